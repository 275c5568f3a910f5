"""How much memory a rank used, and whether the kernel's OOM killer ended it: read by
whoever reaps the rank (the server, or the launching process in fork mode), since the
rusage of the reaping wait4 and the pid are only known there.

The OOM killer leaves two traces: the oom_kill counter of the memory cgroup it acted in
(cgroup v2 ``memory.events``, v1 ``memory.oom_control``), and a "Killed process PID"
line in the kernel log. The counter is read when the rank starts and again when it dies
by SIGKILL (a dead process's cgroup can no longer be read); the log only where this
process may read /dev/kmsg.
"""
from __future__ import annotations

import os
import re
from typing import Dict, Optional, Tuple

_CGROOT = "/sys/fs/cgroup"
_KILLED = re.compile(rb"Killed process (\d+) ")
HOW_TO_CHECK = ("`dmesg | grep -i -e oom -e 'killed process'` (or `journalctl -k`) "
                "shows whether the kernel's OOM killer did it")


def reap(pid: int, options: int = 0):
    """os.wait4: (pid, raw status, peak resident memory in bytes)."""
    pid, status, usage = os.wait4(pid, options)
    return pid, status, usage.ru_maxrss * 1024  # Linux counts it in KiB


def memory_cgroup(pid: int) -> Optional[str]:
    """The directory of `pid`'s memory cgroup (v2, else v1's memory controller)."""
    try:
        with open(f"/proc/{pid}/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    v1 = v2 = None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            v2 = path
        elif "memory" in controllers.split(","):
            v1 = path
    if v1 is not None:
        return os.path.join(_CGROOT, "memory") + v1.rstrip("/")
    if v2 is not None:
        for root in (_CGROOT, os.path.join(_CGROOT, "unified")):
            if os.path.exists(os.path.join(root, "cgroup.controllers")):
                return root + v2.rstrip("/")
    return None


def oom_kills(cgroup: Optional[str]) -> Optional[int]:
    """The oom_kill counter of that cgroup, None where it cannot be read."""
    if cgroup is None:
        return None
    for name in ("memory.events", "memory.oom_control"):
        try:
            with open(os.path.join(cgroup, name)) as f:
                for line in f:
                    key, _, value = line.partition(" ")
                    if key == "oom_kill":
                        return int(value)
        except (OSError, ValueError):
            continue
    return None


def in_kernel_log(pid: int) -> Optional[bool]:
    """Whether the kernel log says the OOM killer killed `pid`; None if unreadable."""
    try:
        fd = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return None
    found = False
    try:
        while True:
            try:
                record = os.read(fd, 8192)
            except BlockingIOError:
                break
            except OSError:   # EPIPE: a record was overwritten while we read
                continue
            if not record:
                break
            m = _KILLED.search(record)
            if m and int(m.group(1)) == pid:
                found = True
    finally:
        os.close(fd)
    return found


class OomWatch:
    """The oom_kill counters of the ranks' cgroups as they were when each started."""

    def __init__(self):
        self._start: Dict[int, Tuple[Optional[str], Optional[int]]] = {}

    def started(self, pid: int) -> None:
        cgroup = memory_cgroup(pid)
        self._start[pid] = (cgroup, oom_kills(cgroup))

    def forget(self, pid: int) -> None:
        self._start.pop(pid, None)

    def exited(self, pid: int, status: int) -> Optional[str]:
        """For a rank killed by SIGKILL: what the kernel says of its death, as a
        clause ("the kernel's OOM killer killed it (...)"), else None. `status` is its
        raw wait status."""
        cgroup, before = self._start.pop(pid, (None, None))
        if not (os.WIFSIGNALED(status) and os.WTERMSIG(status) == 9):
            return None
        if in_kernel_log(pid):  # (a few hundred records: a millisecond)
            return "the kernel's OOM killer killed it (the kernel log says so)"
        after = oom_kills(cgroup)
        if after is not None and before is not None and after > before:
            # Not necessarily this rank, but in its cgroup while it ran.
            return (f"the kernel's OOM killer killed a process of its memory cgroup "
                    f"{cgroup} meanwhile (oom_kill went from {before} to {after})")
        return None


def killed_why(signo: int, kernel_note: Optional[str]) -> Optional[str]:
    """Why a rank may have been killed by `signo`, as the failure's message."""
    if kernel_note:
        return kernel_note
    if signo == 9:
        return ("nothing says who sent it; running out of memory is a common cause: "
                + HOW_TO_CHECK)
    return None
