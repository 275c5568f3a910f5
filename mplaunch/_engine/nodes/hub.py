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
from typing import Dict, List, NamedTuple, Optional, Sequence

from ..config import LaunchConfig
from .agents import NodesError, agent_argv, join_addr, listen
from .mend import Mends
from .joining import NodeInfo, accept
from .links import Link, clock_offset
from .payloads import NodePayloads
from .pump import Pump
from .schedulers import AgentLaunch, Scheduler, Step
from ..._wire import auth, tunnel
from ..._wire.link import (Beat, Bye, Closed, Configure, Exited, NotReady, OpenGroup,
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


class Hub:
    """A World's nodes: the step of agents, one authenticated link to each, and the pump
    thread. Lives as long as the World (a heal or a replaced rank reuses it); closed,
    it ends the step and leaves nothing running on any node. The World's `scheduler`
    (schedulers.Scheduler) starts the step; the Hub asks the same of every one."""

    def __init__(self, nnodes: int, address: str, cfg: LaunchConfig, gpus, cpus,
                 scheduler: Scheduler, join_timeout: float = JOIN_TIMEOUT,
                 mend: bool = False):
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
        self.mends = Mends(self, mend)   # a healing World's lost nodes replaced
        self._secret = ""

    @property
    def can_mend(self) -> bool:
        return self.mends.can()

    @property
    def broken(self) -> bool:
        """A node is lost and will not be replaced: the World's step ends."""
        return self.mends.broken()

    @property
    def nodes(self) -> List[NodeInfo]:
        return [link.info for link in self.links]

    # -- start -------------------------------------------------------------------------
    def start(self) -> "Hub":
        self._secret = secret = auth.new_secret()
        listener = listen(self.address)
        try:
            port = listener.getsockname()[1]
            self._step_log = tempfile.TemporaryFile(prefix="mplaunch-agents-")
            self.step = self.scheduler.start(
                self.agent_launch(self.nnodes, join_addr(self.address, port)))
            joined = accept(listener, secret, self, range(self.nnodes), self.join_timeout,
                            self.step, self._step_said)
            self.links = [Link(*joined[i]) for i in range(self.nnodes)]
            listener.close()    # every agent is in: nobody else gets to connect
            # Whatever fails from here on (a node that cannot place its ranks, an agent
            # that ends, an interrupt while they start their servers) ends the step too.
            self.configure(self.links)
            self._pump = pump = Pump(self)
            self._routes = {Output: pump.output, StackBytes: pump.from_stack,
                            RankMessage: pump.from_rank, Signaled: self._signaled,
                            Beat: self._beat,
                            **{kind: self.report for kind in _REPORTS}}
            pump.start()
            self.step.watch(self._node_ended)   # a scheduler that learns of a lost node
        except BaseException:
            listener.close()
            self.close()
            raise
        return self

    def agent_launch(self, nnodes: int, addr: str) -> AgentLaunch:
        """What a scheduler starts for `nnodes` agents that join at `addr` with this
        World's secret (the step, or a lost node's replacement: mend.py)."""
        env = dict(os.environ)
        env[auth.SECRET_ENV] = self._secret
        env[tunnel.ADDR_ENV] = addr
        for name in (tunnel.NODE_ENV, tunnel.NAME_ENV, tunnel.NODE_FROM_ENV):
            env.pop(name, None)   # this process's own, if it is a node's rank
        return AgentLaunch(tuple(agent_argv()), env, nnodes, self._step_log,
                           self._secret, addr)

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

    @staticmethod
    def _beat(link: Link, _record: Beat) -> None:
        link.beating = True   # from now on the pump takes its silence as a lost node

    def report(self, link: Link, record) -> None:
        """The one way a report (a record of _REPORTS) reaches the group: the current
        spawner's handler of it, run in the group's thread; with no group, nobody hears."""
        spawner = self._spawner
        if spawner is not None:
            spawner.post(getattr(spawner, _REPORTS[type(record)]), link, record)

    def lose(self, link: Link, why: str) -> None:
        """`link`'s node is lost (its connection ended, or its agent stopped answering):
        its connection is cut, the group hears, and where the World heals, its
        replacement begins at once (mend.py)."""
        link.lost = link.lost or why
        try:
            link.sock.shutdown(socket.SHUT_RDWR)   # a frozen agent's ranks end with it
        except OSError:
            pass
        self.mends.begin(link)
        self.report(link, LinkLost(link.lost))

    def install_lost(self, only=None) -> List[int]:
        """Every lost node's replacement (of the nodes `only`, if given) installed in its
        place (install); their indices."""
        lost = [i for i, link in enumerate(self.links)
                if link.lost is not None and (only is None or i in only)]
        for index in lost:
            self.install(index)
        return lost

    def install(self, index: int) -> Link:
        """The group asks for lost node `index`'s replacement, to start its ranks there:
        its Link, in the lost one's place, once it is up (mend.py); NodesError saying
        why there is none. The lost link is closed with the Hub (the pump may still
        hold it)."""
        old = self.links[index]
        if old.lost is None:
            return old
        link, part = self.mends.take(index, old)
        with self.mends.lock:
            self.links[index] = link
        self._payloads.forget(old.info.slot)
        self._pump.add_link(link)
        part.watch(lambda i, why: self._node_ended(i, why, link))
        if self._spawner is not None:
            link.beating = False
            link.send(OpenGroup())
        return link

    def drop(self, lost: Sequence[Link]) -> None:
        """Go on without the nodes of `lost` (World.restart(nnodes=M), where none can be
        replaced): their links leave the World, closed with the Hub; the others are
        renumbered in their order (their ranks' NODE_RANK), keeping their slots (the
        scheduler's numbers, which its step and part-steps speak of)."""
        self.mends.drop(lost)
        with self.mends.lock:
            self.links = [link for link in self.links if link not in lost]
            for i, link in enumerate(self.links):
                link.info.index = i
            self.nnodes = len(self.links)
        for link in lost:
            self._payloads.forget(link.info.slot)

    # -- what the group asks (in its thread; a call, in the pump's) ----------------------
    def open_group(self, spawner) -> None:
        """`spawner`'s group begins: it hears the reports from now on, each agent opens a
        launch channel, and a node lost already is reported at once."""
        self._spawner = spawner
        for link in self.links:
            link.beating = False   # until it beats again: it may start a cold server
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

    def _node_ended(self, index: int, why: str, link: Optional[Link] = None) -> None:
        """The scheduler says node `index`'s agent ended (`link`'s, for a replacement's
        part-step; the step's own speaks of its first agents, and of a replaced node's
        only late): its link is cut at once, and the pump takes it as a lost node (and
        the agent, if it is still there, ends with its connection, its ranks with it)."""
        with self.mends.lock:
            if link is None:
                if index in self.mends.replaced:
                    return
                link = next((lk for lk in self.links if lk.info.slot == index), None)
                if link is None:
                    return   # a node the World went on without
        if link.lost is None:
            link.lost = why
            try:
                link.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self.mends.begin(link)

    def configure(self, links: Sequence[Link]) -> None:
        """Send each agent the configuration; each starts its warm server and places its
        node's ranks (GPUs, CPUs: what that node has)."""
        cfg = dataclasses.replace(self.cfg, stdout=None, stderr=None)
        gpus, cpus = self.placement_args
        for link in links:
            link.send(Configure(cfg, gpus, cpus))
        for link in links:
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
        for link in links:
            link.info.clock_offset_ns = clock_offset(link)

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
        if any(link.lost is not None for link in self.links):
            grace = min(grace, 3.0)
        parts, gone = self.mends.close(grace)
        for link in self.links:
            link.send(Bye())
        pump, self._pump = self._pump, None
        if pump is not None:
            pump.stop()
        self._payloads.clear()
        for link in gone:
            link.sock.close()
        for link in self.links:
            try:
                link.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            link.sock.close()
            link.lost = link.lost or "the World was closed"
        step, self.step = self.step, None
        if step is not None:
            # Each node with the step that runs its agent now (a replaced node's: its part).
            step.end(grace, [n for n in self.nodes
                             if n.slot not in self.mends.replaced])
        for part, node in parts:
            part.end(grace, [node])
        if self._step_log is not None:
            self._step_log.close()
            self._step_log = None
