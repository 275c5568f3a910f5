"""RemoteSpawner: the spawner (_engine.spawners' seam) of a group whose ranks live on a
World's nodes (_engine.nodes.hub.Hub): it starts, signals and reaps them through the
nodes' agents, and hands their reports (started, exited, a lost node) to the group in
the group's own thread, through a queue and a pipe on its selector. It asks everything
of the Hub (start_rank, broadcast, drop_payloads...) and hears through Hub.report, which
posts the handler of each report (on_started, on_exited...) with it: the records are
dispatched once, by the Hub. Rejected: a spawner that held the pump's proxies and
payloads itself (before), and so depended on the pump's private state.

A node is lost when its connection ends, and also when its agent is there but answers
nothing (frozen, cut off): a signal request unanswered within SIGNAL_ACK_WAIT, or the
exits of ranks it was told to SIGKILL unreported within KILL_REPORT_WAIT, while nothing
at all arrives from it (an agent busy sending a large frame is alive).
"""
from __future__ import annotations

import os
import queue
import selectors
import signal
import threading
import time
from typing import Dict, List, Sequence

from .. import servers
from ..config import LaunchConfig
from .hub import Hub, Link, LinkLost
from ..._wire.link import (CloseGroup, Closed, Exited, ServerLost, SignalGroups,
                           SignalRanks, Started, StartFailed, Sweep, Swept)
from ..._wire.spec import RankSpec

__mplaunch_plumbing__ = True

KILL_REPORT_WAIT = 5.0   # for an agent to report the exits of ranks it SIGKILLed
SIGNAL_ACK_WAIT = 3.0    # for an agent to answer a signal request (it does at once)


class RemoteSpawner:
    """The spawner of a group whose ranks live on the hub's nodes (see spawners for the
    seam). Each rank's node is its spec's node_rank."""

    def __init__(self, cfg: LaunchConfig, events, hub: Hub):
        self.cfg = cfg
        self.events = events
        self.hub = hub
        self.lock = threading.RLock()
        self._queue: "queue.Queue" = queue.Queue()
        self._r = self._w = None
        self._wake = threading.Lock()   # the pipe's write end, between post() and close()
        self._sel = None
        self._tokens: Dict[int, Link] = {}   # each rank's node
        self._lost_seen: set = set()   # the links whose loss the group heard
        self._acks: set = set()
        self._exited: set = set()     # tokens whose exit was reported

    def post(self, handler, link: Link, record) -> None:
        """From any thread (Hub.report): `handler(link, record)` runs in the group's."""
        self._queue.put((handler, link, record))
        with self._wake:   # never into an fd number close() gave back and another took
            if self._w is not None:
                try:
                    os.write(self._w, b"x")
                except OSError:
                    pass

    def open(self, sel: selectors.BaseSelector) -> None:
        self._r, self._w = os.pipe()
        os.set_blocking(self._r, False)
        for fd in (self._r, self._w):
            servers.own_fd(fd)
        self._sel = sel
        sel.register(self._r, selectors.EVENT_READ, self._on_events)
        self.hub.open_group(self)

    def start(self, token: int, spec: RankSpec, fds: Sequence[int]) -> None:
        link = self.hub.links[spec.node_rank]
        self._tokens[token] = link
        self._exited.discard(token)     # a replaced rank's token is its new process's
        self.hub.start_rank(link, token, spec, fds)

    def pump(self) -> None:
        self._handle(self._queue.get())

    def _on_events(self, _fd) -> None:
        try:
            os.read(self._r, 4096)
        except BlockingIOError:
            pass
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            self._handle(item)

    def _handle(self, item) -> None:
        handler, link, record = item
        if self.events is not None:
            handler(link, record)

    # -- the reports' handlers (Hub.report posts them), in the group's thread ----------
    def on_started(self, _link: Link, rec: Started) -> None:
        self.events.started(rec.token, rec.pid)

    def on_exited(self, _link: Link, rec: Exited) -> None:
        self._exited.add(rec.token)
        self.events.exited(None, rec.status, rec.max_rss, rec.note, token=rec.token)

    def on_start_failed(self, _link: Link, rec: StartFailed) -> None:
        self.events.start_failed(rec.token, rec.reason)

    def on_server_lost(self, link: Link, rec: ServerLost) -> None:
        self._node_lost(link, rec.why, mended=False)   # its agent is there: no mend

    def on_link_lost(self, link: Link, rec: LinkLost) -> None:
        self._node_lost(link, f"mplaunch's agent there (pid {link.info.pid}) is gone: "
                              f"{rec.why}")

    def on_answer(self, link: Link, rec) -> None:
        """Swept or Closed: a round's answer (_round)."""
        self._acks.add((type(rec), link.info.index))

    def _node_lost(self, link: Link, why: str, mended: bool = True) -> None:
        """`mended`: a lost link, whose ranks a healing World's heal takes as dead ranks
        (replaced on the node's replacement, or left to World.restart(nnodes=M)); a lost
        server is not (its agent would start the ranks again there)."""
        if link in self._lost_seen or link not in self.hub.links:
            return   # said already, or a link a replacement took the place of
        self._lost_seen.add(link)
        tokens = [t for t, node in self._tokens.items() if node is link]
        coming = mended and self.hub.mends.mending(link.info.index)
        self.events.node_lost(tokens, f"is gone: its node, {link.describe()}, was lost: "
                                      f"{why}; every rank there is gone"
                                      + ("; a replacement node is on its way" if coming
                                         else ""), healable=mended)

    def forget(self, tokens) -> None:
        """The group let these ranks go (their node left the World: renumber)."""
        for token in tokens:
            if self._tokens.pop(token, None) is not None:
                self.hub.drop_rank_proxy(token)
            self._exited.discard(token)

    def _tokens_by_link(self, tokens):
        by: Dict[Link, List[int]] = {}
        for t in tokens:
            link = self._tokens.get(t)
            if link is not None:
                by.setdefault(link, []).append(t)
        return by

    def signal_groups(self, signo: int, pids, tokens=()) -> None:
        self._signal(SignalGroups, signo, tokens)

    def signal_ranks(self, signo: int, pids, tokens=()) -> None:
        self._signal(SignalRanks, signo, tokens)

    def _signal(self, request, signo: int, tokens) -> None:
        for link, ts in self._tokens_by_link(tokens).items():
            count = link.send_signal(request(signo, tuple(ts)))
            if count is None:
                continue
            self._arm(SIGNAL_ACK_WAIT, self._check_acked, (link, count, time.monotonic()))
            if signo == signal.SIGKILL:
                # A SIGKILLed rank's exit is reported within milliseconds; an agent that
                # does not report it (frozen, cut off) has lost its node.
                self._arm(KILL_REPORT_WAIT, self._check_killed,
                          (link, ts, time.monotonic()))

    @staticmethod
    def _arm(wait: float, check, args) -> None:
        timer = threading.Timer(wait, check, args)
        timer.daemon = True
        timer.start()

    @staticmethod
    def _talking(link: "Link", since: float) -> bool:
        """The agent sent something after `since`, or is sending now: it is alive, and
        busy (a large result on a slow network), not frozen."""
        return link.reading or link.heard > since

    def _check_acked(self, link: "Link", count: int, since: float) -> None:
        """In a timer's thread: signal request number `count` went SIGNAL_ACK_WAIT ago."""
        if self.events is None or link.lost is not None or link.acked >= count:
            return
        if self._talking(link, since):
            self._arm(SIGNAL_ACK_WAIT, self._check_acked,
                      (link, count, time.monotonic()))
            return
        self.hub.lose(link, f"its agent did not answer a signal request within "
                            f"{SIGNAL_ACK_WAIT:g} s (is the node frozen, or cut off?)")

    def _check_killed(self, link: "Link", tokens, since: float) -> None:
        """In a timer's thread: `tokens` were SIGKILLed KILL_REPORT_WAIT ago."""
        if self.events is None or link.lost is not None:
            return
        if not any(t in self._tokens and t not in self._exited for t in tokens):
            return
        if link.reading:   # the reports may be queued behind a large frame
            self._arm(KILL_REPORT_WAIT, self._check_killed, (link, tokens, since))
            return
        self.hub.lose(link, f"its agent did not report its ranks' exits within "
                            f"{KILL_REPORT_WAIT:g} s of their SIGKILL (is the node frozen, "
                            f"or cut off?)")

    def _round(self, request, answer: type, timeout: float) -> None:
        """`request` to every agent, and each one's `answer` waited for (a lost node's
        is not)."""
        self._acks = set()
        waiting = {link.info.index for link in self.hub.broadcast(request)}
        end = time.monotonic() + timeout
        while waiting and time.monotonic() < end:
            try:
                item = self._queue.get(timeout=max(0.01, end - time.monotonic()))
            except queue.Empty:
                break
            self._handle(item)
            waiting -= {i for k, i in self._acks if k is answer}
            waiting = {i for i in waiting if self.hub.links[i].lost is None}

    def clock_offset_ns(self, node: int) -> int:
        return self.hub.links[node].info.clock_offset_ns

    def sweep(self, timeout: float = 5.0) -> None:
        self._round(Sweep(), Swept, timeout)

    def close(self) -> None:
        self._round(CloseGroup(), Closed, 15.0)
        self.hub.drop_payloads()    # the agents dropped theirs with the group
        for token in list(self._tokens):
            self.hub.drop_rank_proxy(token)
        self._tokens = {}
        self.hub.end_group(self)
        if self._sel is not None and self._r is not None:
            try:
                self._sel.unregister(self._r)
            except (KeyError, ValueError):
                pass
        with self._wake:
            fds, self._r, self._w = (self._r, self._w), None, None
        for fd in fds:
            if fd is not None:
                servers.close_fd(fd)
