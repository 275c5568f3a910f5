"""This checkout against another (the commit before a change), each in its own virtual
environment, in one run: ``bench/run.py --quick`` and ``bench/inputs.py --quick``,
alternating between the two, round by round (each round in the other order), on a
machine whose TCP table holds thousands of TIME_WAIT sockets (made first, as a machine
that ran a test suite holds).

    git worktree add ../before <commit>
    (cd ../before && python3 -m venv .venv && . .venv/bin/activate &&
     pip install torch==2.13.0 && pip install -e . numpy psutil)
    python bench/versions.py --before ../before [--rounds 3]

Each checkout's benchmarks run with its own interpreter (DIR/.venv/bin/python; this
one's: the running interpreter) and its own bench/ scripts, so each measures itself.
The report gives, per figure, the median over the rounds of each side and their
ratio. Nothing here asserts a timing.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from _busy import fill_time_wait, time_wait_count  # noqa: E402


def _figures_run(d: dict) -> dict:
    """The figures of one bench/run.py --json report that a change could move."""
    out = {}
    for case, v in d["latency"]["mplaunch"].items():
        out[f"latency {case} (s)"] = v["median"]
    out["return 2 x 16 MiB tensors (s)"] = d["tensors"]["return_s"]
    for n in ("4", "64"):
        out[f"launch {n} ranks, trivial fn (s)"] = d["scale"]["seconds"][n]
    out["server RSS (MB)"] = d["memory"]["server_rss_mb"]
    out["rank USS (MB)"] = d["memory"]["rank_uss_mb"]
    for row in d["startup"]["rows"]:
        out[f"{row['state']} {row['case']} {row['n']} first call (s)"] = \
            statistics.median(row["mplaunch"])
    return out


def _figures_inputs(d: dict) -> dict:
    """The figures of one bench/inputs.py --json report: a launch's input, and a
    World's three calls on it (argument, global)."""
    out = {}
    for row in d["cases"]:
        if "first" in row:
            key = f"launch, {row['mib']} MiB input to {row['nprocs']} ranks"
            out[f"{key}: first read (s)"] = row["first"]
            out[f"{key}: all read (s)"] = row["all"]
            out[f"{key}: summed PSS (GiB)"] = row["pss"] / (1 << 30)
    for w in d["world"]:
        for i, c in enumerate(w["calls"]):
            key = f"World(4), {w['mib']} MiB as {w['how']}, call {i + 1}"
            out[f"{key}: call (s)"] = c["call"]
            out[f"{key}: peak PSS (GiB)"] = c["peak_pss"] / (1 << 30)
    return out


def _run(python: str, checkout: str, script: str, args: list) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        path = f.name
    try:
        subprocess.run([python, os.path.join(checkout, "bench", script), *args,
                        "--json", path], cwd=checkout, check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        with open(path) as f:
            return json.load(f)
    finally:
        os.unlink(path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", required=True, help="the other checkout (with .venv)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--time-wait", type=int, default=5000)
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    sides = {"this": (sys.executable, os.path.dirname(HERE)),
             "before": (os.path.join(a.before, ".venv", "bin", "python"),
                        os.path.abspath(a.before))}
    got = {side: [] for side in sides}
    for r in range(a.rounds):
        # Each round in the other order: whichever side runs first in a round was the
        # slower one (World(64)'s first call, bench/startup.py run both ways round), so
        # a fixed order biased every figure against it.
        order = list(sides.items())
        for side, (python, checkout) in (order if r % 2 == 0 else order[::-1]):
            fill_time_wait(a.time_wait)
            print(f"round {r + 1}, {side}: {time_wait_count()} TIME_WAIT sockets",
                  file=sys.stderr, flush=True)
            figures = _figures_run(_run(python, checkout, "run.py",
                                        ["--quick", "--launchers", "mplaunch"]))
            figures.update(_figures_inputs(_run(
                python, checkout, "inputs.py", ["--quick", "--launchers", "mplaunch"])))
            got[side].append(figures)
    keys = [k for k in got["this"][0] if all(k in f for fs in got.values() for f in fs)]
    print(f"\nthis checkout against {a.before}, {a.rounds} rounds alternating, "
          f"{os.cpu_count()} cpus; medians over rounds\n")
    print("| figure | this | before | this / before |\n|---|---|---|---|")
    table = {}
    for k in keys:
        this = statistics.median(f[k] for f in got["this"])
        before = statistics.median(f[k] for f in got["before"])
        table[k] = (this, before)
        ratio = f"{this / before:.2f}" if before else "-"
        print(f"| {k} | {this:.4g} | {before:.4g} | {ratio} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"rounds": got, "medians": table}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
