"""What importing mplaunch costs, and what a rank's own children import.

    python bench/imports.py                 # about 30 s on 2 cores
    python bench/imports.py --runs 31 --json out.json
    PYTHONPATH=/path/to/other/checkout python bench/imports.py   # another version

1. ``import mplaunch`` against a bare interpreter, and ``import pytest,
   mplaunch.pytest_plugin`` (what every pytest session pays once mplaunch is installed,
   since the plugin is an entry point) against ``import pytest``. Each figure is the
   median wall time of fresh interpreters started one after the other, alternating, so
   that a slow moment of the machine hits every variant alike; reported as ratios.
2. How many mplaunch modules a spawn child of a rank (a DataLoader or Pool worker)
   imports to rebuild its ``__main__``, and which.

Every ratio is from this one run, on this machine. Nothing here asserts a timing.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))

VARIANTS = {
    "bare": "pass",
    "mplaunch": "import mplaunch",
    "pytest": "import pytest",
    "pytest+plugin": "import pytest, mplaunch.pytest_plugin",
}

CHILD_PROBE = r"""
import json, multiprocessing as mp, sys
import mplaunch

def child(q):
    q.put(sorted(m for m in sys.modules if m == "mplaunch" or m.startswith("mplaunch.")))

def rank():
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=child, args=(q,))
    p.start()
    mods = q.get(timeout=120)
    p.join()
    return mods

if __name__ == "__main__":
    print(json.dumps(mplaunch.launch(rank, nprocs=1, preload=())[0]))
"""


def _env():
    env = dict(os.environ)
    root = env.get("PYTHONPATH") or os.path.dirname(HERE)
    env["PYTHONPATH"] = root
    return env


def time_imports(runs: int) -> dict:
    env = _env()
    samples = {name: [] for name in VARIANTS}
    for _ in range(runs):
        for name, code in VARIANTS.items():
            t0 = time.perf_counter()
            # From a directory with no mplaunch in it: `-c` puts the current directory
            # first on sys.path, and PYTHONPATH must decide which copy is measured.
            subprocess.run([sys.executable, "-c", code], env=env, check=True, cwd="/")
            samples[name].append(time.perf_counter() - t0)
    med = {name: statistics.median(s) for name, s in samples.items()}
    return {
        "median_s": med,
        "mplaunch_over_bare": med["mplaunch"] / med["bare"],
        "mplaunch_minus_bare_ms": (med["mplaunch"] - med["bare"]) * 1e3,
        "plugin_over_pytest": med["pytest+plugin"] / med["pytest"],
        "plugin_minus_pytest_ms": (med["pytest+plugin"] - med["pytest"]) * 1e3,
    }


def child_modules() -> list:
    out = subprocess.run([sys.executable, "-c", CHILD_PROBE], env=_env(), check=True,
                         capture_output=True, text=True, timeout=300, cwd="/")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=15)
    ap.add_argument("--json")
    ns = ap.parse_args()
    result = time_imports(ns.runs)
    mods = child_modules()
    result["rank_child_modules"] = mods
    med = result["median_s"]
    print(f"import mplaunch: {med['mplaunch'] * 1e3:.0f} ms, bare interpreter "
          f"{med['bare'] * 1e3:.0f} ms: {result['mplaunch_over_bare']:.2f}x "
          f"(+{result['mplaunch_minus_bare_ms']:.0f} ms)")
    print(f"import pytest, mplaunch.pytest_plugin: {med['pytest+plugin'] * 1e3:.0f} ms, "
          f"import pytest {med['pytest'] * 1e3:.0f} ms: {result['plugin_over_pytest']:.2f}x "
          f"(+{result['plugin_minus_pytest_ms']:.0f} ms)")
    print(f"a rank's spawn child imports {len(mods)} mplaunch modules: {', '.join(mods)}")
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
