"""Does the straggler report name the rank the others wait for, and what does recording
cost? (issue 41)

Trials: a World of N ranks (gloo) holds a DDP model; each trial is one call of STEPS
training steps in which one rank, chosen at random, is slow: 150 ms of sleep in a
backward hook, or a DataLoader (num_workers=0) whose items take 150 ms in that rank.
The trial counts as found when ``world.report().named`` is that rank. Clean runs: the
same call with nobody slowed; they count as right when nobody is named.

Overhead: per-step time of the same DDP loop with the Flight Recorder on (torch's
default; mplaunch reads it after each call of a second or more) and off
(``TORCH_FR_BUFFER_SIZE=0``, so mplaunch reads nothing), in two Worlds that take turns
call by call, in one run.

    python bench/stragglers.py [--sizes 4,8] [--trials 20] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import mplaunch  # noqa: E402

STEPS = 10
CALL_STEPS = 60
DELAY = 0.15


def build(width: int = 512):
    global model, data
    import torch
    from torch.nn.parallel import DistributedDataParallel
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Sequential(
        torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, width)))
    data = torch.randn(32, width)


class _Items:
    def __init__(self, slow: bool, n: int):
        self.slow, self.n = slow, n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if self.slow:
            time.sleep(DELAY)
        return data


def train(steps: int, slow: int, how: str):
    """`steps` steps; rank `slow` (-1: none) slowed by `how` ("hook" or "loader");
    the per-step times."""
    import torch.distributed as dist
    from torch.utils.data import DataLoader
    me = dist.get_rank()
    hook = None
    if me == slow and how == "hook":
        hook = model.module[0].weight.register_hook(lambda g: (time.sleep(DELAY), g)[1])
    loader = DataLoader(_Items(me == slow and how == "loader", steps), batch_size=None,
                        num_workers=0)
    times = []
    for x in loader:
        t0 = time.perf_counter()
        model(x).sum().backward()
        times.append(time.perf_counter() - t0)
    if hook is not None:
        hook.remove()
    return times


def trials(size: int, count: int, rng: random.Random) -> dict:
    out = {}
    with mplaunch.World(size, backend="gloo") as w:
        w.run(build)
        for how in ("hook", "loader"):
            found, wrong, none = 0, 0, 0
            for _ in range(count):
                slow = rng.randrange(size)
                w.run(train, (STEPS, slow, how))
                report = w.report()
                named = report.named
                if named != slow:
                    print(f"slow rank {slow}, {how}: the report said\n{report}",
                          file=sys.stderr, flush=True)
                found += named == slow
                wrong += named is not None and named != slow
                none += named is None
            out[how] = {"found": found, "wrong": wrong, "none": none, "of": count}
            print(f"{size} ranks, {how}: named the slow rank in {found}/{count} "
                  f"(another rank {wrong}, nobody {none})", file=sys.stderr, flush=True)
        clean = 0
        for _ in range(count):
            w.run(train, (STEPS, -1, "hook"))
            report = w.report()
            clean += report.named is None
            if report.named is not None:
                print(f"nobody slowed: the report said\n{report}", file=sys.stderr,
                      flush=True)
        out["clean"] = {"nobody": clean, "of": count}
        print(f"{size} ranks, nobody slowed: nobody named in {clean}/{count}",
              file=sys.stderr, flush=True)
    return out


def overhead(size: int, rounds: int) -> dict:
    """Median per-step time, recorder on and off, Worlds taking turns: inside the loop,
    and of whole calls (each over a second, so that the ranks read their recorder and
    send its records with the answer: the recorder's whole cost). Two Worlds alike
    differ by a few percent, and a pair of them keeps its difference for its life (seen
    here: 2.7% with the recorder on in both; one pair for 16 rounds read 4.4%, another
    0.3%), so each pair of Worlds runs two rounds only, a fresh pair for the next two,
    made and run in the other order."""
    steps = {"on": [], "off": []}
    calls = {"on": [], "off": []}
    envs = {"on": {}, "off": {"TORCH_FR_BUFFER_SIZE": "0"}}
    for pair in range(max(1, rounds // 2)):
        order = ("on", "off") if pair % 2 == 0 else ("off", "on")
        worlds = {name: mplaunch.World(size, backend="gloo", env=envs[name])
                  for name in order}
        try:
            for w in worlds.values():
                w.run(build)
                w.run(train, (5, -1, "hook"))   # warm
            for i in range(2):
                for name in (order if i == 0 else order[::-1]):
                    t0 = time.perf_counter()
                    per_rank = worlds[name].run(train, (CALL_STEPS, -1, "hook"))
                    calls[name].append((time.perf_counter() - t0) / CALL_STEPS)
                    steps[name].append(statistics.median(
                        statistics.median(t) for t in per_rank))
        finally:
            for w in worlds.values():
                w.close()
    # ratios of the rounds' pairs (this machine's step time drifts by more than the
    # difference sought, from one round to the next), then their median
    med = {k: statistics.median(v) for k, v in steps.items()}
    call = {k: statistics.median(v) for k, v in calls.items()}
    return {"step_on_s": med["on"], "step_off_s": med["off"],
            "ratio": statistics.median(a / b for a, b in zip(steps["on"], steps["off"])),
            "call_step_on_s": call["on"], "call_step_off_s": call["off"],
            "call_ratio": statistics.median(a / b for a, b in zip(calls["on"],
                                                                  calls["off"]))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="4,8")
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--seed", type=int, default=41)
    ap.add_argument("--json")
    ap.add_argument("--picture", metavar="SVG",
                    help="only draw one 4-rank run, rank 2 slowed in its backward "
                         "(docs/_static/stragglers.svg), and write its trace beside it")
    a = ap.parse_args()
    rng = random.Random(a.seed)
    if a.picture:
        with mplaunch.World(4, backend="gloo") as w:
            w.run(build)
            w.run(train, (STEPS, 2, "hook"))
            report = w.report()
        html = report._repr_html_()
        with open(a.picture, "w") as f:
            f.write(html[html.index("<svg"):])
        report.trace(os.path.splitext(a.picture)[0] + ".json")
        print(report)
        return
    result = {}
    for size in [int(s) for s in a.sizes.split(",")]:
        result[size] = trials(size, a.trials, rng)
        result[size]["overhead"] = overhead(size, a.rounds)
    print("| ranks | slowed by | named right | another | nobody | clean: nobody named "
          "| step on / off (in the loop) | step on / off (whole calls) |")
    print("|---|---|---|---|---|---|---|---|")
    for size, r in result.items():
        o = r["overhead"]
        for how in ("hook", "loader"):
            t = r[how]
            print(f"| {size} | {how} | {t['found']}/{t['of']} | {t['wrong']} | {t['none']} "
                  f"| {r['clean']['nobody']}/{r['clean']['of']} | "
                  f"{o['step_on_s'] * 1e3:.1f} / {o['step_off_s'] * 1e3:.1f} ms "
                  f"({o['ratio']:.3f}) | {o['call_step_on_s'] * 1e3:.1f} / "
                  f"{o['call_step_off_s'] * 1e3:.1f} ms ({o['call_ratio']:.3f}) |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
