"""A skipped collective at 64 ranks: how soon after the timeout is the missing rank
named, with its line? (issue 41)

A World of 64 ranks (gloo) runs 16 all_reduces in every rank; then one rank, chosen at
random, skips the 17th (it sleeps at a marked line) while the other 63 wait in it, in
the default group, or in a new_group of all the ranks. The call's timeout is TIMEOUT
seconds. Measured: from the call's deadline (its start plus the timeout) to the moment
the timeout's message reached this process's stderr (mplaunch says it as it is known,
before the World heals), and to run() raising; and whether the message names the
missing rank and its marked line. torch.multiprocessing.spawn and torch elastic have
no such report (a hang there is a hang, or NCCL's watchdog on GPUs), so there is no side
by side. Nothing here asserts a timing.

    python bench/skipped.py [--nprocs 64] [--repeats 3] [--json out.json]
"""
from __future__ import annotations

import argparse
import io
import json
import os
import random
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import mplaunch  # noqa: E402

TIMEOUT = 10.0


def skip_one(missing: int, subgroup: bool):
    import torch
    import torch.distributed as dist
    group = dist.new_group(list(range(dist.get_world_size()))) if subgroup else None
    t = torch.ones(1)
    for _ in range(16):
        dist.all_reduce(t, group=group)
    if dist.get_rank() == missing:
        time.sleep(3600)   # SKIPPED-HERE
    dist.all_reduce(t, group=group)


class _Tee(io.TextIOBase):
    """stderr, with the time the timeout's message first came through."""

    def __init__(self, real):
        self.real, self.said_at, self.text = real, None, []

    def write(self, s):
        if self.said_at is None and "SKIPPED-HERE" in s:
            self.said_at = time.monotonic()
        self.text.append(s)
        return self.real.write(s)

    def flush(self):
        self.real.flush()


def once(w, nprocs: int, subgroup: bool, rng: random.Random) -> dict:
    missing = rng.randrange(nprocs)
    tee = _Tee(sys.stderr)
    sys.stderr = tee
    t0 = time.monotonic()
    try:
        w.run(skip_one, (missing, subgroup), timeout=TIMEOUT)
        raise SystemExit("the call did not time out")
    except mplaunch.WorkerError as exc:   # LaunchTimeout is one
        raised = time.monotonic()
        text = str(exc)
    finally:
        sys.stderr = tee.real
    deadline = t0 + TIMEOUT
    block = text[text.index(f"\nrank {missing}:\n"):] if f"\nrank {missing}:\n" in text \
        else ""
    return {"missing": missing, "subgroup": subgroup,
            "said_after_s": (tee.said_at - deadline) if tee.said_at else None,
            "raised_after_s": raised - deadline,
            "named_with_line": "# SKIPPED-HERE" in block.split("\nrank")[1]
            if block else False}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nprocs", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=41)
    ap.add_argument("--json")
    a = ap.parse_args()
    rng = random.Random(a.seed)
    rows = []
    with mplaunch.World(a.nprocs, backend="gloo") as w:
        w.start()   # the ranks' start-up is not the call's
        for _ in range(a.repeats):
            for subgroup in (False, True):
                rows.append(once(w, a.nprocs, subgroup, rng))
                print(rows[-1], file=sys.stderr, flush=True)
    print(f"| group | missing rank | said after the timeout | raised after | named "
          f"with its line |\n|---|---|---|---|---|")
    for r in rows:
        said = f"{r['said_after_s']:.2f} s" if r["said_after_s"] is not None else "-"
        print(f"| {'new_group' if r['subgroup'] else 'default'} | {r['missing']} | "
              f"{said} | {r['raised_after_s']:.2f} s | {r['named_with_line']} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
