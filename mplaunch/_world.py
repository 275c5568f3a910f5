"""mplaunch.World: ranks that stay up between calls, for notebooks and test suites.

The front-end: it validates, takes one call at a time, and presents. The engine is
_engine.serving.Serving (what Run is to launch()): it starts the ranks, drives each call
to its replies with the loop launch() uses, and heals a failed call where it can
(_engine.heal drives the call, _rank.heal is the ranks' side). One run() goes down to
it and comes back once, with the results or the error to raise.
"""
from __future__ import annotations

import atexit
import threading
from typing import Any, Callable, List, Mapping, Optional, Sequence, Set, TypeVar

from ._engine.config import LaunchConfig, check_call, seconds, validate
from ._engine.serving import RankCalls, Serving
from ._rank import heal, procgroup
from ._wire.payload import dumps_payload

T = TypeVar("T")
# mplaunch's own calls in the ranks, sent by reference to the rank's side
_CALLS = RankCalls(setup=procgroup.setup, group_state=heal.group_state,
                   rebuild=heal.rebuild)

# Strong references: a World nobody refers to any more is still open (its ranks, pipes and
# store are up) and must be closed at exit. With weak ones, a world made in a function
# that returned was dropped unclosed: its fds stayed open and its ranks ended by EOF.
_open: "Set[World]" = set()


class World:
    """``nprocs`` ranks started once and kept up: ``run(func)`` calls ``func`` in every
    rank and returns the list of results, as :func:`mplaunch.launch` would, but the
    processes, their module globals, :func:`mplaunch.rank_state` and (with
    ``backend=``) the process group stay for the next ``run``.

    Takes the keyword arguments of :func:`mplaunch.launch` (``timeout`` applies to each
    run), ``gpus=`` and ``cpus=`` included. The ranks start at the first ``run`` (or
    ``start()``); with ``backend`` each has called
    ``torch.distributed.init_process_group(backend)`` before it (on CUDA, on its own
    GPU: see :doc:`gpus`). A failing run raises as ``launch`` does; with ``heal=True``
    (the default) the world heals where it can: a rank's exception, a collective left
    half-done, an interrupt, a timeout or a dead rank keep the ranks and their state
    (the process group is rebuilt and a dead rank replaced if need be, and the error
    says so); what cannot be healed is torn down and the next ``run`` starts fresh
    ranks, as always with ``heal=False``. ``restart()`` starts fresh ranks on purpose.
    ``close()`` (or leaving the ``with``
    block) ends every process; a world left open is closed at interpreter exit.
    """

    __module__ = "mplaunch"

    def __init__(self, nprocs: Any = None, backend: Optional[str] = None,
                 heal: bool = True, **options: Any):
        if "kwargs" in options:
            raise TypeError("World takes no kwargs=; pass them to run()")
        if not isinstance(heal, bool):
            raise TypeError(f"heal must be True (keep the ranks through a failed run) or "
                            f"False (tear them down), got {heal!r}")
        self.heal = heal
        self.cfg: LaunchConfig = validate(procgroup.setup, (backend,), nprocs,
                                          dict(options, backend=backend))
        if self.cfg.nnodes > 1:
            raise ValueError("a World runs on one node; for several nodes use launch()")
        if self.cfg.max_restarts:
            raise ValueError("a World does not restart on its own: after a failed run the "
                             "next run() starts fresh ranks; leave max_restarts at 0")
        self.backend = backend
        self._engine = Serving(self.cfg, backend, heal, _CALLS)
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
        return self._engine.pids

    @property
    def fresh_ranks(self) -> List[int]:
        """The ranks that are fresh processes since the last run, their state gone:
        every rank after the world was torn down, the replaced ones after a run that
        healed a dead rank; [] once a run has begun. Send them their state again."""
        return list(self._engine.fresh)

    @property
    def nprocs(self) -> int:
        return self.cfg.nprocs

    def stacks(self):
        """{rank: where it is now}, asked without stopping anything, from any thread
        (while another runs ``run``): as :meth:`mplaunch.Handle.stacks`."""
        return self._engine.stacks()

    def start(self) -> "World":
        """Start the ranks now (else the first run() does)."""
        with self._lock:
            if self._closed:
                raise RuntimeError("this World is closed; make a new one")
            self._engine.start()
        return self

    def run(self, func: Callable[..., T], args: Sequence[Any] = (),
            kwargs: Optional[Mapping[str, Any]] = None,
            timeout: Optional[float] = None) -> List[T]:
        """Call ``func(*args, **kwargs)`` in every rank; the results by rank. Raises
        :class:`~mplaunch.WorkerError` or :class:`~mplaunch.LaunchTimeout` as
        ``launch`` does, after healing the world (``err.healed`` says what it kept) or
        tearing it down; an interrupt (SIGINT) raises :class:`KeyboardInterrupt` in the
        ranks and here, the world kept (:class:`~mplaunch.MainProcessError` with
        ``heal=False``, or for SIGTERM, SIGHUP, SIGQUIT or a second SIGINT)."""
        check_call(func, args, kwargs)
        # None: the world's own timeout; inf: none, for this call (the loop's deadline
        # is then never reached, and its waits are sliced).
        if timeout != float("inf"):
            timeout = seconds("timeout", timeout, optional=True)
        payload = dumps_payload(func, args, kwargs or {})
        with self._lock:
            self.start()
            return self._engine.call(payload, timeout)

    def restart(self) -> "World":
        """End the ranks and start fresh ones."""
        with self._lock:
            self._engine.stop()
            return self.start()

    def close(self) -> None:
        """End every rank and release the store's port. Idempotent; from another thread
        it ends the call in progress there (which raises) instead of waiting for it."""
        self._closed = True
        _open.discard(self)
        if not self._lock.acquire(blocking=False):
            self._engine.request_stop()  # the running call tears down and raises
            self._lock.acquire()
        try:
            self._engine.stop()
        finally:
            self._lock.release()

    def __enter__(self) -> "World":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def __repr__(self) -> str:
        state = ("closed" if self._closed else f"up, pids {self.pids}" if self._engine.up
                 else "not started")
        return f"<mplaunch.World nprocs={self.nprocs} backend={self.backend!r} {state}>"


@atexit.register
def _close_open_worlds() -> None:
    for world in list(_open):
        world.close()
