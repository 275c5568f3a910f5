"""A group of ranks: started together, watched on one selector, ended together.

Lifetime: ``start()``, then ``wait()`` in a loop while ``running`` (each call handles what
happened: results, output, exits, the SIGTERM -> grace -> SIGKILL escalation), ``stop()``
to tear down as on a failure, and ``close()``, which returns only once every process of
the group, grandchildren included, is gone and its output relayed. What the outcome *is*
(a list of results or an error) is decided elsewhere (_engine.ending, _engine.outcome),
from ``ranks`` and ``failures``.
"""
from __future__ import annotations

import contextlib
import os
import pickle
import selectors
import signal
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

from . import spawners
from .failures import exited as exit_failure, gone_with_node, of_node, of_rank, raised
from .config import LaunchConfig
from .output import StreamRelay, read_pipe, relay_pending
from .screen import screen_for
from .membership import Membership
from .ranks import RankState, drain_outputs
from .signals import Waker
from .._wire.channel import send_framed
from .debugging import Debugging
from .._wire.messages import (CALL_TAG, RESULT_TAG, Collectives, DebugAsk, KeptGlobals,
                              Raised, Returned)
from .._wire.payload import loads_result
from .._wire.spec import RankSpec
from ..errors import RankFailure

_DRAIN_WAIT = 2.0      # how long output pipes may stay open after every rank is gone
_MAX_SELECT = 86400.0
_EXIT_WAIT = 10.0      # how long close() waits for SIGKILLed ranks to be reaped


@dataclass
class Teardown:
    """A group's teardown, once begun: `signal` went to every rank at `since`, and
    SIGKILL follows at `kill_at` (monotonic times)."""
    signal: int
    since: float
    wall: float         # `since` as time.time(), to compare with the ranks' timestamps
    kill_at: float
    killed: bool = False


class RankGroup(Membership):
    """This node's ranks of one attempt. ``waker`` lets someone else (a signal handler,
    another thread) make ``wait()`` return early. How ranks are started, signalled and
    reaped is the spawner's (_engine.spawners); the group only keeps their state."""

    def __init__(self, cfg: LaunchConfig, specs: Sequence[RankSpec], payload_fd: int,
                 attempt: int, waker: Waker, make_spawner=None):
        self.cfg = cfg
        # log_dir's attempt_<n>; its failures' "[attempt N]": none in a World (no retries)
        self.number, self.attempt = attempt, 0 if any(s.serve for s in specs) else attempt
        self.payload_fd = payload_fd
        self._sinks = None   # relay_to's last sinks and their screens (_relay_to)
        self._specs = list(specs)
        self.ranks: List[RankState] = [RankState(s) for s in specs]
        self._tokens: Dict[int, RankState] = {}   # each started rank by its token
        self._by_rank_logs = len({s.node_rank for s in specs}) > 1
        self.failures: List[RankFailure] = []
        self.teardown: Optional[Teardown] = None
        self.spawner = (make_spawner or spawners.for_config)(cfg, self)
        # Held while another thread reads the ranks' stacks (_engine.timeouts): the
        # ranks' fds stay open, fork-mode pids unreaped and channel sends whole meanwhile.
        self.lock = self.spawner.lock
        self._by_pid: Dict[int, RankState] = {}
        self._sel = selectors.DefaultSelector()
        self.debug = Debugging(self._sel, cfg, self)   # pdb, input() in ranks
        self._waker = waker
        self._closed = False
        self.heal = False   # a healing World's call: see fail()

    @property
    def running(self) -> bool:
        return any(r.alive for r in self.ranks)

    @property
    def stopping(self) -> bool:
        return self.teardown is not None

    @property
    def pids(self) -> Dict[int, int]:
        return {r.spec.rank: r.pid for r in self.ranks if r.pid is not None}

    # -- starting --------------------------------------------------------------------
    def start(self) -> None:
        """Start every rank; returns once each has a pid."""
        self.spawner.open(self._sel)
        self._sel.register(self._waker.r, selectors.EVENT_READ, self._on_wake)
        for r in self.ranks:
            self._start_one(r)
        while any(r.pid is None and r.alive for r in self.ranks):   # started, or failed to
            self.spawner.pump()

    def _start_one(self, r: RankState, payload_fd: Optional[int] = None) -> None:
        if self._by_rank_logs:
            r.log_name = str(r.spec.rank)
        child_fds = r.open(self.cfg, self.number,
                           self.payload_fd if payload_fd is None else payload_fd)
        if r.token is None:
            # Its place in the group when it started (local_rank is not one across
            # nodes); its own from then on (renumber)
            r.token = self.ranks.index(r)
        self._tokens[r.token] = r
        try:
            self.spawner.start(r.token, r.spec, child_fds)
        finally:
            r.close_child_ends()
        self._sel.register(r.reader.sock, selectors.EVENT_READ, ("result", r))
        self._sel.register(r.out_fd, selectors.EVENT_READ, ("out", r))
        self._sel.register(r.err_fd, selectors.EVENT_READ, ("err", r))

    # -- what the spawner reports ----------------------------------------------------------
    def started(self, token: int, pid: int) -> None:
        r = self._tokens.get(token)
        if r is None:
            return   # a rank the group let go of (renumber)
        r.pid = pid
        self._by_pid[pid] = r
        if self.teardown is not None:
            self._signal(self.teardown.signal, [r])

    def exited(self, pid: int, status: int, max_rss: Optional[int] = None,
               note: Optional[str] = None, token: Optional[int] = None) -> None:
        """`note`: the kernel's word on its death (OOM); `token`: it, if pids repeat."""
        r = self._tokens.get(token) if token is not None else self._by_pid.get(pid)
        if r is not None and r.alive and r.pid is not None:
            r.max_rss, r.exit_note = max_rss, note
            self._on_exit(r, status)

    def node_lost(self, tokens: Sequence[int], message: str, healable=False) -> None:
        """A node is gone with its ranks: their deaths; the group torn down unless they
        are `healable` in a healing World's call: dead ranks, which its heal replaces on
        the node's replacement, or leaves to World.restart(nnodes=M) where there is
        none."""
        lost = [r for r in (self._tokens.get(t) for t in tokens)
                if r is not None and r.alive]
        for r in lost:
            r.status, r.exited_at = signal.SIGKILL, time.time()
            self.record(gone_with_node(r, self.attempt, message if r is lost[0] else None))
        if not (healable and self.heal):
            self.stop(signal.SIGTERM)

    def start_failed(self, token: int, reason: str) -> None:
        r = self._tokens.get(token)
        if r is None:
            return
        r.status = 1 << 8    # dead without a pid: it never started
        self.fail(of_rank(r, self.attempt, exitcode=1,
                          message=f"could not start: {reason}"))

    def server_lost(self, pid: Optional[int], how: str) -> None:
        """The server (`pid`) died (`how`: "was killed by SIGKILL"), and every rank it
        started with it (parent-death signal)."""
        dead = [r for r in self.ranks if r.alive]
        who = f" (pid {pid})" if pid is not None else ""
        first = (f"mplaunch's server process{who} {how}, and every rank was killed with "
                 "it; the next launch starts a new server")
        for r in dead:
            r.status = signal.SIGKILL
            self.fail(of_rank(
                r, self.attempt, exitcode=-signal.SIGKILL, signal="SIGKILL",
                message=first if r is dead[0] else "it died with mplaunch's server process"))

    # -- calls (a World's ranks stay up between them) ----------------------------------
    def call(self, payload_fd: int, ranks: Optional[Sequence[RankState]] = None,
             ahead: bytes = b"") -> None:
        """Each rank (or these) runs `payload_fd`'s payload after `ahead` (its reloads)."""
        self.debug.new_call()
        for r in self.ranks if ranks is None else ranks:
            r.has_result, r.result, r.error = False, None, None
            r.calls += 1
            if r.err is not None:
                r.err.begin_call()   # its stderr tail is this call's (_engine.output)
            send_framed(r.reader.sock, ahead) if ahead else None
            send_framed(r.reader.sock, CALL_TAG, [payload_fd])

    @property
    def replied(self) -> bool:
        return all(r.has_result for r in self.ranks)

    def relay_written(self) -> None:
        """Relay all the ranks have written so far, a last line without its newline
        included: once every rank has answered a call, that call's output goes to the
        streams it was called with, not to the next call's (the ranks flushed their
        streams before answering; the pipes may hold more than one read)."""
        for r in self.ranks:
            relay_pending(r, end_line=True)

    def relay_to(self, stdout, stderr) -> None:
        """Relay the ranks' output to these streams from now on."""
        self._sinks = _relay_to(self.ranks, self._sinks, (stdout, stderr))

    # -- waiting ---------------------------------------------------------------------
    def wait(self, timeout: Optional[float]) -> None:
        """Handle what happens within `timeout` seconds (None: until something does),
        and escalate a teardown whose grace period is over."""
        td = self.teardown
        if td is not None and not td.killed:
            left = max(0.0, td.kill_at - time.monotonic())
            timeout = left if timeout is None else min(timeout, left)
        if timeout is not None:
            # epoll takes at most ~24 days (an int of ms); callers loop until their
            # deadline, so a longer limit is waited out in slices.
            timeout = min(timeout, _MAX_SELECT)
        for key, _ in self._sel.select(timeout):
            self._dispatch(key)
        if td is not None and not td.killed and time.monotonic() >= td.kill_at:
            self._signal(signal.SIGKILL, [r for r in self.ranks if r.alive])
            td.killed = True

    def _dispatch(self, key) -> None:
        data = key.data
        if callable(data):
            data(key.fileobj)
            return
        kind, r = data
        if kind == "result":
            self._read_result(r)
        elif kind == "out":
            self._read_output(r.out_fd, r.out)
        elif kind == "err":
            self._read_output(r.err_fd, r.err)

    def _on_wake(self, _fd) -> None:
        self._waker.drain()
        self.debug.take_posts()   # answers another thread gave (_engine.debugging)

    def _read_result(self, r: RankState) -> None:
        for data, fds in r.reader.read_available():
            self._on_message(r, data, fds)
        if r.reader.eof:
            self._unregister(r.reader.sock)

    def _on_message(self, r: RankState, data: bytes, fds: list) -> None:
        tag, body = data[:1], data[1:]
        msg = _answer(r, tag, body, fds, self.debug)
        if msg is _NOT_AN_ANSWER:
            return
        if tag == RESULT_TAG:
            try:
                r.result = loads_result(body, fds)
                r.has_result = True
            except Exception as exc:  # noqa: BLE001
                r.error = Raised(None, type(exc).__name__,
                                 f"the parent could not unpickle rank {r.spec.rank}'s "
                                 f"return value: {exc}", None, 1, time.time())
                if not self.stopping:
                    self.fail(raised(r, self.attempt, r.error))
        elif isinstance(msg, Returned):
            r.result, r.has_result = msg.value, True
        elif isinstance(msg, Raised):
            r.error = msg
            # An error raised after the teardown began is its consequence, not a cause.
            if self.teardown is None or msg.timestamp <= self.teardown.wall:
                self.fail(raised(r, self.attempt, msg))

    def _read_output(self, fd: int, relay: StreamRelay) -> None:
        chunk = read_pipe(fd)
        if chunk is None:
            return
        if chunk == b"":
            self._unregister(fd)
            return
        relay.feed(chunk)

    # -- exits and failures ----------------------------------------------------------
    def _on_exit(self, r: RankState, status: int) -> None:
        r.status = status
        r.exited_at = time.time()
        if r.reader.sock.fileno() != -1:
            self._read_result(r)  # everything it sent is already in the socket
        if r.error is not None or self.stopping:
            return
        failure = exit_failure(r, self.attempt, status)
        if failure is not None:
            self.fail(failure)   # a healing World replaces it after the call

    def record(self, failure: RankFailure) -> None:
        """Record a failure, and nothing else (found once the ranks are gone)."""
        self.failures.append(failure)

    def fail(self, failure: RankFailure) -> None:
        """Record a failure of this node and tear the group down; in a healing World's
        call, a rank's failure is its answer instead (_engine.heal decides the rest)."""
        self.record(failure)
        if not self.heal or failure.local_rank is None:
            self.stop(signal.SIGTERM)

    def node_failure(self, message: str) -> RankFailure:
        """A failure of this node as a whole, recorded under its first rank."""
        return of_node(self.ranks[0].spec, self.attempt, message)

    # -- stopping --------------------------------------------------------------------
    def stop(self, signo: int = signal.SIGTERM,
             grace_period: Optional[float] = None) -> None:
        """Begin tearing down (once): `signo` to every rank now, SIGKILL after the grace
        period (driven by wait())."""
        if self.teardown is not None:
            return
        now = time.monotonic()
        grace = self.cfg.grace_period if grace_period is None else grace_period
        self.teardown = Teardown(signo, now, time.time(), now + grace)
        self.debug.interrupt()
        self._signal(signo, [r for r in self.ranks if r.alive])

    def hurry(self) -> None:
        """Asked twice: do not wait for the rest of the grace period."""
        if self.teardown is not None:
            self.teardown.kill_at = 0.0

    def send_signal(self, signo: int, ranks: Sequence[RankState]) -> None:
        """Deliver `signo` to these ranks' processes (not their groups). Any thread:
        under the lock, a fork-mode rank is not reaped meanwhile, so its pid is its."""
        with self.lock:
            ranks = [r for r in ranks if r.signalable]
            if ranks:
                self.spawner.signal_ranks(signo, [r.pid for r in ranks],
                                          tokens=[r.token for r in ranks])

    def _signal(self, signo: int, ranks) -> None:
        """`signo` to each rank's whole process group (its descendants too)."""
        ranks = [r for r in ranks if r.pid is not None]
        if ranks:
            self.spawner.signal_groups(signo, [r.pid for r in ranks],
                                       tokens=[r.token for r in ranks])

    def _unregister(self, fileobj) -> None:
        with contextlib.suppress(KeyError, ValueError):
            self._sel.unregister(fileobj)

    # -- the end ---------------------------------------------------------------------
    def close(self) -> None:
        """Kill what is still running, kill orphans, relay the last output, close every
        fd. Idempotent; returns only when every process of the group is gone."""
        if self._closed:
            return
        self._closed = True
        alive = [r for r in self.ranks if r.signalable]
        if alive:
            self._signal(signal.SIGKILL, alive)
            end = time.monotonic() + _EXIT_WAIT
            while any(r.alive for r in alive) and time.monotonic() < end:
                for key, _ in self._sel.select(0.5):
                    self._dispatch(key)
        self.spawner.sweep()
        drain_outputs(self.ranks, _DRAIN_WAIT)
        with self.lock:
            for r in self.ranks:
                r.close()
        self.spawner.close()
        # It reports to us and we hold it: else the pair lives until the cycle collector.
        self.spawner.events = None
        self._sel.close()


_NOT_AN_ANSWER = object()


def _answer(r: RankState, tag: bytes, body: bytes, fds: list, debug: Debugging):
    """A message of rank `r` as the current call sees it: its answer (the record, or
    None for a RESULT_TAG result, whose fds are then the caller's), counted off, or
    _NOT_AN_ANSWER: a KeptGlobals note (kept on `r`, before its answer), or anything
    about a call before the current one (see RankState.calls), which only counts that
    call off."""
    stale = r.calls - r.answers > 1
    msg = None
    if tag != RESULT_TAG or stale:
        for fd in fds:
            os.close(fd)
    if tag != RESULT_TAG:
        try:
            msg = pickle.loads(body)
        except Exception:  # noqa: BLE001 - unreadable: an answer all the same
            if not stale:
                raise
    if isinstance(msg, KeptGlobals):
        if not stale:
            r.kept_globals += msg.names   # before its answer (_wire.mainglobals)
        return _NOT_AN_ANSWER
    if isinstance(msg, Collectives):
        if not stale:
            r.collectives.append(msg)   # before its answer (_rank.flight)
        return _NOT_AN_ANSWER
    if isinstance(msg, DebugAsk):
        # Not an answer: a request for a line (an older call's: refused as interrupted)
        if stale:
            debug.refuse(r)
        else:
            debug.on_ask(r, msg)
        return _NOT_AN_ANSWER
    r.answers += 1
    if not stale:
        debug.gone(r)   # it answered: a line it asked for is no longer wanted
    return _NOT_AN_ANSWER if stale else msg


def _relay_to(ranks, last, sinks):
    """Point the ranks' relays at `sinks` (stdout, stderr); (`sinks`, their screens),
    for the next time. Each stream's screen is looked up once (a tty check and an
    fstat), not once per rank's relay, and not again (`last`'s) while a World's calls
    write to the same stream objects."""
    if last is None or any(a is not b for a, b in zip(last[0], sinks)):
        last = sinks, {id(s): screen_for(s) for s in sinks if s is not None}
    for r in ranks:
        for relay, sink in ((r.out, sinks[0]), (r.err, sinks[1])):
            if relay is not None and relay.sink is not None:
                relay.retarget(sink, last[1].get(id(sink)))
    return last
