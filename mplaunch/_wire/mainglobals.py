"""Which names of a rank's `__main__` follow the calling process, and which are the
rank's own.

A function from the caller's `__main__` travels with the globals it names, at the
caller's values (cloudpickle), and loading it puts them into the rank's `__main__`. A
rank that runs one call (`launch`, `start`) needs nothing more. A World's rank runs many
and keeps what its code built: ``global model; model = Net()`` in one run is ``model``
in the next. There the caller's values must not land on every name: the placeholder
``model = None`` at the top of a script (or in a notebook cell) would undo the rank's
model at every call, and nothing would say why.

The rule, per name:

- a name the rank's own code bound (a function's ``global`` assignment, a ``%%ranks``
  cell, ``globals()[...]``) belongs to the rank: the caller's value does not replace
  it, and the caller is told once per name where the two differ (`take_kept`, sent as
  ``_wire.messages.KeptGlobals``);
- every other name follows the caller, as it always did: a constant changed in a cell
  and run again arrives;
- a class or function that the caller's `__main__` defines under that very name always
  follows the caller (a function redefined in a cell is the common case): the caller
  says which names those are, at pickling time (`function_reduce`);
- `push` (``%ranks push``) replaces a name on purpose, and the name follows the caller
  again until the rank binds it anew; a name the rank deleted follows the caller again;
- a name the caller deleted, that a function it sends names, is deleted in the rank too
  where it still holds the caller's object (`launch` would raise NameError there): the
  caller says which names its functions name but it lacks (`function_reduce`).

How the rank tells its own names: the ledger remembers, for each name, the object it
last put there from the caller. After each call, a name that no longer holds that very
object was bound by the rank; so was one that the code the call ran assigns, which
catches ``model = model.to(device)``, a rebinding to the same object. That code is:

- the call's function, and every function of the caller's `__main__` that the call
  brought, wherever it was (an argument, the closure of a decorator such as
  ``@torch.no_grad()`` or one made with `functools.wraps`, an object's class): the
  rank's load notes each as it makes it (`function_setstate`), so no object of the
  payload is searched for them;
- a ``%%ranks`` cell's statements;
- the functions and classes of the rank's `__main__` that this code reads as globals,
  and theirs; the functions a decorator wraps (``__wrapped__``, closures). Only a name
  read as a global counts: ``opt.step()`` is not a use of a function ``step``.

What it assigns: ``global`` statements (STORE_GLOBAL), a cell's own assignments, and
``globals()["name"] = ...`` with the name written out. Code that binds a name another
way (``globals().update(...)``, ``setattr`` on the module, ``exec`` of a string, another
module's code) is seen only by identity: where it binds the very object the caller sent
(a small int, None, the model it sent), the name stays the caller's; docs/world.rst says
so.
Identity and assignment, not equality: an object the rank changes in place
(``history.append(x)``) is still the caller's, and the caller's next copy replaces it,
as before; but not a torch module, optimizer, LR scheduler or tensor that the caller
still holds unchanged (a model and its optimizer built in a notebook's cell and
stepped by a run, ``opt.step()``: each run started training again, silently). For
those the caller sends, with each name, a fingerprint (`_state`): the object's identity
here (a serial number, `_token`: ids are reused), its tensors' ids, version counters and
storage, its modules' train/eval mode, its hyperparameters. Where the caller's object
is the one whose copy the rank holds, unchanged since, the rank keeps its copy, changed
in place or not, and the caller's new copy is dropped; where the caller rebound the
name or changed the object, the rank takes it, and where the rank had changed its copy
the caller is told that this was lost (``replaced``), once per object of the caller's.
Objects that share tensors (an optimizer holds its model's parameters; a scheduler its
optimizer) are kept or taken together, or the rank's optimizer would step a model that
is no longer its `__main__`'s; so is a kept object that anything else the call brought
holds (an argument, a dict, a trainer of the user's): those hold the caller's copy.
A name the rank's own code bound is said once per object of the caller's, not once
per name: another model here under that name is said again.

Rejected: ipyparallel's ``@interactive`` way, where a function resolves every global in
the engine's namespace and nothing travels unless pushed: mplaunch's functions run with
the caller's constants and helpers without a push (in `launch` as in a World), and users
rely on it. Rejected too: telling changes by comparing values (``==`` on arbitrary
objects, tensors among them, is neither cheap nor a truthful bool) or by keeping a
snapshot of each value sent (a second copy of every global), and watching the
namespace's writes: a module's namespace is a plain dict, whose ``STORE_GLOBAL`` no
``__setitem__`` sees, and CPython's dict watchers are for C code only.
"""
from __future__ import annotations

import functools
import gc
import itertools
import opcode
import sys
import types
import weakref
from typing import Dict, Iterable, List, Optional, Set

__all__ = ["track", "function_reduce", "function_setstate", "install", "push",
           "cell_runs", "settle", "take_kept"]

_MISSING = object()
# Values whose == is plain data comparison, safe to call and a real bool: where the
# rank's value and the caller's are equal, keeping the rank's changes nothing worth
# saying. (Any other type is said to differ: no user __eq__ runs here.)
_PLAIN = (type(None), bool, int, float, complex, str, bytes, tuple, list, dict, set,
          frozenset)


class _Ledger:
    __slots__ = ("namespace", "given", "told", "kept", "brought", "prints", "own",
                 "since", "loads", "spared")

    def __init__(self, namespace: dict):
        self.namespace = namespace
        self.given: Dict[str, object] = {}   # name -> the caller's object put there last
        self.told: set = set()               # (name, the caller's token) reported
        # What to report after this load: (kind, name, the caller's token, why).
        self.kept: List[tuple] = []
        # The code this call brought: the caller's `__main__` functions its payload
        # held, the code of the %%ranks cells it runs. Kept until `settle` reads it.
        self.brought: list = []
        # The torch objects among `given` (see the module's docstring): name -> the
        # (token, state) the caller sent with it, its own state's digest when it came,
        # and the load it came with (`loads` counts them).
        self.prints: Dict[str, tuple] = {}
        self.own: Dict[str, int] = {}
        self.since: Dict[str, int] = {}
        self.loads = 0
        # name -> the caller's copy this load brought and did not install, the rank's
        # staying: dropped at the load's end (`take_kept`).
        self.spared: Dict[str, object] = {}


_ledger: Optional[_Ledger] = None


def track(namespace: dict) -> None:
    """In a rank: `namespace` (its `__main__`'s) is the one whose names are kept apart;
    the same namespace keeps its ledger from call to call."""
    global _ledger
    if _ledger is None or _ledger.namespace is not namespace:
        _ledger = _Ledger(namespace)


def function_reduce(rv, defined: Iterable[str], missing: Iterable[str] = ()):
    """cloudpickle's reduction `rv` of a function of the caller's `__main__`, rewritten
    so that the rank installs the function's globals through `install` (`defined`: the
    names among them that the caller's `__main__` defines as that class or function;
    `missing`: the globals the function's code names that the caller's `__main__` does
    not hold, deleted or never made). Any other shape of `rv` is returned as it is."""
    if type(rv) is not tuple or len(rv) != 6 or rv[5] is None:
        return rv
    make, args, state, items, pairs, setter = rv
    defined = tuple(defined)
    return (make, args, (setter, state, defined, tuple(missing), _prints(state, defined)),
            items, pairs, function_setstate)


def _prints(state, defined: tuple) -> dict:
    """{name: (token, state)} of the globals in cloudpickle's `state` of a function: who
    each object is here (`_token`) and, for a torch object, what it holds (`_state`)."""
    try:
        named = state[1]["__globals__"]
    except (TypeError, LookupError):
        return {}
    return {k: (_token(v), _state(v)) for k, v in named.items()
            if k not in defined and not _dunder(k)}


def function_setstate(func, packed) -> None:
    """The rank's side of `function_reduce`: cloudpickle's own state setter, given no
    globals, then the globals through the ledger; the function is noted as code this
    call brought (`settle` reads what it assigns, wherever the payload held it)."""
    setter, state, defined, missing, prints = packed
    inner, slots = state
    values = slots.get("__globals__") or {}
    slots["__globals__"] = {}
    setter(func, (inner, slots))
    ledger = _ledger
    if ledger is not None and func.__globals__ is ledger.namespace:
        ledger.brought.append(func)
    install(func.__globals__, values, defined, missing, prints)


def install(namespace: dict, values: dict, defined: Iterable[str] = (),
            missing: Iterable[str] = (), prints: Optional[dict] = None) -> None:
    """Put the caller's `values` into `namespace`, but not over a name the rank's own
    code bound (see the module's docstring), nor over a torch object the rank holds
    a copy of that the caller did not change since (`prints`: `_prints`); `defined`
    names always go in. The `missing` names (the caller has none) leave `namespace`
    where they still hold the caller's object: the rank's own stay."""
    ledger = _ledger
    if ledger is None or namespace is not ledger.namespace:
        namespace.update(values)   # a namespace nobody ran code in yet: all of it
        return
    given, defined = ledger.given, set(defined)
    for name in missing:
        obj = given.get(name, _MISSING)
        if obj is not _MISSING and namespace.get(name, _MISSING) is obj:
            del namespace[name], given[name]
            _forget(ledger, name)
    for name, value in values.items():
        current = namespace.get(name, _MISSING)
        token, state = prints.get(name, (None, None)) if prints else (None, None)
        if (current is not _MISSING and current is not given.get(name, _MISSING)
                and name not in defined and not _dunder(name)):
            if (name, token) not in ledger.told and _differ(current, value):
                ledger.told.add((name, token))
                ledger.kept.append(("kept", name, token, None))
            continue
        if current is value:
            continue   # a second function of this load that names it
        why = None
        if (state is not None and current is not _MISSING and name not in defined
                and ledger.prints.get(name) == (token, state)):
            # The caller's object is the one the rank's copy came from, unchanged:
            # the copy stays, with what the rank changed in it, unless an object it
            # shares tensors with came later (the two would no longer be linked).
            other = _taken_after(ledger, name)
            if other is None:
                ledger.spared[name] = value
                continue
            why = "shares:" + other
        _take(ledger, name, value, token, state, why)


def _take(ledger: _Ledger, name: str, value, token, state, why=None) -> None:
    """The caller's `value` goes in under `name`; where a copy the rank had changed in
    place goes, that is reported. Spared copies that share tensors with it follow."""
    namespace, prints = ledger.namespace, ledger.prints
    old, own, before = (namespace.get(name, _MISSING), ledger.own.get(name),
                        prints.get(name))
    if own is not None and old is ledger.given.get(name, _MISSING) and \
            _digest(old) != own:
        if why is None:
            why = "changed" if before is not None and before[0] == token else "new"
        ledger.kept.append(("replaced", name, token, why))
    namespace[name] = ledger.given[name] = value
    _forget(ledger, name)
    if state is None:
        return
    prints[name], ledger.own[name] = (token, state), _digest(value)
    ledger.since[name] = ledger.loads
    ids = set(state[1])
    for other in [n for n in ledger.spared if not ids.isdisjoint(prints[n][1][1])]:
        if other in ledger.spared:   # not taken meanwhile, by the recursion
            _take(ledger, other, ledger.spared.pop(other), *prints[other],
                  why="shares:" + name)


def _taken_after(ledger: _Ledger, name: str) -> Optional[str]:
    """A name whose torch object shares tensors with `name`'s and came to the rank
    with a later load (or earlier in this one), if any."""
    ids, since = set(ledger.prints[name][1][1]), ledger.since[name]
    for other, (_, state) in ledger.prints.items():
        if ledger.since[other] > since and not ids.isdisjoint(state[1]):
            return other
    return None


def _forget(ledger: _Ledger, name: str) -> None:
    ledger.prints.pop(name, None)
    ledger.own.pop(name, None)
    ledger.since.pop(name, None)


def push(namespace: dict, values: dict) -> None:
    """``%ranks push``: the caller's values, over the rank's own on purpose; the names
    follow the caller again (until the rank's code binds them anew)."""
    namespace.update(values)
    ledger = _ledger
    if ledger is not None and namespace is ledger.namespace:
        ledger.given.update(values)
        for name, value in values.items():
            # Not from a run: the next run's object replaces it, said if the rank
            # changed this one in place meanwhile.
            _forget(ledger, name)
            digest = _digest(value)
            if digest is not None:
                ledger.own[name] = digest


def cell_runs(code) -> None:
    """A ``%%ranks`` cell's code is about to run in the rank's `__main__` (_rank.cells):
    `settle` reads what it assigns. (Not in the notebook, which compiles it too.)"""
    if _ledger is not None:
        _ledger.brought.append(code)


def settle(func=None) -> None:
    """After a call of `func`: the names the code it ran or brought assigned, or that no
    longer hold the caller's object, are the rank's from now on; the caller's objects
    they held are forgotten, so that they are freed now rather than at the next call."""
    ledger = _ledger
    if ledger is None:
        return
    namespace, given = ledger.namespace, ledger.given
    runs, ledger.brought = [f for f in (func, *ledger.brought) if f is not None], []
    ledger.spared.clear()   # a load that did not end: nothing of it stays
    for name in [n for n, obj in given.items() if namespace.get(n, _MISSING) is not obj]:
        del given[name]
        _forget(ledger, name)
    if given and runs:
        try:
            assigned = _assigned_by(runs, namespace, set(given))
        except Exception:  # noqa: BLE001 - odd code or objects: identity alone decides
            assigned = set()
        for name in assigned:
            del given[name]
            _forget(ledger, name)


def take_kept() -> List[tuple]:
    """At the end of a load (before the call runs): what the caller is told of it,
    (kind, name, the caller's token, why): ``kept``, a name the rank's own code bound
    kept over the caller's value (once per name and caller's object in the rank's
    life); ``replaced``, a torch object the rank had changed in place, replaced by the
    caller's (why: ``new``, ``changed``, ``shares:NAME``, ``held``). The caller's
    copies that the rank did not install are dropped, but those that something else
    the load brought holds (an argument, a dict): the rank takes those instead."""
    ledger = _ledger
    if ledger is None:
        return []
    if ledger.spared:
        try:
            held = _held_elsewhere(ledger)
        except Exception:  # noqa: BLE001 - cannot tell: the caller's copies, as before
            held = list(ledger.spared)
        for name in held:
            if name in ledger.spared:
                _take(ledger, name, ledger.spared.pop(name), *ledger.prints[name],
                      why="held")
        ledger.spared.clear()
    ledger.loads += 1
    kept, ledger.kept = ledger.kept, []
    return kept


def _held_elsewhere(ledger: _Ledger) -> List[str]:
    """The names of `spared` whose copy something of the load holds besides the spared
    copies themselves (each other, what they hold): another global (a trainer, a dict),
    an argument. Told by reference counts: each copy's, less the references that the
    spared copies' own objects hold to it (their walk stops at classes, modules and
    functions, which lead everywhere), against a probe's, which only this function
    holds as it holds the copies. No search of the payload or of the heap, and only the
    top of each copy: a model's thousand modules are not walked."""
    spared = ledger.spared
    spared[""] = object()   # the probe ("": no global's name), held only here
    try:
        pairs = list(spared.items())
        inner = {id(copy): 0 for _, copy in pairs}
        seen = {id(spared), id(pairs)}
        todo = [(copy, 0) for _, copy in pairs]
        while todo:
            obj, depth = todo.pop()
            if id(obj) in seen or isinstance(obj, _OPAQUE):
                continue
            seen.add(id(obj))
            for ref in gc.get_referents(obj):
                if id(ref) in inner:
                    inner[id(ref)] += 1
                if depth < _DEPTH:
                    todo.append((ref, depth + 1))
        del todo, obj
        counts = {name: sys.getrefcount(copy) - inner[id(copy)] for name, copy in pairs}
    finally:
        del spared[""]
    base = counts.pop("")
    return [name for name, count in counts.items() if count > base]


_OPAQUE = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType,
           types.CodeType)
# How deep a copy's references to the others are looked for: its attributes' dict, the
# attributes, theirs (a scheduler's optimizer, an optimizer's patched ``step``). One
# deeper is taken for a holder of its own: the copies are then taken, as before.
_DEPTH = 2


def _dunder(name: str) -> bool:
    # __file__, __builtins__ ...: the module's own attributes, not the user's state
    return name.startswith("__") and name.endswith("__")


# -- torch objects: who the caller's object is, and what it holds -------------------

_SCALARS = (type(None), bool, int, float, complex, str, bytes)
_serials: Dict[int, tuple] = {}    # id -> (a weak reference to the object, its serial)
_counter = itertools.count(1)


def _token(value):
    """Who `value` is in the caller, for as long as it lives: a serial number (an id
    is reused by the next object), or for a scalar its hash (the same value is the
    same), or where no weak reference can be made (a list), its id."""
    if type(value) in _SCALARS:
        return ("=", hash(value))
    key = id(value)
    entry = _serials.get(key)
    if entry is not None and entry[0]() is value:
        return entry[1]
    try:
        ref = weakref.ref(value, functools.partial(_unserial, key))
    except TypeError:
        return ("id", key)
    serial = next(_counter)
    _serials[key] = (ref, serial)
    return serial


def _unserial(key: int, ref) -> None:
    entry = _serials.get(key)
    if entry is not None and entry[0] is ref:
        del _serials[key]


def _state(value):
    """(a digest of what can change in place, the ids of its tensors) of a torch
    module, optimizer, LR scheduler or tensor: the tensors' ids, version counters
    (every in-place change bumps them), storage and requires_grad; a module's
    train/eval modes; an optimizer's hyperparameters and state; a scheduler's
    attributes. None for any other object, or one that cannot be read so."""
    torch = sys.modules.get("torch")
    if torch is None or type(value) in _SCALARS:
        return None
    try:
        if isinstance(value, torch.Tensor):
            tensors, extra = [value], ()
        elif isinstance(value, torch.nn.Module):
            tensors = [*value.parameters(), *value.buffers()]
            extra = tuple(m.training for m in value.modules())
        elif isinstance(value, torch.optim.Optimizer):
            tensors = [p for g in value.param_groups for p in g["params"]]
            extra = (tuple(_plain(v) for g in value.param_groups
                           for k, v in sorted(g.items()) if k != "params"),
                     tuple(_plain(v) for s in value.state.values() for v in s.values()))
        elif isinstance(value, _schedulers(torch)):
            tensors = [p for g in value.optimizer.param_groups for p in g["params"]]
            extra = tuple(_plain(v) for k, v in sorted(vars(value).items())
                          if k != "optimizer")
        else:
            return None
        seen = tuple((id(t), t._version, t.data_ptr(), t.requires_grad) for t in tensors)
        return hash((seen, extra)), tuple(id(t) for t in tensors)
    except Exception:  # noqa: BLE001 - an inference tensor, a sparse one: untracked
        return None


def _digest(value) -> Optional[int]:
    state = _state(value)
    return None if state is None else state[0]


def _schedulers(torch) -> tuple:
    lr = torch.optim.lr_scheduler
    return tuple(c for c in (getattr(lr, "LRScheduler", None),
                             getattr(lr, "_LRScheduler", None),
                             getattr(lr, "ReduceLROnPlateau", None)) if c is not None)


def _plain(value):
    """A hashable stand-in for `value` that changes when it does, as far as a look
    at it can tell: scalars as they are, a tensor's id and version, others' ids."""
    if type(value) in _SCALARS:
        return value
    if type(value) in (list, tuple):
        return tuple(_plain(v) for v in value)
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        return id(value), value._version
    return "id", id(value)


def _differ(current, value) -> bool:
    if current is value:
        return False
    if type(current) is not type(value) or type(current) not in _PLAIN:
        return True
    try:
        return not bool(current == value)
    except Exception:  # noqa: BLE001 - a container of tensors, say
        return True


_STORE_GLOBAL = opcode.opmap["STORE_GLOBAL"]
_STORE_NAME = opcode.opmap["STORE_NAME"]
_STORE_SUBSCR = opcode.opmap["STORE_SUBSCR"]
_LOAD_CONST = opcode.opmap["LOAD_CONST"]
_LOAD_GLOBAL = opcode.opmap["LOAD_GLOBAL"]
# Since 3.11 LOAD_GLOBAL's argument is the name's index times two (plus a flag).
_LOAD_GLOBAL_SHIFT = 1 if sys.version_info >= (3, 11) else 0
# Reads that fall through to the module's namespace: a module's or class body's names,
# and (3.12) a class body's in a function or with type parameters.
_LOAD_NAMES = frozenset(opcode.opmap[n] for n in ("LOAD_NAME",
                                                  "LOAD_FROM_DICT_OR_GLOBALS")
                        if n in opcode.opmap)
_EXTENDED_ARG = opcode.EXTENDED_ARG
_MAIN_NAMES = ("__main__", "__mp_main__")   # as _wire.mainmod.MAIN_NAMES (which imports us)
# What a global, a closure or a ``__wrapped__`` may hold that leads to code to read.
_FOLLOWED = (types.FunctionType, types.MethodType, functools.partial, staticmethod,
             classmethod, property)


def _assigned_by(runs, namespace: dict, wanted: Set[str]) -> Set[str]:
    """The names of `wanted` that the code in `runs` assigns: a function's ``global``
    statements and ``globals()["name"] = ...``, a ``%%ranks`` cell's assignments (a code
    object run in `namespace`), and those of the functions and classes of `namespace`
    that they read as globals, and of theirs; a decorated function's, wherever the
    decorator came from (``__wrapped__``, a closure). Code that may not have run counts
    too: a function that declares ``global best`` and assigns it makes ``best`` state
    of the process it runs in."""
    found: Set[str] = set()
    seen: Set[int] = set()
    todo = list(runs)
    while todo:
        obj = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, functools.partial):
            todo.append(obj.func)
        elif isinstance(obj, (types.MethodType, staticmethod, classmethod)):
            todo.append(obj.__func__)
        elif isinstance(obj, property):
            todo.extend(f for f in (obj.fget, obj.fset, obj.fdel) if f is not None)
        elif isinstance(obj, type):
            if obj.__module__ in _MAIN_NAMES:
                todo.extend(vars(obj).values())
        elif isinstance(obj, (types.FunctionType, types.CodeType)):
            cell = isinstance(obj, types.CodeType)
            if not cell:
                # A decorator's function (torch.no_grad's is torch's own) holds the
                # decorated one in its closure; functools.wraps names it too.
                todo.extend(_wrapped(obj))
                if obj.__globals__ is not namespace:
                    continue   # another module's: its globals are not __main__'s
            for code in _codes(obj if cell else obj.__code__):
                # A cell's own statements bind names with STORE_NAME (a module's code);
                # in the functions and classes it defines, that is a local or a class
                # attribute.
                stores, loads = _scan(code, namespace, wanted, cell and code is obj)
                found |= stores
                todo.extend(namespace[name] for name in loads)
        else:
            todo.extend(_wrapped(obj))   # functools.lru_cache's wrapper, say
    return found


def _wrapped(obj) -> list:
    """The callables a decorator's result `obj` holds: its ``__wrapped__`` (read from
    its own dict: no descriptor or ``__getattr__`` runs) and, for a function, its
    closure's."""
    found = []
    wrapped = _own_dict(obj).get("__wrapped__")
    if wrapped is not None:
        found.append(wrapped)
    if type(obj) is types.FunctionType and obj.__closure__:
        for cell in obj.__closure__:
            try:
                value = cell.cell_contents
            except ValueError:   # empty
                continue
            if isinstance(value, _FOLLOWED):
                found.append(value)
    return found


def _own_dict(obj) -> dict:
    # The object's own attributes, read without running its __getattr__ or a property.
    try:
        own = object.__getattribute__(obj, "__dict__")
    except Exception:  # noqa: BLE001 - no __dict__, or an odd one
        return {}
    return own if type(own) is dict else {}


def _codes(code):
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _codes(const)


def _followed(value, namespace: dict) -> bool:
    """Whether a global holding `value` leads to code that may assign `__main__`'s
    names: a function of `__main__`, one that wraps another (a decorator's), a class of
    `__main__`. Another module's plain function does not, nor does any other object."""
    if type(value) is types.FunctionType:
        return (value.__globals__ is namespace or value.__closure__ is not None
                or "__wrapped__" in value.__dict__)
    if isinstance(value, type):
        return value.__module__ in _MAIN_NAMES
    return isinstance(value, _FOLLOWED) or "__wrapped__" in _own_dict(value)


def _scan(code, namespace: dict, wanted: Set[str], module_level: bool):
    """(the names of `wanted` that `code` assigns in its module, the names it reads
    from there that hold functions or `__main__` classes). The bytecode is read only
    where `code`'s names or constants could give an answer: most code costs a set test
    and a few look-ups."""
    names = code.co_names
    candidates = [n for n in names if _followed(namespace.get(n), namespace)]
    subscripts = "globals" in names and any(
        type(c) is str and c in wanted for c in code.co_consts)
    if not candidates and not subscripts and wanted.isdisjoint(names):
        return set(), ()
    stores_ops = (_STORE_GLOBAL, _STORE_NAME) if module_level else (_STORE_GLOBAL,)
    consts, count = code.co_consts, len(names)
    stores, loads, keys = set(), set(), set()
    raw, extended, const = code.co_code, 0, None
    for i in range(0, len(raw), 2):
        op, arg = raw[i], raw[i + 1] | extended
        if op == _EXTENDED_ARG:
            extended = arg << 8
            continue
        extended = 0
        if op in stores_ops:
            if arg < count:
                stores.add(names[arg])
        elif op == _LOAD_GLOBAL:
            arg >>= _LOAD_GLOBAL_SHIFT
            if arg < count:
                loads.add(names[arg])
        elif op in _LOAD_NAMES:
            if arg < count:
                loads.add(names[arg])
        elif op == _STORE_SUBSCR and type(const) is str:
            keys.add(const)   # x["name"] = ...: the namespace's when x is globals()
        const = consts[arg] if op == _LOAD_CONST and arg < len(consts) else None
    if "globals" in loads:
        stores |= keys
    return stores & wanted, [n for n in candidates if n in loads]
