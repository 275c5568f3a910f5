"""Message framing on the two kinds of socket mplaunch uses.

Control channels (parent <-> server) are SOCK_SEQPACKET: one pickled tuple per datagram,
fds attached. Result channels (rank -> parent) are SOCK_STREAM, because a return value
can be far larger than a datagram: each message is a 16-byte header (payload length,
number of fds, fds attached to the header) followed by the payload, decoded
incrementally by the parent without ever blocking.
"""
from __future__ import annotations

import array
import os
import pickle
import socket
import struct

from .linux import close_quiet

# mplaunch's own plumbing: an interrupt is never raised in its frames (_rank.call_loop)
__mplaunch_plumbing__ = True

_HEADER = struct.Struct("!QQ")

# The fds a rank is started with, in the order they travel with a start request. The
# last, stdin, is sent only to the rank that reads the launching process's terminal; the
# others open /dev/null themselves.
RANK_FDS = ("payload", "result", "stdout", "stderr", "stack", "stdin")
_MAX_FDS = 250  # below SCM_MAX_FD


def send_obj(sock: socket.socket, obj, fds=()) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    if fds:
        socket.send_fds(sock, [data], list(fds))
    else:
        sock.send(data)


def recv_obj(sock: socket.socket, maxfds: int = 16):
    """(obj, fds), or (None, []) at EOF."""
    data, fds, _flags, _addr = socket.recv_fds(sock, 1 << 22, maxfds)
    if not data:
        for fd in fds:
            os.close(fd)
        return None, []
    return pickle.loads(data), list(fds)


def send_framed(sock: socket.socket, data: bytes, fds=()) -> None:
    header = _HEADER.pack(len(data), len(fds))
    if fds:
        socket.send_fds(sock, [header], list(fds))
    else:
        sock.sendall(header)
    sock.sendall(data)


def recv_framed(sock: socket.socket):
    """Block for one framed message on a blocking stream socket: (data, fds), or
    (None, []) at EOF."""
    header, fds = _recv_exactly(sock, _HEADER.size)
    if header is None:
        return None, []
    size, _nfds = _HEADER.unpack(header)
    data, more = _recv_exactly(sock, size) if size else (b"", [])
    if data is None:
        fds, more = fds + more, []
        for fd in fds:
            os.close(fd)
        return None, []
    return data, fds + more


def _recv_exactly(sock: socket.socket, n: int):
    buf = bytearray()
    fds: list = []
    fdsize = array.array("i").itemsize
    while len(buf) < n:
        data, anc, _flags, _addr = sock.recvmsg(n - len(buf),
                                                socket.CMSG_SPACE(_MAX_FDS * fdsize))
        fds.extend(_fds_in(anc))
        if not data:
            for fd in fds:
                os.close(fd)
            return None, []
        buf += data
    return bytes(buf), fds


def _fds_in(ancillary) -> list:
    fdsize = array.array("i").itemsize
    fds = array.array("i")
    for level, kind, cdata in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(cdata[:len(cdata) - (len(cdata) % fdsize)])
    return list(fds)


class FramedReader:
    """Non-blocking reader of framed messages from one stream socket."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        sock.setblocking(False)
        self._buf = bytearray()
        self._fds: list = []
        self.eof = False

    def fileno(self) -> int:
        return self.sock.fileno()

    def read_available(self) -> list:
        """Read what is there now; return the complete messages as (data, fds)."""
        fdsize = array.array("i").itemsize
        while not self.eof:
            try:
                data, anc, _flags, _addr = self.sock.recvmsg(
                    1 << 20, socket.CMSG_SPACE(_MAX_FDS * fdsize))
            except (BlockingIOError, InterruptedError):
                break
            except ConnectionResetError:
                data, anc = b"", []
            self._fds.extend(_fds_in(anc))
            if not data:
                self.eof = True
                break
            self._buf += data
        return self._parse()

    def _parse(self) -> list:
        out = []
        while len(self._buf) >= _HEADER.size:
            size, nfds = _HEADER.unpack_from(self._buf)
            if len(self._buf) < _HEADER.size + size:
                break
            data = bytes(self._buf[_HEADER.size:_HEADER.size + size])
            del self._buf[:_HEADER.size + size]
            fds, self._fds = self._fds[:nfds], self._fds[nfds:]
            out.append((data, fds))
        return out

    @property
    def partial(self) -> bool:
        """True if an incomplete message is buffered."""
        return bool(self._buf)

    def close(self) -> None:
        close_quiet(*self._fds)
        self._fds = []
        self.sock.close()
