"""The release of a collective left half-done in a subgroup, whichever way torch made the
subgroup: ``dist.new_subgroups``, ``new_subgroups_by_enumeration``, the
``distributed_c10d.new_group`` that torch's own helpers and DeviceMesh call (not the name
``dist.new_group``), ``use_local_synchronization=True``, ``init_device_mesh`` and
``split_group`` (mplaunch._rank.rendezvous wraps where they all go through)."""
from __future__ import annotations

import os
import socket
import sys
import time
import types

import pytest

import mplaunch
from mplaunch._rank import endpoints, rendezvous


@pytest.fixture(autouse=True)
def _no_group_known():
    """Each test starts and ends with no group's endpoints known in this process."""
    endpoints._known = endpoints._pending = None
    yield
    endpoints._known = endpoints._pending = None


# -- real ranks -----------------------------------------------------------------------------

WAYS = ["new_subgroups", "new_subgroups_by_enumeration", "distributed_c10d.new_group",
        "use_local_synchronization", "init_device_mesh"]


def make_subgroup(way):
    """In each of 4 ranks: the subgroup {0, 1} or {2, 3} this rank is in, made `way`,
    kept in rank_state()["sub"]; the number of connections the rank now knows."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d
    st = mplaunch.rank_state()
    rank = dist.get_rank()
    st["kept"] = 10 * rank      # state that must outlive the release
    if way == "new_subgroups":
        sub, _ = dist.new_subgroups(group_size=2)
    elif way == "new_subgroups_by_enumeration":
        sub, _ = dist.new_subgroups_by_enumeration([[0, 1], [2, 3]])
    elif way == "distributed_c10d.new_group":
        sub = [c10d.new_group([0, 1]), c10d.new_group([2, 3])][rank // 2]
    elif way == "use_local_synchronization":
        # non-members do not call it at all
        sub = dist.new_group([0, 1] if rank < 2 else [2, 3],
                             use_local_synchronization=True)
    elif way == "init_device_mesh":
        from torch.distributed.device_mesh import init_device_mesh
        st["mesh"] = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        sub = st["mesh"].get_group("tp")           # rows: {0, 1} and {2, 3}
    else:
        raise AssertionError(way)
    assert sorted(dist.get_process_group_ranks(sub)) == ([0, 1] if rank < 2 else [2, 3])
    st["sub"] = sub
    known = endpoints.known()
    return len(known.sockets) if known else 0


def connections_known():
    known = endpoints.known()
    return len(known.sockets) if known else 0


def raise_while_rank0_waits_in_the_subgroup():
    import torch
    import torch.distributed as dist
    if dist.get_rank() == 1:
        raise ValueError("rank one leaves the subgroup's collective")
    dist.all_reduce(torch.ones(1), group=mplaunch.rank_state()["sub"])  # {2, 3} complete
    return "ok"


def kept():
    return mplaunch.rank_state().get("kept")


def allreduce_sum():
    import torch
    import torch.distributed as dist
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return t.item()


@pytest.mark.slow   # 10-20 s each on 2 cores
@pytest.mark.parametrize("way,method", [(way, "forkserver") for way in WAYS] + [
    ("init_device_mesh", "fork"),    # torch, DeviceMesh's new_group, imported before
])
def test_a_collective_of_any_subgroup_left_half_done_is_released(way, method):
    # Rank 0 waits in the subgroup's all_reduce for rank 1, which raised: it is released
    # (the group rebuilt, every rank and its state kept), not killed at the grace period
    # and replaced by a fresh process.
    if way == "init_device_mesh":
        pytest.importorskip("torch.distributed.device_mesh")   # torch 2.2 and newer
    with mplaunch.World(4, backend="gloo", start_method=method, grace_period=20) as world:
        before = world.run(connections_known)
        after = world.run(make_subgroup, (way,))
        assert all(a > b for a, b in zip(after, before)), (before, after)
        pids = world.pids
        start = time.monotonic()
        with pytest.raises(mplaunch.WorkerError) as info:
            world.run(raise_while_rank0_waits_in_the_subgroup, timeout=120)
        took = time.monotonic() - start
        err = info.value
        assert err.rank == 1 and type(err.__cause__) is ValueError
        assert not isinstance(err, mplaunch.LaunchTimeout)
        assert world.fresh_ranks == [] and world.pids == pids, err.healed
        assert "rebuilt" in err.healed and "died" not in err.healed
        assert took < 15, took                       # released, not killed at 20 s
        assert world.run(kept) == [0, 10, 20, 30]
        assert world.run(allreduce_sum) == [10.0] * 4


def where_groups_are_made():
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d
    wrapped = {name: bool(getattr(fn, "_mplaunch", False)) for name, fn in (
        ("helper", getattr(c10d, "_new_process_group_helper", None)),
        ("split", getattr(c10d.ProcessGroup, "split_group", None)),
        ("new_group", dist.new_group)) if fn is not None}
    return wrapped, dist.new_group([0, 1]).size()


def test_a_rank_wraps_where_torch_makes_groups_and_new_group_still_works():
    with mplaunch.World(2, backend="gloo") as world:
        wrapped, size = world.run(where_groups_are_made)[0]
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d
    assert size == 2
    if hasattr(c10d, "_new_process_group_helper"):
        # not dist.new_group itself: it reaches the helper, noted once
        assert wrapped.pop("helper") and not wrapped.pop("new_group")
    else:   # an older torch: the name dist.new_group, as before
        assert wrapped.pop("new_group")
    assert all(wrapped.values()), wrapped           # ProcessGroup.split_group, if any
    assert not getattr(dist.new_group, "_mplaunch", False)   # never in this process


# -- split_group: where a gloo split makes its connections -------------------------------

def _listener():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s


@pytest.mark.no_torch
def test_the_connections_a_split_makes_are_noted_whichever_name_called_it(monkeypatch):
    """ProcessGroup.split_group (which c10d.split_group, new_group under torchcomms and
    DeviceMesh's own binding of split_group all call) is where a split's connections are
    made; on CPU with gloo torch refuses to split, so this one is a stand-in."""
    peer = _listener()
    opened = [peer]

    class ProcessGroup:
        def split_group(self, ranks, timeout=None, opts=None, group_name=None):
            # what gloo's split does: a listener, and a connection to a peer
            opened.append(_listener())
            client = socket.create_connection(peer.getsockname(), timeout=10)
            accepted, _ = peer.accept()
            opened.extend([client, accepted])
            return ProcessGroup() if ranks else None

    parent = ProcessGroup()
    fake = types.SimpleNamespace(
        is_initialized=lambda: True,
        # the child is not registered yet when the split returns: only the parent is
        get_backend=lambda group=None: "gloo" if group in (None, parent) else
        pytest.fail("asked the unregistered child"),
        GroupMember=types.SimpleNamespace(NON_GROUP_MEMBER=object()))
    c10d = types.SimpleNamespace(ProcessGroup=ProcessGroup)
    monkeypatch.setitem(sys.modules, "torch.distributed", fake)
    monkeypatch.setattr(endpoints, "_enabled", True)
    try:
        endpoints._known = endpoints.Known(frozenset({1}), frozenset(), frozenset())
        rendezvous._patch_subgroups(fake, c10d)
        rendezvous._patch_subgroups(fake, c10d)             # once only
        assert ProcessGroup.split_group._mplaunch
        assert ProcessGroup.split_group.__wrapped__.__name__ == "split_group"
        child = parent.split_group([0, 1], group_name="x")
        assert isinstance(child, ProcessGroup)
        known = endpoints.known()
        inodes = {os.fstat(s.fileno()).st_ino for s in opened[-2:]}
        assert inodes <= known.sockets and 1 in known.sockets
        assert known.own == {opened[1].getsockname()}
        assert parent.split_group([]) is None                # not in any split
    finally:
        for s in opened:
            s.close()


@pytest.mark.no_torch
def test_the_default_group_is_not_taken_for_a_subgroup(monkeypatch):
    """init_process_group goes through torch's helper too: the group it makes is the
    rendezvous' (group_made), never added to a previous group's connections."""
    fake = types.SimpleNamespace(is_initialized=lambda: False)
    monkeypatch.setitem(sys.modules, "torch.distributed", fake)
    monkeypatch.setattr(endpoints, "_enabled", True)
    endpoints._known = endpoints.Known(frozenset({1}), frozenset(), frozenset())
    assert endpoints.subgroup_started() is None
