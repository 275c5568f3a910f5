"""The release of a collective left half-done (mplaunch._rank.endpoints, _rank.heal): which
connections a rank shuts is decided by the endpoints its group's ranks published in the
store, never by who else runs on this machine, so it works across nodes."""
from __future__ import annotations

import datetime
import json
import logging
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

LISTEN, ESTABLISHED = linux.TCP_LISTEN, 0x01


@pytest.fixture(autouse=True)
def _no_group_known():
    """Each test starts and ends with no group's endpoints known in this process."""
    endpoints._known = endpoints._pending = endpoints._store = None
    yield
    endpoints._known = endpoints._pending = endpoints._store = None


def _has_ipv6() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError:
        return False
    return True


# -- what /proc/net/tcp{,6} says --------------------------------------------------------

@pytest.mark.no_torch
def test_proc_addresses_are_decoded_ipv4_mapped_ones_as_ipv4():
    little = sys.byteorder == "little"
    v4 = "0100007F" if little else "7F000001"
    assert linux.decode_endpoint(f"{v4}:1F90") == ("127.0.0.1", 8080)
    mapped = ("0000000000000000FFFF0000" + ("0700000A" if little else "0A000007"))
    assert linux.decode_endpoint(f"{mapped}:A0D2") == ("10.0.0.7", 41170)
    v6 = "000080FE00000000" + ("00000000" + "01000000" if little else "0000000000000001")
    assert linux.decode_endpoint(f"{v6}:0016") == ("fe80::1", 22)
    for bad in ("0100007F", "01007F:0016", "zz00007F:0016", "-100007F:0016",
                "0100007F:", "0100007F:+16"):
        with pytest.raises(ValueError):
            linux.decode_endpoint(bad)


@pytest.mark.no_torch
def test_this_process_tcp_sockets_are_read_from_proc_with_their_state():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        addr = server.getsockname()
        with socket.create_connection(addr) as client:
            accepted, _ = server.accept()
            with accepted:
                table = linux.tcp_sockets()
                fds = linux.socket_fds(os.getpid())
                ends = [table[fds[s.fileno()]] for s in (server, client, accepted)]
                here = client.getsockname()
    assert ends == [(addr, ("0.0.0.0", 0), LISTEN), (here, addr, ESTABLISHED),
                    (addr, here, ESTABLISHED)]


# -- what the store holds ---------------------------------------------------------------

@pytest.mark.no_torch
def test_published_endpoints_are_read_in_each_form():
    raw = json.dumps([["10.0.0.7", 41234], "10.0.0.8:5000", "[fd00::2]:6000",
                      ["::ffff:10.0.0.9", 7000], "fd00::3:8000"])
    assert endpoints.parse(raw.encode(), "rank 1") == [
        ("10.0.0.7", 41234), ("10.0.0.8", 5000), ("fd00::2", 6000), ("10.0.0.9", 7000),
        ("fd00::3", 8000)]


GARBAGE_VALUES = [
    b"\xff\xfe not utf-8", b"not json", b"{\"10.0.0.7\": 41234}", b"\"10.0.0.7:1\"",
    b"__import__('os').system('true')", b"[" * 5000 + b"]" * 5000,
    json.dumps([["10.0.0.7", 1]] * (endpoints.MAX_ENTRIES + 1)).encode(),
    b" " * (endpoints.MAX_BYTES + 1) + b"[]",
]


@pytest.mark.no_torch
@pytest.mark.parametrize("raw", GARBAGE_VALUES, ids=range(len(GARBAGE_VALUES)))
def test_a_value_that_is_not_a_list_of_endpoints_is_ignored_and_logged(raw, caplog):
    with caplog.at_level(logging.WARNING, logger="mplaunch"):
        assert endpoints.parse(raw, "rank 3") == []
    assert len(caplog.records) == 1 and "rank 3" in caplog.text and "ignored" in caplog.text


@pytest.mark.no_torch
def test_each_entry_that_is_not_an_endpoint_is_ignored_and_logged(caplog):
    bad = [["10.0.0.7", True], ["10.0.0.7", 1.5], ["10.0.0.7", "80"], ["10.0.0.7", 0],
           ["10.0.0.7", 65536], ["10.0.0.7", 2 ** 80], ["node7", 80], "node7:80",
           "10.0.0.7", "10.0.0.7:", "10.0.0.7:８０", ["10.0.0.7", 80, 1], [80, "10.0.0.7"],
           {"addr": "10.0.0.7"}, None, 7]
    raw = json.dumps(bad + [["10.0.0.7", 80]])
    with caplog.at_level(logging.WARNING, logger="mplaunch"):
        assert endpoints.parse(raw, "rank 2") == [("10.0.0.7", 80)]
    assert len(caplog.records) == len(bad)
    assert all("rank 2" in r.getMessage() for r in caplog.records)


# -- which connections the release shuts ----------------------------------------------------

# A rank on host 10.0.0.1 (listener :41000) whose peers are on 10.0.0.2 and fd00::3; the
# store on 10.0.0.9:29500.
ME, PEER, PEER6, STORE = ("10.0.0.1", 41000), ("10.0.0.2", 42000), ("fd00::3", 43000), \
    ("10.0.0.9", 29500)
KNOWN = Known(own=frozenset({ME}), peers=frozenset({PEER, PEER6}),
              never=frozenset({STORE}))


def _table(rows):
    """({fd: inode}, {inode: (local, remote, state)}) from {fd: (local, remote, state)}."""
    return ({fd: 1000 + fd for fd in rows}, {1000 + fd: row for fd, row in rows.items()})


@pytest.mark.no_torch
def test_the_release_shuts_the_groups_connections_and_nothing_else():
    mine, table = _table({
        3: (("10.0.0.1", 50001), STORE, ESTABLISHED),          # the store: never
        4: (("10.0.0.1", 50002), PEER, ESTABLISHED),           # to a peer's listener
        5: (ME, ("10.0.0.2", 50003), ESTABLISHED),             # accepted by ours
        6: (ME, ("0.0.0.0", 0), LISTEN),                       # our listener itself
        7: (("10.0.0.1", 50004), ("10.0.0.2", 22), ESTABLISHED),   # another service
        8: (("fd00::1", 50005), PEER6, ESTABLISHED),           # a peer over IPv6
        9: (("10.0.0.1", 50006), ("10.0.0.3", 42000), ESTABLISHED),  # same port, not it
    })
    mine[10] = 9999                                            # not TCP (unix, a pipe)
    assert endpoints.select(mine, table, KNOWN) == [4, 5, 8]


@pytest.mark.no_torch
def test_a_peer_that_publishes_the_stores_endpoint_does_not_get_it_shut():
    mine, table = _table({3: (("10.0.0.1", 50001), STORE, ESTABLISHED),
                          4: (STORE, ("10.0.0.5", 50002), ESTABLISHED)})
    lying = KNOWN._replace(peers=KNOWN.peers | {STORE}, own=KNOWN.own | {STORE})
    assert endpoints.select(mine, table, lying) == []


@pytest.mark.no_torch
def test_a_listener_bound_to_a_wildcard_address_matches_its_accepted_ones_by_port():
    mine, table = _table({4: (("10.0.0.1", 41000), ("10.0.0.2", 50003), ESTABLISHED),
                          5: (("127.0.0.1", 41000), ("127.0.0.1", 50004), ESTABLISHED),
                          6: (("10.0.0.1", 41001), ("10.0.0.2", 50005), ESTABLISHED)})
    for wildcard in ("0.0.0.0", "::"):
        known = KNOWN._replace(own=frozenset({(wildcard, 41000)}))
        assert endpoints.select(mine, table, known) == [4, 5]
    # a peer's wildcard says nothing about which host it is on: it matches nothing
    known = KNOWN._replace(peers=frozenset({("0.0.0.0", 50003)}), own=frozenset())
    assert endpoints.select(mine, table, known) == []


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


@pytest.mark.no_torch
def test_a_real_release_shuts_the_peer_connections_and_keeps_the_fds_and_the_store():
    listeners = []
    for family, addr in ([(socket.AF_INET, "127.0.0.1")]
                         + ([(socket.AF_INET6, "::")] if _has_ipv6() else [])):
        s = socket.socket(family)
        if family == socket.AF_INET6:
            s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)   # dual-stack
        s.bind((addr, 0))
        s.listen()
        listeners.append(s)
    store_listener, peer_listener = socket.socket(), socket.socket()
    for s in (store_listener, peer_listener):
        s.bind(("127.0.0.1", 0))
        s.listen()
    opened = [store_listener, peer_listener] + listeners
    try:
        to_store, store_side = _connected(store_listener)
        to_peer, peer_side = _connected(peer_listener)
        opened += [to_store, store_side, to_peer, peer_side]
        accepted = []
        for own in listeners:
            # IPv4 clients, also to the dual-stack listener: tcp6 lists those accepted
            # ones as ::ffff:127.0.0.1
            client = socket.create_connection(("127.0.0.1", own.getsockname()[1]),
                                              timeout=10)
            mine, _ = own.accept()
            opened += [client, mine]
            accepted.append((mine, client))
        endpoints._known = Known(
            own=frozenset((s.getsockname()[0], s.getsockname()[1]) for s in listeners),
            peers=frozenset({peer_listener.getsockname()}),
            never=frozenset({store_listener.getsockname()}))
        assert endpoints.release() == 1 + len(listeners)
        assert _is_shut(to_peer) and _is_shut(peer_side)
        for mine, client in accepted:
            assert _is_shut(mine) and _is_shut(client)
        # the store's connection still carries data both ways
        to_store.sendall(b"ping")
        assert store_side.recv(4) == b"ping"
        store_side.sendall(b"pong")
        assert to_store.recv(4) == b"pong"
        # and the fds are still open (gloo closes its own)
        assert all(s.fileno() >= 0 and os.fstat(s.fileno()) for s in opened)
    finally:
        for s in opened:
            s.close()


# -- publishing and reading through a real store --------------------------------------------

def _store():
    """A TCPStore server of this process on a free port, and its port."""
    from torch.distributed import TCPStore   # before a test fakes torch.distributed
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    port = s.getsockname()[1]
    return TCPStore("127.0.0.1", port, 1, True, wait_for_workers=False,
                    timeout=datetime.timedelta(seconds=30),
                    master_listen_fd=s.detach()), port


@pytest.fixture
def fake_gloo_group(monkeypatch):
    """torch.distributed as group_made() sees it: a gloo group is up (its PrefixStore
    the real one)."""
    from torch.distributed import PrefixStore, TCPStore  # noqa: F401 - imported for good
    fake = types.SimpleNamespace(is_initialized=lambda: True, get_backend=lambda: "gloo",
                                 PrefixStore=PrefixStore, TCPStore=TCPStore)
    monkeypatch.setitem(sys.modules, "torch.distributed", fake)
    return fake


def test_a_rank_publishes_its_new_listeners_and_reads_its_peers_once(
        fake_gloo_group, monkeypatch, caplog):
    PrefixStore = fake_gloo_group.PrefixStore
    monkeypatch.setattr(endpoints, "PEERS_WAIT", 0.5)
    store, port = _store()
    old = socket.socket()
    old.bind(("127.0.0.1", 0))
    old.listen()                      # already there before the rendezvous: not the group's
    new = socket.socket()
    try:
        space = PrefixStore("job/pg0/", store)
        space.set(endpoints.KEY + "1", json.dumps([["10.0.0.2", 42000], "node2:1"]))
        space.set(endpoints.KEY + "2", b"\x00garbage")
        # rank 3 publishes nothing (it died right after init)
        endpoints.rendezvous_started(space, 0, 4, ("127.0.0.1", str(port)))
        assert endpoints.known() is None
        new.bind(("127.0.0.1", 0))
        new.listen()                  # the group's listener (gloo's, in a real rank)
        with caplog.at_level(logging.WARNING, logger="mplaunch"):
            endpoints.group_made()
        known = endpoints.known()
        assert known == Known(own=frozenset({new.getsockname()}),
                              peers=frozenset({("10.0.0.2", 42000)}),
                              never=frozenset({("127.0.0.1", port)}))
        # the key, in the group's key space, in the raw store
        assert json.loads(store.get("job/pg0//mplaunch/endpoints/0")) == [
            list(new.getsockname())]
        said = caplog.text
        assert "rank 1" in said and "node2:1" in said and "rank 2" in said
        assert "only ranks [1, 2] published" in said
        endpoints.group_made()        # once: nothing pending any more
        assert endpoints.known() is known
    finally:
        old.close()
        new.close()
        del store


def test_a_group_without_gloo_exchanges_nothing(fake_gloo_group):
    PrefixStore = fake_gloo_group.PrefixStore
    fake_gloo_group.get_backend = lambda: "nccl"
    store, port = _store()
    try:
        space = PrefixStore("job/pg0/", store)
        keys = store.num_keys()
        endpoints.rendezvous_started(space, 0, 2, ("127.0.0.1", str(port)))
        endpoints.group_made()
        assert endpoints.known() is None and store.num_keys() == keys
    finally:
        del store


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
    return sorted(known.peers) if known else None


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
        assert all(p and len(p) == 1 for p in peers), peers   # each knows its one peer
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
    return len(known.peers) if known else 0


def raise_while_peers_wait_in_the_subgroup():
    import torch
    import torch.distributed as dist
    if dist.get_rank() == 2:
        raise ValueError("rank two leaves the subgroup's collective")
    if dist.get_rank() < 2:
        dist.all_reduce(torch.ones(1), group=mplaunch.rank_state()["sub"])
    return "ok"


def test_a_collective_of_a_new_group_left_half_done_is_released():
    # new_group makes listeners of its own: its members exchange them as the default
    # group's do, so ranks 0 and 1, blocked on rank 2 in the subgroup, are released
    # (not killed at the grace period and replaced).
    with mplaunch.World(3, backend="gloo", grace_period=30) as world:
        before = world.run(lambda: len(endpoints.known().peers))
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
                          "own": sorted(known.own), "peers": sorted(known.peers)}})
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
        # each knows the other's listener, as the other published it
        assert ready[0]["peers"] == ready[1]["own"] and ready[1]["peers"] == ready[0]["own"]
        assert json.loads(store.get("job/pg0//mplaunch/endpoints/1")) == ready[1]["own"]
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
