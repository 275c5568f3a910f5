"""A World across the nodes of a real SLURM allocation (mplaunch.World(nprocs=2,
nnodes=2): 2 ranks on each node): the throwaway two-node cluster of slurm_cluster (n1 and n2, both on
127.0.0.1, whose names do not resolve: master_addr is given), a script started by
`salloc -N2` as a user would start one, and what SLURM itself says about the job's
steps while the World is up and after it closed.

Each script (tests/scripts_slurm) prints one JSON line per check ({"check": name, ...});
the tests parse them. One cluster serves the whole module; each script gets its own
allocation, and every test ends by proving that once the allocation is over the
controller knows no job and no process of the cluster's jobs is left
(SlurmCluster.job_processes finds them by pid, never by name).

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
import sys
import time

import pytest

import slurm_cluster as harness

pytestmark = pytest.mark.slurm

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SCRIPTS = os.path.join(HERE, "scripts_slurm")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    harness.require_slurm()
    with harness.slurm_cluster(tmp_path_factory.mktemp("slurm")) as c:
        yield c


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


# -- one World through its runs and heals ------------------------------------------------

@pytest.fixture(scope="module")
def world_nodes(cluster):
    """world_nodes.py's checks, run once for the tests below."""
    return _run_script(cluster, "world_nodes.py")


def test_ranks_are_split_over_the_nodes_in_global_order(world_nodes):
    checks, out, _, _ = world_nodes
    start = checks["start"]
    assert (start["nprocs"], start["nnodes"], start["size"]) == (2, 2, 4), out
    assert " nprocs=2 nnodes=2 (4 ranks) " in start["repr"], start["repr"]
    assert [(n["node"], n["name"]) for n in start["nodes"]] == [(0, "n1"), (1, "n2")]
    ranks = start["ranks"]
    assert [r["RANK"] for r in ranks] == ["0", "1", "2", "3"], out
    assert [r["LOCAL_RANK"] for r in ranks] == ["0", "1", "0", "1"]
    assert [r["NODE_RANK"] for r in ranks] == ["0", "0", "1", "1"]
    assert [r["GROUP_RANK"] for r in ranks] == ["0", "0", "1", "1"]
    assert {r["WORLD_SIZE"] for r in ranks} == {"4"}
    assert {r["LOCAL_WORLD_SIZE"] for r in ranks} == {"2"}
    # where SLURM put them: node 0 is n1, node 1 is n2
    assert [r["SLURMD_NODENAME"] for r in ranks] == ["n1", "n1", "n2", "n2"]
    # the SLURM task variables are the ranks' (mplaunch rewrites them), in the
    # World's one step of the allocation
    assert [r["SLURM_PROCID"] for r in ranks] == ["0", "1", "2", "3"]
    assert [r["SLURM_LOCALID"] for r in ranks] == ["0", "1", "0", "1"]
    assert [r["SLURM_NODEID"] for r in ranks] == ["0", "0", "1", "1"]
    assert {r["SLURM_NTASKS"] for r in ranks} == {"4"}
    assert {r["SLURM_JOB_ID"] for r in ranks} == {start["job_id"]}
    assert {r["SLURM_STEP_ID"] for r in ranks} == {"0"}
    # as srun gives each task: its own pid (not its node agent's)
    assert [r["SLURM_TASK_PID"] for r in ranks] == [str(r["pid"]) for r in ranks], ranks
    assert {r["MASTER_ADDR"] for r in ranks} == {"127.0.0.1"}
    assert [r["pid"] for r in ranks] == [start["pids"][str(i)] for i in range(4)]
    assert [r["secret"] for r in ranks] == [[]] * 4, "the ranks see the World's secret"


def test_more_nodes_than_the_allocation_has_is_refused_before_anything_starts(world_nodes):
    checks, out, _, _ = world_nodes
    too_many = checks["too_many"]
    assert too_many["raised"] == "ValueError", out
    assert "has 2 node(s)" in too_many["message"] and "salloc -N 3" in too_many["message"]
    assert too_many["steps"] == []


def test_all_reduce_across_the_nodes(world_nodes):
    checks, out, _, _ = world_nodes
    assert checks["all_reduce"]["results"] == [10.0] * 4, out


def test_exactly_one_step_while_up_and_none_after_close(world_nodes):
    checks, out, jobs, procs = world_nodes
    job = checks["start"]["job_id"]
    assert checks["start"]["steps"] == [[f"{job}.0", "mplaunch-world"]], out
    # after a heal that replaced a dead rank, and after a timeout: still that one step
    assert checks["dead"]["steps"] == [[f"{job}.0", "mplaunch-world"]], out
    assert checks["timeout"]["steps"] == [[f"{job}.0", "mplaunch-world"]], out
    assert checks["closed"]["steps"] == [], out
    # the allocation over: no job, no process of it, none of the World's pids
    assert jobs == [] and procs == [], (jobs, procs, out)
    assert [p for p in checks["closed"]["pids"] if _alive(p)] == []


def test_two_worlds_at_once_each_have_a_step(world_nodes):
    checks, out, _, _ = world_nodes
    job = checks["start"]["job_id"]
    two = checks["two_worlds"]
    assert two["steps"] == [[f"{job}.0", "mplaunch-world"],
                            [f"{job}.1", "mplaunch-world"]], out
    assert [(r["RANK"], r["SLURMD_NODENAME"], r["SLURM_STEP_ID"]) for r in two["ranks"]] \
        == [("0", "n1", "1"), ("1", "n2", "1")]
    assert two["results"] == [[10.0] * 4, [3.0, 3.0]]
    assert two["after"] == [[f"{job}.0", "mplaunch-world"]]


def test_an_exception_heals_keeping_ranks_and_state(world_nodes):
    checks, out, _, _ = world_nodes
    exc = checks["exception"]
    assert exc["raised"] == "WorkerError" and exc["rank"] == 2, out
    assert exc["cause"] == "ValueError('rank 2 says no')"
    assert exc["healed"].startswith("the world was kept"), exc
    assert exc["same_pids"] and exc["kept"] == ["state"] * 4, exc
    assert exc["after"] == [10.0] * 4


def test_a_dead_rank_is_replaced_on_its_own_node(world_nodes):
    checks, out, _, _ = world_nodes
    dead = checks["dead"]
    assert dead["raised"] == "WorkerError" and dead["rank"] == 3, out
    assert dead["signal"] == "SIGKILL"
    assert "on n2" in dead["message"] and "[on node 1]" in dead["message"], dead["message"]
    assert "replaced" in dead["healed"], dead["healed"]
    assert dead["fresh"] == [3]
    before, after = dead["before"], dead["pids"]
    assert after["3"] != before["3"]
    assert {k: after[k] for k in "012"} == {k: before[k] for k in "012"}
    ranks = dead["ranks"]
    assert ranks[3]["pid"] == after["3"]
    assert ranks[3]["SLURMD_NODENAME"] == "n2" and ranks[3]["NODE_RANK"] == "1"
    assert ranks[3]["LOCAL_RANK"] == "1" and ranks[3]["SLURM_PROCID"] == "3"
    assert dead["kept"], "the other ranks lost their state"
    assert dead["all_reduce"] == [10.0] * 4
    # the same agents: the rank was replaced by its node's agent, not a new step
    assert dead["nodes"] == checks["start"]["nodes"]


def test_a_timeout_heals(world_nodes):
    checks, out, _, _ = world_nodes
    t = checks["timeout"]
    assert t["raised"] == "LaunchTimeout", out
    assert t["seconds"] < 30, t
    assert t["same_pids"] and t["healed"].startswith("the world was kept"), t
    assert t["after"] == [10.0] * 4


def test_a_foreign_client_at_the_store_port_does_not_disturb_the_world(world_nodes):
    checks, out, _, _ = world_nodes
    junk = checks["junk"]
    assert junk["results"] == [10.0] * 4 and junk["again"] == [10.0] * 4, out
    assert junk["pids"] == checks["start"]["pids"]


# -- a node's agent killed ---------------------------------------------------------------

def test_a_killed_agent_or_cancelled_step_ends_it_and_the_next_run_starts_anew(cluster):
    checks, out, jobs, procs = _run_script(cluster, "world_agent_killed.py")
    up, lost, ended, again = (checks[k] for k in ("up", "lost", "ended", "again"))
    [[step, name]] = up["steps"]
    job = step.split(".")[0]
    assert (step, name) == (f"{job}.0", "mplaunch-world"), out
    assert lost["raised"] == "WorkerError", out
    assert "node 1 (n2)" in lost["message"], lost["message"]
    assert f"pid {up['nodes'][1]['agent_pid']}" in lost["message"]
    assert lost["rank"] in (2, 3)
    # the step ended, and every process of the World with it, on both nodes
    assert ended["step_gone"] and ended["all_gone"], ended
    # the next run: a new World in a new step, on both nodes
    assert again["steps"] == [[f"{job}.1", "mplaunch-world"]], again
    assert [r["node"] for r in again["ranks"]] == ["n1", "n1", "n2", "n2"]
    assert {r["step"] for r in again["ranks"]} == {"1"}
    assert not set(r["pid"] for r in again["ranks"]) & set(ended["world_pids"])
    assert again["all_reduce"] == [10.0] * 4
    # scancel of the World's step: both nodes lost, then a third step
    cancel = checks["scancel"]
    assert cancel["step"] == f"{job}.1" and cancel["scancel_rc"] == 0, cancel
    assert cancel["step_gone"] and cancel["all_gone"], cancel
    assert cancel["raised"] == "WorkerError", cancel
    assert "was lost" in cancel["message"], cancel["message"]
    assert cancel["steps"] == [[f"{job}.2", "mplaunch-world"]], cancel
    assert [r["node"] for r in cancel["ranks"]] == ["n1", "n1", "n2", "n2"]
    assert cancel["all_reduce"] == [10.0] * 4
    assert checks["closed"]["step_gone"], out
    assert jobs == [] and procs == [], (jobs, procs, out)
    assert [p for p in checks["closed"]["pids"] if _alive(p)] == []


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


# -- foreign clients at the agents' port ----------------------------------------------

def _agent_port(cluster, mode):
    checks, out, jobs, procs = _run_script(cluster, "world_agent_port.py", mode)
    assert jobs == [] and procs == [], (jobs, procs, out)
    check = checks[mode]
    if not check["connected"]:
        pytest.skip(f"the foreign client came too late: {check['refused']}")
    assert check["results"] == [10.0] * 4, out
    return check, out


def test_junk_at_the_agents_port_while_the_world_starts_is_dropped(cluster):
    check, out = _agent_port(cluster, "junk")
    assert "does not speak mplaunch's World protocol" in out, out


def test_a_silent_client_at_the_agents_port_does_not_hold_the_start_back(cluster):
    check, out = _agent_port(cluster, "silent")
    # it was there, and dropped (cut when every agent had joined, or at its timeout)
    assert "dropped a connection" in out, out
    assert check["start_seconds"] < 8, check   # a start takes 2-5 s here; 12+ with it


# -- fresh ranks on the same nodes -------------------------------------------------------

@pytest.fixture(scope="module")
def world_restart(cluster):
    return _run_script(cluster, "world_restart.py")


def _no_leftovers(world_restart):
    _, out, jobs, procs = world_restart
    assert jobs == [] and procs == [], (jobs, procs, out)


def test_restart_across_nodes_leaves_nothing_behind(world_restart):
    _no_leftovers(world_restart)


def test_restart_starts_fresh_ranks_in_the_same_step(world_restart):
    checks, out, _, _ = world_restart
    r = checks["restart"]
    assert r["restart_error"] is None and r["run_error"] is None, r
    assert [n for n, _ in r["after"]] == ["n1", "n1", "n2", "n2"]
    assert not {p for _, p in r["after"]} & {p for _, p in r["first"]}
    assert r["steps"] == r["steps_before"], "restart started another step"


def test_heal_false_the_run_after_a_failure_starts_fresh_ranks(world_restart):
    checks, out, _, _ = world_restart
    r = checks["no_heal"]
    assert r["failed"].startswith("WorkerError: rank 1 "), r
    assert r["run_error"] is None, r
    assert [n for n, _ in r["after"]] == ["n1", "n1", "n2", "n2"]
    assert not {p for _, p in r["after"]} & {p for _, p in r["first"]}
    assert r["steps"] == r["steps_before"], "the fresh ranks came in another step"


def test_after_a_nodes_server_was_killed_the_next_run_starts_fresh_ranks(world_restart):
    checks, out, _, _ = world_restart
    r = checks["server_killed"]
    # the run that finds node 1's ranks gone says why
    assert r["failed"].startswith("WorkerError: rank "), r
    assert "node 1 (n2), was lost: mplaunch's server on this node" in r["failed"], r
    # the next one starts fresh ranks on both nodes
    assert r["run_error"] is None, r
    assert [n for n, _ in r["after"]] == ["n1", "n1", "n2", "n2"]


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


def test_stacks_from_another_thread_reach_every_node(world_options):
    checks, out, _, _ = world_options
    stacks = checks["stacks"]
    assert stacks["ranks"] == [0, 1, 2, 3], out
    # all four in the same place, the sleeper's frame shown
    assert "ranks 0-3:" in stacks["text"], stacks["text"]
    assert "in sleeper" in stacks["text"] and "time.sleep(3)" in stacks["text"], stacks


def test_log_dir_keeps_every_ranks_output_across_nodes(world_options):
    checks, out, _, _ = world_options
    files = checks["log_dir"]["files"]
    stdout = "".join(text for name, text in files.items() if name.endswith("stdout.log"))
    for rank in range(4):
        assert stdout.count(f"hello from rank {rank}\n") == 1, (rank, files)
