"""Signal handlers in the launching process for the lifetime of one launch.

Installed only in the main thread (Python delivers signals there alone), always restored,
and kept minimal: the handler records the signal and wakes the monitor, which does the
forwarding and teardown outside of signal context.
"""
from __future__ import annotations

import contextlib
import logging
import os
import select
import signal
import threading
from typing import Optional

from .._wire.linux import close_quiet

log = logging.getLogger("mplaunch")

FORWARDED = tuple(getattr(signal, n) for n in ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT")
                  if hasattr(signal, n))


@contextlib.contextmanager
def forwarding(on_signal, warn: bool = True, wake_fd: Optional[int] = None):
    """Within the block, the signals in FORWARDED call on_signal(signo) instead of their
    usual handlers. Outside the main thread nothing is installed (Python runs handlers
    there alone); `warn` says so in the log.

    `wake_fd` (a Waker's non-blocking write end, which the waiting loop selects on) is
    the signal wakeup fd meanwhile. Python runs a handler only when the main thread runs
    bytecode, and the kernel may deliver a process-directed signal to any thread that
    does not block it (a thread of torch's, of a framework's, the test's own): the main
    thread, asleep in select(), then never ran the handler, and a Ctrl-C hung instead of
    interrupting. With the fd, the C-level handler wakes the select itself."""
    if threading.current_thread() is not threading.main_thread():
        if warn:
            log.warning("mplaunch.launch is running outside the main thread: signals to "
                        "this process are not forwarded to the ranks (they are still "
                        "torn down if this process dies)")
        yield False
        return
    previous = {}
    old_wake = None
    try:
        if wake_fd is not None:
            old_wake = signal.set_wakeup_fd(wake_fd, warn_on_full_buffer=False)
        for signo in FORWARDED:
            previous[signo] = signal.signal(signo, lambda s, _f: on_signal(s))
        yield True
    finally:
        for signo, handler in previous.items():
            signal.signal(signo, signal.SIG_DFL if handler is None else handler)
        if old_wake is not None:
            signal.set_wakeup_fd(old_wake)


class Waker:
    """A self-pipe the monitor selects on, so a signal or another thread can wake it."""

    def __init__(self):
        self.r, self.w = os.pipe()
        os.set_blocking(self.r, False)
        os.set_blocking(self.w, False)

    def wake(self) -> None:
        try:
            os.write(self.w, b"x")
        except (BlockingIOError, OSError):
            pass

    def drain(self) -> None:
        try:
            while os.read(self.r, 4096):
                pass
        except (BlockingIOError, OSError):
            pass

    def sleep(self, seconds: float) -> None:
        """Wait `seconds`, or less if woken."""
        try:
            select.select([self.r], [], [], seconds)
        except InterruptedError:
            pass
        self.drain()

    def close(self) -> None:
        close_quiet(self.r, self.w)
