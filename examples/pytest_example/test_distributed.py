"""Distributed tests as a user writes them with mplaunch's pytest plugin (installed with
mplaunch: nothing to register).

    python -m pytest examples/pytest_example

A test marked ``@pytest.mark.mplaunch(nprocs=2)`` runs its body in 2 ranks with
torch.distributed already initialised (gloo); it passes when every rank passes.
"""
import os

import pytest
import torch
import torch.distributed as dist


@pytest.mark.mplaunch(nprocs=2, timeout=60)
def test_all_reduce_sums_over_ranks():
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    assert t.item() == 3.0  # 1 + 2, on every rank


@pytest.mark.mplaunch(nprocs=2, timeout=60)
@pytest.mark.parametrize("src", [0, 1])
def test_broadcast_from_each_rank(src, tmp_path):
    # Parameters and fixture values (tmp_path here) are pickled and sent to every rank.
    t = torch.full((3,), float(dist.get_rank()))
    dist.broadcast(t, src=src)
    assert t.tolist() == [float(src)] * 3
    torch.save(t, tmp_path / f"rank{dist.get_rank()}.pt")  # the same tmp_path in each rank
    dist.barrier()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0.pt", "rank1.pt"]


@pytest.mark.mplaunch(nprocs=3, backend=None)
def test_environment_without_a_process_group():
    # backend=None: nothing is initialised; the launcher's variables are still there.
    assert not dist.is_initialized()
    assert os.environ["WORLD_SIZE"] == "3"
    assert 0 <= int(os.environ["RANK"]) < 3


def test_launch_from_the_test(mplaunch):
    # No marker: the test runs here, and the mplaunch fixture is mplaunch.launch with
    # this session's defaults (nprocs from the mplaunch_nprocs ini option).
    def square_of_rank(offset):
        return (int(os.environ["RANK"]) + offset) ** 2

    assert mplaunch(square_of_rank, args=(1,)) == [1, 4]
    assert mplaunch(square_of_rank, args=(0,), nprocs=3) == [0, 1, 4]
