"""The launching side of a World across nodes: its one step of node agents
(_agent.agent, started by the World's scheduler: _engine.nodes.schedulers), the
authenticated connection to each
(_wire.auth, _wire.tunnel); RemoteSpawner (_engine.nodes.spawner), the spawner
that starts, signals and reaps ranks through them, uses it.

Every remote rank gets the fds a local one gets (result channel, output pipes, stack
socket): RemoteSpawner keeps the rank's ends, and the pump (_engine.nodes.pump) copies
between them and the node's connection, so the RankGroup, the heal and the relay that
drive one node's ranks drive these, unchanged. Reports (started, exited, a lost node)
reach the group in its own thread, through a queue and a pipe on its selector.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import queue
import socket
import tempfile
import threading
import time
from typing import Dict, List, Optional

from ..config import LaunchConfig
from .pump import Pump
from .agents import NodesError, agent_argv, join_addr, listen
from .schedulers import AgentLaunch, Scheduler, Step
from ..._wire import auth, tunnel

log = logging.getLogger("mplaunch")
__mplaunch_plumbing__ = True

JOIN_TIMEOUT = 120.0     # for every agent to connect and prove itself


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
    it ends the step and leaves nothing running on any node. The World's `scheduler`
    (schedulers.Scheduler) starts the step; the Hub asks the same of every one."""

    def __init__(self, nnodes: int, address: str, cfg: LaunchConfig, gpus, cpus,
                 scheduler: Scheduler, join_timeout: float = JOIN_TIMEOUT):
        self.nnodes = nnodes
        self.address = address
        self.cfg = cfg
        self.placement_args = (gpus, cpus)
        self.scheduler = scheduler
        self.join_timeout = join_timeout
        self.links: List[Link] = []
        self.step: Optional[Step] = None
        self._step_log = None
        self.pump: Optional[Pump] = None
        self.spawner = None  # the current group's (_engine.nodes.spawner), hears reports
        self.dropped = 0     # connections that failed to prove themselves

    @property
    def broken(self) -> bool:
        return any(link.lost is not None for link in self.links)

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
            env[tunnel.ADDR_ENV] = join_addr(self.address, port)
            env.pop(tunnel.NODE_ENV, None)
            self._step_log = tempfile.TemporaryFile(prefix="mplaunch-agents-")
            self.step = self.scheduler.start(AgentLaunch(
                tuple(agent_argv()), env, self.nnodes, self._step_log, secret,
                env[tunnel.ADDR_ENV]))
            self._accept(listener, secret)
        except BaseException:
            listener.close()
            self.close()
            raise
        listener.close()    # every agent is in: nobody else gets to connect
        self._configure()
        self.pump = Pump(self)
        self.step.watch(self._node_ended)   # a scheduler that learns of a lost node
        return self

    def _node_ended(self, index: int, why: str) -> None:
        """The scheduler says node `index`'s agent ended: its link is cut at once, and
        the pump takes it as a lost node (and the agent, if it is still there, ends with
        its connection, its ranks with it)."""
        if not 0 <= index < len(self.links):
            return
        link = self.links[index]
        if link.lost is None:
            link.lost = why
            try:
                link.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

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
        cmd = self.step.command if self.step is not None else "not started"
        return (f"the step ({cmd}) printed:\n{text}" if text
                else f"the step ({cmd}) printed nothing")

    # -- the end -----------------------------------------------------------------------
    def close(self, grace: float = 10.0) -> None:
        """End every agent (and so every rank) and the step; idempotent. With a node
        lost, the step is not waited for long: its scheduler ends it (step.end)."""
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
            step.end(grace, self.nodes)
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
