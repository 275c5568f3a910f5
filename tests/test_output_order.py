"""A rank's stdout and stderr are relayed in the order it wrote them (issue 38, item 6):
the two are pipes of their own, read as they become ready, and a progress bar's last
frames on stderr were relayed after the line the rank printed next on stdout, leaving
the bar frozen short of 100% above it (42 of 100 bars here before)."""
from __future__ import annotations

import contextlib
import io

import mplaunch


def bars(n, frames):
    import sys
    for i in range(n):
        for p in range(frames):
            sys.stderr.write(f"\rbar{i} {p:08d}" + "#" * 100)
        sys.stderr.write("\n")
        print(f"after{i}")
    return True


def test_a_bars_last_frames_come_before_the_line_printed_after_it():
    buf = io.StringIO()
    n = 20
    with mplaunch.World(2) as world:
        world.run(bars, (1, 1))
        with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
            world.run(bars, (n, 2000))
    text = buf.getvalue()
    late = []
    for rank in (0, 1):
        lines = [line for line in text.split("\n") if line.startswith(f"[rank{rank}]")]
        for i in range(n):
            after = next(k for k, line in enumerate(lines) if line.endswith(f"after{i}"))
            last_frame = max(k for k, line in enumerate(lines) if f"bar{i} " in line)
            if last_frame > after:
                late.append((rank, i))
    assert late == []
