"""Each rank's stdout and stderr, read from the pipes on its fds 1 and 2, relayed line by
line with a prefix to the launching process's sys.stdout / sys.stderr (in Jupyter: the
cell), copied to per-rank log files, and the end of stderr kept for error messages."""
from __future__ import annotations

import json
import os
import re
import socket
import time
from typing import Optional

_TAIL_BYTES = 256 * 1024
_MAX_PENDING = 1 << 20  # a "line" longer than this is relayed in pieces


class StreamRelay:
    """One stream of one rank."""

    def __init__(self, sink, prefix: str, logfile=None, keep_tail: bool = False):
        self.sink = sink
        self.prefix = prefix.encode()
        self.logfile = logfile
        self.keep_tail = keep_tail
        self._pending = b""
        self._tail = bytearray()
        self.total = 0

    def feed(self, data: bytes) -> None:
        if not data:
            return
        self.total += len(data)
        if self.logfile is not None:
            self.logfile.write(data)
        if self.keep_tail:
            self._tail += data
            if len(self._tail) > 2 * _TAIL_BYTES:
                del self._tail[:-_TAIL_BYTES]
        if self.sink is None:
            return
        buf = self._pending + data if self._pending else data
        cut = max(buf.rfind(b"\n"), buf.rfind(b"\r"))
        if cut < 0:
            if len(buf) > _MAX_PENDING:
                self._emit(buf + b"\n")
                buf = b""
            self._pending = buf
            return
        self._pending = buf[cut + 1:]
        self._emit(buf[:cut + 1])

    def _emit(self, chunk: bytes) -> None:
        """chunk ends with \\n or \\r; every line in it gets the prefix."""
        p = self.prefix
        if b"\r" not in chunk:
            out = p + chunk[:-1].replace(b"\n", b"\n" + p) + b"\n" if p else chunk
        else:
            out = self._emit_progress(chunk)
        self._write(out)

    def _emit_progress(self, chunk: bytes) -> bytes:
        # A progress bar redraws its line after each \r: of the redraws that arrived
        # together only the last is worth showing, and it keeps its \r so terminals and
        # notebooks draw it in place.
        p = self.prefix
        parts = []
        lines = chunk.split(b"\n")
        ends_open = not chunk.endswith(b"\n")
        last = lines.pop()  # b"" when the chunk ends with \n
        for line in lines:
            segs = [s for s in line.split(b"\r") if s]
            parts.append(p + (segs[-1] if segs else b"") + b"\n")
        if ends_open and last:
            segs = [s for s in last.split(b"\r") if s]
            if segs:
                parts.append(p + segs[-1] + b"\r")
        return b"".join(parts)

    def _write(self, out: bytes) -> None:
        if not out:
            return
        try:
            self.sink.write(out.decode("utf-8", "replace"))
        except Exception:  # noqa: BLE001 - a closed or broken sink must not stop the launch
            self.sink = None

    def close(self) -> None:
        if self.sink is not None and self._pending:
            segs = [s for s in self._pending.split(b"\r") if s]
            if segs:
                self._write(self.prefix + segs[-1] + b"\n")
        self._pending = b""
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


_FATAL = re.compile(r"^(Fatal Python error|Windows fatal exception):")
_THREAD = re.compile(r"^(Current thread|Thread) 0x[0-9a-f]+ ")


def summarize_tail(text: str, max_lines: int = 40) -> str:
    """The end of a rank's stderr, for an error message.

    A crash dump (faulthandler's "Fatal Python error" with every thread's stack and a
    long list of extension modules) can push out everything useful if we only keep the
    last N lines. So the dump is shortened instead: the crashing thread's stack in full,
    other threads in brief, the extension list cut; and the lines the rank wrote just
    before the dump are kept too.
    """
    lines = text.splitlines()
    if not lines:
        return ""
    start = None
    for i in range(len(lines) - 1, -1, -1):
        if _FATAL.match(lines[i]):
            start = i
            break
    if start is None:
        return "\n".join(lines[-max_lines:])
    before = lines[max(0, start - 10):start]
    dump = []
    other_thread_frames = None
    for line in lines[start:]:
        if line.startswith("Extension modules:"):
            dump.append(line[:160] + (" ..." if len(line) > 160 else ""))
            continue
        m = _THREAD.match(line)
        if m:
            other_thread_frames = 0 if m.group(1) == "Thread" else None
            dump.append(line)
            continue
        if other_thread_frames is not None and line.startswith("  "):
            other_thread_frames += 1
            if other_thread_frames == 4:
                dump.append("  ...")
            if other_thread_frames >= 4:
                continue
        dump.append(line)
    keep_dump = dump[:max(max_lines - len(before), 20)]
    if len(keep_dump) < len(dump):
        keep_dump.append(f"... ({len(dump) - len(keep_dump)} more lines)")
    return "\n".join(before + keep_dump)


def read_pipe(fd: int) -> Optional[bytes]:
    """What is in a non-blocking pipe now: b'' at EOF, None if nothing yet."""
    try:
        return os.read(fd, 1 << 20)
    except (BlockingIOError, InterruptedError):
        return None


def set_pipe_size(fd: int, size: int = 1 << 20) -> None:
    try:
        import fcntl
        fcntl.fcntl(fd, 1031, size)  # F_SETPIPE_SZ: fewer wakeups at high output rates
    except OSError:
        pass


def write_error_file(path: str, failure, message: str) -> None:
    """A JSON error file in the layout torch elastic's error handler writes, so tools
    that read those files (torchrun's summary, schedulers' log scrapers) understand it."""
    data = {
        "message": {
            "message": message,
            "extraInfo": {
                "py_callstack": failure.traceback or "",
                "timestamp": str(int(failure.timestamp or time.time())),
            },
        },
        "rank": failure.rank,
        "pid": failure.pid,
        "exitcode": failure.exitcode,
        "hostname": failure.hostname or socket.gethostname(),
    }
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)
