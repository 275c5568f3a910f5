"""Run by test_slurm_world inside an allocation (`salloc -N2 python world_options.py`):
a World of 4 ranks over 2 nodes made with options that are per rank: env= a callable
of the (global) rank, and cpus="per-rank" (each node places its own ranks on the CPUs
it has), and log_dir= (every rank's output in a file of its own). Also World.stacks()
from another thread while a run is in progress. Prints one JSON line per option."""
import os
import shutil
import tempfile
import threading
import time

import mplaunch

from allocation import say


def my_env():
    return os.environ["RANK"], os.environ.get("MY_RANK"), os.environ.get("SHARED")


def my_cpus():
    return (os.environ["RANK"], os.environ["SLURMD_NODENAME"],
            sorted(os.sched_getaffinity(0)))


def sleeper():
    time.sleep(3)


def env_for(rank):
    return {"MY_RANK": str(rank)}


with mplaunch.World(nprocs=2, nnodes=2, backend="gloo", master_addr="127.0.0.1",
                    timeout=60, env=env_for) as w:
    say("env_callable", ranks=w.run(my_env))
with mplaunch.World(nprocs=2, nnodes=2, backend="gloo", master_addr="127.0.0.1",
                    timeout=60, env={"SHARED": "yes"}, cpus="per-rank") as w:
    say("cpus_per_rank", env=w.run(my_env), ranks=w.run(my_cpus),
        nodes=[{k: n[k] for k in ("node", "name", "cpus", "allowed")} for n in w.nodes])

logs = tempfile.mkdtemp(prefix="mplaunch-logs-")
with mplaunch.World(nprocs=2, nnodes=2, backend="gloo", master_addr="127.0.0.1",
                    timeout=60, log_dir=logs) as w:
    w.run(lambda: print("hello from rank", os.environ["RANK"], flush=True))
    # where every rank is, asked from another thread while they sleep in a run
    asked = {}
    timer = threading.Timer(1.5, lambda: asked.setdefault("stacks", w.stacks()))
    timer.start()
    w.run(sleeper)
    timer.join()
    stacks = asked["stacks"]
files = {}
for root, _dirs, names in os.walk(logs):
    for name in names:
        path = os.path.join(root, name)
        with open(path, errors="replace") as f:
            files[os.path.relpath(path, logs)] = f.read()
shutil.rmtree(logs, ignore_errors=True)
say("log_dir", files=files)
say("stacks", ranks=sorted(dict(stacks)), text=str(stacks))
