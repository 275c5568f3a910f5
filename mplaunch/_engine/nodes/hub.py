"""The launching side of a World across nodes: its one step of node agents
(_agent.agent, started by the World's scheduler: _engine.nodes.schedulers), the
authenticated link to each (_wire.auth, _wire.tunnel), and the one place where the
launching side's pieces meet: the pump (_engine.nodes.pump), the payloads each node
holds (_engine.nodes.payloads) and the current group's spawner (_engine.nodes.spawner,
RemoteSpawner, which starts, signals and reaps ranks through the agents).

Every remote rank gets the fds a local one gets (result channel, output pipes, stack
socket): the pump keeps the rank's ends and copies between them and the node's link, so
the RankGroup, the heal and the relay that drive one node's ranks drive these, unchanged.
Every record an agent sends (_wire.link) is routed once, by its type, in Hub.received
(in the pump's thread): a rank's bytes to the pump, a signal's answer to its link, and
the group's reports (started, exited, a lost node) through Hub.report to the current
spawner's handler, run in the group's own thread (a queue and a pipe on its selector).

Rejected: pieces that reach into each other (the spawner into the pump's payloads and
proxies, the pump into the spawner), which tied each to the others' private state; they
ask the Hub, whose methods say what the launching side does with the nodes.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import socket
import tempfile
import threading
import time
from typing import Dict, List, NamedTuple, Optional, Sequence

from ..config import LaunchConfig
from .agents import NodesError, agent_argv, join_addr, listen
from .joining import Joining, NodeInfo
from .payloads import NodePayloads
from .pump import Pump
from .schedulers import AgentLaunch, Scheduler, Step
from ..._wire import auth, tunnel
from ..._wire.link import (Bye, Clock, Closed, Configure, Exited, NotReady, OpenGroup,
                           Output, RankMessage, Ready, ServerLost, Signaled, StackBytes,
                           Started, StartFailed, StartRank, Swept, ToRank)
from ..._wire.spec import RankSpec

log = logging.getLogger("mplaunch")
__mplaunch_plumbing__ = True

JOIN_TIMEOUT = 120.0     # for every agent to connect and prove itself


class LinkLost(NamedTuple):
    """The launching side's own report, never sent: a node's link ended, or its agent
    stopped answering (RemoteSpawner's checks)."""
    tag = "link-lost"
    why: str


# The report records, and the current spawner's handler of each (Hub.report).
_REPORTS = {Started: "on_started", Exited: "on_exited", StartFailed: "on_start_failed",
            ServerLost: "on_server_lost", LinkLost: "on_link_lost", Swept: "on_answer",
            Closed: "on_answer"}


def _clock_offset(link: "Link", rounds: int = 3) -> int:
    """How far `link`'s node's wall clock is ahead of this process's, in ns: NTP's
    estimate (the agent read its clock halfway through the round trip), from the
    quickest of a few round trips. Only the Flight Recorder's times use it (a straggler
    report across nodes, _engine.stragglers); a link that fails here is left to the
    pump, which reports it, so this never raises."""
    best = None
    link.sock.settimeout(10.0)
    try:
        for _ in range(rounds):
            sent = time.time_ns()
            tunnel.send(link.sock, Clock(sent))
            back = tunnel.recv(link.sock)
            came = time.time_ns()
            if isinstance(back, Clock) and (best is None or came - sent < best[0]):
                best = (came - sent, back.theirs - (sent + came) // 2)
    except OSError:
        pass
    finally:
        if link.sock.fileno() != -1:
            link.sock.settimeout(None)
    return best[1] if best is not None else 0


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

    def send(self, record) -> bool:
        """`record` (_wire.link) to the agent; False if the link is lost."""
        if self.lost is not None:
            return False
        try:
            with self.lock:
                tunnel.send(self.sock, record)
            return True
        except OSError as exc:
            self.lost = self.lost or f"its connection failed ({exc})"
            return False

    def send_signal(self, record) -> Optional[int]:
        """A signal request (SignalGroups, SignalRanks), counted: its number, which
        `acked` reaches once the agent answered it; None if the link is lost."""
        if not self.send(record):
            return None
        self.signals += 1
        return self.signals

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
        self._pump: Optional[Pump] = None
        self._payloads = NodePayloads()   # which payload each node holds
        self._spawner = None  # the current group's (_engine.nodes.spawner): Hub.report
        self._routes: Dict[type, object] = {}
        self.dropped = 0     # connections dropped at the agent port (each logged)

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
            for name in (tunnel.NODE_ENV, tunnel.NAME_ENV, tunnel.NODE_FROM_ENV):
                env.pop(name, None)   # this process's own, if it is a node's rank
            self._step_log = tempfile.TemporaryFile(prefix="mplaunch-agents-")
            self.step = self.scheduler.start(AgentLaunch(
                tuple(agent_argv()), env, self.nnodes, self._step_log, secret,
                env[tunnel.ADDR_ENV]))
            self._accept(listener, secret)
            listener.close()    # every agent is in: nobody else gets to connect
            # Whatever fails from here on (a node that cannot place its ranks, an agent
            # that ends, an interrupt while they start their servers) ends the step too.
            self._configure()
            self._pump = pump = Pump(self)
            self._routes = {Output: pump.output, StackBytes: pump.from_stack,
                            RankMessage: pump.from_rank, Signaled: self._signaled,
                            **{kind: self.report for kind in _REPORTS}}
            pump.start()
            self.step.watch(self._node_ended)   # a scheduler that learns of a lost node
        except BaseException:
            listener.close()
            self.close()
            raise
        return self

    # -- what the agents say (in the pump's thread) --------------------------------------
    def received(self, link: Link, record) -> None:
        """The launching side's one dispatch of what the agents send: each record to the
        one that handles it."""
        route = self._routes.get(type(record))
        if route is None:
            log.warning("mplaunch: %s from %s ignored", type(record).__name__,
                        link.describe())
            return
        route(link, record)

    @staticmethod
    def _signaled(link: Link, _record: Signaled) -> None:
        link.acked += 1

    def report(self, link: Link, record) -> None:
        """The one way a report (a record of _REPORTS) reaches the group: the current
        spawner's handler of it, run in the group's thread; with no group, nobody hears."""
        spawner = self._spawner
        if spawner is not None:
            spawner.post(getattr(spawner, _REPORTS[type(record)]), link, record)

    def lose(self, link: Link, why: str) -> None:
        """`link`'s node is lost (its connection ended, or its agent stopped answering):
        the group hears."""
        link.lost = link.lost or why
        self.report(link, LinkLost(link.lost))

    # -- what the group asks (in its thread; a call, in the pump's) ----------------------
    def open_group(self, spawner) -> None:
        """`spawner`'s group begins: it hears the reports from now on, each agent opens a
        launch channel, and a node lost already is reported at once."""
        self._spawner = spawner
        for link in self.links:
            link.send(OpenGroup())
        for link in self.links:
            if link.lost is not None:
                self.report(link, LinkLost(link.lost))

    def end_group(self, spawner) -> None:
        """`spawner`'s group ended (after CloseGroup): nobody hears the reports."""
        if self._spawner is spawner:
            self._spawner = None

    def broadcast(self, record) -> List[Link]:
        """`record` to every agent: the links it reached."""
        return [link for link in self.links if link.send(record)]

    def add_rank_proxy(self, token: int, link: Link, fds: Sequence[int]) -> None:
        """The pump copies between rank `token`'s child ends `fds` and `link`."""
        self._pump.add_proxy(token, link, fds)

    def drop_rank_proxy(self, token: int) -> None:
        self._pump.drop_proxy(token)

    def start_rank(self, link: Link, token: int, spec: RankSpec,
                   fds: Sequence[int]) -> None:
        """Start rank `token` on `link`'s node with the child ends `fds` (RANK_FDS
        order), its payload sent there first unless the node holds it; a lost node is
        reported as the rank's failure to start."""
        self.add_rank_proxy(token, link, fds)
        if not self._payloads.send(link, [fds[0]],
                                   lambda keys: StartRank(token, spec, keys[0])):
            self.report(link, StartFailed(token, f"{link.describe()} is lost: {link.lost}"))

    def call_rank(self, link: Link, token: int, data: bytes, fds: Sequence[int]) -> bool:
        """A message for a remote rank's channel (a call): its payloads go to the node
        once, for all its ranks. False if the link is lost."""
        return self._payloads.send(link, list(fds),
                                   lambda keys: ToRank(token, data, tuple(keys)))

    def drop_payloads(self) -> None:
        """The group ended: its agents dropped theirs (CloseGroup)."""
        self._payloads.clear()

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
        in a thread of its own (joining.Joining): a client that connects and says
        nothing holds up nobody but itself."""
        end = time.monotonic() + self.join_timeout
        links: Dict[int, Link] = {}
        joining = Joining(secret, self)
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
                        raise NodesError(f"two agents (or one out of range) said they "
                                         f"are node {node.index} of {self.nnodes}: is each "
                                         f"node given one task? {self._step_said()}")
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
            link.send(Configure(cfg, gpus, cpus))
        for link in self.links:
            link.sock.settimeout(300.0)
            try:
                ready = tunnel.recv(link.sock)
            except OSError as exc:
                ready = None
                link.lost = str(exc)
            finally:
                if link.sock.fileno() != -1:
                    link.sock.settimeout(None)
            if isinstance(ready, NotReady):
                raise NodesError(f"{link.describe()} cannot run this World: "
                                 f"{ready.reason}")
            if not isinstance(ready, Ready):
                raise NodesError(f"{link.describe()}'s agent ended while starting; "
                                 f"{self._step_said()}")
            link.info.gpus, link.info.placed_cpus = ready.gpus, ready.cpus
        for link in self.links:
            link.info.clock_offset_ns = _clock_offset(link)

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
            link.send(Bye())
        pump, self._pump = self._pump, None
        if pump is not None:
            pump.stop()
        self._payloads.clear()
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
