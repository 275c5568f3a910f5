"""The rank's standard streams: fds 0, 1 and 2, and the Python objects over them.

- stdout and stderr are pipes to the launching process. With PYTHONUNBUFFERED (which
  mplaunch sets in every rank) they are unbuffered, as under ``python -u``: whatever the
  rank wrote is in the pipe before its next statement runs, so a rank that dies by
  ``os._exit``, a signal or a segfault loses nothing, not even half a line.
- stdin is the launching process's terminal for the rank chosen to read it, /dev/null
  for every other rank. ``breakpoint()`` and ``input()`` in any rank do not read it:
  they ask the launching process for each line (_rank.debugging).
- When the launching process's stream is a terminal, the rank's Python stream says so
  (``isatty()``), so libraries that colour or draw progress bars only on a terminal do
  so in the rank as they would under torchrun.
"""
from __future__ import annotations

import array
import builtins
import fcntl
import io
import os
import stat
import sys
import termios
import time

from .._wire import linux

# mplaunch's own plumbing: an interrupt is never raised in its frames (_rank.call_loop)
__mplaunch_plumbing__ = True


class _StderrPipe(io.FileIO):
    """The rank's stderr. stdout and stderr are pipes of their own to the launching
    process, which reads the two as they become ready, so text written to one after
    the other could be relayed first: tqdm's last frames on stderr came after the line
    printed next on stdout, leaving a bar frozen at 90% above it. So a write that
    follows a write to the other stream first lets the launching process read what
    that one holds (waiting at most _HANDOFF): a rank's streams are relayed in the
    order it wrote them. The stdout side of it is print() (_print), not a hook on
    every stdout write: a Python method under TextIOWrapper costs about a microsecond
    a write, and print is how ranks write to stdout. Writes that go to the fds some
    other way (sys.stdout.write, C code, a subprocess) are not ordered."""

    def write(self, b):
        if _last[0] == 1 and _ordered:
            _wait_read(1)
        _last[0] = 2
        return super().write(b)


_last: list = [None]      # 1 or 2: the stream print() or stderr wrote to last
_ordered: list = []       # non-empty where both streams are pipes
_HANDOFF = 0.25


def _wait_read(fd: int) -> None:
    """Until the launching process has read everything pipe `fd` holds, or _HANDOFF."""
    count = array.array("i", [0])
    deadline = None
    while True:
        try:
            fcntl.ioctl(fd, termios.FIONREAD, count, True)
        except OSError:
            return
        if count[0] == 0:
            return
        now = time.monotonic()
        if deadline is None:
            deadline = now + _HANDOFF
        elif now >= deadline:
            return
        time.sleep(0)   # the launching process needs the CPU to read it


def wait_relayed() -> None:
    """Until the launching process has read what stdout and stderr hold (or _HANDOFF
    each): what the rank printed reaches its user before a prompt it sends another way."""
    if _ordered:
        _wait_read(1)
        _wait_read(2)


class _TerminalPipe(io.FileIO):
    """A pipe whose far end (the launching process's relay) writes to a terminal.

    Only the Python object says so: ``os.isatty(1)`` and subprocesses still see the
    pipe. That is what libraries ask (``stream.isatty()``: logging colour handlers,
    tqdm's ``disable=None``, rich, click), and a pipe keeps the relay's prefixes and
    whole lines, which a pseudo-terminal per rank would not."""

    def isatty(self) -> bool:
        return True


def take_over(fds: dict, terminal: dict, unbuffered: bool) -> None:
    """Point fds 0, 1 and 2 at what the parent sent, and make sys.stdin, sys.stdout
    and sys.stderr fresh objects over them.

    `terminal` says which of stdout and stderr end on a terminal in the parent;
    `unbuffered` is the rank's PYTHONUNBUFFERED.
    """
    stdin = fds.get("stdin")
    if stdin is None:
        stdin = os.open(os.devnull, os.O_RDONLY)
    if stdin != 0:
        os.dup2(stdin, 0)
        os.close(stdin)
    os.dup2(fds["stdout"], 1)
    os.dup2(fds["stderr"], 2)
    for key in ("stdout", "stderr"):
        if fds[key] > 2:
            os.close(fds[key])
    # Fresh Python streams over the new fds; anything buffered in the inherited objects
    # belongs to another process and is dropped, not flushed.
    sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))
    _ordered[:] = [True] if all(stat.S_ISFIFO(os.fstat(fd).st_mode) for fd in (1, 2)) \
        else []
    _last[0] = None
    sys.stdout = _writer(1, terminal.get("stdout", False), unbuffered)
    sys.stderr = _writer(2, terminal.get("stderr", False), unbuffered)
    sys.__stdout__, sys.__stderr__, sys.__stdin__ = sys.stdout, sys.stderr, sys.stdin
    if unbuffered:
        _unbuffer_c_stdio()
        _own[:] = [sys.stdout, sys.stderr]
        builtins.print = _print


class _StderrTerminalPipe(_StderrPipe):
    """stderr, ordered as _StderrPipe, ending on a terminal as _TerminalPipe."""

    def isatty(self) -> bool:
        return True


def _writer(fd: int, tty: bool, unbuffered: bool) -> io.TextIOWrapper:
    if fd == 2:
        raw = (_StderrTerminalPipe if tty else _StderrPipe)(fd, "w", closefd=False)
    else:
        raw = (_TerminalPipe if tty else io.FileIO)(fd, "w", closefd=False)
    if unbuffered:
        return io.TextIOWrapper(raw, write_through=True, errors="backslashreplace")
    return io.TextIOWrapper(raw, line_buffering=True, errors="backslashreplace")


def _unbuffer_c_stdio() -> None:
    # As `python -u` does: printf from an extension (or std::cout, which goes through
    # C stdio) reaches the pipe before a crash in the same extension, not only at exit.
    # A forked rank inherits the server's C stdio, set up before PYTHONUNBUFFERED applied.
    try:
        import ctypes
        libc = linux._c()
        for name in ("stdout", "stderr"):
            stream = ctypes.c_void_p.in_dll(libc, name)
            libc.setvbuf(stream, None, 2, 0)  # _IONBF
    except Exception:  # noqa: BLE001 - not glibc: C stdio keeps its own buffering
        pass


# -- print ------------------------------------------------------------------------------

_builtin_print = builtins.print
_own: list = []  # the rank's unbuffered sys.stdout and sys.stderr


def _print(*args, sep=None, end=None, file=None, flush=False):
    """print(), writing one piece of text where the builtin writes one per argument,
    separator and end.

    On an unbuffered stream each write is a system call, so ``print("step", i)`` would
    cost four and make a rank that prints a lot several times slower; one write also
    keeps a printed line whole in the pipe. Any other file, and any unusual argument,
    goes to the builtin print unchanged.
    """
    if file is None:
        file = sys.stdout
    if ((file is not _own[0] and file is not _own[1])
            or (sep is not None and type(sep) is not str)
            or (end is not None and type(end) is not str)):
        return _builtin_print(*args, sep=sep, end=end, file=file, flush=flush)
    if file is _own[0]:
        if _last[0] == 2 and _ordered:
            _wait_read(2)      # what stderr holds is relayed first (_StderrPipe)
        _last[0] = 1
    if sep is None:
        sep = " "
    parts = []
    try:
        for arg in args:
            parts.append(arg if type(arg) is str else str(arg))
    except BaseException:
        # As the builtin: what came before the argument that failed is written.
        file.write(sep.join(parts) + (sep if parts else ""))
        raise
    file.write(sep.join(parts) + ("\n" if end is None else end))
    return None


_print.__name__ = _print.__qualname__ = "print"
_print.__doc__ = _builtin_print.__doc__
