"""The per-World secret that every connection between a launching process and its
node agents proves it holds (a World across nodes: _engine.nodes.hub, _agent.agent).

A challenge-response in both directions, before either side reads anything else: each
side sends a random nonce, and answers the other's with an HMAC-SHA256 of both nonces
and its role under the secret. The secret itself never crosses the network. What comes
before the proof is read as fixed-size bytes, never unpickled; a peer that fails it is
dropped (and logged by the caller). The secret travels to the agents only in their
step's environment (never on a command line, which ``ps`` shows, nor in the store,
which anyone reaching its port reads).
"""
from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import socket

from .tunnel import keepalive, recv_exactly

SECRET_ENV = "MPLAUNCH_WORLD_SECRET"
_NONCE = 32
_MAC = hashlib.sha256().digest_size
_MAGIC = b"mplaunch-world-1"   # the protocol and its version, sent first


class AuthError(ConnectionError):
    """The peer did not prove it holds the World's secret."""


def new_secret() -> str:
    return secrets.token_hex(32)


def _mac(secret: str, role: bytes, mine: bytes, theirs: bytes) -> bytes:
    return hmac.new(secret.encode(), role + mine + theirs, hashlib.sha256).digest()


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    data = recv_exactly(sock, n)
    if data is None:
        raise AuthError(f"the peer closed the connection before the {n} bytes of its "
                        f"proof")
    return data


def prove(sock: socket.socket, secret: str, server: bool, timeout: float = 10.0) -> None:
    """Both sides call this right after connecting (the listening side with
    ``server=True``); returns once each has proved to the other that it holds `secret`,
    else raises AuthError (or OSError). Bounded in time and in what it reads."""
    old = sock.gettimeout()
    sock.settimeout(timeout)
    try:
        mine = os.urandom(_NONCE)
        sock.sendall(_MAGIC + mine)
        head = _recv_exactly(sock, len(_MAGIC) + _NONCE)
        if not hmac.compare_digest(head[:len(_MAGIC)], _MAGIC):
            raise AuthError("the peer does not speak mplaunch's World protocol")
        theirs = head[len(_MAGIC):]
        if theirs == mine:
            raise AuthError("the peer sent back our own challenge")
        me, peer = (b"server", b"client") if server else (b"client", b"server")
        sock.sendall(_mac(secret, me, theirs, mine))
        answer = _recv_exactly(sock, _MAC)
        if not hmac.compare_digest(answer, _mac(secret, peer, mine, theirs)):
            raise AuthError("the peer does not hold this World's secret")
    except socket.timeout:
        raise AuthError(f"the peer did not prove itself within {timeout:g} s") from None
    finally:
        sock.settimeout(old)


def connect(addr: str, secret: str, timeout: float = 30.0) -> socket.socket:
    """An agent's connection to the World at `addr` ("host:port", "[v6]:port"), the
    secret proved both ways; kept alive by TCP."""
    host, _, port = addr.rpartition(":")
    sock = socket.create_connection((host.strip("[]"), int(port)), timeout=timeout)
    try:
        prove(sock, secret, server=False, timeout=timeout)
    except BaseException:
        sock.close()
        raise
    sock.settimeout(None)
    keepalive(sock)
    return sock
