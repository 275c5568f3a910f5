"""One node's authenticated connection to its agent (Link), and the node's wall clock
against this process's (clock_offset), read once it has joined: the Hub's, and a
replacement's (mend.py)."""
from __future__ import annotations

import socket
import threading
import time
from typing import Optional

from .joining import NodeInfo
from ..._wire import tunnel
from ..._wire.link import Clock

__mplaunch_plumbing__ = True


def clock_offset(link: "Link", rounds: int = 3) -> int:
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
        self.beating = False              # it has sent a Beat: silence means it is lost
        self.unsent: Optional[int] = None  # bytes of ours it had not taken (pump)

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
