"""Nodes of a multi-node launch watch each other through the launch's store.

The first node to see a failure claims it (compare_set: first writer wins), every node
tears its ranks down, the claiming node publishes the failure's details, and every node
raises that same error. Each node marks each attempt done; node 0 keeps the store up
until every node has, so nobody loses the report.

The store has no authentication: whoever reaches its port can set any key. So what
nodes read from it is data, never code: reports are JSON (a rank's exception travels as
its type name, message and traceback text, never as a pickle), node numbers are parsed
as ints, and with MPLAUNCH_TOKEN set in every node's environment each report carries an
HMAC of it, so a report nobody with the token wrote is refused.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import time
from typing import Optional

from ..._wire.messages import Raised
from ...errors import RankFailure, signal_name

log = logging.getLogger("mplaunch")
TOKEN_ENV = "MPLAUNCH_TOKEN"
_FAILURE_FIELDS = RankFailure.__slots__
_ERROR_FIELDS = ("type", "message", "traceback", "exitcode", "timestamp")

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
        return self._node_number(won)

    def _has(self, key: str) -> bool:
        return self._call(_has_key, self.store, key)

    def failed_node(self) -> Optional[int]:
        if self._has(self.prefix + "failed"):
            return self._node_number(self._call(self.store.get, self.prefix + "failed"))
        return None

    def _node_number(self, raw) -> int:
        try:
            node = int(raw)
        except (TypeError, ValueError):
            node = -1
        if not 0 <= node < self.nnodes:
            raise NodeLost(f"the launch's store holds {raw[:40]!r} where a node number "
                           f"was expected: something other than mplaunch writes to it")
        return node

    def publish(self, failures, error_msg) -> None:
        self._call(self.store.set, self.prefix + "report",
                   encode_report(failures, error_msg))

    def report(self, wait: float):
        """(failures, error message tuple) published by the failing node, or None (also
        for a report that is not one)."""
        end = time.monotonic() + wait
        while time.monotonic() < end:
            if self._has(self.prefix + "report"):
                raw = self._call(self.store.get, self.prefix + "report")
                try:
                    return decode_report(raw)
                except ValueError as exc:
                    log.warning("mplaunch ignored the failure report in its store: %s",
                                exc)
                    return None
            time.sleep(POLL_INTERVAL)
        return None

    def mark_done(self) -> None:
        self._call(self.store.add, self.prefix + "done", 1)

    def all_done(self) -> bool:
        return self._call(self.store.add, self.prefix + "done", 0) >= self.nnodes


_ABSENT = "\0mplaunch: no such key"


def _has_key(store, key: str) -> bool:
    """Whether `key` is in the store, without waiting for it. ``TCPStore.check`` where
    this torch has it (2.2 and newer); else a compare_set with an expected value no key
    ever holds: the store then sets nothing and answers that same value when the key is
    missing, and the key's value when it exists."""
    check = getattr(store, "check", None)
    if check is not None:
        return bool(check([key]))
    return store.compare_set(key, _ABSENT, _ABSENT) != _ABSENT.encode()


def _mac(token: str, body: bytes) -> str:
    return hmac.new(token.encode(), body, hashlib.sha256).hexdigest()


def encode_report(failures, error_msg: Optional[Raised]) -> bytes:
    """JSON for what a failing node tells the others: its failures, and the first
    failing rank's exception as text (its pickle, `blob`, stays here)."""
    error = None
    if error_msg is not None:
        r = error_msg
        error = dict(zip(_ERROR_FIELDS, (r.type_name, r.message, r.traceback, r.exitcode,
                                         r.timestamp)))
    body = json.dumps({"failures": [{k: getattr(f, k) for k in _FAILURE_FIELDS}
                                    for f in failures],
                       "error": error}).encode()
    token = os.environ.get(TOKEN_ENV)
    return json.dumps({"body": body.decode(),
                       "mac": _mac(token, body) if token else None}).encode()


def decode_report(raw):
    """(failures, Raised or None) from encode_report's bytes; ValueError for
    anything else, a report signed with another token, or an unsigned one where this
    node has a token."""
    try:
        outer = json.loads(raw)
        body = outer["body"].encode()
        mac = outer["mac"]
        data = json.loads(body)
        failures = [RankFailure(**{k: _plain(d[k]) for k in _FAILURE_FIELDS if k in d})
                    for d in data["failures"]]
        error = data["error"]
        error_msg = None if error is None else Raised(
            None, *(_plain(error[k]) for k in _ERROR_FIELDS))
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"not a node report ({type(exc).__name__}: {exc})") from None
    token = os.environ.get(TOKEN_ENV)
    if token and not (isinstance(mac, str) and hmac.compare_digest(mac, _mac(token, body))):
        raise ValueError(f"the report is not signed with this node's {TOKEN_ENV}")
    if not all(isinstance(f.rank, int) for f in failures):
        raise ValueError("not a node report (a failure without a rank number)")
    return failures, error_msg


def _plain(value):
    if value is not None and not isinstance(value, (str, int, float)):
        raise ValueError(f"unexpected {type(value).__name__} in a node report")
    return value


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

    def settle(self, attempt, report, sleep) -> Optional[str]:
        """Every local rank is gone. Wait for the other nodes to succeed (or for one to
        fail), exchange the failure report, and on node 0 keep the store up until every
        node has read it. `report()` gives this node's (failures, first error message);
        `sleep(seconds)` waits but wakes for a signal (attempt.signal_received). Returns
        what to record as this node's failure when the others were lost meanwhile and
        nothing else failed (the attempt records it), else None."""
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
                return str(exc)
        return None

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
