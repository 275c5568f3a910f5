"""mplaunch.World: ranks that stay up between calls, for notebooks and test suites.

A World is one Attempt whose ranks serve calls (_rank.serve) instead of running one function
and exiting. Each run() is a call driven to its replies by the same loop launch() uses,
so failures, timeouts, signals, output and teardown behave as for launch(). A run that
fails heals the world where it can (_engine.heal drives the call, _rank.pgroup is the ranks' side):
the ranks and their state stay, and the process group is rebuilt if a collective was
left half-done. What cannot be healed is torn down; the next run starts fresh ranks.
"""
from __future__ import annotations

import atexit
import contextlib
import logging
import sys
import threading
from typing import (Any, Callable, Iterator, List, Mapping, Optional, Sequence, Set,
                    TypeVar)

from ._engine import servers, signals
from ._engine.attempt import Attempt
from ._engine.config import LaunchConfig, check_call, seconds, validate, with_streams
from ._engine.heal import CallDriver, consequences_last, replace_rank, what_was_kept
from ._engine.outcome import error_for, results_or_raise
from ._engine.session import Session
from ._rank import procgroup
from ._rank.pgroup import group_state, rebuild
from ._wire.messages import RELEASE_SIGNAL
from ._wire import linux
from ._wire.payload import dumps_payload
from .errors import MainProcessError

log = logging.getLogger("mplaunch")
T = TypeVar("T")

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
        self._attempt: Optional[Attempt] = None
        self._stack: Optional[contextlib.ExitStack] = None
        self._generation = 0       # how many times ranks were started
        self._fresh: List[int] = []
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
    def fresh_ranks(self) -> List[int]:
        """The ranks that are fresh processes since the last run, their state gone:
        every rank after the world was torn down, the replaced ones after a run that
        healed a dead rank; [] once a run has begun. Send them their state again."""
        return list(self._fresh)

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
            self._fresh = []
            if self.heal:
                return self._healing_call(payload, timeout)
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
            # The first "call" is the set-up (init_process_group; nothing when the rank's
            # spec made it already): the ranks start from it. Sent by reference to the
            # rank's own module, so that loading it loads nothing of this side.
            session = stack.enter_context(
                Session(cfg, dumps_payload(procgroup.setup, (self.backend,), {})))
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

    def _send(self, payload: bytes) -> Attempt:
        attempt = self._attempt
        attempt.group.relay_to(sys.stdout, sys.stderr)
        with _payload_fd(payload) as fd:
            try:
                attempt.group.call(fd)
            except OSError:
                pass  # a rank is gone: the loop below finds out which, and why
        return attempt

    def _driven(self, on_signal, drive: Callable[[], None]) -> None:
        """Run `drive` with signals to this process forwarded to `on_signal`; whatever
        it raises tears the world down first."""
        try:
            with signals.forwarding(on_signal, warn=False):
                drive()
        except BaseException:
            self._stop()
            raise

    def _call(self, payload: bytes, timeout: Optional[float]) -> list:
        return self._wait_replies(self._send(payload), timeout)

    def _healing_call(self, payload: bytes, timeout: Optional[float]) -> list:
        attempt = self._send(payload)
        group = attempt.group
        driver = CallDriver(attempt, RELEASE_SIGNAL)
        group.heal = True
        try:
            self._driven(driver.on_signal, lambda: driver.drive(timeout))
        finally:
            group.heal = False
        if group.stopping or not group.running:
            return self._torn_down(attempt)
        group.relay_written()
        if not (group.failures or attempt.timed_out or driver.interrupted):
            return [r.result for r in group.ranks]
        consequences_last(group.failures)
        error = (KeyboardInterrupt() if driver.interrupted and not attempt.timed_out
                 else error_for(attempt, attempt.ending))
        _forget_failures(attempt)
        kept = self._settle(driver.released)
        if isinstance(error, KeyboardInterrupt):
            error.args = (f"mplaunch.World: the ranks were interrupted; {kept}",)
        else:
            error.healed = kept
        raise error

    def _settle(self, released: bool) -> str:
        """Bring the ranks back to a state all agree on, after a failed call every rank
        answered (or died): replace the dead ones, rebuild the process group if the
        ranks disagree about it; what the world kept, said for the error."""
        group = self._attempt.group
        dead = [r.local_rank for r in group.ranks if not r.alive]
        live = [r for r in group.ranks if r.alive]
        try:
            states = self._control(group_state, (), None, live)
            inited = [s for s in states if s["initialized"]]
            seqs = {s["seq"] for s in inited}
            if not (dead or released or (inited and len(inited) != len(states))
                    or len(seqs) > 1):
                return ("the world was kept: its ranks, their state and their process "
                        "group are as the failed run left them")
            backends = {s["backend"] for s in inited}
            backend = backends.pop() if len(backends) == 1 else self.backend
            n = max(s["incarnation"] for s in states)
            stale = self._rebuild(backend, n, dead, live)
        except (KeyboardInterrupt, MainProcessError):
            raise
        except BaseException as exc:  # noqa: BLE001 - whatever it was, it cannot be healed
            self._stop()
            return (f"the world could not be healed ({type(exc).__name__}: {exc}) and was "
                    "torn down; the next run starts fresh ranks")
        self._fresh = [group.ranks[i].spec.rank for i in dead]
        pids = {group.ranks[i].spec.rank: group.ranks[i].pid for i in dead}
        return what_was_kept(pids, backend, released, stale)

    def _rebuild(self, backend, n: int, dead: List[int], live) -> list:
        """Start a fresh process for each dead rank and build the group again in every
        rank (key space `n`); each live rank's names of stale objects."""
        group = self._attempt.group
        with _payload_fd(dumps_payload(rebuild, (backend, n), {})) as fd:
            # The fresh ranks first: a fork (start_method="fork") of this process while
            # its store serves the others' rendezvous could inherit a lock held.
            for i in dead:
                replace_rank(group, i, fd)
            group.call(fd, live)
        return self._wait_replies(self._attempt, max(30.0, self.cfg.grace_period),
                                  quiet=True)

    def _control(self, func, args, timeout, ranks) -> list:
        """A call of mplaunch's own in these ranks; torn down and raised if it fails."""
        attempt = self._attempt
        group = attempt.group
        with _payload_fd(dumps_payload(func, args, {})) as fd:
            group.call(fd, ranks)
        self._driven(attempt.on_signal, lambda: attempt.drive(
            until=lambda: all(r.has_result for r in ranks) or group.stopping,
            timeout=timeout))
        if group.stopping or not all(r.has_result for r in ranks):
            self._stop()
            results_or_raise(attempt)    # raises what stopped it
            raise RuntimeError("a rank did not answer mplaunch's own call")
        return [r.result for r in ranks]

    def _wait_replies(self, attempt: Attempt, timeout: Optional[float],
                      quiet: bool = False) -> list:
        group = attempt.group
        self._driven(attempt.on_signal, lambda: attempt.drive(
            until=lambda: group.replied and not group.stopping, timeout=timeout))
        if group.running and not group.stopping:
            group.relay_written()
            return [r.result for r in group.ranks]
        return self._torn_down(attempt, quiet)

    def _torn_down(self, attempt: Attempt, quiet: bool = False) -> list:
        self._stop()
        if not quiet:
            log.warning("mplaunch.World: the failed call tore the world's %d ranks down; "
                        "the next call starts fresh ranks", self.nprocs)
        return results_or_raise(attempt)

    def _stop(self) -> None:
        attempt, stack = self._attempt, self._stack
        self._attempt = self._stack = None
        if attempt is None:
            return
        self._fresh = [self.cfg.global_rank(i) for i in range(self.nprocs)]
        try:
            attempt.group.stop()
            attempt.drive()          # SIGTERM, then SIGKILL after the grace period
        finally:
            stack.close()            # the group, then the session


@contextlib.contextmanager
def _payload_fd(payload: bytes) -> Iterator[int]:
    """A memfd holding `payload` for the ranks; closed once they have their copies."""
    fd = linux.memfd_with(payload, "mplaunch-payload")
    try:
        yield fd
    finally:
        servers.close_fd(fd)


def _forget_failures(attempt: Attempt) -> None:
    """The world goes on: the next call starts with nothing failed."""
    group = attempt.group
    group.failures = []
    for r in group.ranks:
        r.error = None
    attempt.early = None
    attempt.signal_received = None


@atexit.register
def _close_open_worlds() -> None:
    for world in list(_open):
        world.close()
