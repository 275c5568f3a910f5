"""Each rank's stdout and stderr, read from the pipes on its fds 1 and 2, relayed line by
line with a prefix to the launching process's sys.stdout / sys.stderr (in Jupyter: the
cell), copied to per-rank log files, and the end of stderr kept for error messages.

Only whole lines reach the sink, each in one write together with its prefix, so lines
of different ranks never mix. A progress bar that redraws its line after ``\\r`` is
shown in place: its latest state is written as ``prefix + state + "\\r"``, and when its
line ends, the final state is written once more as an ordinary line.
"""
from __future__ import annotations

import codecs
import io
import json
import os
import re
import time
import warnings
from typing import Optional

_TAIL_BYTES = 256 * 1024
_MAX_PENDING = 1 << 20  # a "line" longer than this is relayed in pieces
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


def _whole_chars(buf: bytes) -> bytes:
    """buf without a UTF-8 sequence cut short at its end."""
    for back in range(1, min(4, len(buf)) + 1):
        b = buf[-back]
        if b & 0xC0 != 0x80:  # the last sequence's first byte
            need = 4 if b >= 0xF0 else 3 if b >= 0xE0 else 2 if b >= 0xC0 else 1
            return buf[:-back] if need > back else buf
    return buf


class StreamRelay:
    """One stream of one rank: feed() it what the pipe gave, close() it at EOF."""

    def __init__(self, sink, prefix: str, logfile=None, keep_tail: bool = False):
        self.prefix = prefix.encode("utf-8")
        self._nlp = b"\n" + self.prefix
        self.logfile = logfile
        self.keep_tail = keep_tail
        self._tail = bytearray()
        self.retarget(sink)
        # The line being received: the text after its last \r (all of it if none).
        self._pending = bytearray()
        # Whether that line has had a \r (it is a progress bar), what its latest
        # complete state was, and what we last drew of it.
        self._progress = False
        self._state = b""
        self._drawn = None

    def retarget(self, sink) -> None:
        """Relay to `sink` from now on (a World's run from another notebook cell, or
        under another test's capture)."""
        self.sink = sink
        self._bytes = _byte_sink(sink) if sink is not None else None
        # Bytes written under the text layer must show as soon as text would.
        self._flush_each = bool(getattr(sink, "line_buffering", False)
                                or getattr(sink, "write_through", False))

    # -- input ---------------------------------------------------------------------
    def feed(self, data: bytes) -> None:
        if not data:
            return
        if self.logfile is not None:
            self.logfile.write(data)
        if self.keep_tail:
            self._tail += data
            if len(self._tail) > 2 * _TAIL_BYTES:
                del self._tail[:-_TAIL_BYTES]
        if self.sink is None:
            return
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

    def _draw(self) -> None:
        """Show the open progress line's latest state in place, once per change."""
        now = _whole_chars(bytes(self._pending)) or self._state
        if now and now != self._drawn:
            self._drawn = now
            self._write(self.prefix + now + b"\r")

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
        if not out:
            return
        sink = self.sink
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

    def end_line(self) -> None:
        """A line left open (no newline yet, or a progress bar) is written as a line:
        at the end of the stream, or of a World's call."""
        if self.sink is not None:
            last = bytes(self._pending) or (self._state if self._progress else b"")
            if last:
                self._write(self.prefix + last + b"\n")
        self._pending = bytearray()
        self._progress, self._state, self._drawn = False, b"", None

    def close(self) -> None:
        """End of the stream: a last line without its newline is written as a line."""
        self.end_line()
        if self.sink is not None:
            try:
                self.sink.flush()
            except Exception:  # noqa: BLE001
                pass
        if self.logfile is not None:
            self.logfile.close()
            self.logfile = None

    def tail_text(self) -> str:
        return bytes(self._tail[-_TAIL_BYTES:]).decode("utf-8", "replace")


# -- the stderr tail in error messages ----------------------------------------------------

_FATAL = re.compile(r"^(Fatal Python error|Windows fatal exception):")
_THREAD = re.compile(r"^(Current thread|Thread) 0x[0-9a-fA-F]+\b")
_CXX_HEADLINE = re.compile(r"terminate called|what\(\):")
_MAX_LINE = 600
_MAX_CURRENT = 50  # lines of the crashing thread's stack (faulthandler stops at 100)


def _clip(line: str) -> str:
    if len(line) <= _MAX_LINE or line.startswith("Extension modules:"):
        return line  # that one is shortened where its total can be kept
    return line[:_MAX_LINE] + " ..."


def summarize_tail(text: str, max_lines: int = 40) -> str:
    """The end of a rank's stderr, for an error message.

    Without a crash dump: the last `max_lines` lines. With one (faulthandler's "Fatal
    Python error" and every thread's stack, then a long list of extension modules),
    keeping only the last lines would show other threads' stacks and the module list,
    and lose both what the rank wrote just before it failed and where it failed. So the
    summary has, in this order: the lines written before the dump, the dump's headline,
    the crashing thread's stack in full, the other threads one frame each, and the
    start of the module list.
    """
    lines = [_clip(line) for line in text.splitlines()]
    while lines and not lines[-1].strip():
        lines.pop()
    if not lines:
        return ""
    start = None
    for i in range(len(lines) - 1, -1, -1):
        if _FATAL.match(lines[i]):
            start = i
            break
    if start is None:
        return "\n".join(lines[-max_lines:])
    return "\n".join(_summarize_dump(lines[:start], lines[start:], max_lines))


def _summarize_dump(before: list, dump: list, max_lines: int) -> list:
    head: list = []        # the "Fatal Python error" line and what precedes any thread
    current: list = []     # the crashing thread: header and frames
    others: list = []      # [header, first frame or None] per other thread
    after: list = []       # the module list and anything the dump did not account for
    section = head
    for line in dump:
        m = _THREAD.match(line)
        if m:
            if m.group(1) == "Current thread":
                current = [line]
                section = current
            else:
                others.append([line])
                section = others[-1]
            continue
        if line.startswith("Extension modules:"):
            if len(line) > 200:
                total = re.search(r" \(total: \d+\)$", line)
                line = line[:200] + " ..." + (total.group(0) if total else "")
            after.append(line)
            section = after
            continue
        if not line.strip():
            continue
        if section is after or section is head or section is current:
            section.append(line)
        elif len(section) < 2:
            section.append(line)
    if not current:
        # No thread was marked current (a crash outside any Python thread): the
        # last thread printed is the best guess, shown whole.
        current = others.pop() if others else []

    out_before = [line for line in before if line.strip()]
    budget_before = max(8, max_lines // 2)
    shown_before = out_before[-budget_before:]
    hidden = out_before[:-budget_before] if len(out_before) > budget_before else []
    # A C++ exception prints its message first and then a long stack: keep the message.
    headlines = [line for line in hidden[-200:] if _CXX_HEADLINE.search(line)][-3:]
    result = headlines + (["  ..."] if headlines else []) + shown_before
    # The outermost frames are mplaunch's own bootstrap: the same in every crash.
    while len(current) > 1 and _is_bootstrap_frame(current[-1]):
        current.pop()
    if len(current) > _MAX_CURRENT:
        current = current[:_MAX_CURRENT] + ["  ..."]
    result += head + current
    after = after[:10]
    if others:
        # Threads often come in identical sets (loader workers, a pool): count them.
        counts: dict = {}
        for thread in others:
            frame = thread[1] if len(thread) > 1 else "  <no Python frame>"
            counts[frame] = counts.get(frame, 0) + 1
        room = max(2, max_lines - len(result) - len(after) - 2)
        result.append(f"{len(others)} other thread(s), at (innermost frame):")
        for frame, n in list(counts.items())[:room]:
            result.append(f"{frame}  [{n} thread(s)]" if n > 1 else frame)
        if len(counts) > room:
            result.append(f"  ... and {len(counts) - room} more place(s)")
    return result + after


_OWN_DIR = os.path.dirname(os.path.abspath(__file__))


def _is_bootstrap_frame(line: str) -> bool:
    line = line.strip()
    return (line.startswith(f'File "{_OWN_DIR}{os.sep}')
            or line == 'File "<string>", line 1 in <module>')


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

def error_file_data(failure, message: Optional[str] = None) -> dict:
    """What torch elastic's ErrorHandler.record_exception writes for an exception,
    plus the errorCode its agent adds when it copies a child's file upward.

    py_callstack holds the worker's traceback; a rank that died without one (a signal,
    os._exit) gets the end of its stderr there instead (a segfault's faulthandler
    stack), since that is the field torchrun and log scrapers show.
    """
    if message is None:
        if failure.exc_type is not None:
            message = (f"{failure.exc_type}: {failure.message}" if failure.message
                       else failure.exc_type)
        else:
            message = failure.describe()
    callstack = failure.traceback or failure.stderr_tail or message
    msg = {
        "message": message,
        "extraInfo": {
            "py_callstack": callstack,
            "timestamp": str(int(failure.timestamp or time.time())),
        },
    }
    if failure.exitcode:
        msg["errorCode"] = failure.exitcode
    return {"message": msg}


def write_error_file(path: str, failure, message: Optional[str] = None) -> bool:
    """Write `failure` as a torch elastic JSON error file at `path`, atomically (a
    reader never sees half a file). A path that cannot be written is a warning, not an
    error: the launch's own exception must not be replaced by an OSError."""
    data = error_file_data(failure, message)
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(tmp, "w") as f:
            json.dump(data, f)
        os.replace(tmp, path)
        return True
    except OSError as exc:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        warnings.warn(f"mplaunch could not write the error file {path!r}: {exc}",
                      RuntimeWarning, stacklevel=2)
        return False

