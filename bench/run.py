"""The whole benchmark suite, mplaunch side by side with what users would use instead.

    python bench/run.py              # a few minutes on 2 cores
    python bench/run.py --quick      # fewer repeats, smaller sizes
    python bench/run.py --json out.json

Every ratio is measured in this one run, on this machine: launchers take turns case by
case, so background load affects all of them alike. Nothing here is a test; the figures
go into docs/performance.rst.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import psutil  # noqa: E402

import baselines  # noqa: E402  (imports torch, as a user's training script would)
import mplaunch  # noqa: E402
from mplaunch._engine import servers as _procs  # noqa: E402

CASES = ["gloo4", "trivial2", "fail_teardown"]
CASE_TITLES = {
    "gloo4": "4 ranks, gloo all_reduce: call -> return",
    "trivial2": "2 ranks, trivial fn: per launch",
    "fail_teardown": "rank raises, others in barrier: raise -> call returns",
}


def launch_mplaunch(fn, nprocs, args=()):
    mplaunch.launch(fn, tuple(args), nprocs)


LAUNCHERS = {"mplaunch": launch_mplaunch, **baselines.LAUNCHERS}


def log(msg):
    print(msg, file=sys.stderr, flush=True)


# -- latency: the table ---------------------------------------------------------

def latency(repeats, launchers):
    results = {name: {} for name in launchers}
    for case in CASES:
        for name in launchers:
            if name == "mplaunch":
                # cold = the first launch of a fresh process: the server starts and
                # imports torch; everything after is warm
                _procs.shutdown_servers()
            else:
                baselines.shutdown_helpers()
            log(f"  {case:14s} {name}")
            try:
                results[name][case] = baselines.time_case(LAUNCHERS[name], case, repeats)
            except Exception as exc:  # noqa: BLE001 - report, carry on
                results[name][case] = {"error": f"{type(exc).__name__}: {exc}"}
    baselines.shutdown_helpers()
    return results


def format_latency(results):
    lines = ["| launcher | " + " | ".join(CASE_TITLES[c] for c in CASES) + " |",
             "|---|" + "---|" * len(CASES)]
    ours = results["mplaunch"]
    for name, cases in results.items():
        cells = []
        for case in CASES:
            r = cases.get(case, {})
            if "median" not in r:
                cells.append("error")
                continue
            cell = f"{r['median'] * 1000:.0f} ms"
            if case == "gloo4":
                cell += f" (cold {r['cold']:.2f} s)"
            if name != "mplaunch" and "median" in ours.get(case, {}):
                cell += f", {r['median'] / ours[case]['median']:.1f}x mplaunch"
            cells.append(cell)
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# -- return values through shared memory ------------------------------------------------

def big_tensor(mib):
    import torch
    t = torch.full((mib * (1 << 20) // 4,), float(os.environ["RANK"]), dtype=torch.float32)
    return t, time.time()  # the moment the rank hands its value back


def tensors(repeats, mib):
    """From the last rank returning its tensor to the values being in the parent: what
    the return path costs, without the rank's own work of building the tensor."""
    def shm_entries():
        try:
            return set(os.listdir("/dev/shm"))
        except OSError:
            return set()

    before = shm_entries()
    mplaunch.launch(int, (1,), 2)  # warm
    samples = []
    for _ in range(repeats):
        out = mplaunch.launch(big_tensor, (mib,), 2)
        end = time.time()
        samples.append(end - max(stamp for _, stamp in out))
        assert out[1][0][0].item() == 1.0 and out[1][0].numel() * 4 == mib << 20
        del out
    leaked = [n for n in shm_entries() - before if "torch" in n or "mplaunch" in n]
    t = statistics.median(samples)
    total = 2 * mib / 1024
    return {"mib_per_rank": mib, "return_s": t, "gb_per_s": total / t,
            "leaked_shm": sorted(leaked)}


def _timed(fn):
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


# -- scale ------------------------------------------------------------------------------

def scale(sizes, repeats):
    out = {}
    for n in sizes:
        mplaunch.launch(int, (1,), n)  # warm for this size
        out[n] = statistics.median(_timed(lambda: mplaunch.launch(int, (1,), n))
                                   for _ in range(repeats))
        log(f"  {n:3d} ranks: {out[n] * 1000:.0f} ms")
    xs, ys = list(out), list(out.values())
    mx, my = statistics.mean(xs), statistics.mean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    intercept = my - slope * mx
    resid = max(abs(y - (intercept + slope * x)) for x, y in zip(xs, ys))
    return {"seconds": out, "ms_per_rank": slope * 1000, "intercept_ms": intercept * 1000,
            "max_residual_ms": resid * 1000}


# -- memory -----------------------------------------------------------------------------

def rank_memory():
    import torch  # noqa: F401 - what a real rank has
    info = psutil.Process().memory_full_info()
    return {"rss": info.rss, "uss": info.uss}


def memory():
    mplaunch.launch(int, (1,), 2)
    server = psutil.Process(_procs.server_pids()[0]).memory_full_info()
    ranks = mplaunch.launch(rank_memory, nprocs=4)
    mb = 1 << 20
    return {"server_rss_mb": server.rss / mb, "server_uss_mb": server.uss / mb,
            "rank_rss_mb": statistics.median(r["rss"] for r in ranks) / mb,
            "rank_uss_mb": statistics.median(r["uss"] for r in ranks) / mb}


# -- relay ------------------------------------------------------------------------------

def relay(mb):
    import relay as relay_bench
    return relay_bench.run(total_mb=mb)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--quick", action="store_true", help="3 repeats, smaller sizes")
    ap.add_argument("--launchers", default=",".join(LAUNCHERS))
    ap.add_argument("--json", help="also write every figure to this file")
    args = ap.parse_args(argv)
    repeats = 3 if args.quick else args.repeats
    launchers = [n for n in args.launchers.split(",") if n]
    report = {"machine": f"{platform.machine()}, {os.cpu_count()} cpus, "
                         f"python {platform.python_version()}",
              "torch": __import__("torch").__version__, "mplaunch": mplaunch.__version__}
    log("latency (medians of warm runs; cold = first launch):")
    report["latency"] = latency(repeats, launchers)
    log("tensors:")
    report["tensors"] = tensors(repeats, 16 if args.quick else 64)
    log("scale:")
    report["scale"] = scale([2, 4, 8, 16, 32, 64], max(2, repeats // 2))
    log("memory:")
    report["memory"] = memory()
    log("start-up, empty and busy TCP table (bench/startup.py):")
    import startup
    report["startup"] = startup.measure([4, 64] if args.quick else [4, 16, 64], 1)
    log("relay:")
    try:
        report["relay"] = relay(100 if args.quick else 400)
    except Exception as exc:  # noqa: BLE001
        report["relay"] = {"error": f"{type(exc).__name__}: {exc}"}
    _procs.shutdown_servers()

    print(f"\nmplaunch {report['mplaunch']} / torch {report['torch']} / {report['machine']}\n")
    print(format_latency(report["latency"]))
    t = report["tensors"]
    print(f"\nreturn values: 2 ranks x {t['mib_per_rank']} MiB tensors: {t['gb_per_s']:.2f} "
          f"GB/s from the ranks returning to launch returning ({t['return_s'] * 1000:.0f} ms);"
          f" leaked shared-memory entries: {len(t['leaked_shm'])}")
    s = report["scale"]
    print("\nscale (trivial fn, warm): " + ", ".join(
        f"{n} ranks {v * 1000:.0f} ms" for n, v in s["seconds"].items()))
    print(f"  linear fit: {s['intercept_ms']:.1f} ms + {s['ms_per_rank']:.2f} ms/rank "
          f"(largest deviation {s['max_residual_ms']:.0f} ms)")
    m = report["memory"]
    print(f"\nmemory: forkserver RSS {m['server_rss_mb']:.0f} MB; each rank (torch imported) "
          f"RSS {m['rank_rss_mb']:.0f} MB of which unique {m['rank_uss_mb']:.1f} MB")
    print("\nstart-up of a process group, empty and busy table (10,000 TIME_WAIT sockets):")
    for row in report["startup"]["rows"]:
        print("  " + startup.line(row))
    r = report["relay"]
    if "error" in r:
        print(f"\nrelay: {r['error']}")
    else:
        print(f"\nrelay: {json.dumps(r)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1, default=str)


if __name__ == "__main__":
    main()
