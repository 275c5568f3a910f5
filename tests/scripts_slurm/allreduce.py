"""Run by `srun -N2 -n2 python -m mplaunch --nprocs 2 allreduce.py MODE`: a world of 4."""
import os
import sys
import time

import torch
import torch.distributed as dist

mode = sys.argv[1]
dist.init_process_group("gloo")
rank = dist.get_rank()
if mode == "fail" and rank == 3:
    sys.exit(7)  # on node 1
t = torch.tensor([float(rank + 1)])
dist.all_reduce(t)
if mode == "fail":
    time.sleep(120)  # node 0's ranks must be torn down by node 1's failure
print(f"rank {rank} of {dist.get_world_size()} on node {os.environ['GROUP_RANK']}"
      f" (slurm node {os.environ.get('SLURM_NODEID')}): {t.item():g}", flush=True)
dist.destroy_process_group()
