"""Which of the user's modules the calling process reloaded since a World's ranks last
ran: the ranks reload the same ones before the next call (_rank.reloads), so that a
helper module that was edited and reloaded here (``importlib.reload``, IPython's
``%autoreload``) runs as edited in the ranks too, instead of the version they imported
first.

The sign is the module's ``__spec__``: a reload runs the module again in its own module
object and gives it a new spec, and an import after ``del sys.modules[name]`` makes a
new module. Only the user's own source modules are watched, those outside the Python
installation and its site-packages (a few, against the thousand torch brings): each run
compares their specs, and looks at the names ``sys.modules`` gained only when it gained
some. Reading every module's spec at each run took half a millisecond, as much as the
rest of a short run.

Rejected: reloading in the ranks every module whose file changed on disk (what
``%autoreload`` does in one process). The ranks would then run code the calling process
does not, and a World would stat every imported file at each call. A module edited but
not reloaded here stays as the ranks imported it, as it stays here.
"""
from __future__ import annotations

import os
import sys
import types
from importlib.machinery import ModuleSpec
from typing import Any, Dict, List, Set, Tuple

__all__ = ["ModuleWatch"]

# Never reloaded in the ranks: the caller's __main__ travels with each call anyway
# (_wire.mainmod), and mplaunch's own modules run the ranks.
_SKIP = ("__main__", "__mp_main__")


class ModuleWatch:
    """The user's source modules of this process, each with its spec at the last look."""

    def __init__(self) -> None:
        self._known: Set[str] = set()     # every name of sys.modules looked at
        self._mark: Tuple[Any, ...] = ()  # sys.modules' size and last name, then
        self._watched: Dict[str, Tuple[Any, Any]] = {}   # name -> (module, spec)

    def reloaded(self) -> List[str]:
        """The watched modules reloaded since the last call (none at the first), in the
        order this process first imported them."""
        modules = sys.modules
        changed = []
        for name, (module, spec) in list(self._watched.items()):
            now = modules.get(name)
            now_spec = _spec_if_users(name, now)
            if now is module and now_spec is spec:
                continue
            if now_spec is None:
                del self._watched[name]   # gone (imported again, it is looked at anew)
                continue
            changed.append(name)
            self._watched[name] = (now, now_spec)
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
                    self._watched[name] = (module, spec)
        return changed


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
