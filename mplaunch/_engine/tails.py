"""What a failing rank leaves for its error: the end of its stderr, summarized (a
crash's dump shortened to what matters), and torch elastic's error file."""
from __future__ import annotations

import json
import os
import re
import time
import warnings
from typing import Optional


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
    start of the module list. A progress bar's frames (redrawn after ``\r``) count as
    its last one, as a terminal shows it.
    """
    lines = [_clip(line) for line in collapse_redraws(text).splitlines()]
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


def collapse_redraws(text: str) -> str:
    """`text` with each line that was redrawn after ``\r`` (a tqdm bar: hundreds of
    frames, each taken for a line of its own) cut to its last frame, the last text
    between ``\r``'s, as the relay shows it; a line whose last frame is blank (a bar
    cleared with ``leave=False``) is left out."""
    if "\r" not in text:
        return text
    out = []
    for line in text.split("\n"):
        if "\r" in line:
            frames = [frame for frame in line.split("\r") if frame]
            if not frames or not frames[-1].strip():
                continue
            line = frames[-1]
        out.append(line)
    return "\n".join(out)


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


_OWN_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # mplaunch/


def _is_bootstrap_frame(line: str) -> bool:
    line = line.strip()
    return (line.startswith(f'File "{_OWN_DIR}{os.sep}')
            or line == 'File "<string>", line 1 in <module>')


# -- error files ----------------------------------------------------------------

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
