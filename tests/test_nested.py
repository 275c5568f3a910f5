"""A launch from inside a rank: supported. The rank is a launching process like any
other: its launch binds a store of its own (its ranks never meet the outer ranks'
store or port), starts its own warm server, relays its ranks' output into the rank's
own (so it arrives with both prefixes), raises in the rank as it would anywhere, and
is torn down with the rank."""
from __future__ import annotations

import os
import time

import psutil
import pytest

import mplaunch


def _inner_sum(scale):
    import torch
    import torch.distributed as dist
    t = torch.tensor([float(dist.get_rank() + 1)]) * scale
    dist.all_reduce(t)
    return os.environ["MASTER_PORT"], t.item()


def _outer():
    import torch.distributed as dist
    rank = dist.get_rank()                     # the outer group (backend="gloo")
    inner = mplaunch.launch(_inner_sum, args=(rank + 1,), nprocs=2, backend="gloo")
    dist.barrier()                             # the outer group still works after it
    return os.environ["MASTER_PORT"], inner


def test_a_rank_launches_ranks_of_its_own():
    results = mplaunch.launch(_outer, nprocs=2, backend="gloo", timeout=120)
    outer_ports = {port for port, _ in results}
    assert len(outer_ports) == 1
    inner_ports = set()
    for rank, (_, inner) in enumerate(results):
        assert [total for _, total in inner] == [3.0 * (rank + 1)] * 2
        ports = {port for port, _ in inner}
        assert len(ports) == 1        # one store per inner launch, shared by its ranks
        inner_ports |= ports
    assert len(inner_ports) == 2 and not inner_ports & outer_ports


def _inner_fails():
    if os.environ["RANK"] == "1":
        raise KeyError("deep")


def _inner_waits(pid_dir):
    open(os.path.join(pid_dir, str(os.getpid())), "w").close()
    time.sleep(120)


def _outer_fails(pid_dir):
    if os.environ["RANK"] == "0":
        deadline = time.monotonic() + 60
        while len(os.listdir(pid_dir)) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)   # until rank 1's inner ranks are up
        return mplaunch.launch(_inner_fails, nprocs=2)
    # Rank 1 waits in an inner launch of its own until rank 0's failure ends it.
    return mplaunch.launch(_inner_waits, args=(pid_dir,), nprocs=2)


def test_an_inner_failure_raises_in_the_rank_and_everything_ends(tmp_path, capfd):
    with pytest.raises(mplaunch.WorkerError) as info:
        mplaunch.launch(_outer_fails, args=(str(tmp_path),), nprocs=2, grace_period=2,
                        timeout=120)
    err = info.value
    assert err.rank == 0 and err.exc_type == "mplaunch.WorkerError"
    inner = err.__cause__
    assert isinstance(inner, mplaunch.WorkerError) and inner.rank == 1
    assert type(inner.__cause__) is KeyError and inner.__cause__.args == ("deep",)
    err_text = capfd.readouterr().err
    assert "[rank0]: [rank1]: KeyError: 'deep'" in err_text   # both prefixes
    # Rank 1's inner ranks were running when rank 0 failed: they are gone too.
    pids = [int(name) for name in os.listdir(tmp_path)]
    assert len(pids) == 2
    deadline = time.monotonic() + 10
    while any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
              for p in pids):
        assert time.monotonic() < deadline, pids
        time.sleep(0.05)
