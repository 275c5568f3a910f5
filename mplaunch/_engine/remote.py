"""The launching side of a World across nodes: its one step of node agents
(_engine.agent, started by _engine.nodestep), the authenticated connection to each
(_wire.auth, _wire.tunnel), and RemoteSpawner, the spawner (_engine.spawners' seam) that
starts, signals and reaps ranks through them.

Every remote rank gets the fds a local one gets (result channel, output pipes, stack
socket): RemoteSpawner keeps the rank's ends, and the pump (_engine.nodepump) copies
between them and the node's connection, so the RankGroup, the heal and the relay that
drive one node's ranks drive these, unchanged. Reports (started, exited, a lost node)
reach the group in its own thread, through a queue and a pipe on its selector.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import queue
import selectors
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import Callable, Dict, List, Optional, Sequence

from . import servers
from .config import LaunchConfig
from .nodepump import Pump, _Proxy
from .nodestep import (AGENT_MODULE, NodesError, end_step, join_addr, listen,
                       srun_argv, start_srun_step)
from .nodestep import check_allocation, slurm_nodes_available  # noqa: F401 (re-exported)
from .._wire import auth, linux, tunnel
from .._wire.spec import RankSpec

log = logging.getLogger("mplaunch")
__mplaunch_plumbing__ = True

JOIN_TIMEOUT = 120.0     # for every agent to connect and prove itself
KILL_REPORT_WAIT = 5.0   # for an agent to report the exits of ranks it SIGKILLed
SIGNAL_ACK_WAIT = 3.0    # for an agent to answer a signal request (it does at once)


@dataclasses.dataclass
class NodeInfo:
    index: int
    name: str
    host: str
    pid: int
    environ: Dict[str, str]
    cpus: List[int]
    gpus: Optional[tuple] = None
    placed_cpus: Optional[tuple] = None


class Link:
    """The authenticated connection to one node's agent."""

    def __init__(self, sock: socket.socket, info: NodeInfo):
        self.sock = sock
        self.info = info
        self.lock = threading.Lock()      # whole frames from any thread
        self.lost: Optional[str] = None   # why the connection ended
        self.signals = 0                  # signal requests sent, and answered (the pump
        self.acked = 0                    # counts those): a frozen agent answers none
        self.reading = False              # the pump is reading a frame of it now
        self.heard = time.monotonic()     # when the pump last read one

    def send(self, kind: int, token: int = 0, body=b"") -> bool:
        if self.lost is not None:
            return False
        try:
            with self.lock:
                tunnel.send(self.sock, kind, token, body)
            return True
        except OSError as exc:
            self.lost = self.lost or f"its connection failed ({exc})"
            return False

    def describe(self) -> str:
        i = self.info
        return f"node {i.index} ({i.name})"


class Hub:
    """A World's nodes: the step of agents, one authenticated link to each, and the pump
    thread. Lives as long as the World (a heal or a replaced rank reuses it); closed,
    it ends the step and leaves nothing running on any node."""

    def __init__(self, nnodes: int, address: str, cfg: LaunchConfig, gpus, cpus,
                 starter: Optional[Callable] = None, join_timeout: float = JOIN_TIMEOUT):
        self.nnodes = nnodes
        self.address = address
        self.cfg = cfg
        self.placement_args = (gpus, cpus)
        self.starter = starter or start_srun_step
        self.join_timeout = join_timeout
        self.links: List[Link] = []
        self.step: Optional[subprocess.Popen] = None
        self._step_log = None
        self.pump: Optional[Pump] = None
        self.spawner: Optional["RemoteSpawner"] = None
        self.dropped = 0     # connections that failed to prove themselves

    @property
    def broken(self) -> bool:
        return any(link.lost is not None for link in self.links)

    @property
    def step_id(self) -> Optional[str]:
        """"JOB.STEP" of the agents' SLURM step (what their environment says)."""
        for link in self.links:
            env = link.info.environ
            if env.get("SLURM_JOB_ID") and env.get("SLURM_STEP_ID"):
                return f"{env['SLURM_JOB_ID']}.{env['SLURM_STEP_ID']}"
        return None

    @property
    def nodes(self) -> List[NodeInfo]:
        return [link.info for link in self.links]

    # -- start -------------------------------------------------------------------------
    def start(self) -> "Hub":
        secret = auth.new_secret()
        listener = listen(self.address)
        try:
            port = listener.getsockname()[1]
            env = dict(os.environ)
            env[auth.SECRET_ENV] = secret
            env["MPLAUNCH_WORLD_ADDR"] = join_addr(self.address, port)
            env.pop("MPLAUNCH_NODE_INDEX", None)
            self._step_log = tempfile.TemporaryFile(prefix="mplaunch-agents-")
            self.step = self.starter([sys.executable, "-m", AGENT_MODULE], env,
                                     self.nnodes, self._step_log)
            self._accept(listener, secret)
        except BaseException:
            listener.close()
            self.close()
            raise
        listener.close()    # every agent is in: nobody else gets to connect
        self._configure()
        self.pump = Pump(self)
        return self

    def _accept(self, listener: socket.socket, secret: str) -> None:
        """Every agent in, each having proved the secret. Each connection proves itself
        in a thread of its own (_Joining): a client that connects and says nothing holds
        up nobody but itself."""
        end = time.monotonic() + self.join_timeout
        links: Dict[int, Link] = {}
        joining = _Joining(secret, self)
        listener.settimeout(0.1)
        try:
            while len(links) < self.nnodes:
                if time.monotonic() > end:
                    raise NodesError(f"{len(links)} of the World's {self.nnodes} node "
                                     f"agents joined within {self.join_timeout:g} s; "
                                     f"{self._step_said()}")
                if self.step.poll() is not None:
                    raise NodesError(f"the World's step of node agents ended (exit status "
                                     f"{self.step.returncode}) before {self.nnodes} "
                                     f"joined; {self._step_said()}")
                try:
                    joining.begin(*listener.accept())
                except socket.timeout:
                    pass
                for sock, node in joining.joined():
                    if node.index in links or not 0 <= node.index < self.nnodes:
                        sock.close()
                        raise NodesError(f"two agents (or one out of range) said they are "
                                         f"node {node.index} of {self.nnodes}: is each node "
                                         f"given one task? {self._step_said()}")
                    sock.settimeout(None)
                    tunnel.keepalive(sock)
                    links[node.index] = Link(sock, node)
        except BaseException:
            for link in links.values():
                link.sock.close()
            raise
        finally:
            joining.end()
        self.links = [links[i] for i in range(self.nnodes)]

    def _configure(self) -> None:
        """Send each agent the configuration; each starts its warm server and places its
        node's ranks (GPUs, CPUs: what that node has)."""
        cfg = dataclasses.replace(self.cfg, stdout=None, stderr=None)
        gpus, cpus = self.placement_args
        for link in self.links:
            link.send(tunnel.CONFIG, 0, (cfg, gpus, cpus))
        for link in self.links:
            link.sock.settimeout(300.0)
            try:
                frame = tunnel.recv(link.sock)
            except OSError as exc:
                frame = None
                link.lost = str(exc)
            finally:
                if link.sock.fileno() != -1:
                    link.sock.settimeout(None)
            if frame is None or frame[0] != tunnel.READY:
                raise NodesError(f"{link.describe()}'s agent ended while starting; "
                                 f"{self._step_said()}")
            ready = frame[2]
            if "error" in ready:
                raise NodesError(f"{link.describe()} cannot run this World: "
                                 f"{ready['error']}")
            link.info.gpus, link.info.placed_cpus = ready["gpus"], ready["cpus"]

    def _step_said(self) -> str:
        out = self._step_log
        if out is None:
            return "the step printed nothing"
        try:
            out.flush()
            out.seek(0)
            text = out.read()[-3000:].decode(errors="replace").strip()
        except (OSError, ValueError):
            text = ""
        cmd = shlex.join(srun_argv(self.nnodes, [sys.executable, "-m", AGENT_MODULE]))
        return (f"the step ({cmd}) printed:\n{text}" if text
                else f"the step ({cmd}) printed nothing")

    # -- the pump: node connections <-> the ranks' fds ---------------------------------
    def close(self, grace: float = 10.0) -> None:
        """End every agent (and so every rank) and the step; idempotent. With a node
        lost, the step is not waited for long: SLURM ends it (nodestep.end_step)."""
        if self.broken:
            grace = min(grace, 3.0)
        for link in self.links:
            link.send(tunnel.BYE)
        pump, self.pump = self.pump, None
        if pump is not None:
            pump.stop()
        for link in self.links:
            try:
                link.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            link.sock.close()
            link.lost = link.lost or "the World was closed"
        step, self.step = self.step, None
        if step is not None:
            end_step(step, grace, self.step_id)
        if self._step_log is not None:
            self._step_log.close()
            self._step_log = None


class _Joining:
    """Connections to the agent port proving themselves, each in a thread."""
    MAX = 64    # more at once than any allocation's agents: refused at once

    def __init__(self, secret: str, hub: "Hub"):
        self.secret, self.hub = secret, hub
        self.lock = threading.Lock()
        self.pending: Dict[socket.socket, object] = {}
        self.done: "queue.Queue" = queue.Queue()
        self.over = False

    def begin(self, sock: socket.socket, peer) -> None:
        with self.lock:
            if len(self.pending) >= self.MAX:
                self._drop(sock, peer, "too many connections proving themselves at once")
                return
            self.pending[sock] = peer
        threading.Thread(target=self._prove, args=(sock, peer), daemon=True,
                         name="mplaunch-join").start()

    def _drop(self, sock, peer, why) -> None:
        self.hub.dropped += 1
        log.warning("mplaunch dropped a connection from %s to the World's agent port: %s",
                    peer, why)
        sock.close()

    def _prove(self, sock: socket.socket, peer) -> None:
        try:
            auth.prove(sock, self.secret, server=True, timeout=10.0)
            sock.settimeout(30.0)
            frame = tunnel.recv(sock)     # unpickled only now: the peer proved itself
            if frame is None or frame[0] != tunnel.HELLO:
                raise auth.AuthError("no hello after its proof")
            info = frame[2]
            node = NodeInfo(int(info["node"]), str(info["name"]), str(info["host"]),
                            int(info["pid"]), dict(info["environ"]), list(info["cpus"]))
        except (OSError, auth.AuthError, ValueError, KeyError, TypeError) as exc:
            with self.lock:
                self.pending.pop(sock, None)
            self._drop(sock, peer, exc)
            return
        with self.lock:
            self.pending.pop(sock, None)
            if self.over:
                sock.close()
                return
            self.done.put((sock, node))

    def joined(self):
        while True:
            try:
                yield self.done.get_nowait()
            except queue.Empty:
                return

    def end(self) -> None:
        """No more joining: the connections still proving themselves are cut."""
        with self.lock:
            self.over = True
            pending = list(self.pending)
        for sock in pending:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for sock, _node in self.joined():
            sock.close()


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
        payload = linux.read_all_fd(fds[0])
        if not link.send(tunnel.START, token, (spec, [payload])):
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
