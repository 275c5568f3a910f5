"""The inner session of test_slurm_world's plugin test, run by `salloc -N2 python -m
pytest` with MPLAUNCH_TEST_NNODES=2 and OUT naming a directory: reuse tests in a World
across the allocation's two nodes, nprocs=2 ranks on each. Each rank of each test
writes OUT/<test>-rank<R> = "pid node"; the plain test in between (run in this pytest
process, inside the allocation) writes OUT/steps, the job's steps while the World is
up. A test failing in rank 2 (on n2) heals the World, and the test after it runs in the
same ranks."""
import os
import pathlib
import subprocess

import pytest
import torch
import torch.distributed as dist

OUT = pathlib.Path(os.environ["OUT"])


def record(name):
    (OUT / f"{name}-rank{os.environ['RANK']}").write_text(
        f"{os.getpid()} {os.environ.get('SLURMD_NODENAME')}")


@pytest.mark.mplaunch(nprocs=2, nnodes=2, reuse=True, master_addr="127.0.0.1")
def test_a_explicit_nodes():
    assert dist.get_world_size() == 4
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    assert t.item() == 10.0
    record("a")


def test_b_plain_in_between():
    out = subprocess.run(["squeue", "-s", "-j", os.environ["SLURM_JOB_ID"], "-h", "-o",
                          "%i %j"], capture_output=True, text=True, timeout=30).stdout
    (OUT / "steps").write_text(out)


# nnodes from MPLAUNCH_TEST_NNODES: the same options, so the same World
@pytest.mark.mplaunch(nprocs=2, reuse=True, master_addr="127.0.0.1")
def test_c_nodes_from_the_environment():
    t = torch.ones(1) * dist.get_rank()
    dist.broadcast(t, src=3)
    assert t.item() == 3.0
    record("c")


@pytest.mark.mplaunch(nprocs=2, nnodes=2, reuse=True, master_addr="127.0.0.1")
def test_d_fails_on_node_1():
    assert dist.get_rank() != 2, "FAILS-IN-RANK-2 on " + os.environ["SLURMD_NODENAME"]


@pytest.mark.mplaunch(nprocs=2, nnodes=2, reuse=True, master_addr="127.0.0.1")
def test_e_after_the_failure():
    dist.barrier()
    record("e")
