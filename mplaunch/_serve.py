"""A rank that stays up (a World's): it runs each call the launching process sends on
its result socket, answering each with one message, until that socket closes.

A call is a framed message whose single fd is a memfd holding the pickled function and
arguments, as for a launch; the answer is the usual result or exception message.
"""
from __future__ import annotations

import os
import socket
from typing import Any, Callable, Dict, Optional

from . import _sys
from ._channel import recv_framed

_state: Dict[str, Any] = {}


def rank_state() -> Dict[str, Any]:
    """A dict that lives as long as this process: in a :class:`mplaunch.World`'s rank,
    state kept from one ``run`` to the next (module globals persist too). In any other
    process it is just a dict of that process."""
    return _state


def serve(sock: socket.socket, call: Callable[[bytes], int]) -> int:
    """Run calls until the parent closes the socket; the exit code (0)."""
    while True:
        payload = _next_call(sock)
        if payload is None:
            return 0
        call(payload)


def _next_call(sock: socket.socket) -> Optional[bytes]:
    """Block for the next call's payload; None once the parent has closed its end."""
    data, fds = recv_framed(sock)
    try:
        return _sys.read_all_fd(fds[0]) if data is not None and fds else None
    finally:
        for fd in fds:
            os.close(fd)
