"""A World across two nodes, inside an allocation of the throwaway test SLURM cluster.

    python bench/nodes.py              # about 3 minutes on 2 cores
    python bench/nodes.py --quick      # fewer repeats
    python bench/nodes.py --json out.json

Starts the two-node cluster of ``tests/slurm_cluster.py`` (nodes n1 and n2, both this
machine, loopback), runs ``salloc -N2 python bench/nodes.py --inner`` in it, and prints
what the inner process measured:

1. Start: from nothing to the first gloo ``all_reduce`` of 4 ranks done, 2 per node:
   ``World(2, nnodes=2)`` and its first ``run`` (one srun step of node agents, started
   from a process that has imported torch, as a notebook has), against the one-shot
   batch ways: ``srun -N2 -n2 python -m mplaunch --nprocs 2 script.py`` (a watcher per
   node) and ``srun -N2 -n2 python -m torch.distributed.run --nnodes 2
   --nproc-per-node 2 --rdzv-backend c10d script.py``. For those, "first call" is when
   rank 0 has its ``all_reduce`` result (it writes the time to a file), "exit" when srun
   returns. A one-node ``World(4)`` is there for scale. They take turns.
2. A call: ``world.run`` of a trivial function on the 4 ranks across 2 nodes, against a
   one-node ``World(4)`` on the same machine (warm ranks, median of 50 calls each).
3. Healing across nodes (4 ranks on 2 nodes, gloo, ``grace_period=5``), the failing
   rank being rank 3, on node n2: an exception; a rank that calls ``os._exit`` while the
   others wait in ``all_reduce``; a rank that raises while the others wait in
   ``all_reduce`` (a collective left half-done); a run with ``timeout=1`` of a
   ``sleep(30)``; and node n2's agent killed (SIGKILL) during a run. Each: from the
   failure to ``run`` raising, and to the next ``run`` of a trivial function returning.

Optionally (``--ipyparallel``), ipyparallel's Slurm engines: an ``ipp.Cluster`` with
``engines="slurm"`` (sbatch of 4 engines) until 4 engines have joined a gloo group and
done an ``all_reduce``; ipyparallel must be importable (``pip install ipyparallel``), or
installed apart with ``pip install --target DIR ipyparallel`` and given as
``--ipyparallel DIR``. It runs once, after the rest, outside the allocation.

Every ratio is from this one run, on this machine. Nothing here asserts a timing.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

NPROCS, NNODES = 4, 2     # ranks in all, and nodes
PER_NODE = NPROCS // NNODES   # a World's nprocs counts one node's ranks, as launch's
FAILING = 3          # on the second node (ranks 2 and 3 live on n2)
GRACE = 5.0

# What the one-shot launchers run on each rank.
SCRIPT = """\
import os, sys, time
import torch
import torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
assert t.item() == dist.get_world_size() == 4, t
if dist.get_rank() == 0:
    with open(sys.argv[1] + ".tmp", "w") as f:
        f.write(repr(time.time()))
    os.replace(sys.argv[1] + ".tmp", sys.argv[1])
dist.destroy_process_group()
"""


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def _med(xs):
    return statistics.median(xs) if xs else float("nan")


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- in the ranks (sent by value: this module is __main__ there too) ---------------------

def trivial():
    return 0


def allreduce():
    import torch
    import torch.distributed as dist
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


def _stamp(directory):
    with open(os.path.join(directory, "stamp.tmp"), "w") as f:
        f.write(repr(time.time()))
    os.replace(os.path.join(directory, "stamp.tmp"), os.path.join(directory, "stamp"))


def raise_alone(directory):
    import torch.distributed as dist
    if dist.get_rank() == FAILING:
        _stamp(directory)
        raise ValueError("rank 3 fails on its own")
    return 0


def exit_while_peers_wait(directory):
    import torch
    import torch.distributed as dist
    if dist.get_rank() == FAILING:
        _stamp(directory)
        os._exit(1)
    dist.all_reduce(torch.ones(1))


def raise_while_peers_wait(directory):
    import torch
    import torch.distributed as dist
    if dist.get_rank() == FAILING:
        _stamp(directory)
        raise ValueError("rank 3 fails before the collective")
    dist.all_reduce(torch.ones(1))


def sleep_long():
    time.sleep(30)


def _stamped(directory):
    with open(os.path.join(directory, "stamp")) as f:
        return float(f.read())


# -- inner: inside the allocation ---------------------------------------------------------

def _world(**kw):
    import mplaunch
    return mplaunch.World(PER_NODE, nnodes=NNODES, backend="gloo",
                          master_addr="127.0.0.1", **kw)


def start_world():
    t0 = time.time()
    w = _world()
    try:
        assert w.run(allreduce) == [4.0] * 4
        first = time.time() - t0
    finally:
        w.close()
    return {"first": first, "exit": time.time() - t0}


def start_world_one_node():
    import mplaunch
    t0 = time.time()
    with mplaunch.World(NPROCS, backend="gloo") as w:
        assert w.run(allreduce) == [4.0] * 4
        first = time.time() - t0
    return {"first": first, "exit": time.time() - t0}


def _one_shot(argv, workdir):
    stamp = os.path.join(workdir, "stamp")
    if os.path.exists(stamp):
        os.unlink(stamp)
    t0 = time.time()
    proc = subprocess.run(argv + [os.path.join(workdir, "script.py"), stamp], cwd=workdir,
                          stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=180)
    done = time.time() - t0
    if proc.returncode != 0 or not os.path.exists(stamp):
        raise RuntimeError(f"{argv[:8]} failed (rc {proc.returncode}):\n{proc.stdout[-3000:]}")
    return {"first": _stamped(workdir) - t0, "exit": done}


SRUN = ["srun", "-N2", "-n2", "--ntasks-per-node=1"]


def start_watchers(workdir):
    return _one_shot(SRUN + [sys.executable, "-m", "mplaunch", "--nprocs", "2",
                             "--master-addr", "127.0.0.1"], workdir)


def start_torchrun(workdir):
    port = _free_port()
    return _one_shot(SRUN + [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
                             "--nproc-per-node", "2", "--rdzv-backend", "c10d",
                             "--rdzv-endpoint", f"127.0.0.1:{port}",
                             "--rdzv-id", str(port)], workdir)


def starts(repeats, workdir):
    with open(os.path.join(workdir, "script.py"), "w") as f:
        f.write(SCRIPT)
    kinds = {
        "World(2, nnodes=2): World() + first run": start_world,
        "srun + python -m mplaunch --nprocs 2 (a watcher per node)":
            lambda: start_watchers(workdir),
        "srun + torchrun --nnodes 2 --nproc-per-node 2 (c10d)":
            lambda: start_torchrun(workdir),
        "World(4) on one node (for scale; the first is cold)": start_world_one_node,
    }
    out = {name: [] for name in kinds}
    errors = {}
    for i in range(repeats):   # in turns, so background load hits each alike
        for name, fn in kinds.items():
            if name in errors:
                continue
            try:
                r = fn()
            except Exception as exc:  # noqa: BLE001 - reported, not hidden
                errors[name] = f"{type(exc).__name__}: {exc}"
                log(f"  {name}: FAILED {errors[name]}")
                continue
            out[name].append(r)
            log(f"  {name}: first {r['first']:.2f} s, exit {r['exit']:.2f} s")
    res = {name: {"first_s": _med([r["first"] for r in rs]),
                  "exit_s": _med([r["exit"] for r in rs]),
                  "all_first_s": [r["first"] for r in rs], "n": len(rs)}
           for name, rs in out.items()}
    for name, e in errors.items():
        res[name]["error"] = e
    one = "World(4) on one node (for scale; the first is cold)"
    rs = out[one]
    if len(rs) > 1:   # the first started this process's warm server (importing torch)
        res[one].update(cold_first_s=rs[0]["first"], first_s=_med([r["first"] for r in rs[1:]]),
                        exit_s=_med([r["exit"] for r in rs[1:]]))
    return res


def calls(n):
    import mplaunch
    out = {}
    for name, make in (("World(2, nnodes=2)", _world),
                       ("World(4), one node", lambda: mplaunch.World(NPROCS,
                                                                     backend="gloo"))):
        with make() as w:
            for _ in range(20):
                w.run(trivial)
            samples = []
            for _ in range(n):
                t0 = time.perf_counter()
                w.run(trivial)
                samples.append(time.perf_counter() - t0)
        s = sorted(samples)
        out[name] = {"median_s": _med(s), "p90_s": s[int(0.9 * (len(s) - 1))],
                     "min_s": s[0], "n": n}
        log(f"  {name}: median {out[name]['median_s'] * 1e3:.2f} ms")
    return out


def _short(err):
    healed = getattr(err, "healed", None)
    return (f"{type(err).__name__}; healed: {healed}" if healed
            else f"{type(err).__name__}: {str(err).splitlines()[0][:200]}")


def _heal_case(w, fn, args, timeout, stamp_dir):
    """One failing call: (failure -> run raises, failure -> the next run of a trivial
    function returns, what the error said)."""
    import mplaunch
    w.run(trivial)
    try:
        w.run(fn, args, timeout=timeout)
    except (mplaunch.WorkerError, mplaunch.MainProcessError) as exc:
        raised = time.time()
        what = _short(exc)
    else:
        raise RuntimeError(f"{fn.__name__} did not fail")
    t_fail = _stamped(stamp_dir)
    return raised - t_fail, _next_run(w) - t_fail, what


def _next_run(w, tries=3):
    """When the next run of a trivial function returned; a run that fails instead is
    logged and retried (it is part of the time to a working world)."""
    import mplaunch
    for i in range(tries):
        try:
            assert w.run(trivial) == [0] * 4
            return time.time()
        except mplaunch.WorkerError as exc:
            NEXT_RUN_FAILURES.append(str(exc).splitlines()[0][:300])
            log(f"    the next run failed ({i + 1} of {tries} tries): "
                f"{str(exc).splitlines()[0][:300]}")
    raise RuntimeError(f"no working run after {tries} tries")


NEXT_RUN_FAILURES = []


def _no_pids(text):
    """The message without its pids and attempt numbers (they differ run to run)."""
    text = re.sub(r"pids \{[^}]*\}", "pids ...", text)
    text = re.sub(r"\[attempt [0-9]+\]", "[attempt n]", text)
    return re.sub(r"pid [0-9]+", "pid ...", text)


def heals(repeats, nnodes):
    import mplaunch
    out = {}

    def stamped(fn):
        def case(w):
            with tempfile.TemporaryDirectory(dir=os.environ.get("MPLAUNCH_BENCH_TMP")) as d:
                return _heal_case(w, fn, (d,), 300, d)
        return case

    def timeout_case(fn, args):
        def case(w):
            # the failure is the deadline: one second after the call
            import mplaunch
            w.run(trivial)
            t_call = time.time()
            try:
                w.run(fn, args, timeout=1)
            except mplaunch.WorkerError as exc:
                raised = time.time()
                what = _short(exc)
            else:
                raise RuntimeError("no timeout")
            return raised - (t_call + 1), _next_run(w) - (t_call + 1), what
        return case

    def kill_agent(w):
        w.run(trivial)
        pid = w.nodes[1]["agent_pid"]
        killed = []

        def kill():
            time.sleep(0.5)
            killed.append(time.time())
            os.kill(pid, signal.SIGKILL)
        th = threading.Thread(target=kill)
        import mplaunch
        th.start()
        try:
            w.run(time.sleep, (30,), timeout=120)
        except (mplaunch.WorkerError, mplaunch.MainProcessError, RuntimeError) as exc:
            raised = time.time()
            what = _short(exc)
        else:
            raise RuntimeError("killing the agent did not fail the run")
        th.join()
        return raised - killed[0], _next_run(w) - killed[0], what

    cases = {
        "exception (rank 3 raises, the others return)": stamped(raise_alone),
        "dead rank (rank 3 os._exit while the others wait in all_reduce)":
            stamped(exit_while_peers_wait),
        "collective left half-done (rank 3 raises while the others wait in all_reduce)":
            stamped(raise_while_peers_wait),
        "timeout (timeout=1, ranks in a Python function that sleeps; from the deadline)":
            timeout_case(sleep_long, ()),
        "timeout (timeout=1, the function being the builtin time.sleep(30) itself)":
            timeout_case(time.sleep, (30,)),
        "agent of node n2 killed (SIGKILL) during a run": kill_agent,
    }
    if nnodes == 1:
        del cases["agent of node n2 killed (SIGKILL) during a run"]
        world = mplaunch.World(NPROCS, backend="gloo", grace_period=GRACE)
    else:
        world = _world(grace_period=GRACE)
    with world as w:
        for name, case in cases.items():
            rs, whats = [], []
            log(f"  {name}:")
            for _ in range(repeats):
                try:
                    to_raise, to_next, what = case(w)
                except Exception as exc:  # noqa: BLE001 - reported
                    whats.append(f"BENCH CASE FAILED: {type(exc).__name__}: {exc}")
                    log(f"  {name}: FAILED {whats[-1]}")
                    break
                rs.append((to_raise, to_next))
                whats.append(what)
                log(f"    raise {to_raise * 1e3:.0f} ms, next run "
                    f"{to_next * 1e3:.0f} ms ({what[:160]})")
            failed_next = NEXT_RUN_FAILURES[:]
            del NEXT_RUN_FAILURES[:]
            out[name] = {"next_run_failures": failed_next,
                         "to_raise_s": _med([r[0] for r in rs]),
                         "to_next_run_s": _med([r[1] for r in rs]),
                         "all_to_raise_s": [r[0] for r in rs], "n": len(rs),
                         "what": sorted({_no_pids(w) for w in whats})}
    return out


def inner(args):
    import torch
    import mplaunch
    report = {"machine": f"{platform.machine()}, {os.cpu_count()} cpus, "
                         f"python {platform.python_version()}",
              "torch": torch.__version__, "mplaunch": mplaunch.__version__,
              "slurm_job": os.environ.get("SLURM_JOB_ID"),
              "loadavg_before": os.getloadavg()}
    workdir = tempfile.mkdtemp(prefix="bench-nodes-", dir=args.tmp)
    os.environ["MPLAUNCH_BENCH_TMP"] = workdir
    log(f"1. from nothing to the first all_reduce of {NPROCS} ranks on {NNODES} nodes:")
    report["start"] = starts(args.repeats, workdir)
    log("2. a trivial run on warm ranks:")
    report["calls"] = calls(args.calls)
    log(f"3. heals across nodes (grace_period={GRACE:g}):")
    report["heal"] = heals(args.heal_repeats, NNODES)
    log("   the same on one node, 4 ranks:")
    report["heal_one_node"] = heals(args.heal_repeats, 1)
    report["loadavg_after"] = os.getloadavg()
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)


# -- ipyparallel (outside the allocation: its engines come as an sbatch job) -------------

IPP = """\
import json, os, sys, time
t0 = time.time()
import ipyparallel as ipp
port = int(sys.argv[1])
cluster = ipp.Cluster(engines="slurm", n=4, controller_ip="127.0.0.1",
                      profile_dir=sys.argv[2], log_level=40)
rc = cluster.start_and_connect_sync(activate=False)
rc.wait_for_engines(4, timeout=120)
started = time.time() - t0
view = rc[:]
view.scatter("rank", list(range(4)), flatten=True, block=True)
def first(port):
    import os, torch, torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=4)
    t = torch.ones(1); dist.all_reduce(t)
    return (t.item(), os.environ.get("SLURMD_NODENAME"))
res = view.apply_sync(first, port)
first_s = time.time() - t0
cluster.stop_cluster_sync()
print(json.dumps({"engines_s": started, "first": first_s, "exit": time.time() - t0,
                  "result": res}))
"""


def ipyparallel_case(cluster, tmp, extra_path):
    code = os.path.join(tmp, "ipp_case.py")
    with open(code, "w") as f:
        f.write(IPP)
    prof = os.path.join(tmp, "ipp-profile")
    os.makedirs(prof, exist_ok=True)
    t0 = time.time()
    path = [p for p in (ROOT, extra_path, os.environ.get("PYTHONPATH")) if p]
    r = cluster.run([sys.executable, code, str(_free_port()), prof], timeout=200, cwd=tmp,
                    env={"PYTHONPATH": os.pathsep.join(path)})
    wall = time.time() - t0
    lines = [l for l in r.stdout.splitlines() if l.startswith("{")]
    if r.returncode or not lines:
        return {"error": f"rc {r.returncode}: {(r.stdout + r.stderr)[-2000:]}"}
    out = json.loads(lines[-1])
    out["wall_s"] = wall
    return out


# -- outer ---------------------------------------------------------------------------------

def _print(report):
    print(f"\nmplaunch {report['mplaunch']} / torch {report['torch']} / {report['machine']}"
          f" / nodes n1 and n2 of the test SLURM cluster, both this machine (loopback)"
          f" / load average {report['loadavg_before'][0]:.1f} before, "
          f"{report['loadavg_after'][0]:.1f} after")
    st = report["start"]
    base = st["World(2, nnodes=2): World() + first run"]["first_s"]
    print(f"\n1. from nothing to the first all_reduce of {NPROCS} ranks, 2 per node "
          "(median; exit: until the launcher returned):")
    for name, r in st.items():
        ratio = f"  ({r['first_s'] / base:.1f}x)" if r["n"] else ""
        err = f"  ERROR {r['error']}" if "error" in r else ""
        cold = (f"  (cold, the first in the process: {r['cold_first_s']:.2f} s; the "
                f"median is of the others)" if "cold_first_s" in r else "")
        print(f"  {name:62s} first {r['first_s']:6.2f} s  exit {r['exit_s']:6.2f} s"
              f"  n={r['n']}{ratio}{err}{cold}")
    if "ipyparallel" in report:
        r = report["ipyparallel"]
        if "error" in r:
            print(f"  {'ipyparallel Cluster(engines=slurm), 4 engines':62s} ERROR "
                  f"{r['error'][-600:]}")
        else:
            print(f"  {'ipyparallel Cluster(engines=slurm), 4 engines':62s} first "
                  f"{r['first']:6.2f} s  exit {r['exit']:6.2f} s  n=1  ({r['first'] / base:.1f}x;"
                  f" engines up after {r['engines_s']:.2f} s)")
    c = report["calls"]
    one = c["World(4), one node"]["median_s"]
    print("\n2. a trivial run on 4 warm ranks:")
    for name, r in c.items():
        print(f"  {name:30s} median {r['median_s'] * 1e3:7.2f} ms  p90 "
              f"{r['p90_s'] * 1e3:7.2f} ms  n={r['n']}  ({r['median_s'] / one:.1f}x one node)")
    print(f"\n3. heals (4 ranks, rank 3 fails; grace_period={GRACE:g}; median; across nodes: "
          "rank 3 is on n2; to next run: until the next run of a trivial function "
          "returned):")
    one_node = report.get("heal_one_node", {})
    for name, r in report["heal"].items():
        o = one_node.get(name)
        print(f"  {name}")
        for label, x in (("2 nodes", r), ("1 node", o)):
            if x is None:
                continue
            print(f"    {label:8s} to raise {x['to_raise_s'] * 1e3:7.0f} ms  to next run "
                  f"{x['to_next_run_s'] * 1e3:7.0f} ms  n={x['n']}")
            for w in x["what"]:
                print(f"        {w[:300]}")
            for f in x["next_run_failures"]:
                print(f"        THE NEXT RUN FAILED: {f}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer repeats")
    ap.add_argument("--json", help="also write every figure to this file")
    ap.add_argument("--ipyparallel", nargs="?", const="", metavar="DIR",
                    help="also time ipyparallel's Slurm engines (needs ipyparallel "
                         "importable, or installed with pip install --target DIR)")
    ap.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--tmp", help=argparse.SUPPRESS)
    ap.add_argument("--repeats", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--calls", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--heal-repeats", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.heal_repeats is None:
        args.heal_repeats = args.repeats
    if args.inner:
        return inner(args)

    sys.path.insert(0, os.path.join(ROOT, "tests"))
    import slurm_cluster
    repeats, heal_repeats, ncalls = (2, 2, 20) if args.quick else (3, 3, 50)
    t_all = time.time()
    with tempfile.TemporaryDirectory(prefix="bench-nodes-") as tmp:
        out = os.path.join(tmp, "inner.json")
        with slurm_cluster.slurm_cluster(os.path.join(tmp, "slurm")) as cluster:
            env = {"PYTHONPATH": os.pathsep.join(
                p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)}
            r = cluster.run(["salloc", "-N2", sys.executable, os.path.abspath(__file__),
                             "--inner", "--out", out, "--tmp", tmp, "--repeats",
                             str(repeats), "--heal-repeats", str(heal_repeats),
                             "--calls", str(ncalls)],
                            timeout=600, env=env, cwd=tmp,
                            stdout=subprocess.PIPE, stderr=None)
            if r.returncode != 0 or not os.path.exists(out):
                print(r.stdout[-5000:])
                raise SystemExit(f"the inner run failed (rc {r.returncode})")
            with open(out) as f:
                report = json.load(f)
            report["inner_stdout_tail"] = r.stdout[-3000:]
            if args.ipyparallel is not None:
                log("ipyparallel's Slurm engines:")
                report["ipyparallel"] = ipyparallel_case(cluster, tmp, args.ipyparallel)
                log(f"  {report['ipyparallel']}")
    report["bench_wall_s"] = time.time() - t_all
    _print(report)
    print(f"\n(whole bench: {report['bench_wall_s']:.0f} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
