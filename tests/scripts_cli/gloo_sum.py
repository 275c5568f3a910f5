"""A real DDP-style rank: join the group through env:// and all_reduce."""
import os

import torch
import torch.distributed as dist

if __name__ == "__main__":
    dist.init_process_group("gloo")
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    print(f"rank {dist.get_rank()} of {dist.get_world_size()} sum {t.item():g}")
    dist.destroy_process_group()
