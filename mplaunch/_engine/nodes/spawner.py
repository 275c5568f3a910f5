"""RemoteSpawner: the spawner (_engine.spawners' seam) of a group whose ranks live on a
World's nodes (_engine.nodes.hub.Hub): it starts, signals and reaps them through the nodes'
agents, and hands their reports (started, exited, a lost node) to the group in the
group's own thread, through a queue and a pipe on its selector.

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
from .pump import _Proxy
from .hub import Hub, Link
from ..._wire import tunnel
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
        self._sel = None
        self._tokens: Dict[int, _Proxy] = {}
        self._lost_seen: set = set()
        self._acks: set = set()
        self._exited: set = set()     # tokens whose exit was reported

    def post(self, item) -> None:
        """From the pump thread."""
        self._queue.put(item)
        w = self._w
        if w is not None:
            try:
                os.write(w, b"x")
            except OSError:
                pass

    def open(self, sel: selectors.BaseSelector) -> None:
        self._r, self._w = os.pipe()
        os.set_blocking(self._r, False)
        for fd in (self._r, self._w):
            servers.own_fd(fd)
        self._sel = sel
        sel.register(self._r, selectors.EVENT_READ, self._on_events)
        self.hub.spawner = self
        for link in self.hub.links:
            link.send(tunnel.OPEN)
        for link in self.hub.links:
            if link.lost is not None:
                self.post((None, 0, link.lost, link))

    def start(self, token: int, spec: RankSpec, fds: Sequence[int]) -> None:
        link = self.hub.links[spec.node_rank]
        proxy = _Proxy(token, link, fds)
        old = self._tokens.pop(token, None)
        if old is not None:
            self.hub.pump.drop_proxy(token)
        self._tokens[token] = proxy
        self._exited.discard(token)     # a replaced rank's token is its new process's
        self.hub.pump.add_proxy(proxy)
        if not self.hub.pump.payloads.send(link, tunnel.START, token, [fds[0]],
                                           lambda keys: (spec, keys[0])):
            self.post((tunnel.START_FAILED, token,
                       f"{link.describe()} is lost: {link.lost}", link))

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
        kind, token, body, link = item
        ev = self.events
        if ev is None:
            return
        if kind == tunnel.STARTED:
            ev.started(token, body)
        elif kind == tunnel.EXITED:
            self._exited.add(token)
            status, max_rss, note = body
            ev.exited(None, status, max_rss, note, token=token)
        elif kind == tunnel.START_FAILED:
            ev.start_failed(token, body)
        elif kind == tunnel.SERVER_LOST:
            self._node_lost(link, body)
        elif kind is None:
            self._node_lost(link, f"mplaunch's agent there (pid {link.info.pid}) is "
                                  f"gone: {body}")
        elif kind in (tunnel.SWEPT, tunnel.CLOSED):
            self._acks.add((kind, link.info.index))

    def _node_lost(self, link: Link, why: str) -> None:
        if link.info.index in self._lost_seen:
            return
        self._lost_seen.add(link.info.index)
        tokens = [t for t, p in self._tokens.items() if p.link is link]
        self.events.node_lost(tokens, f"is gone: its node, {link.describe()}, was lost: "
                                      f"{why}; every rank there is gone")

    def _tokens_by_link(self, tokens):
        by: Dict[int, List[int]] = {}
        for t in tokens:
            proxy = self._tokens.get(t)
            if proxy is not None:
                by.setdefault(proxy.link.info.index, []).append(t)
        return by

    def signal_groups(self, signo: int, pids, tokens=()) -> None:
        self._signal(tunnel.SIGNAL_GROUPS, signo, tokens)

    def signal_ranks(self, signo: int, pids, tokens=()) -> None:
        self._signal(tunnel.SIGNAL_RANKS, signo, tokens)

    def _signal(self, kind: int, signo: int, tokens) -> None:
        for node, ts in self._tokens_by_link(tokens).items():
            link = self.hub.links[node]
            if not link.send(kind, 0, (signo, ts)):
                continue
            link.signals += 1
            self._arm(SIGNAL_ACK_WAIT, self._check_acked,
                      (link, link.signals, time.monotonic()))
            if signo == signal.SIGKILL:
                # A SIGKILLed rank's exit is reported within milliseconds; an agent that
                # does not report it (frozen, cut off) has lost its node.
                self._arm(KILL_REPORT_WAIT, self._check_killed, (link, ts, time.monotonic()))

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
        link.lost = (f"its agent did not answer a signal request within "
                     f"{SIGNAL_ACK_WAIT:g} s (is the node frozen, or cut off?)")
        self.post((None, 0, link.lost, link))

    def _check_killed(self, link: "Link", tokens, since: float) -> None:
        """In a timer's thread: `tokens` were SIGKILLed KILL_REPORT_WAIT ago."""
        if self.events is None or link.lost is not None:
            return
        if not any(t in self._tokens and t not in self._exited for t in tokens):
            return
        if link.reading:   # the reports may be queued behind a large frame
            self._arm(KILL_REPORT_WAIT, self._check_killed, (link, tokens, since))
            return
        link.lost = (f"its agent did not report its ranks' exits within "
                     f"{KILL_REPORT_WAIT:g} s of their SIGKILL (is the node frozen, or "
                     f"cut off?)")
        self.post((None, 0, link.lost, link))

    def _round(self, kind: int, ack: int, timeout: float) -> None:
        self._acks = set()
        waiting = {link.info.index for link in self.hub.links if link.send(kind)}
        end = time.monotonic() + timeout
        while waiting and time.monotonic() < end:
            try:
                item = self._queue.get(timeout=max(0.01, end - time.monotonic()))
            except queue.Empty:
                break
            self._handle(item)
            waiting -= {i for k, i in self._acks if k == ack}
            waiting = {i for i in waiting if self.hub.links[i].lost is None}

    def sweep(self, timeout: float = 5.0) -> None:
        self._round(tunnel.SWEEP, tunnel.SWEPT, timeout)

    def close(self) -> None:
        self._round(tunnel.CLOSE_GROUP, tunnel.CLOSED, 15.0)
        self.hub.pump.payloads.clear()    # the agents dropped theirs with the group
        for token in list(self._tokens):
            self.hub.pump.drop_proxy(token)
        self._tokens = {}
        self.hub.spawner = None
        if self._sel is not None and self._r is not None:
            try:
                self._sel.unregister(self._r)
            except (KeyError, ValueError):
                pass
        for fd in (self._r, self._w):
            if fd is not None:
                servers.close_fd(fd)
        self._r = self._w = None
