"""Each rank's stdout and stderr, read from the pipes on its fds 1 and 2, relayed line by
line with a prefix to the launching process's sys.stdout / sys.stderr (in Jupyter: the
cell), copied to per-rank log files, and the end of stderr kept for error messages.

Only whole lines reach the sink, each in one write together with its prefix, so lines
of different ranks never mix. A progress bar that redraws its line after ``\\r`` is
shown in place: on a terminal its latest state is written as ``prefix + state + "\\r"``,
elsewhere (a log file, a pipe) as ``"\\r" + prefix + state`` after the one before, and
when its line ends, the final state is written once more as an ordinary line (unless
it is there already). Before any other line is written to the same place, a drawn bar
is taken off a terminal and drawn again under that line; elsewhere the bar's line is
ended where it stands, since a file keeps what a ``\\r`` only seems to clear: the next
line would be written at the end of the bar's.

Ranks share a terminal (stdout and stderr of every rank end on the same screen), and a
terminal line can show one thing at a time. So one relay at a time draws an open line
there (a progress bar, or a prompt waiting for input), and the others' bars wait their
turn instead of taking turns on that line; lines written meanwhile go above it. That
part is _engine.screen's.
"""
from __future__ import annotations

import codecs
import io
import os
import weakref
from typing import Optional

from .screen import (LOCK as _LOCK, MAX_PENDING as _MAX_PENDING, OpenLine,
                     screen_for as _screen_for)

_TAIL_BYTES = 256 * 1024
# Small enough that every object made from one read stays under malloc's mmap
# threshold (128 KiB): with 512 KiB reads each of them was a fresh mapping, and the page
# faults (300k per 300 MB) cut the relay's throughput to a third.
_READ_SIZE = 1 << 16
_ASCII_SUPERSETS = frozenset({"utf-8", "ascii", "latin-1", "iso8859-15", "cp1252"})


def _byte_sink(sink):
    """The binary buffer under `sink` when ASCII bytes may go there directly.

    Decoding every chunk only for the sink to encode it again costs more than the rest
    of the relay together. That shortcut is only taken for a plain TextIOWrapper (the
    real sys.stdout, pytest's capture), whose write() nobody overrode and whose encoding
    writes ASCII as itself; anything else (Jupyter's stream, a tee) gets str.
    """
    if not isinstance(sink, io.TextIOWrapper) or type(sink).write is not io.TextIOWrapper.write:
        return None
    try:
        if codecs.lookup(sink.encoding).name not in _ASCII_SUPERSETS:
            return None
        return sink.buffer
    except (AttributeError, LookupError, ValueError):
        return None


def _utf8_cut(buf, n: int) -> int:
    """A cut near n (at most 3 bytes before it) that does not split a UTF-8 sequence:
    step back over continuation bytes (10xxxxxx) to the sequence's first byte."""
    i = n
    while i > n - 3 and i > 0 and (buf[i] & 0xC0) == 0x80:
        i -= 1
    return i if i > 0 else n


class StreamRelay(OpenLine):
    """One stream of one rank: feed() it what the pipe gave, close() it at EOF."""

    def __init__(self, sink, prefix: str, logfile=None, keep_tail: bool = False):
        self.prefix = prefix.encode("utf-8")
        self._nlp = b"\n" + self.prefix
        self.logfile = logfile
        self.keep_tail = keep_tail
        self._tail = bytearray()
        self._screen = None
        self.retarget(sink)
        # The line being received: the text after its last \r (all of it if none).
        self._pending = bytearray()
        # Whether that line has had a \r (it is a progress bar), what its latest
        # complete state was, and what we last drew of it.
        self._progress = False
        self._state = b""
        self._drawn = None
        self._open = False
        # Show an unfinished line at once (see show_prompts), and what of it is shown.
        self._prompts = False
        self._shown = None

    def retitle(self, prefix: str) -> None:
        """Prefix its lines with `prefix` from now on (a rank renumbered)."""
        self.prefix = prefix.encode("utf-8")
        self._nlp = b"\n" + self.prefix

    def retarget(self, sink, screen=None) -> None:
        """Relay to `sink` from now on (a World's run from another notebook cell, or
        under another test's capture); `screen`: `sink`'s (screen_for), when the caller
        has it already (a group retargets every rank's relay to the same two sinks)."""
        self.sink = sink
        self._bytes = _byte_sink(sink) if sink is not None else None
        # Bytes written under the text layer must show as soon as text would.
        self._flush_each = bool(getattr(sink, "line_buffering", False)
                                or getattr(sink, "write_through", False))
        if sink is None:
            return
        screen = screen if screen is not None else _screen_for(sink)
        if screen is not self._screen:
            # Another destination (the first one of a World started before its first
            # run, another cell's, a test's capture): draw open lines on its screen.
            self._leave_screen()
            self._screen = screen
            screen.relays.append(weakref.ref(self))

    # -- input ---------------------------------------------------------------------
    def feed(self, data: bytes) -> None:
        if not data:
            return
        with _LOCK:
            self._feed(data)

    def _feed(self, data: bytes) -> None:
        if self.logfile is not None:
            self.logfile.write(data)
        if self.keep_tail:
            self._tail += data
            if len(self._tail) > 2 * _TAIL_BYTES:
                del self._tail[:-_TAIL_BYTES]
        if self.sink is None:
            return
        if self._shown is not None:
            data = self._continue_prompt(data)
        if data:
            self._relay(data)
        if self._prompts and self._pending and not self._progress and self.sink is not None:
            self._show_prompt()

    def _relay(self, data: bytes) -> None:
        cr = data.rfind(b"\r")
        cut = max(data.rfind(b"\n"), cr)
        if cut < 0:
            self._pending += data
            if len(self._pending) > _MAX_PENDING:
                self._split_long_line()
            elif self._progress:
                self._draw()
            return
        tail_len = len(data) - cut - 1
        if cr < 0 and not self._progress:
            self._emit_lines(data, tail_len)
        else:
            self._emit_progress(bytes(self._pending) + data[:cut + 1])
            self._pending = bytearray()
        if tail_len:
            self._pending += data[cut + 1:]
            if len(self._pending) > _MAX_PENDING:
                self._split_long_line()
        if self._progress:
            self._draw()

    def _emit_lines(self, data: bytes, tail_len: int) -> None:
        """The common case: data holds whole lines (and maybe the start of the next
        one, `tail_len` bytes), no \\r anywhere."""
        p = self.prefix
        if not p:
            body = data[:len(data) - tail_len] if tail_len else data
            self._write(bytes(self._pending) + body if self._pending else body)
            self._pending = bytearray()
            return
        # One replace prefixes every line after the first and adds a prefix after the
        # last \n, which (with the tail, which has no \n) is cut off again.
        body = data.replace(b"\n", self._nlp)
        end = len(body) - tail_len - len(p)
        self._write(b"".join((p, self._pending, memoryview(body)[:end])))
        self._pending = bytearray()

    def _emit_progress(self, buf: bytes) -> None:
        """buf ends with \\n or \\r. Each finished line is written with its final state
        (the last non-empty text between \\r's); a line still open after \\r only
        updates the state to draw."""
        p = self.prefix
        out = []
        lines = buf.split(b"\n")
        last = lines.pop()  # b"" when buf ends with \n, else ends with \r
        for line in lines:
            state = self._state if self._progress else b""
            if b"\r" in line:
                for seg in reversed(line.split(b"\r")):
                    if seg:
                        state = seg
                        break
            elif line:
                state = line
            if not self._ended_as(state):
                out.append(p + state + b"\n")
            self._progress, self._state, self._drawn = False, b"", None
        if last:
            self._progress = True
            for seg in reversed(last.split(b"\r")):
                if seg:
                    self._state = seg
                    break
        if out:
            self._write(b"".join(out))
        elif not self._progress:
            self._release()

    def _split_long_line(self) -> None:
        # Memory stays bounded for output that never ends its line; the pieces are
        # cut between characters, so each decodes on its own.
        buf = self._pending
        while len(buf) > _MAX_PENDING:
            n = _utf8_cut(buf, _MAX_PENDING)
            self._write(self.prefix + bytes(buf[:n]) + b"\n")
            del buf[:n]
        self._progress, self._state, self._drawn = False, b"", None

    # -- output --------------------------------------------------------------------
    def _write(self, out) -> None:
        """Write whole lines: above the open line another relay has drawn, or over our
        own bar when these lines end it."""
        if not out:
            return
        screen = self._screen
        owner = screen.owner if screen is not None else None
        if owner is None:
            self._put(out)
        elif owner is self:
            if screen.ansi:
                self._put(b"\r\x1b[K" + out)
            else:
                # The lines end ours: the first is its final state, after the last drawn.
                self._put(b"\r" + out if self._open else out)
                self._open = False
            if not self._progress:
                self._release()
        else:
            owner._hide()
            self._put(out)
            owner._redraw()

    def _put(self, out) -> None:
        if not out:
            return
        sink = self.sink
        if self._screen is not None:
            self._screen.switch_to(sink)
        try:
            raw = self._bytes
            if raw is not None and out.isascii():
                sink.flush()  # what the parent printed itself comes first
                while True:
                    # Under `python -u` the buffer is the raw file, which may take
                    # only part of a large write.
                    n = raw.write(out)
                    if n is None or n >= len(out):
                        break
                    out = memoryview(out)[n:]
                if self._flush_each:
                    raw.flush()
                return
            text = str(out, "utf-8", "replace")
            try:
                sink.write(text)
            except UnicodeEncodeError:
                enc = getattr(sink, "encoding", None) or "ascii"
                sink.write(text.encode(enc, "backslashreplace").decode(enc))
        except Exception:  # noqa: BLE001 - a closed or broken sink must not stop the launch
            self.sink = self._bytes = None
            self._open = False
            if self._screen is not None and self._screen.owner is self:
                self._screen.owner = None

    def end_line(self) -> None:
        """A line left open (no newline yet, or a progress bar) is written as a line:
        at the end of the stream, or of a World's call."""
        with _LOCK:
            self._end_line()

    def _end_line(self) -> None:
        if self.sink is not None:
            if self._shown is not None:
                self._put(bytes(self._pending)[len(self._shown):] + b"\n")
                self._pending = bytearray()
                self._shown = None
            last = bytes(self._pending) or (self._state if self._progress else b"")
            self._progress = False
            if last and not self._ended_as(last):
                self._write(self.prefix + last + b"\n")
        self._pending = bytearray()
        self._progress, self._state, self._drawn, self._open = False, b"", None, False
        # Its open line is over; it stays on its screen (a World's next call most often
        # writes to the same one: retarget leaves it for another).
        self._release()

    def close(self) -> None:
        """End of the stream: a last line without its newline is written as a line."""
        self.end_line()
        with _LOCK:
            self._leave_screen()
        if self.sink is not None:
            try:
                self.sink.flush()
            except Exception:  # noqa: BLE001
                pass
        if self.logfile is not None:
            self.logfile.close()
            self.logfile = None

    def begin_call(self) -> None:
        """A World's call is sent: the tail kept from now on is that call's, so that its
        error quotes what the failing call wrote, never an earlier call's (a previous
        cell's traceback, or its progress bars, above a rank that died silently)."""
        with _LOCK:
            self._tail = bytearray()

    def tail_text(self) -> str:
        """The end of what the stream carried (of the current call's, in a World)."""
        return bytes(self._tail[-_TAIL_BYTES:]).decode("utf-8", "replace")


def relay_pending(r, end_line: bool) -> None:
    """Relay what rank `r`'s pipes (a RankState's) hold now, until a read finds them
    empty or at EOF (which the group's wait() then unregisters); with `end_line`, a
    last line without its newline too."""
    for fd, relay in ((r.out_fd, r.out), (r.err_fd, r.err)):
        if fd is None or relay is None:
            continue
        while True:
            chunk = read_pipe(fd)
            if not chunk:
                break
            relay.feed(chunk)
        if end_line:
            relay.end_line()


# -- pipes -------------------------------------------------------------------------------

def read_pipe(fd: int) -> Optional[bytes]:
    """What is in a non-blocking pipe now: b'' at EOF, None if nothing yet."""
    try:
        return os.read(fd, _READ_SIZE)
    except (BlockingIOError, InterruptedError):
        return None


def set_pipe_size(fd: int, size: int = 1 << 20) -> None:
    try:
        import fcntl
        fcntl.fcntl(fd, 1031, size)  # F_SETPIPE_SZ: fewer wakeups at high output rates
    except OSError:
        pass


# -- torch elastic error files ------------------------------------------------------------
