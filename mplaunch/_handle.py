"""mplaunch.start(): a launch that runs while the caller does other work, and the Handle
that watches it.

The launch itself is the same Run that launch() drives; here a thread drives it. Signals
are forwarded to the ranks only while the main thread waits on the handle (wait() or
result()); otherwise a Ctrl-C is the caller's, as with any other work it does.
"""
from __future__ import annotations

import atexit
import threading
import time
import weakref
from typing import Any, Callable, Dict, Generic, List, Optional, TypeVar

from ._engine import prompts, signals
from ._engine.config import validate
from ._engine.stragglers import analyse, off_line
from ._launch import Run, from_here
from ._wire.payload import dumps_payload
from .errors import MPLaunchError

T = TypeVar("T")

_open: "weakref.WeakSet[Handle]" = weakref.WeakSet()


class Handle(Generic[T]):
    """A launch in progress, returned by :func:`mplaunch.start`.

    ``pids`` maps each rank of this node to its process id; ``done()`` says whether the
    launch has ended, without blocking; ``wait(timeout)`` waits for it; ``result()``
    returns what :func:`mplaunch.launch` would have returned, or raises what it would
    have raised; ``stacks()`` says where each rank is now, without stopping it;
    ``stop()`` tears the ranks down as on a failure. Used as a context
    manager, leaving the block stops the launch if it is still running. A handle left
    running is stopped when the interpreter exits.
    """

    __module__ = "mplaunch"

    def __init__(self, run: Run):
        self._run = run
        self._finished = threading.Event()
        self._value: Optional[List[T]] = None
        self._error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._drive, name="mplaunch-monitor",
                                        daemon=True)
        _open.add(self)
        self._thread.start()
        run.started.wait()   # every rank has a pid (or the launch already failed)

    def _drive(self) -> None:
        try:
            self._value = self._run.drive()
        except BaseException as exc:  # noqa: BLE001 - handed to result()
            self._error = exc
        finally:
            self._run.started.set()
            self._finished.set()

    def report(self):
        """Who the others waited for, once the launch ended: as
        :meth:`mplaunch.World.report`."""
        if not self._finished.is_set():
            raise RuntimeError("the launch is still running: its report comes when it "
                               "ends (handle.wait())")
        if self._run.flight_off:
            raise RuntimeError(off_line(self._run.flight_off))
        if not any(self._run.collectives.values()):
            raise RuntimeError("no straggler report: the launch's collectives were "
                               "not read in every rank (its ranks started none, or a "
                               "rank's call lasted less than a second, too short to be "
                               "read; a World's report() reads a short call too)")
        report = analyse(self._run.collectives)
        report.late_stacks = dict(self._run.late)
        return report

    @property
    def pids(self) -> Dict[int, int]:
        """{rank: pid} of the ranks of the current attempt on this node."""
        return self._run.pids

    def stacks(self) -> Dict[int, str]:
        """{rank: where it is now}, asked without stopping anything (from any thread):
        the innermost frames of each thread with source lines, and the collective it
        is in, as a timeout's message shows them; ``print()`` shows them grouped.
        Empty once the launch has ended."""
        return self._run.stacks()

    def done(self) -> bool:
        """True once every rank is gone and the outcome is known. Never blocks."""
        return self._finished.is_set()

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Wait up to `timeout` seconds (None: no limit) for the launch to end; True if
        it has. A signal to this process meanwhile (in the main thread) is forwarded to
        the ranks, as during launch()."""
        if self._finished.is_set():
            return True
        end = None if timeout is None else time.monotonic() + timeout
        with signals.forwarding(self._run.on_signal, warn=False):
            # In slices: a signal the kernel gave another thread runs its handler only
            # once this (main) thread runs bytecode again, and a lock wait is not woken.
            while True:
                prompts.serve_deferred()   # a rank's prompt, in a kernel
                left = 0.25 if end is None else min(0.25, end - time.monotonic())
                if self._finished.wait(max(0.0, left)):
                    return True
                if end is not None and time.monotonic() >= end:
                    return False

    def result(self, timeout: Optional[float] = None) -> List[T]:
        """The list launch() returns, or raise what launch() raises. Raises
        TimeoutError if the launch is still running after `timeout` seconds (it goes
        on; call stop() to end it)."""
        if not self.wait(timeout):
            raise TimeoutError(f"the launch is still running after {timeout:g} s; call "
                               "result() again to keep waiting, or stop() to end it")
        self._thread.join()
        if isinstance(self._error, MPLaunchError):
            raise from_here(self._error)   # not the monitor thread's frames
        if self._error is not None:
            raise self._error
        return self._value  # type: ignore[return-value]

    def stop(self, grace_period: Optional[float] = None) -> None:
        """Tear the ranks down as on a failure: SIGTERM, then SIGKILL after
        `grace_period` (default: the launch's). Returns once every process is gone;
        idempotent. result() then raises a WorkerError naming the ranks that were
        stopped, unless every rank had already returned."""
        self._run.stop(grace_period)
        self._finished.wait()
        self._thread.join()

    def __enter__(self) -> "Handle[T]":
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "done" if self.done() else f"running, pids {self.pids}"
        return f"<mplaunch.Handle {state}>"


def start(func: Callable[..., T], args: Any = (), nprocs: Any = None,
          **options: Any) -> Handle[T]:
    """Start ``func(*args, **kwargs)`` in ``nprocs`` ranks and return at once with a
    :class:`Handle`; ``start(...).result()`` is ``launch(...)``. Takes every keyword
    argument of :func:`mplaunch.launch`. Bad arguments raise here, before any process
    starts."""
    cfg = validate(func, args, nprocs, options)
    payload = dumps_payload(func, args, options.get("kwargs") or {})
    return Handle(Run(cfg, payload, forward_signals=False))


@atexit.register
def _stop_open_handles() -> None:
    for handle in list(_open):
        if not handle.done():
            handle.stop()

