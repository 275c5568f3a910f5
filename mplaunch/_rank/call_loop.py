"""A rank that stays up (a World's): it runs each call the launching process sends on
its result socket, answering each with one message, until that socket closes.

A call is a framed message whose single fd is a memfd holding the pickled function and
arguments, as for a launch; the answer is the usual result or exception message. Where
the calling process reloaded modules since the last call, a frame without an fd comes
just before it: the call's tag and the pickled changes, which the rank follows
(_rank.reloads) before it loads the payload. Rejected: the changes inside the payload,
whose format (_wire.payload) every launch shares; a frame of their own costs a run that
changed nothing nothing.

SIGINT (sent by a healing World to ranks that have not answered) raises KeyboardInterrupt
in the call's code, as Ctrl-C does in a notebook, and never in our own plumbing: a rank
interrupted while it reads a call or sends an answer would lose it, or die. So the
interrupt is taken only inside a call's window (accept_interrupts: from the moment the
call's code may run until it has returned or raised), and never in a frame of a module
marked PLUMBING; anywhere else it is dropped, and the World sends it again (every 0.1 s)
until the rank answers. A call that it ended is answered with one line on stderr, not a
traceback (_rank.heal).
"""
from __future__ import annotations

import os
import pickle
import signal
import socket
import time
from typing import Any, Callable, Dict, Optional, Tuple

from .._wire.channel import recv_framed
from .._wire.messages import CALL_TAG

_state: Dict[str, Any] = {}


def rank_state() -> Dict[str, Any]:
    """A dict that lives as long as this process: in a :class:`mplaunch.World`'s rank,
    state kept from one ``run`` to the next (module globals persist too). In any other
    process it is just a dict of that process."""
    return _state


def serve(sock: socket.socket, payload_fd: int, call: Callable[[int, tuple], int]) -> int:
    """Run calls, ``call(payload fd, reloads)``, until the parent closes the socket; the
    exit code (0). `payload_fd` is the first call's; each call's payload stays open until
    the next one's has replaced it (the rank's children read its `__main__` there)."""
    while True:
        got = _next_call(sock)
        if got is None:
            return 0
        call(*got)
        os.close(payload_fd)
        payload_fd = got[0]


def _next_call(sock: socket.socket) -> Optional[Tuple[int, tuple]]:
    """Block for the next call: its payload fd and the (name, how) module changes that
    came ahead of it (mostly none); None once the parent has closed its end."""
    reloads: tuple = ()
    data, fds = recv_framed(sock)
    while data is not None and not fds and len(data) > 1 and data[:1] == CALL_TAG:
        reloads += pickle.loads(data[1:])
        data, fds = recv_framed(sock)
    if data is None or not fds:
        for fd in fds:
            os.close(fd)
        return None
    for fd in fds[1:]:
        os.close(fd)
    return fds[0], reloads


# This module is plumbing: see PLUMBING.
__mplaunch_plumbing__ = True
PLUMBING = "__mplaunch_plumbing__"
"""The global that marks a module as mplaunch's own plumbing (this one, worker, streams,
_wire.channel, linux, messages): an interrupt that lands in one of its frames is dropped.
Each module says so itself, so moving or renaming one keeps the guard true."""


_interrupts = 0      # KeyboardInterrupts _on_sigint raised, in the rank's life
_accepting = False   # inside a call's window (accept_interrupts)
_raised_at = 0.0     # when _on_sigint last raised (monotonic)
# After raising, the interrupt is dropped this long: the KeyboardInterrupt is on its way
# to the call's handler, and a second one that lands between the handler's first line
# and its closing of the window would kill the rank. Shorter than the World's resend
# (0.1 s), so code that catches KeyboardInterrupt and goes on is interrupted again.
_SETTLING = 0.05


def arm() -> None:
    """Take SIGINT as a World's rank does (before its first call): only inside a
    call's window."""
    signal.signal(signal.SIGINT, _on_sigint)


def interrupts() -> int:
    """How many times the World's interrupt has raised KeyboardInterrupt in this rank:
    compared before and after a call, it says whether the call's was one."""
    return _interrupts


def accept_interrupts(accepted: bool) -> None:
    """Open (True) or close a call's window. Outside it the World's interrupt is dropped
    wherever it lands: the rank is reading its next call, setting it up, or answering
    (pickling its result, formatting its exception, in the standard library's frames
    too, which are not ours); the World stops sending it once the answer is in."""
    global _accepting
    _accepting = accepted


UNINTERRUPTED = "__mplaunch_uninterrupted__"


def uninterrupted(func):
    """Mark `func` as one of mplaunch's own calls of a heal (the group's set-up, its
    state, its rebuild): the call's window stays closed while it runs. Not every
    function of mplaunch is: the plugin's test runner, a %%ranks cell or a reload runs
    the user's code, which Ctrl-C must reach."""
    setattr(func, UNINTERRUPTED, True)
    return func


def own_call(func) -> bool:
    """`func` was marked uninterrupted."""
    return getattr(func, UNINTERRUPTED, False) is True


def _on_sigint(signo, frame) -> None:
    # In our frames the interrupt is dropped; the World sends it again until the rank
    # answers, so one that lands in user code a moment later still interrupts it.
    global _interrupts, _raised_at
    if not _accepting or (frame is not None and frame.f_globals.get(PLUMBING)):
        return
    now = time.monotonic()
    if now - _raised_at < _SETTLING:
        return
    _interrupts += 1
    _raised_at = now
    raise KeyboardInterrupt
