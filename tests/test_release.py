"""The release of a collective left half-done (mplaunch._rank.endpoints, _rank.heal): which
connections a rank shuts is decided by what the rank noted of its own sockets while its
group was made, never by who else runs on this machine or what the store says, so it
works across nodes."""
from __future__ import annotations

import datetime
import json
import os
import signal
import socket
import subprocess
import sys
import time
import types

import pytest

import mplaunch
from mplaunch._rank import endpoints
from mplaunch._rank.endpoints import Known
from mplaunch._wire import linux
from mplaunch._wire.messages import RELEASE_SIGNAL

@pytest.fixture(autouse=True)
def _no_group_known():
    """Each test starts and ends with no group's endpoints known in this process."""
    endpoints._known = endpoints._pending = None
    yield
    endpoints._known = endpoints._pending = None


def _has_ipv6() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError:
        return False
    return True


# -- what a socket says of itself ---------------------------------------------------------

@pytest.mark.no_torch
def test_this_process_tcp_sockets_are_asked_their_ends_and_whether_they_listen():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        addr = server.getsockname()
        with socket.create_connection(addr) as client, \
                socket.socket(socket.AF_UNIX) as unix:
            accepted, _ = server.accept()
            with accepted:
                ends = [linux.socket_ends(s.fileno()) for s in (server, client, accepted)]
                here = client.getsockname()
                assert linux.socket_ends(unix.fileno()) is None
                r, w = os.pipe()
                assert linux.socket_ends(r) is None
                os.close(r), os.close(w)
                assert linux.socket_ends(r) is None              # closed
    assert ends == [(addr, None, True), (here, addr, False), (addr, here, False)]


@pytest.mark.no_torch
@pytest.mark.skipif(not _has_ipv6(), reason="no IPv6 loopback")
def test_an_ipv4_peer_of_a_dual_stack_listener_is_named_as_ipv4():
    with socket.socket(socket.AF_INET6) as server:
        server.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        server.bind(("::", 0))
        server.listen()
        port = server.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port)) as client:
            accepted, _ = server.accept()
            with accepted:
                assert linux.socket_ends(accepted.fileno()) == (
                    ("127.0.0.1", port), client.getsockname(), False)


# -- which connections the release shuts ----------------------------------------------------

# A rank on host 10.0.0.1 (listener :41000) whose peers are on 10.0.0.2 and fd00::3; the
# store on 10.0.0.9:29500. The group's connections were noted as sockets 1004 and 1008.
ME, PEER, PEER6, STORE = ("10.0.0.1", 41000), ("10.0.0.2", 42000), ("fd00::3", 43000), \
    ("10.0.0.9", 29500)
KNOWN = Known(sockets=frozenset({1004, 1008}), own=frozenset({ME}),
              never=frozenset({STORE}))


def _mine(rows):
    """{fd: (inode, ends)} from {fd: ends}, inode 1000 + fd."""
    return {fd: (1000 + fd, ends) for fd, ends in rows.items()}


@pytest.mark.no_torch
def test_the_release_shuts_the_groups_connections_and_nothing_else():
    mine = _mine({
        3: (("10.0.0.1", 50001), STORE, False),           # the store: never
        4: (("10.0.0.1", 50002), PEER, False),            # made with the group
        5: (ME, ("10.0.0.2", 50003), False),              # accepted by its listener later
        6: (ME, None, True),                              # the listener itself
        7: (("10.0.0.1", 50004), ("10.0.0.2", 22), False),    # another service
        8: (("fd00::1", 50005), None, False),             # the group's, reset by its peer
        9: (("10.0.0.1", 50006), PEER, False),            # a peer's port, not the group's
        10: None,                                         # not TCP (unix, a pipe)
    })
    assert endpoints.select(mine, KNOWN) == [4, 5, 8]


@pytest.mark.no_torch
def test_a_store_connection_made_during_init_is_never_shut():
    mine = _mine({4: (("10.0.0.1", 50001), STORE, False),
                  5: (STORE, ("10.0.0.5", 50002), False)})
    noted = KNOWN._replace(sockets=frozenset({1004, 1005}), own=KNOWN.own | {STORE})
    assert endpoints.select(mine, noted) == []


@pytest.mark.no_torch
def test_a_listener_bound_to_a_wildcard_address_matches_its_accepted_ones_by_port():
    mine = _mine({4: (("10.0.0.1", 41000), ("10.0.0.2", 50003), False),
                  5: (("127.0.0.1", 41000), ("127.0.0.1", 50004), False),
                  6: (("10.0.0.1", 41001), ("10.0.0.2", 50005), False)})
    for wildcard in ("0.0.0.0", "::"):
        known = KNOWN._replace(sockets=frozenset(), own=frozenset({(wildcard, 41000)}))
        assert endpoints.select(mine, known) == [4, 5]


@pytest.mark.no_torch
def test_nothing_is_shut_while_no_group_is_known():
    assert endpoints.known() is None and endpoints.release() == 0


def _connected(listener):
    """(client, accepted) connected to `listener`."""
    client = socket.create_connection(listener.getsockname()[:2], timeout=10)
    accepted, _ = listener.accept()
    accepted.settimeout(10)
    return client, accepted


def _is_shut(s) -> bool:
    """Whether `s` can no longer be read: its own shutdown, or its peer's."""
    s.settimeout(5)
    try:
        return s.recv(1) == b""
    except OSError:
        return True


def _listener(family=socket.AF_INET, addr="127.0.0.1"):
    s = socket.socket(family)
    if family == socket.AF_INET6:
        s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)   # dual-stack
    s.bind((addr, 0))
    s.listen()
    return s


@pytest.fixture
def gloo_is_up(monkeypatch):
    """torch.distributed as group_made() sees it: a gloo group is up."""
    fake = types.SimpleNamespace(is_initialized=lambda: True,
                                 get_backend=lambda group=None: "gloo",
                                 GroupMember=types.SimpleNamespace(NON_GROUP_MEMBER=object()))
    monkeypatch.setitem(sys.modules, "torch.distributed", fake)
    monkeypatch.setattr(endpoints, "_enabled", True)
    return fake


@pytest.mark.no_torch
def test_a_real_release_shuts_the_connections_made_with_the_group_and_keeps_the_rest(
        gloo_is_up):
    store_listener, peer_listener, other_listener = _listener(), _listener(), _listener()
    opened = [store_listener, peer_listener, other_listener]
    try:
        to_store, store_side = _connected(store_listener)      # the store's, from before
        unrelated, unrelated_side = _connected(other_listener)  # a user's, from before
        opened += [to_store, store_side, unrelated, unrelated_side]
        endpoints.rendezvous_started(store_listener.getsockname())
        # What init makes: listeners (a dual-stack one too), a connection to a peer's
        # listener, connections the listeners accept, and a second store connection.
        listeners = [_listener()] + ([_listener(socket.AF_INET6, "::")]
                                     if _has_ipv6() else [])
        to_peer, peer_side = _connected(peer_listener)
        to_store2, store_side2 = _connected(store_listener)
        opened += listeners + [to_peer, peer_side, to_store2, store_side2]
        accepted = []
        for own in listeners:
            # IPv4 clients, also to the dual-stack listener (its ends name them IPv4)
            client, mine = _connected_v4(own)
            opened += [client, mine]
            accepted.append((mine, client))
        endpoints.group_made()
        known = endpoints.known()
        assert known.own == frozenset(s.getsockname()[:2] for s in listeners)
        assert known.never == {("127.0.0.1", store_listener.getsockname()[1])}
        # Then, as with gloo's lazy init, one more accepted by a group's listener.
        late_client, late = _connected_v4(listeners[0])
        opened += [late_client, late]
        accepted.append((late, late_client))
        endpoints.group_made()        # once: nothing pending any more
        assert endpoints.known() is known
        # peer_side, store_side2, each `client`: the other ends in this very process,
        # made during "init" too, and a real rank has them in its peers: shut as well
        shut = endpoints.release()
        assert _is_shut(to_peer) and _is_shut(peer_side)
        for mine, client in accepted:
            assert _is_shut(mine) and _is_shut(client)
        assert shut >= 2 + len(accepted)
        # the store's connections and the unrelated one still carry data both ways
        for a, b in ((to_store, store_side), (to_store2, store_side2),
                     (unrelated, unrelated_side)):
            a.sendall(b"ping")
            assert b.recv(4) == b"ping"
            b.sendall(b"pong")
            assert a.recv(4) == b"pong"
        # and the fds are still open (gloo closes its own)
        assert all(s.fileno() >= 0 and os.fstat(s.fileno()) for s in opened)
    finally:
        for s in opened:
            s.close()


def _connected_v4(listener):
    client = socket.create_connection(("127.0.0.1", listener.getsockname()[1]), timeout=10)
    accepted, _ = listener.accept()
    accepted.settimeout(10)
    return client, accepted


@pytest.mark.no_torch
def test_a_group_without_gloo_notes_nothing(gloo_is_up):
    gloo_is_up.get_backend = lambda group=None: "nccl"
    endpoints.rendezvous_started(("127.0.0.1", "1"))
    with _listener() as new:
        endpoints.group_made()
        assert new.fileno() >= 0 and endpoints.known() is None


@pytest.mark.no_torch
def test_a_rank_that_does_not_heal_notes_nothing(gloo_is_up, monkeypatch):
    monkeypatch.setattr(endpoints, "_enabled", False)
    looked = []
    monkeypatch.setattr(linux, "socket_fds", lambda pid: looked.append(pid) or {})
    endpoints.rendezvous_started(("127.0.0.1", "1"))
    endpoints.group_made()
    assert endpoints.subgroup_started() is None
    assert endpoints.known() is None and looked == []


# -- real ranks -----------------------------------------------------------------------------

def blind_the_sibling_lookup():
    """In a rank: /proc's children of any process are none from now on, and each call
    of the lookup is counted (the old release asked it for the ranks' parent)."""
    st = mplaunch.rank_state()
    st["lookups"] = 0

    def children_of(pid):
        st["lookups"] += 1
        return []
    linux.children_of = children_of
    return os.getppid()


def init_gloo_in_user_code():
    import torch.distributed as dist
    dist.init_process_group("gloo")        # env://, the user's own call
    known = endpoints.known()
    return len(known.sockets) if known else None


def raise_while_peer_waits_in_allreduce():
    import torch
    import torch.distributed as dist
    if dist.get_rank() == 1:
        raise ValueError("rank one fails before the collective")
    dist.all_reduce(torch.ones(1))         # waits for rank 1: forever, unless released
    return "unreachable"


def allreduce_sum():
    import torch
    import torch.distributed as dist
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return t.item()


def lookups():
    return mplaunch.rank_state()["lookups"]


@pytest.mark.parametrize("method", ["forkserver", "fork"])
def test_a_world_releases_a_user_made_group_with_the_sibling_lookup_blind(method):
    with mplaunch.World(2, start_method=method, grace_period=20) as world:
        world.run(blind_the_sibling_lookup)
        peers = world.run(init_gloo_in_user_code)
        assert all(p and p >= 1 for p in peers), peers   # each noted its connection
        pids = world.pids
        for _ in range(2):            # the first group, then the one the heal rebuilt
            with pytest.raises(mplaunch.WorkerError) as info:
                world.run(raise_while_peer_waits_in_allreduce, timeout=120)
            err = info.value
            assert err.rank == 1 and type(err.__cause__) is ValueError
            assert not isinstance(err, mplaunch.LaunchTimeout)   # released, not timed out
            assert "rebuilt" in err.healed and world.pids == pids   # nobody was replaced
            assert world.run(allreduce_sum) == [3.0, 3.0]
        assert world.run(lookups) == [0, 0]


def make_subgroup():
    import torch.distributed as dist
    st = mplaunch.rank_state()
    st["sub"] = dist.new_group([0, 1, 2])
    known = endpoints.known()
    return len(known.sockets) if known else 0


def raise_while_peers_wait_in_the_subgroup():
    import torch
    import torch.distributed as dist
    if dist.get_rank() == 2:
        raise ValueError("rank two leaves the subgroup's collective")
    if dist.get_rank() < 2:
        dist.all_reduce(torch.ones(1), group=mplaunch.rank_state()["sub"])
    return "ok"


def test_a_collective_of_a_new_group_left_half_done_is_released():
    # new_group makes connections of its own: its members note them as the default
    # group's, so ranks 0 and 1, blocked on rank 2 in the subgroup, are released
    # (not killed at the grace period and replaced).
    with mplaunch.World(3, backend="gloo", grace_period=30) as world:
        before = world.run(lambda: len(endpoints.known().sockets))
        after = world.run(make_subgroup)
        assert [a > b for a, b in zip(after, before)] == [True, True, True], (before, after)
        pids = world.pids
        with pytest.raises(mplaunch.WorkerError) as info:
            world.run(raise_while_peers_wait_in_the_subgroup, timeout=120)
        err = info.value
        assert err.rank == 2 and type(err.__cause__) is ValueError
        assert not isinstance(err, mplaunch.LaunchTimeout)
        assert "rebuilt" in err.healed and world.pids == pids and world.fresh_ranks == []
        assert world.run(allreduce_sum) == [6.0] * 3


_RANK = r"""
import json, os, sys, time
sys.path.insert(0, {pkg_parent!r})
from mplaunch._rank import endpoints, heal, rendezvous
heal.arm_release()
rendezvous.install_hook()
import torch
import torch.distributed as dist
out, rank = sys.argv[1], int(os.environ["RANK"])

def write(name, value):
    with open(os.path.join(out, name + ".tmp"), "w") as f:
        json.dump(value, f)
    os.rename(os.path.join(out, name + ".tmp"), os.path.join(out, name))

dist.init_process_group("gloo")
known = endpoints.known()
write(f"ready.{{rank}}", {{"pid": os.getpid(), "ppid": os.getppid(),
                          "own": sorted(known.own), "sockets": len(known.sockets)}})
if rank == 0:
    start = time.monotonic()
    try:
        dist.all_reduce(torch.ones(1))     # rank 1 never joins
        outcome = "returned"
    except Exception as exc:
        outcome = f"{{type(exc).__name__}}: {{exc}}"
    write("outcome", {{"outcome": outcome, "seconds": time.monotonic() - start}})
else:
    while not os.path.exists(os.path.join(out, "stop")):
        time.sleep(0.05)
os._exit(0)
"""


def _store():
    """A TCPStore server of this process on a free port, and its port."""
    from torch.distributed import TCPStore
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    port = s.getsockname()[1]
    return TCPStore("127.0.0.1", port, 1, True, wait_for_workers=False,
                    timeout=datetime.timedelta(seconds=30),
                    master_listen_fd=s.detach()), port


def _has_key(store, key):
    """Whether the store holds key (Store.check is not bound on torch 2.1's TCPStore: a
    get that times out at once says the same there)."""
    if hasattr(store, "check"):
        return store.check([key])
    store.set_timeout(datetime.timedelta(milliseconds=200))
    try:
        store.get(key)
        return True
    except Exception:   # torch 2.1 raises RuntimeError, later DistStoreError
        return False
    finally:
        store.set_timeout(datetime.timedelta(seconds=30))


def _wait_for_file(path, procs, timeout=60):
    end = time.monotonic() + timeout
    while not os.path.exists(path):
        for p in procs:
            assert p.poll() is None, f"exited {p.returncode} before {path} appeared"
        assert time.monotonic() < end, f"never appeared: {path}"
        time.sleep(0.02)
    with open(path) as f:
        return json.load(f)


def test_ranks_that_are_not_siblings_are_released(tmp_path):
    """Two ranks of one gloo group under different parents (as on two nodes, each forked
    by its own agent): rank 0, blocked in an all_reduce rank 1 never joins, is released
    by the signal alone."""
    pkg_parent = os.path.dirname(os.path.dirname(os.path.abspath(mplaunch.__file__)))
    script = tmp_path / "rank.py"
    script.write_text(_RANK.format(pkg_parent=pkg_parent))
    store, port = _store()
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
               MPLAUNCH_STORE=f"127.0.0.1:{port}", MPLAUNCH_STORE_PREFIX="job/",
               WORLD_SIZE="2", OMP_NUM_THREADS="1")
    procs = []
    try:
        procs.append(subprocess.Popen([sys.executable, str(script), str(tmp_path)],
                                      env=dict(env, RANK="0", LOCAL_RANK="0")))
        # rank 1 one level further down, under a parent of its own
        procs.append(subprocess.Popen(
            [sys.executable, "-c", "import subprocess, sys; "
             "sys.exit(subprocess.call(sys.argv[1:]))",
             sys.executable, str(script), str(tmp_path)],
            env=dict(env, RANK="1", LOCAL_RANK="0")))
        ready = [_wait_for_file(tmp_path / f"ready.{r}", procs) for r in (0, 1)]
        assert ready[0]["ppid"] == os.getpid() and ready[1]["ppid"] == procs[1].pid
        assert ready[1]["pid"] not in linux.children_of(ready[0]["ppid"])
        assert ready[0]["pid"] not in linux.children_of(ready[1]["ppid"])
        # each noted its group's connection and listener; nothing went through the store
        assert all(r["sockets"] >= 1 and r["own"] for r in ready), ready
        assert not _has_key(store, "job/pg0//mplaunch/endpoints/1")
        outcome_path = tmp_path / "outcome"
        end = time.monotonic() + 60
        while not outcome_path.exists():  # again until it lands inside the all_reduce
            assert time.monotonic() < end and procs[0].poll() is None
            os.kill(ready[0]["pid"], RELEASE_SIGNAL)
            time.sleep(0.2)
        outcome = _wait_for_file(outcome_path, [])
        # gloo's "Connection closed by peer" (its wording varies across torch releases)
        assert outcome["outcome"] != "returned" and outcome["seconds"] < 30, outcome
        (tmp_path / "stop").touch()
        assert [p.wait(timeout=30) for p in procs] == [0, 0]
    finally:
        (tmp_path / "stop").touch()
        for p in reversed(procs):
            if p.poll() is None:
                for pid in linux.children_of(p.pid):   # rank 1, under its own parent
                    linux.kill_quiet(pid, signal.SIGKILL)
                p.kill()
            p.wait()
        del store
