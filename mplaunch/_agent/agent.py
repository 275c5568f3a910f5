"""A node's agent in a World across nodes: started once per node by the World's
scheduler (``python -m mplaunch._agent.agent``: _engine.nodes.schedulers), it connects
back to the launching process, proves it holds the World's secret (_wire.auth), then
starts, signals and reaps that node's ranks from a warm server of its own, as the
launching process does on one node. Each rank's fds (result channel, output pipes, stack
socket) end here, and travel to the launching process on the one connection
(_wire.tunnel), where _engine.nodes.hub turns them back into fds: the launching process
drives remote ranks with the code that drives local ones. Everything it sends is a
record of the agent link (_wire.link), handled by the one method its type names
(_FRONT); rejected: a table of integer kinds with positional bodies (before), whose
shapes each reader had to know by heart.

It runs only what an authenticated launching process sends; it reads its address and
the secret from its environment (MPLAUNCH_WORLD_ADDR, MPLAUNCH_WORLD_SECRET; or the
secret comes down its stdin, where the scheduler says so), removes the secret from it
before anything starts, and ends, with every rank it started, when the connection ends
(or the process that started it does, where the scheduler names one): nothing of it
outlives the World.
"""
from __future__ import annotations

import logging
import os
import selectors
import signal
import socket
import sys
import time
from typing import Dict, Optional

from .._engine import devices, servers, spawners
from .._engine.env import allowed_cpus
from .._engine.output import read_pipe
from .._wire import auth, linux, tunnel
from .._wire.channel import FramedReader
from .._wire.link import (BEAT_S, Beat, Bye, Clock, CloseGroup, Closed, Configure, Credit, Drop, Exited,
                          Hello, NotReady, OpenGroup, Output, Payload, RankMessage, Ready,
                          ServerLost, SignalGroups, Signaled, SignalRanks, StackBytes,
                          Started, StartFailed, StartRank, Sweep, Swept, ToRank)
from .._wire.spec import for_this_node

log = logging.getLogger("mplaunch.agent")
ADDR_ENV, NODE_ENV, NAME_ENV = tunnel.ADDR_ENV, tunnel.NODE_ENV, tunnel.NAME_ENV
NODE_FROM_ENV, CWD_ENV = tunnel.NODE_FROM_ENV, tunnel.CWD_ENV
SECRET_STDIN_ENV, PARENT_ENV = tunnel.SECRET_STDIN_ENV, tunnel.PARENT_ENV


def _given(what: int, environ) -> Optional[str]:
    """What the scheduler handed this agent: NODE_ENV / NAME_ENV themselves, else the
    variable NODE_FROM_ENV names for them ("INDEX_VAR:NAME_VAR")."""
    value = environ.get((NODE_ENV, NAME_ENV)[what])
    if value:
        return value
    named = environ.get(NODE_FROM_ENV, "").split(":")
    return environ.get(named[what]) if len(named) == 2 and named[what] else None


def node_index(environ=os.environ) -> int:
    """This agent's node, as its scheduler handed it (0 if it did not)."""
    value = _given(0, environ)
    return int(value) if value is not None and value.isdigit() else 0


def node_name(environ=os.environ) -> str:
    """What the output prefix and errors call this node: as its scheduler handed it
    (the node id its scheduler gives), else the host name."""
    return _given(1, environ) or socket.gethostname()


class _Rank:
    __slots__ = ("token", "pid", "reader", "out", "err", "stack", "credit")

    def __init__(self, token: int):
        self.token = token
        self.pid: Optional[int] = None
        self.reader: Optional[FramedReader] = None
        self.out = self.err = None
        self.stack: Optional[socket.socket] = None
        # bytes of each stream it may still send ahead (tunnel.OUTPUT_WINDOW)
        self.credit = {"out": tunnel.OUTPUT_WINDOW, "err": tunnel.OUTPUT_WINDOW}


class Agent:
    def __init__(self, sock: socket.socket, node_cwd: Optional[str] = None):
        self.sock = sock
        self.node_cwd = node_cwd          # CWD_ENV: where every rank starts
        self.sel = selectors.DefaultSelector()
        self.cfg = None
        self.spawner = None
        self.ranks: Dict[int, _Rank] = {}
        self.payloads: Dict[tuple, int] = {}   # key -> memfd (link.Payload)
        self.by_pid: Dict[int, int] = {}
        self.done = False
        self.beating = False   # from the first group on: its hub watches for silence

    # -- the loop --------------------------------------------------------------------
    def serve(self, parent: Optional[int] = None) -> None:
        self.sel.register(self.sock, selectors.EVENT_READ, self._on_front)
        if parent is not None:
            self._watch_parent(parent)
        beat = 0.0
        while not self.done:
            for key, _ in self.sel.select(BEAT_S):
                key.data(key.fileobj)
                if self.done:
                    break
            if self.beating and time.monotonic() - beat >= BEAT_S:
                beat = time.monotonic()
                self._send(Beat())

    def _watch_parent(self, pid: int) -> None:
        """End with `pid` (the Ray actor that started this agent): Ray kills a dead
        actor's process, and this agent, its server and its ranks go with it."""
        if os.getppid() != pid:
            log.error("mplaunch agent: the process that started it (pid %d) is gone", pid)
            self.done = True
            return
        try:
            fd = os.pidfd_open(pid)
        except (OSError, AttributeError):
            return    # no pidfd here: the actor's process group still takes this agent

        def parent_ended(_fd) -> None:
            log.error("mplaunch agent: the process that started it (pid %d) ended", pid)
            self.done = True
        self.sel.register(fd, selectors.EVENT_READ, parent_ended)

    def _send(self, record) -> None:
        try:
            tunnel.send(self.sock, record)
        except OSError:
            self.done = True    # the launching process is gone: the loop ends

    def _on_front(self, sock) -> None:
        try:
            record = tunnel.recv(sock)
        except OSError:
            record = None
        if record is None:
            log.info("mplaunch agent: the launching process closed the connection")
            self.done = True
            return
        handler = _FRONT.get(type(record))
        if handler is None:
            log.warning("mplaunch agent: %r ignored (not a request)", type(record).__name__)
            return
        handler(self, record)

    # -- what the launching process asks -----------------------------------------------
    def _configure(self, req: Configure) -> None:
        """The World's configuration: start the warm server and place the ranks."""
        cfg = self.cfg = req.cfg
        try:
            placement = devices.place(cfg.nprocs, req.gpus, req.cpus, cfg.backend,
                                      os.environ, allowed_cpus())
            servers.get_server(cfg.server_preload).wait_ready()
        except Exception as exc:  # noqa: BLE001 - said to the launching process
            self._send(NotReady(f"{type(exc).__name__}: {exc}"))
            return
        self._send(Ready(placement.gpus, placement.cpus))

    def _open(self, _req: OpenGroup) -> None:
        self.beating = True
        self.spawner = spawners.for_config(self.cfg, self)
        self.spawner.open(self.sel)

    def _payload(self, payload: Payload) -> None:
        """A payload for this node's ranks, kept until the next one, a Drop or the
        group's end (_engine.nodes.payloads)."""
        linux.close_quiet(self.payloads.pop(payload.key, -1))
        self.payloads[payload.key] = payload.fd

    def _drop(self, req: Drop) -> None:
        linux.close_quiet(self.payloads.pop(tuple(req.key), -1))

    def _start(self, req: StartRank) -> None:
        token = req.token
        spec = for_this_node(req.spec, self.node_cwd, os.getcwd(), sys.path)
        r = _Rank(token)
        payload = os.dup(self.payloads[tuple(req.payload)])
        res_ours, res_child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        stack_ours, stack_child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        for fd in (out_r, err_r):
            os.set_blocking(fd, False)
        r.reader = FramedReader(res_ours)
        r.out, r.err, r.stack = out_r, err_r, stack_ours
        self.ranks[token] = r
        try:
            self.spawner.start(token, spec, [payload, res_child.fileno(), out_w, err_w,
                                             stack_child.fileno()])
        finally:
            res_child.close()
            stack_child.close()
            linux.close_quiet(payload, out_w, err_w)
        self.sel.register(res_ours, selectors.EVENT_READ,
                          lambda _s, r=r: self._from_rank(r))
        for which in ("out", "err"):
            self._watch_output(r, which)
        self.sel.register(stack_ours, selectors.EVENT_READ,
                          lambda _s, r=r: self._from_stack(r))

    def _to_rank(self, req: ToRank) -> None:
        r = self.ranks.get(req.token)
        if r is not None and r.reader is not None:
            try:
                tunnel.deliver_fds(r.reader.sock, req.data,
                                   [self.payloads[tuple(k)] for k in req.payloads])
            except OSError:
                pass    # the rank is gone: its exit says so

    def _unwatch(self, obj) -> None:
        """Stop watching `obj`; one not watched (any more) is not an error."""
        try:
            self.sel.unregister(obj)
        except (KeyError, ValueError):
            pass

    def _watch_output(self, r: _Rank, which: str) -> None:
        try:
            self.sel.register(getattr(r, which), selectors.EVENT_READ,
                              lambda _f, r=r, w=which: self._output(r, w))
        except KeyError:
            pass    # watched already

    def _credit(self, req: Credit) -> None:
        """The launching process wrote on `n` bytes of a rank's stream: it may send as
        many more, and its pipe is read again if it had been left alone."""
        which, n = req.stream, req.n
        r = self.ranks.get(req.token)
        if r is None or which not in r.credit or not isinstance(n, int) or n <= 0:
            return
        paused = r.credit[which] <= 0
        r.credit[which] += n
        if paused and r.credit[which] > 0 and getattr(r, which) is not None:
            self._watch_output(r, which)

    def _to_stack(self, req: StackBytes) -> None:
        r = self.ranks.get(req.token)
        if r is not None and r.stack is not None:
            try:
                r.stack.sendall(req.data)
            except OSError:
                pass

    def _pids(self, tokens):
        return [self.ranks[t].pid for t in tokens
                if t in self.ranks and self.ranks[t].pid is not None]

    def _signal_groups(self, req: SignalGroups) -> None:
        pids = self._pids(req.tokens)
        if pids and self.spawner is not None:
            self.spawner.signal_groups(req.signo, pids)
        self._send(Signaled())   # alive: the launching process times this

    def _signal_ranks(self, req: SignalRanks) -> None:
        pids = self._pids(req.tokens)
        if pids and self.spawner is not None:
            self.spawner.signal_ranks(req.signo, pids)
        self._send(Signaled())

    def _sweep(self, _req: Sweep) -> None:
        if self.spawner is not None:
            self.spawner.sweep()
        self._send(Swept())

    def _close_group(self, _req: CloseGroup) -> None:
        self.close_group()
        self._send(Closed())

    def _bye(self, _req: Bye) -> None:
        self.done = True

    def close_group(self) -> None:
        """Kill what is left of the group's ranks (the server kills them when their
        channel closes), send the rest of their output, close their fds."""
        spawner, self.spawner = self.spawner, None
        if spawner is not None:
            spawner.close()
            spawner.events = None
        end = time.monotonic() + 2.0
        for r in list(self.ranks.values()):
            self._from_rank(r)
            for which in ("out", "err"):
                while getattr(r, which) is not None and time.monotonic() < end:
                    if not self._output(r, which, wait=0.1, closing=True):
                        break
            self._forget(r)
        self.ranks.clear()
        self.by_pid.clear()
        payloads, self.payloads = self.payloads, {}
        linux.close_quiet(*payloads.values())

    def _forget(self, r: _Rank) -> None:
        for obj in (r.reader.sock if r.reader is not None else None, r.out, r.err, r.stack):
            if obj is None:
                continue
            self._unwatch(obj)
        if r.reader is not None:
            r.reader.close()
            r.reader = None
        linux.close_quiet(*(fd for fd in (r.out, r.err) if fd is not None))
        r.out = r.err = None
        if r.stack is not None:
            r.stack.close()
            r.stack = None

    # -- what the ranks and the server say ---------------------------------------------
    def _from_rank(self, r: _Rank) -> None:
        if r.reader is None:
            return
        for data, fds in r.reader.read_available():
            try:
                self._send(RankMessage(r.token, data, tuple(fds)))
            finally:
                linux.close_quiet(*fds)
        if r.reader.eof:
            self._unwatch(r.reader.sock)

    def _output(self, r: _Rank, which: str, wait: float = 0.0,
                closing: bool = False) -> bool:
        """Forward what the pipe holds; False once it is empty (or at EOF), or once the
        stream's credit is spent (its pipe is then left alone until a Credit).
        `closing`: the group's last output, sent whatever the credit."""
        fd = getattr(r, which)
        if fd is None:
            return False
        if r.credit[which] <= 0 and not closing:
            self._unwatch(fd)
            return False
        if wait:
            sel = selectors.DefaultSelector()
            sel.register(fd, selectors.EVENT_READ)
            ready = sel.select(wait)
            sel.close()
            if not ready:
                return False
        chunk = read_pipe(fd)
        if chunk is None:
            return False
        self._send(Output(r.token, which, chunk))
        r.credit[which] -= len(chunk)
        if chunk and r.credit[which] <= 0 and not closing:
            self._unwatch(fd)   # until the launching process catches up
            return False
        if chunk == b"":
            self._unwatch(fd)
            linux.close_quiet(fd)
            setattr(r, which, None)
            return False
        return True

    def _from_stack(self, r: _Rank) -> None:
        try:
            chunk = r.stack.recv(1 << 16)
        except OSError:
            chunk = b""
        self._send(StackBytes(r.token, chunk))
        if not chunk:
            self._unwatch(r.stack)

    # the spawner's events (it reports to us as to a RankGroup)
    def started(self, token: int, pid: int) -> None:
        r = self.ranks.get(token)
        if r is not None:
            r.pid = pid
            self.by_pid[pid] = token
        self._send(Started(token, pid))

    def exited(self, pid: int, status: int, max_rss=None, note=None) -> None:
        token = self.by_pid.pop(pid, None)
        if token is None:
            return
        r = self.ranks.get(token)
        if r is not None:
            self._from_rank(r)   # all it sent goes before its exit
        self._send(Exited(token, status, max_rss, note))

    def start_failed(self, token: int, reason: str) -> None:
        self._send(StartFailed(token, reason))

    def server_lost(self, pid, how: str) -> None:
        self._send(ServerLost(f"mplaunch's server on this node (pid {pid}) {how}"))


# Every record the launching process sends, and the one method that handles it.
_FRONT = {
    Configure: Agent._configure, OpenGroup: Agent._open, StartRank: Agent._start,
    ToRank: Agent._to_rank, StackBytes: Agent._to_stack, Credit: Agent._credit,
    SignalGroups: Agent._signal_groups, SignalRanks: Agent._signal_ranks,
    Sweep: Agent._sweep, CloseGroup: Agent._close_group, Payload: Agent._payload,
    Drop: Agent._drop, Bye: Agent._bye,
    Clock: lambda agent, req: agent._send(req._replace(theirs=time.time_ns())),
}


def _terminate(signo, _frame) -> None:
    raise SystemExit(128 + signo)


def main() -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"mplaunch agent on {node_name()}: %(message)s")
    # Taken before anything else starts: neither the server nor the ranks inherit it.
    secret = os.environ.pop(auth.SECRET_ENV, None)
    if os.environ.pop(SECRET_STDIN_ENV, None) == "1":
        secret = sys.stdin.readline().strip() or None   # never in any environment
    addr = os.environ.pop(ADDR_ENV, None)
    parent = os.environ.pop(PARENT_ENV, None)
    node_cwd = os.environ.pop(CWD_ENV, None) or None
    if not secret or not addr:
        log.error("started without %s and %s in its environment: an agent is started "
                  "by mplaunch.World(nnodes=...), not by hand", auth.SECRET_ENV, ADDR_ENV)
        return 2
    # Inherited from whoever started it (a Ray actor's thread blocks SIGINT): this
    # agent, its server and its ranks take their signals.
    signal.pthread_sigmask(signal.SIG_SETMASK, set())
    signal.signal(signal.SIGTERM, _terminate)
    signal.signal(signal.SIGHUP, _terminate)
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # the launching process decides
    try:
        sock = auth.connect(addr, secret)
    except (OSError, auth.AuthError) as exc:
        log.error("could not join the World at %s: %s", addr, exc)
        return 1
    agent = Agent(sock, node_cwd)
    hello = Hello(node_index(), node_name(), socket.gethostname(), os.getpid(),
                  dict(os.environ), list(allowed_cpus()))
    try:
        tunnel.send(sock, hello)
        agent.serve(int(parent) if parent and parent.isdigit() else None)
    finally:
        agent.close_group()
        sock.close()
        servers.shutdown_servers()
    return 0


if __name__ == "__main__":
    sys.exit(main())
