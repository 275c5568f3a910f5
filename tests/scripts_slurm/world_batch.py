"""Run by test_slurm_world as a batch job (`sbatch -N2 -n3 --wrap "python
world_batch.py"`): the batch step's environment sets SLURM_CPUS_ON_NODE (the batch
node's CPUs), which salloc's does not. A World of 4 ranks over the 2 nodes, one
all_reduce; prints one JSON line."""
import json
import os

import mplaunch


def where():
    import torch
    import torch.distributed as dist
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return os.environ["SLURMD_NODENAME"], t.item()


env = {k: os.environ.get(k) for k in ("SLURM_CPUS_ON_NODE", "SLURM_JOB_CPUS_PER_NODE")}
with mplaunch.World(nprocs=2, nnodes=2, backend="gloo", master_addr="127.0.0.1",
                    timeout=60) as w:
    print(json.dumps({"check": "batch", "env": env, "results": w.run(where)}), flush=True)
