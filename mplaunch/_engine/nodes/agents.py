"""What every scheduler of a World across nodes shares: the error its nodes raise, the
agent's command, the port the agents connect to, and ending a step that is one process
on this machine (srun, or the tests' stand-in)."""
from __future__ import annotations

import logging
import signal
import subprocess
import sys
from typing import List, Optional, Sequence, Callable

import socket

from .. import servers, store

log = logging.getLogger("mplaunch")

AGENT_MODULE = "mplaunch._agent.agent"


class NodesError(RuntimeError):
    """The World's nodes could not be started or reached."""


def agent_argv() -> List[str]:
    """What each node of the step runs: this interpreter, as an agent."""
    return [sys.executable, "-m", AGENT_MODULE]


def listen(address: str) -> socket.socket:
    """The port the World's agents connect to, bound as the store's is (store.bind)."""
    try:
        sock = store.bind(address, 0)
    except OSError as exc:
        raise NodesError(f"cannot listen on {address!r} for the World's node agents: "
                         f"{exc}; give master_addr= an address of this machine that the "
                         "nodes reach") from None
    servers.own_socket(sock)
    return sock


def join_addr(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class ProcessStep:
    """A step of node agents that is one process on this machine (srun, or a test's
    stand-in for it), ended by `cancel` (its scheduler's way of ending every process of
    the step on every node) when it outlives its connections."""

    def __init__(self, proc: subprocess.Popen, command: str,
                 cancel: Optional[Callable[[Sequence], bool]] = None,
                 step_replace: Optional[Callable] = None):
        self.proc = proc
        self.command = command
        self.cancel = cancel
        if step_replace is not None:
            # Its scheduler can start a lost node's agent again (Step.replace).
            self.replace = step_replace

    @property
    def returncode(self) -> Optional[int]:
        return self.proc.returncode

    def poll(self) -> Optional[int]:
        return self.proc.poll()

    def watch(self, on_end) -> None:
        """Nothing to watch: a node lost is known by its agent's connection."""

    def end(self, grace: float, nodes: Sequence = ()) -> None:
        """The agents end when their connection does, and the step with them. A step
        still there after `grace` (an agent frozen, or cut off) is cancelled by its
        scheduler (`cancel(nodes)`, if it can: what it cancelled, or False), then
        ended; said, unless `grace` was 0 (ended on purpose: a replaced part-step)."""
        proc = self.proc
        try:
            proc.wait(grace)
            return
        except subprocess.TimeoutExpired:
            pass
        if self.cancel is not None:
            try:
                cancelled = self.cancel(nodes)
                if cancelled:
                    if grace > 0:
                        log.warning("mplaunch: the World's step %s did not end with its "
                                    "connections within %g s; cancelled it",
                                    cancelled if isinstance(cancelled, str)
                                    else self.command, grace)
                    proc.wait(grace)
                    return
            except (subprocess.TimeoutExpired, OSError):
                pass
        for signo, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
            try:
                proc.send_signal(signo)
                proc.wait(wait)
                return
            except subprocess.TimeoutExpired:
                continue
            except ProcessLookupError:
                return
        log.warning("mplaunch: the World's step (%s, pid %d) did not end", self.command,
                    proc.pid)
