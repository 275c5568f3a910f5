"""Nodes of a multi-node launch watch each other through the launch's store.

The first node to see a failure claims it (compare_set: first writer wins), every node
tears its ranks down, the claiming node publishes the failure's details, and every node
raises that same error. Each node marks each attempt done; node 0 keeps the store up
until every node has, so nobody loses the report.
"""
from __future__ import annotations

import pickle
import time
from typing import Optional

from ..errors import signal_name

POLL_INTERVAL = 0.1  # network state has no fd to wait on; 10 checks a second is plenty


class NodeLost(RuntimeError):
    pass


class NodeWatch:
    def __init__(self, store, attempt: int, node_rank: int, nnodes: int):
        self.store = store
        self.node_rank = node_rank
        self.nnodes = nnodes
        self.prefix = f"mplaunch/attempt_{attempt}/"

    def _call(self, fn, *args):
        try:
            return fn(*args)
        except Exception as exc:  # noqa: BLE001 - torch raises several kinds
            raise NodeLost(f"lost contact with the launch's store: {exc}") from None

    def claim(self) -> int:
        """Claim the failure for this node; returns the node that holds the claim."""
        won = self._call(self.store.compare_set, self.prefix + "failed", "",
                         str(self.node_rank))
        return int(won)

    def failed_node(self) -> Optional[int]:
        if self._call(self.store.check, [self.prefix + "failed"]):
            return int(self._call(self.store.get, self.prefix + "failed"))
        return None

    def publish(self, failures, error_msg) -> None:
        self._call(self.store.set, self.prefix + "report",
                   pickle.dumps((failures, error_msg)))

    def report(self, wait: float):
        """(failures, error message tuple) published by the failing node, or None."""
        end = time.monotonic() + wait
        while time.monotonic() < end:
            if self._call(self.store.check, [self.prefix + "report"]):
                return pickle.loads(self._call(self.store.get, self.prefix + "report"))
            time.sleep(POLL_INTERVAL)
        return None

    def mark_done(self) -> None:
        self._call(self.store.add, self.prefix + "done", 1)

    def all_done(self) -> bool:
        return self._call(self.store.add, self.prefix + "done", 0) >= self.nnodes


class NodeSync:
    """This node's part in agreeing with the others on one attempt's outcome: claim a
    local failure, notice a remote one, and settle once the local ranks are gone."""

    def __init__(self, watch: NodeWatch):
        self.watch = watch
        self.claimed = False          # this node reported the attempt's failure
        self.claim_tried = False
        self.remote_node: Optional[int] = None    # another node failed first
        self.remote_report = None     # (failures, error message) from that node

    def claim(self) -> None:
        self.claim_tried = True
        if self.remote_node is not None:
            return
        try:
            won = self.watch.claim()
        except NodeLost:
            return
        if won == self.watch.node_rank:
            self.claimed = True
        else:
            self.remote_node = won

    def poll(self) -> Optional[int]:
        """The node that failed, if another one did (raises NodeLost)."""
        failed = self.watch.failed_node()
        if failed is not None and failed != self.watch.node_rank:
            self.remote_node = failed
            return failed
        return None

    def settle(self, attempt, report, sleep) -> None:
        """Every local rank is gone. Wait for the other nodes to succeed (or for one to
        fail), exchange the failure report, and on node 0 keep the store up until every
        node has read it. `report()` gives this node's (failures, first error message);
        `sleep(seconds)` waits but wakes for a signal (attempt.signal_received)."""
        w = self.watch
        try:
            if attempt.signal_received is not None and self.remote_node is None \
                    and not self.claimed:
                self.claim()
            if not attempt.group.failures and self.remote_node is None \
                    and not self.claimed and attempt.signal_received is None \
                    and not attempt.timed_out:
                self._wait_for_others(attempt, sleep)
            if self.claimed:
                failures, error = report()
                if not failures and attempt.signal_received is not None:
                    # Nothing failed here: this node was told to stop. Tell the others
                    # why their ranks are being torn down.
                    failures = [attempt.group.node_failure(
                        f"was torn down because node {w.node_rank}'s launcher received "
                        f"{signal_name(attempt.signal_received)}")]
                w.publish(failures, error)
            elif self.remote_node is not None:
                self.remote_report = w.report(wait=30.0)
            w.mark_done()
            if w.node_rank == 0:
                end = time.monotonic() + 30.0
                while not w.all_done() and time.monotonic() < end:
                    sleep(POLL_INTERVAL)
        except NodeLost as exc:
            if not attempt.group.failures and self.remote_node is None:
                attempt.group.failures.append(attempt.group.node_failure(str(exc)))

    def _wait_for_others(self, attempt, sleep) -> None:
        w = self.watch
        w._call(w.store.add, w.prefix + "ok", 1)
        while True:
            failed = w.failed_node()
            if failed is not None:
                self.remote_node = failed
                return
            if w._call(w.store.add, w.prefix + "ok", 0) >= w.nnodes:
                return
            if attempt.signal_received is not None:
                self.claim()
                return
            sleep(POLL_INTERVAL)
