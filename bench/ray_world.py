"""A World on the nodes of a Ray cluster, side by side with Ray Train, in one run.

    python bench/ray_world.py              # about 2-4 minutes on 2 cores
    python bench/ray_world.py --quick      # fewer samples, about 3 minutes
    python bench/ray_world.py --slurm      # and the same World on the test SLURM cluster
    python bench/ray_world.py --json out.json

Starts a two-node ``ray.cluster_utils.Cluster`` (a head and a second raylet, both on this
machine, 2 CPUs each, so that 4 workers of 1 CPU land 2 per node whoever places them),
connects to it, imports torch, mplaunch and Ray Train, and then measures, 4 ranks, 2 per
node, gloo:

1. Start: from nothing (the cluster up) to the first ``all_reduce`` done:
   ``World(2, nnodes=2, scheduler="ray", backend="gloo")`` and its first ``run`` (its
   placement group, an agent actor per node, each agent's warm server importing torch,
   the ranks and their group), against ``TorchTrainer(...).fit()`` with
   ``ScalingConfig(num_workers=4, use_gpu=False)`` and ``TorchConfig(backend="gloo")``,
   whose train loop does one ``all_reduce`` (its controller, 4 worker actors importing
   torch, their group). For the trainer "first all_reduce done" is the latest time a
   worker had the result (each writes it to a file); "returned" is ``fit`` returning,
   and for the World ``close()`` returning.
2. A second call: ``world.run`` of the same ``all_reduce`` on the same World, against a
   second ``TorchTrainer.fit`` (each fit starts its controller and workers again).
   1 and 2 take turns, round by round.
3. A trivial ``world.run`` on the 4 warm ranks (median of many). Ray Train has no call
   on warm workers; for scale, ``ray.get`` of a trivial method on 4 warm Ray actors
   placed 2 per node.
4. Heals, each the failing call plus the next call (an ``all_reduce`` on every rank, so
   the World is shown to work again), rank 3 (on the second node) failing: an
   exception, the others returning; a half-done collective (rank 3 raises while the
   others wait in ``all_reduce``); a dead rank (rank 3 calls ``os._exit`` while the
   others wait in ``all_reduce``; it is replaced). Against Ray Train's way: the fit
   whose worker of rank 3 raises while the others wait in ``all_reduce``, plus the next
   fit.

With ``--slurm``, the same World (``World(2, nnodes=2, backend="gloo")``, one srun step
of node agents) is measured the same way inside an allocation (``salloc -N2``) of the
throwaway two-node SLURM cluster of the tests (``tests/slurm_cluster.py``; needs
slurm-wlm and munge, ``.ci/install-slurm.sh``), after the Ray cluster is shut down.

At the end every process this run started (the Ray cluster's, the World's, the
trainer's) must be gone: the bench is their subreaper, waits for them, and reports and
ends by pid whatever is left. Every ratio is from this one run, on this machine. Nothing
here asserts a timing; the figures go to docs/performance.rst.
"""
from __future__ import annotations

import argparse
import ctypes
import glob
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

PER_NODE, NNODES = 2, 2
NPROCS = PER_NODE * NNODES
NODE_CPUS = 2          # per Ray node: 4 one-CPU workers can only land 2 per node
FAILING = 3            # a rank of the second node


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def _med(xs):
    return statistics.median(xs) if xs else float("nan")


def _span(xs):
    return f"{min(xs):.2f}-{max(xs):.2f}" if xs else "-"


# -- in the ranks and Ray Train's workers (sent by value: this module is __main__) -------

def trivial():
    return 0


def allreduce():
    import torch
    import torch.distributed as dist
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


def raise_alone():
    import torch.distributed as dist
    if dist.get_rank() == FAILING:
        raise ValueError("rank 3 fails on its own")
    return 0


def raise_while_peers_wait():
    import torch
    import torch.distributed as dist
    if dist.get_rank() == FAILING:
        raise ValueError("rank 3 fails before the collective")
    dist.all_reduce(torch.ones(1))


def exit_while_peers_wait():
    import torch
    import torch.distributed as dist
    if dist.get_rank() == FAILING:
        os._exit(1)
    dist.all_reduce(torch.ones(1))


def train_loop(config):
    """Ray Train's train loop: one all_reduce; each worker writes when it had the result
    and where it ran (Ray Train V2 keeps reported metrics only with a checkpoint)."""
    import json as _json
    import os as _os
    import time as _time

    import ray as _ray
    import torch
    import torch.distributed as dist
    rank = dist.get_rank()
    if config.get("fail") and rank == FAILING:
        raise ValueError("rank 3 fails before the collective")
    t = torch.ones(1)
    dist.all_reduce(t)
    done = _time.time()
    path = _os.path.join(config["dir"], f"rank{rank}")
    with open(path + ".tmp", "w") as f:
        _json.dump([done, t.item(), _ray.get_runtime_context().get_node_id()[:8]], f)
    _os.replace(path + ".tmp", path)


class Trivial:
    def where(self):
        import ray as _ray
        return _ray.get_runtime_context().get_node_id()[:8]

    def call(self):
        return 0


# -- the processes of this run --------------------------------------------------------------

def become_subreaper():
    """Orphans among this run's descendants (a raylet's daemons) come back to this
    process instead of init, so that the end can see and wait for every one."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(36, 1, 0, 0, 0) == 0      # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        return False


def _reap():
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def leftovers(timeout):
    """Processes below this one still alive after ``timeout`` seconds, zombies reaped."""
    import psutil
    end = time.monotonic() + timeout
    while True:
        _reap()
        left = []
        for p in psutil.Process().children(recursive=True):
            try:
                if p.status() != psutil.STATUS_ZOMBIE:
                    left.append((p.pid, " ".join(p.cmdline())[:120] or p.name()))
            except psutil.Error:
                continue
        if not left or time.monotonic() > end:
            return left
        time.sleep(0.2)


def end_leftovers(left):
    """What is still there is ours (below this process): ended by its pid."""
    for pid, _ in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    time.sleep(0.5)
    _reap()


# -- the World's measures (on Ray here, on SLURM in --slurm-inner) -------------------------

def _timed(fn, *args):
    t0 = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - t0, out


def world_round(make):
    """World() + first run(all_reduce), the second run, close()."""
    t0 = time.perf_counter()
    w = make()
    try:
        assert w.run(allreduce) == [float(NPROCS)] * NPROCS
        first = time.perf_counter() - t0
        nodes = [n["name"] for n in w.nodes]
        second, got = _timed(w.run, allreduce)
        assert got == [float(NPROCS)] * NPROCS
    finally:
        w.close()
    return {"first": first, "exit": time.perf_counter() - t0, "second": second,
            "nodes": nodes}


def world_calls(make, n):
    with make() as w:
        for _ in range(20):
            w.run(trivial)
        return [_timed(w.run, trivial)[0] for _ in range(n)]


HEALS = {
    "exception": ("rank 3 raises, the others return", raise_alone),
    "half-done": ("rank 3 raises while the others wait in all_reduce (a collective "
                  "left half-done)", raise_while_peers_wait),
    "dead rank": ("rank 3 calls os._exit while the others wait in all_reduce "
                  "(replaced)", exit_while_peers_wait),
}


def world_heals(make, n):
    import mplaunch
    out = {}
    with make() as w:
        assert w.run(allreduce) == [float(NPROCS)] * NPROCS
        for key, (_, fn) in HEALS.items():
            rs = []
            for _ in range(n):
                w.run(trivial)
                t0 = time.perf_counter()
                try:
                    w.run(fn, timeout=120)
                except mplaunch.WorkerError as exc:
                    failed = time.perf_counter() - t0
                    healed = getattr(exc, "healed", None) or ""
                    what = (f"{type(exc).__name__}; healed: {healed.split('. ')[0][:150]}"
                            if healed else type(exc).__name__)
                else:
                    raise RuntimeError(f"{fn.__name__} did not fail")
                assert w.run(allreduce) == [float(NPROCS)] * NPROCS
                rs.append({"failing": failed, "both": time.perf_counter() - t0,
                           "what": what})
            out[key] = rs
            log(f"  World {key}: failing call + next "
                + ", ".join(f"{r['both'] * 1e3:.0f} ms" for r in rs) + f" ({rs[-1]['what']})")
    return out


# -- Ray ------------------------------------------------------------------------------------

class RayBench:
    def __init__(self, tmp):
        self.tmp = tmp
        self.fits = 0

    def start_cluster(self):
        import ray
        from ray.cluster_utils import Cluster
        t0 = time.perf_counter()
        self.cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": NODE_CPUS})
        self.cluster.add_node(num_cpus=NODE_CPUS)
        self.cluster.wait_for_nodes()
        ray.init(address=self.cluster.address, log_to_driver=False)
        return time.perf_counter() - t0

    def stop_cluster(self):
        import ray
        try:
            ray.shutdown()
        finally:
            if getattr(self, "cluster", None) is not None:
                self.cluster.shutdown()
                self.cluster = None

    def world(self):
        import mplaunch
        return mplaunch.World(PER_NODE, nnodes=NNODES, scheduler="ray", backend="gloo")

    def fit(self, fail=False):
        """One TorchTrainer.fit: (first all_reduce done, fit returned or raised, the
        workers' nodes, what it raised)."""
        import ray.train
        from ray.train.torch import TorchConfig, TorchTrainer
        d = os.path.join(self.tmp, "stamps")
        os.makedirs(d, exist_ok=True)
        for f in glob.glob(os.path.join(d, "rank*")):
            os.unlink(f)
        self.fits += 1
        t_wall, t0 = time.time(), time.perf_counter()
        trainer = TorchTrainer(
            train_loop, train_loop_config={"dir": d, "fail": fail},
            scaling_config=ray.train.ScalingConfig(num_workers=NPROCS, use_gpu=False),
            torch_config=TorchConfig(backend="gloo"),
            run_config=ray.train.RunConfig(storage_path=os.path.join(self.tmp, "results"),
                                           name=f"fit{self.fits}"))
        raised = None
        try:
            trainer.fit()
        except Exception as exc:  # noqa: BLE001 - the failing fit; reported
            raised = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
        returned = time.perf_counter() - t0
        got = [json.load(open(f)) for f in sorted(glob.glob(os.path.join(d, "rank*")))]
        if fail:
            if raised is None:
                raise RuntimeError("the failing fit did not fail")
            return {"exit": returned, "raised": raised}
        if raised is not None or len(got) != NPROCS or any(g[1] != NPROCS for g in got):
            raise RuntimeError(f"the fit failed: {raised}; {got}")
        return {"first": max(g[0] for g in got) - t_wall, "exit": returned,
                "nodes": [g[2] for g in got]}

    def actor_calls(self, n):
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        pg = placement_group([{"CPU": 1}] * NPROCS, strategy="SPREAD")
        ray.get(pg.ready(), timeout=60)
        cls = ray.remote(Trivial)
        actors = [cls.options(num_cpus=1, scheduling_strategy=PlacementGroupSchedulingStrategy(
            pg, placement_group_bundle_index=i)).remote() for i in range(NPROCS)]
        try:
            where = ray.get([a.where.remote() for a in actors], timeout=60)
            for _ in range(20):
                ray.get([a.call.remote() for a in actors])
            samples = [_timed(lambda: ray.get([a.call.remote() for a in actors]))[0]
                       for _ in range(n)]
        finally:
            for a in actors:
                ray.kill(a)
            remove_placement_group(pg)
        return samples, where


def run_ray(args, report):
    rb = RayBench(report["tmp"])
    try:
        log("Ray cluster: a head and a second raylet ...")
        report["ray_cluster_start_s"] = rb.start_cluster()
        log(f"  up in {report['ray_cluster_start_s']:.1f} s")
        log(f"1, 2. start and a second call, {args.rounds} rounds in turns:")
        worlds, fits = [], []
        for i in range(args.rounds):
            order = ("world", "train") if i % 2 == 0 else ("train", "world")
            for who in order:
                if who == "world":
                    r = world_round(rb.world)
                    worlds.append(r)
                    log(f"  World: first {r['first']:.2f} s, second run "
                        f"{r['second'] * 1e3:.1f} ms, closed {r['exit']:.2f} s "
                        f"(nodes {r['nodes']})")
                else:
                    a, b = rb.fit(), rb.fit()
                    fits.append({"first": a["first"], "exit": a["exit"],
                                 "second_first": b["first"], "second": b["exit"],
                                 "nodes": a["nodes"]})
                    log(f"  TorchTrainer: first all_reduce {a['first']:.2f} s, fit "
                        f"{a['exit']:.2f} s; second fit: all_reduce {b['first']:.2f} s, "
                        f"returned {b['exit']:.2f} s (workers' nodes {a['nodes']})")
        report["ray_world_rounds"], report["train_rounds"] = worlds, fits
        log("3. a trivial call on 4 warm ranks:")
        report["ray_world_calls"] = world_calls(rb.world, args.calls)
        log(f"  World.run: median {_med(report['ray_world_calls']) * 1e3:.2f} ms")
        samples, where = rb.actor_calls(args.calls)
        report["ray_actor_calls"], report["ray_actor_nodes"] = samples, where
        log(f"  ray.get on 4 actors: median {_med(samples) * 1e3:.2f} ms (nodes {where})")
        log("4. heals:")
        report["ray_world_heals"] = world_heals(rb.world, args.heal_repeats)
        rs = []
        for _ in range(args.train_failures):
            a = rb.fit(fail=True)
            b = rb.fit()
            rs.append({"failing": a["exit"], "both": a["exit"] + b["exit"],
                       "what": a["raised"]})
            log(f"  TorchTrainer: failing fit {a['exit']:.2f} s + next fit "
                f"{b['exit']:.2f} s ({a['raised']})")
        report["train_failures"] = rs
    finally:
        rb.stop_cluster()


# -- SLURM (optional): inside an allocation of the test cluster ---------------------------

def slurm_inner(args):
    import torch  # noqa: F401 - as the driver of the Ray part had
    import mplaunch

    def make():
        return mplaunch.World(PER_NODE, nnodes=NNODES, backend="gloo",
                              master_addr="127.0.0.1")
    out = {"rounds": []}
    for _ in range(args.rounds):
        r = world_round(make)
        out["rounds"].append(r)
        log(f"  SLURM World: first {r['first']:.2f} s, second run {r['second'] * 1e3:.1f} "
            f"ms, closed {r['exit']:.2f} s")
    out["calls"] = world_calls(make, args.calls)
    out["heals"] = world_heals(make, args.heal_repeats)
    with open(args.out, "w") as f:
        json.dump(out, f)


def run_slurm(args, report):
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    import slurm_cluster
    if not slurm_cluster.slurm_available():
        report["slurm_error"] = "slurm-wlm or munge is not installed"
        return
    out = os.path.join(report["tmp"], "slurm.json")
    with slurm_cluster.slurm_cluster(os.path.join(report["tmp"], "slurm")) as cluster:
        env = {"PYTHONPATH": os.pathsep.join(
            p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)}
        r = cluster.run(["salloc", "-N2", sys.executable, os.path.abspath(__file__),
                         "--slurm-inner", "--out", out, "--rounds", str(args.rounds),
                         "--calls", str(args.calls), "--heal-repeats",
                         str(args.heal_repeats)],
                        timeout=600, env=env, cwd=report["tmp"],
                        stdout=subprocess.PIPE, stderr=None)
        if r.returncode != 0 or not os.path.exists(out):
            report["slurm_error"] = f"rc {r.returncode}: {(r.stdout or '')[-2000:]}"
            return
    with open(out) as f:
        report["slurm"] = json.load(f)


# -- the table --------------------------------------------------------------------------------

def _ms(x):
    return f"{x * 1e3:.1f} ms" if x < 1 else f"{x:.2f} s"


def print_report(report):
    print(f"\nmplaunch {report['mplaunch']} / torch {report['torch']} / ray "
          f"{report['ray']} / {report['machine']} / a ray.cluster_utils.Cluster of 2 nodes "
          f"({NODE_CPUS} CPUs each), both this machine / load average "
          f"{report['loadavg_before'][0]:.1f} before, {report['loadavg_after'][0]:.1f} after"
          f" / the Ray cluster started in {report['ray_cluster_start_s']:.1f} s")
    W, T = report["ray_world_rounds"], report["train_rounds"]
    S = report.get("slurm", {})
    sr = S.get("rounds", [])
    w_first, t_first = _med([r["first"] for r in W]), _med([r["first"] for r in T])
    w_exit, t_exit = _med([r["exit"] for r in W]), _med([r["exit"] for r in T])
    print(f"\n1. from nothing (cluster up) to the first all_reduce of {NPROCS} ranks, "
          f"2 per node (median of {len(W)}, range in brackets; returned: close() / fit()):")
    print(f"  {'World(2, nnodes=2, scheduler=ray) + run':46s} first {w_first:6.2f} s "
          f"({_span([r['first'] for r in W])})  returned {w_exit:6.2f} s  1")
    print(f"  {'TorchTrainer(num_workers=4, gloo).fit()':46s} first {t_first:6.2f} s "
          f"({_span([r['first'] for r in T])})  returned {t_exit:6.2f} s  "
          f"{t_first / w_first:.1f}x (returned: {t_exit / w_exit:.1f}x)")
    if sr:
        s_first = _med([r["first"] for r in sr])
        print(f"  {'World(2, nnodes=2) on SLURM (srun step)':46s} first {s_first:6.2f} s "
              f"({_span([r['first'] for r in sr])})  returned "
              f"{_med([r['exit'] for r in sr]):6.2f} s  {s_first / w_first:.1f}x")
    w2, t2 = _med([r["second"] for r in W]), _med([r["second"] for r in T])
    print(f"\n2. the second call, all_reduce (median of {len(W)}):")
    print(f"  {'World.run again':46s} {_ms(w2):>10s}  1")
    print(f"  {'a second TorchTrainer.fit()':46s} {_ms(t2):>10s}  {t2 / w2:.0f}x  (its "
          f"all_reduce done after {_med([r['second_first'] for r in T]):.2f} s)")
    if sr:
        s2 = _med([r["second"] for r in sr])
        print(f"  {'World.run again, on SLURM':46s} {_ms(s2):>10s}  {s2 / w2:.1f}x")
    c, a = report["ray_world_calls"], report["ray_actor_calls"]
    print(f"\n3. a trivial call on {NPROCS} warm ranks (median of {len(c)}, p90):")
    print(f"  {'World.run (Ray)':46s} {_med(c) * 1e3:7.2f} ms "
          f"({sorted(c)[int(0.9 * (len(c) - 1))] * 1e3:.2f})  1")
    print(f"  {'ray.get of a method on 4 warm actors (scale)':46s} {_med(a) * 1e3:7.2f} ms "
          f"({sorted(a)[int(0.9 * (len(a) - 1))] * 1e3:.2f})  {_med(a) / _med(c):.1f}x")
    if S.get("calls"):
        s = S["calls"]
        print(f"  {'World.run (SLURM)':46s} {_med(s) * 1e3:7.2f} ms "
              f"({sorted(s)[int(0.9 * (len(s) - 1))] * 1e3:.2f})  {_med(s) / _med(c):.1f}x")
    H, F = report["ray_world_heals"], report["train_failures"]
    tf = _med([r["both"] for r in F])
    print("\n4. heals, rank 3 (second node) failing: the failing call + the next "
          "all_reduce call (median; the failing call alone in brackets):")
    for key, (title, _) in HEALS.items():
        rs = H[key]
        both = _med([r["both"] for r in rs])
        slurm = ""
        if S.get("heals"):
            s = S["heals"][key]
            slurm = f"; SLURM {_ms(_med([r['both'] for r in s]))}"
        print(f"  World: {title}")
        print(f"    {_ms(both):>10s} ({_ms(_med([r['failing'] for r in rs]))})  n={len(rs)}"
              f"  Ray Train's row below: {tf / both:.0f}x{slurm}; {rs[-1]['what']}")
    print("  TorchTrainer: rank 3 raises while the others wait in all_reduce; the failing "
          "fit() + the next fit()")
    print(f"    {_ms(tf):>10s} ({_ms(_med([r['failing'] for r in F]))})  n={len(F)}; "
          f"{F[-1]['what'] if F else ''}")
    print(f"\nranks per node: World {sorted(W[0]['nodes'])}; TorchTrainer workers "
          f"{T[0]['nodes']}; actors {report['ray_actor_nodes']}")
    if "slurm_error" in report:
        print(f"SLURM: not measured: {report['slurm_error']}")
    print(f"left after the end: {report['left'] or 'no process'}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer samples")
    ap.add_argument("--slurm", action="store_true",
                    help="also the same World on the test SLURM cluster")
    ap.add_argument("--json", help="also write every figure to this file")
    ap.add_argument("--rounds", type=int, help="start rounds (each: a World, two fits)")
    ap.add_argument("--calls", type=int, help="trivial calls timed")
    ap.add_argument("--heal-repeats", type=int, help="samples of each World heal")
    ap.add_argument("--train-failures", type=int, help="samples of a failing fit + next")
    ap.add_argument("--slurm-inner", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    for name, quick, full in (("rounds", 2, 3), ("calls", 100, 300),
                              ("heal_repeats", 3, 5), ("train_failures", 1, 2)):
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    if args.slurm_inner:
        return slurm_inner(args)

    t_all = time.perf_counter()
    subreaper = become_subreaper()
    import torch        # what the user's driver has imported; none of it is timed
    import ray
    import ray.train.torch  # noqa: F401
    import mplaunch
    from mplaunch._engine import servers
    report = {"machine": f"{platform.machine()}, {os.cpu_count()} cpus, "
                         f"python {platform.python_version()}",
              "torch": torch.__version__, "ray": ray.__version__,
              "mplaunch": mplaunch.__version__, "loadavg_before": os.getloadavg(),
              "subreaper": subreaper}
    with tempfile.TemporaryDirectory(prefix="bench-ray-world-") as tmp:
        report["tmp"] = tmp
        try:
            run_ray(args, report)
            if args.slurm:
                log("SLURM: the same World in an allocation of the test cluster:")
                run_slurm(args, report)
        finally:
            servers.shutdown_servers()
            left = leftovers(30)
            if left:
                log(f"left after the end, ended by pid now: {left}")
                end_leftovers(left)
            report["left"] = left
    report["loadavg_after"] = os.getloadavg()
    report["bench_wall_s"] = time.perf_counter() - t_all
    print_report(report)
    print(f"\n(whole bench: {report['bench_wall_s']:.0f} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
