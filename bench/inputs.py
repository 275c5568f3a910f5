"""What a large input costs: a tensor sent to N ranks, by each launcher, side by side.

    python bench/inputs.py [--quick] [--sizes 256,1024,4096] [--nprocs 2,4,8]
                           [--launchers mplaunch,tmp_spawn,elastic_forkserver,accelerate]
                           [--before /path/to/older/checkout] [--json out.json]

Launchers (what one writes without mplaunch, the input as an argument each time):

  mplaunch             mplaunch.launch(work, (t, sync), n): its warm server, as in real use
  tmp_spawn            torch.multiprocessing.spawn(work, args=(t, sync), nprocs=n)
  elastic_forkserver   torch.distributed.elastic.multiprocessing.start_processes(...,
                       start_method="forkserver"), its forkserver warmed by a first run
  accelerate           accelerate's notebook_launcher(work, (t, sync), num_processes=n):
                       forked ranks (copy-on-write pages of the caller)
  before               --before PATH: mplaunch from another checkout (e.g. one exported
                       with ``git archive``), to compare versions

Each measure runs in a fresh interpreter that makes ``t = torch.rand(size)`` (every page
touched) and launches. Every rank reads one element (the figure "first read": from the
call to the last rank's read), then the whole input ("all read"), then says it is ready
and waits; meanwhile this process reads /proc/PID/smaps_rollup of itself and of every
process below it (servers, forkservers, ranks): the summed PSS, and each rank's USS
(Private_Clean + Private_Dirty). "copies" is the summed PSS less that of the same
launch with a one-element input, in units of the input: the copies of it on the
machine. A case whose estimated peak memory would not fit in 80% of MemAvailable is
skipped, and said so.

Last, a World(4) runs the same function three times on the same tensor (mplaunch only),
two ways side by side: as an argument (``world.run(f, (t,))``), and as a global of
``__main__`` that the function reads (``t`` made at the top of a script or in a
notebook cell, ``def f(): ... t ...``; ``world.run(f)``). Per call: the time to the
last rank's first and full read, the peak of the summed PSS of this process and every
process below it while the call ran, the largest rank USS seen meanwhile, and after the
call the largest rank USS and the ranks' summed PSS (what they hold between calls).
``--world-only`` runs these alone.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time

MIB = 1 << 20
GIB = 1 << 30
LAUNCHERS = ("mplaunch", "tmp_spawn", "elastic_forkserver", "accelerate")


# -- in the ranks -----------------------------------------------------------------------

def work(t, sync, rank=None):
    """Read one element, then all of it; say so; wait until measured."""
    if rank is None:
        rank = int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0")))
    first = float(t.reshape(-1)[0])
    t_first = time.time()
    total = float(t.sum())
    t_all = time.time()
    path = os.path.join(sync, f"ready.{rank}")
    with open(path + ".tmp", "w") as f:
        json.dump({"first": t_first, "all": t_all, "pid": os.getpid(),
                   "sum": total + 0 * first}, f)
    os.rename(path + ".tmp", path)
    go = os.path.join(sync, "go")
    while not os.path.exists(go):
        time.sleep(0.005)
    return total


def work_spawn(i, t, sync):
    return work(t, sync, rank=i)


def world_work(t):
    first = float(t.reshape(-1)[0])
    t_first = time.time()
    float(t.sum()) + first
    return t_first, time.time()


GLOBAL_T = None   # the global case's tensor: set at the top level of this __main__


def world_global_work():
    """world_work on a global of `__main__`: this function travels by value, and
    GLOBAL_T with it (the notebook's ``x = torch.randn(...)`` read by ``def train()``)."""
    return world_work(GLOBAL_T)


# -- in the measuring interpreter ---------------------------------------------------------

def rollup(pid) -> dict:
    out = {}
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                parts = line.split()
                if len(parts) == 3 and parts[2] == "kB":
                    out[parts[0].rstrip(":")] = int(parts[1]) * 1024
    except OSError:
        pass
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(launcher, t, sync, n):
    """Launch and block until every rank has returned."""
    if launcher in ("mplaunch", "before"):
        import mplaunch
        mplaunch.launch(work, (t, sync), n)
    elif launcher == "tmp_spawn":
        import torch.multiprocessing as tmp
        tmp.spawn(work_spawn, args=(t, sync), nprocs=n)
    elif launcher == "elastic_forkserver":
        from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, start_processes
        logs = tempfile.mkdtemp(prefix="bench-inputs-logs-")
        ctx = start_processes(name="bench", entrypoint=work, args={i: (t, sync) for i in range(n)},
                              envs={i: {"LOCAL_RANK": str(i)} for i in range(n)},
                              logs_specs=DefaultLogsSpecs(log_dir=logs),
                              start_method="forkserver")
        try:
            result = ctx.wait()
            if result is None or result.is_failed():
                raise RuntimeError(f"elastic start_processes failed: {result}")
        finally:
            ctx.close()
    elif launcher == "accelerate":
        import contextlib
        import io
        from accelerate import notebook_launcher
        with contextlib.redirect_stdout(io.StringIO()):   # its "Launching training..."
            notebook_launcher(work, (t, sync), num_processes=n, use_port=str(_free_port()))
    else:
        raise ValueError(launcher)


def _warm(launcher, n):
    """What stays warm between launches in real use: mplaunch's server, torch's
    forkserver."""
    import torch
    sync = tempfile.mkdtemp(prefix="bench-inputs-warm-")
    open(os.path.join(sync, "go"), "w").close()
    if launcher in ("mplaunch", "before", "elastic_forkserver"):
        _launch(launcher, torch.zeros(1), sync, n)


def measure(launcher, nbytes, n):
    """In a fresh interpreter: the figures of one launch."""
    import psutil
    import torch
    _warm(launcher, n)
    t = torch.rand(max(1, nbytes // 4))
    sync = tempfile.mkdtemp(prefix="bench-inputs-")
    figures: dict = {}

    def watch():
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            ready = [f for f in os.listdir(sync) if f.startswith("ready.") and
                     not f.endswith(".tmp")]
            if len(ready) == n:
                break
            time.sleep(0.005)
        ranks = []
        for name in sorted(os.listdir(sync)):
            if name.startswith("ready.") and not name.endswith(".tmp"):
                with open(os.path.join(sync, name)) as f:
                    ranks.append(json.load(f))
        me = psutil.Process()
        procs = [me.pid] + [p.pid for p in me.children(recursive=True)]
        figures["pss"] = sum(rollup(pid).get("Pss", 0) for pid in procs)
        figures["processes"] = len(procs)
        figures["uss"] = [rollup(r["pid"]).get("Private_Clean", 0)
                          + rollup(r["pid"]).get("Private_Dirty", 0) for r in ranks]
        figures["ranks"] = ranks
        open(os.path.join(sync, "go"), "w").close()

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    t0 = time.time()
    _launch(launcher, t, sync, n)
    watcher.join()
    ranks = figures.pop("ranks")
    if len(ranks) != n:
        raise RuntimeError(f"{len(ranks)} of {n} ranks reported")
    figures["first"] = max(r["first"] for r in ranks) - t0
    figures["all"] = max(r["all"] for r in ranks) - t0
    if launcher in ("mplaunch", "before"):
        import mplaunch
        figures["module"] = mplaunch.__file__
    return figures


class _Peak:
    """Samples, while a call runs, the summed PSS of this process and every process
    below it, and each rank's USS: their peaks."""

    def __init__(self, ranks):
        self.ranks, self.pss, self.uss = list(ranks), 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self):
        import psutil
        me = psutil.Process()
        try:
            procs = [me.pid] + [p.pid for p in me.children(recursive=True)]
        except psutil.Error:
            return
        rolls = {pid: rollup(pid) for pid in procs}
        self.pss = max(self.pss, sum(r.get("Pss", 0) for r in rolls.values()))
        for pid in self.ranks:
            r = rolls.get(pid) or rollup(pid)
            self.uss = max(self.uss, r.get("Private_Clean", 0) + r.get("Private_Dirty", 0))

    def _run(self):
        while not self._stop.is_set():
            self._sample()
            self._stop.wait(0.02)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self._sample()
        # What the ranks hold once the call is over (all have mapped what they share:
        # a page only one rank has read yet counts in its USS while the call runs).
        rolls = [rollup(pid) for pid in self.ranks]
        self.after_uss = max(r.get("Private_Clean", 0) + r.get("Private_Dirty", 0)
                             for r in rolls)
        self.after_pss = sum(r.get("Pss", 0) for r in rolls)


def measure_world(nbytes, n=4, how="argument", calls=3):
    """`how`: "argument" (world.run(world_work, (t,))) or "global" (world.run(
    world_global_work), the tensor a global of this `__main__`)."""
    global GLOBAL_T
    import mplaunch
    import torch
    t = torch.rand(nbytes // 4)
    if how == "global":
        GLOBAL_T = t
        func, args = world_global_work, ()
    else:
        func, args = world_work, (t,)
    out = []
    with mplaunch.World(n) as world:
        world.run(len, ((),))
        for _ in range(calls):
            with _Peak(world.pids.values()) as peak:
                t0 = time.time()
                times = world.run(func, args)
                t_end = time.time()
            out.append({"first": max(a for a, _ in times) - t0,
                        "all": max(b for _, b in times) - t0, "call": t_end - t0,
                        "peak_pss": peak.pss, "rank_uss": peak.uss,
                        "after_uss": peak.after_uss, "after_pss": peak.after_pss})
    return {"calls": out, "module": mplaunch.__file__}


# -- the driver ---------------------------------------------------------------------------

def _mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def _estimate(launcher, size, n) -> int:
    """Peak memory of a case, roughly: the caller's tensor, the copies each launcher
    makes, and each rank's interpreter."""
    copies = {"mplaunch": 2, "tmp_spawn": 2, "elastic_forkserver": 2, "accelerate": 1,
              "before": 3 + 2 * n}[launcher]
    per_rank = 150 * MIB if launcher in ("mplaunch", "accelerate", "before") else 450 * MIB
    return copies * size + n * per_rank


def _one(args, env_path=None, timeout=900):
    env = dict(os.environ)
    if env_path:
        env["PYTHONPATH"] = env_path + os.pathsep + env.get("PYTHONPATH", "")
        env["PYTHONDONTWRITEBYTECODE"] = "1"   # write nothing into that checkout
    out = subprocess.run([sys.executable, os.path.abspath(__file__), *args],
                         capture_output=True, text=True, env=env, timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(out.stderr.strip().splitlines()[-1] if out.stderr.strip()
                           else f"exit {out.returncode}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true",
                    help="256 MiB to 2 ranks, no one-element baselines: about a minute")
    ap.add_argument("--sizes", default="256,1024,4096", help="MiB")
    ap.add_argument("--nprocs", default="2,4,8")
    ap.add_argument("--launchers", default=",".join(LAUNCHERS))
    ap.add_argument("--before", default=None, metavar="PATH",
                    help="also measure mplaunch from this checkout ('before')")
    ap.add_argument("--json", default=None)
    ap.add_argument("--world-only", action="store_true",
                    help="only the World cases (argument and global)")
    ap.add_argument("--one", nargs=3, help=argparse.SUPPRESS)
    ap.add_argument("--world", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--world-how", default="argument", help=argparse.SUPPRESS)
    ns = ap.parse_args()
    if ns.one:
        print(json.dumps(measure(ns.one[0], int(ns.one[1]), int(ns.one[2]))))
        return
    if ns.world:
        print(json.dumps(measure_world(ns.world, how=ns.world_how)))
        return
    sizes = [256] if ns.quick else [int(s) for s in ns.sizes.split(",")]
    nprocs = [2] if ns.quick else [int(n) for n in ns.nprocs.split(",")]
    launchers = ns.launchers.split(",") + (["before"] if ns.before else [])
    results: dict = {"cases": [], "world": []}
    baselines: dict = {}
    if not ns.world_only:
        print(f"{'input':>8} {'ranks':>5}  {'launcher':<20}{'first read':>11}"
              f"{'all read':>10}{'summed PSS':>12}{'copies':>8}{'rank USS (max)':>16}")
    for mib in ([] if ns.world_only else sizes):
        for n in nprocs:
            for launcher in launchers:
                size = mib * MIB
                row = {"mib": mib, "nprocs": n, "launcher": launcher}
                path = ns.before if launcher == "before" else None
                head = f"{mib:>5}MiB {n:>5}  {launcher:<20}"
                need = _estimate(launcher, size, n)
                if need > 0.8 * _mem_available():
                    row["skipped"] = (f"needs about {need / GIB:.1f} GiB, more than 80% of "
                                      f"the {_mem_available() / GIB:.1f} GiB available")
                    print(f"{head}skipped: {row['skipped']}")
                    results["cases"].append(row)
                    continue
                try:
                    if not ns.quick and (launcher, n) not in baselines:
                        baselines[launcher, n] = _one(["--one", launcher, "4", str(n)], path)
                    row.update(_one(["--one", launcher, str(size), str(n)], path))
                except (RuntimeError, subprocess.TimeoutExpired) as exc:
                    row["error"] = str(exc)
                    print(f"{head}failed: {exc}")
                    results["cases"].append(row)
                    continue
                base = baselines.get((launcher, n))
                copies = (f"{(row['pss'] - base['pss']) / size:>8.2f}" if base
                          else f"{'':>8}")
                if base:
                    row["copies"] = (row["pss"] - base["pss"]) / size
                print(f"{head}{row['first']:>10.2f}s{row['all']:>9.2f}s"
                      f"{row['pss'] / GIB:>10.2f}GiB{copies}{max(row['uss']) / MIB:>12.0f} MiB",
                      flush=True)
                results["cases"].append(row)
    print()
    print("World(4), three calls on the same tensor t: as an argument, world.run(f, (t,)); "
          "as a global of __main__ that f reads, world.run(f)")
    print(f"{'input':>8}  {'launcher':<10}{'t is':<10}{'call':>5}{'first read':>11}"
          f"{'all read':>10}{'call':>8}{'peak PSS':>11}{'rank USS':>10}"
          f"{'after: rank USS':>17}{'ranks PSS':>11}")
    for mib in sizes:
        for launcher in [x for x in launchers if x in ("mplaunch", "before")]:
            path = ns.before if launcher == "before" else None
            for how in ("argument", "global"):
                head = f"{mib:>5}MiB  {launcher:<10}{how:<10}"
                # the global case before issue 38: a copy per rank, and the stream's
                need = (_estimate("before", mib * MIB, 4) if how == "global"
                        else _estimate(launcher, mib * MIB, 4))
                if need > 0.8 * _mem_available():
                    print(f"{head}skipped: does not fit")
                    continue
                try:
                    r = _one(["--world", str(mib * MIB), "--world-how", how], path)
                except (RuntimeError, subprocess.TimeoutExpired) as exc:
                    print(f"{head}failed: {exc}")
                    continue
                for i, c in enumerate(r["calls"]):
                    print(f"{head if i == 0 else ' ' * len(head)}{i + 1:>5}"
                          f"{c['first']:>10.2f}s{c['all']:>9.2f}s{c['call']:>7.2f}s"
                          f"{c['peak_pss'] / GIB:>9.2f}GiB{c['rank_uss'] / MIB:>6.0f} MiB"
                          f"{c['after_uss'] / MIB:>13.0f} MiB{c['after_pss'] / GIB:>8.2f}GiB",
                          flush=True)
                results["world"].append({"mib": mib, "launcher": launcher, "how": how,
                                         **r})
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
