"""World(nprocs, nnodes=2, scheduler="ray") on a real two-node Ray cluster
(ray.cluster_utils.Cluster: a head and a second raylet on this machine, one cluster for
the module). Real actors, a real placement group, real gloo.

The scenarios every scheduler runs (tests/nodes_scenarios.py: order and environment,
output and stacks, every heal, an interrupt, a killed agent, restarts, foreign clients,
the magic) run here with the `sched` fixture below: `RayNodes` tells them the nodes'
names (Ray node ids), the variables Ray's workers must not pass to a rank, the World's
placement group (its "step") and how an agent is lost here (its actor killed). What only
Ray has: GPUs Ray assigns each bundle, a driver that exits or is killed, a working_dir
Ray ships, bad scheduler arguments, no cluster, a node removed. After every test: no
actor, placement group or process of ours left on any node."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import psutil
import pytest

# Collected by the README's plain run too, where Ray is not installed and these tests are
# deselected (-m "not ray"); CI's ray job installs it first, and fails if it cannot.
ray = pytest.importorskip("ray")

pytest.register_assert_rewrite("nodes_scenarios")

import mplaunch  # noqa: E402
import nodes_scenarios  # noqa: E402
import ray_cluster  # noqa: E402
from nodes_scenarios import *  # noqa: E402,F401,F403 - the shared scenarios
from nodes_scenarios import allreduce_sum, count_calls  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.no_leak_check, pytest.mark.timeout(240),
              # older Ray releases leave their own log files to the garbage collector
              pytest.mark.filterwarnings("ignore::ResourceWarning"),
              pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")]

NODE_CPUS = ray_cluster.NODE_CPUS
NODE_GPUS = 3
# What Ray Train (and torchrun) put in a worker's environment: never a World rank's.
LEAKY = {"ROLE_NAME": "ray-train-worker", "TORCHELASTIC_RUN_ID": "ray-run",
         "GROUP_WORLD_SIZE": "99", "MASTER_PORT": "1"}


# -- the cluster, and nothing of ours left after each test ------------------------------

@pytest.fixture(scope="module")
def cluster():
    # GPUs as Ray counts them (a resource it hands out by index): no real GPU needed
    with ray_cluster.two_nodes(env=LEAKY, num_gpus=NODE_GPUS) as c:
        yield c


_ours, _live_actors, _live_groups = (ray_cluster.ours, ray_cluster.live_actors,
                                     ray_cluster.live_groups)


@pytest.fixture(autouse=True)
def nothing_left(cluster):
    yield
    ray_cluster.check_nothing_left()


def _agent_actors():
    from ray._private import state
    return [a for a in state.actors().values()
            if a.get("State") == "ALIVE" and "NodeAgent" in str(a.get("ActorClassName"))]


class RayNodes(nodes_scenarios.Nodes):
    """The nodes of the Ray cluster this process is connected to: one placement group
    per World, an agent actor in each of its bundles."""
    scheduler = "ray"
    gone_within = 20.0
    replaces = True    # an actor alone on a live node the World does not use (or the lost one)

    def check_names(self, names):
        # keyed by Ray node id: the two raylets share this machine's name and address
        assert len(set(names)) == len(names) and set(names) <= set(ray_cluster.node_ids())

    def check_rank_env(self, w, rank, node, local, got):
        env = got["env"]
        assert env.get("MPLAUNCH_NODE_NAME") == w.nodes[node]["name"], env
        # Ray's workers' launcher variables do not reach the ranks: each has
        # mplaunch's own value, or none
        assert all(env.get(k) != v for k, v in LEAKY.items()), env

    def step(self, w):
        groups = [k for k, g in ray.util.placement_group_table().items()
                  if g.get("state") not in ("REMOVED",)]
        assert len(groups) == 1, groups
        return groups[0]

    def check_up(self, w):
        # one placement group, an agent actor in each bundle, for the World's life
        assert len(_live_actors()) == w.nnodes and len(_live_groups()) == 1

    def kill_agent(self, w, node):
        """SIGKILL to the actor in node `node`'s bundle, as Ray sees it: the agent goes
        with it (Ray ends the actor's process group; the agent also watches the actor's
        pid)."""
        name = w.nodes[node]["name"]
        victim = [a for a in _agent_actors() if a["Address"]["NodeID"][:8] == name]
        assert len(victim) == 1, _agent_actors()
        agent = psutil.Process(w.nodes[node]["agent_pid"])
        os.kill(victim[0]["Pid"], signal.SIGKILL)
        assert not psutil.wait_procs([agent], timeout=20)[1]


@pytest.fixture
def sched(cluster):
    return RayNodes()


def world(**options):
    return RayNodes().world(**options)


ray_node_ids = ray_cluster.node_ids


# -- GPUs as Ray assigns them -------------------------------------------------------------

def visible_gpus():
    return os.environ.get("CUDA_VISIBLE_DEVICES")


def test_gpus_per_rank_are_the_ones_ray_assigned_each_nodes_bundle():
    with world(gpus="per-rank") as w:
        seen = w.run(visible_gpus)
        bundles = [g["bundles"] for g in ray.util.placement_group_table().values()
                   if g.get("state") == "CREATED"]
        assert bundles == [{0: {"CPU": 2.0, "GPU": 2.0}, 1: {"CPU": 2.0, "GPU": 2.0}}]
        # one GPU each, two different ones on each node, of the node's three
        for node in (0, 1):
            mine = seen[2 * node:2 * node + 2]
            assert all(g is not None and g.isdigit() and int(g) < NODE_GPUS
                       for g in mine), seen
            assert mine[0] != mine[1], seen
        assert w.run(allreduce_sum) == [10.0] * 4     # gloo: the GPUs are only placed


# -- the driver: gone, or shipping its code -----------------------------------------------

_DRIVER = """
import os, sys, ray, mplaunch
ray.init(address=sys.argv[1], log_to_driver=False)
w = mplaunch.World(2, nnodes=2, scheduler="ray", backend="gloo")
print("PIDS", sorted(w.run(os.getpid)), [n["agent_pid"] for n in w.nodes], flush=True)
if sys.argv[2] == "left-open":
    sys.exit(0)          # the World is closed at exit
import time
time.sleep(300)          # killed here
"""


@pytest.mark.parametrize("how", ["left-open", "killed"])
def test_a_driver_that_exits_or_is_killed_leaves_nothing_on_the_cluster(cluster, how):
    proc = subprocess.Popen([sys.executable, "-c", _DRIVER, cluster.address, how],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        line = ""
        while not line.startswith("PIDS"):
            line = proc.stdout.readline()
            assert line, "the driver ended before its World ran"
        if how == "killed":
            os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=60) in (0, -signal.SIGKILL)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
    # its ranks, agents, servers, actors and placement group all go (nothing_left waits)
    left = _ours(timeout=30)
    assert not left, left


_SHIPPED_DRIVER = """
import os, shutil, sys, ray, mplaunch
project = sys.argv[2]
sys.path.insert(0, project)
import shipped                     # the project's own module, as the driver imports it
ray.init(address=sys.argv[1], log_to_driver=False, runtime_env={"working_dir": project})
shutil.rmtree(project)   # uploaded: from here on the project is only where Ray put it
with mplaunch.World(2, nnodes=2, scheduler="ray", backend="gloo") as w:
    print("OUT", w.run(shipped.where), flush=True)
"""


def test_code_and_files_ray_ships_in_a_working_dir_are_the_ranks(cluster, tmp_path):
    """A project shipped with runtime_env={"working_dir": ...}, as Ray's docs show for a
    cluster whose nodes do not share the driver's files: on every node the ranks import
    its modules and start in its copy (where Ray runs its own tasks), with the driver's
    own copy gone, as it is on every other machine of a real cluster."""
    project = tmp_path / "project"
    project.mkdir()
    (project / "data.txt").write_text("read from the working_dir\n")
    (project / "shipped.py").write_text(
        "import os\n"
        "def where():\n"
        "    import torch.distributed as dist\n"
        "    with open('data.txt') as f:\n"
        "        return dist.get_rank(), f.read().strip(), os.getcwd()\n")
    out = subprocess.run([sys.executable, "-c", _SHIPPED_DRIVER, cluster.address,
                          str(project)], cwd=tmp_path, capture_output=True, text=True,
                         timeout=180)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("OUT ")]
    assert out.returncode == 0 and lines, out.stdout[-3000:] + out.stderr[-3000:]
    got = eval(lines[0][4:])
    assert [r for r, _, _ in got] == [0, 1, 2, 3]
    assert {text for _, text, _ in got} == {"read from the working_dir"}
    assert not any(cwd == str(tmp_path) for _, _, cwd in got), got


# -- bad input, before anything starts ----------------------------------------------------

def test_bad_scheduler_arguments_are_refused_before_anything_starts():
    with pytest.raises(ValueError, match=r"scheduler must be one of 'slurm', 'ray'.* got "
                                         r"'k8s'"):
        mplaunch.World(2, nnodes=2, scheduler="k8s")
    with pytest.raises(TypeError, match=r"ray_resources= is an option of scheduler='ray' "
                                        r"\(.*\); this World's scheduler is 'slurm'"):
        mplaunch.World(2, nnodes=2, ray_resources={"CPU": 1})
    with pytest.raises(ValueError, match="ray_resources must map"):
        mplaunch.World(2, nnodes=2, scheduler="ray", ray_resources={"CPU": -1})
    with pytest.raises(ValueError, match=r"needs 3 nodes with \{CPU: 2\} each, and this "
                                         r"Ray cluster has 2 of its 2 live node"):
        mplaunch.World(2, nnodes=3, scheduler="ray")
    with pytest.raises(ValueError, match=r"needs 2 nodes with \{CPU: 9\}"):
        mplaunch.World(9, nnodes=2, scheduler="ray")
    assert not _live_actors() and not _live_groups()


def test_a_driver_connected_to_no_cluster_is_told_how_to_connect(tmp_path):
    code = ("import mplaunch\n"
            "try:\n"
            "    mplaunch.World(2, nnodes=2, scheduler='ray')\n"
            "except RuntimeError as e:\n"
            "    print('REFUSED', e)\n")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=120)
    assert "REFUSED" in out.stdout and "ray.init(address=" in out.stdout, out


_id = ray_cluster.node_id


# -- last: a node removed from the cluster ------------------------------------------------

def test_a_removed_node_names_it_and_the_next_run_places_the_world_again(cluster):
    spare = cluster.add_node(num_cpus=NODE_CPUS, num_gpus=NODE_GPUS)
    cluster.wait_for_nodes()
    # heal=False: torn down and placed again (a healing World replaces only the node:
    # tests/test_ray_node_loss.py)
    with world(grace_period=2, heal=False) as w:
        assert w.run(count_calls) == [1] * 4
        names = [n["name"] for n in w.nodes]
        spare_id = _id(spare)
        if spare_id not in names:
            # the World is on the head and the first worker: remove the worker
            victim = [n for n in cluster.worker_nodes
                      if _id(n) in names and n is not spare][0]
        else:
            victim = spare
        vid = _id(victim)
        ranks = dict(w.pids)
        agent = psutil.Process(w.nodes[names.index(vid)]["agent_pid"])
        cluster.remove_node(victim, allow_graceful=False)
        assert not psutil.wait_procs([agent], timeout=30)[1]
        with pytest.raises(mplaunch.WorkerError) as info:
            w.run(count_calls, timeout=60)
        msg = str(info.value)
        assert vid in msg and "lost" in msg, msg
        left = nodes_scenarios.alive(ranks.values(), timeout=20)   # (one reaped meanwhile)
        assert not left, left
        assert w.run(count_calls) == [1] * 4      # re-placed on the nodes left
        assert vid not in [n["name"] for n in w.nodes]
        assert w.run(allreduce_sum) == [10.0] * 4
    # the spare (or the node it replaced) keeps the module's cluster at two live nodes
