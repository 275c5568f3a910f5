"""mplaunch.World(nprocs, nnodes=2), nprocs ranks on each node, without SLURM: the
agents are started by a stand-in step (tests/local_step.py), one per "node", on this
machine or each in a network namespace of its own (tests/netns.py). Real processes
and real gloo: the ranks' order and environment across the nodes, output relayed with
each node's name, stacks, the heal cases, a close that leaves nothing on any node, and
the per-World secret that keeps foreign clients out (mplaunch/_wire/auth.py)."""
from __future__ import annotations

import contextlib
import json
import logging
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

import local_step
import mplaunch
import netns
from mplaunch._wire import auth

netns_hosts = netns.netns_hosts   # bind the fixture so pytest finds it

HERE = os.path.dirname(os.path.abspath(__file__))
NODE_SCRIPTS = os.path.join(HERE, "scripts_nodes")

pytestmark = pytest.mark.timeout(150)


def named_nodes(i):
    """Each node's agent gets a name of its own (the one a SLURM node's agent reads), so
    the output's prefix and World.nodes tell the two stand-in nodes apart."""
    return ["env", f"SLURMD_NODENAME=node{i}"]


def world(**options):
    options.setdefault("backend", "gloo")
    options.setdefault("master_addr", "127.0.0.1")
    options.setdefault("_starter", local_step.starter(wrap=named_nodes))
    return mplaunch.World(2, nnodes=2, **options)   # 2 ranks on each node: 4


def _wait_for(paths, timeout=60):
    end = time.monotonic() + timeout
    while not all(os.path.exists(p) for p in paths):
        assert time.monotonic() < end, f"never appeared: {paths}"
        time.sleep(0.02)


def _tree(w):
    """Every process of the World's nodes: the step, its agents, their warm servers
    (with any idle pre-forked children) and the ranks."""
    agents = [n["agent_pid"] for n in w.nodes]
    step = {psutil.Process(a).ppid() for a in agents}
    assert len(step) == 1, "both agents are children of one step process"
    (step_pid,) = step
    procs = [psutil.Process(step_pid)] + psutil.Process(step_pid).children(recursive=True)
    pids = {p.pid for p in procs}
    assert set(agents) <= pids and set(w.pids.values()) <= pids
    return step_pid, pids


def _alive(pids, timeout=10.0):
    """The pids still running (zombies count as gone) after up to `timeout` s."""
    procs = []
    for pid in pids:
        with contextlib.suppress(psutil.NoSuchProcess):
            procs.append(psutil.Process(pid))
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    return [p.pid for p in alive if _state(p.pid) not in (None, "Z")]


def _state(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0]
    except OSError:
        return None


# -- in the ranks (module level: the ranks import them by reference) ----------------------

_CALLS = 0   # a module global in each rank: state that stays between runs


def count_calls():
    global _CALLS
    _CALLS += 1
    return _CALLS


ENV_NAMES = ("RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK", "WORLD_SIZE",
             "LOCAL_WORLD_SIZE", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID",
             "SLURM_NTASKS", "SLURM_TASK_PID", "MPLAUNCH_WORLD_SECRET",
             "MPLAUNCH_WORLD_ADDR")


def whoami():
    import torch.distributed as dist
    return ({k: os.environ.get(k) for k in ENV_NAMES}, os.getpid(), os.getppid(),
            dist.get_rank(), dist.get_world_size())


def allreduce_sum():
    import torch
    import torch.distributed as dist
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return t.item()


def say(word):
    rank = os.environ["RANK"]
    print(f"out {word} {rank}")
    print(f"err {word} {rank}", file=sys.stderr)
    return rank


def wait_for_go(flag_dir):
    open(os.path.join(flag_dir, f"in.{os.environ['RANK']}"), "w").close()
    while not os.path.exists(os.path.join(flag_dir, "go")):
        time.sleep(0.02)
    return "went"


def fail_in_rank_three():
    count_calls()
    if os.environ["RANK"] == "3":
        raise ValueError("rank three fails")
    return "fine"


def die_in_rank_three_while_peers_wait():
    import torch
    import torch.distributed as dist
    if dist.get_rank() == 3:
        os._exit(3)
    dist.all_reduce(torch.ones(1))
    return "unreachable"


def die_in_rank_three():
    count_calls()
    if os.environ["RANK"] == "3":
        os._exit(3)
    return "fine"


def sleep_in_rank_three(flag_dir):
    open(os.path.join(flag_dir, f"in.{os.environ['RANK']}"), "w").close()
    if os.environ["RANK"] == "3":
        time.sleep(600)
    return "done"


def master_port():
    return os.environ["MASTER_PORT"]


def gloo_sockets():
    """This rank's all_reduce, then its TCP sockets as this namespace sees them."""
    value = allreduce_sum()
    ip = lambda a: a.ip[7:] if a.ip.startswith("::ffff:") else a.ip  # noqa: E731
    conns = psutil.Process().net_connections("tcp")
    return {"sum": value, "pid": os.getpid(), "rank": int(os.environ["RANK"]),
            "listen": sorted(ip(c.laddr) for c in conns if c.status == "LISTEN"),
            "peers": sorted([ip(c.laddr), ip(c.raddr)] for c in conns if c.raddr)}


# -- 1., 5. order, environment, collectives, state; close ---

def test_ranks_in_global_order_with_their_node_env_and_one_group_and_close_ends_all(
        monkeypatch):
    # Inside a SLURM step the launching process's task variables describe it: each
    # rank must see its own, on every node, not the launching process's task 0.
    monkeypatch.setenv("SLURM_PROCID", "0")
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_TASK_PID", str(os.getpid()))
    w = world()
    try:
        results = w.run(whoami)
        assert len(w.nodes) == 2
        assert [n["node"] for n in w.nodes] == [0, 1]
        assert [n["name"] for n in w.nodes] == ["node0", "node1"]
        for rank, (env, pid, _ppid, grank, gsize) in enumerate(results):
            node, local = divmod(rank, 2)
            assert env == {
                "RANK": str(rank), "LOCAL_RANK": str(local), "NODE_RANK": str(node),
                "GROUP_RANK": str(node), "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2",
                "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(local),
                "SLURM_NODEID": str(node), "SLURM_NTASKS": "4",
                "SLURM_TASK_PID": str(pid),   # its own, not its agent's
                # the agent's secret and address stay with the agent
                "MPLAUNCH_WORLD_SECRET": None, "MPLAUNCH_WORLD_ADDR": None}, (rank, env)
            assert (grank, gsize) == (rank, 4)
            assert w.pids[rank] == pid
        # each node's ranks are children of that node's warm server, itself below its
        # agent: ranks 0, 1 under node 0's, ranks 2, 3 under node 1's
        servers = [ppid for _, _, ppid, _, _ in results]
        assert servers[0] == servers[1] != servers[2] == servers[3]
        for rank, server in enumerate(servers):
            agent = w.nodes[rank // 2]["agent_pid"]
            assert agent in [p.pid for p in psutil.Process(server).parents()]
        assert w.run(allreduce_sum) == [10.0] * 4
        assert w.run(count_calls) == [1] * 4
        assert w.run(count_calls) == [2] * 4       # the same processes, their globals
        assert w.run(allreduce_sum) == [10.0] * 4
        assert {r: p for r, (_, p, _, _, _) in enumerate(w.run(whoami))} == w.pids
        # 5. what close() must end: the step, its agents, their warm servers (and any
        # idle pre-forked children) and the ranks
        step, tree = _tree(w)
        assert set(servers) <= tree
        assert len(tree) >= 1 + 2 + 2 + 4
    finally:
        w.close()
    assert _alive(tree, timeout=0) == [], [
        (p, _state(p)) for p in tree if _state(p) not in (None, "Z")]
    assert w.pids == {} and w.nodes == []
    w.close()   # idempotent


# -- 2., 3. output and stacks ------------------------------------------------------------

def test_output_is_relayed_with_each_ranks_node_and_stacks_name_every_rank(capfd,
                                                                            tmp_path):
    with world() as w:
        assert w.run(say, ("hi",)) == ["0", "1", "2", "3"]
        out, err = capfd.readouterr()
        for rank in range(4):
            assert f"[node{rank // 2} rank{rank}]: out hi {rank}\n" in out, out
            assert f"[node{rank // 2} rank{rank}]: err hi {rank}\n" in err, err
        stacks = w.stacks()
        assert sorted(stacks) == [0, 1, 2, 3]

        # ... and from another thread while every rank, on both nodes, is in a call
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
            assert w.run(wait_for_go, (str(tmp_path),), timeout=60) == ["went"] * 4
        finally:
            t.join()
        assert sorted(seen) == [0, 1, 2, 3]
        assert all("wait_for_go" in seen[r] for r in range(4)), seen


# -- 4. heal ----------------------------------------------------------------------------

def test_an_exception_in_a_remote_rank_keeps_the_world():
    with world() as w:
        assert w.run(count_calls) == [1] * 4
        pids = w.pids
        agents = [n["agent_pid"] for n in w.nodes]
        with pytest.raises(mplaunch.WorkerError) as info:
            w.run(fail_in_rank_three)
        err = info.value
        assert err.rank == 3 and type(err.__cause__) is ValueError
        assert "node 1" in str(err) or "node1" in str(err), str(err)
        assert "world was kept" in str(err)
        assert w.pids == pids and [n["agent_pid"] for n in w.nodes] == agents
        assert w.fresh_ranks == []
        assert w.run(count_calls) == [3] * 4     # their state (2 from the failed run)
        assert w.run(allreduce_sum) == [10.0] * 4


def test_a_dead_remote_rank_is_replaced_on_its_node():
    with world(grace_period=2) as w:
        assert w.run(count_calls) == [1] * 4
        pids = w.pids
        agents = [n["agent_pid"] for n in w.nodes]
        with pytest.raises(mplaunch.WorkerError) as info:
            w.run(die_in_rank_three, timeout=120)
        err = info.value
        assert err.rank == 3 and err.exitcode == 3, str(err)
        assert "node 1" in str(err), str(err)
        assert "replaced" in err.healed and "rebuilt" in err.healed, err.healed
        # a pid means nothing without its node
        assert f"(rank 3 on node 1 (node1), pid {w.pids[3]})" in err.healed, err.healed
        assert w.fresh_ranks == [3]
        assert w.pids[3] != pids[3]
        assert {r: w.pids[r] for r in range(3)} == {r: pids[r] for r in range(3)}
        assert [n["agent_pid"] for n in w.nodes] == agents
        # the fresh rank 3 is on node 1, below node 1's agent
        assert agents[1] in [p.pid for p in psutil.Process(w.pids[3]).parents()]
        assert w.run(count_calls) == [3, 3, 3, 1]   # rank 3 starts from nothing
        assert w.fresh_ranks == []
        assert w.run(allreduce_sum) == [10.0] * 4
        assert _alive([pids[3]], timeout=0) == []


def test_a_dead_remote_rank_while_its_peers_wait_in_an_all_reduce_replaces_only_it():
    with world(grace_period=2) as w:
        assert w.run(count_calls) == [1] * 4
        pids = w.pids
        with pytest.raises(mplaunch.WorkerError) as info:
            w.run(die_in_rank_three_while_peers_wait, timeout=120)
        err = info.value
        assert err.rank == 3 and err.exitcode == 3, str(err)
        assert "replaced" in err.healed, err.healed
        fresh, after = w.fresh_ranks, w.pids
        # healed in any case: the world is kept and works
        assert 3 in fresh and after[3] != pids[3]
        assert w.run(allreduce_sum) == [10.0] * 4
        # what the same failure keeps on one node: every rank but the dead one
        assert fresh == [3], err.healed
        assert {r: after[r] for r in range(3)} == {r: pids[r] for r in range(3)}


def test_a_timeout_on_a_remote_node_keeps_the_world(tmp_path):
    with world(grace_period=3) as w:
        assert w.run(count_calls) == [1] * 4
        pids = w.pids
        with pytest.raises(mplaunch.LaunchTimeout) as info:
            w.run(sleep_in_rank_three, (str(tmp_path),), timeout=2)
        err = info.value
        assert "sleep_in_rank_three" in err.stacks[3], err.stacks
        assert "world was kept" in str(err), str(err)
        assert w.pids == pids
        assert w.run(count_calls) == [2] * 4
        assert w.run(allreduce_sum) == [10.0] * 4


def test_sigint_to_the_launching_process_interrupts_every_node_and_keeps_the_world(
        tmp_path):
    script = os.path.join(NODE_SCRIPTS, "world_nodes_sigint.py")
    log = tmp_path / "parent.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen([sys.executable, script, str(tmp_path)],
                                stdin=subprocess.DEVNULL, stdout=f,
                                stderr=subprocess.STDOUT)
    try:
        _wait_for([tmp_path / f"in.{r}" for r in range(4)] + [tmp_path / "tree.json"],
                  timeout=90)
        tree = json.loads((tmp_path / "tree.json").read_text())
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=90) == 0, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log.read_text()
    lines = [line for line in text.splitlines() if line.startswith("RESULT ")]
    assert lines, text
    res = json.loads(lines[-1][len("RESULT "):])
    assert res["error"] == "KeyboardInterrupt", text
    assert "interrupted" in res["message"] and "kept" in res["message"], res
    assert res["pids_after"] == res["pids_before"]        # the same ranks, every node
    assert res["agents_after"] == res["agents_before"]
    assert res["calls"] == [2, 2, 2, 2]                    # with their state
    assert res["sum"] == [10.0] * 4
    assert _alive(tree) == [], "the script's World left processes"


def test_a_killed_agent_names_its_node_and_the_next_run_starts_a_fresh_step():
    with world(grace_period=2) as w:
        assert w.run(count_calls) == [1] * 4
        step, tree = _tree(w)
        agents = [n["agent_pid"] for n in w.nodes]
        os.kill(agents[1], signal.SIGKILL)
        with pytest.raises(mplaunch.WorkerError) as info:
            w.run(count_calls, timeout=60)
        msg = str(info.value)
        assert "node 1" in msg and "lost" in msg, msg
        assert "node 0 " not in msg, msg
        # node 1's ranks and warm server went with their agent, and the old step with
        # the World's ranks on node 0
        assert _alive(tree) == [], "the lost node's or old step's processes remain"
        assert w.run(count_calls) == [1] * 4     # fresh ranks on a fresh step
        new_agents = [n["agent_pid"] for n in w.nodes]
        assert not set(new_agents) & set(agents)
        new_step, _ = _tree(w)
        assert new_step != step
        assert w.run(allreduce_sum) == [10.0] * 4


def test_the_magic_across_nodes_counts_nprocs_per_node_and_notes_name_the_node(capsys):
    # %ranks start N --nodes M runs N ranks on each node, as launch's nprocs; a failing
    # cell's note, and what a heal says of a replaced rank, name the rank's node.
    from mplaunch._magic import _Ranks
    ranks = _Ranks(shell=None)
    ranks.settings.update(nprocs=2, nnodes=2, backend="gloo", master_addr="127.0.0.1",
                          grace_period=2, _starter=local_step.starter(wrap=named_nodes))
    try:
        ranks.magic("", "import os\nprint('size', os.environ['WORLD_SIZE'])")
        out = capsys.readouterr().out
        assert ("%ranks: started 4 ranks on 2 nodes (node0, node1), 2 on each, backend "
                "gloo: pids {0: ") in out, out
        assert out.count("size 4") == 4, out
        pids = ranks.world.pids
        with pytest.raises(ValueError) as info:
            ranks.magic("", "import os\nif os.environ['RANK'] == '3':\n"
                            "    raise ValueError('three')")
        assert info.value.__notes__[-1].startswith(
            f"%%ranks: rank 3 on node 1 (node1, pid {pids[3]}) raised this; the world "
            "was kept"), info.value.__notes__
        with pytest.raises(mplaunch.WorkerError) as info:
            ranks.magic("", "import os\nif os.environ['RANK'] == '2':\n    os._exit(3)")
        new = ranks.world.pids[2]
        assert new != pids[2]
        assert f"(rank 2 on node 1 (node1), pid {new})" in info.value.__notes__[-1], \
            info.value.__notes__
        capsys.readouterr()
        ranks.magic("")
        status = capsys.readouterr().out
        assert status.startswith("4 ranks on 2 nodes, 2 on each, backend gloo: up"), status
    finally:
        ranks.stop(quiet=True)


def test_restart_re_forms_the_world_on_fewer_nodes_then_more():
    # What the survivors of a --no-kill allocation do (docs/multinode.rst): a new step
    # of the nodes asked for, fresh ranks, as many per node unless nprocs says.
    with world() as w:
        assert (w.nprocs, w.nnodes, w.size) == (2, 2, 4)
        assert w.run(allreduce_sum) == [10.0] * 4
        step, tree = _tree(w)
        w.restart(nnodes=1)
        assert (w.nprocs, w.nnodes, w.size, len(w.nodes)) == (2, 1, 2, 1)
        assert w.fresh_ranks == [0, 1]
        assert w.run(allreduce_sum) == [3.0, 3.0]
        assert _alive(tree) == [], "the first step's processes remain"
        assert _tree(w)[0] != step
        w.restart(nnodes=2, nprocs=1)
        assert (w.nprocs, w.nnodes, w.size) == (1, 2, 2)
        assert w.fresh_ranks == [0, 1]
        assert [e["NODE_RANK"] for e, *_ in w.run(whoami)] == ["0", "1"]
        w.restart(nnodes=2, nprocs=3)            # no longer has to split: 3 on each
        assert (w.nprocs, w.nnodes, w.size) == (3, 2, 6)
        assert w.fresh_ranks == list(range(6))
        envs = [e for e, *_ in w.run(whoami)]
        assert [(e["NODE_RANK"], e["LOCAL_RANK"]) for e in envs] == [
            ("0", "0"), ("0", "1"), ("0", "2"), ("1", "0"), ("1", "1"), ("1", "2")]
        assert {e["WORLD_SIZE"] for e in envs} == {"6"}
        assert repr(w).startswith("<mplaunch.World nprocs=3 nnodes=2 (6 ranks) "), repr(w)
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


def _foreign_first(marker, sent, impostor):
    """A starter that, before starting the agents, connects two foreign clients to the
    World's agent port: one sends a pickle that would create `marker` if unpickled, the
    other (in a thread: the World answers once the starter returns) runs the protocol
    with a wrong secret; its outcome goes to `impostor`."""
    real = local_step.starter(wrap=named_nodes)

    def wrong_secret(addr):
        try:
            with socket.create_connection(addr, timeout=30) as s:
                auth.prove(s, "not the World's secret", server=False, timeout=30)
            impostor.append("accepted")
        except auth.AuthError as exc:
            impostor.append(exc)

    def start(agent_argv, env, nnodes, output):
        host, _, port = env["MPLAUNCH_WORLD_ADDR"].rpartition(":")
        addr = (host.strip("[]"), int(port))
        sent.append(addr)
        with socket.create_connection(addr, timeout=5) as s:
            s.sendall(pickle.dumps(_Boom(marker)).ljust(256, b"\0"))
        t = threading.Thread(target=wrong_secret, args=(addr,))
        t.start()
        sent.append(t)
        time.sleep(0.2)   # both are queued before the agents connect
        return real(agent_argv, env, nnodes, output)
    return start


def test_foreign_clients_on_the_agent_port_are_dropped_and_the_world_starts(tmp_path,
                                                                            caplog):
    caplog.set_level(logging.WARNING, logger="mplaunch")
    marker = tmp_path / "unpickled"
    sent, impostor = [], []
    with world(_starter=_foreign_first(marker, sent, impostor)) as w:
        try:
            assert w.run(allreduce_sum) == [10.0] * 4
        finally:
            if len(sent) > 1:
                sent[1].join(30)
        assert w._engine.hub.dropped == 2
        assert len(impostor) == 1 and isinstance(impostor[0], auth.AuthError), impostor
        # every agent is in: the agent port is closed to anyone else
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(sent[0], timeout=5).close()
        assert w.run(count_calls) == [1] * 4
        assert [n["node"] for n in w.nodes] == [0, 1]
    dropped = [r for r in caplog.records if "dropped a connection" in r.getMessage()]
    assert len(dropped) == 2, caplog.text
    assert any("protocol" in r.getMessage() for r in dropped), caplog.text
    assert any("secret" in r.getMessage() for r in dropped), caplog.text
    assert not marker.exists()


def test_a_silent_client_on_the_agent_port_does_not_hold_the_agents_up():
    real = local_step.starter(wrap=named_nodes)
    held = []

    def start(agent_argv, env, nnodes, output):
        host, _, port = env["MPLAUNCH_WORLD_ADDR"].rpartition(":")
        held.append(socket.create_connection((host.strip("[]"), int(port)), timeout=5))
        return real(agent_argv, env, nnodes, output)

    try:
        with world(_starter=start) as w:
            begin = time.monotonic()
            w.start()
            took = time.monotonic() - begin
            assert w.run(count_calls) == [1] * 4
    finally:
        for sock in held:
            sock.close()
    # a start is some 3 s here; the silent peer's proof times out after 10
    assert took < 9.0, f"the World took {took:.1f} s to start"


def test_junk_on_the_store_port_runs_nothing_and_the_world_keeps_working(tmp_path):
    marker = tmp_path / "unpickled"
    with world() as w:
        port = int(w.run(master_port)[0])
        assert w.run(master_port) == [str(port)] * 4
        for junk in (pickle.dumps(_Boom(marker)), os.urandom(4096), b""):
            with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
                s.sendall(junk)
                time.sleep(0.1)
        assert w.run(allreduce_sum) == [10.0] * 4
        assert w.run(count_calls) == [1] * 4
        # and after a heal, whose rebuild uses the store again
        with pytest.raises(mplaunch.WorkerError):
            w.run(fail_in_rank_three)
        assert w.run(allreduce_sum) == [10.0] * 4
    assert not marker.exists()


def gloo_listeners():
    from mplaunch._rank import endpoints
    return sorted(endpoints.known().own)


def test_junk_on_every_ranks_gloo_port_runs_nothing_and_breaks_nothing(tmp_path):
    # The other ports a World opens: each rank's gloo listener (torch's), across nodes.
    marker = tmp_path / "unpickled"
    with world() as w:
        ports = [tuple(e) for listeners in w.run(gloo_listeners) for e in listeners]
        assert len(ports) >= 4, ports
        for addr, port in ports:
            for junk in (pickle.dumps(_Boom(marker)), os.urandom(4096), b""):
                with socket.create_connection((addr, port), timeout=5) as s:
                    s.sendall(junk)
                    time.sleep(0.05)
        assert w.run(allreduce_sum) == [10.0] * 4
        with pytest.raises(mplaunch.WorkerError):      # a heal still releases and rebuilds
            w.run(fail_in_rank_three)
        assert w.run(allreduce_sum) == [10.0] * 4
    assert not marker.exists()


# -- 7. nodes with addresses of their own ------------------------------------------------

def test_nodes_in_network_namespaces_use_their_own_addresses(netns_hosts):
    hosts = list(netns_hosts)
    root = netns_hosts.root_addr
    starter = local_step.starter(
        wrap=lambda i: hosts[i].argv(named_nodes(i)))
    with mplaunch.World(2, nnodes=2, backend="gloo", master_addr=root, _starter=starter,
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
        _, tree = _tree(w)
    # gone with the World's close, not killed by the fixture's teardown of the namespaces
    assert _alive(tree, timeout=0) == []
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


def test_a_step_that_ends_before_its_agents_join_is_named_with_what_it_printed():
    """The scheduler's step fails before any agent connects (srun refused, a node that
    cannot run Python): the error says so at once, with the step's command and its last
    output, and nothing is left running."""
    def broken(i):
        return ["sh", "-c", f"echo node {i} cannot start its agent >&2; exit 3", "sh"]

    begin = time.monotonic()
    with pytest.raises(Exception) as info:
        with world(_starter=local_step.starter(wrap=broken)) as w:
            w.run(count_calls)
    msg = str(info.value)
    assert "ended (exit status 3) before 2 joined" in msg, msg
    assert "local_step.py: 2 local agent(s)" in msg, msg
    assert "node 0 cannot start its agent" in msg and "node 1" in msg, msg
    assert time.monotonic() - begin < 30, "not at once: it waited for the join timeout"


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
