"""A group of ranks: started together, watched on one selector, ended together.

Lifetime: ``start()``, then ``wait()`` in a loop while ``running`` (each call handles what
happened: results, output, exits, the SIGTERM -> grace -> SIGKILL escalation), ``stop()``
to tear down as on a failure, and ``close()``, which returns only once every process of
the group, grandchildren included, is gone and its output relayed. What the outcome *is*
(a list of results or an error) is decided elsewhere (_outcome), from ``ranks`` and
``failures``.
"""
from __future__ import annotations

import os
import pickle
import selectors
import signal
import socket
import time
from typing import Dict, List, Optional, Sequence

from . import _procs, _sys
from ._channel import RANK_FDS, recv_obj, send_framed, send_obj
from ._config import LaunchConfig, RankSpec
from ._output import StreamRelay, read_pipe
from ._ranks import RankState, drain_outputs
from ._serialize import loads_result
from ._signals import Waker
from .errors import RankFailure, signal_name

_DRAIN_WAIT = 2.0      # how long output pipes may stay open after every rank is gone
_MAX_SELECT = 86400.0
_EXIT_WAIT = 10.0      # how long close() waits for SIGKILLed ranks to be reaped


class RankGroup:
    """This node's ranks of one attempt. ``waker`` lets someone else (a signal handler,
    another thread) make ``wait()`` return early."""

    def __init__(self, cfg: LaunchConfig, specs: Sequence[RankSpec], payload_fd: int,
                 attempt: int, waker: Waker):
        self.cfg = cfg
        self.attempt = attempt
        self.payload_fd = payload_fd
        self.ranks: List[RankState] = [RankState(s) for s in specs]
        self.failures: List[RankFailure] = []
        self.stopping_since: Optional[float] = None   # monotonic time teardown began
        self.stop_wall: Optional[float] = None        # the same, as time.time()
        self.stop_signal = signal.SIGTERM
        self.kill_deadline: Optional[float] = None
        self.killed = False
        self._by_pid: Dict[int, RankState] = {}
        self._sel = selectors.DefaultSelector()
        self._waker = waker
        self._channel: Optional[socket.socket] = None
        self._fork_descendants: set = set()
        self._closed = False

    @property
    def running(self) -> bool:
        return any(r.alive for r in self.ranks)

    @property
    def stopping(self) -> bool:
        return self.stopping_since is not None

    @property
    def pids(self) -> Dict[int, int]:
        return {r.spec.rank: r.pid for r in self.ranks if r.pid not in (None, -1)}

    # -- starting --------------------------------------------------------------------
    def start(self) -> None:
        """Start every rank; returns once each has a pid (fork: at once)."""
        cfg = self.cfg
        server = _procs.get_server(cfg.server_preload).wait_ready()
        if cfg.start_method == "forkserver" and server.threads > 1:
            raise RuntimeError(
                f"mplaunch's forkserver has {server.threads} threads after importing "
                f"{list(cfg.preload)}: forking it is unsafe. Use start_method='spawn', or "
                "preload other modules.")
        self._channel = server.open_channel()
        self._channel.setblocking(True)
        self._sel.register(self._channel, selectors.EVENT_READ, self._on_channel)
        self._sel.register(self._waker.r, selectors.EVENT_READ, self._on_wake)
        for r in self.ranks:
            self._start_one(r)
        while any(r.pid is None for r in self.ranks):
            self._on_channel(self._channel)

    def _start_one(self, r: RankState) -> None:
        child_fds = r.open(self.cfg, self.attempt, self.payload_fd)
        try:
            if self.cfg.start_method == "fork":
                pid = _procs.fork_rank(r.spec, dict(zip(RANK_FDS, child_fds)))
                send_obj(self._channel, ("watch", pid))
                self._set_pid(r, pid)
                r.pidfd = _procs.own_fd(os.pidfd_open(pid))
                self._sel.register(r.pidfd, selectors.EVENT_READ, ("pidfd", r))
            else:
                send_obj(self._channel, ("start", r.local_rank, r.spec), child_fds)
        finally:
            r.close_child_ends()
        self._sel.register(r.reader.sock, selectors.EVENT_READ, ("result", r))
        self._sel.register(r.out_fd, selectors.EVENT_READ, ("out", r))
        self._sel.register(r.err_fd, selectors.EVENT_READ, ("err", r))

    def _set_pid(self, r: RankState, pid: int) -> None:
        r.pid = pid
        self._by_pid[pid] = r
        if self.stopping:
            self._signal(self.stop_signal, [r])

    # -- calls (a World's ranks stay up between them) ----------------------------------
    def call(self, payload_fd: int) -> None:
        """Ask every rank to run the payload in `payload_fd` next; wait() until
        ``replied``."""
        for r in self.ranks:
            r.has_result, r.result = False, None
            send_framed(r.reader.sock, b"c", [payload_fd])

    @property
    def replied(self) -> bool:
        return all(r.has_result for r in self.ranks)

    def relay_written(self) -> None:
        """Relay all the ranks have written so far, a last line without its newline
        included: once every rank has answered a call, that call's output goes to the
        streams it was called with, not to the next call's (the ranks flushed their
        streams before answering; the pipes may hold more than one read)."""
        for r in self.ranks:
            for fd, relay in ((r.out_fd, r.out), (r.err_fd, r.err)):
                if fd is None or relay is None:
                    continue
                while True:
                    chunk = read_pipe(fd)
                    if not chunk:
                        break  # empty for now, or EOF (wait() unregisters it)
                    relay.feed(chunk)
                relay.end_line()

    def relay_to(self, stdout, stderr) -> None:
        """Relay the ranks' output to these streams from now on."""
        for r in self.ranks:
            for relay, sink in ((r.out, stdout), (r.err, stderr)):
                if relay is not None and relay.sink is not None:
                    relay.retarget(sink)

    # -- waiting ---------------------------------------------------------------------
    def wait(self, timeout: Optional[float]) -> None:
        """Handle what happens within `timeout` seconds (None: until something does),
        and escalate a teardown whose grace period is over."""
        if self.kill_deadline is not None and not self.killed:
            left = max(0.0, self.kill_deadline - time.monotonic())
            timeout = left if timeout is None else min(timeout, left)
        if timeout is not None:
            # epoll takes at most ~24 days (an int of ms); callers loop until their
            # deadline, so a longer limit is waited out in slices.
            timeout = min(timeout, _MAX_SELECT)
        for key, _ in self._sel.select(timeout):
            self._dispatch(key)
        if (self.kill_deadline is not None and not self.killed
                and time.monotonic() >= self.kill_deadline):
            self._signal(signal.SIGKILL, [r for r in self.ranks if r.alive])
            self.killed = True

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
        elif kind == "pidfd":
            self._on_pidfd(r)
        elif kind == "stack":
            chunk = read_pipe(r.stack_fd)
            if chunk:
                r.stack_text += chunk
            elif chunk == b"":
                self._unregister(r.stack_fd)

    def _on_wake(self, _fd) -> None:
        self._waker.drain()

    def _on_channel(self, sock) -> None:
        try:
            msg, fds = recv_obj(sock)
        except OSError:
            msg, fds = None, []
        for fd in fds:
            os.close(fd)
        if msg is None:
            self._server_died()
        elif msg[0] == "started":
            self._set_pid(self.ranks[msg[1]], msg[2])
        elif msg[0] == "exited":
            r = self._by_pid.get(msg[1])
            if r is not None and r.alive:
                self._on_exit(r, msg[2])
        elif msg[0] == "error":
            r = self.ranks[msg[1]]
            r.status, r.pid = 1 << 8, -1
            self.fail(self._record(r, exitcode=1, message=f"could not start: {msg[2]}"))

    def _on_pidfd(self, r: RankState) -> None:
        status = _procs.reap_forked(r.pid)
        if status is None:
            return
        self._unregister(r.pidfd)
        _procs.close_fd(r.pidfd)
        r.pidfd = None
        try:
            send_obj(self._channel, ("unwatch", r.pid))
        except OSError:
            pass
        self._on_exit(r, status)

    def _server_died(self) -> None:
        self._unregister(self._channel)
        for r in self.ranks:
            if r.alive and r.pidfd is None:
                # Its server is gone, so the rank died with it (parent-death signal).
                r.status = signal.SIGKILL
                if r.pid is None:
                    r.pid = -1
                self.fail(self._record(
                    r, exitcode=-signal.SIGKILL, signal="SIGKILL",
                    message="was killed because mplaunch's server process died"))

    def _read_result(self, r: RankState) -> None:
        for data, fds in r.reader.read_available():
            self._on_message(r, data, fds)
        if r.reader.eof:
            self._unregister(r.reader.sock)

    def _on_message(self, r: RankState, data: bytes, fds: list) -> None:
        tag, body = data[:1], data[1:]
        if tag == b"o":
            try:
                r.result = loads_result(body, fds)
                r.has_result = True
            except Exception as exc:  # noqa: BLE001
                r.error = ("err", None, type(exc).__name__,
                           f"the parent could not unpickle rank {r.spec.rank}'s return "
                           f"value: {exc}", None, 1, time.time())
                if not self.stopping:
                    self.fail(self._failure_from_error(r, r.error))
            return
        for fd in fds:
            os.close(fd)
        msg = pickle.loads(body)
        if msg[0] == "ok":
            r.result, r.has_result = msg[1], True
        elif msg[0] == "err":
            r.error = msg
            # An error raised after the teardown began is its consequence, not a cause.
            if not self.stopping or msg[6] <= self.stop_wall:
                self.fail(self._failure_from_error(r, msg))

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
        exitcode, signo = _sys.describe_status(status)
        if r.error is not None or self.stopping:
            return
        if r.has_result and exitcode == 0 and not r.spec.serve:
            return
        if signo is not None:
            failure = self._record(r, exitcode=exitcode, signal=signal_name(signo))
        elif r.spec.serve:
            failure = self._record(r, exitcode=exitcode, message=f"exited with code "
                                   f"{exitcode} while its World was up")
        elif exitcode == 0:
            failure = self._record(r, exitcode=0, message="exited with code 0 without "
                                   "returning a result (did it call os._exit(0)?)")
        else:
            failure = self._record(r, exitcode=exitcode)
        self.fail(failure)

    def _record(self, r: RankState, **fields) -> RankFailure:
        fields.setdefault("timestamp", r.exited_at or time.time())
        return RankFailure(r.spec.rank, r.pid, attempt=self.attempt,
                           local_rank=r.local_rank, node_rank=r.spec.node_rank,
                           hostname=r.spec.hostname, **fields)

    def _failure_from_error(self, r: RankState, msg) -> RankFailure:
        _, _blob, type_name, message, tb_text, exitcode, ts = msg
        return self._record(r, exitcode=exitcode, exc_type=type_name, message=message,
                            traceback=tb_text, timestamp=ts)

    def fail(self, failure: RankFailure) -> None:
        """Record a failure of this node and tear the group down."""
        self.failures.append(failure)
        self.stop(signal.SIGTERM)

    def node_failure(self, message: str) -> RankFailure:
        """A failure of this node as a whole (not of one rank's process), recorded
        under its first rank."""
        first = self.ranks[0].spec
        return RankFailure(first.rank, None, None, None, message=message,
                           attempt=self.attempt, timestamp=time.time(),
                           local_rank=first.local_rank, node_rank=first.node_rank,
                           hostname=first.hostname)

    # -- stopping --------------------------------------------------------------------
    def stop(self, signo: int = signal.SIGTERM, grace_period: Optional[float] = None) -> None:
        """Begin tearing down (once): `signo` to every rank now, SIGKILL after the grace
        period (driven by wait())."""
        if self.stopping:
            return
        self.stopping_since = time.monotonic()
        self.stop_wall = time.time()
        self.stop_signal = signo
        grace = self.cfg.grace_period if grace_period is None else grace_period
        self.kill_deadline = self.stopping_since + grace
        self._signal(signo, [r for r in self.ranks if r.alive])

    def hurry(self) -> None:
        """Asked twice: do not wait for the rest of the grace period."""
        self.kill_deadline = 0.0

    def send_signal(self, signo: int, ranks: Sequence[RankState]) -> None:
        """Deliver `signo` to these ranks' processes (not their groups)."""
        pids = [r.pid for r in ranks if r.signalable]
        if self.cfg.start_method == "fork":
            for pid in pids:
                _sys.kill_quiet(pid, signo)
        elif pids:
            try:
                send_obj(self._channel, ("kill", signo, pids))
            except OSError:
                pass  # the server is gone, and the ranks with it

    def watch_stacks(self, ranks: Sequence[RankState]) -> None:
        """Start collecting these ranks' stack dumps into their ``stack_text``."""
        for r in ranks:
            self._sel.register(r.stack_fd, selectors.EVENT_READ, ("stack", r))

    def _signal(self, signo: int, ranks) -> None:
        """`signo` to each rank's whole process group (its descendants too)."""
        pids = [r.pid for r in ranks if r.pid not in (None, -1)]
        if not pids:
            return
        if self.cfg.start_method == "fork":
            for pid in pids:
                # Our own children, not yet reaped: their pids are still theirs. No
                # server is their subreaper, so note their descendants while they are
                # still below them (a grandchild in a session of its own is outside the
                # group), and signal those too.
                self._fork_descendants.update(_sys.descendants_of(pid))
                _sys.killpg_quiet(pid, signo)
                _sys.kill_quiet(pid, signo)
            for pid in self._fork_descendants:
                _sys.kill_quiet(pid, signo)
        else:
            try:
                send_obj(self._channel, ("signal", signo, pids))
            except OSError:
                pass

    def _unregister(self, fileobj) -> None:
        try:
            self._sel.unregister(fileobj)
        except (KeyError, ValueError):
            pass

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
        if self._fork_descendants:
            for pid in self._fork_descendants:
                _sys.kill_quiet(pid, signal.SIGKILL)
            _sys.wait_dead(list(self._fork_descendants), timeout=2.0)
        if self._channel is not None and self._channel.fileno() != -1:
            self._sweep()
        drain_outputs(self.ranks, _DRAIN_WAIT)
        for r in self.ranks:
            r.close()
        if self._channel is not None:
            self._channel.close()
        self._sel.close()

    def _sweep(self, timeout: float = 5.0) -> None:
        """Ask the server to kill what is left below it (orphaned grandchildren) and wait
        until it has, noting exits reported meanwhile."""
        ch = self._channel
        try:
            send_obj(ch, ("sweep",))
            ch.settimeout(timeout)
            while True:
                msg, fds = recv_obj(ch)
                for fd in fds:
                    os.close(fd)
                if msg is None or msg[0] == "swept":
                    return
                if msg[0] == "exited":
                    r = self._by_pid.get(msg[1])
                    if r is not None and r.alive:
                        self._on_exit(r, msg[2])
        except (socket.timeout, OSError):
            return
        finally:
            if ch.fileno() != -1:
                ch.settimeout(None)
