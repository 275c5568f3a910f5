"""Ranks that heal: the process group can be destroyed and built again in user code, and
a World keeps its ranks and their state through what can be brought back (issue 19)."""
from __future__ import annotations

import os
import signal
import sys
import time

import pytest

import mplaunch

METHODS = ["forkserver", "spawn", "fork"]


# -- in the ranks -------------------------------------------------------------------------

def _model():
    import torch
    torch.manual_seed(0)
    return torch.nn.Linear(8, 8)


def wrap_model():
    """Build a DDP model and keep it (the World's first cell)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    st = mplaunch.rank_state()
    st["m"] = _model()
    st["ddp"] = DDP(st["m"])
    return True


def recover(times):
    """The recovery sequence of the issue, `times` times, with no barrier anywhere:
    destroy, init, drop the old DDP, wrap again, one training step."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    st = mplaunch.rank_state()
    if "m" not in st:
        wrap_model()
    m, ddp = st.pop("m"), st.pop("ddp")
    steps = []
    for _ in range(times):
        dist.destroy_process_group()
        dist.init_process_group("gloo")
        del ddp
        ddp = DDP(m)
        group = dist.distributed_c10d._get_default_group()
        before = group._get_sequence_number_for_group()
        ddp(torch.randn(4, 8)).sum().backward()
        steps.append(group._get_sequence_number_for_group() - before)
    st["m"], st["ddp"] = m, ddp
    return steps


# -- item 7: destroy/init in user code ----------------------------------------------------

@pytest.mark.parametrize("method", METHODS)
def test_recovery_sequence_twenty_times_under_launch(method):
    steps = mplaunch.launch(recover, (20,), nprocs=2, start_method=method, timeout=120)
    # Every backward issued the same collectives: the old wrappers' hooks did not pile up
    # (they would also fail on their destroyed group).
    assert steps[0] == steps[1] and len(set(steps[0])) == 1 and len(steps[0]) == 20


@pytest.mark.parametrize("method", METHODS)
def test_recovery_sequence_twenty_times_in_a_world_with_a_kept_model(method):
    with mplaunch.World(2, start_method=method, timeout=120) as world:
        assert world.run(wrap_model) == [True, True]
        steps = world.run(recover, (20,))
        assert steps[0] == steps[1] and len(set(steps[0])) == 1
        assert world.run(recover, (2,))[0] == steps[0][:2]   # and again, in the same ranks
