"""mplaunch.World and mplaunch.start, side by side with what one would use instead.

    python bench/world.py              # about a minute on 2 cores
    python bench/world.py --quick      # fewer repeats
    python bench/world.py --json out.json

1. A call on warm ranks: ``world.run`` of a trivial function on 4 ranks that are already
   up (the median is the per-call overhead: the function itself does nothing), against
   ``mplaunch.launch`` of the same function (new ranks each time, warm server) and, once,
   ``torch.multiprocessing.spawn``.
2. Returning while ranks run: how long ``mplaunch.start`` takes to return a handle on a
   warm server (every rank has a pid), against ``torch.multiprocessing.start_processes(
   join=False)`` (spawn and forkserver) and torch elastic's ``start_processes`` (spawn).
   The ranks sleep; each launch is torn down, untimed, before the next.

Every ratio is from this one run, on this machine. Nothing here asserts a timing.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import baselines  # noqa: E402  (imports torch, as a user's script would)
import _cases  # noqa: E402
import mplaunch  # noqa: E402
from mplaunch._engine import servers as _procs  # noqa: E402

NPROCS = 4
SLEEP = 60.0  # the ranks of part 2 sleep; each launch is stopped long before


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def _timed(fn):
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _summary(samples):
    s = sorted(samples)
    return {"median": statistics.median(s), "p90": s[int(0.9 * (len(s) - 1))],
            "min": s[0], "n": len(s)}


# -- 1. a call on warm ranks --------------------------------------------------------------

def warm_calls(calls, launches):
    out = {}
    with mplaunch.World(NPROCS) as world:
        for _ in range(20):  # warm: the ranks are up, the first calls paid for imports
            world.run(_cases.trivial)
        samples = [_timed(lambda: world.run(_cases.trivial)) for _ in range(calls)]
    out["world.run"] = _summary(samples)
    log(f"  world.run: {out['world.run']['median'] * 1000:.2f} ms")
    mplaunch.launch(_cases.trivial, nprocs=NPROCS)  # warm server
    samples = [_timed(lambda: mplaunch.launch(_cases.trivial, nprocs=NPROCS))
               for _ in range(launches)]
    out["mplaunch.launch"] = _summary(samples)
    log(f"  launch: {out['mplaunch.launch']['median'] * 1000:.1f} ms")
    t = _timed(lambda: baselines.launch_tmp_spawn(_cases.trivial, NPROCS))
    out["torch.multiprocessing.spawn"] = _summary([t])
    log(f"  tmp.spawn: {t * 1000:.0f} ms")
    baselines.shutdown_helpers()
    return out


# -- 2. returning while the ranks run ------------------------------------------------------

def start_mplaunch():
    t0 = time.perf_counter()
    handle = mplaunch.start(time.sleep, (SLEEP,), NPROCS)
    t = time.perf_counter() - t0
    assert len(handle.pids) == NPROCS and not handle.done()
    handle.stop(grace_period=0)
    return t


def _start_tmp(method):
    import torch.multiprocessing as tmp

    def one():
        port = baselines.free_port()
        with baselines._private_tempdir():
            t0 = time.perf_counter()
            ctx = tmp.start_processes(_cases.tmp_entry,
                                      args=(NPROCS, port, time.sleep, (SLEEP,)),
                                      nprocs=NPROCS, join=False, start_method=method)
            t = time.perf_counter() - t0
            for p in ctx.processes:
                p.kill()
            for p in ctx.processes:
                p.join()
        return t
    return one


def start_elastic():
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.elastic.multiprocessing import start_processes
    port = baselines.free_port()
    with baselines._private_tempdir() as log_dir:
        t0 = time.perf_counter()
        pc = start_processes(
            name="bench", entrypoint=time.sleep,
            args={r: (SLEEP,) for r in range(NPROCS)},
            envs={r: _cases.rank_env(r, NPROCS, port) for r in range(NPROCS)},
            logs_specs=DefaultLogsSpecs(log_dir=log_dir, redirects=Std.NONE,
                                        tee=Std.NONE),
            start_method="spawn")
        t = time.perf_counter() - t0
        pc.close(death_sig=__import__("signal").SIGKILL)
    return t


STARTERS = {
    "mplaunch.start": start_mplaunch,
    "torch.multiprocessing.start_processes(join=False, spawn)": _start_tmp("spawn"),
    "torch.multiprocessing.start_processes(join=False, forkserver)":
        _start_tmp("forkserver"),
    "torch elastic start_processes (spawn)": start_elastic,
}


def returning(repeats):
    out = {name: [] for name in STARTERS}
    start_mplaunch()  # warm server
    _start_tmp("forkserver")()  # warm torch's forkserver too: warm against warm
    for _ in range(repeats):  # in turns, so background load hits every launcher alike
        for name, fn in STARTERS.items():
            out[name].append(fn())
    baselines.shutdown_helpers()
    result = {name: _summary(s) for name, s in out.items()}
    for name, r in result.items():
        log(f"  {name}: {r['median'] * 1000:.1f} ms")
    return result


def _table(results, ours, unit_ms_digits=1):
    base = results[ours]["median"]
    lines = []
    for name, r in results.items():
        ratio = "" if name == ours else f"  ({r['median'] / base:.1f}x {ours})"
        lines.append(f"  {name:62s} median {r['median'] * 1000:8.{unit_ms_digits}f} ms"
                     f"  p90 {r['p90'] * 1000:8.{unit_ms_digits}f} ms  n={r['n']}{ratio}")
    return "\n".join(lines)


def main(argv=None):
    # elastic logs a warning per rank it closes; the figures are what matter here
    logging.getLogger("torch.distributed.elastic").setLevel(logging.ERROR)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer repeats")
    ap.add_argument("--json", help="also write every figure to this file")
    args = ap.parse_args(argv)
    calls, launches, repeats = (100, 5, 3) if args.quick else (500, 15, 7)
    report = {"machine": f"{platform.machine()}, {os.cpu_count()} cpus, "
                         f"python {platform.python_version()}",
              "torch": __import__("torch").__version__, "mplaunch": mplaunch.__version__,
              "loadavg_before": os.getloadavg()}
    log(f"1. a call on {NPROCS} warm ranks:")
    report["warm_calls"] = warm_calls(calls, launches)
    log(f"2. returning while {NPROCS} ranks run:")
    report["returning"] = returning(repeats)
    report["loadavg_after"] = os.getloadavg()
    _procs.shutdown_servers()

    print(f"\nmplaunch {report['mplaunch']} / torch {report['torch']} / {report['machine']}"
          f" / load average {report['loadavg_before'][0]:.1f} before, "
          f"{report['loadavg_after'][0]:.1f} after")
    print(f"\n1. a trivial function on {NPROCS} ranks, per call (world.run: ranks already "
          "up; the others start them):")
    print(_table(report["warm_calls"], "world.run", 2))
    print(f"\n2. from the call to a handle on {NPROCS} running ranks (warm servers):")
    print(_table(report["returning"], "mplaunch.start"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
