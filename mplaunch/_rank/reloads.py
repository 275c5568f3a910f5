"""In a World's rank: change the modules the calling process changed (found there by
_engine.modwatch) the same way, before the call they came with loads its payload, so that
the rank runs what the caller runs. Never fails the call: a module that does not reload
is restored as it was and noted, with why, ahead of the call's answer; the World says
which ranks run what (mplaunch._world_notes). Rejected: a call of its own for the
reloads, sent by reference before the run's (before): two trips for one run.

How each module changed in the caller decides what the rank does: reloaded
(``importlib.reload``), the rank reloads it, and objects it made from the old module (an
instance of its class, a function kept in a global) keep the old code, as they do in
the calling process; patched in place (IPython's ``%autoreload``), the rank reloads it
and gives its old functions and classes the new code, as %autoreload does; imported
anew (after ``del sys.modules[name]``), the rank imports it anew.
"""
from __future__ import annotations

import importlib
import sys
import types
import weakref
from typing import Dict, List, Sequence, Tuple


__all__ = ["follow", "reload_modules"]

# How a module changed in the caller, and the kind of the note of one that a rank could
# not change so (_engine.modwatch's names; not imported from there, which the ranks never
# need otherwise).
PATCH, IMPORT, UNFOLLOWED = "patch", "import", "unfollowed"


def follow(changes: Sequence[Tuple[str, str]]) -> List[tuple]:
    """A World's call's `changes`, before its payload is loaded (its function may be
    pickled by reference to a reloaded module). The call's window of interrupts is
    still closed: an interrupt in a module's top would leave it half-run over its old
    namespace (and the modules after it not followed); the World sends it again, and it
    lands in the call's code once the reloads are done (a module whose top never ends
    is a rank the timeout replaces, fresh). A note (UNFOLLOWED, name, None, why) for
    each module this rank runs as it had it."""
    failed = reload_modules(changes)
    return [(UNFOLLOWED, name, None, why) for name, why in failed.items()]


def reload_modules(changes: Sequence[Tuple[str, str]]) -> Dict[str, str]:
    """Change those of the (name, how) `changes` this rank has imported (one it has not
    will be read from its file when it is); {name: why} for each that failed, which
    the rank then runs as it had it."""
    importlib.invalidate_caches()   # a file new since the rank's last import is found
    how = dict(changes)
    failed = {}
    for name in _users_last([n for n in how if n in sys.modules]):
        module = sys.modules[name]
        old = dict(module.__dict__)
        try:
            if how[name] == IMPORT:
                del sys.modules[name]
                importlib.import_module(name)
            else:
                importlib.reload(module)
        except (Exception, SystemExit) as exc:  # noqa: BLE001 - said, the rank goes on
            # As it was, not a mix: a reload that raised half-way has run the module's
            # top down to the error, over the old names.
            sys.modules[name] = module
            module.__dict__.clear()
            module.__dict__.update(old)
            failed[name] = f"{type(exc).__name__}: {exc}"
            continue
        if how[name] == PATCH:
            _patch_old(old, module)
    return failed


# (module, name) -> the functions and classes that name had before each patch that the
# rank still holds: each later patch gives them its code too (a function a cell kept
# before two edits runs the second), as IPython's superreload keeps its old objects.
_patched: Dict[Tuple[str, str], List[weakref.ref]] = {}


def _patch_old(old: dict, module: types.ModuleType) -> None:
    """Give the functions and classes `module` had (`old`, its namespace before the
    reload), and those it had before earlier patches, the code of those that replaced
    them, so that the rank's old objects run the new code, as IPython's %autoreload
    makes the caller's."""
    new = module.__dict__
    for key, before in old.items():
        if getattr(before, "__module__", None) != module.__name__ or \
                not isinstance(before, (types.FunctionType, type)):
            continue
        refs = _patched.setdefault((module.__name__, key), [])
        if not any(ref() is before for ref in refs):
            refs.append(weakref.ref(before))
        after = new.get(key)
        for ref in list(refs):
            had = ref()
            if had is None:
                refs.remove(ref)
            elif had is after:
                continue
            elif isinstance(had, types.FunctionType) and \
                    isinstance(after, types.FunctionType):
                _patch_function(had, after)
            elif isinstance(had, type) and isinstance(after, type):
                _patch_class(had, after)


_FUNCTION_ATTRS = ("__code__", "__defaults__", "__kwdefaults__", "__doc__", "__dict__",
                   "__annotations__")


def _patch_function(old: types.FunctionType, new: types.FunctionType) -> bool:
    """Whether `old` now runs `new`'s code (it cannot where their closures differ)."""
    if old.__code__.co_freevars != new.__code__.co_freevars:
        return False   # its closure's cells are not the new code's
    old.__code__ = new.__code__
    for attr in _FUNCTION_ATTRS[1:]:
        try:
            setattr(old, attr, getattr(new, attr))
        except (AttributeError, TypeError, ValueError):
            pass
    return True


def _patch_class(old: type, new: type, depth: int = 2) -> None:
    """`old`'s methods run `new`'s code, its attributes are `new`'s, and those `new`
    dropped are gone: its instances (the rank's objects) behave as `new`'s."""
    skip = ("__dict__", "__weakref__", "__module__", "__qualname__")
    for key, attr in list(new.__dict__.items()):
        if key in skip:
            continue
        had = old.__dict__.get(key)
        if had is attr:
            continue
        if _same_kind(had, attr) and _patch_method(had, attr, old, depth):
            continue
        try:
            setattr(old, key, _in_class(attr, old))
        except (AttributeError, TypeError):
            pass
    for key in [k for k in old.__dict__ if k not in new.__dict__ and k not in skip]:
        try:
            delattr(old, key)
        except (AttributeError, TypeError):
            pass


def _same_kind(a, b) -> bool:
    return a is not None and type(a) is type(b)


def _patch_method(had, attr, old: type, depth: int) -> bool:
    if isinstance(attr, (staticmethod, classmethod)):
        had, attr = had.__func__, attr.__func__
    if isinstance(attr, types.FunctionType):
        return _patch_function(had, attr)
    if isinstance(attr, property):
        # Each accessor in place, or not at all (a property is read-only).
        pairs = [(getattr(had, f), getattr(attr, f)) for f in ("fget", "fset", "fdel")]
        if all(isinstance(a, types.FunctionType) and isinstance(b, types.FunctionType)
               or a is None and b is None for a, b in pairs):
            return all(_patch_function(a, b) for a, b in pairs if a is not None)
        return False
    if isinstance(attr, type) and depth and attr.__module__ == old.__module__:
        _patch_class(had, attr, depth - 1)
        return True
    return False


def _in_class(attr, old: type):
    """`attr` of the new class as an attribute of `old`: a function whose ``super()``
    refers to the new class (its ``__class__`` cell) is made again to refer to `old`."""
    wrap = type(attr) if isinstance(attr, (staticmethod, classmethod)) else None
    func = attr.__func__ if wrap is not None else attr
    if not isinstance(func, types.FunctionType) or \
            "__class__" not in func.__code__.co_freevars:
        return attr
    cells = tuple(types.CellType(old) if name == "__class__" else cell
                  for name, cell in zip(func.__code__.co_freevars, func.__closure__ or ()))
    made = types.FunctionType(func.__code__, func.__globals__, func.__name__,
                              func.__defaults__, cells)
    made.__kwdefaults__, made.__dict__ = func.__kwdefaults__, func.__dict__
    made.__qualname__, made.__doc__ = func.__qualname__, func.__doc__
    return wrap(made) if wrap is not None else made


def _users_last(names: List[str]) -> List[str]:
    """`names` ordered so that a module comes after those of them it took names from
    (``from helper import f`` must see the reloaded helper); otherwise kept in order."""
    modules = {n: sys.modules[n] for n in names}

    def uses(a: str, b: str) -> bool:
        target = modules[b]
        for value in list(vars(modules[a]).values()):
            if value is target:
                return True
            if isinstance(value, (types.FunctionType, type)) and \
                    getattr(value, "__module__", None) == b:
                return True
        return False

    done: List[str] = []
    visiting = set()

    def visit(name: str) -> None:
        if name in done or name in visiting:
            return   # (a cycle: the order given breaks it)
        visiting.add(name)
        for other in names:
            if other != name and uses(name, other):
                visit(other)
        visiting.discard(name)
        done.append(name)

    for name in names:
        visit(name)
    return done
