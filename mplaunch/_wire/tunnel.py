"""Frames between a launching process and a node agent (a World across nodes), on one
TCP connection per node, after both sides proved they hold the World's secret
(_wire.auth): a 13-byte header (kind, the rank's token, the body's length) and the body.

Kinds that carry a rank's bytes (its output, its stack socket) carry them raw; the
others carry a pickle, which only an authenticated peer ever gets to send. A channel
message to or from a rank travels with the contents of the fds attached to it (memfds:
a call's payload, a large result's buffers), which the other side turns back into
memfds: fds do not cross machines, their contents do.
"""
from __future__ import annotations

import pickle
import socket
import struct
from typing import List, Optional, Tuple

from . import linux
from .channel import send_framed

__mplaunch_plumbing__ = True

_HEADER = struct.Struct("!BIQ")

# front -> agent
CONFIG, OPEN, START, TO_RANK, TO_STACK, SIGNAL_GROUPS, SIGNAL_RANKS, SWEEP, CLOSE_GROUP, \
    BYE, CREDIT = range(1, 12)
# agent -> front
HELLO, READY, STARTED, EXITED, START_FAILED, FROM_RANK, OUT, ERR, FROM_STACK, SWEPT, \
    CLOSED, SERVER_LOST, SIGNALED = range(32, 45)

RAW = {TO_STACK, OUT, ERR, FROM_STACK}

# How many bytes of one rank's stdout (or stderr) an agent sends ahead of what the
# launching process has written on (CREDIT frames give it back). Past that the agent
# stops reading the rank's pipe and the rank blocks on it, as a rank on this node does
# when nobody reads its output: a flood between calls slows the rank, never grows the
# launching process's memory (at most this much per rank and stream).
OUTPUT_WINDOW = 1 << 20


def keepalive(sock: socket.socket, idle: int = 5, interval: int = 2,
              count: int = 3) -> None:
    """A node that vanished (powered off, cut off) sends no FIN: TCP keepalive finds it
    in idle + interval * count seconds."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", idle), ("TCP_KEEPINTVL", interval),
                        ("TCP_KEEPCNT", count)):
        opt = getattr(socket, name, None)
        if opt is not None:
            sock.setsockopt(socket.IPPROTO_TCP, opt, value)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def send(sock: socket.socket, kind: int, token: int = 0, body=b"") -> None:
    """One frame; `body` is bytes for RAW kinds, anything picklable for the others.
    Callers sending from several threads hold a lock around it."""
    if kind not in RAW:
        body = pickle.dumps(body, protocol=pickle.HIGHEST_PROTOCOL)
    sock.sendall(_HEADER.pack(kind, token, len(body)) + body if len(body) < 65536
                 else _HEADER.pack(kind, token, len(body)))
    if len(body) >= 65536:
        sock.sendall(body)


def recv_exactly(sock: socket.socket, n: int) -> Optional[bytes]:
    """`n` bytes from a stream socket, blocking; None if it ends first."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            return None
        got += k
    return bytes(buf)


def recv(sock: socket.socket) -> Optional[Tuple[int, int, object]]:
    """(kind, token, body) of the next frame, blocking; None at EOF."""
    head = recv_exactly(sock, _HEADER.size)
    if head is None:
        return None
    kind, token, size = _HEADER.unpack(head)
    body = recv_exactly(sock, size) if size else b""
    if body is None:
        return None
    if kind not in RAW:
        body = pickle.loads(body)
    return kind, token, body


def fd_contents(fds: List[int]) -> List[bytes]:
    """The contents of these memfds, which are closed."""
    try:
        return [linux.read_all_fd(fd) for fd in fds]
    finally:
        linux.close_quiet(*fds)


def memfds(blobs: List[bytes]) -> List[int]:
    return [linux.memfd_with(b, "mplaunch-remote") for b in blobs]


def deliver(sock: socket.socket, data: bytes, blobs: List[bytes]) -> None:
    """A channel message that came as a frame, written whole to a rank's channel socket
    (which its reader keeps non-blocking), its fds made again from their contents and
    closed once sent. Raises OSError when the channel is gone."""
    fds = memfds(blobs)
    try:
        sock.setblocking(True)
        try:
            send_framed(sock, data, fds)
        finally:
            sock.setblocking(False)
    finally:
        linux.close_quiet(*fds)
