"""mplaunch: launch a function in N worker processes for PyTorch distributed work,
watch them, and tear everything down cleanly when anything goes wrong.

The public names are imported on first use (PEP 562): ``import mplaunch`` costs next to
nothing, which matters because the pytest plugin is loaded in every pytest session of an
environment where mplaunch is installed, and because a rank's own children (DataLoader
workers) import this package to rebuild their ``__main__``. ``dir(mplaunch)``,
``help(mplaunch)`` and type checkers see every public name.
"""
from __future__ import annotations

import importlib

# Not typing.TYPE_CHECKING: importing typing would cost more than the rest of this module.
# Type checkers read any name TYPE_CHECKING as true.
TYPE_CHECKING = False

__version__ = "0.1.0"

__all__ = [
    "launch",
    "start",
    "spawn",
    "SpawnContext",
    "Handle",
    "World",
    "rank_state",
    "StragglerReport",
    "WorkerError",
    "MainProcessError",
    "LaunchTimeout",
    "RankFailure",
    "RemoteException",
    "MPLaunchError",
    "__version__",
]

# public name -> the module that defines it (relative to this package)
_HOMES = {
    "launch": "._launch",
    "start": "._handle",
    "spawn": "._spawn",
    "SpawnContext": "._spawn",
    "Handle": "._handle",
    "World": "._world",
    "rank_state": "._rank.call_loop",
    "StragglerReport": "._engine.stragglers",
    "load_ipython_extension": "._magic",
    "unload_ipython_extension": "._magic",
    "WorkerError": ".errors",
    "MainProcessError": ".errors",
    "LaunchTimeout": ".errors",
    "RankFailure": ".errors",
    "RemoteException": ".errors",
    "MPLaunchError": ".errors",
}

if TYPE_CHECKING:
    from typing import Any, List

    from ._handle import Handle, start
    from ._launch import launch
    from ._spawn import SpawnContext, spawn
    from ._magic import load_ipython_extension, unload_ipython_extension
    from ._rank.call_loop import rank_state
    from ._engine.stragglers import StragglerReport
    from ._world import World
    from .errors import (LaunchTimeout, MainProcessError, MPLaunchError, RankFailure,
                         RemoteException, WorkerError)


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'mplaunch' has no attribute {name!r}")
    value = getattr(importlib.import_module(home, __name__), name)
    globals()[name] = value  # once: later lookups do not come here
    return value


def __dir__() -> List[str]:
    return sorted(set(globals()) | set(_HOMES))
