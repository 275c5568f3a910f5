"""What bench/heal.py runs in the ranks (a module of its own: ranks import it by name)."""
from __future__ import annotations

import os
import time


def raise_while_peer_waits():
    import torch
    import torch.distributed as dist
    if dist.get_rank() == 1:
        raise ValueError("rank one fails before the collective")
    dist.all_reduce(torch.ones(1))


def spawn_raise_while_peer_waits(rank, directory):
    import torch
    import torch.distributed as dist
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("gloo", rank=rank, world_size=2)
    if rank == 1:
        with open(os.path.join(directory, "stamp"), "w") as f:
            f.write(repr(time.time()))
        raise ValueError("rank one fails")
    dist.all_reduce(torch.ones(1))


def die_while_peers_wait(directory):
    import torch
    import torch.distributed as dist
    if dist.get_rank() == 1:
        with open(os.path.join(directory, "stamp"), "w") as f:
            f.write(repr(time.time()))
        os._exit(1)
    dist.all_reduce(torch.ones(1))


def stamp_file(directory) -> float:
    with open(os.path.join(directory, "stamp")) as f:
        return float(f.read())


def rewrap_and_time(n):
    """The recovery sequence n times; the median backward time after each re-wrap."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(8)])
    ddp = DDP(model)
    x = torch.randn(32, 256)
    out = []
    for _ in range(n):
        dist.destroy_process_group()
        dist.init_process_group("gloo")
        del ddp
        ddp = DDP(model)
        times = []
        for _ in range(10):
            loss = ddp(x).sum()
            t0 = time.perf_counter()
            loss.backward()
            times.append(time.perf_counter() - t0)
        out.append(sorted(times)[len(times) // 2])
    return out
