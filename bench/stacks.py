"""Stacks on demand: how long ``handle.stacks()`` takes for 8 running ranks.

    python bench/stacks.py             # about half a minute on 2 cores
    python bench/stacks.py --json out.json

Two cases, each on 8 ranks started with ``mplaunch.start`` and left running:

1. gloo: torch.distributed initialised, seven ranks blocked in an ``all_reduce`` that
   the eighth never joins (each rank's collectives reporter answers, with the sequence
   number and the dump);
2. plain: ranks in ``time.sleep`` without torch.distributed (faulthandler answers the
   signal in C).

torch.multiprocessing and torch elastic offer no way to ask, so there is no side by side
here: the figure is the time to wait, against the issue's target of one second. The
ranks go on after each call (the last call checks that they all still run). Nothing here
asserts a timing.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import mplaunch  # noqa: E402

NPROCS = 8
REPEATS = 15


def lagging_all_reduce():
    import torch
    import torch.distributed as dist
    dist.init_process_group("gloo")
    t = torch.ones(1)
    dist.all_reduce(t)
    if dist.get_rank() == NPROCS - 1:
        time.sleep(600)
    dist.all_reduce(t)


def sleeps():
    time.sleep(600)


def measure(func, **options) -> dict:
    with mplaunch.start(func, nprocs=NPROCS, **options) as handle:
        time.sleep(5)  # every rank where it stays
        times = []
        for _ in range(REPEATS):
            t0 = time.perf_counter()
            stacks = handle.stacks()
            times.append(time.perf_counter() - t0)
            assert len(stacks) == NPROCS and not handle.done()
    return {"median_s": statistics.median(times), "max_s": max(times)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    args = parser.parse_args()
    results = {"gloo": measure(lagging_all_reduce),
               "plain": measure(sleeps, preload=())}
    for name, r in results.items():
        print(f"{name:6s} 8 ranks: median {r['median_s'] * 1000:.0f} ms, "
              f"max {r['max_s'] * 1000:.0f} ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
