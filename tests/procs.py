"""Whether processes a test saw are gone (the processes of an inner session, or a
script's ranks, which the autouse leak check cannot see: they are not its children)."""
from __future__ import annotations

import time

import psutil


def assert_gone(procs, within: float = 10.0) -> None:
    """Every process of `procs` (pid -> create time, or None where unknown) is gone
    within `within` seconds; a zombie counts as gone, and a pid reused by a process
    created at another time is not the one recorded."""
    end = time.monotonic() + within
    while True:
        alive = []
        for pid, created in procs.items():
            try:
                p = psutil.Process(pid)
                if p.status() == psutil.STATUS_ZOMBIE:
                    continue
                if created is None or abs(p.create_time() - created) < 0.5:
                    alive.append(f"{pid} {' '.join(p.cmdline())[:100]}")
            except psutil.Error:
                pass
        if not alive or time.monotonic() > end:
            break
        time.sleep(0.1)
    assert not alive, f"these processes outlived what started them: {alive}"
