"""Run: one launch from its first rank to its outcome: a Session (payload, store,
waker, server) and the attempts it holds, restarted on failure up to max_restarts.
launch() drives it inline, start() in a thread.
"""
from __future__ import annotations

import threading
import weakref
from typing import Any, Dict, List, Optional, Union

from . import signals
from .attempt import Attempt
from .config import LaunchConfig
from .tasks.sync import NodeWatch
from .outcome import results_or_raise
from .sampling import LateSampler
from .stragglers import take_records
from .session import Session
from .timeouts import collect_stacks, hush
from .._wire.buffers import Payload
from .._wire.stacks import RankStacks
from ..errors import WorkerError


def running() -> List["Run"]:
    """The launches this process is driving now (the watcher's SIGUSR1 shows their
    stacks)."""
    return list(_driven)


class Run:
    """One launch from its first rank to its outcome: the payload, the store, and the
    attempts. Signals to this process are forwarded to the current attempt."""

    def __init__(self, cfg: LaunchConfig, payload: Union[bytes, Payload],
                 forward_signals: bool = True):
        self.cfg = cfg
        self.payload = payload
        self.forward_signals = forward_signals  # else the caller forwards (Handle.wait)
        self.attempt: Optional[Attempt] = None
        self.stop_asked = False
        self.stop_grace: Optional[float] = None
        self.started = threading.Event()   # the first attempt's ranks all have pids
        self._pids: Dict[int, int] = {}
        # per rank, the collectives the last attempt's ranks started (_rank.flight)
        self.collectives: Dict[int, list] = {}
        self.flight_off: Optional[str] = None   # why the ranks could read none
        self.late: dict = {}   # the late rank's sampled stacks (_engine.sampling)

    @property
    def pids(self) -> Dict[int, int]:
        """{rank: pid} of the current (else the last) attempt's ranks."""
        attempt = self.attempt
        return attempt.group.pids if attempt is not None else dict(self._pids)

    def stop(self, grace_period: Optional[float] = None) -> None:
        """From any thread: end the current attempt as on a failure, and start no
        other."""
        self.stop_grace, self.stop_asked = grace_period, True
        attempt = self.attempt
        if attempt is not None:
            attempt.request_stop(grace_period)

    def stacks(self) -> RankStacks:
        """From any thread: where each rank of the current attempt is now."""
        attempt = self.attempt
        return RankStacks(collect_stacks(attempt.group) if attempt is not None else {})

    def on_signal(self, signo: int) -> None:
        """From a signal handler or another thread: the current attempt stops."""
        attempt = self.attempt
        if attempt is not None:
            attempt.on_signal(signo)

    def drive(self) -> List[Any]:
        """Run attempts until one succeeds or max_restarts is spent."""
        _driven.add(self)
        try:
            return self._drive()
        finally:
            _driven.discard(self)

    def _drive(self) -> List[Any]:
        cfg = self.cfg
        previous: list = []
        with Session(cfg, self.payload) as session:
            for number in range(cfg.max_restarts + 1):
                try:
                    return self._attempt(number, session)
                except WorkerError as err:
                    if number >= cfg.max_restarts or self.stop_asked:
                        if previous:
                            err.previous_attempts = previous + err.previous_attempts
                            err.args = (err._message(),)
                        raise
                    previous.append(err.failures)
        raise AssertionError("unreachable")  # pragma: no cover

    def _attempt(self, number: int, session: Session) -> List[Any]:
        cfg = self.cfg
        session.wait_server()
        watch = (NodeWatch(session.hosted.store, number, cfg.node_rank, cfg.nnodes)
                 if cfg.nnodes > 1 else None)
        attempt = Attempt(cfg, number, session.specs(number), session.payload_fd,
                          session.waker, watch)
        self.attempt = attempt
        if self.stop_asked:
            attempt.request_stop(self.stop_grace)
        sampler = LateSampler()
        sampler.begin(attempt.group)
        try:
            if self.forward_signals:
                with signals.forwarding(self.on_signal, wake_fd=session.waker.w):
                    attempt.run(self.started.set)
            else:
                attempt.run(self.started.set)
        finally:
            self.late = sampler.end()
            hush(attempt.group)
            self._pids = attempt.group.pids
            self.collectives, self.flight_off = take_records(attempt.group)
            self.attempt = None
        return results_or_raise(attempt)


_driven: "weakref.WeakSet[Run]" = weakref.WeakSet()
