"""Start-up of a process group, on an empty TCP table and on a busy one, mplaunch side by
side with torch spawn and torchrun's machinery (torch elastic's start_processes).

    python bench/startup.py                       # 4, 16, 64, 128 ranks; some minutes
    python bench/startup.py --quick               # 4 and 64 ranks, mplaunch alone
    python bench/startup.py --against ../old      # and another checkout, alternating
    python bench/startup.py --profile 64          # where a 64-rank launch spends its time

Cases: a launch of N ranks that each run init_process_group("gloo") + one all_reduce +
destroy_process_group (call -> return, warm server), and ``World(N, backend="gloo")`` to
its first ``run`` returning (warm server).

Table states. Every sample runs in a child interpreter in a network namespace of its own
(``unshare --net``, loopback only; the current namespace where that is refused, and the
report says so), so "empty" starts from no TCP socket at all; "busy" first leaves
10,000 TIME_WAIT sockets on loopback there (bench/_busy.py), what any machine that ran a
test suite holds. A launch's own gloo mesh adds to the table as on a real machine.

With ``--against DIR``, each sample of DIR's mplaunch (a checkout, e.g. a git worktree of
the commit before a change) alternates with this checkout's, in the same run. Nothing
here asserts a timing; the figures go into docs/performance.rst.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
BUSY = 10_000


def log(msg):
    print(msg, file=sys.stderr, flush=True)


# -- in the child --------------------------------------------------------------------------

def _child(case: str, n: int, state: str, repeats: int, launcher: str) -> dict:
    sys.path.insert(0, HERE)
    import _busy
    import _cases
    filled = _busy.fill_time_wait(BUSY) if state == "busy" else 0
    import torch  # noqa: F401 - what a user's script has imported before launching
    if launcher == "mplaunch":
        import mplaunch
        run = {"gloo": lambda: mplaunch.launch(_cases.gloo_allreduce, (), n),
               "world": lambda: _world_first_call(mplaunch, n)}[case]
        mplaunch.launch(int, (1,), 2)       # the server is warm, as after any first launch
    else:
        import baselines
        os.environ["OMP_NUM_THREADS"] = "1"
        launch = baselines.LAUNCHERS[launcher]
        run = lambda: launch(_cases.gloo_allreduce, n, ())  # noqa: E731
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        run()
        samples.append(time.perf_counter() - t0)
    out = {"samples": samples, "filled": filled, "time_wait_after": _busy.time_wait_count()}
    if launcher == "mplaunch":
        from mplaunch._engine import servers
        servers.shutdown_servers()
    return out


def _world_first_call(mplaunch, n):
    with mplaunch.World(n, backend="gloo") as world:
        world.run(int, args=(1,))


def _profile(n: int, state: str) -> None:
    """cProfile of one rank of a warm n-rank gloo launch (rank 0), printed."""
    sys.path.insert(0, HERE)
    import _busy
    import mplaunch
    if state == "busy":
        _busy.fill_time_wait(BUSY)
    mplaunch.launch(int, (1,), 2)
    out = mplaunch.launch(_profiled_rank, (), n)
    print(out[0])
    t0 = time.perf_counter()
    mplaunch.launch(_profiled_rank, (), n)
    print(f"whole launch of {n}: {time.perf_counter() - t0:.2f} s")


def _profiled_rank():
    import cProfile
    import io
    import pstats
    import time as t

    import torch
    import torch.distributed as dist
    prof = cProfile.Profile()
    start = t.perf_counter()
    prof.enable()
    dist.init_process_group("gloo")
    init = t.perf_counter() - start
    dist.all_reduce(torch.ones(4))
    dist.destroy_process_group()
    prof.disable()
    if dist.is_available() and int(os.environ["RANK"]) != 0:
        return None
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(18)
    return f"rank 0: init_process_group {init:.3f} s\n{s.getvalue()}"


# -- in the parent --------------------------------------------------------------------------

def _netns_prefix():
    if shutil.which("unshare") and subprocess.run(
            ["unshare", "--net", "true"], capture_output=True).returncode == 0:
        return ["unshare", "--net", "sh", "-c", 'ip link set lo up && exec "$@"', "sh"]
    return []


def _sample(tree, case, n, state, repeats, launcher, prefix):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([tree, HERE]), OMP_NUM_THREADS="1")
    cmd = prefix + [sys.executable, os.path.abspath(__file__), "--child",
                    json.dumps([case, n, state, repeats, launcher])]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"{launcher} {case} {n} {state} in {tree}: "
                           f"{done.stderr.strip()[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true",
                    help="4 and 64 ranks, mplaunch only, fewer samples")
    ap.add_argument("--sizes", default=None, help="comma-separated rank counts")
    ap.add_argument("--rounds", type=int, default=None, help="children per figure")
    ap.add_argument("--against", help="another checkout whose mplaunch alternates")
    ap.add_argument("--baselines", default=None,
                    help="comma-separated: tmp_spawn (torch spawn), elastic_spawn "
                         "(torchrun's start_processes); none with --quick")
    ap.add_argument("--no-world", action="store_true")
    ap.add_argument("--json")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--profile", type=int, metavar="N")
    ap.add_argument("--state", default="busy", choices=["empty", "busy"])
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(_child(*json.loads(args.child))))
        return
    if args.profile:
        _profile(args.profile, args.state)
        return
    sizes = [int(x) for x in (args.sizes or ("4,64" if args.quick else "4,16,64,128"))
             .split(",")]
    rounds = args.rounds or (1 if args.quick else 2)
    base = (args.baselines if args.baselines is not None
            else ("" if args.quick else "tmp_spawn,elastic_spawn"))
    baselines = [b for b in base.split(",") if b]
    trees = [("mplaunch", ROOT)] + ([("against", os.path.abspath(args.against))]
                                    if args.against else [])
    report = measure(sizes, rounds, trees, baselines, world=not args.no_world)
    print(f"\nstart-up, {report['machine']}, "
          f"{'a network namespace per sample' if report['netns'] else 'this network namespace'}\n")
    for row in report["rows"]:
        print(line(row, trees, baselines))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


def measure(sizes, rounds, trees=(("mplaunch", ROOT),), baselines=(), world=True):
    """Every figure, both table states: {"machine", "netns", "rows": [...]}, each row
    {"state", "case", "n", tree name: [seconds...], baseline: [seconds...]}."""
    prefix = _netns_prefix()
    report = {"machine": f"{platform.machine()}, {os.cpu_count()} cpus, "
                         f"python {platform.python_version()}",
              "netns": bool(prefix), "rows": []}
    cases = [("gloo", n) for n in sizes] + ([("world", n) for n in sizes if n >= 64]
                                            if world else [])
    for state in ("empty", "busy"):
        for case, n in cases:
            row = {"state": state, "case": case, "n": n}
            for _ in range(rounds):
                for name, tree in trees:
                    got = _sample(tree, case, n, state, 2 if n <= 16 else 1,
                                  "mplaunch", prefix)
                    row.setdefault(name, []).extend(got["samples"])
                    row.setdefault(name + "_tw", []).append(got["time_wait_after"])
            if case == "gloo":
                for b in baselines:
                    if n > 64:
                        continue      # minutes of interpreter starts on 2 cores
                    got = _sample(ROOT, case, n, state, 1, b, prefix)
                    row[b] = got["samples"]
            report["rows"].append(row)
            log(line(row, trees, baselines))
    return report


def line(row, trees=(("mplaunch", ROOT),), baselines=()):
    title = (f"launch {row['n']:3d} (init+all_reduce+destroy)" if row["case"] == "gloo"
             else f"World({row['n']}) first call")
    cells = []
    ours = statistics.median(row["mplaunch"])
    for name, _ in trees:
        cells.append(f"{name} {statistics.median(row[name]):.3f} s "
                     f"({min(row[name]):.3f}-{max(row[name]):.3f})")
    for b in baselines:
        if b in row:
            v = statistics.median(row[b])
            cells.append(f"{b} {v:.2f} s ({v / ours:.1f}x)")
    return f"{row['state']:5s} {title:38s} " + "; ".join(cells)


if __name__ == "__main__":
    main()
