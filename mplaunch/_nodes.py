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
