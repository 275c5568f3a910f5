"""A real two-node Ray cluster for the tests marked ray (ray.cluster_utils.Cluster: a
head and a second raylet on this machine), one per test module, and the check that a
test left nothing of mplaunch's on it: no live agent actor, no placement group, no
agent, server or rank process (nor a zombie) below this process."""
from __future__ import annotations

import contextlib
import os
import time

import psutil
import ray
from ray.cluster_utils import Cluster

from mplaunch._engine import servers as _procs

NODE_CPUS = 4


@contextlib.contextmanager
def two_nodes(env=None, head_args=None, **node_args):
    """The cluster, with this process connected to its head (a test may remove any
    other node); `env` is set while the raylets start (their workers inherit it);
    `head_args` go to the head alone."""
    saved = {k: os.environ.get(k) for k in (env or {})}
    os.environ.update(env or {})
    args = dict({"num_cpus": NODE_CPUS}, **node_args)
    c = None
    try:
        c = Cluster(initialize_head=True, head_node_args=dict(args, **(head_args or {})))
        # connected while the head is the only node, the driver is on the head: Ray
        # before 2.4x picks any node of the driver's address, and a test that removes
        # the driver's node breaks the driver itself
        ray.init(address=c.address, log_to_driver=False)
        c.add_node(**args)
        c.wait_for_nodes()
        assert driver_node(c) is c.head_node, "the driver is not on the head"
    except BaseException:
        ray.shutdown()
        if c is not None:
            c.shutdown()
        raise
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    try:
        yield c
    finally:
        ray.shutdown()
        c.shutdown()
    left = ours(timeout=10)
    assert not left, f"processes of ours left after the cluster: {left}"


def ours(timeout=0.0):
    """Processes of mplaunch (agents, their servers and ranks) below this process that
    are not this process's own warm servers, and zombies: on any node of the cluster."""
    end = time.monotonic() + timeout
    while True:
        local = set(_procs.server_pids()) | set(_procs.idle_pool_pids())
        found = []
        for p in psutil.Process().children(recursive=True):
            try:
                if p.pid in local or p.ppid() in local:
                    continue
                if p.status() == psutil.STATUS_ZOMBIE or "mplaunch" in " ".join(p.cmdline()):
                    found.append((p.pid, p.status(), " ".join(p.cmdline())[:100]))
            except psutil.Error:
                continue
        if not found or time.monotonic() > end:
            return found
        time.sleep(0.1)


def live_actors():
    """mplaunch's agent actors that are not dead."""
    from ray._private import state
    return [a for a in state.actors().values()
            if a.get("State") != "DEAD" and "NodeAgent" in str(a.get("ActorClassName"))]


def live_groups():
    return [g for g in ray.util.placement_group_table().values()
            if g.get("state") not in ("REMOVED",)]


def check_nothing_left(wait=20.0):
    end = time.monotonic() + wait
    while (live_actors() or live_groups()) and time.monotonic() < end:
        time.sleep(0.2)
    assert not live_actors(), live_actors()
    assert not live_groups(), live_groups()
    left = ours(timeout=10)
    assert not left, f"test left processes of ours on the cluster's nodes: {left}"


def node_ids():
    """The live nodes' ids as a World names them (their first 8 hex digits)."""
    return sorted(n["NodeID"][:8] for n in ray.nodes() if n["Alive"])


def driver_node(cluster):
    """The cluster_utils node whose raylet this process (the driver) is connected to."""
    sock = ray._private.worker._global_node._raylet_socket_name
    return [n for n in [cluster.head_node, *cluster.worker_nodes]
            if n._raylet_socket_name == sock][0]


def node_id(node):
    """A cluster_utils node's Ray node id as the World names it."""
    if getattr(node, "node_id", None):
        return node.node_id[:8]
    sock = node._plasma_store_socket_name    # Ray before 2.4x: found by its object store
    return [n["NodeID"] for n in ray.nodes()
            if n.get("ObjectStoreSocketName") == sock][0][:8]
