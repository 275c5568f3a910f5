"""The agents of a World across nodes joining it: each connection to the agent port proves
it holds the World's secret (_wire.auth) and says which node it is (a Hello record), in a
thread of its own, so that a client that connects and says nothing holds up nobody but
itself; what joined is the Hub's (hub.py). Each connection dropped is counted
(Hub.dropped) and logged.

Rejected: proving each connection in the accepting loop, one after another (a silent
client held every agent back for its timeout)."""
from __future__ import annotations

import dataclasses
import logging
import queue
import socket
import threading
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from ..._wire import auth, tunnel
from ..._wire.link import Hello

log = logging.getLogger("mplaunch")
__mplaunch_plumbing__ = True


@dataclasses.dataclass
class NodeInfo:
    """A node of the World, as its agent said when it joined (and its placement, once
    ready). `index` is its place in the World (its ranks' NODE_RANK); `slot` is the
    scheduler's number for it (the step's task, the placement group's bundle), the same
    unless the World went on without a lost node (World.restart(nnodes=M)), which
    renumbers the others but not their slots."""
    index: int
    name: str
    host: str
    pid: int
    environ: Dict[str, str]
    cpus: List[int]
    gpus: Optional[tuple] = None
    placed_cpus: Optional[tuple] = None
    payloads: int = 0       # payloads sent to the node so far (_engine.nodes.payloads)
    clock_offset_ns: int = 0  # its wall clock less ours (hub._clock_offset)
    slot: int = -1            # the scheduler's number for it: `index` when it joined

    def __post_init__(self):
        if self.slot == -1:
            self.slot = self.index


class Joining:
    """Connections to the agent port proving themselves, each in a thread. Each one
    dropped (it did not prove itself, or came too late) is counted (Hub.dropped) and
    logged."""
    MAX = 64    # more at once than any allocation's agents: refused at once

    def __init__(self, secret: str, hub):
        self.secret, self.hub = secret, hub
        self.lock = threading.Lock()
        self.counting = threading.Lock()
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
        with self.counting:
            self.hub.dropped += 1
        log.warning("mplaunch dropped a connection from %s to the World's agent port: %s",
                    peer, why)
        sock.close()

    def _prove(self, sock: socket.socket, peer) -> None:
        try:
            auth.prove(sock, self.secret, server=True, timeout=10.0)
            sock.settimeout(30.0)
            hello = tunnel.recv(sock)     # unpickled only now: the peer proved itself
            if not isinstance(hello, Hello):
                raise auth.AuthError("no hello after its proof")
            node = NodeInfo(int(hello.node), str(hello.name), str(hello.host),
                            int(hello.pid), dict(hello.environ), list(hello.cpus))
        except (OSError, auth.AuthError, ValueError, KeyError, TypeError) as exc:
            with self.lock:
                self.pending.pop(sock, None)
            self._drop(sock, peer, exc)
            return
        with self.lock:
            self.pending.pop(sock, None)
            late = self.over
            if not late:
                self.done.put((sock, node, peer))
        if late:
            self._drop(sock, peer, "it proved itself after the World's agents had joined")

    def joined(self):
        while True:
            try:
                sock, node, _peer = self.done.get_nowait()
            except queue.Empty:
                return
            yield sock, node

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
        while True:
            try:
                sock, _node, peer = self.done.get_nowait()
            except queue.Empty:
                return
            self._drop(sock, peer, "it proved itself after the World's agents had joined")


def accept(listener: socket.socket, secret: str, hub, want: Sequence[int], timeout: float,
           step, said: Callable[[], str],
           cancelled: Callable[[], bool] = lambda: False
           ) -> Optional[Dict[int, Tuple[socket.socket, NodeInfo]]]:
    """The agents of nodes `want` in (the World's step's, or a replacement's), each
    having proved `secret`, by node index; None if `cancelled()` first. Each connection
    proves itself in a thread of its own (Joining): a client that connects and says
    nothing holds up nobody but itself. Raises NodesError (from .agents: `error`) for a
    step that ends first, the timeout, or two agents saying they are one node."""
    from .agents import NodesError
    end = time.monotonic() + timeout
    got: Dict[int, Tuple[socket.socket, NodeInfo]] = {}
    joining = Joining(secret, hub)
    listener.settimeout(0.1)
    try:
        while len(got) < len(want):
            if cancelled():
                return None
            if time.monotonic() > end:
                raise NodesError(f"{len(got)} of {len(want)} node agent(s) joined within "
                                 f"{timeout:g} s; {said()}")
            if step.poll() is not None:
                raise NodesError(f"the step of node agents ended (exit status "
                                 f"{step.returncode}) before {len(want)} joined; {said()}")
            try:
                joining.begin(*listener.accept())
            except socket.timeout:
                pass
            for sock, node in joining.joined():
                if node.index in got or node.index not in want:
                    sock.close()
                    raise NodesError(f"two agents (or one out of range) said they are "
                                     f"node {node.index} of {len(want)}: is each node "
                                     f"given one task? {said()}")
                sock.settimeout(None)
                tunnel.keepalive(sock)
                got[node.index] = (sock, node)
    except BaseException:
        for sock, _ in got.values():
            sock.close()
        raise
    finally:
        joining.end()
    return got
