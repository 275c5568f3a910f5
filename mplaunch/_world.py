"""mplaunch.World: ranks that stay up between calls, for notebooks and test suites.

A World is one Attempt whose ranks serve calls (_rank.serve) instead of running one function
and exiting. Each run() is a call driven to its replies by the same loop launch() uses,
so failures, timeouts, signals, output and teardown behave as for launch(). A run that
fails tears the world down; the next run starts fresh ranks.
"""
from __future__ import annotations

import atexit
import contextlib
import logging
import sys
import threading
from typing import Any, Callable, List, Mapping, Optional, Sequence, Set, TypeVar

from ._engine import servers, signals
from ._engine.attempt import Attempt
from ._engine.config import LaunchConfig, check_call, seconds, validate, with_streams
from ._engine.outcome import results_or_raise
from ._engine.session import Session
from ._rank import procgroup
from ._wire import linux
from ._wire.payload import dumps_payload

log = logging.getLogger("mplaunch")
T = TypeVar("T")

# Strong references: a World nobody refers to any more is still open (its ranks, pipes and
# store are up) and must be closed at exit. With weak ones, a world made in a function
# that returned was dropped unclosed: its fds stayed open and its ranks ended by EOF.
_open: "Set[World]" = set()


def _setup_rank(backend: Optional[str]) -> None:
    procgroup.setup(backend)   # made already when the rank's spec named it


class World:
    """``nprocs`` ranks started once and kept up: ``run(func)`` calls ``func`` in every
    rank and returns the list of results, as :func:`mplaunch.launch` would, but the
    processes, their module globals, :func:`mplaunch.rank_state` and (with
    ``backend=``) the process group stay for the next ``run``.

    Takes the keyword arguments of :func:`mplaunch.launch` (``timeout`` applies to each
    run), ``gpus=`` and ``cpus=`` included. The ranks start at the first ``run`` (or
    ``start()``); with ``backend`` each has called
    ``torch.distributed.init_process_group(backend)`` before it (on CUDA, on its own
    GPU: see :doc:`gpus`). A failing
    run raises as ``launch`` does and tears the world down; the next ``run`` starts
    fresh ranks. ``restart()`` does so on purpose. ``close()`` (or leaving the ``with``
    block) ends every process; a world left open is closed at interpreter exit.
    """

    __module__ = "mplaunch"

    def __init__(self, nprocs: Any = None, backend: Optional[str] = None,
                 **options: Any):
        if "kwargs" in options:
            raise TypeError("World takes no kwargs=; pass them to run()")
        self.cfg: LaunchConfig = validate(_setup_rank, (backend,), nprocs,
                                          dict(options, backend=backend))
        if self.cfg.nnodes > 1:
            raise ValueError("a World runs on one node; for several nodes use launch()")
        if self.cfg.max_restarts:
            raise ValueError("a World does not restart on its own: after a failed run the "
                             "next run() starts fresh ranks; leave max_restarts at 0")
        self.backend = backend
        self._attempt: Optional[Attempt] = None
        self._stack: Optional[contextlib.ExitStack] = None
        self._generation = 0       # how many times ranks were started
        self._closed = False
        # One call at a time: a call's replies are read from the ranks' sockets in the
        # order they come, and two callers would take each other's (and register the
        # same fds twice with the selector). A second thread's run() waits its turn.
        self._lock = threading.RLock()
        _open.add(self)

    # -- public ----------------------------------------------------------------------
    @property
    def pids(self):
        """{rank: pid} of the running ranks ({} before the first run)."""
        return self._attempt.group.pids if self._attempt is not None else {}

    @property
    def nprocs(self) -> int:
        return self.cfg.nprocs

    def stacks(self):
        """{rank: where it is now}, asked without stopping anything, from any thread
        (while another runs ``run``): as :meth:`mplaunch.Handle.stacks`."""
        from ._wire.stacks import RankStacks
        from ._engine.timeouts import collect_stacks
        attempt = self._attempt
        return RankStacks(collect_stacks(attempt.group) if attempt is not None else {})

    def start(self) -> "World":
        """Start the ranks now (else the first run() does)."""
        with self._lock:
            if self._closed:
                raise RuntimeError("this World is closed; make a new one")
            if self._attempt is None:
                self._start()
        return self

    def run(self, func: Callable[..., T], args: Sequence[Any] = (),
            kwargs: Optional[Mapping[str, Any]] = None,
            timeout: Optional[float] = None) -> List[T]:
        """Call ``func(*args, **kwargs)`` in every rank; the results by rank. Raises
        :class:`~mplaunch.WorkerError`, :class:`~mplaunch.LaunchTimeout` or
        :class:`~mplaunch.MainProcessError` as ``launch`` does, after tearing the world
        down."""
        check_call(func, args, kwargs)
        # None: the world's own timeout; inf: none, for this call (the loop's deadline
        # is then never reached, and its waits are sliced).
        if timeout != float("inf"):
            timeout = seconds("timeout", timeout, optional=True)
        payload = dumps_payload(func, args, kwargs or {})
        with self._lock:
            self.start()
            return self._call(payload, timeout)

    def restart(self) -> "World":
        """End the ranks and start fresh ones."""
        with self._lock:
            self._stop()
            return self.start()

    def close(self) -> None:
        """End every rank and release the store's port. Idempotent; from another thread
        it ends the call in progress there (which raises) instead of waiting for it."""
        self._closed = True
        _open.discard(self)
        if not self._lock.acquire(blocking=False):
            attempt = self._attempt
            if attempt is not None:
                attempt.request_stop()  # the running call tears down and raises
            self._lock.acquire()
        try:
            self._stop()
        finally:
            self._lock.release()

    def __enter__(self) -> "World":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def __repr__(self) -> str:
        state = ("closed" if self._closed else f"up, pids {self.pids}" if self._attempt
                 else "not started")
        return f"<mplaunch.World nprocs={self.nprocs} backend={self.backend!r} {state}>"

    # -- the ranks ---------------------------------------------------------------------
    def _start(self) -> None:
        cfg = with_streams(self.cfg)
        stack = contextlib.ExitStack()
        try:
            # The first "call" is the set-up (init_process_group): the ranks start from it.
            session = stack.enter_context(
                Session(cfg, dumps_payload(_setup_rank, (self.backend,), {})))
            session.wait_server()
            attempt = Attempt(cfg, self._generation, session.specs(self._generation,
                                                                   serve=True),
                              session.payload_fd, session.waker)
            self._generation += 1
            stack.callback(attempt.group.close)
            attempt.group.start()
        except BaseException:
            stack.close()
            raise
        self._attempt, self._stack = attempt, stack
        self._wait_replies(attempt, None)   # every rank has run its setup

    def _call(self, payload: bytes, timeout: Optional[float]) -> list:
        attempt = self._attempt
        attempt.group.relay_to(sys.stdout, sys.stderr)
        fd = linux.memfd_with(payload, "mplaunch-payload")
        try:
            attempt.group.call(fd)
        except OSError:
            pass  # a rank is gone: the loop below finds out which, and why
        finally:
            servers.close_fd(fd)
        return self._wait_replies(attempt, timeout)

    def _wait_replies(self, attempt: Attempt, timeout: Optional[float]) -> list:
        group = attempt.group
        try:
            with signals.forwarding(attempt.on_signal, warn=False):
                attempt.drive(until=lambda: group.replied and not group.stopping,
                              timeout=timeout)
        except BaseException:
            self._stop()
            raise
        if group.running and not group.stopping:
            group.relay_written()
            return [r.result for r in group.ranks]
        self._stop()
        log.warning("mplaunch.World: the failed call tore the world's %d ranks down; the "
                    "next call starts fresh ranks", self.nprocs)
        return results_or_raise(attempt)

    def _stop(self) -> None:
        attempt, stack = self._attempt, self._stack
        self._attempt = self._stack = None
        if attempt is None:
            return
        try:
            attempt.group.stop()
            attempt.drive()          # SIGTERM, then SIGKILL after the grace period
        finally:
            stack.close()            # the group, then the session


@atexit.register
def _close_open_worlds() -> None:
    for world in list(_open):
        world.close()
