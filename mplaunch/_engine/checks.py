"""Checks of launch arguments that look at the machine rather than at the value alone:
how many processes it can take, whether a log directory can be written, which backends
torch.distributed knows, whether the working directory still exists. validate() (in
config) calls them before any process starts.
"""
from __future__ import annotations

import os
import sys
import tempfile
from typing import Optional, Tuple

MAX_NPROCS_ENV = "MPLAUNCH_MAX_NPROCS"


def max_nprocs() -> Tuple[int, str]:
    """The most ranks one node may start, and why: MPLAUNCH_MAX_NPROCS, else 32 per
    CPU (at least 256), bounded by this user's process limit and the kernel's pid_max."""
    raw = os.environ.get(MAX_NPROCS_ENV)
    if raw is not None:
        if not raw.strip().isdigit() or int(raw) < 1:
            raise ValueError(f"{MAX_NPROCS_ENV} must be a positive int (the most ranks "
                             f"one node may start), got {raw!r}")
        return int(raw), f"{MAX_NPROCS_ENV}={raw.strip()}"
    cpus = os.cpu_count() or 1
    limit, why = max(256, 32 * cpus), f"32 per CPU, {cpus} CPUs here, at least 256"
    try:
        import resource
        soft, _ = resource.getrlimit(resource.RLIMIT_NPROC)
        if soft != resource.RLIM_INFINITY and 0 < soft < limit:
            limit, why = soft, f"RLIMIT_NPROC (ulimit -u) is {soft}"
    except (ImportError, AttributeError, OSError, ValueError):
        pass
    try:
        with open("/proc/sys/kernel/pid_max") as f:
            pid_max = int(f.read())
        if pid_max // 2 < limit:
            limit, why = pid_max // 2, f"half of the kernel's pid_max {pid_max}"
    except (OSError, ValueError):
        pass
    return limit, why


def check_nprocs_limit(nprocs: int) -> None:
    limit, why = max_nprocs()
    if nprocs > limit:
        raise ValueError(
            f"nprocs={nprocs} is more ranks than mplaunch starts on one node without being "
            f"told: at most {limit} ({why}). Each rank is a process with its own Python "
            f"and torch, so this many would exhaust the machine long before they ran. "
            f"If you mean it, set the environment variable {MAX_NPROCS_ENV} to the "
            f"largest nprocs to allow")


def log_dir(log_dir) -> Optional[str]:
    """A directory that exists and is writable, or can be created: checked now, before
    the server or any rank starts, by making it (as the ranks would) and a folder in it
    (removed at once). Where folders cannot be made (under /proc, /sys, a read-only
    mount), permission bits say nothing, and root passes every access() check."""
    if log_dir is None:
        return None
    if not isinstance(log_dir, (str, os.PathLike)):
        raise TypeError(f"log_dir must be a directory path (a str or os.PathLike), or "
                        f"None for no log files; got {type(log_dir).__name__} {log_dir!r}")
    path = os.fspath(log_dir)
    if isinstance(path, bytes):
        path = os.fsdecode(path)
    if not path:
        raise ValueError("log_dir must be a directory path, got ''; use None for no logs")
    existing = os.path.abspath(path)
    while not os.path.exists(existing) and os.path.dirname(existing) != existing:
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise ValueError(f"log_dir {path!r} is not a directory: {existing!r} is a file; "
                         f"name a directory (it is created if missing)")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"log_dir {path!r} is not writable: this process may not write "
                         f"in {existing!r}; name a directory it may write in")
    try:
        os.makedirs(path, exist_ok=True)
        os.rmdir(tempfile.mkdtemp(prefix=".mplaunch-probe-", dir=path))
    except OSError as exc:
        raise ValueError(f"log_dir {path!r} cannot hold the ranks' log folders: making "
                         f"one there failed ({exc.strerror or exc}); name a directory "
                         "on a writable file system") from None
    return path


def check_backend(backend) -> None:
    """A World's ``backend``: None, or a backend torch.distributed knows ("gloo",
    "nccl", ..., or "cpu:gloo,cuda:nccl"); checked without initialising CUDA."""
    if backend is None:
        return
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a str such as 'gloo' or 'nccl', or None, "
                        f"got {backend!r}")
    try:
        from torch.distributed import Backend
        known = [b for b in Backend.backend_list if b != Backend.UNDEFINED]
    except Exception:  # noqa: BLE001 - no torch.distributed here: the ranks will say
        return
    for part in backend.split(","):
        name = part.rpartition(":")[2].strip().lower()
        if name not in known:
            raise ValueError(f"backend {backend!r} is not a torch.distributed backend "
                             f"here; use one of {', '.join(map(repr, known))} (or a "
                             f"device mapping such as 'cpu:gloo,cuda:nccl'), or None")


def working_directory() -> str:
    """The directory each rank starts in: the caller's, which must still exist."""
    try:
        return os.getcwd()
    except FileNotFoundError:
        raise FileNotFoundError(
            "mplaunch cannot launch from this process's current working directory: it "
            "no longer exists (it was deleted). Each rank starts in the caller's working "
            "directory, and torch cannot even be imported in a deleted one. os.chdir() "
            "to a directory that exists, then launch again") from None


def cuda_initialized() -> bool:
    """Whether this process has initialised CUDA (without importing torch to ask)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    try:
        return bool(torch.cuda.is_initialized())
    except Exception:  # noqa: BLE001
        return False
