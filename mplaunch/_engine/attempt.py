"""One attempt of a launch: a RankGroup driven from start to its end, with the three
things that can end it early besides a failing rank: a signal to this process, the
deadline, and another node's failure. What it amounts to is ``attempt.ending``
(_engine.ending), and the result or error to raise is _engine.outcome's."""
from __future__ import annotations

import signal
from typing import Callable, Optional, Sequence

from .config import LaunchConfig
from .ending import Ending, EndKind, decide
from .group import RankGroup
from .tasks.sync import POLL_INTERVAL, NodeLost, NodeSync, NodeWatch
from .outcome import first_error, local_failures
from .signals import Waker
from .timeouts import timed_out
from .._wire.spec import RankSpec


class Attempt:
    """Run with ``run()``; afterwards ``ending`` says how it ended and
    ``outcome.results_or_raise(attempt)`` what it amounts to."""

    def __init__(self, cfg: LaunchConfig, number: int, specs: Sequence[RankSpec],
                 payload_fd: int, waker: Waker, watch: Optional[NodeWatch] = None,
                 make_spawner=None):
        self.cfg = cfg
        self.number = number
        self.waker = waker
        self.group = RankGroup(cfg, specs, payload_fd, number, waker, make_spawner)
        self.nodes = NodeSync(watch) if watch is not None else None
        # Requests from a signal handler or another thread, acted on by the loop:
        self.signal_received: Optional[int] = None
        self._stop_grace: Optional[float] = None
        self._stop_asked = False
        # What made the loop tear the group down before its ranks ended (a stop or a
        # timeout); the first one counts.
        self.early: Optional[Ending] = None

    @property
    def ending(self) -> Ending:
        """How the attempt ended (meaningful once the group has ended)."""
        nodes = self.nodes
        return decide(self.early, self.signal_received, bool(self.group.failures),
                      nodes.remote_node if nodes is not None else None)

    @property
    def timed_out(self) -> bool:
        return self.early is not None and self.early.kind is EndKind.TIMED_OUT

    def on_signal(self, signo: int) -> None:
        """Called from a signal handler (or another thread): record, and let the loop
        act. The same signal twice: stop waiting for the grace period."""
        if self.signal_received is not None and signo == self.signal_received:
            self.group.hurry()
        self.signal_received = signo
        self.waker.wake()

    @property
    def stop_asked(self) -> bool:
        """request_stop() was called (from any thread); the loop acts on it."""
        return self._stop_asked

    @property
    def stop_grace(self) -> Optional[float]:
        """The grace period request_stop() asked for (None: the launch's)."""
        return self._stop_grace

    def request_stop(self, grace_period: Optional[float] = None) -> None:
        """From any thread: tear down as on a failure (Handle.stop, World.close)."""
        self._stop_grace = grace_period
        self._stop_asked = True
        self.waker.wake()

    def run(self, on_started: Optional[Callable[[], None]] = None) -> None:
        """Start the ranks and return once every one of them is gone (and, with several
        nodes, the nodes agree on the outcome)."""
        try:
            self.group.start()
            if on_started is not None:
                on_started()
            self.drive()
        finally:
            self.group.close()
        if self.nodes is not None:
            lost = self.nodes.settle(self, self._report, self.waker.sleep)
            if lost is not None:
                self.group.record(self.group.node_failure(lost))

    def drive(self, until: Optional[Callable[[], bool]] = None,
              timeout: Optional[float] = None) -> None:
        """Handle events until the group has ended, or `until()` holds; a `timeout`
        (default: the launch's) collects every rank's stack and tears down."""
        group, nodes = self.group, self.nodes
        timeout = self.cfg.timeout if timeout is None else timeout
        clock = group.debug.clock   # time a rank spends in a debugger does not count
        deadline = None if timeout is None else clock() + timeout
        while group.running and not (until is not None and until()):
            wait = None
            if deadline is not None and not group.stopping:
                wait = max(0.0, deadline - clock())
            if nodes is not None:
                # Network state has no fd to wait on.
                wait = POLL_INTERVAL if wait is None else min(wait, POLL_INTERVAL)
            group.wait(wait)
            if nodes is not None:
                self._watch_nodes()
            if group.stopping:
                continue
            if self.signal_received is not None:
                group.stop(self.signal_received)
            elif self._stop_asked:
                self.early = Ending(EndKind.STOPPED,
                                    stopped=[r.spec.rank for r in group.ranks if r.alive])
                group.stop(signal.SIGTERM, self._stop_grace)
            elif deadline is not None and group.running and clock() >= deadline:
                self.early = timed_out(group, timeout)
                group.stop(signal.SIGTERM)

    def _watch_nodes(self) -> None:
        group, nodes = self.group, self.nodes
        if group.failures and not nodes.claim_tried:
            nodes.claim()
        if group.stopping:
            return
        try:
            if nodes.poll() is not None:
                group.stop(signal.SIGTERM)
        except NodeLost as exc:
            group.fail(group.node_failure(str(exc)))

    def _report(self):
        failures = local_failures(self.group)
        return failures, first_error(self.group, failures)
