"""mplaunch under a real SLURM: two slurmd nodes on loopback, one srun task per node,
each running `python -m mplaunch --nprocs 2`, forming one world of 4 ranks."""
import os
import sys

import pytest

import slurm_cluster as harness

slurm = harness.slurm
pytestmark = pytest.mark.slurm

SCRIPT = os.path.join(os.path.dirname(__file__), "scripts_slurm", "allreduce.py")


def _srun(cluster, mode, timeout=150):
    # The nodes' names (n1, n2) do not resolve on this one machine, so the master
    # address is given; node count, node rank and port come from SLURM itself.
    return cluster.run(["srun", "-N2", "-n2", "--ntasks-per-node=1", sys.executable, "-m",
                        "mplaunch", "--nprocs", "2", "--master-addr", "127.0.0.1",
                        "--grace-period", "2", SCRIPT, mode],
                       timeout=timeout, cwd=os.path.dirname(os.path.dirname(SCRIPT)))


def test_srun_two_nodes_all_reduce_over_four_ranks(slurm):
    res = _srun(slurm, "ok")
    assert res.returncode == 0, res.stdout + res.stderr
    lines = sorted(l for l in res.stdout.splitlines() if " of 4 on node " in l)
    assert len(lines) == 4, res.stdout + res.stderr
    for rank, line in enumerate(lines):
        assert f"rank {rank} of 4 on node {rank // 2} (slurm node {rank // 2}): 10" in line
    assert not slurm.job_processes()


def test_a_failing_rank_on_one_node_ends_both(slurm):
    res = _srun(slurm, "fail")
    assert res.returncode == 7, res.stdout + res.stderr
    # both nodes' watchers report the same failure: rank 3, on node 1
    assert res.stderr.count("rank 3") >= 2, res.stderr
    assert not slurm.job_processes()
