"""A World across the nodes of a real SLURM allocation (mplaunch.World(nprocs=2,
nnodes=2): 2 ranks on each node): the throwaway two-node cluster of slurm_cluster (n1
and n2, both on 127.0.0.1, whose names do not resolve: master_addr is given).

The scenarios every scheduler runs (tests/nodes_scenarios.py) run here in the pytest
process itself, made a process inside an allocation: the `allocation` fixture holds one
(`salloc -N2`) per test and puts the environment salloc gives its command into this
process's (monkeypatch), so the World's srun runs its step in that job, as from a shell
of salloc. `SlurmNodes` tells the scenarios what SLURM says: the nodes' names, the SLURM
task variables of each rank, and the job's steps as squeue lists them (exactly one while
a World is up, the same one through every heal). Every such test ends by proving that
the job had no step left, and, once the allocation was over, that the controller knows
no job and no process of the cluster's jobs is left (SlurmCluster.job_processes finds
them by pid, never by name).

What only SLURM has: an allocation too small, two Worlds' steps in one job, a step
cancelled with scancel; and what needs a script of its own, started as a user starts
one (`salloc -N2 python SCRIPT`, `sbatch`; tests/scripts_slurm, one JSON line per check):
a Jupyter kernel inside the allocation, the pytest plugin's reuse, a launching process
that exits or is killed with its World open, batch jobs, a frozen node, per-rank options.

Several tests here began as strict xfails for bugs they found (agents that could not
start a second group of ranks, a frozen node that hung run() and close(), uneven
allocations, env= callables and log_dir= across nodes, a silent client at the agents'
port); they pass since each was fixed.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import psutil
import pytest

pytest.register_assert_rewrite("nodes_scenarios")

import mplaunch  # noqa: E402
import nodes_scenarios  # noqa: E402
import slurm_cluster as harness  # noqa: E402
from nodes_scenarios import *  # noqa: E402,F401,F403 - the shared scenarios
from nodes_scenarios import (agents, alive, allreduce_sum, whoami,  # noqa: E402
                             world_processes)

pytestmark = pytest.mark.slurm

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SCRIPTS = os.path.join(HERE, "scripts_slurm")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    harness.require_slurm()
    with harness.slurm_cluster(tmp_path_factory.mktemp("slurm")) as c:
        yield c


@pytest.fixture
def allocation(cluster, monkeypatch):
    """This process inside a fresh `salloc -N2` allocation for the test; on its end, the
    job must have no step left, and nothing of it may be left once it is over."""
    with cluster.allocation(2) as alloc:
        for name in list(os.environ):
            if name.startswith("SLURM_"):
                monkeypatch.delenv(name)
        for name, value in alloc.slurm_env.items():
            monkeypatch.setenv(name, value)
        yield alloc


SLURM_TASK_VARS = ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID", "SLURM_NTASKS",
                   "SLURM_TASK_PID")


class SlurmNodes(nodes_scenarios.Nodes):
    """The nodes of this process's allocation: one srun step of agents per World."""
    scheduler = "slurm"
    gone_within = 10.0
    replaces = True     # a lost node's agent again, in a step of its own (srun --exclude)

    def __init__(self, cluster, alloc):
        self.cluster, self.job = cluster, alloc.job

    def options(self, **options):
        options.setdefault("master_addr", "127.0.0.1")   # n1, n2 do not resolve
        return super().options(**options)

    def steps(self):
        return [list(s) for s in self.cluster.steps(self.job)]

    def step(self, w):
        """The World's one step of the job (JOB.STEP), named mplaunch-world: a step that
        ended a moment ago (cancelled, restarted, a replacement's) may still be listed,
        as squeue hears of a step's end late."""
        deadline = time.monotonic() + 20
        while len(steps := self.steps()) != 1 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert len(steps) == 1 and steps[0][1] == "mplaunch-world", steps
        assert steps[0][0].startswith(f"{self.job}."), steps
        return steps[0][0]

    def check_up(self, w):
        # the World's step, and one more for each node it replaced
        steps = self.steps()
        assert steps and all(s[1] == "mplaunch-world" for s in steps), steps
        assert all(s[0].startswith(f"{self.job}.") for s in steps), steps

    def check_closed(self):
        deadline = time.monotonic() + 20        # squeue hears of a step's end late
        while self.steps() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert self.steps() == []

    def step_pids(self, w):
        """srun, this process's child: the step as this machine holds it."""
        return {p.pid for p in psutil.Process().children() if p.name() == "srun"}

    def check_names(self, names):
        # where SLURM put them: node 0 is n1, node 1 is n2
        assert names == list(self.cluster.nodes[:len(names)]), names

    def check_rank_env(self, w, rank, node, local, got):
        env = got["env"]
        assert env["SLURMD_NODENAME"] == w.nodes[node]["name"], (rank, env)
        # the SLURM task variables are the ranks' (mplaunch rewrites them), as srun gives
        # each task: its own pid (not its node agent's)
        assert {k: env.get(k) for k in SLURM_TASK_VARS} == {
            "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(local),
            "SLURM_NODEID": str(node), "SLURM_NTASKS": str(w.size),
            "SLURM_TASK_PID": str(got["pid"])}, (rank, env)
        # in the World's one step of the allocation
        assert env["SLURM_JOB_ID"] == self.job
        assert f"{self.job}.{env['SLURM_STEP_ID']}" in [s[0] for s in self.steps()], (
            rank, env)
        # the job's name as this process sees it, not the step's (mplaunch-world)
        assert env.get("SLURM_JOB_NAME") == os.environ.get("SLURM_JOB_NAME"), env
        assert env["MASTER_ADDR"] == "127.0.0.1"


@pytest.fixture
def sched(cluster, allocation):
    return SlurmNodes(cluster, allocation)


# -- what only an allocation has --------------------------------------------------------

def test_more_nodes_than_the_allocation_has_is_refused_before_anything_starts(sched):
    with pytest.raises(ValueError) as info:
        sched.world(nnodes=3)
    msg = str(info.value)
    assert f"(job {sched.job}) has 2 node(s)" in msg and "salloc -N 3" in msg, msg
    assert sched.steps() == []


def test_outside_an_allocation_a_world_across_nodes_says_how_to_get_one(monkeypatch):
    for name in list(os.environ):
        if name.startswith("SLURM_"):
            monkeypatch.delenv(name)
    with pytest.raises(RuntimeError, match="not inside a SLURM allocation"):
        mplaunch.World(2, nnodes=2, scheduler="slurm", master_addr="127.0.0.1")


def test_two_worlds_at_once_each_have_a_step_of_their_own(sched):
    with sched.world() as w:
        first = w.run(whoami)
        [[step, _]] = sched.steps()
        with sched.world(nprocs=1) as w2:
            second = w2.run(whoami)
            both = sched.steps()
            results = (w.run(allreduce_sum), w2.run(allreduce_sum))
            seen = world_processes(w) | world_processes(w2)
        # the second World's srun is gone when close() returns; squeue hears of its
        # step's end late (as check_closed knows)
        deadline = time.monotonic() + 20
        while (after := sched.steps()) != [[step, "mplaunch-world"]] and \
                time.monotonic() < deadline:
            time.sleep(0.2)
    job = sched.job
    assert {g["env"]["SLURM_STEP_ID"] for g in first} == {step.split(".")[1]}
    second_step = [s for s, _ in both if s != step]
    assert sorted(both) == sorted([[step, "mplaunch-world"],
                                   [second_step[0], "mplaunch-world"]]), both
    assert second_step[0].startswith(f"{job}.")
    assert [(g["env"]["RANK"], g["env"]["SLURMD_NODENAME"], g["env"]["SLURM_STEP_ID"])
            for g in second] == [("0", "n1", second_step[0].split(".")[1]),
                                 ("1", "n2", second_step[0].split(".")[1])]
    assert results == ([10.0] * 4, [3.0, 3.0])
    assert after == [[step, "mplaunch-world"]]        # the second World's step ended
    sched.check_closed()
    assert alive(seen) == []


def test_a_cancelled_step_is_lost_on_both_nodes_and_the_next_run_starts_a_new_step(
        sched):
    with sched.world(grace_period=2) as w:
        assert w.run(allreduce_sum) == [10.0] * 4
        step = sched.step(w)
        old = world_processes(w) | sched.step_pids(w)
        # SLURM kills both agents
        cancel = subprocess.run(["scancel", step], capture_output=True, text=True,
                                timeout=30)
        assert cancel.returncode == 0, cancel.stderr
        # scancel only asks: the step's tasks end a moment later (CI, by chance: the
        # next run, a few ms, returned from the ranks before SLURM ended them)
        assert alive(set(agents(w)), timeout=20) == [], "scancel left the agents"
        with pytest.raises(mplaunch.WorkerError) as info:
            w.run(allreduce_sum, timeout=60)
        assert "was lost" in str(info.value), str(info.value)
        # the step ended, and every process of the World with it, on both nodes
        assert alive(old, timeout=20) == []
        assert w.run(allreduce_sum) == [10.0] * 4
        assert sched.step(w) != step
        assert [n["name"] for n in w.nodes] == ["n1", "n2"]
        assert not set(agents(w)) & old


# -- a script of its own inside an allocation -------------------------------------------

def _salloc(cluster, argv, timeout=150, env=None):
    """`salloc -N2 argv...` from the repository root, mplaunch importable."""
    extra = {"PYTHONPATH": os.pathsep.join(
        p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)}
    extra.update(env or {})
    return cluster.run(["salloc", "-N2", *argv], timeout=timeout, cwd=ROOT, env=extra)


def _checks(res) -> dict:
    checks = {}
    for line in res.stdout.splitlines():
        if line.startswith("{"):
            doc = json.loads(line)
            checks[doc["check"]] = doc
    return checks


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _settled(cluster, timeout=20.0):
    """Once an allocation is over: (jobs squeue still shows, processes of the cluster's
    jobs still alive), after giving the controller time to forget the job."""
    deadline = time.monotonic() + timeout
    while True:
        jobs, procs = cluster.job_ids(), cluster.job_processes()
        if (not jobs and not procs) or time.monotonic() > deadline:
            return jobs, procs
        time.sleep(0.2)


def _run_script(cluster, name, *args, timeout=150):
    res = _salloc(cluster, [sys.executable, os.path.join(SCRIPTS, name), *args],
                  timeout=timeout)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out
    checks = _checks(res)
    jobs, procs = _settled(cluster)
    return checks, out, jobs, procs


# -- a Jupyter kernel inside the allocation ----------------------------------------------

@pytest.mark.notebook
def test_ddp_across_nodes_from_a_kernel_inside_the_allocation(cluster):
    pytest.importorskip("nbclient")
    res = _salloc(cluster, [sys.executable, os.path.join(SCRIPTS, "kernel_driver.py")],
                         timeout=170)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out
    cells, steps, interrupted = {}, {}, None
    for line in res.stdout.splitlines():
        if line.startswith("{"):
            doc = json.loads(line)
            if doc["check"] == "cell":
                cells[doc["id"]] = doc
            elif doc["check"] == "steps":
                steps[doc["after"]] = doc["steps"]
            elif doc["check"] == "interrupted":
                interrupted = doc["pids"]
    assert list(cells) == ["start", "model", "step", "check", "fails", "interrupt",
                           "after", "status", "stop"], out
    for name, cell in cells.items():
        if name not in ("fails", "interrupt"):
            assert not cell["errors"], (name, cell["errors"])

    start = cells["start"]["stdout"]
    # NPROCS is per node, as for launch: `%ranks start 2 --nodes 2` is 4 ranks
    assert "%ranks: started 4 ranks on 2 nodes (n1, n2), 2 on each, backend gloo" in start, \
        start
    [[step, name]] = steps["start"]
    assert step.endswith(".0") and name == "mplaunch-world", steps
    lines = sorted(cells["model"]["stdout"].splitlines())
    assert lines == [f"[{n} rank{r}]: model on {n} rank {r} of 4"
                     for r, n in enumerate(["n1", "n1", "n2", "n2"])], lines
    assert sorted(cells["step"]["stdout"].splitlines()) == [
        f"[{n} rank{r}]: stepped {r}" for r, n in enumerate(["n1", "n1", "n2", "n2"])]
    # after a step on different batches, DDP kept the parameters equal on all 4 ranks
    assert sorted(cells["check"]["stdout"].splitlines()) == [
        f"[{n} rank{r}]: equal True trained True node {n} step 0"
        for r, n in enumerate(["n1", "n1", "n2", "n2"])], cells["check"]["stdout"]
    assert steps["check"] == steps["start"], "the cells ran in the World's one step"

    # rank 3 (on n2) raises: the cell shows it, the other ranks' output, the world kept
    [fails] = cells["fails"]["errors"]
    assert "ValueError: rank 3 on n2 says no" in fails, fails
    assert "the world was kept" in fails, fails
    # the note names the rank's node, as %ranks does
    assert re.search(r"^%%ranks: rank 3 on node 1 \(n2, pid \d+\) raised this; the world "
                     r"was kept", fails, re.M), fails
    assert sorted(cells["fails"]["stdout"].splitlines()) == [
        "[n1 rank0]: fine 0", "[n1 rank1]: fine 1", "[n2 rank2]: fine 2"]
    # shown once, as the cell's error: the rank does not relay its traceback too
    assert "ValueError" not in cells["fails"]["stderr"], cells["fails"]["stderr"]
    # the stop button, while every rank sleeps in the cell: all four interrupted, kept
    [interrupt] = cells["interrupt"]["errors"]
    assert "KeyboardInterrupt" in interrupt and "the world was kept" in interrupt, interrupt
    # each rank says in one line where the interrupt found it, no traceback
    for rank, node in enumerate(["n1", "n1", "n2", "n2"]):
        assert re.search(rf"^\[{node} rank{rank}\]: \[mplaunch\] rank {rank}: interrupted "
                         r"at \S+:\d+ in ", cells["interrupt"]["stderr"], re.M), \
            cells["interrupt"]["stderr"]
    assert "Traceback" not in cells["interrupt"]["stderr"], cells["interrupt"]["stderr"]
    pids = {int(k): int(v) for k, v in
            re.findall(r"(\d+): (\d+)", re.search(r"pids \{(.*?)\}", start).group(1))}
    assert sorted(pids) == [0, 1, 2, 3], start
    assert {int(k): v for k, v in interrupted.items()} == pids, (interrupted, pids)
    # ... and the cell after them finds the same processes, their names kept
    assert sorted(cells["after"]["stdout"].splitlines()) == [
        f"[{n} rank{r}]: still {r} {pids[r]} DistributedDataParallel"
        for r, n in enumerate(["n1", "n1", "n2", "n2"])], cells["after"]["stdout"]
    assert steps["after"] == steps["start"]

    status = cells["status"]["stdout"]
    assert status.startswith("4 ranks on 2 nodes, 2 on each, backend gloo: up"), status
    for rank, node in enumerate(["0 (n1", "0 (n1", "1 (n2", "1 (n2"]):
        assert f"rank {rank} on node {node}, pid " in status, status
    assert cells["stop"]["stdout"] == "%ranks: stopped 4 ranks\n"
    assert steps["stop"] == [], steps
    jobs, procs = _settled(cluster)
    assert jobs == [] and procs == [], (jobs, procs, out)


# -- the pytest plugin's reuse across nodes ----------------------------------------------

def test_plugin_reuse_tests_share_one_world_across_the_nodes_through_a_failure(cluster,
                                                                               tmp_path):
    inner = tmp_path / "inner"
    inner.mkdir()
    out = tmp_path / "out"
    out.mkdir()
    (inner / "pytest.ini").write_text("[pytest]\naddopts = --strict-markers -p "
                                      "no:cacheprovider\nfilterwarnings = error\n")
    test_file = inner / "test_reuse_nodes.py"
    shutil.copy(os.path.join(SCRIPTS, "reuse_nodes_inner.py"), test_file)
    res = cluster.run(["salloc", "-N2", sys.executable, "-m", "pytest", "-rA", "-q",
                       str(test_file)], timeout=150, cwd=str(inner),
                      env={"PYTHONPATH": ROOT, "OUT": str(out),
                           "MPLAUNCH_TEST_NNODES": "2"})
    text = res.stdout + res.stderr
    assert res.returncode == 1, text
    assert "1 failed, 4 passed" in res.stdout, text
    assert "FAILED test_reuse_nodes.py::test_d_fails_on_node_1" in res.stdout, text
    assert "FAILS-IN-RANK-2 on n2" in res.stdout, text
    assert "raised in rank 2 of 4 " in res.stdout, text    # nprocs=2 on each of 2 nodes

    def recorded(name):
        return {int(f.name.rsplit("rank", 1)[1]): tuple(f.read_text().split())
                for f in out.iterdir() if f.name.startswith(name + "-rank")}

    a, c = recorded("a"), recorded("c")
    assert sorted(a) == [0, 1, 2, 3], text
    assert [a[r][1] for r in range(4)] == ["n1", "n1", "n2", "n2"], a
    assert a == c, "the two tests ran in different worlds"
    assert recorded("e") == a, "the failing test's World was not kept for the next"
    steps = (out / "steps").read_text().split("\n")
    assert [s.split() for s in steps if s.strip()] == [[f"{_job_of(steps)}.0",
                                                        "mplaunch-world"]], steps
    jobs, procs = _settled(cluster)
    assert jobs == [] and procs == [], (jobs, procs, text)
    assert [p for p in (int(v[0]) for v in a.values()) if _alive(p)] == []


def _job_of(steps):
    return next(s.split()[0].split(".")[0] for s in steps if s.strip())


# -- the launching process ends without closing the World -------------------------------

def test_a_world_left_open_or_its_process_killed_leaves_nothing_in_the_allocation(cluster):
    checks, out, jobs, procs = _run_script(cluster, "world_orphaned.py")
    exited, killed = checks["exit"], checks["kill"]
    assert exited["returncode"] == 0, out
    assert killed["returncode"] == -9, out
    for how in (exited, killed):
        [[step, name]] = how["steps_up"]
        assert name == "mplaunch-world", how
        # the allocation still runs: the step and the World's processes ended on their own
        assert how["steps"] == [] and how["alive"] == [], how
        assert how["seconds"] < 20, how
    assert jobs == [] and procs == [], (jobs, procs, out)


# -- a batch job ---------------------------------------------------------------------

def _sbatch(cluster, tmp_path, args, script, timeout=120.0):
    """Submit `script` as a batch job with `args`; wait for the job to be over; its
    output. (sbatch -W polls the controller only every few seconds.)"""
    out = tmp_path / "job.out"
    res = cluster.run(["sbatch", "--parsable", *args, "-o", str(out), "--wrap",
                       f"{sys.executable} {os.path.join(SCRIPTS, script)}"],
                      timeout=60, cwd=ROOT, env={"PYTHONPATH": ROOT})
    assert res.returncode == 0, res.stdout + res.stderr
    job = res.stdout.strip().split(";")[0]
    deadline = time.monotonic() + timeout
    while job in cluster.job_ids() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert job not in cluster.job_ids(), f"job {job} still running after {timeout} s"
    return out.read_text() if out.exists() else ""


def test_a_batch_job_with_as_many_cpus_on_each_node(cluster, tmp_path):
    text = _sbatch(cluster, tmp_path, ["-N2"], "world_batch.py")
    checks = {json.loads(l)["check"]: json.loads(l) for l in text.splitlines()
              if l.startswith("{")}
    assert "batch" in checks, text
    assert checks["batch"]["results"] == [["n1", 10.0], ["n1", 10.0], ["n2", 10.0],
                                          ["n2", 10.0]], text
    jobs, procs = _settled(cluster)
    assert jobs == [] and procs == [], (jobs, procs, text)


def test_a_batch_job_with_fewer_cpus_on_one_node(cluster, tmp_path):
    text = _sbatch(cluster, tmp_path, ["-N2", "-n3"], "world_batch.py")
    checks = {json.loads(l)["check"]: json.loads(l) for l in text.splitlines()
              if l.startswith("{")}
    try:
        assert "batch" in checks, text
        assert checks["batch"]["env"]["SLURM_JOB_CPUS_PER_NODE"] == "2,1"
        assert [r[0] for r in checks["batch"]["results"]] == ["n1", "n1", "n2", "n2"]
        assert {r[1] for r in checks["batch"]["results"]} == {10.0}
    finally:
        jobs, procs = _settled(cluster)
        assert jobs == [] and procs == [], (jobs, procs, text)


# -- a frozen node --------------------------------------------------------------------


@pytest.mark.slow
def test_a_run_with_a_frozen_node_ends_at_its_timeout(cluster):
    checks, out, jobs, procs = _run_script(cluster, "world_frozen_node.py", "run")
    run = checks["run"]
    assert jobs == [] and procs == [], (jobs, procs, out)
    assert run["rescued"] == [], f"run(timeout=3) came back only when the agent woke: {run}"
    assert run["error"].startswith(("LaunchTimeout", "WorkerError")), run
    assert run["seconds"] < 12, run


@pytest.mark.slow
def test_close_with_a_frozen_node_returns_and_ends_the_step(cluster):
    checks, out, jobs, procs = _run_script(cluster, "world_frozen_node.py", "close")
    closed = checks["close"]
    assert jobs == [] and procs == [], (jobs, procs, out)
    assert closed["rescued"] == [], f"close() came back only when the agent woke: {closed}"
    assert closed["error"] is None, closed
    assert closed["steps"] == [] and closed["alive"] == [], closed


# -- per-rank options ------------------------------------------------------------------

@pytest.fixture(scope="module")
def world_options(cluster):
    return _run_script(cluster, "world_options.py")


def test_env_dict_and_cpus_per_rank_across_nodes(world_options):
    checks, out, jobs, procs = world_options
    assert jobs == [] and procs == [], (jobs, procs, out)
    c = checks["cpus_per_rank"]
    assert [e[2] for e in c["env"]] == ["yes"] * 4, c
    # each node places its own ranks on the CPUs it has: one disjoint slice per rank
    for node in c["nodes"]:
        cpus = [tuple(s) for s in node["cpus"]]
        assert len(cpus) == 2 and not set(cpus[0]) & set(cpus[1]), node
        assert set(cpus[0]) | set(cpus[1]) <= set(node["allowed"]), node
    for rank, name, affinity in c["ranks"]:
        node = c["nodes"][int(rank) // 2]
        assert name == node["name"]
        assert affinity == sorted(node["cpus"][int(rank) % 2]), (rank, affinity, node)


def test_env_callable_is_called_with_each_global_rank(world_options):
    checks, out, _, _ = world_options
    assert checks["env_callable"]["ranks"] == [[str(r), str(r), None] for r in range(4)], \
        checks["env_callable"]


def test_log_dir_keeps_every_ranks_output_across_nodes(world_options):
    checks, out, _, _ = world_options
    files = checks["log_dir"]["files"]
    stdout = "".join(text for name, text in files.items() if name.endswith("stdout.log"))
    for rank in range(4):
        assert stdout.count(f"hello from rank {rank}\n") == 1, (rank, files)


# -- a spare node of the allocation ---------------------------------------------------------

@pytest.fixture(scope="module")
def three(tmp_path_factory):
    harness.require_slurm()
    with harness.slurm_cluster(tmp_path_factory.mktemp("slurm3"), nodes=3) as c:
        yield c


def test_a_lost_node_is_replaced_on_the_allocations_spare_node(three, monkeypatch):
    """A World of 2 nodes in an allocation of 3 (salloc -N3): node 1 lost, its ranks
    start again on the third node, not on the lost one (which may be failing), and the
    ranks on node 0 keep their processes and state."""
    with three.allocation(3) as alloc:
        for name in [n for n in os.environ if n.startswith("SLURM_")]:
            monkeypatch.delenv(name)
        for name, value in alloc.slurm_env.items():
            monkeypatch.setenv(name, value)
        with mplaunch.World(2, nnodes=2, spare_nodes=1, backend="gloo",
                            master_addr="127.0.0.1", grace_period=2) as w:
            assert w.run(nodes_scenarios.count_calls) == [1] * 4
            assert [n["name"] for n in w.nodes] == ["n1", "n2"]
            kept = [w.pids[0], w.pids[1]]
            os.kill(w.nodes[1]["agent_pid"], signal.SIGKILL)
            with pytest.raises(mplaunch.WorkerError, match=r"node 1 \(n2\)"):
                w.run(nodes_scenarios.count_calls, timeout=60)
            assert [n["name"] for n in w.nodes] == ["n1", "n3"]
            assert w.run(nodes_scenarios.count_calls) == [3, 3, 1, 1]
            assert [w.pids[0], w.pids[1]] == kept
            assert w.run(allreduce_sum) == [10.0] * 4
            got = w.run(whoami)
            assert [g["env"]["SLURMD_NODENAME"] for g in got] == ["n1", "n1", "n3", "n3"]
            assert [g["env"]["SLURM_NODEID"] for g in got] == ["0", "0", "1", "1"]
            held = world_processes(w)
        assert alive(held, timeout=20) == []


# -- no spare: going on with the nodes left ---------------------------------------------

def test_a_node_taken_down_in_a_no_kill_allocation_leaves_the_others_to_go_on(
        cluster, monkeypatch):
    """salloc --no-kill -N2, a World on both; n2 taken down as a failed host is
    (scontrol State=DOWN): SLURM ends the job's processes there and keeps the job on
    n1, which leaves no node to replace n2 with. The ranks on n1 are kept, and
    restart(nnodes=1) goes on with them in the World's step, their SLURM task variables
    renumbered with them."""
    with cluster.allocation(2, args=["--no-kill"]) as alloc:
        for name in [n for n in os.environ if n.startswith("SLURM_")]:
            monkeypatch.delenv(name)
        for name, value in alloc.slurm_env.items():
            monkeypatch.setenv(name, value)
        try:
            with mplaunch.World(2, nnodes=2, backend="gloo", master_addr="127.0.0.1",
                                grace_period=2) as w:
                assert w.run(nodes_scenarios.count_calls) == [1] * 4
                kept = {0: w.pids[0], 1: w.pids[1]}
                down = cluster._quiet(["scontrol", "update", "NodeName=n2", "State=DOWN",
                                       "Reason=mplaunch-test"])
                assert down.returncode == 0, down.stderr
                end = time.monotonic() + 30     # SLURM ends the tasks there, then ...
                while w.nodes[1]["lost"] is None:   # ... the World hears its agent go
                    assert time.monotonic() < end, "n2's agent outlived State=DOWN"
                    time.sleep(0.05)
                with pytest.raises(mplaunch.WorkerError, match=r"node 1 \(n2\)") as info:
                    w.run(nodes_scenarios.count_calls, timeout=120)
                healed = str(info.value.healed)
                assert "world.restart(nnodes=1) goes on with them" in healed, healed
                w.restart(nnodes=1)
                assert w.pids == kept and w.size == 2
                assert w.run(nodes_scenarios.count_calls) == [3, 3]
                assert w.run(allreduce_sum) == [3.0, 3.0]
                got = w.run(whoami)
                assert [g["env"]["SLURMD_NODENAME"] for g in got] == ["n1", "n1"]
                assert [(g["env"]["SLURM_PROCID"], g["env"]["SLURM_NTASKS"],
                         g["env"]["WORLD_SIZE"]) for g in got] == [("0", "2", "2"),
                                                                   ("1", "2", "2")]
                held = world_processes(w)
            assert alive(held, timeout=20) == []
        finally:
            cluster._quiet(["scontrol", "update", "NodeName=n2", "State=RESUME"])
