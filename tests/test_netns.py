"""The network-namespace harness (tests/netns.py) gives hosts that reach each other at
addresses of their own, and torch.distributed's gloo works across them."""
from __future__ import annotations

import errno
import json
import os
import socket
import subprocess
import sys

import pytest

import netns

netns_hosts = netns.netns_hosts   # bind the fixture so pytest finds it

PY = sys.executable

# connect to argv[1]:argv[2], send "hi", print the address we connected from
CLIENT = """if 1:
    import socket, sys
    with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10) as s:
        print(s.getsockname()[0], flush=True)
        s.sendall(b"hi")
"""

# listen on argv[1], print the port, then the address of each of argv[2] peers
SERVER = """if 1:
    import socket, sys
    with socket.create_server((sys.argv[1], 0)) as s:
        s.settimeout(20)
        print(s.getsockname()[1], flush=True)
        for _ in range(int(sys.argv[2])):
            c, (ip, _) = s.accept()
            with c:
                print(ip, c.recv(2).decode(), flush=True)
"""

# try to bind argv[1]; print the errno (0: it worked)
BIND = """if 1:
    import socket, sys
    try:
        socket.create_server((sys.argv[1], 0)).close()
        print(0)
    except OSError as e:
        print(e.errno)
"""


def _recv_all(conn):
    return b"".join(iter(lambda: conn.recv(16), b""))


@pytest.mark.no_torch
def test_root_server_is_reached_from_each_namespace(netns_hosts):
    root = netns_hosts.root_addr
    with socket.create_server((root, 0)) as srv:
        srv.settimeout(20)
        port = str(srv.getsockname()[1])
        procs = [h.popen([PY, "-c", CLIENT, root, port], stdout=subprocess.PIPE, text=True)
                 for h in netns_hosts]
        peers = set()
        for _ in procs:
            conn, (ip, _) = srv.accept()
            with conn:
                assert _recv_all(conn) == b"hi"
            peers.add(ip)
        outs = [p.communicate(timeout=20)[0].strip() for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert outs == [h.addr for h in netns_hosts]   # each left from its own address
    assert peers == {h.addr for h in netns_hosts}
    assert root not in peers and len({root, *peers}) == 3


@pytest.mark.no_torch
@pytest.mark.parametrize("netns_hosts", [3], indirect=True)
def test_server_in_a_namespace_is_reached_from_the_others_and_root(netns_hosts):
    a, b, c = netns_hosts
    server = a.popen([PY, "-c", SERVER, a.addr, "3"], stdout=subprocess.PIPE, text=True)
    port = server.stdout.readline().strip()
    assert port, "the server in A did not start"
    for h in (b, c):
        r = h.run([PY, "-c", CLIENT, a.addr, port], timeout=20)
        assert r.returncode == 0 and r.stdout.strip() == h.addr, r
    with socket.create_connection((a.addr, int(port)), timeout=10) as s:
        assert s.getsockname()[0] == netns_hosts.root_addr
        s.sendall(b"hi")
    out, _ = server.communicate(timeout=20)
    assert server.returncode == 0
    assert out.splitlines() == [f"{b.addr} hi", f"{c.addr} hi",
                                f"{netns_hosts.root_addr} hi"]


@pytest.mark.no_torch
def test_each_address_is_bound_only_in_its_own_namespace(netns_hosts):
    a, b = netns_hosts
    for host, addr, want in [(a, netns_hosts.root_addr, errno.EADDRNOTAVAIL),
                             (a, b.addr, errno.EADDRNOTAVAIL),
                             (a, a.addr, 0),
                             (a, "127.0.0.1", 0)]:   # loopback is up in there
        r = a.run([PY, "-c", BIND, addr], timeout=20)
        assert (r.returncode, r.stdout.strip()) == (0, str(want)), (addr, r)
    with pytest.raises(OSError) as e:
        socket.create_server((a.addr, 0))
    assert e.value.errno == errno.EADDRNOTAVAIL


def _state(pid):
    """The state letter of /proc/PID/stat, or None when the pid is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0]
    except OSError:
        return None


@pytest.mark.no_torch
def test_exit_kills_everything_in_the_namespaces_and_deletes_them():
    if netns.unavailable_reason():
        pytest.skip(netns.unavailable_reason())
    try:
        with netns.network(1, grace=0.3) as net:
            (h,) = net
            # `ip netns exec` execs: the pid held is the shell's, then sleep's; the
            # background sleep is a grandchild the harness never saw.
            p = h.popen(["sh", "-c", "sleep 60 & echo $!; exec sleep 60"],
                        stdout=subprocess.PIPE, text=True)
            grandchild = int(p.stdout.readline())
            # ignores SIGTERM (and so does its sleep): killed after the grace period
            stubborn = h.popen(["sh", "-c", "trap '' TERM; echo; exec sleep 60"],
                               stdout=subprocess.PIPE)
            stubborn.stdout.readline()
            own = os.stat("/proc/self/ns/net").st_ino
            assert os.stat(f"/proc/{p.pid}/ns/net").st_ino == h.inode != own
            assert os.stat(f"/proc/{grandchild}/ns/net").st_ino == h.inode
            assert os.path.exists(f"/run/netns/{h.name}")
    except netns.NetnsUnavailable as e:
        pytest.skip(str(e))
    assert p.returncode == -15 and p.stdout.closed   # SIGTERM; reaped, pipe closed
    assert stubborn.returncode == -9
    assert _state(grandchild) in (None, "Z")          # a zombie of init at most
    assert net.leftovers() == []
    assert not os.path.exists(f"/run/netns/{h.name}")


@pytest.mark.no_torch
def test_a_refused_netns_add_is_unavailable_and_leaves_nothing(tmp_path, monkeypatch):
    """Where the kernel refuses namespaces (a container without CAP_NET_ADMIN) the
    fixture skips: network() raises NetnsUnavailable, after undoing what it made."""
    if netns.unavailable_reason():
        pytest.skip(netns.unavailable_reason())
    real = netns._ip_path()
    fake = tmp_path / "ip"
    fake.write_text(f"""#!/bin/sh
if [ "$1 $2" = "netns add" ]; then echo "Operation not permitted" >&2; exit 1; fi
exec {real} "$@"
""")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    with pytest.raises(netns.NetnsUnavailable, match="netns add.*Operation not permitted"):
        with netns.network(2):
            pass
    monkeypatch.undo()
    links = subprocess.run([real, "-o", "link"], capture_output=True, text=True).stdout
    assert f"mn{os.getpid():x}c" not in links


# One rank of a gloo group: rendezvous at argv[1] as rank argv[2] of argv[3], all_reduce,
# then report the value and this process's TCP sockets (psutil reads /proc/self/net,
# i.e. this namespace's view).
RANK = """if 1:
    import json, sys, torch, psutil
    import torch.distributed as dist
    url, rank, world = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    dist.init_process_group("gloo", init_method=url, rank=rank, world_size=world)
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    ip = lambda a: a.ip.removeprefix("::ffff:")
    conns = psutil.Process().net_connections("tcp")
    print(json.dumps({
        "sum": t.item(),
        "listen": [[ip(c.laddr), c.laddr.port] for c in conns if c.status == "LISTEN"],
        "peers": [[ip(c.laddr), ip(c.raddr), c.raddr.port] for c in conns if c.raddr],
    }), flush=True)
    dist.destroy_process_group()
"""


@pytest.fixture
def root_store(netns_hosts):
    """A TCPStore hosted in the root namespace on its address, as mplaunch's front hosts
    one: the listening socket is bound first and handed over. Yields its port."""
    pytest.importorskip("torch")
    from torch.distributed import TCPStore
    sock = socket.create_server((netns_hosts.root_addr, 0))
    port = sock.getsockname()[1]
    store = TCPStore(netns_hosts.root_addr, port, 2, True, wait_for_workers=False,
                     master_listen_fd=sock.detach())
    yield port
    del store


def _ranks(hosts, url, env):
    procs = [h.popen([PY, "-c", RANK, url, str(r), str(len(hosts))], env=env,
                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r, h in enumerate(hosts)]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=90)
        assert p.returncode == 0, err
        results.append(json.loads(out))
    return results


def test_gloo_all_reduce_across_namespaces(netns_hosts, root_store):
    a, b = netns_hosts
    root = netns_hosts.root_addr
    env = dict(os.environ, **netns.TORCH_ENV)
    results = _ranks([a, b], f"tcp://{root}:{root_store}", env)
    for me, peer, res in ((a, b, results[0]), (b, a, results[1])):
        assert res["sum"] == 3.0
        # gloo listens on this namespace's address only; the one other listener
        # tolerated is a wildcard on the store's port (torch 2.14's rank 0 hosts a
        # store of its own there despite TORCHELASTIC_USE_AGENT_STORE)
        named = [ip for ip, port in res["listen"]
                 if not (ip in ("::", "0.0.0.0") and port == root_store)]
        assert named and all(ip == me.addr for ip in named), res
        # the pair to the peer runs between the two addresses; the store's is to root
        assert any(l == me.addr and r == peer.addr for l, r, _ in res["peers"]), res
        assert any(l == me.addr and r == root and p == root_store
                   for l, r, p in res["peers"]), res
        assert not any("127.0.0.1" in (l, r) for l, r, _ in res["peers"]), res


def test_without_the_env_gloo_binds_loopback_and_rank_0_hosts_a_store(netns_hosts,
                                                                     root_store):
    """Why netns.TORCH_ENV: without GLOO_SOCKET_IFNAME gloo listens on (and would give
    its peers) 127.0.0.1, the hostname's address; without TORCHELASTIC_USE_AGENT_STORE
    rank 0 starts a second store on the port, which its namespace lets it bind."""
    a = netns_hosts[0]
    env = {k: v for k, v in os.environ.items() if k not in netns.TORCH_ENV}
    (res,) = _ranks([a], f"tcp://{netns_hosts.root_addr}:{root_store}", env)
    assert res["sum"] == 1.0
    gloo = [ip for ip, port in res["listen"] if port != root_store]
    assert gloo == ["127.0.0.1"], res
    assert any(port == root_store for _, port in res["listen"]), res
