"""Which of the user's modules changed in the calling process since a World's ranks
last ran, and how: the ranks then change them the same way before the next call
(_rank.reloads), so that a helper module that was edited and reloaded here runs as
edited in the ranks too, instead of the version they imported first.

A module changes here in three ways, each told by its own sign:

- ``importlib.reload`` (and IPython's ``%autoreload --full``, which calls it) runs the
  module again in its own module object and gives it a new ``__spec__``;
- IPython's ``%autoreload`` in its default mode (deduperreload) runs only the changed
  definitions, into the functions and classes the module has: the spec stays, the
  file's (mtime, size) and the code of those functions change;
- ``del sys.modules[name]`` and an import make a new module object.

A new spec alone is not enough: a reload that raised before it ran anything (a
SyntaxError) sets it too, and the module runs what it ran before. So the sign that
counts is what the module's namespace holds: each name's object and, for a function or
a class, its code (the ``__code__`` of each function; identities, compared with
``is``, never the objects kept: a large module-level array is not held after a
reload). It is read only where the spec, the module or the file changed; a file that
changed while the namespace did not was edited, not run here, and the ranks keep what
they run, as this process does.

Where the module was patched in place (deduperreload, or %autoreload's superreload,
which also patches the old objects), the ranks patch their old objects too: "patch";
a module run again in its object: "reload"; a new module object: "import".

Only the user's own source modules are watched, those outside the Python installation
and its site-packages (a few, against the thousand torch brings): each run compares
their module and spec by identity, and looks at the names ``sys.modules`` gained only
when it gained some. Reading every module's spec at each run took half a millisecond,
as much as the rest of a short run. Their files are looked at (a stat each) only in a
process where deduperreload was imported: a stat is some microseconds, 20 modules took
80-160 us a run on a busy machine, and nothing else changes a module without a new
spec (a function assigned into a module here by hand is not a reload, and is not
followed).

Rejected: reloading in the ranks every module whose file changed on disk (what
``%autoreload`` does in one process). The ranks would then run code the calling process
does not. A module edited but not run here stays as the ranks imported it, as it stays
here.
"""
from __future__ import annotations

import os
import sys
import types
from importlib.machinery import ModuleSpec
from typing import Any, Dict, List, Optional, Set, Tuple

__all__ = ["ModuleWatch", "RELOAD", "PATCH", "IMPORT", "UNFOLLOWED"]

# How a module changed here, and so how the ranks change theirs (_rank.reloads).
RELOAD = "reload"   # run again in its module object
PATCH = "patch"     # run again, and its old functions and classes given the new code
IMPORT = "import"   # a new module object
# The kind of a rank's note (ahead of its answer) of a module it could not change so:
# (UNFOLLOWED, name, None, why), as _rank.reloads.follow makes it.
UNFOLLOWED = "unfollowed"

# IPython's %autoreload in its default mode since IPython 9
_DEDUPER = "IPython.extensions.deduperreload.deduperreload"

# Never reloaded in the ranks: the caller's __main__ travels with each call anyway
# (_wire.mainmod), and mplaunch's own modules run the ranks.
_SKIP = ("__main__", "__mp_main__")


class _Seen:
    """A watched module as it was when the ranks last followed it."""
    __slots__ = ("module", "spec", "origin", "stat", "sign")

    def __init__(self, module, spec, origin: str) -> None:
        self.module = module
        self.spec = spec
        self.origin = origin
        self.stat = _stat(origin)
        self.sign = _sign(module)


class ModuleWatch:
    """The user's source modules of this process, each as the ranks last followed it."""

    def __init__(self) -> None:
        self._known: Set[str] = set()     # every name of sys.modules looked at
        self._mark: Tuple[Any, ...] = ()  # sys.modules' size and last name, then
        self._watched: Dict[str, _Seen] = {}
        self._again: List[Tuple[str, str]] = []   # said again (again())

    def again(self, changes: List[Tuple[str, str]]) -> None:
        """`changes` went down with a call that failed: a rank that was not sent it, or
        was interrupted before it followed, runs what it had. The next reloaded() says
        them again (reloading a module a rank followed already runs its top again, as a
        second reload here would)."""
        self._again = list(dict(list(changes) + self._again).items())

    def reloaded(self) -> List[Tuple[str, str]]:
        """(name, how) of each watched module that changed since the last call (none at
        the first), in the order this process first imported them; how is RELOAD,
        PATCH or IMPORT."""
        modules = sys.modules
        changed, self._again = self._again, []
        # Only deduperreload patches a module without a new spec: where it was never
        # imported, no file is looked at.
        patcher = _DEDUPER in modules
        for name, seen in list(self._watched.items()):
            now = modules.get(name)
            if now is seen.module:
                spec = now.__dict__.get("__spec__")
                if spec is seen.spec:
                    if not patcher:
                        continue
                    stat = _stat(seen.origin)
                    if stat == seen.stat:
                        continue              # the common case: nothing to read
                    sign = _sign(now)
                    if _same(sign, seen.sign):
                        continue   # edited, not run here (looked at again next time)
                    how = PATCH    # run here without a reload: deduperreload
                elif _spec_if_users(name, now) is None:
                    del self._watched[name]
                    continue
                else:
                    sign = _sign(now)
                    if _same(sign, seen.sign):
                        # The reload raised before it ran anything: this process runs
                        # what it ran, and so do the ranks.
                        seen.spec = spec
                        continue
                    how = PATCH if _autoreload_patches() else RELOAD
                    seen.origin = spec.origin
                    stat = _stat(seen.origin)
                changed.append((name, how))
                seen.spec, seen.stat, seen.sign = spec, stat, sign
                continue
            spec = _spec_if_users(name, now)
            if spec is None:
                del self._watched[name]   # gone (imported again, it is looked at anew)
                continue
            changed.append((name, IMPORT))
            self._watched[name] = _Seen(now, spec, spec.origin)
        # A name sys.modules gains goes at its end: while its size and last name are
        # the same, it has gained none (a module deleted and imported again is watched
        # by name above).
        mark = (len(modules), next(reversed(modules), None))
        if mark != self._mark:
            self._mark = mark
            names = modules.keys()
            self._known &= names
            for name in names - self._known:
                self._known.add(name)
                module = modules.get(name)
                spec = _spec_if_users(name, module)
                if spec is not None:
                    self._watched[name] = _Seen(module, spec, spec.origin)
        return list(dict(changed).items())   # a name said again and changed again: once


def _stat(path: str) -> Optional[Tuple[int, int]]:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_mtime_ns, st.st_size


def _sign(module) -> Dict[str, Tuple[Any, ...]]:
    """What `module`'s namespace runs: {name: (id of its object, the code of each
    function in it)}, dunder names left out (a failed reload sets them too)."""
    name = module.__dict__.get("__name__")
    return {key: (id(value),) + _codes(value, name, 2)
            for key, value in list(module.__dict__.items())
            if not (key.startswith("__") and key.endswith("__"))}


def _codes(value, module_name, depth: int) -> Tuple[Any, ...]:
    """The code objects `value` runs: a function's, or those of a class of the module
    (its methods, properties and nested classes, `depth` levels down)."""
    if isinstance(value, (staticmethod, classmethod)):
        value = value.__func__
    if isinstance(value, types.FunctionType):
        return (value.__code__,)
    if isinstance(value, property):
        return tuple(f.__code__ if isinstance(f, types.FunctionType) else id(f)
                     for f in (value.fget, value.fset, value.fdel))
    if isinstance(value, type) and depth and \
            value.__dict__.get("__module__") == module_name:
        out: Tuple[Any, ...] = ()
        for key, attr in list(value.__dict__.items()):
            if key not in ("__dict__", "__weakref__", "__doc__"):
                out += (key, id(attr)) + _codes(attr, module_name, depth - 1)
        return out
    return ()


def _same(a: Dict[str, Tuple[Any, ...]], b: Dict[str, Tuple[Any, ...]]) -> bool:
    """Whether two signs are of the same objects and code (by identity)."""
    if a.keys() != b.keys():
        return False
    for key, these in a.items():
        those = b[key]
        if len(these) != len(those) or \
                not all(x is y or type(x) in (int, str) and x == y
                        for x, y in zip(these, those)):
            return False
    return True


def _autoreload_patches() -> bool:
    """Whether IPython's %autoreload is on in this process: its reloads (superreload,
    deduperreload) give the old functions and classes the new code, and the ranks are
    to do the same. Read from IPython's own objects, where they are as IPython 8 and 9
    make them; otherwise a plain reload is assumed."""
    if "IPython.extensions.autoreload" not in sys.modules:
        return False
    try:
        shell = sys.modules["IPython"].get_ipython()
        magics = shell.magics_manager.registry["AutoreloadMagics"]
        return bool(magics._reloader.enabled)
    except Exception:  # noqa: BLE001 - another IPython, or none running
        return False


def _spec_if_users(name: str, module):
    """`module`'s spec if it is one of the user's source modules, else None."""
    if not isinstance(module, types.ModuleType) or name in _SKIP \
            or name == "mplaunch" or name.startswith("mplaunch."):
        return None
    # The module's own dict: no module __getattr__ (lazy modules) runs.
    spec = module.__dict__.get("__spec__")
    try:
        origin = spec.origin if isinstance(spec, ModuleSpec) else None
    except Exception:  # noqa: BLE001 - an odd spec: not one of the user's modules
        return None
    if not (isinstance(origin, str) and origin.endswith(".py")) or \
            origin.startswith(_installed()):
        return None
    return spec


_roots: Tuple[str, ...] = ()


def _installed() -> Tuple[str, ...]:
    """The folders of the Python installation and its site-packages, as given and as
    resolved (a virtual environment links to its base)."""
    global _roots
    if not _roots:
        import site
        import sysconfig
        paths = sysconfig.get_paths()
        roots = {paths.get(k) for k in ("stdlib", "platstdlib", "purelib", "platlib")}
        try:
            roots.update(site.getsitepackages())
            roots.add(site.getusersitepackages())
        except AttributeError:   # an old virtualenv's site module
            pass
        roots |= {os.path.realpath(r) for r in roots if r}
        _roots = tuple(os.path.join(r, "") for r in roots if r)
    return _roots
