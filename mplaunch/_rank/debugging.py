"""pdb and input() in any rank, through the launching process (_engine.debugging).

A rank has no terminal of its own: in a notebook none at all, in a script one rank at
most. So every line a rank asks for (``input()``, and pdb's prompt, which is ``input()``
too when pdb is given no stdin) goes up its result socket as a :class:`DebugAsk`, and
the launching process answers it with a line from wherever its user is: the kernel's
input box, its terminal, pytest's suspended capture. It answers one rank at a time: a
rank in pdb holds the turn from its first prompt until it continues, quits or its call
ends; another rank that asks meanwhile waits for its answer, and is named.

What pdb prints goes to the rank's stdout, relayed with its prefix as any output; the
prompt (``[rank1]: (Pdb) ``) is the line's request. Rejected: a pdb over a socket of
its own per rank (remote-pdb, Monarch's): a second terminal, and no turn-taking.

- ``breakpoint()`` first asks whether anybody can answer (``open``): where nobody can
  (a script whose stdin is not a terminal, pytest without ``--pdb``), it is skipped
  with a note, as before, instead of failing the rank on pdb's EOF.
- ``pdb.set_trace()`` and ``pdb.post_mortem()`` work as they are: pdb's own class asks
  through ``input()``. The session's end is learnt by wrapping that instance's
  ``set_continue`` and ``set_quit``; pdb is taught to skip mplaunch's frames.
- The launching process's interrupt (Ctrl-C, the kernel's stop button) answers a
  waiting pdb in a World's rank with ``c``, and the World's interrupt, sent after it,
  ends the call in the user's code as it would have without a debugger; a launch's
  rank ends there (the launch is being torn down); a waiting ``input()`` raises
  KeyboardInterrupt.

This module is plumbing: the World's interrupt is never raised in its frames while it
waits for a line (the line, or ``c``, comes instead).
"""
from __future__ import annotations

import builtins
import os
import pickle
import sys
from typing import Optional

from . import streams
from .call_loop import own_call
from .frames import is_ours
from .._wire.channel import recv_framed, send_framed
from .._wire.messages import DEBUG_TAG, MESSAGE_TAG, DebugAsk

# mplaunch's own plumbing: an interrupt is never raised in its frames (_rank.call_loop)
__mplaunch_plumbing__ = True

_sock = None
_pid = None           # the rank's own process: its forked children (a DataLoader's
                      # workers) share _sock, and may not ask over it (_own)
_rank = "?"
_told_child = False   # a child of the rank said its breakpoint() is skipped
_serve = False        # a World's rank (install)
_holder = None        # the pdb instance holding the turn, while one does
_kept: Optional[BaseException] = None   # a World's rank: its last call's error
_SKIP = ("mplaunch.*",)   # pdb does not stop in mplaunch's frames
_builtin_input = builtins.input
_WHERE = ("(this process's stdin is not a terminal, or stdin_rank=None, or the "
          "notebook's frontend takes no input, or pytest ran without --pdb)")


def install(sock, rank, serve: bool) -> None:
    """Ask the launching process for lines from now on (`sock`: the result socket;
    `serve`: a World's rank, whose call an interrupt ends, not its process)."""
    global _sock, _rank, _serve, _pid
    _sock, _rank, _serve, _pid = sock, rank, serve, os.getpid()
    builtins.input = _input
    if not os.environ.get("PYTHONBREAKPOINT"):
        sys.breakpointhook = _breakpoint


def rank():
    """This rank's number, as the launching process knows it."""
    return _rank


def renumbered(rank: int) -> None:
    """The World went on without a lost node and renumbered this rank (_rank.heal)."""
    global _rank
    _rank = rank


def call_begins(func) -> None:
    """A call of `func` starts: the last call's error, kept for ``World.debug``, is
    forgotten, unless `func` is mplaunch's own (a heal's, or World.debug's)."""
    global _kept
    if not (own_call(func) or is_post_mortem(func)):
        _kept = None


def on_error(exc: BaseException) -> bool:
    """The call raised `exc`. A World's rank keeps it for ``World.debug()``; where the
    launching process wants post-mortems (``MPLAUNCH_POST_MORTEM=1``, pytest --pdb),
    pdb opens at the frame that raised, before the error is sent (the other ranks wait,
    as at a breakpoint). Whether its traceback is worth showing on stderr: not pdb's
    ``q`` (one line says it)."""
    global _kept
    if type(exc).__name__ == "BdbQuit" and type(exc).__module__ == "bdb":
        sys.stderr.write(f"mplaunch: rank {_rank} quit the debugger (q): its call "
                         "ends with bdb.BdbQuit\n")
        return False
    if not isinstance(exc, Exception) or getattr(exc, "kind", None) in ("skip", "xfail"):
        return True
    if _serve:
        _kept = exc
    if _sock is not None and _holder is None:
        post_mortem(exc, ask="post-mortem")
    return True


def is_post_mortem(func) -> bool:
    return getattr(func, "__mplaunch_post_mortem__", False) is True


def world_post_mortem(rank: int) -> Optional[bool]:
    """World.debug's call: pdb at the kept error's frame in `rank` (post_mortem's
    answer); the others return at once."""
    if int(os.environ.get("RANK", "-1")) != rank:
        return None
    return post_mortem()


world_post_mortem.__mplaunch_post_mortem__ = True


def call_ends() -> None:
    """The call returned or raised: a pdb still stepping through it (``n`` past its
    last line) gives the turn back, and stops tracing mplaunch's frames."""
    global _holder
    if _holder is not None:
        _holder = None
        sys.settrace(None)
        _tell("end")


# -- what a rank's code calls ----------------------------------------------------------

def _breakpoint(*args, **kwargs):
    """sys.breakpointhook: pdb at the caller, if the launching process can answer."""
    global _told_child
    frame = sys._getframe(1)
    where = f"{frame.f_code.co_filename}:{frame.f_lineno}"
    if not _own():
        if _told_child:
            return None
        _told_child = True   # once per child process: a worker calls it per item
        sys.stderr.write(
            f"mplaunch: breakpoint() at {where} skipped in process {os.getpid()}, a "
            f"child of rank {_rank} (a DataLoader worker?): only the rank's own process "
            "asks the launching process for lines; debug the code there (a "
            "DataLoader with num_workers=0)\n")
        return None
    answer = _ask("open", "", where)
    if answer == "n":
        sys.stderr.write(
            f"mplaunch: breakpoint() skipped in rank {_rank}: nobody can answer its "
            f"prompt here {_WHERE}\n")
    if answer != "y":
        return None   # "n", or "I": the launching process was interrupted meanwhile
    import pdb
    pdb.Pdb(skip=list(_SKIP), nosigint=True).set_trace(frame)
    return None


def post_mortem(exc: Optional[BaseException] = None,
                ask: str = "open") -> Optional[bool]:
    """pdb at the frame that raised `exc` (default: the kept error of the last call):
    True once it ended, None where there is no error, False where nobody can answer."""
    exc = _kept if exc is None else exc
    if exc is None or exc.__traceback__ is None:
        return None
    tb = exc.__traceback__
    while tb.tb_next is not None:
        tb = tb.tb_next
    where = f"{tb.tb_frame.f_code.co_filename}:{tb.tb_lineno}"
    if _ask(ask, "", where) != "y":
        return False
    import pdb
    p = pdb.Pdb(skip=list(_SKIP), nosigint=True)
    p.reset()
    sys.stdout.write(f"mplaunch: rank {_rank} post-mortem: "
                     f"{type(exc).__name__}: {exc}\n")
    try:
        p.interaction(None, _users_part(exc.__traceback__))
    finally:
        if _holder is p:
            call_ends()
    return True


def _users_part(tb):
    """`tb` from the user's first frame (pdb's ``up`` stops there), as the report cuts
    it (_rank.worker); the exception's own traceback is left as it is."""
    start = tb
    while start is not None and is_ours(start):
        start = start.tb_next
    return start if start is not None else tb


def _input(prompt: object = "") -> str:
    """builtins.input in a rank: a line from the launching process's user."""
    if _sock is None or not _own():
        return _builtin_input(prompt)   # a child of the rank: its own stdin, as before
    debugger = _calling_debugger()
    if debugger is not None:
        _hold(debugger)
    text = str(prompt)
    answer = _ask("line", text, "", hold=debugger is not None)
    kind, line = answer[:1], answer[1:]
    if kind == "L":
        return line
    if kind == "E":
        raise EOFError
    if debugger is not None:
        _release(debugger)
        if kind == "I" and not _serve:
            # A launch being torn down (Ctrl-C): its one signal may land inside pdb,
            # which takes a KeyboardInterrupt as "cancel the command" and prompts
            # again; so the rank ends here, as the interrupt would have ended it.
            sys.settrace(None)
            raise SystemExit(128 + 2)
        # Nobody to answer ("N"), or the World was interrupted ("I"): go on; the World's
        # interrupt, sent until the call answers, ends it in the user's code.
        return "c"
    if kind == "I":
        raise KeyboardInterrupt
    raise EOFError(f"mplaunch: nobody can answer input() in this rank here {_WHERE}")


# -- the turn ------------------------------------------------------------------------

def _calling_debugger():
    """The bdb.Bdb instance whose prompt called input(), if one did."""
    bdb = sys.modules.get("bdb")
    if bdb is None:
        return None
    frame = sys._getframe(2)
    for _ in range(6):
        if frame is None:
            return None
        obj = frame.f_locals.get("self")
        if isinstance(obj, bdb.Bdb):
            return obj
        frame = frame.f_back
    return None


def _hold(debugger) -> None:
    """`debugger` holds the turn until it continues or quits (or the call ends)."""
    global _holder
    if _holder is debugger:
        return
    _holder = debugger
    if getattr(debugger, "_mplaunch_wrapped", False):
        return
    debugger._mplaunch_wrapped = True
    # The World's interrupt is mplaunch's (_rank.call_loop), not pdb's "Program
    # interrupted" after a continue.
    debugger.nosigint = True
    if not debugger.skip:
        debugger.skip = set(_SKIP)
    for name in ("set_continue", "set_quit"):
        original = getattr(debugger, name)

        def wrapped(*args, _original=original, **kwargs):
            try:
                return _original(*args, **kwargs)
            finally:
                _release(debugger)
        setattr(debugger, name, wrapped)


def _release(debugger) -> None:
    global _holder
    if _holder is debugger:
        _holder = None
        _tell("end")


# -- the wire --------------------------------------------------------------------------

def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:  # noqa: BLE001 - a closed stream: nothing to order
            pass
    streams.wait_relayed()   # what pdb printed is shown before its prompt


def _own() -> bool:
    """Whether this is the rank's own process, not a child forked from it, whose asks
    and answers would cross the rank's on the one socket they share."""
    return os.getpid() == _pid


def _tell(kind: str, text: str = "", where: str = "", hold: bool = False) -> None:
    _flush()
    msg = DebugAsk(kind, text, where, hold)
    try:
        send_framed(_sock, MESSAGE_TAG + pickle.dumps(msg, pickle.HIGHEST_PROTOCOL))
    except OSError:
        pass   # the launching process is gone: the death signal ends this rank


def _ask(kind: str, text: str, where: str, hold: bool = False) -> str:
    """Send an ask and block for its answer: "y"/"n" to ``open``; "L" and the line,
    "E" (end of input), "N" (nobody to answer) or "I" (interrupted) to ``line``."""
    _tell(kind, text, where, hold)
    while True:
        data, fds = recv_framed(_sock)
        for fd in fds:
            os.close(fd)
        if data is None:
            return "N" if kind == "line" else "n"
        if data[:1] == DEBUG_TAG:
            return data[1:].decode("utf-8", "replace")
