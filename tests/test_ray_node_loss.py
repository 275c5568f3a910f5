"""A node Ray declares lost while mplaunch's own connection to it still works: its
raylet frozen (SIGSTOP), as a node cut off from the cluster's network looks to the
head. Ray's health checks find it within seconds (this module's cluster checks every
0.5 s); the World takes Ray's word at once and names the node. Without healing it tears
down on every node, and the next run is placed on the nodes Ray has then; a healing
World replaces the node on a live one it does not use, the other nodes' ranks kept. Its
own cluster: health checks this tight would be a hazard for the other modules' tests."""
from __future__ import annotations

import signal
import time

import psutil
import pytest

ray = pytest.importorskip("ray")

import mplaunch  # noqa: E402
import ray_cluster  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.no_leak_check, pytest.mark.timeout(240),
              pytest.mark.filterwarnings("ignore::ResourceWarning"),
              pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")]

HEALTH = {"health_check_period_ms": 500, "health_check_timeout_ms": 1000,
          "health_check_failure_threshold": 4}


@pytest.fixture(scope="module")
def cluster():
    with ray_cluster.two_nodes(head_args={"_system_config": HEALTH}) as c:
        yield c


@pytest.fixture(autouse=True)
def nothing_left(cluster):
    yield
    ray_cluster.check_nothing_left()


def count_calls():
    g = globals()
    g["_calls"] = g.get("_calls", 0) + 1
    return g["_calls"]


def allreduce_sum():
    import torch
    import torch.distributed as dist
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return t.item()


def test_a_node_ray_declares_lost_is_named_and_the_world_placed_again(cluster):
    worker = cluster.worker_nodes and list(cluster.worker_nodes)[0]
    raylet = psutil.Process(worker.all_processes["raylet"][0].process.pid)
    wid = ray_cluster.node_id(worker)
    with mplaunch.World(2, nnodes=2, scheduler="ray", backend="gloo",
                        grace_period=2, heal=False) as w:
        assert w.run(count_calls) == [1] * 4
        names = [n["name"] for n in w.nodes]
        assert wid in names, (wid, names)
        ranks = [psutil.Process(p) for p in w.pids.values()]
        agent = psutil.Process(w.nodes[names.index(wid)]["agent_pid"])
        raylet.send_signal(signal.SIGSTOP)      # the node's processes go on running
        try:
            begin = time.monotonic()
            # the agent and its ranks are fine: only Ray's verdict can end them
            while agent.is_running() and time.monotonic() - begin < 60:
                time.sleep(0.1)
            took = time.monotonic() - begin
            assert not agent.is_running(), "the World did not take Ray's word"
            with pytest.raises(mplaunch.WorkerError) as info:
                w.run(count_calls, timeout=60)
            msg = str(info.value)
            assert wid in msg and "lost" in msg and "Ray reports" in msg, msg
            # every rank of the World went, on both nodes, while the raylet was frozen
            assert not psutil.wait_procs(ranks, timeout=20)[1]
        finally:
            raylet.send_signal(signal.SIGCONT)   # it learns it is dead, and ends
        assert took < 30, f"{took:.1f} s to take Ray's word"
        cluster.remove_node(worker, allow_graceful=False)   # what is left of it
        spare = cluster.add_node(num_cpus=ray_cluster.NODE_CPUS)
        cluster.wait_for_nodes()
        assert w.run(count_calls) == [1] * 4    # re-placed: the head and the new node
        assert sorted(n["name"] for n in w.nodes) == sorted(
            [n for n in names if n != wid] + [ray_cluster.node_id(spare)])
        assert w.run(allreduce_sum) == [10.0] * 4
        cluster.remove_node(spare, allow_graceful=False)
        cluster.add_node(num_cpus=ray_cluster.NODE_CPUS)   # the module's two nodes again
        cluster.wait_for_nodes()


@pytest.mark.parametrize("how", ["frozen raylet", "raylet removed"])
def test_a_lost_node_is_replaced_on_a_live_node_the_world_does_not_use(cluster, how):
    """Three raylets, a World on two: one of its nodes (not the driver's) lost, its
    ranks start again on the third, the other node's ranks keep their state."""
    spare = cluster.add_node(num_cpus=ray_cluster.NODE_CPUS)
    cluster.wait_for_nodes()
    by_id = {ray_cluster.node_id(n): n for n in cluster.worker_nodes}
    head = ray_cluster.node_id(cluster.head_node)
    with mplaunch.World(2, nnodes=2, scheduler="ray", backend="gloo",
                        grace_period=2) as w:
        assert w.run(count_calls) == [1] * 4
        names = [n["name"] for n in w.nodes]
        index = next(i for i, n in enumerate(names) if n != head)
        victim = by_id[names[index]]
        kept = [w.pids[r] for r in range(4) if r // 2 != index]
        raylet = psutil.Process(victim.all_processes["raylet"][0].process.pid)
        agent = psutil.Process(w.nodes[index]["agent_pid"])
        begin = time.monotonic()
        if how == "frozen raylet":
            raylet.send_signal(signal.SIGSTOP)
        else:
            cluster.remove_node(victim, allow_graceful=False)
        try:
            # until Ray's verdict (a frozen raylet's node still runs the World's ranks)
            assert not psutil.wait_procs([agent], timeout=60)[1], "Ray's word not taken"
            with pytest.raises(mplaunch.WorkerError) as info:
                w.run(count_calls, timeout=90)
            took = time.monotonic() - begin
            msg = str(info.value)
            assert names[index] in msg and "lost" in msg, msg
            now = [n["name"] for n in w.nodes]
            assert len(now) == 2, info.value.healed
            assert now[index] not in names and now[1 - index] == names[1 - index], now
            counts = w.run(count_calls)
            assert [c for r, c in enumerate(counts) if r // 2 != index] == [3, 3]
            assert [c for r, c in enumerate(counts) if r // 2 == index] == [1, 1]
            assert [w.pids[r] for r in range(4) if r // 2 != index] == kept
            assert w.run(allreduce_sum) == [10.0] * 4
        finally:
            if how == "frozen raylet":
                raylet.send_signal(signal.SIGCONT)
        assert took < 60, f"{took:.1f} s from the loss to a healed World"
    # the cluster back to two live nodes for the next test
    for node in list(cluster.worker_nodes):
        if ray_cluster.node_id(node) not in ray_cluster.node_ids():
            cluster.remove_node(node, allow_graceful=False)
    if len(ray_cluster.node_ids()) > 2:
        cluster.remove_node(spare if spare in cluster.worker_nodes else
                            list(cluster.worker_nodes)[-1], allow_graceful=False)
    cluster.wait_for_nodes()


def test_a_lost_node_nothing_replaces_leaves_the_other_to_go_on(cluster):
    """Two raylets, a World on both: the worker's node removed, and no live node left
    for a replacement. The head's ranks are kept, with their processes and state, and
    restart(nnodes=1) goes on with them (issue 42, on Ray's own nodes)."""
    head = ray_cluster.node_id(cluster.head_node)
    by_id = {ray_cluster.node_id(n): n for n in cluster.worker_nodes}
    with mplaunch.World(2, nnodes=2, scheduler="ray", backend="gloo",
                        grace_period=2) as w:
        assert w.run(count_calls) == [1] * 4
        names = [n["name"] for n in w.nodes]
        index = next(i for i, n in enumerate(names) if n != head)
        kept = [w.pids[r] for r in range(4) if r // 2 != index]
        agent = psutil.Process(w.nodes[index]["agent_pid"])
        cluster.remove_node(by_id[names[index]], allow_graceful=False)
        assert not psutil.wait_procs([agent], timeout=60)[1], "the node's agent lives"
        with pytest.raises(mplaunch.WorkerError) as info:
            w.run(count_calls, timeout=90)
        healed = str(info.value.healed)
        assert "could not be healed" in healed and "the ranks on the other 1 node(s) " \
            "were kept" in healed and "world.restart(nnodes=1) goes on with them" in \
            healed, healed
        assert set(p for p in kept if psutil.pid_exists(p)) == set(kept)
        assert w.restart(nnodes=1) is w
        assert (w.nnodes, w.size) == (1, 2)
        assert w.pids == {0: kept[0], 1: kept[1]}        # the same processes
        counts = w.run(count_calls)
        assert counts[0] == counts[1] >= 2, counts       # and their state
        assert [n["name"] for n in w.nodes] == [head]
        assert w.run(allreduce_sum) == [3.0, 3.0]
    # the cluster back to two live nodes for the next test
    cluster.add_node(num_cpus=ray_cluster.NODE_CPUS)
    cluster.wait_for_nodes()
