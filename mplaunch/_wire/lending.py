"""How much memory a payload's large buffers may fill on this machine: asked before a
call's buffers are written (InputsTooLarge, before anything starts) and again while they
are written (Budget), so that the machine is never filled by mplaunch's copy.

What can be lent is the kernel's MemAvailable, or less where a memory cgroup's limit
leaves less: the process's own cgroup or any ancestor's (a container's limit is often
set on a parent), each less what it uses beyond the page cache the kernel can drop
(inactive_file, as the kubelet counts a working set). Counting page cache as used
refused data that fits; asking only the leaf cgroup let through data that a parent's
limit then killed. A memfd counts against neither /dev/shm's size nor overcommit, so
neither is asked.

Why again while writing: two large payloads written at once (two notebooks, two Worlds)
each passed the check made before writing, and together filled the machine.
"""
from __future__ import annotations

import os
import sys
import threading
from typing import Optional, Tuple

from .memory import memory_cgroup

__all__ = ["InputsTooLarge", "lendable", "size_text", "Budget"]


class InputsTooLarge(MemoryError):
    """A call's large buffers (its arguments', and those of the globals its functions of
    `__main__` read) are more than this machine can hold in shared
    memory now: nothing was started. ``nbytes`` is what they need, ``limit`` what is
    there, ``source`` where that figure comes from. Pass less, or have each rank load
    its data itself (e.g. ``np.load(path, mmap_mode="r")`` in the function)."""

    def __init__(self, nbytes: int, limit: int, source: str):
        self.nbytes, self.limit, self.source = nbytes, limit, source
        super().__init__(
            f"mplaunch: the large buffers of the call's arguments (and of the globals its "
            f"functions read) need {size_text(nbytes)} of shared memory "
            f"(written once, mapped by every rank), more than the {size_text(limit)} this "
            f"machine can lend now ({source}); nothing was started. Pass less, or load the "
            "data in each rank (np.load(path, mmap_mode='r'), torch.load(path, mmap=True)).")

    def __reduce__(self):
        return type(self), (self.nbytes, self.limit, self.source)


def size_text(n: int) -> str:
    """n bytes, as people read sizes."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} bytes"


def lendable() -> Tuple[int, str]:
    """(bytes, where the figure comes from): the memory this process may fill with
    shared pages now: the kernel's MemAvailable, or less where a memory cgroup's limit
    leaves less: its own cgroup's or any ancestor's (a container's limit is often set
    on a parent), each less what it uses beyond page cache the kernel can drop
    (inactive_file, as the kubelet counts a working set). A memfd counts against
    neither /dev/shm's size nor overcommit."""
    limit, source = sys.maxsize, "no limit found"
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    limit, source = int(line.split()[1]) * 1024, "MemAvailable in /proc/meminfo"
                    break
    except (OSError, ValueError, IndexError):
        pass
    cgroup = memory_cgroup(os.getpid())
    while cgroup is not None and cgroup.startswith(_CGROUPS):
        left = _cgroup_left(cgroup)
        if left is not None and left < limit:
            limit = left
            source = (f"the limit of memory cgroup {cgroup} less what it uses beyond "
                      "reclaimable page cache")
        parent = os.path.dirname(cgroup)
        cgroup = parent if parent != cgroup else None
    return limit, source


_CGROUPS = "/sys/fs/cgroup/"


def _cgroup_left(cgroup: str) -> Optional[int]:
    """What `cgroup`'s limit leaves (v2, else v1), None without a limit there."""
    for cap, used, cache in (("memory.max", "memory.current", "inactive_file"),
                             ("memory.limit_in_bytes", "memory.usage_in_bytes",
                              "total_inactive_file")):
        try:
            with open(os.path.join(cgroup, cap)) as f:
                text = f.read().strip()
            with open(os.path.join(cgroup, used)) as f:
                in_use = int(f.read())
        except (OSError, ValueError):
            continue
        if not text.isdigit() or int(text) >= 1 << 60:   # "max", or v1's no-limit
            return None
        try:
            with open(os.path.join(cgroup, "memory.stat")) as f:
                for line in f:
                    name, _, value = line.partition(" ")
                    if name == cache:
                        in_use = max(0, in_use - int(value))
                        break
        except (OSError, ValueError):
            pass
        return max(0, int(text) - in_use)
    return None


class Budget:
    """The writes of one payload check, as they go, that what is left to write still
    fits (see the module's docstring). Asked again every _RECHECK bytes; the first
    writer that no longer fits stops with InputsTooLarge and its pages are freed, so
    the other finishes."""

    def __init__(self, total: int):
        self.total, self.written, self._next = total, 0, _RECHECK
        self._lock = threading.Lock()

    def wrote(self, n: int) -> None:
        with self._lock:
            self.written += n
            if self.written < self._next:
                return
            self._next = self.written + _RECHECK
            left = self.total - self.written
        limit, source = lendable()
        if left > limit:
            raise InputsTooLarge(self.total, limit + self.written,
                                 f"{source}, while it was being written: something "
                                 "else took memory meanwhile")


_RECHECK = 256 << 20


# -- the rank's side --------------------------------------------------------------------
