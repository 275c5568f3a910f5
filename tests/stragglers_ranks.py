"""Rank functions for tests/test_stragglers.py, in a module of their own: a rank that
imports the test module imports nbclient and jupyter_client with it (test_notebook's
fixture), about a second of CPU that each rank spends at its own pace within its first
call, which the timing these tests make would have to include."""
import os
import time


def late_and_short(short_rank, meet):
    """`short_rank` starts each of three all_reduces 150 ms late and returns at once;
    the others wait for it, then stay in the call past MIN_CALL_S (1 s). The ranks
    first meet at a file barrier in `meet`, which the recorder does not see: the call
    reaches each rank at its own time (CI: ranks 0 and 1 began 60 ms after rank 2, so
    the first all_reduce found rank 2 on time and the report named nobody)."""
    import torch
    import torch.distributed as dist
    rank, size = dist.get_rank(), dist.get_world_size()
    open(os.path.join(meet, str(rank)), "w").close()
    while len(os.listdir(meet)) < size:
        time.sleep(0.001)
    t = torch.ones(10)
    for _ in range(3):
        if rank == short_rank:
            time.sleep(0.15)
        dist.all_reduce(t)
    if rank != short_rank:
        time.sleep(1.2)


def all_reduces_for(seconds):
    import torch
    import torch.distributed as dist
    for _ in range(int(seconds / 0.05) + 1):   # as many in every rank
        dist.all_reduce(torch.ones(4))
        time.sleep(0.05)
