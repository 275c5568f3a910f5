"""The SLURM test harness (tests/slurm_cluster.py) really gives two nodes.

Select with ``-m slurm``.  Skipped where slurm-wlm/munge are not installed
(``.ci/install-slurm.sh``).
"""

import json
import os
import subprocess
import sys
import time

import pytest

# pytest's default "prepend" import mode puts tests/ on sys.path for this
# file; do it by hand too so that --import-mode=importlib works as well.
_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

import slurm_cluster as harness  # noqa: E402
from slurm_cluster import SlurmCluster, SlurmClusterError, require_slurm, slurm_cluster  # noqa: E402

# Bind the fixture at module level: that is how pytest finds it.
slurm = harness.slurm

pytestmark = pytest.mark.slurm

SRUN = ["srun", "-N2", "-n2"]


def _assert_pids_gone(pids):
    for name, pid in pids.items():
        try:
            os.kill(pid, 0)  # fails once the pid is reaped; a zombie would not
        except ProcessLookupError:
            continue
        raise AssertionError(f"{name} (pid {pid}) is still there")


def _children():
    """Pids whose parent is this process (zombies included)."""
    me = str(os.getpid())
    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            if stat[stat.rfind(")") + 2:].split()[1] == me:
                kids.append(int(entry))
    return kids


def test_cluster_starts_and_stops_cleanly(tmp_path, record_property):
    require_slurm()
    fds_before = sorted(os.listdir("/proc/self/fd"))
    kids_before = _children()
    t0 = time.monotonic()
    with slurm_cluster(tmp_path / "slurm") as cluster:
        started = time.monotonic() - t0
        pids = cluster.pids
        assert set(pids) == {"munged", "slurmctld", "slurmd-n1", "slurmd-n2"}
        assert cluster.node_states() == {"n1": "idle", "n2": "idle"}
        t1 = time.monotonic()
    stopped = time.monotonic() - t1
    record_property("slurm_start_s", round(started, 3))
    record_property("slurm_stop_s", round(stopped, 3))
    print(f"\nslurm cluster: start {started:.2f}s, stop {stopped:.2f}s")
    assert started < 30
    _assert_pids_gone(pids)
    assert _children() == kids_before
    assert sorted(os.listdir("/proc/self/fd")) == fds_before
    assert not cluster.run_dir.exists()
    assert (cluster.log_dir / "slurmctld.log").exists()  # logs are kept


def test_one_task_on_each_node(slurm: SlurmCluster):
    r = slurm.run(SRUN + ["bash", "-c", "echo $SLURM_NODEID $SLURM_PROCID $SLURMD_NODENAME"],
                  timeout=60)
    assert r.returncode == 0, r.stderr
    rows = sorted(tuple(line.split()) for line in r.stdout.splitlines())
    # Block distribution: rank 0 on the first node, rank 1 on the second.
    assert rows == [("0", "0", "n1"), ("1", "1", "n2")], r.stdout


def test_srun_exports_job_variables_to_tasks(slurm: SlurmCluster):
    keys = ["SLURM_JOB_ID", "SLURM_NNODES", "SLURM_NODEID", "SLURM_JOB_NODELIST",
            "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"]
    code = ("import json, os, sys; "
            f"print(json.dumps({{k: os.environ.get(k) for k in {keys!r}}}))")
    # sys.executable: the tasks can run this very interpreter, as mplaunch will.
    r = slurm.run(SRUN + [sys.executable, "-c", code], timeout=60)
    assert r.returncode == 0, r.stderr
    envs = sorted((json.loads(line) for line in r.stdout.splitlines()),
                  key=lambda e: e["SLURM_PROCID"])
    assert len(envs) == 2, r.stdout
    assert envs[0]["SLURM_JOB_ID"] and envs[0]["SLURM_JOB_ID"].isdigit()
    assert envs[0]["SLURM_JOB_ID"] == envs[1]["SLURM_JOB_ID"]
    for rank, env in enumerate(envs):
        assert env["SLURM_NNODES"] == "2"
        assert env["SLURM_NTASKS"] == "2"
        assert env["SLURM_NODEID"] == str(rank)
        assert env["SLURM_LOCALID"] == "0"
        assert env["SLURM_JOB_NODELIST"] == "n[1-2]"


def test_failing_task_makes_srun_fail(slurm: SlurmCluster):
    r = slurm.run(SRUN + ["bash", "-c", 'if [ "$SLURM_PROCID" = 1 ]; then exit 3; fi'],
                  timeout=60)
    assert r.returncode == 3, (r.returncode, r.stderr)
    assert "exit code 3" in r.stderr


def _wait_for_tasks(cluster: SlurmCluster, srun: subprocess.Popen, n: int) -> None:
    """Wait until ``n`` ``sleep`` tasks of the cluster are running."""
    deadline = time.monotonic() + 30
    while sum(name == "sleep" for _, name in cluster.job_processes()) < n:
        assert srun.poll() is None, srun.communicate()
        assert time.monotonic() < deadline, f"tasks did not start: {cluster.job_processes()}"
        time.sleep(0.1)


def test_teardown_cancels_running_job(tmp_path):
    """A job still running when the cluster stops is cancelled; nothing is left."""
    require_slurm()
    srun = None
    try:
        with slurm_cluster(tmp_path / "slurm") as cluster:
            pids = cluster.pids
            srun = subprocess.Popen(SRUN + ["sleep", "300"], env=cluster.env,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                    text=True)
            _wait_for_tasks(cluster, srun, 2)
    finally:
        # srun ends when the teardown cancels its job; reap it either way.
        if srun is not None:
            with srun:
                _, err = srun.communicate(timeout=30)
    assert srun.returncode != 0, err
    _assert_pids_gone(pids)
    assert cluster.job_processes() == []


def test_teardown_kills_tasks_that_escaped_slurm(tmp_path):
    """Tasks that double-fork out of slurmstepd's tree survive scancel; the
    teardown still finds them (by the marker in their environment), kills
    them and reports it as an error."""
    require_slurm()
    script = "(setsid sleep 300 </dev/null >/dev/null 2>&1 &); exec sleep 300"
    srun = None
    try:
        with pytest.raises(SlurmClusterError, match="had to SIGKILL leftover") as info:
            with slurm_cluster(tmp_path / "slurm") as cluster:
                pids = cluster.pids
                srun = subprocess.Popen(SRUN + ["bash", "-c", script], env=cluster.env,
                                        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                        text=True)
                _wait_for_tasks(cluster, srun, 4)
    finally:
        if srun is not None:
            with srun:
                srun.communicate(timeout=30)
    assert "sleep" in str(info.value)
    _assert_pids_gone(pids)
    assert cluster.job_processes() == []


def test_run_timeout_aborts_the_step(slurm: SlurmCluster):
    with pytest.raises(subprocess.TimeoutExpired):
        slurm.run(SRUN + ["sleep", "300"], timeout=2)
    # srun was interrupted and reaped; its tasks go away with the step.
    deadline = time.monotonic() + 15
    while slurm.job_processes():
        assert time.monotonic() < deadline, slurm.job_processes()
        time.sleep(0.1)


def test_sbatch_job_runs_on_both_nodes(slurm: SlurmCluster, tmp_path):
    out = tmp_path / "job.out"
    r = slurm.run(["sbatch", "--wait", "-N2", "-n2", "-o", str(out),
                   "--wrap", "srun bash -c 'echo $SLURMD_NODENAME'"],
                  timeout=60, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert sorted(out.read_text().split()) == ["n1", "n2"]
