"""Where a rank was, read back from text: its faulthandler dump (where it waits, for a
timeout's message) and its traceback (where it failed, for a failure's one line)."""
from __future__ import annotations

import linecache
import os
import re
import sysconfig
from typing import Dict, List, Optional, Tuple

_FRAME = re.compile(r'^\s+File "(?P<file>.*)", line (?P<line>\d+) in (?P<func>.*)$')
_THREAD = re.compile(r"^(Current thread|Thread) (0x[0-9a-f]+)")
# A frame line of a traceback printed by Python (SyntaxError's "File ..., line N" has no
# function and names no frame).
_TB_FRAME = re.compile(r'^  File "(?P<file>.*)", line (?P<line>\d+), in (?P<func>.*)$')
_TB_HEAD = "Traceback (most recent call last):"

INNERMOST = 4
# mplaunch's own package (this file is in its _wire folder): frames there are not the user's.
_OWN_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
NO_STACK = "no stack arrived (it did not answer in time)"


def parse_dump(text: str) -> List[Tuple[str, List[Tuple[str, int, str]]]]:
    """[(thread header, [(file, line, func), ...innermost first])]"""
    threads = []
    for line in text.splitlines():
        m = _THREAD.match(line)
        if m:
            threads.append((line.rstrip(":").replace(" (most recent call first)", ""), []))
            continue
        f = _FRAME.match(line)
        if f and threads and not f["file"].startswith(_OWN_DIR) and f["file"] != "<string>":
            # mplaunch's own frames (the server's loop, the worker's bootstrap) are
            # below every rank's stack and say nothing about where it waits
            threads[-1][1].append((f["file"], int(f["line"]), f["func"]))
    return threads


def format_frames(frames, limit: int = INNERMOST) -> List[str]:
    """Innermost `limit` frames in traceback order (outermost first), each with its
    source line: a C call (a collective, time.sleep) has no frame of its own, so the
    line that called it is what tells the reader where the rank waits."""
    out = []
    shown = list(reversed(frames[:limit]))
    if len(frames) > limit:
        out.append(f"  ... {len(frames) - limit} outer frame(s)")
    for file, line, func in shown:
        out.append(f'  File "{file}", line {line}, in {func}')
        src = linecache.getline(file, line).strip()
        if src:
            out.append(f"    {src}")
    return out


def readable_stack(dump: str) -> str:
    """One rank's faulthandler dump as the timeout's message shows it: the innermost
    frames of each thread, main thread first, with source lines, without mplaunch's own
    frames. Text that is not a dump is kept as it is."""
    threads = parse_dump(dump)
    if not threads:
        return dump.strip("\n") or NO_STACK
    lines = []
    # The main thread is listed last by faulthandler; show it first.
    ordered = sorted(threads, key=lambda t: 0 if t[0].startswith("Current") else 1)
    for header, frames in ordered:
        if len(threads) > 1:
            lines.append(f"{header}:")
            lines.extend("  " + line for line in format_frames(frames))
        else:
            lines.extend(format_frames(frames))
    return "\n".join(lines)


def summarize_stacks(stacks: Dict[int, str]) -> str:
    """Every rank's readable stack, rank by rank. `stacks` maps rank to its raw dump."""
    lines = []
    for rank in sorted(stacks):
        text = readable_stack(stacks[rank])
        if text == NO_STACK:
            lines.append(f"rank {rank}: {NO_STACK}")
            continue
        lines.append(f"rank {rank}:")
        lines.extend("  " + line for line in text.splitlines())
    return "\n".join(lines)


def _library_dirs() -> Tuple[str, ...]:
    dirs = {_OWN_DIR}
    paths = sysconfig.get_paths()
    for key in ("stdlib", "platstdlib", "purelib", "platlib"):
        if paths.get(key):
            dirs.add(os.path.realpath(paths[key]) + os.sep)
            dirs.add(os.path.abspath(paths[key]) + os.sep)
    return tuple(dirs)


def failure_site(tb_text: Optional[str]) -> Optional[Tuple[str, int, str]]:
    """(file, line, function) where a rank's traceback text says it failed: the
    innermost frame of the user's own code in the last traceback of the chain (the one of
    the exception it raised), not a frame inside Python's library, torch or mplaunch,
    since the line that called into those is the one to look at. The innermost frame of
    all when every frame is a library's. None when the text names no frame."""
    if not tb_text:
        return None
    block = tb_text.rsplit(_TB_HEAD, 1)[-1] if _TB_HEAD in tb_text else ""
    frames = []
    for line in block.splitlines():
        m = _TB_FRAME.match(line)
        if m:
            frames.append((m["file"], int(m["line"]), m["func"]))
    if not frames:
        return None
    library = _library_dirs()
    for file, line, func in reversed(frames):
        if not (file.startswith(library) or file.startswith("<frozen ")):
            return file, line, func
    return frames[-1]


def short_path(path: str) -> str:
    """`path` relative to the current directory when it lies below it."""
    try:
        cwd = os.getcwd() + os.sep
    except OSError:
        return path
    return path[len(cwd):] if path.startswith(cwd) else path
