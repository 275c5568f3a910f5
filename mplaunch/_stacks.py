"""Turning the ranks' faulthandler dumps into a message that shows where each one waits."""
from __future__ import annotations

import linecache
import os
import re
from typing import Dict, List, Tuple

_FRAME = re.compile(r'^\s+File "(?P<file>.*)", line (?P<line>\d+) in (?P<func>.*)$')
_THREAD = re.compile(r"^(Current thread|Thread) (0x[0-9a-f]+)")

INNERMOST = 4
_OWN_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


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
        out.append(f"    ... {len(frames) - limit} outer frame(s)")
    for file, line, func in shown:
        out.append(f'    File "{file}", line {line}, in {func}')
        src = linecache.getline(file, line).strip()
        if src:
            out.append(f"      {src}")
    return out


def summarize_stacks(stacks: Dict[int, str]) -> str:
    lines = []
    for rank in sorted(stacks):
        text = stacks[rank]
        threads = parse_dump(text)
        if not threads:
            lines.append(f"rank {rank}: no stack arrived (it did not answer in time)")
            continue
        lines.append(f"rank {rank}:")
        # The main thread is listed last by faulthandler; show it first.
        ordered = sorted(threads, key=lambda t: 0 if t[0].startswith("Current") else 1)
        for header, frames in ordered:
            if len(threads) > 1:
                lines.append(f"  {header}:")
            lines.extend(format_frames(frames))
    return "\n".join(lines)
