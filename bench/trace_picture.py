"""Draw a straggler report's trace (``report.trace(path)``: Chrome/Perfetto JSON) as a
PNG, one row per rank: each collective a bar from when the rank started it to when the
last rank did (the time it waited), a red mark where a rank arrived last. What the
docs show (docs/_static/stragglers.png); Perfetto (ui.perfetto.dev) draws the same
file interactively. Needs Pillow (``pip install pillow``), which mplaunch does not.

    python bench/stragglers.py --picture /tmp/run.svg     # writes /tmp/run.json too
    python bench/trace_picture.py /tmp/run.json docs/_static/stragglers.png
"""
from __future__ import annotations

import json
import sys

from PIL import Image, ImageDraw, ImageFont

WIDTH, ROW, LEFT, TOP = 1000, 34, 70, 30


def main(src: str, out: str) -> None:
    events = json.load(open(src))["traceEvents"]
    slices = [e for e in events if e.get("ph") == "X" and isinstance(e.get("pid"), int)]
    marks = [e for e in events if e.get("ph") == "i"]
    ranks = sorted({e["pid"] for e in slices})
    t0 = min(e["ts"] for e in slices)
    t1 = max(e["ts"] + e["dur"] for e in slices)
    scale = (WIDTH - LEFT - 20) / (t1 - t0)
    height = TOP + ROW * len(ranks) + 50
    img = Image.new("RGB", (WIDTH, height), "white")
    d = ImageDraw.Draw(img)
    font = ImageFont.load_default(size=13)
    d.text((LEFT, 6), "each rank's collectives: a bar from when it started one to when "
           "the last rank did (its wait); red: it came last", fill="black", font=font)
    for i, rank in enumerate(ranks):
        y = TOP + i * ROW
        d.text((8, y + 8), f"rank {rank}", fill="black", font=font)
        d.line([(LEFT, y + ROW - 4), (WIDTH - 20, y + ROW - 4)], fill=(220, 220, 220))
        for e in (e for e in slices if e["pid"] == rank):
            x0 = LEFT + (e["ts"] - t0) * scale
            x1 = max(x0 + 1, LEFT + (e["ts"] + e["dur"] - t0) * scale)
            d.rectangle([x0, y + 6, x1, y + ROW - 8], fill=(110, 150, 200))
        for e in (e for e in marks if e["pid"] == rank):
            x = LEFT + (e["ts"] - t0) * scale
            d.rectangle([x - 1, y + 2, x + 2, y + ROW - 4], fill=(210, 40, 40))
    axis = TOP + ROW * len(ranks) + 8
    span_ms = (t1 - t0) / 1e3
    step = next(s for s in (50, 100, 200, 500, 1000, 2000, 5000) if span_ms / s <= 10)
    for k in range(int(span_ms // step) + 1):
        x = LEFT + k * step * 1e3 * scale
        d.line([(x, axis), (x, axis + 5)], fill="black")
        d.text((x - 10, axis + 8), f"{k * step} ms", fill="black", font=font)
    img.save(out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
