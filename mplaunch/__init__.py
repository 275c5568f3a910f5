"""mplaunch: launch a function in N worker processes for PyTorch distributed work,
watch them, and tear everything down cleanly when anything goes wrong."""
from ._handle import Handle, start
from ._launch import launch
from ._magic import load_ipython_extension, unload_ipython_extension
from ._serve import rank_state
from ._world import World
from .errors import (LaunchTimeout, MainProcessError, MPLaunchError, RankFailure,
                     RemoteException, WorkerError)

__version__ = "0.1.0"

__all__ = [
    "launch",
    "start",
    "Handle",
    "World",
    "rank_state",
    "WorkerError",
    "MainProcessError",
    "LaunchTimeout",
    "RankFailure",
    "RemoteException",
    "MPLaunchError",
    "__version__",
]
