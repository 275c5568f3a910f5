"""The frameworks researchers run, each scenario under mplaunch's watcher and under
torchrun, side by side in one run: wall time of the whole command (interpreter start,
framework import, training, teardown), median of ``repeats`` runs, alternating the two
launchers so that drift on the machine hits both alike.

Scenarios (the same scripts the tests run, tests/frameworks/):
  lightning      Trainer(strategy="ddp") on CPU, 2 epochs of a small model
  transformers   Trainer on a tiny BERT built from a config, 4 steps
  accelerate:*   accelerate's own distributed test scripts that run on CPU

    python bench/frameworks.py [--nprocs 2] [--repeats 3] [--only lightning,...]
                               [--json out.json]

Prints one line per scenario: both medians and the ratio torchrun / mplaunch (above 1:
mplaunch is faster). A scenario whose command fails under either launcher is reported as
failed, not timed.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
FRAMEWORKS = os.path.join(ROOT, "tests", "frameworks")
# run distributed on CPU with ACCELERATE_USE_CPU=1 (tests/test_frameworks.py says why)
ACCELERATE_SCRIPTS = ["test_ops", "test_script", "test_sync", "test_cli"]
LAUNCHER_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                 "MASTER_PORT", "TORCHELASTIC_RUN_ID")


def scenarios(tmp):
    out = {}
    if importlib.util.find_spec("pytorch_lightning"):
        out["lightning"] = [os.path.join(FRAMEWORKS, "lightning_job.py")]
    if importlib.util.find_spec("transformers"):
        out["transformers"] = [os.path.join(FRAMEWORKS, "transformers_job.py"),
                               os.path.join(tmp, "hf")]
    if importlib.util.find_spec("accelerate"):
        for name in ACCELERATE_SCRIPTS:
            spec = importlib.util.find_spec("accelerate.test_utils.scripts." + name)
            out["accelerate:" + name] = [spec.origin]
    return out


def command(launcher, nprocs, script_args):
    module = "mplaunch" if launcher == "mplaunch" else "torch.distributed.run"
    return [sys.executable, "-m", module, "--nproc-per-node", str(nprocs), *script_args]


def timed(cmd, tmp):
    cwd = tempfile.mkdtemp(dir=tmp)   # accelerate's scripts write files in their cwd
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
    env["ACCELERATE_USE_CPU"] = "1"   # as `accelerate launch --cpu`: CPU ranks are distributed
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=cwd, env=env, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True, timeout=600)
    elapsed = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}:\n"
                           f"{proc.stderr[-1500:]}")
    return elapsed


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nprocs", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--only", default="")
    p.add_argument("--json")
    a = p.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        todo = scenarios(tmp)
        if a.only:
            todo = {k: v for k, v in todo.items() if k in a.only.split(",")}
        print(f"{'scenario':<30} {'mplaunch s':>10} {'torchrun s':>10} {'ratio':>6}")
        for name, script_args in todo.items():
            times = {"mplaunch": [], "torchrun": []}
            try:
                for _ in range(a.repeats):
                    for launcher in times:
                        times[launcher].append(timed(command(launcher, a.nprocs,
                                                             script_args), tmp))
            except (RuntimeError, subprocess.TimeoutExpired) as exc:
                print(f"{name:<30} failed: {str(exc).splitlines()[0]}")
                results[name] = {"failed": str(exc)}
                continue
            med = {k: statistics.median(v) for k, v in times.items()}
            ratio = med["torchrun"] / med["mplaunch"]
            results[name] = {"runs": times, "median": med, "ratio": ratio}
            print(f"{name:<30} {med['mplaunch']:>10.2f} {med['torchrun']:>10.2f} "
                  f"{ratio:>6.2f}", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
