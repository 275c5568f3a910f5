"""mplaunch.World(nprocs, nnodes=2) without SLURM or Ray: scheduler="local", the
stand-in of tests/local_step.py, starts one agent per "node" on this machine (or each
in a network namespace of its own, tests/netns.py). Real processes and real gloo.

The scenarios every scheduler runs (order and environment, output and stacks, every
heal, an interrupt, a killed agent, restarts, foreign clients, the magic) are
tests/nodes_scenarios.py's, run here with the `sched` fixture below; the SLURM and Ray
modules run the same ones. Here too what only the stand-in can show: the per-World
secret's proof itself (mplaunch/_wire/auth.py), nodes with addresses of their own, a
rank flooding its output, a step that dies before its agents join."""
from __future__ import annotations

import contextlib
import os
import pickle
import signal
import socket
import threading
import time

import psutil
import pytest

pytest.register_assert_rewrite("nodes_scenarios")

import local_step  # noqa: E402
import mplaunch  # noqa: E402
import netns  # noqa: E402
import nodes_scenarios  # noqa: E402
from mplaunch._engine import servers as _procs  # noqa: E402
from mplaunch._wire import auth  # noqa: E402
from nodes_scenarios import *  # noqa: E402,F401,F403 - the shared scenarios
from nodes_scenarios import (alive, allreduce_sum, count_calls,  # noqa: E402
                             die_in_rank_three, world_processes, world_processes_of)

netns_hosts = netns.netns_hosts   # bind the fixture so pytest finds it

HERE = os.path.dirname(os.path.abspath(__file__))

pytestmark = pytest.mark.timeout(150)


def named_nodes(i):
    """Each node's agent is handed a name of its own, as a scheduler hands it
    (_wire.tunnel.NAME_ENV), so the output's prefix and World.nodes tell the two
    stand-in nodes apart."""
    return ["env", f"MPLAUNCH_NODE_NAME=node{i}"]


SLURM_TASK_VARS = ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID", "SLURM_NTASKS",
                   "SLURM_TASK_PID")


class LocalNodes(nodes_scenarios.Nodes):
    """Stand-in nodes: one step process (tests/local_step.py) with an agent per node
    below it, all children of this process."""
    scheduler = "local"
    replaces = True

    def options(self, **options):
        options.setdefault("master_addr", "127.0.0.1")
        options.setdefault("local_wrap", named_nodes)
        return super().options(**options)

    def launcher_env(self, monkeypatch):
        # Inside a SLURM step the launching process's task variables describe it: each
        # rank must see its own, on every node, not the launching process's task 0.
        monkeypatch.setenv("SLURM_PROCID", "0")
        monkeypatch.setenv("SLURM_JOB_ID", "4242")
        monkeypatch.setenv("SLURM_TASK_PID", str(os.getpid()))

    def check_names(self, names):
        assert names == [f"node{i}" for i in range(len(names))], names

    def check_rank_env(self, w, rank, node, local, got):
        env = got["env"]
        assert env["MASTER_ADDR"] == "127.0.0.1", env
        if "SLURM_PROCID" in os.environ:     # launched from a task: the ranks' own
            assert {k: env.get(k) for k in SLURM_TASK_VARS} == {
                "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(local),
                "SLURM_NODEID": str(node), "SLURM_NTASKS": str(w.size),
                "SLURM_TASK_PID": str(got["pid"])}, (rank, env)  # its own, not its agent's

    def step(self, w):
        """The step process: the one parent of every agent."""
        parents = {psutil.Process(a).ppid() for a in nodes_scenarios.agents(w)}
        assert len(parents) == 1, "the agents are children of one step process"
        return parents.pop()

    def step_pids(self, w):
        # the step, and any replaced node's part-step: each agent's parent
        return {psutil.Process(a).ppid() for a in nodes_scenarios.agents(w)}

    def check_up(self, w):
        step = psutil.Process(self.step(w))
        assert step.ppid() == os.getpid()
        assert sorted(p.pid for p in step.children()) == sorted(nodes_scenarios.agents(w))
        assert len(w.nodes) == w.nnodes


@pytest.fixture
def sched():
    return LocalNodes()


def world(**options):
    return LocalNodes().world(**options)   # 2 ranks on each node: 4


def test_restart_across_nodes_is_refused_to_a_world_on_one_node():
    with mplaunch.World(2) as one, pytest.raises(ValueError, match="across nodes"):
        one.restart(nnodes=2)


# -- 6. authentication ------------------------------------------------------------------

SECRET = "s3cret" * 10


def _prove_pair(server_secret, client_secret):
    """prove() on both ends of a socketpair; each side's outcome (None or the error)."""
    a, b = socket.socketpair()
    outcome = {}

    def side(name, sock, secret, server):
        try:
            auth.prove(sock, secret, server=server, timeout=5.0)
            outcome[name] = None
        except (auth.AuthError, OSError) as exc:
            outcome[name] = exc
        finally:
            # as a real peer does: a side that refused closes, the other does not hang
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    t = threading.Thread(target=side, args=("server", a, server_secret, True))
    t.start()
    side("client", b, client_secret, False)
    t.join(10)
    a.close()
    b.close()
    return outcome


@pytest.mark.no_torch
def test_auth_the_same_secret_passes_both_ways():
    assert _prove_pair(SECRET, SECRET) == {"server": None, "client": None}


@pytest.mark.no_torch
def test_auth_a_wrong_secret_fails_on_both_sides():
    outcome = _prove_pair(SECRET, SECRET + "x")
    for side in ("server", "client"):
        assert isinstance(outcome[side], auth.AuthError), outcome
    assert "secret" in str(outcome["server"])


class _Boom:
    """A pickle that, if anyone unpickled it, would create `path`."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def _server_against(client, timeout=2.0):
    """prove(server=True) against `client(sock)` on the other end; the server's error."""
    a, b = socket.socketpair()
    t = threading.Thread(target=client, args=(b,))
    t.start()
    try:
        with pytest.raises(auth.AuthError) as info:
            auth.prove(a, SECRET, server=True, timeout=timeout)
    finally:
        a.close()
        t.join(10)
        b.close()
    return info.value


@pytest.mark.no_torch
def test_auth_refuses_garbage_nothing_silence_and_a_pickle_without_unpickling(tmp_path):
    # garbage where the protocol's magic belongs
    err = _server_against(lambda s: s.sendall(os.urandom(200)))
    assert "protocol" in str(err)
    # a client that connects and closes at once
    err = _server_against(lambda s: s.shutdown(socket.SHUT_WR))
    assert "closed" in str(err)
    # a client that connects and says nothing: bounded by the timeout
    took = []
    a, b = socket.socketpair()     # b: the client, which never writes
    with a, b, pytest.raises(auth.AuthError) as info:
        start = time.monotonic()
        try:
            auth.prove(a, SECRET, server=True, timeout=0.5)
        finally:
            took.append(time.monotonic() - start)
    assert "within" in str(info.value) and 0.4 < took[0] < 3.0, took
    # a pickle whose loading would create a file: read as bytes and refused
    marker = tmp_path / "unpickled"
    blob = pickle.dumps(_Boom(marker))
    err = _server_against(lambda s: s.sendall(blob + b"\0" * 64))
    assert "protocol" in str(err)
    # the same pickle after a well-formed challenge, in place of the answer
    blob = pickle.dumps(_Boom(marker)).ljust(64, b"\0")

    def challenge_then_pickle(s):
        s.sendall(auth._MAGIC + os.urandom(32) + blob)

    err = _server_against(challenge_then_pickle)
    assert "secret" in str(err)
    assert not marker.exists()
    pickle.loads(pickle.dumps(_Boom(marker))).close()   # the check can see one
    assert marker.exists()


@pytest.mark.no_torch
def test_auth_refuses_a_peer_that_reflects_our_own_challenge_and_answer():
    """Without the secret, a man in the middle sends the server's own bytes back: the
    nonce, then the server's MAC (which is for the role "server", not "client")."""
    def reflect(s):
        with contextlib.suppress(OSError):
            head = s.recv(len(auth._MAGIC) + 32, socket.MSG_WAITALL)
            s.sendall(head)
            mac = s.recv(32, socket.MSG_WAITALL)
            s.sendall(mac)

    err = _server_against(reflect)
    assert "own challenge" in str(err) or "secret" in str(err)


# -- 7. nodes with addresses of their own ------------------------------------------------

def gloo_sockets():
    """This rank's all_reduce, then its TCP sockets as this namespace sees them."""
    value = allreduce_sum()
    ip = lambda a: a.ip[7:] if a.ip.startswith("::ffff:") else a.ip  # noqa: E731
    conns = psutil.Process().net_connections("tcp")
    return {"sum": value, "pid": os.getpid(), "rank": int(os.environ["RANK"]),
            "listen": sorted(ip(c.laddr) for c in conns if c.status == "LISTEN"),
            "peers": sorted([ip(c.laddr), ip(c.raddr)] for c in conns if c.raddr)}


def test_nodes_in_network_namespaces_use_their_own_addresses(netns_hosts):
    hosts = list(netns_hosts)
    root = netns_hosts.root_addr
    with world(master_addr=root, local_wrap=lambda i: hosts[i].argv(named_nodes(i)),
               env={"GLOO_SOCKET_IFNAME": netns.IFNAME}, grace_period=2) as w:
        results = w.run(gloo_sockets)
        assert [r["rank"] for r in results] == [0, 1, 2, 3]
        for rank, res in enumerate(results):
            me = hosts[rank // 2].addr
            other = hosts[1 - rank // 2].addr
            assert res["sum"] == 10.0
            # the rank's process is in its node's namespace
            assert os.stat(f"/proc/{res['pid']}/ns/net").st_ino == hosts[rank // 2].inode
            # gloo listens on the node's own address only
            assert res["listen"] and set(res["listen"]) == {me}, res
            # its pairs run from its own address: to the other node's ranks at theirs
            assert [me, other] in res["peers"], res
            # the store is the front's, in the root namespace
            assert [me, root] in res["peers"], res
            assert not any("127.0.0.1" in pair for pair in res["peers"]), res
        pids = w.pids
        with pytest.raises(mplaunch.WorkerError) as info:
            w.run(die_in_rank_three, timeout=120)
        assert info.value.rank == 3 and "replaced" in info.value.healed
        assert w.fresh_ranks == [3]
        assert w.pids[3] != pids[3] and all(w.pids[r] == pids[r] for r in range(3))
        assert os.stat(f"/proc/{w.pids[3]}/ns/net").st_ino == hosts[1].inode
        results = w.run(gloo_sockets)
        assert [r["sum"] for r in results] == [10.0] * 4
        assert set(results[3]["listen"]) == {hosts[1].addr}
        tree = world_processes(w) | LocalNodes().step_pids(w)
    # gone with the World's close, not killed by the fixture's teardown of the namespaces
    assert alive(tree, timeout=0) == []
    assert not netns._pids_in({h.inode for h in hosts})


# -- output nobody reads ------------------------------------------------------------------

FLOOD = 1 << 30


def flood_between_calls(progress_path):
    """In rank 2 (node 1): a thread writes 1 GiB to stdout after the call returned, and
    notes in `progress_path` how much the pipe has taken so far."""
    if os.environ["RANK"] != "2":
        return 0

    def write():
        chunk = b"x" * ((1 << 20) - 1) + b"\n"
        fd = os.open(progress_path, os.O_WRONLY | os.O_CREAT)
        done = 0
        while done < FLOOD:
            done += os.write(1, chunk)
            os.pwrite(fd, f"{done:>12}".encode(), 0)
        os.close(fd)
    threading.Thread(target=write, daemon=True).start()
    return 1


def _progress(path) -> int:
    try:
        with open(path) as f:
            return int(f.read() or 0)
    except (OSError, ValueError):
        return 0


def test_a_remote_rank_flooding_its_output_between_calls_is_slowed_not_buffered(
        tmp_path, capfd):
    # A rank on this node blocks on its pipe while no call reads it; one on another node
    # is held the same way by its agent's output window, not buffered without bound in
    # the launching process.
    me = psutil.Process()
    progress = tmp_path / "progress"
    with world() as w:
        w.run(int, (1,))
        before = me.memory_info().rss
        assert sum(w.run(flood_between_calls, (str(progress),))) == 1
        last, still_since, end = -1, time.monotonic(), time.monotonic() + 30
        while time.monotonic() < end:
            now = _progress(progress)
            if now != last:
                last, still_since = now, time.monotonic()
            elif time.monotonic() - still_since > 2.0:
                break            # the writer is blocked
            time.sleep(0.1)
        grown = me.memory_info().rss - before
        assert 0 < last < 128 << 20, f"{last >> 20} MiB went out of the rank unread"
        assert grown < 96 << 20, f"the launching process grew {grown >> 20} MiB"
    capfd.readouterr()   # what was relayed as the world closed


# -- a step that dies early ---------------------------------------------------------------

def test_a_step_that_ends_before_its_agents_join_is_named_with_what_it_printed():
    """The scheduler's step fails before any agent connects (srun refused, a node that
    cannot run Python): the error says so at once, with the step's command and its last
    output, and nothing is left running."""
    def broken(i):
        return ["sh", "-c", f"echo node {i} cannot start its agent >&2; exit 3", "sh"]

    begin = time.monotonic()
    with pytest.raises(Exception) as info:
        with world(local_wrap=broken) as w:
            w.run(count_calls)
    msg = str(info.value)
    assert "ended (exit status 3) before 2 joined" in msg, msg
    assert "local_step.py: agent(s) of node(s) [0, 1]" in msg, msg
    assert "node 0 cannot start its agent" in msg and "node 1" in msg, msg
    assert time.monotonic() - begin < 30, "not at once: it waited for the join timeout"


class _DiesFirst(local_step.Local):
    """A step whose scheduler's start itself fails, before any agent is started."""

    def start(self, launch):
        raise RuntimeError("this scheduler could not start its step")


def test_a_scheduler_whose_start_fails_leaves_nothing_and_the_world_can_be_closed():
    from mplaunch._engine.nodes import schedulers
    local_step.register("local-dies-first", _DiesFirst)
    try:
        w = world(scheduler="local-dies-first")
        with pytest.raises(Exception, match="could not start its step"):
            w.run(count_calls)
        w.close()
        assert w.pids == {} and w.nodes == []
    finally:
        schedulers.unregister("local-dies-first")


def test_a_node_that_cannot_place_its_ranks_ends_the_step_and_leaves_nothing():
    """The agents joined, and one cannot run the World (gpus= on a node without any):
    the error names the node and why, and the step, its agents and their servers end
    with it (they were left up, the step a zombie, while the agents started)."""
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(RuntimeError, match=r"node \d \(node\d\) cannot run this World: "
                                           r"ValueError: gpus=\[0, 1\] .* no GPU"):
        with world(gpus=[0, 1]) as w:
            w.run(count_calls)
    left = [p for p in psutil.Process().children(recursive=True) if p.pid not in before
            and p.pid not in _procs.server_pids() + _procs.idle_pool_pids()]
    assert left == [], [(p.pid, p.status()) for p in left]


def test_a_rank_starts_where_its_node_can_and_imports_from_the_nodes_path_too():
    """for_this_node (what an agent does to each rank's spec): the directory the node's
    starter names wins; else the launcher's, where the node has it; else the agent's.
    The agent's import path entries the launcher's lacks follow the launcher's."""
    from mplaunch._wire.spec import RankSpec, for_this_node
    spec = RankSpec(rank=0, local_rank=0, node_rank=1, hostname="h", env={},
                    cwd=HERE, sys_path=("/launcher/a", "/shared"))
    here = ("/node/x", "/shared", "", "/node/x")
    assert for_this_node(spec, None, "/agent", ("/launcher/a", "/shared")) is spec
    got = for_this_node(spec, None, "/agent", here)
    assert got.cwd == HERE and got.sys_path == ("/launcher/a", "/shared", "/node/x")
    missing = RankSpec(**{**spec.__dict__, "cwd": os.path.join(HERE, "not-on-this-node")})
    assert for_this_node(missing, None, "/agent", here).cwd == "/agent"
    assert for_this_node(spec, "/ray/working_dir", "/agent", here).cwd == "/ray/working_dir"


@contextlib.contextmanager
def no_spare_world(**options):
    """A World on 2 stand-in nodes (2 ranks each) whose scheduler has no node to
    replace a lost one with."""
    from mplaunch._engine.nodes import schedulers
    local_step.register("local-no-spare", local_step.NoSpare)
    try:
        with world(scheduler="local-no-spare", grace_period=2, **options) as w:
            yield w
    finally:
        schedulers.unregister("local-no-spare")


def rank_numbers():
    import torch.distributed as dist
    return ({k: os.environ[k] for k in nodes_scenarios.RANK_VARS},
            (dist.get_rank(), dist.get_world_size()), os.getpid())


def lost_for_good(w, node):
    """Kill node `node`'s agent; return once the World knows it is lost."""
    os.kill(w.nodes[node]["agent_pid"], signal.SIGKILL)
    end = time.monotonic() + 10
    while w.nodes[node]["lost"] is None:
        assert time.monotonic() < end, "the lost node was not noticed within 10 s"
        time.sleep(0.05)


def test_a_lost_node_without_a_replacement_keeps_the_others_until_the_next_run():
    with no_spare_world() as w:
        assert w.run(count_calls) == [1] * 4
        node0, node1 = (world_processes_of(w, n) for n in (0, 1))
        survivors = {w.pids[0], w.pids[1]}
        os.kill(w.nodes[1]["agent_pid"], signal.SIGKILL)
        with pytest.raises(mplaunch.WorkerError) as info:
            w.run(count_calls, timeout=60)
        healed = str(info.value.healed)
        assert "could not be healed" in healed and "node 1 could not be replaced" in \
            healed and "ended (exit status 1)" in healed, healed
        assert "the ranks on the other 1 node(s) were kept" in healed and \
            "(ranks 0-1)" in healed and "world.restart(nnodes=1) goes on with them, " \
            "renumbered 0..1" in healed and "a run or restart() starts fresh ranks on a " \
            "new step of 2 nodes" in healed, healed
        assert nodes_scenarios.alive(node1, timeout=20) == []
        assert set(nodes_scenarios.alive(survivors, timeout=0)) == survivors
        assert w.nodes[1]["lost"] and w.nodes[0]["lost"] is None
        # mplaunch's own calls would end them: refused, saying what to do
        for ask in (w.debug, w.report):
            with pytest.raises(RuntimeError, match=r"world\.restart\(nnodes=1\), which "
                                                   r"goes on with them"):
                ask()
        assert set(nodes_scenarios.alive(survivors, timeout=0)) == survivors
        assert w.run(count_calls) == [1] * 4      # a fresh step, fresh ranks
        assert nodes_scenarios.alive(node0, timeout=20) == []


def test_restart_with_the_nodes_left_goes_on_with_the_survivors_renumbered(caplog):
    with no_spare_world() as w:
        assert w.run(count_calls) == [1] * 4 and w.run(count_calls) == [2] * 4
        w.run(keep_a_subgroup)
        pids = w.pids
        os.kill(w.nodes[0]["agent_pid"], signal.SIGKILL)     # node 0: the others move
        with pytest.raises(mplaunch.WorkerError) as info:
            w.run(count_calls, timeout=60)
        assert "(ranks 2-3)" in str(info.value.healed), info.value.healed
        with caplog.at_level("WARNING", logger="mplaunch"):
            assert w.restart(nnodes=1) is w
        said = caplog.text
        assert "going on with 1 node(s) of 2 ranks (2 ranks) without node 0" in said and \
            "renumbered (2->0, 3->1)" in said and "these hold the old group and must " \
            "be made again: rank_state()['sub']" in said, said
        assert (w.nnodes, w.size, w.fresh_ranks) == (1, 2, [])
        assert w.pids == {0: pids[2], 1: pids[3]}                 # the same processes
        assert w.run(count_calls) == [4, 4]     # and their state (the failed call's 3rd)
        assert [n["name"] for n in w.nodes] == ["node1"] and w.nodes[0]["node"] == 0
        for rank, (env, dist, pid) in enumerate(w.run(rank_numbers)):
            assert env == {"RANK": str(rank), "LOCAL_RANK": str(rank), "NODE_RANK": "0",
                           "GROUP_RANK": "0", "WORLD_SIZE": "2",
                           "LOCAL_WORLD_SIZE": "2"}, env
            assert dist == (rank, 2) and pid == pids[2 + rank]
        assert w.run(allreduce_sum) == [3.0, 3.0]
        # a rank that dies now is healed as in any World, on its node
        with pytest.raises(mplaunch.WorkerError):
            w.run(die_in_rank_one)
        assert w.fresh_ranks == [1] and w.run(count_calls) == [5, 1]
        assert w.run(allreduce_sum) == [3.0, 3.0]


def keep_a_subgroup():
    import torch.distributed as dist
    mplaunch.rank_state()["sub"] = dist.new_group()


def die_in_rank_one():
    if int(os.environ["RANK"]) == 1:
        os._exit(3)
    return 0


def test_restart_with_the_nodes_left_between_calls_keeps_the_survivors():
    with no_spare_world() as w:
        assert w.run(count_calls) == [1] * 4
        pids = w.pids
        lost_for_good(w, 1)
        w.restart(nnodes=1)
        assert w.pids == {0: pids[0], 1: pids[1]} and w.run(count_calls) == [2, 2]
        assert w.run(allreduce_sum) == [3.0, 3.0]
        # any other count: a new step of fresh ranks
        w.restart(nnodes=2)
        assert w.nnodes == 2 and w.run(count_calls) == [1] * 4
        assert not set(w.pids.values()) & set(pids.values())


class _FirstShort(local_step.Local):
    """A scheduler with no node for its first replacement, and one for each later."""
    shorts = 1

    def _replace(self, index, launch, nodes):
        if _FirstShort.shorts:
            _FirstShort.shorts -= 1
            return local_step.NoSpare._replace(self, index, launch, nodes)
        return super()._replace(index, launch, nodes)


def test_restart_with_fewer_nodes_while_a_replacement_comes_starts_fresh():
    """Going on is for a node nothing replaces: with a replacement on its way (a spare),
    restart(nnodes=1) waits for it and then does what it always did, a new step."""
    with world(grace_period=2) as w:
        assert w.run(count_calls) == [1] * 4
        pids = set(w.pids.values())
        lost_for_good(w, 1)
        w.restart(nnodes=1)
        assert w.nnodes == 1 and w.run(count_calls) == [1, 1]
        assert not set(w.pids.values()) & pids


def test_after_going_on_a_lost_node_is_replaced_in_the_schedulers_own_slot():
    """Three nodes; node 0 lost with no replacement, the World goes on with the other
    two (renumbered 0 and 1: the scheduler's slots 1 and 2); then node 1 (slot 2) is
    lost and replaced: the scheduler is asked for slot 2, and its agent takes the
    World's node 1."""
    from mplaunch._engine.nodes import schedulers
    local_step.register("local-first-short", _FirstShort)
    try:
        with LocalNodes().world(nprocs=1, nnodes=3, scheduler="local-first-short",
                                grace_period=2) as w:
            assert w.run(count_calls) == [1, 1, 1]
            pids = w.pids
            lost_for_good(w, 0)
            w.restart(nnodes=2)
            assert w.pids == {0: pids[1], 1: pids[2]}
            assert [n["name"] for n in w.nodes] == ["node1", "node2"]
            os.kill(w.nodes[1]["agent_pid"], signal.SIGKILL)
            with pytest.raises(mplaunch.WorkerError, match=r"node 1 \(node2\)"):
                w.run(count_calls, timeout=60)
            assert w.fresh_ranks == [1] and w.pids[0] == pids[1]
            assert [n["name"] for n in w.nodes] == ["node1", "node2"]
            assert [n["node"] for n in w.nodes] == [0, 1]
            assert w.run(count_calls) == [3, 1] and w.run(allreduce_sum) == [3.0, 3.0]
            got = w.run(rank_numbers)
            assert [g[0]["NODE_RANK"] for g in got] == ["0", "1"]
            assert [g[1] for g in got] == [(0, 2), (1, 2)]
    finally:
        schedulers.unregister("local-first-short")


def test_spare_nodes_is_checked_before_anything_starts(monkeypatch):
    for bad in (-1, 1.5, True, "1"):
        with pytest.raises(ValueError, match="spare_nodes must be an int >= 0"):
            world(spare_nodes=bad)
    with pytest.raises(ValueError, match="only a healing World"):
        world(spare_nodes=1, heal=False)
    with pytest.raises(ValueError, match="spare_nodes= is for a World across nodes"):
        mplaunch.World(2, spare_nodes=1)
    # a scheduler that counts its nodes is asked for the spares too (SLURM's check)
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_JOB_NUM_NODES", "2")
    with pytest.raises(ValueError, match=r"World\(nnodes=2, spare_nodes=1\) needs 3 nodes: "
                                         r".*has 2 node\(s\)"):
        mplaunch.World(2, nnodes=2, scheduler="slurm", spare_nodes=1)
    with world(spare_nodes=0) as w:
        assert w.nnodes == 2



def test_restart_after_a_node_was_lost_between_calls_starts_on_its_replacement():
    with world(grace_period=2) as w:
        assert w.run(count_calls) == [1] * 4
        lost = w.nodes[1]["agent_pid"]
        lost_for_good(w, 1)               # between calls: the World knows of it
        w.restart()                        # fresh ranks on purpose: every node's
        assert w.run(count_calls) == [1] * 4
        assert w.nodes[1]["agent_pid"] != lost and w.run(allreduce_sum) == [10.0] * 4


def test_silence_is_judged_only_while_the_pump_keeps_up_and_the_agent_takes_nothing():
    """The pump's frozen-node check (_check_silent), on made-up links: a beating link
    silent past SILENT_S is lost; not one with data waiting, not one still taking in a
    large frame of ours (its unsent bytes falling), not after the pump itself was held
    up (a large frame, this process stopped), and not one that has not beaten yet."""
    from mplaunch._engine.nodes import pump as pump_mod
    from mplaunch._wire.link import SILENT_S

    class Link:
        def __init__(self, name, heard, beating=True):
            self.name, self.heard, self.beating = name, heard, beating
            self.lost, self.reading, self.unsent, self.sock = None, False, None, name

    class Hub:
        def __init__(self, links):
            self.links, self.said = links, []

        def lose(self, link, why):
            link.lost = why
            self.said.append(link.name)

    now = 1000.0
    quiet = now - SILENT_S - 1
    links = [Link("frozen", quiet), Link("waiting", quiet), Link("taking", quiet),
             Link("new", quiet, beating=False), Link("fine", now - 0.5)]
    hub = Hub(links)
    unsent = {"taking": [4_000_000, 3_000_000]}
    pump = pump_mod.Pump.__new__(pump_mod.Pump)
    pump.hub = hub
    real = pump_mod.linux.unsent_bytes
    pump_mod.linux.unsent_bytes = lambda sock: (unsent[sock].pop(0) if sock in unsent
                                                and unsent[sock] else 0)
    try:
        links[2].unsent = 5_000_000                    # it took 1 MB since the last look
        pump._check_silent(now, {id(links[1])}, held_up=False)
        assert hub.said == ["frozen"]
        assert links[1].lost is None and links[2].lost is None and links[3].lost is None
        # held up: a fresh window for every link, even one long silent
        late = Link("late", quiet)
        hub.links = [late]
        pump._check_silent(now, set(), held_up=True)
        assert late.lost is None and late.heard >= now - 1.0
        pump._check_silent(now + SILENT_S + 2, set(), held_up=False)
        assert late.lost is not None
    finally:
        pump_mod.linux.unsent_bytes = real
