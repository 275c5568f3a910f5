"""Rank functions that a timeout finds, for test_insight, test_start and test_reports:
in a module that imports nothing heavy. A rank imports the module of the function it
runs within its call, and a timeout of a few seconds counts from the call's start: a
test module that imports nbclient or pytest spends much of that at each rank's own
pace on a loaded machine, and the rank is not yet where the test expects it."""
import os
import time


def sleep_forever():
    time.sleep(600)


def barrier_but_rank_1_sleeps():
    import torch.distributed as dist
    dist.init_process_group("gloo")
    if dist.get_rank() == 1:
        time.sleep(600)
    dist.barrier()


def file_rendezvous_barrier(path):
    """A group set up without mplaunch's env:// hook: no reporter runs in the ranks."""
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{path}",
                            rank=int(os.environ["RANK"]), world_size=2)
    if dist.get_rank() == 1:
        time.sleep(600)
    dist.barrier()


def subgroup_rank_missing():
    import torch
    import torch.distributed as dist
    dist.init_process_group("gloo")
    pair = dist.new_group([0, 1])
    t = torch.ones(1)
    for _ in range(16):
        if dist.get_rank() in (0, 1):
            dist.all_reduce(t, group=pair)
        dist.all_reduce(t)
    if dist.get_rank() == 0:
        dist.all_reduce(t, group=pair)   # PAIR-17: rank 1 never comes
    elif dist.get_rank() == 1:
        time.sleep(120)                  # RANK-1-ELSEWHERE
    dist.barrier()
