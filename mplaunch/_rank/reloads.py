"""In a World's rank: reload the modules the calling process reloaded (found there by
_engine.modwatch), before the call that follows, so that the rank runs what the caller
runs. mplaunch's own call, sent by reference, that never fails the run: a module that
does not reload is reported, and the rank keeps the version it had.

Objects the rank made from the old module (an instance of its class, a function kept
in a global) keep the old code, as they do in the calling process after a reload.
"""
from __future__ import annotations

import importlib
import sys
import types
from typing import Dict, List, Sequence

__all__ = ["reload_modules"]


def reload_modules(names: Sequence[str]) -> Dict[str, str]:
    """Reload those of `names` this rank has imported (one it has not will be read from
    its file when it is); {name: why} for each that failed."""
    importlib.invalidate_caches()   # a file new since the rank's last import is found
    failed = {}
    for name in _users_last([n for n in names if n in sys.modules]):
        try:
            importlib.reload(sys.modules[name])
        except Exception as exc:  # noqa: BLE001 - said to the caller, the rank goes on
            failed[name] = f"{type(exc).__name__}: {exc}"
    return failed


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
