"""Frames between a launching process and a node agent (a World across nodes), on one
TCP connection per node, after both sides proved they hold the World's secret
(_wire.auth): a 13-byte header (kind, the rank's token, the body's length) and the body.

Kinds that carry a rank's bytes (its output, its stack socket) carry them raw; the
others carry a pickle, which only an authenticated peer ever gets to send. A channel
message from a rank travels with the contents of the fds attached to it (memfds: a large
result's buffers), which the other side turns back into memfds: fds do not cross
machines, their contents do. A payload (a start's or a call's memfd, large inputs
included) crosses once per node, not once per rank: a PAYLOAD frame streams the file,
under a key, into a memfd the agent keeps, and the frames that start or call the node's
ranks name it by that key (_engine.nodes.payloads decides when to send and drop one).
"""
from __future__ import annotations

import os
import pickle
import socket
import struct
from typing import List, Optional, Tuple

from . import buffers, linux
from .channel import send_framed

__mplaunch_plumbing__ = True

# What an agent reads from its environment, set by whoever starts it (the World's
# scheduler: _engine.nodes.schedulers): where the launching process listens, its node's
# index and name (or, where every node's agent is given the same environment, which of
# the variables its scheduler sets per node hold them: "INDEX_VAR:NAME_VAR"), whether the secret comes down stdin instead of MPLAUNCH_WORLD_SECRET, a
# process it ends with (the Ray actor), and a working directory its ranks start in
# whatever the launching process's is (the Ray job's runtime_env working_dir).
ADDR_ENV = "MPLAUNCH_WORLD_ADDR"
NODE_ENV = "MPLAUNCH_NODE_INDEX"
NAME_ENV = "MPLAUNCH_NODE_NAME"
NODE_FROM_ENV = "MPLAUNCH_NODE_FROM"
SECRET_STDIN_ENV = "MPLAUNCH_WORLD_SECRET_STDIN"
PARENT_ENV = "MPLAUNCH_AGENT_PARENT"
CWD_ENV = "MPLAUNCH_NODE_CWD"

_HEADER = struct.Struct("!BIQ")

# front -> agent
CONFIG, OPEN, START, TO_RANK, TO_STACK, SIGNAL_GROUPS, SIGNAL_RANKS, SWEEP, CLOSE_GROUP, \
    BYE, CREDIT, PAYLOAD, DROP = range(1, 14)
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
    if kind == PAYLOAD:
        payload = _recv_payload(sock, size)
        return None if payload is None else (kind, token, payload)
    body = recv_exactly(sock, size) if size else b""
    if body is None:
        return None
    if kind not in RAW:
        body = pickle.loads(body)
    return kind, token, body


_KEY = struct.Struct("!QQ")


def payload_key(fd: int) -> Tuple[int, int]:
    """What names a payload's file while someone holds it open: (device, inode)."""
    st = os.fstat(fd)
    return st.st_dev, st.st_ino


def send_payload(sock: socket.socket, key: Tuple[int, int], fd: int) -> None:
    """A PAYLOAD frame: `key`, then the file in `fd` streamed from the kernel (sendfile:
    no copy of a large payload in this process)."""
    size = os.fstat(fd).st_size
    sock.sendall(_HEADER.pack(PAYLOAD, 0, _KEY.size + size) + _KEY.pack(*key))
    done = 0
    while done < size:
        sent = os.sendfile(sock.fileno(), fd, done, size - done)
        if sent == 0:
            raise ConnectionError("the payload's file ended before its size")
        done += sent


def _recv_payload(sock: socket.socket, size: int):
    """(key, memfd) of a PAYLOAD frame's body, streamed into the memfd in chunks (a
    large payload is never whole in this process's memory), sealed as the launching
    process's was; None at EOF."""
    head = recv_exactly(sock, _KEY.size)
    if head is None:
        return None
    fd = os.memfd_create("mplaunch-payload", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        left = size - _KEY.size
        chunk = bytearray(min(left, 4 << 20))
        view = memoryview(chunk)
        while left:
            got = sock.recv_into(view[:min(left, len(chunk))])
            if got == 0:
                os.close(fd)
                return None
            data = view[:got]
            while data:
                data = data[os.write(fd, data):]
            left -= got
        buffers.seal(fd)
    except BaseException:
        os.close(fd)
        raise
    return _KEY.unpack(head), fd


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
        deliver_fds(sock, data, fds)
    finally:
        linux.close_quiet(*fds)


def deliver_fds(sock: socket.socket, data: bytes, fds: List[int]) -> None:
    """As deliver, with fds this process has (and keeps)."""
    sock.setblocking(True)
    try:
        send_framed(sock, data, fds)
    finally:
        sock.setblocking(False)
