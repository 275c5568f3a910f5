"""A signal that the kernel delivers to a thread other than the main one still reaches
the ranks at once. Python runs a handler only when the main thread runs bytecode, and a
process-directed signal may land on any thread that does not block it (torch's, a
framework's, a test's own): without a wakeup fd the main thread, asleep in select() or a
lock, never ran it. pthread_kill sends it to one thread on purpose. Each call has a
timeout, so a signal that is not seen ends as a LaunchTimeout, not a hang."""
from __future__ import annotations

import os
import signal
import threading
import time

import pytest

import mplaunch


def _spin(flag_dir):
    open(os.path.join(flag_dir, f"in.{os.environ['RANK']}"), "w").close()
    while True:
        time.sleep(0.01)


def _signal_from_a_thread(flag_dir, nprocs, signo=signal.SIGINT):
    """Once every rank is in, `signo` to this helper thread itself, not to the main one."""
    def go():
        end = time.monotonic() + 60
        while not all(os.path.exists(os.path.join(flag_dir, f"in.{r}")) for r in range(nprocs)):
            if time.monotonic() > end:
                return
            time.sleep(0.02)
        # and once the main thread forwards it: start() returns before handle.wait()
        # installs the forwarding, and a SIGINT meanwhile is Python's KeyboardInterrupt
        while signal.getsignal(signo) in (signal.default_int_handler, signal.SIG_DFL):
            if time.monotonic() > end:
                return
            time.sleep(0.01)
        signal.pthread_kill(threading.get_ident(), signo)
    t = threading.Thread(target=go)
    t.start()
    return t


def test_launch(tmp_path):
    t = _signal_from_a_thread(str(tmp_path), 2)
    t0 = time.monotonic()
    try:
        with pytest.raises(mplaunch.MainProcessError):
            mplaunch.launch(_spin, args=(str(tmp_path),), nprocs=2, timeout=40)
    finally:
        t.join()
    assert time.monotonic() - t0 < 30


def test_a_healing_world_run(tmp_path):
    with mplaunch.World(2, grace_period=5) as world:
        world.run(os.getpid)
        t = _signal_from_a_thread(str(tmp_path), 2)
        try:
            with pytest.raises(KeyboardInterrupt, match="interrupted"):
                world.run(_spin, (str(tmp_path),), timeout=40)
        finally:
            t.join()
        assert world.run(os.getpid) == list(world.pids.values())


def test_handle_wait(tmp_path):
    handle = mplaunch.start(_spin, args=(str(tmp_path),), nprocs=2, timeout=40)
    t = _signal_from_a_thread(str(tmp_path), 2)
    try:
        handle.wait()
    finally:
        t.join()
    with pytest.raises(mplaunch.MainProcessError):
        handle.result()
