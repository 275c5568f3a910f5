"""A World on the nodes of a Ray cluster, side by side with Ray Train, in one run.

    python bench/ray_world.py              # about 4-6 minutes on 2 cores
    python bench/ray_world.py --quick      # fewer samples, about 3-4 minutes
    python bench/ray_world.py --slurm      # and the same World on the test SLURM cluster
    python bench/ray_world.py --scheduler ray,local   # or any schedulers, Ray the base
    python bench/ray_world.py --json out.json

The cases and the report are bench/_nodes_cases.py's, the same for every scheduler (its
docstring says what is measured); this file is Ray's part. It starts a two-node
``ray.cluster_utils.Cluster`` (a head and a second raylet, both on this machine, 2 CPUs
each, so that 4 workers of 1 CPU land 2 per node whoever places them), connects to it,
imports torch, mplaunch and Ray Train, and measures ``World(2, nnodes=2,
scheduler="ray", backend="gloo")`` (its placement group, an agent actor per node, each
agent's warm server importing torch, the ranks and their group) against Ray's own ways:

- the start and the second call: ``TorchTrainer(...).fit()`` with
  ``ScalingConfig(num_workers=4, use_gpu=False)`` and ``TorchConfig(backend="gloo")``,
  whose train loop does one ``all_reduce``, then a second fit (each fit starts its
  controller and its 4 worker actors again). "First" is the latest time a worker had the
  result (each writes it to a file); "returned" is ``fit`` returning.
- a trivial call: Ray Train has no call on warm workers; for scale, ``ray.get`` of a
  trivial method on 4 warm Ray actors placed 2 per node.
- heals: the fit whose worker of rank 3 raises while the others wait in ``all_reduce``,
  plus the next fit.

Ray Train needs ``pip install 'ray[train]'`` (pandas, pyarrow, tensorboardX); without
it the World is measured and Train's rows say why not. ``--slurm`` adds the same World
in an allocation of the test SLURM cluster (bench/nodes.py; needs slurm-wlm and munge),
after the Ray cluster is shut down.
"""
from __future__ import annotations

import glob
import json
import os
import sys
import time

import _nodes_cases as cases

NODE_CPUS = 2          # per Ray node: 4 one-CPU workers can only land 2 per node
NPROCS = cases.NPROCS
TRAIN_FAILS = ("TorchTrainer: rank 3 raises while the others wait in all_reduce: the "
               "failing fit() + the next fit()")


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
    if config.get("fail") and rank == cases.FAILING:
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


class Ray(cases.Setup):
    name = "ray"
    where = (f"a ray.cluster_utils.Cluster of 2 nodes ({NODE_CPUS} CPUs each), both this "
             "machine")

    def __init__(self):
        self.cluster = None
        self.fits = 0

    @staticmethod
    def add_arguments(ap):
        ap.add_argument("--slurm", action="store_true",
                        help="also the same World on the test SLURM cluster "
                             "(--scheduler ray,slurm)")
        ap.add_argument("--train-failures", type=int,
                        help="with ray: samples of a failing fit + the next (default 2, "
                             "quick 1)")

    def unavailable(self):
        try:
            import ray  # noqa: F401
        except ImportError:
            return "Ray is not installed: pip install -e '.[ray]' 'ray[train]'"

    def up(self):
        import ray
        from ray.cluster_utils import Cluster
        try:
            import ray.train.torch  # noqa: F401 - as the user's driver has; not timed
        except ImportError as exc:
            self.no_train = f"{exc}"
        else:
            self.no_train = None
        t0 = time.perf_counter()
        self.cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": NODE_CPUS})
        self.cluster.add_node(num_cpus=NODE_CPUS)
        self.cluster.wait_for_nodes()
        ray.init(address=self.cluster.address, log_to_driver=False)
        return {"start_s": time.perf_counter() - t0}

    def down(self):
        import ray
        try:
            ray.shutdown()
        finally:
            if self.cluster is not None:
                self.cluster.shutdown()
                self.cluster = None

    def versions(self):
        import ray
        return {"ray": ray.__version__}

    def session(self, args, scale):
        fig = super().session(args, scale)
        fig["ranks_per_node"] = f"actors {getattr(self, 'actor_nodes', '-')}"
        return fig

    # -- Ray's own ways ---------------------------------------------------------------

    def fit(self, fail=False):
        """One TorchTrainer.fit: (first all_reduce done, fit returned or raised, the
        workers' nodes, what it raised)."""
        if self.no_train:
            raise RuntimeError(f"Ray Train does not import ({self.no_train}): "
                               "pip install 'ray[train]'")
        import ray.train
        from ray.train.torch import TorchConfig, TorchTrainer
        tmp = os.environ["MPLAUNCH_BENCH_TMP"]
        d = os.path.join(tmp, "stamps")
        os.makedirs(d, exist_ok=True)
        for f in glob.glob(os.path.join(d, "rank*")):
            os.unlink(f)
        self.fits += 1
        t_wall, t0 = time.time(), time.perf_counter()
        trainer = TorchTrainer(
            train_loop, train_loop_config={"dir": d, "fail": fail},
            scaling_config=ray.train.ScalingConfig(num_workers=NPROCS, use_gpu=False),
            torch_config=TorchConfig(backend="gloo"),
            run_config=ray.train.RunConfig(storage_path=os.path.join(tmp, "results"),
                                           name=f"fit{self.fits}"))
        raised = None
        try:
            trainer.fit()
        except Exception as exc:  # noqa: BLE001 - the failing fit; reported
            raised = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
        returned = time.perf_counter() - t0
        got = []
        for f in sorted(glob.glob(os.path.join(d, "rank*"))):
            with open(f) as fh:
                got.append(json.load(fh))
        if fail:
            if raised is None:
                raise RuntimeError("the failing fit did not fail")
            return {"exit": returned, "raised": raised}
        if raised is not None or len(got) != NPROCS or any(g[1] != NPROCS for g in got):
            raise RuntimeError(f"the fit failed: {raised}; {got}")
        return {"first": max(g[0] for g in got) - t_wall, "exit": returned,
                "nodes": [g[2] for g in got]}

    def starts(self, args, workdir):
        def two_fits():
            a, b = self.fit(), self.fit()
            return {"first": a["first"], "exit": a["exit"], "second_first": b["first"],
                    "second": b["exit"], "nodes": a["nodes"]}
        return {"TorchTrainer(num_workers=4, gloo).fit(); 2.: a second fit": two_fits}

    def calls(self, args):
        name = "ray.get of a method on 4 warm actors (scale)"
        try:
            samples, self.actor_nodes = self.actor_calls(args.calls)
        except Exception as exc:  # noqa: BLE001 - reported
            return {name: {"error": f"{type(exc).__name__}: {exc}"}}
        return {name: samples}

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
            samples = []
            for _ in range(n):
                t0 = time.perf_counter()
                ray.get([a.call.remote() for a in actors])
                samples.append(time.perf_counter() - t0)
        finally:
            for a in actors:
                ray.kill(a)
            remove_placement_group(pg)
        return samples, where

    def heals(self, args):
        rs = []
        try:
            n = args.train_failures or (1 if args.quick else 2)
            for _ in range(n):
                a = self.fit(fail=True)
                b = self.fit()
                rs.append({"failing": a["exit"], "both": a["exit"] + b["exit"],
                           "what": a["raised"]})
                cases.log(f"  TorchTrainer: failing fit {a['exit']:.2f} s + next fit "
                          f"{b['exit']:.2f} s ({a['raised']})")
        except Exception as exc:  # noqa: BLE001 - reported
            return {TRAIN_FAILS: {"error": f"{type(exc).__name__}: {exc}"}}
        return {TRAIN_FAILS: rs}


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--slurm" in argv and not any(a.startswith("--scheduler") for a in argv):
        argv += ["--scheduler", "ray,slurm"]
    return cases.main(argv, __doc__, "ray", full=(3, 300, 5), quick=(2, 100, 3),
                      own={"ray": Ray})


if __name__ == "__main__":
    sys.exit(main())
