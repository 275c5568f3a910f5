"""World(nprocs, nnodes=2, scheduler="ray") on a real two-node Ray cluster
(ray.cluster_utils.Cluster: a head and a second raylet on this machine, one cluster for
the module). Real actors, a real placement group, real gloo: the ranks' order and
environment, the node ids in the output, stacks, every heal, a killed agent actor, a
removed node, restart(nnodes=), foreign clients on the World's ports, and after every
test: no actor, placement group or process of ours left on any node."""
from __future__ import annotations

import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time

import psutil
import pytest

ray = pytest.importorskip("ray")

import mplaunch  # noqa: E402
import ray_cluster  # noqa: E402

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


def world(**options):
    options.setdefault("backend", "gloo")
    return mplaunch.World(2, nnodes=2, scheduler="ray", **options)


ray_node_ids = ray_cluster.node_ids


# -- what the ranks run -------------------------------------------------------------------

def whoami():
    import torch.distributed as dist
    keys = ("RANK", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
            "MPLAUNCH_NODE_NAME", "MPLAUNCH_WORLD_SECRET", "MPLAUNCH_WORLD_ADDR",
            "MPLAUNCH_WORLD_SECRET_STDIN", *LEAKY)
    return ({k: os.environ.get(k) for k in keys}, os.getpid(), dist.get_rank(),
            dist.get_world_size())


def allreduce_sum():
    import torch
    import torch.distributed as dist
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return t.item()


def count_calls():
    g = globals()
    g["_calls"] = g.get("_calls", 0) + 1
    return g["_calls"]


def say(word):
    rank = os.environ["RANK"]
    print("out", word, rank, flush=True)
    print("err", word, rank, file=sys.stderr, flush=True)
    return rank


def fail_in_rank_three():
    count_calls()
    if os.environ["RANK"] == "3":
        raise ValueError("three")
    return "ok"


def die_in_rank_three():
    if os.environ["RANK"] == "3":
        os._exit(3)
    return allreduce_sum()


def half_done_collective():
    """Ranks 0-2 enter an all_reduce that rank 3 never joins: it raises instead."""
    if os.environ["RANK"] == "3":
        time.sleep(0.5)
        raise ValueError("rank 3 left the all_reduce")
    return allreduce_sum()


def sleep_in_rank_three(path):
    if os.environ["RANK"] == "3":
        open(os.path.join(path, "sleeping"), "w").close()
        time.sleep(300)
    return "awake"


def wait_for_file(path):
    open(os.path.join(path, f"in.{os.environ['RANK']}"), "w").close()
    while not os.path.exists(os.path.join(path, "go")):
        time.sleep(0.02)
    return "went"


def _wait_for(paths, timeout=60):
    end = time.monotonic() + timeout
    while not all(os.path.exists(p) for p in paths):
        assert time.monotonic() < end, f"never appeared: {paths}"
        time.sleep(0.02)


# -- order, environment, node ids, output, stacks, close ---------------------------------

def test_ranks_in_global_order_on_their_ray_nodes_with_their_own_env(capfd):
    w = world()
    try:
        results = w.run(whoami)
        names = [n["name"] for n in w.nodes]
        # keyed by Ray node id: the two raylets share this machine's name and address
        assert sorted(names) == ray_node_ids() and len(set(names)) == 2
        for rank, (env, pid, grank, gsize) in enumerate(results):
            node, local = divmod(rank, 2)
            assert env == {
                "RANK": str(rank), "LOCAL_RANK": str(local), "NODE_RANK": str(node),
                "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2",
                "MPLAUNCH_NODE_NAME": names[node],
                # the secret and the agents' address stay with the agent
                "MPLAUNCH_WORLD_SECRET": None, "MPLAUNCH_WORLD_ADDR": None,
                "MPLAUNCH_WORLD_SECRET_STDIN": None,
                # Ray's workers' launcher variables do not reach the ranks: each has
                # mplaunch's own value
                **{k: env[k] for k in LEAKY}}, (rank, env)
            assert all(env[k] != v for k, v in LEAKY.items()), env
            assert (grank, gsize) == (rank, 4) and w.pids[rank] == pid
        assert len(_live_actors()) == 2 and len(_live_groups()) == 1
        assert w.run(allreduce_sum) == [10.0] * 4
        assert w.run(count_calls) == [1] * 4
        assert w.run(count_calls) == [2] * 4       # the same processes, their globals
        capfd.readouterr()
        assert w.run(say, ("hi",)) == ["0", "1", "2", "3"]
        out, err = capfd.readouterr()
        for rank in range(4):
            assert f"[{names[rank // 2]} rank{rank}]: out hi {rank}\n" in out, out
            assert f"[{names[rank // 2]} rank{rank}]: err hi {rank}\n" in err, err
        stacks = w.stacks()
        assert sorted(stacks) == [0, 1, 2, 3]
        # one placement group and the same two actors for the World's life
        assert len(_live_actors()) == 2 and len(_live_groups()) == 1
    finally:
        w.close()
    assert w.pids == {} and w.nodes == []


def test_stacks_from_another_thread_while_every_rank_is_in_a_call(tmp_path):
    with world() as w:
        seen = {}

        def ask():
            try:
                _wait_for([tmp_path / f"in.{r}" for r in range(4)])
                seen.update(w.stacks())
            finally:
                (tmp_path / "go").touch()

        t = threading.Thread(target=ask)
        t.start()
        try:
            assert w.run(wait_for_file, (str(tmp_path),), timeout=60) == ["went"] * 4
        finally:
            t.join()
        assert sorted(seen) == [0, 1, 2, 3]
        assert all("wait_for_file" in seen[r] for r in range(4)), seen


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


# -- every heal ---------------------------------------------------------------------------

def test_an_exception_keeps_the_world_and_names_the_node():
    with world() as w:
        assert w.run(count_calls) == [1] * 4
        pids, agents = w.pids, [n["agent_pid"] for n in w.nodes]
        with pytest.raises(mplaunch.WorkerError) as info:
            w.run(fail_in_rank_three)
        err = info.value
        assert err.rank == 3 and type(err.__cause__) is ValueError
        assert w.nodes[1]["name"] in str(err) and "world was kept" in str(err), str(err)
        assert w.pids == pids and [n["agent_pid"] for n in w.nodes] == agents
        assert w.run(count_calls) == [3] * 4
        assert w.run(allreduce_sum) == [10.0] * 4


def test_a_half_done_collective_is_released_and_the_group_rebuilt():
    with world() as w:
        assert w.run(allreduce_sum) == [10.0] * 4
        pids = w.pids
        with pytest.raises(mplaunch.WorkerError) as info:
            w.run(half_done_collective, timeout=120)
        assert info.value.rank == 3, str(info.value)
        assert w.pids == pids                      # released, not replaced
        assert w.run(allreduce_sum) == [10.0] * 4


def test_a_dead_rank_is_replaced_on_its_own_node():
    with world(grace_period=2) as w:
        assert w.run(count_calls) == [1] * 4
        pids, agents = w.pids, [n["agent_pid"] for n in w.nodes]
        with pytest.raises(mplaunch.WorkerError) as info:
            w.run(die_in_rank_three, timeout=120)
        err = info.value
        assert err.rank == 3 and err.exitcode == 3, str(err)
        assert "replaced" in err.healed, err.healed
        assert w.pids[3] != pids[3] and w.fresh_ranks == [3]
        assert [n["agent_pid"] for n in w.nodes] == agents
        assert agents[1] in [p.pid for p in psutil.Process(w.pids[3]).parents()]
        assert w.run(count_calls)[3] == 1
        assert w.run(allreduce_sum) == [10.0] * 4


def test_a_timeout_keeps_the_world(tmp_path):
    with world(grace_period=3) as w:
        assert w.run(count_calls) == [1] * 4
        pids = w.pids
        with pytest.raises(mplaunch.LaunchTimeout) as info:
            w.run(sleep_in_rank_three, (str(tmp_path),), timeout=3)
        assert "sleep_in_rank_three" in info.value.stacks[3], info.value.stacks
        assert w.pids == pids
        assert w.run(count_calls) == [2] * 4


def test_an_interrupt_reaches_every_node_and_keeps_the_world(tmp_path):
    with world(grace_period=3) as w:
        assert w.run(count_calls) == [1] * 4
        pids = w.pids

        def interrupt():
            _wait_for([tmp_path / f"in.{r}" for r in range(4)])
            os.kill(os.getpid(), signal.SIGINT)

        t = threading.Thread(target=interrupt)
        t.start()
        try:
            with pytest.raises(KeyboardInterrupt) as info:
                w.run(wait_for_file, (str(tmp_path),), timeout=60)
        finally:
            t.join()
        assert "kept" in str(info.value), str(info.value)
        assert w.pids == pids
        assert w.run(count_calls) == [2] * 4
        assert w.run(allreduce_sum) == [10.0] * 4


# -- a lost agent, a lost node ----------------------------------------------------------

def _agent_actors():
    from ray._private import state
    return [a for a in state.actors().values()
            if a.get("State") == "ALIVE" and "NodeAgent" in str(a.get("ActorClassName"))]


def test_a_killed_agent_actor_names_its_node_leaves_nothing_and_the_next_run_starts_again():
    with world(grace_period=2) as w:
        assert w.run(count_calls) == [1] * 4
        names = [n["name"] for n in w.nodes]
        ranks = dict(w.pids)
        # the actor in node 1's bundle, as Ray sees it
        victim = [a for a in _agent_actors()
                  if a["Address"]["NodeID"][:8] == names[1]]
        assert len(victim) == 1, _agent_actors()
        agent = psutil.Process(w.nodes[1]["agent_pid"])
        os.kill(victim[0]["Pid"], signal.SIGKILL)
        # the agent goes with its actor (Ray ends the actor's process group; the agent
        # also watches the actor's pid)
        assert not psutil.wait_procs([agent], timeout=20)[1]
        with pytest.raises(mplaunch.WorkerError) as info:
            w.run(count_calls, timeout=60)
        msg = str(info.value)
        assert names[1] in msg and "lost" in msg, msg
        # every rank of the World went, on both nodes
        gone = psutil.wait_procs([psutil.Process(p) for p in ranks.values()
                                  if psutil.pid_exists(p)], timeout=20)[1]
        assert not gone, gone
        assert w.run(count_calls) == [1] * 4      # a new placement, fresh ranks
        assert w.run(allreduce_sum) == [10.0] * 4


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


def test_restart_re_forms_the_world_on_one_node_then_two():
    with world() as w:
        assert w.run(allreduce_sum) == [10.0] * 4
        w.restart(nnodes=1)
        assert (w.nprocs, w.nnodes, w.size, len(w.nodes)) == (2, 1, 2, 1)
        assert w.run(allreduce_sum) == [3.0, 3.0]
        assert len(_live_actors()) == 1
        w.restart(nnodes=2, nprocs=1)
        assert (w.nprocs, w.nnodes, w.size) == (1, 2, 2)
        assert w.run(allreduce_sum) == [3.0, 3.0]
        assert len({n["name"] for n in w.nodes}) == 2


# -- only its owner gets in -----------------------------------------------------------------

class _Boom:
    """Unpickling this makes a file: whoever unpickles what a stranger sent runs code."""
    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def master_addr_port():
    return os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])


def _junk(marker):
    return (pickle.dumps(_Boom(marker)), os.urandom(4096), b"")


def test_foreign_clients_on_every_port_the_world_opens_run_nothing(tmp_path, monkeypatch):
    from mplaunch._engine.nodes import ray_step
    marker = tmp_path / "unpickled"
    real = ray_step.starter

    def junk_first(bundle):
        start = real(bundle)

        def wrapped(agent_argv, env, nnodes, output):
            # the agents' port, while the World starts: strangers before the agents
            host, _, port = env["MPLAUNCH_WORLD_ADDR"].rpartition(":")
            for junk in _junk(marker)[:2]:
                with socket.create_connection((host.strip("[]"), int(port)), 5) as c:
                    c.sendall(junk)
            return start(agent_argv, env, nnodes, output)
        return wrapped

    monkeypatch.setattr(ray_step, "starter", junk_first)
    with world() as w:
        assert w.run(allreduce_sum) == [10.0] * 4
        assert w._engine.hub.dropped == 2
        pids = dict(w.pids)
        # every other port: the store's (this process), each agent's and rank's
        ports = {w.run(master_addr_port)[0]}
        for pid in list(pids.values()) + [n["agent_pid"] for n in w.nodes]:
            for c in psutil.Process(pid).net_connections("tcp"):
                if c.status == "LISTEN":
                    host = c.laddr.ip
                    ports.add(("127.0.0.1" if host in ("0.0.0.0", "::") else host,
                               c.laddr.port))
        assert len(ports) >= 5, ports
        for host, port in sorted(ports):
            for junk in _junk(marker):
                with socket.create_connection((host, port), timeout=5) as c:
                    c.sendall(junk)
                    time.sleep(0.05)
        assert w.run(allreduce_sum) == [10.0] * 4
        assert w.pids == pids
        with pytest.raises(mplaunch.WorkerError):      # a heal still releases and rebuilds
            w.run(fail_in_rank_three)
        assert w.run(allreduce_sum) == [10.0] * 4
    assert not marker.exists()


# -- bad input, before anything starts ----------------------------------------------------

def test_bad_scheduler_arguments_are_refused_before_anything_starts():
    with pytest.raises(ValueError, match="scheduler must be 'slurm'.*or 'ray'"):
        mplaunch.World(2, nnodes=2, scheduler="k8s")
    with pytest.raises(TypeError, match="needs scheduler='ray'"):
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
    if True:
        with world(grace_period=2) as w:
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
            gone = psutil.wait_procs([psutil.Process(p) for p in ranks.values()
                                      if psutil.pid_exists(p)], timeout=20)[1]
            assert not gone, gone
            assert w.run(count_calls) == [1] * 4      # re-placed on the nodes left
            assert vid not in [n["name"] for n in w.nodes]
            assert w.run(allreduce_sum) == [10.0] * 4
    # the spare (or the node it replaced) keeps the module's cluster at two live nodes
