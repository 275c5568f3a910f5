"""The test side of world_parent.py (the process that holds a World or a Handle for
the signal, SIGKILL and interpreter-exit tests), and small checks shared by
test_world.py and test_start.py."""
import contextlib
import os
import signal
import subprocess
import sys
import time

import psutil
from proctree import TreeParent, describe, wait_gone

WORLD_SCRIPTS = os.path.dirname(os.path.abspath(__file__))
EXIT_MAIN_PROCESS_ERROR = 3   # world_parent.py's exit code after MainProcessError
KILL_BOUND_S = 2.0            # as test_lifecycle: "within about a second", with room
GONE_DEADLINE_S = 5.0


def gone(pids, timeout=GONE_DEADLINE_S):
    """Every pid dead (a zombie counts) within `timeout`; the survivors otherwise."""
    procs = []
    for pid in pids:
        with contextlib.suppress(psutil.NoSuchProcess):
            procs.append(psutil.Process(pid))
    _, alive = wait_gone(procs, timeout)
    return alive


class WorldParent(TreeParent):
    """One world_parent.py process (see its docstring for the modes)."""

    def __init__(self, outdir, mode, method="forkserver"):
        self.outdir = str(outdir)
        self.log_path = os.path.join(self.outdir, "parent.log")
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, os.path.join(WORLD_SCRIPTS, "world_parent.py"), mode,
                 self.outdir, method],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        self.tree = []

    def wait_ready(self, timeout=120.0):
        deadline = time.monotonic() + timeout
        while "READY" not in self.log():
            if self.proc.poll() is not None:
                raise AssertionError(f"world_parent.py exited with {self.proc.returncode}"
                                     f" before it was ready:\n{self.log()}")
            assert time.monotonic() < deadline, self.log()
            time.sleep(0.02)


@contextlib.contextmanager
def world_parent(outdir, mode, method="forkserver"):
    wp = WorldParent(outdir, mode, method)
    try:
        yield wp
    finally:
        wp.close()


def assert_closed_at_exit(wp, tmp_path):
    """The script ends with ranks up; the interpreter's exit must end them. Every rank
    got SIGTERM (its handler wrote signal.<rank>): the world or handle was closed by
    mplaunch's atexit hook, not merely killed by the parent-death signal (SIGKILL)
    once the interpreter was gone."""
    records = wp.wait_ranks()
    (tmp_path / "exit").touch()
    assert wp.proc.wait(timeout=60) == 0, wp.log()
    _, alive = wait_gone(wp.tree, GONE_DEADLINE_S)
    assert not alive, describe(alive)
    for rec in records:
        marker = tmp_path / f"signal.{rec['rank']}"
        assert marker.exists(), f"rank {rec['rank']} was not closed at exit:\n{wp.log()}"
        assert marker.read_text().split() == [str(int(signal.SIGTERM)), str(rec["pid"])]
    assert "Traceback" not in wp.log(), wp.log()
