"""A rank that stays up (a World's): it runs each call the launching process sends on
its result socket, answering each with one message, until that socket closes.

A call is a framed message whose single fd is a memfd holding the pickled function and
arguments, as for a launch; the answer is the usual result or exception message.

SIGINT (sent by a healing World to ranks that have not answered) raises KeyboardInterrupt
in the call's code, as Ctrl-C does in a notebook, and never in our own plumbing: a rank
interrupted while it reads a call or sends an answer would lose it, or die. A call that
it ended is answered with one line on stderr, not a traceback (_rank.heal).
"""
from __future__ import annotations

import os
import signal
import socket
from typing import Any, Callable, Dict, Optional

from .._wire.channel import recv_framed

_state: Dict[str, Any] = {}


def rank_state() -> Dict[str, Any]:
    """A dict that lives as long as this process: in a :class:`mplaunch.World`'s rank,
    state kept from one ``run`` to the next (module globals persist too). In any other
    process it is just a dict of that process."""
    return _state


def serve(sock: socket.socket, payload_fd: int, call: Callable[[int], int]) -> int:
    """Run calls until the parent closes the socket; the exit code (0). `payload_fd` is
    the first call's; each call's payload stays open until the next one's has replaced
    it (the rank's children read its `__main__` definitions there)."""
    signal.signal(signal.SIGINT, _on_sigint)
    while True:
        fd = _next_call(sock)
        if fd is None:
            return 0
        call(fd)
        os.close(payload_fd)
        payload_fd = fd


def _next_call(sock: socket.socket) -> Optional[int]:
    """Block for the next call's payload fd; None once the parent has closed its end."""
    data, fds = recv_framed(sock)
    if data is None or not fds:
        for fd in fds:
            os.close(fd)
        return None
    for fd in fds[1:]:
        os.close(fd)
    return fds[0]


# This module is plumbing: see PLUMBING.
__mplaunch_plumbing__ = True
PLUMBING = "__mplaunch_plumbing__"
"""The global that marks a module as mplaunch's own plumbing (this one, worker, streams,
_wire.channel, linux, messages): an interrupt that lands in one of its frames is dropped.
Each module says so itself, so moving or renaming one keeps the guard true."""


_interrupts = 0      # KeyboardInterrupts _on_sigint raised, in the rank's life
_answering = False   # the rank is sending its answer (hold_interrupts)


def interrupts() -> int:
    """How many times the World's interrupt has raised KeyboardInterrupt in this rank:
    compared before and after a call, it says whether the call's was one."""
    return _interrupts


def hold_interrupts(held: bool) -> None:
    """While held, the World's interrupt is dropped wherever it lands: the rank is
    answering (its call's exception is being formatted and sent, in the standard
    library's frames too, which are not ours), and the World stops sending it once the
    answer is in."""
    global _answering
    _answering = held


def _on_sigint(signo, frame) -> None:
    # In our frames the interrupt is dropped; the World sends it again until the rank
    # answers, so one that lands in user code a moment later still interrupts it.
    global _interrupts
    if _answering or (frame is not None and frame.f_globals.get(PLUMBING)):
        return
    _interrupts += 1
    raise KeyboardInterrupt
