"""The notebook magic and the pytest plugin on a real two-node Ray cluster
(ray.cluster_utils.Cluster: a head and a second raylet on this machine, one cluster for
the module), each reaching the cluster only through RAY_ADDRESS, as a user's would:

- a real Jupyter kernel (ipykernel, driven by nbclient) runs ``%ranks start 2 --nodes 2
  --scheduler ray`` and builds a DDP model across %%ranks cells, trains a step, finds
  the parameters equal on all 4 ranks, survives a cell in which one rank raises (the
  World kept, its names too), shows the status, and stops;
- pytest sessions (pytester subprocesses) whose ``reuse=True`` tests share one World
  across the Ray nodes, through a test failing in one rank: by the marker's
  ``nnodes=2, scheduler="ray"`` and by MPLAUNCH_TEST_NNODES / MPLAUNCH_TEST_SCHEDULER.

After each test (the kernel shut down, the inner session over): no NodeAgent actor, no
placement group and no mplaunch process of ours left on any node."""
from __future__ import annotations

import re

import psutil
import pytest

ray = pytest.importorskip("ray")
import ray_cluster  # noqa: E402
from procs import assert_gone  # noqa: E402
from test_plugin import IDENTITY, _inner_ini, _write_tests  # noqa: E402


try:   # the kernel machinery is test_notebook's (the [test] extra's nbclient)
    from test_notebook import (_errors, _plain, _stream, kernel_config,  # noqa: F401
                               run_cells)
except (ImportError, pytest.skip.Exception):
    @pytest.fixture
    def kernel_config():
        pytest.skip("the kernel test needs nbclient (the [test] extra)")

pytestmark = [pytest.mark.ray, pytest.mark.no_leak_check, pytest.mark.timeout(240),
              # older Ray releases leave their own log files to the garbage collector
              pytest.mark.filterwarnings("ignore::ResourceWarning"),
              pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")]

INNER_TIMEOUT = 200     # one inner pytest session; the outer test has 240 s


# -- the cluster, and nothing of ours left after each test ------------------------------

@pytest.fixture(scope="module")
def cluster():
    # this process looks at the cluster's actors and placement groups; the kernel and
    # the inner sessions connect on their own, through RAY_ADDRESS
    with ray_cluster.two_nodes() as c:
        yield c


_ours, _live_actors, _live_groups = (ray_cluster.ours, ray_cluster.live_actors,
                                     ray_cluster.live_groups)
ray_node_ids = ray_cluster.node_ids


@pytest.fixture(autouse=True)
def nothing_left(cluster, monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", cluster.address)
    for name in ("MPLAUNCH_TEST_NNODES", "MPLAUNCH_TEST_SCHEDULER"):
        monkeypatch.delenv(name, raising=False)
    assert not _live_actors() and not _live_groups()
    yield
    ray_cluster.check_nothing_left(wait=30)


def _alive(pids):
    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.Error:
            pass
    return out


# -- a Jupyter kernel connected to the cluster through RAY_ADDRESS -------------------------

CELLS = {
    "start": "%load_ext mplaunch\n%ranks start 2 --nodes 2 --scheduler ray",
    # the kernel is a driver of the module's cluster: what Ray holds for the World
    "held": """import ray
from ray._private import state
actors = [a for a in state.actors().values()
          if a["State"] == "ALIVE" and "NodeAgent" in a["ActorClassName"]]
groups = [g for g in ray.util.placement_group_table().values() if g["state"] == "CREATED"]
print("held", len(actors), "actors,", len(groups), "group", groups[0]["strategy"],
      len(groups[0]["bundles"]), "bundles", ray.get_runtime_context().gcs_address)
""",
    "model": """%%ranks
import os
import torch
import torch.distributed as dist
torch.manual_seed(dist.get_rank())     # different on each rank: DDP broadcasts rank 0's
net = torch.nn.Linear(8, 2)
print("model on", os.environ["MPLAUNCH_NODE_NAME"], "rank", dist.get_rank(), "of",
      dist.get_world_size(), "backend", dist.get_backend())
""",
    "wrap": """%%ranks
from torch.nn.parallel import DistributedDataParallel as DDP
model = DDP(net)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
initial = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()
print("wrapped", dist.get_rank(), type(model).__name__)
""",
    "step": """%%ranks
x = torch.randn(16, 8)                 # each rank its own batch
loss = model(x).pow(2).mean()
opt.zero_grad()
loss.backward()
opt.step()
print("stepped", dist.get_rank())
""",
    "check": """%%ranks
flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
dist.all_gather(gathered, flat)
same = all(torch.equal(g, gathered[0]) for g in gathered)
print("equal", same, "trained", not torch.equal(flat, initial),
      "node", os.environ["MPLAUNCH_NODE_NAME"])
""",
    "fails": """%%ranks
if dist.get_rank() == 3:
    raise ValueError("rank 3 on " + os.environ["MPLAUNCH_NODE_NAME"] + " says no")
print("fine", dist.get_rank())
""",
    "after": """%%ranks
flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
t = flat.sum().reshape(1) * 0 + 1
dist.all_reduce(t)
print("still", dist.get_rank(), os.getpid(), type(model).__name__, int(t.item()))
""",
    "status": "%ranks",
    "stop": "%ranks stop\n%ranks",
}


@pytest.mark.notebook
def test_ddp_across_ray_nodes_from_a_kernel(cluster, kernel_config, tmp_path):
    ids = ray_node_ids()
    cells = run_cells(CELLS, kernel_config, tmp_path, failing=("fails",))
    for name, cell in cells.items():
        if name != "fails":
            assert not _errors(cell), (name, [_plain(e["traceback"])
                                             for e in _errors(cell)])

    start = _stream(cells["start"])
    m = re.search(r"^%ranks: started 4 ranks on 2 nodes \((\w+), (\w+)\), 2 on each, "
                  r"backend gloo: pids \{(.*?)\}$", start, re.M)
    assert m, start
    names = [m.group(1), m.group(2)]
    # the nodes are the cluster's two raylets, named by their Ray node ids
    assert sorted(names) == ids and len(set(names)) == 2, (names, ids)
    pids = {int(k): int(v) for k, v in re.findall(r"(\d+): (\d+)", m.group(3))}
    assert sorted(pids) == [0, 1, 2, 3], start
    node_of = [names[r // 2] for r in range(4)]

    # one STRICT_SPREAD placement group of 2 bundles and an agent actor in each, seen by
    # the kernel on the cluster RAY_ADDRESS named
    held = _stream(cells["held"]).split()
    assert held[:9] == ["held", "2", "actors,", "1", "group", "STRICT_SPREAD", "2",
                        "bundles", cluster.address], held

    assert sorted(_stream(cells["model"]).splitlines()) == sorted([
        f"[{node_of[r]} rank{r}]: model on {node_of[r]} rank {r} of 4 backend gloo"
        for r in range(4)]), _stream(cells["model"])
    # the next cell finds the model of the one before, and so on
    assert sorted(_stream(cells["wrap"]).splitlines()) == sorted([
        f"[{node_of[r]} rank{r}]: wrapped {r} DistributedDataParallel" for r in range(4)])
    assert sorted(_stream(cells["step"]).splitlines()) == sorted([
        f"[{node_of[r]} rank{r}]: stepped {r}" for r in range(4)])
    # after a step on different batches, DDP kept the parameters equal on all 4 ranks
    assert sorted(_stream(cells["check"]).splitlines()) == sorted([
        f"[{node_of[r]} rank{r}]: equal True trained True node {node_of[r]}"
        for r in range(4)]), _stream(cells["check"])

    # rank 3 (on node 1) raises: the cell shows it and the other ranks' output; kept
    [fails] = [_plain(e["traceback"]) for e in _errors(cells["fails"])]
    assert f"ValueError: rank 3 on {names[1]} says no" in fails, fails
    assert re.search(rf"^%%ranks: rank 3 on node 1 \({names[1]}, pid {pids[3]}\) raised "
                     r"this; the world was kept", fails, re.M), fails
    assert sorted(_stream(cells["fails"]).splitlines()) == sorted([
        f"[{node_of[r]} rank{r}]: fine {r}" for r in range(3)]), _stream(cells["fails"])
    # shown once, as the cell's error: the rank does not relay its traceback too
    assert "ValueError" not in _stream(cells["fails"], "stderr"), \
        _stream(cells["fails"], "stderr")
    # ... and the next cell runs in the same processes, with the model, collectives too
    assert sorted(_stream(cells["after"]).splitlines()) == sorted([
        f"[{node_of[r]} rank{r}]: still {r} {pids[r]} DistributedDataParallel 4"
        for r in range(4)]), _stream(cells["after"])

    status = _stream(cells["status"])
    assert status.startswith(f"4 ranks on 2 nodes, 2 on each, backend gloo: up, pids "
                             f"{pids}"), status
    for r in range(4):
        assert f"  rank {r} on node {r // 2} ({node_of[r]}, pid {pids[r]}): " in status, \
            status
    assert _stream(cells["stop"]) == (
        "%ranks: stopped 4 ranks\n"
        "4 ranks on 2 nodes, 2 on each, backend gloo: not started; the next %%ranks cell "
        "starts them\n"), _stream(cells["stop"])
    # run_cells returned once every process below the kernel had ended; the ranks are
    # below the raylets (so below this process): gone too (and nothing_left checks the
    # actors, the placement group and every process of ours)
    assert _alive(pids.values()) == [], pids


# -- the pytest plugin's reuse across the Ray nodes ----------------------------------------

HELPERS = IDENTITY + """
import sys

def where():
    return identity() + " " + os.environ["MPLAUNCH_NODE_NAME"]

def held():
    import ray
    from ray._private import state
    actors = [a for a in state.actors().values()
              if a["State"] == "ALIVE" and "NodeAgent" in a["ActorClassName"]]
    groups = [g for g in ray.util.placement_group_table().values()
              if g["state"] == "CREATED"]
    return f"{len(actors)} {len(groups)} {ray.get_runtime_context().gcs_address}"
"""

STORY = """
reuse = {marker}

@reuse
def test_a_all_reduce():
    assert dist.get_world_size() == 4 and os.environ["WORLD_SIZE"] == "4"
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    assert t.item() == 10.0
    sys.mplaunch_ray_seen = ["a"]      # the rank's own state, kept for the next tests
    record("a", where())

def test_b_plain_in_between():
    # in this pytest process, connected to the cluster by the World: what Ray holds
    record("held", held())

@reuse
def test_c_state_kept():
    assert sys.mplaunch_ray_seen == ["a"]
    sys.mplaunch_ray_seen.append("c")
    t = torch.ones(1) * dist.get_rank()
    dist.broadcast(t, src=3)
    assert t.item() == 3.0
    record("c", where())

@reuse
def test_d_fails_on_node_1():
    sys.mplaunch_ray_seen.append("d")
    record("d", where())
    assert dist.get_rank() != 2, "FAILS-IN-RANK-2 on " + os.environ["MPLAUNCH_NODE_NAME"]

@reuse
def test_e_after_the_failure():
    assert sys.mplaunch_ray_seen == ["a", "c", "d"]
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == 4.0
    record("e", where())
"""


def _rows(out, name):
    """rank -> (pid, ppid, create time, node) of each rank that recorded `name`."""
    rows = {}
    for f in out.iterdir():
        if f.name.startswith(name + "-rank"):
            pid, ppid, created, node = f.read_text().split()
            rows[int(f.name.rsplit("rank", 1)[1])] = (int(pid), int(ppid), created, node)
    return rows


def _check_story(pytester, cluster, out, result):
    text = result.stdout.str() + result.stderr.str()
    result.assert_outcomes(passed=4, failed=1)
    assert "FAILED test_ray_reuse.py::test_d_fails_on_node_1" in text, text
    a = _rows(out, "a")
    assert sorted(a) == [0, 1, 2, 3], text
    names = [a[r][3] for r in range(4)]
    # 2 ranks on each of the cluster's two raylets, in global order
    assert names[0] == names[1] and names[2] == names[3] and names[0] != names[2], names
    assert sorted({names[0], names[2]}) == ray_node_ids(), names
    assert len({a[r][0] for r in range(4)}) == 4
    assert {a[0][1], a[1][1]} & {a[2][1], a[3][1]} == set(), "one agent per node"
    assert f"FAILS-IN-RANK-2 on {names[2]}" in text, text
    assert "raised in rank 2 of 4 " in text, text
    # one World for every test, through the failure
    assert _rows(out, "c") == a, "test_c ran in another World than test_a"
    assert _rows(out, "d") == a
    assert _rows(out, "e") == a, "the failing test's World was not kept for the next"
    # while it was up: one placement group and its two agent actors, on this cluster
    assert (out / "held-rankparent").read_text().split() == ["2", "1", cluster.address]
    # every rank and the process above it (each node's agent side) ended with the session
    procs = {}
    for pid, ppid, created, _node in a.values():
        procs[pid] = float(created)
        procs.setdefault(ppid, None)
    assert_gone(procs)


def test_plugin_reuse_shares_one_world_across_the_ray_nodes_through_a_failure(
        cluster, pytester):
    _inner_ini(pytester)
    out = _write_tests(pytester, "test_ray_reuse", helpers=HELPERS, source=STORY.format(
        marker='pytest.mark.mplaunch(2, nnodes=2, scheduler="ray", reuse=True)'))
    result = pytester.runpytest_subprocess("-rA", timeout=INNER_TIMEOUT)
    _check_story(pytester, cluster, out, result)


def test_plugin_reuse_on_ray_from_the_environment(cluster, pytester, monkeypatch):
    monkeypatch.setenv("MPLAUNCH_TEST_SCHEDULER", "ray")
    monkeypatch.setenv("MPLAUNCH_TEST_NNODES", "2")
    _inner_ini(pytester)
    out = _write_tests(pytester, "test_ray_reuse", helpers=HELPERS, source=STORY.format(
        marker="pytest.mark.mplaunch(2, reuse=True)"))
    result = pytester.runpytest_subprocess("-rA", timeout=INNER_TIMEOUT)
    _check_story(pytester, cluster, out, result)
