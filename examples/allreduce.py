"""Four ranks of DDP with gloo on CPU: each rank trains one step of a tiny model, then
all-reduces a tensor and prints the result. Run: python examples/allreduce.py"""
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import mplaunch


def train_step(world_size: int) -> float:
    dist.init_process_group("gloo")  # env:// from RANK, WORLD_SIZE, MASTER_ADDR/PORT
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(4, 1))
    loss = model(torch.full((8, 4), float(rank + 1))).pow(2).mean()
    loss.backward()  # DDP averages the gradients across the ranks
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)  # 1 + 2 + ... + world_size on every rank
    print(f"rank {rank}: all_reduce -> {t.item():g}, "
          f"grad[0] = {model.module.weight.grad[0, 0].item():.4f}")
    dist.destroy_process_group()
    return t.item()


if __name__ == "__main__":
    n = 4
    results = mplaunch.launch(train_step, args=(n,), nprocs=n)
    assert results == [n * (n + 1) / 2] * n, results
    print("results by rank:", results)
