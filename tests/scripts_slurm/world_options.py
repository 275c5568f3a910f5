"""Run by test_slurm_world inside an allocation (`salloc -N2 python world_options.py`):
a World of 4 ranks over 2 nodes made with options that are per rank: env= a callable
of the (global) rank, and cpus="per-rank" (each node places its own ranks on the CPUs
it has). Prints one JSON line per option."""
import json
import os

import mplaunch


def say(check, **facts):
    print(json.dumps(dict(facts, check=check), sort_keys=True), flush=True)


def my_env():
    return os.environ["RANK"], os.environ.get("MY_RANK"), os.environ.get("SHARED")


def my_cpus():
    return (os.environ["RANK"], os.environ["SLURMD_NODENAME"],
            sorted(os.sched_getaffinity(0)))


def env_for(rank):
    return {"MY_RANK": str(rank)}


with mplaunch.World(nprocs=4, nnodes=2, backend="gloo", master_addr="127.0.0.1",
                    timeout=60, env=env_for) as w:
    say("env_callable", ranks=w.run(my_env))
with mplaunch.World(nprocs=4, nnodes=2, backend="gloo", master_addr="127.0.0.1",
                    timeout=60, env={"SHARED": "yes"}, cpus="per-rank") as w:
    say("cpus_per_rank", env=w.run(my_env), ranks=w.run(my_cpus),
        nodes=[{k: n[k] for k in ("node", "name", "cpus", "allowed")} for n in w.nodes])
