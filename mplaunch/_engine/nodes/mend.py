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

import logging
import threading
from typing import Optional

from .agents import NodesError, join_addr, listen
from .joining import accept
from .links import Link

log = logging.getLogger("mplaunch")
__mplaunch_plumbing__ = True


class Mend:
    """The replacement of node `index`, under way in its thread once made."""

    def __init__(self, hub, index: int, timeout: float):
        self.hub, self.index, self.timeout = hub, index, timeout
        self.link = None                 # the replacement's Link, once configured
        self.step = None                 # the scheduler's part-step running its agent
        self.error: Optional[str] = None
        self.done = threading.Event()
        self._cancelled = False
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"mplaunch-mend-{index}")
        self._thread.start()

    def _run(self) -> None:
        hub = self.hub
        listener = None
        try:
            for part in hub.take_parts(self.index):   # a replacement lost in its turn
                part.end(0.0, [])
            listener = listen(hub.address)
            launch = hub.agent_launch(1, join_addr(hub.address,
                                                   listener.getsockname()[1]))
            self.step = hub.step.replace(self.index, launch, hub.nodes)
            joined = accept(listener, launch.secret, hub, [self.index], self.timeout,
                            self.step, lambda: f"the replacement's step was "
                                               f"{self.step.command}",
                            lambda: self._cancelled)
            if joined is None:
                return
            link = Link(*joined[self.index])
            try:
                hub.configure([link])
            except BaseException:
                link.sock.close()
                raise
            if self._cancelled:
                link.sock.close()
                return
            self.link = link
        except Exception as exc:  # noqa: BLE001 - said when the group asks (wait)
            self.error = f"{type(exc).__name__}: {exc}"
        finally:
            if listener is not None:
                listener.close()
            self.done.set()

    def wait(self, timeout: float):
        """The replacement's configured Link; NodesError saying why there is none."""
        if not self.done.wait(timeout):
            raise NodesError(f"node {self.index}'s replacement did not join within "
                             f"{timeout:g} s")
        if self.link is None:
            raise NodesError(f"node {self.index} could not be replaced: "
                             f"{self.error or 'cancelled'}")
        return self.link

    def cancel(self, grace: float = 3.0) -> None:
        """The World closes: stop waiting, end the part-step (its agent with it)."""
        self._cancelled = True
        if self._thread is not threading.current_thread():
            self._thread.join(5.0)
        link = self.link
        if link is not None and link.sock.fileno() != -1:
            link.sock.close()
        if self.step is not None:
            self.step.end(grace, [link.info] if link is not None else [])
