"""One attempt of a launch: start every rank, wait on all of their channels at once, tear
everything down on the first failure, and return only when every process is gone."""
from __future__ import annotations

import os
import pickle
import selectors
import signal
import socket
import time
from typing import Dict, List, Optional

from . import _procs, _sys, _terminal
from ._channel import RANK_FDS, FramedReader, recv_obj, send_obj
from ._output import StreamRelay, read_pipe, set_pipe_size, summarize_tail
from ._serialize import loads_result, unpack_exception
from ._nodes import POLL_INTERVAL, NodeLost
from ._signals import Waker
from .errors import RankFailure, signal_name

_STACK_WAIT = 2.0      # how long a timed-out launch waits for the ranks' stack dumps
_DRAIN_WAIT = 2.0      # how long output pipes may stay open after every rank is gone


def server_preload(cfg) -> tuple:
    """Which server a launch uses: spawn and fork need no preloads (the server only
    execs, or only watches)."""
    return cfg.preload if cfg.start_method == "forkserver" else ()


class _Rank:
    __slots__ = ("rank", "pid", "reader", "out_fd", "err_fd", "stack_fd", "out", "err",
                 "status", "result", "has_result", "error", "pidfd", "stack_text",
                 "exited_at", "spec")

    def __init__(self, rank):
        self.rank = rank
        self.pid = None
        self.status = None      # raw wait status once exited
        self.has_result = False
        self.result = None
        self.error = None       # the "err" message tuple
        self.pidfd = None
        self.stack_text = b""
        self.exited_at = None

    @property
    def alive(self) -> bool:
        return self.status is None


class Attempt:
    """Runs the ranks of one attempt. `cfg` is the launch's validated configuration."""

    def __init__(self, cfg, attempt: int, specs: List[dict], payload_fd: int,
                 watch=None):
        self.cfg = cfg
        self.watch = watch            # NodeWatch when nnodes > 1
        self.claimed = False          # this node reported the launch's failure
        self.remote_node = None       # another node failed first
        self.remote_report = None     # (failures, error message) from that node
        self.attempt = attempt
        self.specs = specs
        self.payload_fd = payload_fd
        self.sel = selectors.DefaultSelector()
        self.ranks: List[_Rank] = [_Rank(s["local_rank"]) for s in specs]
        self.by_pid: Dict[int, _Rank] = {}
        self.failures: List[RankFailure] = []
        self.teardown_started: Optional[float] = None
        self.teardown_signal = signal.SIGTERM
        self.kill_deadline: Optional[float] = None
        self.killed = False
        self.signal_received: Optional[int] = None
        self.timed_out = False
        self.stacks: Dict[int, str] = {}
        self.waker = Waker()
        _procs.own_fd(self.waker.r)
        _procs.own_fd(self.waker.w)
        self.channel: Optional[socket.socket] = None
        self.server = None
        self.fork_descendants: set = set()

    # -- public ----------------------------------------------------------------------
    def on_signal(self, signo: int) -> None:
        """Called from the signal handler: record, and wake the loop."""
        if self.signal_received is not None and signo == self.signal_received:
            self.kill_deadline = 0.0  # the same signal twice: stop waiting for grace
        self.signal_received = signo
        self.waker.wake()

    def run(self):
        try:
            try:
                self._start_all()
                self._loop()
            finally:
                self._finish()
            if self.watch is not None:
                self._settle_with_other_nodes()
        finally:
            self.waker.close()
            _procs.disown_fd(self.waker.r)
            _procs.disown_fd(self.waker.w)
        return self.ranks

    # -- starting ------------------------------------------------------------------
    def _start_all(self) -> None:
        cfg = self.cfg
        self.server = _procs.get_server(server_preload(cfg)).wait_ready()
        if cfg.start_method == "forkserver" and self.server.threads > 1:
            raise RuntimeError(
                f"mplaunch's forkserver has {self.server.threads} threads after "
                f"importing {list(cfg.preload)}: forking it is unsafe. Use "
                "start_method='spawn', or preload other modules.")
        self.channel = self.server.open_channel()
        self.channel.setblocking(True)
        self.sel.register(self.channel, selectors.EVENT_READ, self._on_channel)
        self.sel.register(self.waker.r, selectors.EVENT_READ, self._on_wake)
        for r, spec in zip(self.ranks, self.specs):
            self._start_one(r, spec)
        if cfg.start_method != "fork":
            self._await_started()

    def _start_one(self, r: _Rank, spec: dict) -> None:
        cfg = self.cfg
        res_parent, res_child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        stack_r, stack_w = os.pipe()
        for fd in (out_r, err_r, stack_r):
            _procs.own_fd(fd)
            os.set_blocking(fd, False)
        set_pipe_size(out_r)
        set_pipe_size(err_r)  # logging and tqdm write to stderr, often as much as to stdout
        _procs._parent_only_socks.add(res_parent)
        r.reader = FramedReader(res_parent)
        r.out_fd, r.err_fd, r.stack_fd = out_r, err_r, stack_r
        r.out = self._relay(r.rank, "stdout")
        r.err = self._relay(r.rank, "stderr")
        extra_fds, spec = _terminal.for_rank(cfg, spec, r.out, r.err)
        child_fds = [self.payload_fd, res_child.fileno(), out_w, err_w, stack_w, *extra_fds]
        try:
            if cfg.start_method == "fork":
                fdmap = dict(zip(RANK_FDS, child_fds))
                pid = _procs.fork_rank(spec, fdmap)
                send_obj(self.channel, ("watch", pid))
                self._set_pid(r, pid)
                r.pidfd = os.pidfd_open(pid)
                _procs.own_fd(r.pidfd)
                self.sel.register(r.pidfd, selectors.EVENT_READ, ("pidfd", r))
            else:
                sent = dict(spec, exec=(cfg.start_method == "spawn"))
                send_obj(self.channel, ("start", r.rank, sent), child_fds)
        finally:
            res_child.close()
            for fd in (out_w, err_w, stack_w):
                os.close(fd)
        self.sel.register(r.reader.sock, selectors.EVENT_READ, ("result", r))
        self.sel.register(out_r, selectors.EVENT_READ, ("out", r))
        self.sel.register(err_r, selectors.EVENT_READ, ("err", r))

    def _relay(self, rank: int, stream: str) -> StreamRelay:
        cfg = self.cfg
        sink = None
        if cfg.relay and (cfg.ranks_filter is None or rank in cfg.ranks_filter):
            sink = cfg.stdout if stream == "stdout" else cfg.stderr
        logfile = None
        if cfg.log_dir is not None:
            d = os.path.join(cfg.log_dir, f"attempt_{self.attempt}", str(rank))
            os.makedirs(d, exist_ok=True)
            logfile = open(os.path.join(d, f"{stream}.log"), "wb", buffering=0)
        prefix = cfg.prefix.format(**self.specs[rank]["prefix_fields"]) if cfg.prefix else ""
        return StreamRelay(sink, prefix, logfile, keep_tail=(stream == "stderr"))

    def _set_pid(self, r: _Rank, pid: int) -> None:
        r.pid = pid
        self.by_pid[pid] = r
        if self.teardown_started is not None:
            self._signal_ranks(self.teardown_signal, [r])

    def _await_started(self) -> None:
        while any(r.pid is None for r in self.ranks):
            self._on_channel(self.channel)

    def _unregister(self, fileobj) -> None:
        try:
            self.sel.unregister(fileobj)
        except (KeyError, ValueError):
            pass

    # -- the loop --------------------------------------------------------------------
    def _loop(self) -> None:
        cfg = self.cfg
        deadline = None if cfg.timeout is None else cfg.started_at + cfg.timeout
        while any(r.alive for r in self.ranks):
            now = time.monotonic()
            wait = None
            if self.kill_deadline is not None and not self.killed:
                wait = max(0.0, self.kill_deadline - now)
            if deadline is not None and self.teardown_started is None:
                wait = max(0.0, deadline - now) if wait is None else min(wait, deadline - now)
            if self.watch is not None:
                wait = POLL_INTERVAL if wait is None else min(wait, POLL_INTERVAL)
            for key, _ in self.sel.select(wait):
                self._dispatch(key)
            if self.watch is not None and self.teardown_started is None:
                self._poll_nodes()
            now = time.monotonic()
            if self.signal_received is not None and self.teardown_started is None:
                self._begin_teardown(self.signal_received)
            if (deadline is not None and now >= deadline and self.teardown_started is None
                    and any(r.alive for r in self.ranks)):
                self._on_timeout()
            if (self.kill_deadline is not None and not self.killed
                    and time.monotonic() >= self.kill_deadline):
                self._signal_ranks(signal.SIGKILL, [r for r in self.ranks if r.alive])
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
            self._read_output(r, r.out_fd, r.out)
        elif kind == "err":
            self._read_output(r, r.err_fd, r.err)
        elif kind == "pidfd":
            status = _procs.reap_forked(r.pid)
            if status is not None:
                self._unregister(r.pidfd)
                _procs.close_fd(r.pidfd)
                r.pidfd = None
                try:
                    send_obj(self.channel, ("unwatch", r.pid))
                except OSError:
                    pass
                self._on_exit(r, status)
        elif kind == "stack":
            chunk = read_pipe(r.stack_fd)
            if chunk:
                r.stack_text += chunk
            elif chunk == b"":
                self._unregister(r.stack_fd)

    def _on_wake(self, _fd) -> None:
        self.waker.drain()

    def _on_channel(self, sock) -> None:
        try:
            msg, fds = recv_obj(sock)
        except OSError:
            msg, fds = None, []
        for fd in fds:
            os.close(fd)
        if msg is None:
            self._server_died()
            return
        kind = msg[0]
        if kind == "started":
            self._set_pid(self.ranks[msg[1]], msg[2])
        elif kind == "exited":
            r = self.by_pid.get(msg[1])
            if r is not None and r.alive:
                self._on_exit(r, msg[2])
        elif kind == "error":
            r = self.ranks[msg[1]]
            r.status = 1 << 8
            r.pid = -1
            self._fail(RankFailure(r.rank, None, 1, None, message=f"could not start: {msg[2]}",
                                   attempt=self.attempt, timestamp=time.time()))

    def _server_died(self) -> None:
        self._unregister(self.channel)
        for r in self.ranks:
            if r.alive and r.pidfd is None:
                # Its server is gone, so the rank died with it (parent-death signal).
                r.status = signal.SIGKILL
                if r.pid is None:
                    r.pid = -1
                self._fail(RankFailure(
                    r.rank, r.pid, -signal.SIGKILL, "SIGKILL",
                    message="was killed because mplaunch's server process died",
                    attempt=self.attempt, timestamp=time.time()))

    def _read_result(self, r: _Rank) -> None:
        for data, fds in r.reader.read_available():
            self._on_message(r, data, fds)
        if r.reader.eof:
            self._unregister(r.reader.sock)

    def _on_message(self, r: _Rank, data: bytes, fds: list) -> None:
        tag, body = data[:1], data[1:]
        if tag == b"o":
            try:
                r.result = loads_result(body, fds)
                r.has_result = True
            except Exception as exc:  # noqa: BLE001
                r.error = ("err", None, type(exc).__name__,
                           f"the parent could not unpickle rank {r.rank}'s return value: "
                           f"{exc}", None, 1, time.time())
                if self.teardown_started is None:
                    self._fail(self._failure_from_error(r, r.error))
            return
        for fd in fds:
            os.close(fd)
        msg = pickle.loads(body)
        if msg[0] == "ok":
            r.result, r.has_result = msg[1], True
        elif msg[0] == "err":
            r.error = msg
            ts = msg[6]
            if self.teardown_started is None or ts <= self.teardown_wall:
                self._fail(self._failure_from_error(r, msg))

    def _read_output(self, r: _Rank, fd: int, relay: StreamRelay) -> None:
        chunk = read_pipe(fd)
        if chunk is None:
            return
        if chunk == b"":
            self._unregister(fd)
            return
        relay.feed(chunk)

    # -- exits and failures ----------------------------------------------------------
    def _on_exit(self, r: _Rank, status: int) -> None:
        r.status = status
        r.exited_at = time.time()
        if r.reader.sock.fileno() != -1:
            self._read_result(r)  # everything it sent is already in the socket
        exitcode, signo = _sys.describe_status(status)
        if r.error is not None or self._is_teardown_victim(r):
            return
        if r.has_result and exitcode == 0:
            return
        if signo is not None:
            failure = RankFailure(r.rank, r.pid, exitcode, signal_name(signo),
                                  attempt=self.attempt, timestamp=r.exited_at)
        elif exitcode == 0:
            failure = RankFailure(r.rank, r.pid, 0, None, attempt=self.attempt,
                                  timestamp=r.exited_at,
                                  message="exited with code 0 without returning a result "
                                          "(did it call os._exit(0)?)")
        else:
            failure = RankFailure(r.rank, r.pid, exitcode, None, attempt=self.attempt,
                                  timestamp=r.exited_at)
        self._fail(failure)

    def _is_teardown_victim(self, r: _Rank) -> bool:
        return self.teardown_started is not None

    def _failure_from_error(self, r: _Rank, msg) -> RankFailure:
        _, _blob, type_name, message, tb_text, exitcode, ts = msg
        return RankFailure(r.rank, r.pid, exitcode, None, exc_type=type_name,
                           message=message, traceback=tb_text, attempt=self.attempt,
                           timestamp=ts)

    def _fail(self, failure: RankFailure) -> None:
        spec = self.specs[failure.rank]
        failure.local_rank = failure.rank
        failure.rank = spec["global_rank"]
        failure.node_rank = spec["node_rank"]
        failure.hostname = spec["hostname"]
        self.failures.append(failure)
        if self.teardown_started is None:
            if self.watch is not None and self.remote_node is None:
                self._claim()
            self._begin_teardown(signal.SIGTERM)

    def _begin_teardown(self, signo: int) -> None:
        self.teardown_started = time.monotonic()
        self.teardown_wall = time.time()
        self.teardown_signal = signo
        self.kill_deadline = self.teardown_started + self.cfg.grace_period
        self._signal_ranks(signo, [r for r in self.ranks if r.alive])

    def _signal_ranks(self, signo: int, ranks) -> None:
        pids = [r.pid for r in ranks if r.pid not in (None, -1)]
        if not pids:
            return
        if self.cfg.start_method == "fork":
            for pid in pids:
                # Our own children, not yet reaped: their pids are still theirs. No
                # server is their subreaper, so note their descendants while they are
                # still below them (a grandchild in a session of its own is outside the
                # group), and signal those too.
                self.fork_descendants.update(_sys.descendants_of(pid))
                _sys.killpg_quiet(pid, signo)
                _sys.kill_quiet(pid, signo)
            for pid in self.fork_descendants:
                _sys.kill_quiet(pid, signo)
        else:
            try:
                send_obj(self.channel, ("signal", signo, pids))
            except OSError:
                pass

    # -- other nodes -----------------------------------------------------------------
    def node_failure(self, message: str) -> RankFailure:
        """A failure of this node as a whole (not of one rank's process), recorded
        under its first rank."""
        return RankFailure(self.specs[0]["global_rank"], None, None, None, message=message,
                           attempt=self.attempt, timestamp=time.time(),
                           local_rank=self.specs[0]["local_rank"],
                           node_rank=self.specs[0]["node_rank"],
                           hostname=self.specs[0]["hostname"])

    def _claim(self) -> None:
        try:
            won = self.watch.claim()
        except NodeLost:
            return
        if won == self.watch.node_rank:
            self.claimed = True
        else:
            self.remote_node = won

    def _poll_nodes(self) -> None:
        try:
            failed = self.watch.failed_node()
        except NodeLost as exc:
            self._fail(RankFailure(0, None, None, None, message=str(exc),
                                   attempt=self.attempt, timestamp=time.time()))
            return
        if failed is not None and failed != self.watch.node_rank:
            self.remote_node = failed
            self._begin_teardown(signal.SIGTERM)

    def _settle_with_other_nodes(self) -> None:
        """Every local rank is gone. Agree with the other nodes on the outcome: wait for
        them to succeed (or for one to fail), exchange the failure report, and on node
        0 keep the store up until every node has read it."""
        w = self.watch
        try:
            if self.signal_received is not None and self.remote_node is None \
                    and not self.claimed:
                self._claim()
            if not self.failures and self.remote_node is None and not self.claimed \
                    and self.signal_received is None and not self.timed_out:
                w.store.add(w.prefix + "ok", 1)
                while True:
                    failed = w.failed_node()
                    if failed is not None:
                        self.remote_node = failed
                        break
                    if w.store.add(w.prefix + "ok", 0) >= w.nnodes:
                        break
                    if self.signal_received is not None:
                        self._claim()
                        break
                    self._idle(POLL_INTERVAL)
            if self.claimed:
                failures = self.final_failures()
                error = self.first_error(failures)
                if not failures and self.signal_received is not None:
                    # Nothing failed here: this node was told to stop. Tell the others
                    # why their ranks are being torn down.
                    failures = [self.node_failure(
                        f"was torn down because node {w.node_rank}'s launcher received "
                        f"{signal_name(self.signal_received)}")]
                w.publish(failures, error)
            elif self.remote_node is not None:
                self.remote_report = w.report(wait=30.0)
            w.mark_done()
            if w.node_rank == 0:
                end = time.monotonic() + 30.0
                while not w.all_done() and time.monotonic() < end:
                    self._idle(POLL_INTERVAL)
        except NodeLost as exc:
            if not self.failures and self.remote_node is None:
                self.failures.append(self.node_failure(str(exc)))

    def _idle(self, seconds: float) -> None:
        """Sleep, but wake for a signal (the handler writes to the waker)."""
        import select
        try:
            select.select([self.waker.r], [], [], seconds)
        except InterruptedError:
            pass
        self.waker.drain()

    # -- timeouts --------------------------------------------------------------------
    def _on_timeout(self) -> None:
        from ._worker import STACK_SIGNAL
        self.timed_out = True
        alive = [r for r in self.ranks if r.alive and r.pid not in (None, -1)]
        for r in alive:
            self.sel.register(r.stack_fd, selectors.EVENT_READ, ("stack", r))
        if self.cfg.start_method == "fork":
            for r in alive:
                _sys.kill_quiet(r.pid, STACK_SIGNAL)
        else:
            send_obj(self.channel, ("kill", STACK_SIGNAL, [r.pid for r in alive]))
        # Collect what arrives; a rank that cannot answer (stuck with signals blocked,
        # or in a C loop faulthandler cannot interrupt) must not hang us.
        end = time.monotonic() + _STACK_WAIT
        quiet_since = None
        while time.monotonic() < end:
            before = sum(len(r.stack_text) for r in alive)
            for key, _ in self.sel.select(0.05):
                self._dispatch(key)
            after = sum(len(r.stack_text) for r in alive)
            if all(r.stack_text or not r.alive for r in alive):
                if after == before:
                    quiet_since = quiet_since or time.monotonic()
                    if time.monotonic() - quiet_since > 0.1:
                        break
                else:
                    quiet_since = None
        for r in alive:
            self.stacks[self.specs[r.rank]["global_rank"]] = r.stack_text.decode(
                "utf-8", "replace")
        self._begin_teardown(signal.SIGTERM)

    # -- the end ---------------------------------------------------------------------
    def _finish(self) -> None:
        # Make sure nothing is left: every rank is dead (we get here after the loop, or
        # on an error, in which case kill what may still run), orphans are killed.
        alive = [r for r in self.ranks if r.alive and r.pid not in (None, -1)]
        if alive:
            self._signal_ranks(signal.SIGKILL, alive)
            self._wait_exits(alive)
        if self.fork_descendants:
            for pid in self.fork_descendants:
                _sys.kill_quiet(pid, signal.SIGKILL)
            _sys.wait_dead(list(self.fork_descendants), timeout=2.0)
        if self.channel is not None and self.channel.fileno() != -1:
            try:
                send_obj(self.channel, ("sweep",))
                self._wait_for(lambda m: m[0] == "swept", timeout=5.0)
            except OSError:
                pass
        self._drain_outputs()
        for r in self.ranks:
            for fd in (r.out_fd, r.err_fd, r.stack_fd, r.pidfd):
                if fd is not None:
                    _procs.close_fd(fd)
            if getattr(r, "reader", None) is not None:
                r.reader.close()
            for relay in (getattr(r, "out", None), getattr(r, "err", None)):
                if relay is not None:
                    relay.close()
        if self.channel is not None:
            self.channel.close()
        self.sel.close()

    def _wait_exits(self, ranks) -> None:
        end = time.monotonic() + 10.0
        while any(r.alive for r in ranks) and time.monotonic() < end:
            for key, _ in self.sel.select(0.5):
                self._dispatch(key)

    def _wait_for(self, pred, timeout: float) -> None:
        self.channel.settimeout(timeout)
        try:
            while True:
                msg, fds = recv_obj(self.channel)
                for fd in fds:
                    os.close(fd)
                if msg is None or pred(msg):
                    return
                if msg[0] == "exited":
                    r = self.by_pid.get(msg[1])
                    if r is not None and r.alive:
                        self._on_exit(r, msg[2])
        except (socket.timeout, OSError):
            return
        finally:
            if self.channel.fileno() != -1:
                self.channel.settimeout(None)

    def _drain_outputs(self) -> None:
        """Relay everything the ranks wrote. Their pipes reach EOF once every writer is
        dead; a writer we could not kill (fork mode orphans) only gets a bounded wait."""
        pending = {}
        for r in self.ranks:
            for fd, relay in ((r.out_fd, getattr(r, "out", None)),
                              (r.err_fd, getattr(r, "err", None))):
                if fd is not None and relay is not None:
                    pending[fd] = relay
        end = time.monotonic() + _DRAIN_WAIT
        sel = selectors.DefaultSelector()
        for fd in pending:
            sel.register(fd, selectors.EVENT_READ)
        try:
            while pending and time.monotonic() < end:
                for key, _ in sel.select(max(0.0, end - time.monotonic())):
                    fd = key.fd
                    chunk = read_pipe(fd)
                    if chunk is None:
                        continue
                    if chunk == b"":
                        sel.unregister(fd)
                        del pending[fd]
                    else:
                        pending[fd].feed(chunk)
        finally:
            sel.close()

    # -- outcome -------------------------------------------------------------------
    def final_failures(self) -> List[RankFailure]:
        """This node's failures, first first, each with the end of its stderr."""
        failures = sorted(self.failures, key=lambda f: (f.timestamp or 0.0))
        for f in failures:
            if f.pid is not None and f.stderr_tail is None:
                f.stderr_tail = self.stderr_tail(f.local_rank) or None
        return failures

    def first_error(self, failures: List[RankFailure]):
        """The "err" message of the first of this node's `failures` (from
        final_failures), if that rank raised."""
        if not failures:
            return None
        return self.ranks[failures[0].local_rank].error
    def stderr_tail(self, local_rank: int) -> str:
        r = self.ranks[local_rank]
        text = r.err.tail_text()
        if r.error is not None and r.error[4]:
            # The traceback travels as the error's __cause__; do not repeat it.
            head, sep, rest = text.rpartition(r.error[4])
            if sep and not rest.strip():
                text = head
        return summarize_tail(text)

    def cause(self, error_msg):
        if error_msg is None:
            return None
        _, blob, type_name, message, tb_text, _code, _ts = error_msg
        return unpack_exception(blob, type_name, message, tb_text)
