"""A lost node's replacement (issue 42): in a thread of its own, from the moment the
node is lost, the World's scheduler starts one agent on another node (or the same one,
back) as a part of the step (Step.replace), the agent joins through a port of its own
with the World's secret, and is configured as the others were; the Hub then installs
its link in the lost one's place (Hub.install) when the group asks for it, to start the
lost ranks there. The survivors are not touched: their ranks keep their processes.

Started as soon as the node is lost (not at the next call), so that by the time the
call in progress has released the survivors, or the next call comes, the replacement
is usually up. Only for a healing World (heal=True) whose scheduler can replace a node
(its Step offers ``replace``); otherwise a lost node ends the World as before.
"""
from __future__ import annotations

import dataclasses
import logging
import threading
from typing import Callable, Dict, List, Optional

from .agents import NodesError, join_addr, listen
from .joining import accept
from .links import Link

log = logging.getLogger("mplaunch")
__mplaunch_plumbing__ = True


class Mend:
    """The replacement of node `index` (the scheduler's `slot`), under way in its
    thread once made. One at a time per World (`serial`): a second one is placed
    knowing where the first went."""

    def __init__(self, mends: "Mends", index: int, slot: int):
        self.mends, self.index, self.slot = mends, index, slot
        self.link = None                 # the replacement's Link, once configured
        self.step = None                 # the scheduler's part-step running its agent
        self.error: Optional[str] = None
        self.done = threading.Event()
        self.cancelled = False
        self._step_ended = False
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"mplaunch-mend-{index}")
        self._thread.start()

    def _run(self) -> None:
        mends, hub = self.mends, self.mends.hub
        listener = None
        try:
            for part, node in mends.take_parts(self.slot):   # one lost in its turn
                part.end(0.0, [node])
            with mends.serial:
                if self.cancelled:
                    return
                listener = listen(hub.address)
                launch = hub.agent_launch(1, join_addr(hub.address,
                                                       listener.getsockname()[1]))
                self.step = hub.step.replace(self.slot, launch, mends.in_use(self.slot))
                joined = accept(listener, launch.secret, hub, [self.slot],
                                hub.join_timeout, self.step,
                                lambda: f"the replacement's step was {self.step.command}",
                                lambda: self.cancelled)
                if joined is None:
                    return
                link = Link(*joined[self.slot])
                link.info.index = self.index   # its place in the World (slot: the agent's)
                try:
                    hub.configure([link])
                except BaseException:
                    link.sock.close()
                    raise
                if self.cancelled:
                    link.sock.close()
                    return
                self.link = link
        except Exception as exc:  # noqa: BLE001 - said when the group asks (wait)
            self.error = f"{type(exc).__name__}: {exc}"
        finally:
            if listener is not None:
                listener.close()
            if self.cancelled:
                self._end_step(0.0)
            self.done.set()

    def wait(self):
        """The replacement's configured Link, once the mend ended (each of its steps is
        bounded: the scheduler's placing, the agent's join, its configuration); a
        NodesError saying why there is none."""
        while not self.done.wait(0.2):
            if self.cancelled:
                break
        if self.link is None:
            raise NodesError(f"node {self.index} could not be replaced: "
                             f"{self.error or 'the World was closed'}")
        return self.link

    def cancel(self, grace: float) -> None:
        """The World closes: stop waiting, end the part-step (its agent with it)."""
        self.cancelled = True
        if self._thread is not threading.current_thread():
            self._thread.join(5.0)
        link = self.link
        if link is not None and link.sock.fileno() != -1:
            link.sock.close()
        if self.done.is_set():
            self._end_step(grace)    # else the thread ends it when it returns

    def _end_step(self, grace: float) -> None:
        with self.mends.lock:
            step, ended, self._step_ended = self.step, self._step_ended, True
        if step is not None and not ended:
            step.end(grace, [self.link.info] if self.link is not None else [])


class Mends:
    """A World's lost nodes and their replacements (the Hub's): the mends under way, the
    part-steps that run replaced nodes' agents, and the links they replaced."""

    def __init__(self, hub, enabled: bool):
        self.hub, self.enabled = hub, enabled
        self.lock = threading.Lock()
        self.serial = threading.Lock()
        self.running: Dict[int, Mend] = {}
        self.parts: list = []             # (part-step, its node): installed replacements
        self.gone: List = []              # the links they replaced (closed at close)
        self.replaced: set = set()        # node slots a part-step runs now
        self.closing = False

    def can(self) -> bool:
        """A lost node is replaced, not the end of the World: a healing World whose
        scheduler's step can start a node's agent again (Step.replace), while a node
        still stands."""
        hub = self.hub
        return (self.enabled and not self.closing
                and callable(getattr(hub.step, "replace", None))
                and any(link.lost is None for link in hub.links))

    def mending(self, index: int) -> bool:
        mend = self.running.get(index)
        return mend is not None and not (mend.done.is_set() and mend.link is None)

    def broken(self) -> bool:
        """A node is lost and nothing replaces it (no mend began, or it failed)."""
        return any(link.lost is not None and not self.mending(i)
                   for i, link in enumerate(self.hub.links))

    def begin(self, link) -> None:
        """`link`'s node was lost: its replacement begins at once, where it can."""
        with self.lock:   # (its index may change meanwhile: Hub.drop)
            index = link.info.index
            if (not self.can() or index >= len(self.hub.links)
                    or self.hub.links[index] is not link or index in self.running):
                return
            log.warning("mplaunch.World: %s was lost (%s); starting a replacement for "
                        "it: its ranks start again there, the other nodes' ranks keep "
                        "theirs", link.describe(), link.lost)
            self.running[index] = Mend(self, index, link.info.slot)

    def in_use(self, slot: int) -> list:
        """What a replacement for the node in `slot` must not land on but that node
        itself: every node of the World (its replacements under way too), and every node
        that failed before or left the World, as slot -1."""
        with self.lock:
            nodes = [link.info for link in self.hub.links]
            nodes += [m.link.info for m in self.running.values()
                      if m.slot != slot and m.link is not None]
            nodes += [dataclasses.replace(link.info, index=-1, slot=-1)
                      for link in self.gone]
        return nodes

    def take_parts(self, slot: int) -> list:
        """The (part-step, node) that ran the agent in `slot`, to end before it is
        replaced again."""
        with self.lock:
            mine = [(p, n) for p, n in self.parts if n.slot == slot]
            self.parts = [(p, n) for p, n in self.parts if n.slot != slot]
        return mine

    def take(self, index: int, old):
        """Lost node `index`'s replacement, once up: its Link and part-step, recorded as
        installed in place of `old`; NodesError saying why there is none."""
        mend = self.running.get(index)
        if mend is None:
            raise NodesError(f"{old.describe()} was lost and is not being replaced")
        link = mend.wait()
        with self.lock:
            self.running.pop(index, None)
            self.parts.append((mend.step, link.info))
            self.replaced.add(old.info.slot)
            self.gone.append(old)
        return link, mend.step

    def settle(self) -> None:
        """Return once no mend is under way (each ends by its own bounds)."""
        for mend in list(self.running.values()):
            while not mend.done.wait(0.2) and not mend.cancelled:
                pass

    def drop(self, links) -> None:
        """`links` leave the World (lost, not replaced: World.restart(nnodes=M)): a mend
        still trying for one is cancelled, and each is closed with the Hub."""
        with self.lock:
            mends = [self.running.pop(i) for i, link in enumerate(self.hub.links)
                     if link in links and i in self.running]
            self.gone += links
        for mend in mends:
            mend.cancel(0.0)

    def close(self, grace: float):
        """No more mends; those under way cancelled. The part-steps to end and the
        replaced links to close, for the Hub (once its pump is stopped)."""
        with self.lock:
            self.closing = True
            running, self.running = list(self.running.values()), {}
            parts, self.parts = self.parts, []
            gone, self.gone = self.gone, []
        for mend in running:
            mend.cancel(grace)
        return parts, gone


def moved(hub, group, dead: List[int], specs: Callable[[], list]) -> dict:
    """Across nodes: the lost nodes among the `dead` ranks' are replaced first (the
    Hub's mends, begun as each was lost: _engine.nodes.mend); the dead ranks' specs on
    their new node (from `specs()`, every rank's), by place. NodesError where a lost
    node has no replacement."""
    if hub is None:
        return {}
    lost = hub.install_lost({group.ranks[i].spec.node_rank for i in dead})
    every = specs() if lost else []
    return {i: every[i] for i in dead if group.ranks[i].spec.node_rank in lost}
