"""Frames between a launching process and a node agent (a World across nodes), on one
TCP connection per node, after both sides proved they hold the World's secret
(_wire.auth): a 13-byte header (kind, the rank's token, the body's length) and the body.
What the frames carry are the agent link's records (_wire.link): `send` frames one,
`recv` gives the next one back.

Most records travel pickled, in RECORD frames, which only an authenticated peer ever
gets to send. The four that carry bulk bytes have raw frames of their own, so that
nothing copies those bytes into a pickle and out again: a rank's output (OUT, ERR) and
its stack socket's bytes (STACK) as they are; a message from a rank's channel
(RANK_MESSAGE) with the contents of the fds attached to it (memfds: a large result's
buffers), streamed from the files by sendfile and into memfds again on the other side,
since fds do not cross machines, their contents do; and a payload (PAYLOAD: a start's or
a call's memfd, large inputs included), which crosses once per node, not once per rank:
the file streams, under a key, into a memfd the agent keeps, and the records that start
or call the node's ranks name it by that key (_engine.nodes.payloads decides when to send
and drop one).

Rejected: one pickle for every frame (before, for all but output and stack bytes): a
large result was copied into the pickle and out of it on both ends, and held whole in
each process's memory; and a kind per message: the kinds and their bodies' shapes were a
second vocabulary beside the records (_wire.link says why).
"""
from __future__ import annotations

import os
import pickle
import socket
import struct
from typing import List, Optional

from . import buffers
from .channel import send_framed
from .link import Output, Payload, RankMessage, StackBytes

__mplaunch_plumbing__ = True

# What an agent reads from its environment, set by whoever starts it (the World's
# scheduler: _engine.nodes.schedulers): where the launching process listens, its node's
# index and name (or, where every node's agent is given the same environment, which of
# the variables its scheduler sets per node hold them: "INDEX_VAR:NAME_VAR"), whether
# the secret comes down stdin instead of MPLAUNCH_WORLD_SECRET, a process it ends with
# (the Ray actor), and a working directory its ranks start in whatever the launching
# process's is (the Ray job's runtime_env working_dir).
ADDR_ENV = "MPLAUNCH_WORLD_ADDR"
NODE_ENV = "MPLAUNCH_NODE_INDEX"
NAME_ENV = "MPLAUNCH_NODE_NAME"
NODE_FROM_ENV = "MPLAUNCH_NODE_FROM"
SECRET_STDIN_ENV = "MPLAUNCH_WORLD_SECRET_STDIN"
PARENT_ENV = "MPLAUNCH_AGENT_PARENT"
CWD_ENV = "MPLAUNCH_NODE_CWD"

_HEADER = struct.Struct("!BIQ")
RECORD, PAYLOAD, RANK_MESSAGE, OUT, ERR, STACK = range(1, 7)
RAW = (Output, StackBytes, RankMessage, Payload)   # the records sent as raw frames

_KEY = struct.Struct("!QQ")      # a payload's key
_MESSAGE = struct.Struct("!IQ")  # a rank message's number of files, and its data's size
_SMALL = 65536                   # a body below this goes in one write with its header


# How many bytes of one rank's stdout (or stderr) an agent sends ahead of what the
# launching process has written on (Credit records give it back). Past that the agent
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


def send(sock: socket.socket, record) -> None:
    """One frame carrying `record` (_wire.link). Callers sending from several threads
    hold a lock around it."""
    kind = type(record)
    if kind is Output:
        _frame(sock, OUT if record.stream == "out" else ERR, record.token, record.data)
    elif kind is StackBytes:
        _frame(sock, STACK, record.token, record.data)
    elif kind is RankMessage:
        _send_rank_message(sock, record)
    elif kind is Payload:
        _send_payload(sock, record)
    else:
        _frame(sock, RECORD, 0, pickle.dumps(record, protocol=pickle.HIGHEST_PROTOCOL))


def _frame(sock: socket.socket, kind: int, token: int, body: bytes) -> None:
    head = _HEADER.pack(kind, token, len(body))
    if len(body) < _SMALL:
        sock.sendall(head + body)
    else:
        sock.sendall(head)
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


def recv(sock: socket.socket):
    """The next record, blocking; None at EOF. Raises ConnectionError on a frame no
    version of this module sends (the stream cannot be trusted any more)."""
    head = recv_exactly(sock, _HEADER.size)
    if head is None:
        return None
    kind, token, size = _HEADER.unpack(head)
    if kind == PAYLOAD:
        return _recv_payload(sock, size)
    if kind == RANK_MESSAGE:
        return _recv_rank_message(sock, token, size)
    body = recv_exactly(sock, size) if size else b""
    if body is None:
        return None
    if kind == RECORD:
        try:
            return pickle.loads(body)
        except Exception as exc:  # noqa: BLE001 - a record this side cannot read
            raise ConnectionError(f"a record on the agent link that this side cannot "
                                  f"read ({type(exc).__name__}: {exc}); is every node "
                                  f"running the same mplaunch?") from None
    if kind == OUT or kind == ERR:
        return Output(token, "out" if kind == OUT else "err", body)
    if kind == STACK:
        return StackBytes(token, body)
    raise ConnectionError(f"a frame of unknown kind {kind} on the agent link")


def payload_key(fd: int):
    """What names a payload's file while someone holds it open: (device, inode)."""
    st = os.fstat(fd)
    return st.st_dev, st.st_ino


def _sendfile(sock: socket.socket, fd: int, size: int) -> None:
    """`size` bytes of the file in `fd`, from its start, streamed from the kernel (no copy
    of a large file in this process)."""
    done = 0
    while done < size:
        sent = os.sendfile(sock.fileno(), fd, done, size - done)
        if sent == 0:
            raise ConnectionError("a file ended before its size while being sent")
        done += sent


def _send_payload(sock: socket.socket, payload: Payload) -> None:
    """A PAYLOAD frame: the key, then the file."""
    size = os.fstat(payload.fd).st_size
    sock.sendall(_HEADER.pack(PAYLOAD, 0, _KEY.size + size) + _KEY.pack(*payload.key))
    _sendfile(sock, payload.fd, size)


def _send_rank_message(sock: socket.socket, msg: RankMessage) -> None:
    """A RANK_MESSAGE frame: how many files and the data's size, each file's size, the
    data, then the files (which stay open: the caller closes them)."""
    sizes = [os.fstat(fd).st_size for fd in msg.fds]
    prefix = (_MESSAGE.pack(len(sizes), len(msg.data))
              + struct.pack(f"!{len(sizes)}Q", *sizes))
    total = len(prefix) + len(msg.data) + sum(sizes)
    head = _HEADER.pack(RANK_MESSAGE, msg.token, total) + prefix
    if len(msg.data) < _SMALL:
        sock.sendall(head + msg.data)
    else:
        sock.sendall(head)
        sock.sendall(msg.data)
    for fd, size in zip(msg.fds, sizes):
        _sendfile(sock, fd, size)


def _recv_rank_message(sock: socket.socket, token: int, size: int):
    """The RankMessage of a RANK_MESSAGE frame, its files streamed into memfds of this
    process; None at EOF."""
    head = recv_exactly(sock, _MESSAGE.size)
    if head is None:
        return None
    nfiles, ndata = _MESSAGE.unpack(head)
    sizes = recv_exactly(sock, 8 * nfiles) if nfiles else b""
    if sizes is None:
        return None
    sizes = struct.unpack(f"!{nfiles}Q", sizes)
    if _MESSAGE.size + 8 * nfiles + ndata + sum(sizes) != size:
        raise ConnectionError("a rank's message whose parts do not add up to its frame")
    data = recv_exactly(sock, ndata) if ndata else b""
    if data is None:
        return None
    fds: List[int] = []
    try:
        for n in sizes:
            fd = _recv_file(sock, n, "mplaunch-remote", os.MFD_CLOEXEC)
            if fd is None:
                break
            os.lseek(fd, 0, os.SEEK_SET)
            fds.append(fd)
        else:
            return RankMessage(token, data, tuple(fds))
    except BaseException:
        _close(fds)
        raise
    _close(fds)
    return None


def _recv_payload(sock: socket.socket, size: int):
    """The Payload of a PAYLOAD frame, its file sealed as the launching process's was;
    None at EOF."""
    head = recv_exactly(sock, _KEY.size)
    if head is None:
        return None
    fd = _recv_file(sock, size - _KEY.size, "mplaunch-payload",
                    os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    if fd is None:
        return None
    try:
        buffers.seal(fd)
    except BaseException:
        os.close(fd)
        raise
    return Payload(_KEY.unpack(head), fd)


def _recv_file(sock: socket.socket, size: int, name: str, flags: int) -> Optional[int]:
    """A memfd holding the next `size` bytes of the stream, written in chunks (a large
    file is never whole in this process's memory); None at EOF."""
    fd = os.memfd_create(name, flags)
    try:
        left = size
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
    except BaseException:
        os.close(fd)
        raise
    return fd


def _close(fds) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def deliver_fds(sock: socket.socket, data: bytes, fds) -> None:
    """A channel message that came as a frame, written whole to a rank's channel socket
    (which its reader keeps non-blocking), with fds this process has (and keeps). Raises
    OSError when the channel is gone."""
    sock.setblocking(True)
    try:
        send_framed(sock, data, fds)
    finally:
        sock.setblocking(False)
