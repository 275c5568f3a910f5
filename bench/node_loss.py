"""A lost node costs only that node: rounds of random node loss in one World across
nodes, each timed from the loss (a node's agent SIGKILLed, as a host that dies takes
it) to a working World again (the call that finds the loss raises, the next returns),
with every surviving rank's counter checked (its state kept) and the lost node's
processes checked gone.

    python bench/node_loss.py                         # the tests' stand-in nodes
    python bench/node_loss.py --scheduler slurm       # inside a SLURM allocation
    python bench/node_loss.py --slurm-cluster         # the tests' 2-node SLURM cluster
    python bench/node_loss.py --ray-cluster           # a 3-raylet Ray cluster, World on 2
    python bench/node_loss.py --rounds 20 --nnodes 3 --nprocs 2 [--json PATH]
    python bench/node_loss.py --go-on                 # no spare: restart(nnodes=M)

--go-on: the stand-in scheduler with no node to replace a lost one (tests/local_step.py
NoSpare); each round a fresh World, one random node's agent SIGKILLed, timed from the
loss to a working World on the nodes left (the call that finds the loss raises,
restart(nnodes=M) goes on, the next call returns), every survivor's counter checked and
the ranks checked renumbered 0..M*nprocs-1.

Nothing here asserts a timing; the figures go to docs/performance.rst.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import sys
import time


HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

import mplaunch  # noqa: E402
from nodes_scenarios import alive, world_processes, world_processes_of  # noqa: E402

_COUNT = 0


def count():
    global _COUNT
    _COUNT += 1
    return _COUNT


def allreduce():
    import torch
    import torch.distributed as dist
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--scheduler", default="local")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--nnodes", type=int, default=3)
    ap.add_argument("--nprocs", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json")
    ap.add_argument("--go-on", action="store_true",
                    help="no spare node: each round goes on with the nodes left")
    ap.add_argument("--slurm-cluster", action="store_true",
                    help="start the tests' two-node SLURM cluster on this machine "
                         "(tests/slurm_cluster.py) and run in an allocation of it")
    ap.add_argument("--ray-cluster", action="store_true",
                    help="start a three-raylet ray.cluster_utils.Cluster on this machine "
                         "(tests/ray_cluster.py) and run a World of two nodes on it")
    a = ap.parse_args()
    if a.ray_cluster:
        import ray_cluster
        a.scheduler, a.nnodes = "ray", 2
        with ray_cluster.two_nodes() as cluster:
            cluster.add_node(num_cpus=ray_cluster.NODE_CPUS)
            cluster.wait_for_nodes()
            return rounds(a)
    if a.scheduler == "local" and not a.slurm_cluster:
        local_step = __import__("local_step")   # registers the stand-in scheduler (tests/)
        if a.go_on:
            local_step.register("local-no-spare", local_step.NoSpare)
            a.scheduler = "local-no-spare"
            return rounds_going_on(a)
    if a.slurm_cluster:
        import tempfile

        import slurm_cluster
        a.scheduler, a.nnodes = "slurm", 2
        with tempfile.TemporaryDirectory(prefix="bench-slurm-") as root, \
                slurm_cluster.slurm_cluster(root) as cluster, \
                cluster.allocation(2) as alloc:
            for name in [n for n in os.environ if n.startswith("SLURM_")]:
                del os.environ[name]
            os.environ.update(alloc.slurm_env)
            return rounds(a)
    return rounds(a)


def rank_of():
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


def rounds_going_on(a):
    rng = random.Random(a.seed)
    rows = []
    for i in range(a.rounds):
        with mplaunch.World(a.nprocs, nnodes=a.nnodes, scheduler=a.scheduler,
                            backend="gloo", grace_period=2, master_addr="127.0.0.1") as w:
            w.run(count)
            counts = w.run(count)
            node = rng.randrange(a.nnodes)
            lost = world_processes_of(w, node)
            kept = [c for r, c in enumerate(counts) if r // a.nprocs != node]
            t0 = time.perf_counter()
            os.kill(w.nodes[node]["agent_pid"], signal.SIGKILL)
            try:
                w.run(count, timeout=120)
                raised = False
            except mplaunch.WorkerError:
                raised = True
            w.restart(nnodes=a.nnodes - 1)
            new = w.run(count)
            took = time.perf_counter() - t0
            size = (a.nnodes - 1) * a.nprocs
            intact = (new == [c + (2 if raised else 1) for c in kept]
                      and w.run(rank_of) == [(r, size) for r in range(size)]
                      and w.run(allreduce) == [float(size)] * size)
            left = alive(lost, timeout=20)
            held = world_processes(w)
        left_at_close = alive(held, timeout=20)
        rows.append({"round": i, "node": node, "recovered_s": took, "raised": raised,
                     "survivors_intact": intact, "left": left + left_at_close})
        print(f"round {i:2d}: node {node} lost, going on with {a.nnodes - 1} node(s) in "
              f"{took:.2f} s, survivors' state {'intact' if intact else 'LOST'}, "
              f"{len(left) + len(left_at_close)} process(es) left", flush=True)
    times = [r["recovered_s"] for r in rows]
    summary = {"scheduler": a.scheduler, "mode": "go-on", "nnodes": a.nnodes,
               "nprocs": a.nprocs, "rounds": len(rows),
               "median_s": statistics.median(times), "max_s": max(times),
               "intact": sum(r["survivors_intact"] for r in rows),
               "left": sum(len(r["left"]) for r in rows)}
    print(json.dumps(summary))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"summary": summary, "rounds": rows}, f, indent=1)


def rounds(a):
    rng = random.Random(a.seed)
    rows = []
    size = a.nnodes * a.nprocs
    where = {} if a.scheduler == "ray" else {"master_addr": "127.0.0.1"}
    with mplaunch.World(a.nprocs, nnodes=a.nnodes, scheduler=a.scheduler,
                        backend="gloo", grace_period=2, **where) as w:
        counts = w.run(count)
        for i in range(a.rounds):
            node = rng.randrange(a.nnodes)
            lost = world_processes_of(w, node)
            agent = w.nodes[node]["agent_pid"]
            ranks = range(node * a.nprocs, (node + 1) * a.nprocs)
            t0 = time.perf_counter()
            os.kill(agent, signal.SIGKILL)
            try:
                w.run(count, timeout=120)
                raised = False
            except mplaunch.WorkerError:
                raised = True
            new = w.run(count)
            took = time.perf_counter() - t0
            expect = [1 if r in ranks else c + (2 if raised else 1)
                      for r, c in enumerate(counts)]
            intact = new == expect and w.fresh_ranks == [] and \
                w.run(allreduce) == [float(size)] * size
            left = alive(lost, timeout=20)
            rows.append({"round": i, "node": node, "recovered_s": took, "raised": raised,
                         "survivors_intact": intact, "left": left})
            print(f"round {i:2d}: node {node} lost, a working World again in "
                  f"{took:.2f} s, survivors' state {'intact' if intact else 'LOST'}, "
                  f"{len(left)} of its processes left", flush=True)
            counts = w.run(count)
        held = world_processes(w)
    left_at_close = alive(held, timeout=20)
    times = [r["recovered_s"] for r in rows]
    summary = {"scheduler": a.scheduler, "nnodes": a.nnodes, "nprocs": a.nprocs,
               "rounds": len(rows), "median_s": statistics.median(times),
               "max_s": max(times), "intact": sum(r["survivors_intact"] for r in rows),
               "left_after_rounds": sum(len(r["left"]) for r in rows),
               "left_at_close": left_at_close}
    print(json.dumps(summary))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"summary": summary, "rounds": rows}, f, indent=1)


if __name__ == "__main__":
    main()
