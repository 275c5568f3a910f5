"""One scenario suite for a World across nodes, run once per scheduler.

The scenarios below are written once and run by each scheduler's test module, which
imports them (``from nodes_scenarios import *``) and gives them the fixture `sched`: a
`Nodes` of its scheduler, whose ``sched.world(**options)`` is a World of 2 ranks on each
of 2 nodes, plus what only that scheduler can say (its nodes' names, the variables its
ranks see, its step, how one of its agents is lost). As ipyparallel's test_slurm.py
runs test_cluster.py's scenarios with one fixture overridden.

* tests/test_world_nodes.py: scheduler="local" (tests/local_step.py: agents on this
  machine, one per stand-in node)
* tests/test_slurm_world.py: scheduler="slurm", the pytest process given an allocation
  of the two-node SLURM cluster of tests/slurm_cluster.py (`salloc -N2`'s environment)
* tests/test_ray_world.py: scheduler="ray", on a real two-node ray.cluster_utils.Cluster

Real processes and real gloo throughout. The tests read what a World shows (World.nodes,
World.pids, World.stacks(), its errors and the "mplaunch" logger), never its insides.

The functions the ranks run live here too, at module level: the ranks import them by
reference, so this module imports nothing of the tests' schedulers at import time.
"""
from __future__ import annotations

import contextlib
import logging
import os
import pickle
import signal
import socket
import sys
import threading
import time

import psutil
import pytest

import mplaunch
from mplaunch._engine.prompts import FrontEnd

__all__ = []   # the scenarios, added by @scenario


def scenario(func):
    __all__.append(func.__name__)
    return func


# -- what a scheduler's module gives the scenarios ---------------------------------------

class Nodes:
    """A World across 2 nodes of one scheduler, and what that scheduler can say of it.
    A scheduler's test module subclasses it and returns one from its `sched` fixture."""
    scheduler: str = ""
    # seconds the World's processes may take to be gone once close() returned
    gone_within = 0.0
    # its step can start a lost node's agent again (Step.replace): a healing World
    # replaces the node and keeps the others' ranks
    replaces = False

    def options(self, **options):
        """World keyword options for this scheduler's nodes."""
        options.setdefault("backend", "gloo")
        options.setdefault("scheduler", self.scheduler)
        return options

    def world(self, nprocs=2, nnodes=2, **options) -> mplaunch.World:
        return mplaunch.World(nprocs, nnodes=nnodes, **self.options(**options))

    def launcher_env(self, monkeypatch) -> None:
        """The launching process's environment as this scheduler's users have it."""

    def check_names(self, names) -> None:
        """The nodes' names (World.nodes[i]["name"]) are this scheduler's."""
        assert len(set(names)) == len(names), names

    def check_rank_env(self, w, rank, node, local, got) -> None:
        """The variables this scheduler's ranks see (got: whoami())."""

    def check_up(self, w) -> None:
        """While a World is up: what this scheduler holds for it (one step)."""

    def check_closed(self) -> None:
        """Once a World closed: nothing of it held by this scheduler."""

    def step(self, w):
        """What identifies the World's step of agents (a new one: a new step)."""
        raise NotImplementedError

    def step_pids(self, w) -> set:
        """Processes of the World's step on this machine that are not agents (srun,
        the stand-in's step process): close() ends them too."""
        return set()

    def kill_agent(self, w, node) -> None:
        """Lose node `node`'s agent, as this scheduler would (SIGKILL by default)."""
        os.kill(w.nodes[node]["agent_pid"], signal.SIGKILL)


@contextlib.contextmanager
def variant(base: str, name: str, before_start):
    """The scheduler `base`, registered as `name`, whose start(launch) first calls
    ``before_start(launch)`` (schedulers.AgentLaunch): a client that must be at the
    agents' port before any agent is, every time, not by luck of timing."""
    from mplaunch._engine.nodes import schedulers
    base_cls = type(schedulers.choose(base))

    def start(self, launch):
        before_start(launch)
        return base_cls.start(self, launch)

    cls = type(f"{base_cls.__name__}FirstAtItsPort", (base_cls,),
               {"name": name, "start": start})
    schedulers.register(name, cls, replace=True)
    try:
        yield name
    finally:
        schedulers.unregister(name)


def agent_port(launch):
    """(host, port) of the World's agent port, from what its scheduler starts."""
    host, _, port = launch.address.rpartition(":")
    return host.strip("[]"), int(port)


def world_processes(w) -> set:
    """Every process of the World's nodes below their agents: the agents, their warm
    servers (and any idle pre-forked children) and the ranks."""
    pids = set()
    for n in w.nodes:
        pids.add(n["agent_pid"])
        with contextlib.suppress(psutil.Error):
            pids.update(p.pid for p in psutil.Process(n["agent_pid"]).children(
                recursive=True))
    assert set(w.pids.values()) <= pids, (w.pids, pids)
    return pids


def alive(pids, timeout=10.0):
    """The pids still running (zombies count as gone) after up to `timeout` s."""
    procs = []
    for pid in pids:
        with contextlib.suppress(psutil.NoSuchProcess):
            procs.append(psutil.Process(pid))
    _, left = psutil.wait_procs(procs, timeout=timeout)
    return [p.pid for p in left if _state(p.pid) not in (None, "Z")]


def _state(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0]
    except OSError:
        return None


def wait_for(paths, timeout=60):
    end = time.monotonic() + timeout
    while not all(os.path.exists(p) for p in paths):
        assert time.monotonic() < end, f"never appeared: {paths}"
        time.sleep(0.02)


def agents(w):
    return [n["agent_pid"] for n in w.nodes]


def names(w):
    return [n["name"] for n in w.nodes]


# -- in the ranks -------------------------------------------------------------------------

_CALLS = 0   # a module global in each rank: state that stays between runs


def count_calls():
    global _CALLS
    _CALLS += 1
    return _CALLS


RANK_VARS = ("RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK", "WORLD_SIZE",
             "LOCAL_WORLD_SIZE")
# the World's secret and its agents' address are the agents' alone
SECRET_VARS = ("MPLAUNCH_WORLD_SECRET", "MPLAUNCH_WORLD_ADDR",
               "MPLAUNCH_WORLD_SECRET_STDIN")


def whoami():
    import torch.distributed as dist
    with open("/proc/self/environ", "rb") as f:
        initial = b"\0" + f.read()
    return {"env": dict(os.environ), "pid": os.getpid(), "ppid": os.getppid(),
            "rank": dist.get_rank(), "size": dist.get_world_size(),
            "secret": [k for k in SECRET_VARS
                       if k in os.environ or b"\0" + k.encode() + b"=" in initial]}


def allreduce_sum():
    import torch
    import torch.distributed as dist
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return t.item()


def say(word):
    rank = os.environ["RANK"]
    print(f"out {word} {rank}", flush=True)
    print(f"err {word} {rank}", file=sys.stderr, flush=True)
    return rank


def wait_for_go(flag_dir):
    open(os.path.join(flag_dir, f"in.{os.environ['RANK']}"), "w").close()
    while not os.path.exists(os.path.join(flag_dir, "go")):
        time.sleep(0.05)
    return "went"


def stop_in_rank_three_then_allreduce():
    import torch
    import torch.distributed as dist
    secret = 21 * (dist.get_rank() + 1)
    if os.environ["RANK"] == "3":
        breakpoint()
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)   # the others wait here while rank 3 is in pdb
    return t.item(), secret


class Scripted(FrontEnd):
    """A debugging front-end (_engine.prompts) that answers prompts from a list, as a
    user at the terminal would, `pause` seconds after each one."""

    def __init__(self, lines, pause=0.0):
        self.lines, self.pause, self.prompts = list(lines), pause, []

    def ask(self, prompt, sel, answer):
        self.prompts.append(prompt)
        time.sleep(self.pause)
        answer(self.lines.pop(0) if self.lines else "c")


@contextlib.contextmanager
def answering(front):
    from mplaunch._engine import prompts
    prompts.override = lambda: front
    try:
        yield front
    finally:
        prompts.override = None


def fail_in_rank_three():
    count_calls()
    if os.environ["RANK"] == "3":
        raise ValueError("rank three fails")
    return "fine"


def fail_in_rank_one():
    if os.environ["RANK"] == "1":
        raise ValueError("rank 1 says no")


def die_in_rank_three():
    count_calls()
    if os.environ["RANK"] == "3":
        os._exit(3)
    return "fine"


def killed_in_rank_three_while_peers_wait():
    import torch
    import torch.distributed as dist
    if dist.get_rank() == 3:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.all_reduce(torch.ones(1))
    return "unreachable"


def half_done_collective():
    """Ranks 0-2 enter an all_reduce that rank 3 never joins: it raises instead."""
    if os.environ["RANK"] == "3":
        time.sleep(0.5)
        raise ValueError("rank 3 left the all_reduce")
    return allreduce_sum()


def sleep_in_rank_three(flag_dir):
    open(os.path.join(flag_dir, f"in.{os.environ['RANK']}"), "w").close()
    if os.environ["RANK"] == "3":
        time.sleep(600)
    return "done"


def master_addr_port():
    return os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])


# -- checks the scenarios share ----------------------------------------------------------

def check_ranks(sched, w, results, nprocs=2):
    """whoami() of every rank: in global order, node by node, each with its own
    variables and none of the World's secrets."""
    size = nprocs * len(w.nodes)
    assert [r["rank"] for r in results] == list(range(size)), results
    for rank, got in enumerate(results):
        node, local = divmod(rank, nprocs)
        env = got["env"]
        assert {k: env.get(k) for k in RANK_VARS} == {
            "RANK": str(rank), "LOCAL_RANK": str(local), "NODE_RANK": str(node),
            "GROUP_RANK": str(node), "WORLD_SIZE": str(size),
            "LOCAL_WORLD_SIZE": str(nprocs)}, (rank, env)
        assert got["secret"] == [], (rank, got["secret"])
        assert got["size"] == size and w.pids[rank] == got["pid"], (rank, got, w.pids)
        sched.check_rank_env(w, rank, node, local, got)
    # one store for them all
    assert len({(g["env"]["MASTER_ADDR"], g["env"]["MASTER_PORT"]) for g in results}) == 1


# == the scenarios ========================================================================

# -- order, environment, collectives, state; close ---------------------------------------

@scenario
def test_ranks_in_global_order_with_their_nodes_env_in_one_group_and_close_ends_all(
        sched, monkeypatch):
    sched.launcher_env(monkeypatch)
    w = sched.world()
    procs = set()
    try:
        results = w.run(whoami)
        assert [n["node"] for n in w.nodes] == [0, 1], w.nodes
        sched.check_names(names(w))
        check_ranks(sched, w, results)
        sched.check_up(w)
        # each node's ranks are children of that node's warm server, itself below its
        # agent: ranks 0, 1 under node 0's, ranks 2, 3 under node 1's
        servers = [r["ppid"] for r in results]
        assert servers[0] == servers[1] != servers[2] == servers[3], servers
        for rank, server in enumerate(servers):
            agent = w.nodes[rank // 2]["agent_pid"]
            assert agent in [p.pid for p in psutil.Process(server).parents()]
        assert w.run(allreduce_sum) == [10.0] * 4
        assert w.run(count_calls) == [1] * 4
        assert w.run(count_calls) == [2] * 4       # the same processes, their globals
        assert w.run(allreduce_sum) == [10.0] * 4
        assert {r: g["pid"] for r, g in enumerate(w.run(whoami))} == w.pids
        sched.check_up(w)                          # still the one step
        # what close() must end: the step, its agents, their warm servers (and any
        # idle pre-forked children) and the ranks
        procs = world_processes(w) | sched.step_pids(w)
        assert set(servers) <= procs and len(procs) >= 2 + 2 + 4, procs
    finally:
        w.close()
    assert alive(procs, timeout=sched.gone_within) == [], [
        (p, _state(p)) for p in procs if _state(p) not in (None, "Z")]
    assert w.pids == {} and w.nodes == []
    sched.check_closed()
    w.close()   # idempotent


# -- output and stacks --------------------------------------------------------------------

@scenario
def test_output_is_relayed_with_each_ranks_node_and_stacks_reach_every_rank(
        sched, capfd, tmp_path):
    with sched.world() as w:
        capfd.readouterr()
        assert w.run(say, ("hi",)) == ["0", "1", "2", "3"]
        out, err = capfd.readouterr()
        for rank in range(4):
            node = names(w)[rank // 2]
            assert f"[{node} rank{rank}]: out hi {rank}\n" in out, out
            assert f"[{node} rank{rank}]: err hi {rank}\n" in err, err
        assert sorted(w.stacks()) == [0, 1, 2, 3]

        # ... and from another thread while every rank, on both nodes, is in a call
        seen = []

        def ask():
            try:
                wait_for([tmp_path / f"in.{r}" for r in range(4)])
                # each rank sleeps in its loop nearly all the time: asked a few times,
                # the four are found on one line
                for _ in range(20):
                    seen.append(w.stacks())
                    if "ranks 0-3:" in str(seen[-1]):
                        break
            finally:
                (tmp_path / "go").touch()

        t = threading.Thread(target=ask)
        t.start()
        try:
            assert w.run(wait_for_go, (str(tmp_path),), timeout=60) == ["went"] * 4
        finally:
            t.join()
        assert seen and all(sorted(s) == [0, 1, 2, 3] for s in seen), seen
        assert all("wait_for_go" in s[r] for s in seen for r in range(4)), seen
        # all four in the same place, shown once
        assert "ranks 0-3:" in str(seen[-1]), str(seen[-1])


# -- heals --------------------------------------------------------------------------------

@scenario
def test_an_exception_in_a_remote_rank_keeps_the_world(sched):
    with sched.world() as w:
        assert w.run(count_calls) == [1] * 4
        pids, agent_pids, step = w.pids, agents(w), sched.step(w)
        with pytest.raises(mplaunch.WorkerError) as info:
            w.run(fail_in_rank_three)
        err = info.value
        assert err.rank == 3 and type(err.__cause__) is ValueError, str(err)
        assert str(err.__cause__) == "rank three fails"
        assert "node 1" in str(err) and names(w)[1] in str(err), str(err)
        assert "world was kept" in str(err) and err.healed.startswith(
            "the world was kept"), (str(err), err.healed)
        assert w.pids == pids and agents(w) == agent_pids and sched.step(w) == step
        assert w.fresh_ranks == []
        assert w.run(count_calls) == [3] * 4     # their state (2 from the failed run)
        assert w.run(allreduce_sum) == [10.0] * 4


@scenario
def test_pdb_in_a_remote_rank_is_answered_here_with_the_timeout_paused(sched, capfd):
    with sched.world() as w:
        # the ranks import this module first, outside the 2 s the test's call has
        assert w.run(allreduce_sum) == [10.0] * 4
        # rank 3 (node 1) stops in pdb; each answer comes 1.5 s after its prompt, past
        # the call's 2 s timeout in all, which must not count that time
        with answering(Scripted(["p secret * 2", "c"], pause=1.5)) as front:
            results = w.run(stop_in_rank_three_then_allreduce, timeout=2)
        assert results == [(10.0, 21), (10.0, 42), (10.0, 63), (10.0, 84)]
        assert len(front.prompts) == 2 and all(
            p.endswith("rank3]: (Pdb) ") for p in front.prompts), front.prompts
        out = capfd.readouterr().out
        assert "rank3]: 168" in out, out
        # post-mortem of a remote rank's error, after the World healed
        with pytest.raises(mplaunch.WorkerError):
            w.run(fail_in_rank_three)
        with answering(Scripted(["p 6 * 7", "c"])) as front:
            w.debug()
        assert front.prompts[0].endswith("rank3]: (Pdb) "), front.prompts
        out = capfd.readouterr().out
        assert "rank3]: mplaunch: rank 3 post-mortem: ValueError: rank three fails" in out
        assert "rank3]: 42" in out, out
        assert w.run(allreduce_sum) == [10.0] * 4


@scenario
def test_a_dead_remote_rank_is_replaced_on_its_node(sched):
    with sched.world(grace_period=2) as w:
        assert w.run(count_calls) == [1] * 4
        pids, agent_pids, step = w.pids, agents(w), sched.step(w)
        with pytest.raises(mplaunch.WorkerError) as info:
            w.run(die_in_rank_three, timeout=120)
        err = info.value
        assert err.rank == 3 and err.exitcode == 3, str(err)
        assert "node 1" in str(err) and names(w)[1] in str(err), str(err)
        assert "replaced" in err.healed and "rebuilt" in err.healed, err.healed
        # a pid means nothing without its node
        assert f"(rank 3 on node 1 ({names(w)[1]}), pid {w.pids[3]})" in err.healed, \
            err.healed
        assert w.fresh_ranks == [3]
        assert w.pids[3] != pids[3]
        assert {r: w.pids[r] for r in range(3)} == {r: pids[r] for r in range(3)}
        # replaced by its node's agent, in the same step
        assert agents(w) == agent_pids and sched.step(w) == step
        assert agent_pids[1] in [p.pid for p in psutil.Process(w.pids[3]).parents()]
        assert w.run(count_calls) == [3, 3, 3, 1]   # rank 3 starts from nothing
        assert w.fresh_ranks == []
        # the fresh rank has its own variables, as the first one had
        check_ranks(sched, w, w.run(whoami))
        assert w.run(allreduce_sum) == [10.0] * 4
        assert alive([pids[3]], timeout=0) == []


@scenario
def test_a_remote_rank_killed_while_its_peers_wait_in_an_all_reduce_is_replaced_alone(
        sched):
    with sched.world(grace_period=2) as w:
        assert w.run(count_calls) == [1] * 4
        pids = w.pids
        with pytest.raises(mplaunch.WorkerError) as info:
            w.run(killed_in_rank_three_while_peers_wait, timeout=120)
        err = info.value
        assert err.rank == 3 and err.signal == "SIGKILL", str(err)
        assert "was killed by SIGKILL" in str(err) and "[on node 1]" in str(err), str(err)
        assert "replaced" in err.healed, err.healed
        fresh, after = w.fresh_ranks, w.pids
        # healed in any case: the world is kept and works
        assert 3 in fresh and after[3] != pids[3]
        assert w.run(allreduce_sum) == [10.0] * 4
        # what the same failure keeps on one node: every rank but the dead one
        assert fresh == [3], err.healed
        assert {r: after[r] for r in range(3)} == {r: pids[r] for r in range(3)}


@scenario
def test_a_half_done_collective_is_released_and_the_group_rebuilt(sched):
    with sched.world() as w:
        assert w.run(allreduce_sum) == [10.0] * 4
        pids = w.pids
        with pytest.raises(mplaunch.WorkerError) as info:
            w.run(half_done_collective, timeout=120)
        assert info.value.rank == 3, str(info.value)
        assert w.pids == pids                      # released, not replaced
        assert w.run(allreduce_sum) == [10.0] * 4


@scenario
def test_a_timeout_on_a_remote_node_keeps_the_world(sched, tmp_path):
    with sched.world(grace_period=3) as w:
        assert w.run(count_calls) == [1] * 4
        pids, step = w.pids, sched.step(w)
        begin = time.monotonic()
        with pytest.raises(mplaunch.LaunchTimeout) as info:
            w.run(sleep_in_rank_three, (str(tmp_path),), timeout=2)
        assert time.monotonic() - begin < 30
        err = info.value
        assert "sleep_in_rank_three" in err.stacks[3], err.stacks
        assert "world was kept" in str(err), str(err)
        assert w.pids == pids and sched.step(w) == step
        assert w.run(count_calls) == [2] * 4
        assert w.run(allreduce_sum) == [10.0] * 4


@scenario
def test_sigint_to_the_launching_process_interrupts_every_node_and_keeps_the_world(
        sched, tmp_path):
    with sched.world(grace_period=3) as w:
        assert w.run(count_calls) == [1] * 4
        pids, agent_pids = w.pids, agents(w)

        def interrupt():
            wait_for([tmp_path / f"in.{r}" for r in range(4)])
            os.kill(os.getpid(), signal.SIGINT)

        t = threading.Thread(target=interrupt)
        t.start()
        try:
            with pytest.raises(KeyboardInterrupt) as info:
                w.run(wait_for_go, (str(tmp_path),), timeout=90)
        finally:
            t.join()
        msg = str(info.value)
        assert "interrupted" in msg and "kept" in msg, msg
        assert w.pids == pids and agents(w) == agent_pids   # the same ranks, every node
        assert w.run(count_calls) == [2] * 4                 # with their state
        assert w.run(allreduce_sum) == [10.0] * 4


# -- a node's agent lost ------------------------------------------------------------------

@scenario
def test_a_killed_agent_names_its_node_and_the_next_run_starts_a_fresh_step(sched):
    # heal=False where the scheduler replaces nodes: that World replaces the lost node
    # instead (the test below)
    with sched.world(grace_period=2, **({"heal": False} if sched.replaces else {})) as w:
        assert w.run(count_calls) == [1] * 4
        step, lost = sched.step(w), names(w)[1]
        old = world_processes(w) | sched.step_pids(w)
        agent_pids = agents(w)
        sched.kill_agent(w, 1)
        with pytest.raises(mplaunch.WorkerError) as info:
            w.run(count_calls, timeout=60)
        msg = str(info.value)
        assert f"node 1 ({lost})" in msg and "lost" in msg, msg
        assert "node 0 " not in msg, msg
        # node 1's ranks and warm server went with their agent, and the old step with
        # the World's ranks on node 0
        assert alive(old, timeout=20) == [], "the lost node's or old step's remain"
        assert w.run(count_calls) == [1] * 4     # fresh ranks on a fresh step
        assert not set(agents(w)) & set(agent_pids)
        assert sched.step(w) != step
        sched.check_up(w)
        check_ranks(sched, w, w.run(whoami))
        assert w.run(allreduce_sum) == [10.0] * 4


@scenario
def test_a_lost_node_costs_only_that_node_its_ranks_start_again_on_a_replacement(sched):
    if not sched.replaces:
        pytest.skip(f"scheduler {sched.scheduler!r} cannot replace a node yet")
    with sched.world(grace_period=2) as w:
        assert w.run(count_calls) == [1] * 4
        before = dict(w.pids)
        lost = world_processes(w) - set(world_processes_of(w, 0))
        sched.kill_agent(w, 1)
        with pytest.raises(mplaunch.WorkerError) as info:
            w.run(count_calls, timeout=60)
        msg = str(info.value)
        assert "node 1 (" in msg and "lost" in msg, msg
        assert "replacement" in msg, msg
        assert w.fresh_ranks == [2, 3]
        # node 0's ranks kept their processes and state; node 1's start afresh
        assert w.run(count_calls) == [3, 3, 1, 1]
        assert [w.pids[r] for r in (0, 1)] == [before[0], before[1]]
        assert not {w.pids[2], w.pids[3]} & set(before.values())
        assert w.run(allreduce_sum) == [10.0] * 4
        check_ranks(sched, w, w.run(whoami))
        assert alive(lost, timeout=20) == [], "the lost node's processes remain"
        held = world_processes(w) | sched.step_pids(w)
    assert alive(held, timeout=max(sched.gone_within, 10)) == []


@scenario
def test_a_frozen_node_is_lost_between_calls_within_seconds_and_replaced(sched, caplog):
    if not sched.replaces:
        pytest.skip(f"scheduler {sched.scheduler!r} cannot replace a node yet")
    with sched.world(grace_period=2) as w:
        assert w.run(count_calls) == [1] * 4
        frozen = w.nodes[1]["agent_pid"]
        os.kill(frozen, signal.SIGSTOP)     # TCP still answers for it; its agent is mute
        try:
            # no call in progress: the World finds out by itself, from the agent's silence
            end = time.monotonic() + 30
            while not [r for r in caplog.records if "node 1 (" in r.getMessage()
                       and "frozen" in r.getMessage()]:
                assert time.monotonic() < end, "the frozen node was not found lost"
                time.sleep(0.2)
            with pytest.raises(mplaunch.WorkerError) as info:
                w.run(count_calls, timeout=60)
            assert "node 1 (" in str(info.value), str(info.value)
            assert w.run(count_calls) == [3, 3, 1, 1]
            assert w.run(allreduce_sum) == [10.0] * 4
        finally:
            # back: it finds its connection cut, and ends (a scheduler that ends a lost
            # node's agent itself, as Ray does with its actor, ended it already)
            with contextlib.suppress(ProcessLookupError):
                os.kill(frozen, signal.SIGCONT)
        assert alive({frozen}, timeout=20) == []
        held = world_processes(w) | sched.step_pids(w)
    assert alive(held, timeout=max(sched.gone_within, 10)) == []


def world_processes_of(w, node) -> set:
    """Node `node`'s agent and every process below it."""
    agent = w.nodes[node]["agent_pid"]
    with contextlib.suppress(psutil.Error):
        return {agent} | {p.pid for p in psutil.Process(agent).children(recursive=True)}
    return {agent}


# -- fresh ranks: restart(), heal=False, a node's server lost -----------------------------

@scenario
def test_restart_re_forms_the_world_on_fewer_nodes_then_more(sched):
    # What the survivors of a --no-kill allocation do (docs/multinode.rst): a new step
    # of the nodes asked for, fresh ranks, as many per node unless nprocs says.
    with sched.world() as w:
        assert (w.nprocs, w.nnodes, w.size) == (2, 2, 4)
        assert w.run(allreduce_sum) == [10.0] * 4
        step = sched.step(w)
        old = world_processes(w) | sched.step_pids(w)
        w.restart(nnodes=1)
        assert (w.nprocs, w.nnodes, w.size, len(w.nodes)) == (2, 1, 2, 1)
        assert w.fresh_ranks == [0, 1]
        assert w.run(allreduce_sum) == [3.0, 3.0]
        assert alive(old, timeout=20) == [], "the first step's processes remain"
        assert sched.step(w) != step
        sched.check_up(w)
        w.restart(nnodes=2, nprocs=1)
        assert (w.nprocs, w.nnodes, w.size) == (1, 2, 2)
        assert w.fresh_ranks == [0, 1]
        assert [g["env"]["NODE_RANK"] for g in w.run(whoami)] == ["0", "1"]
        assert w.run(allreduce_sum) == [3.0, 3.0]
        assert len(set(names(w))) == 2
        w.restart(nnodes=2, nprocs=3)            # no longer has to split: 3 on each
        assert (w.nprocs, w.nnodes, w.size) == (3, 2, 6)
        assert w.fresh_ranks == list(range(6))
        check_ranks(sched, w, w.run(whoami), nprocs=3)
        assert repr(w).startswith("<mplaunch.World nprocs=3 nnodes=2 (6 ranks) "), repr(w)
        sched.check_up(w)


def _where():
    return os.environ["RANK"], os.getpid()


@scenario
def test_restart_starts_fresh_ranks_on_the_same_agents_in_the_same_step(sched):
    with sched.world() as w:
        first = w.run(_where)
        step, agent_pids = sched.step(w), agents(w)
        w.restart()
        assert w.fresh_ranks == [0, 1, 2, 3]
        after = w.run(_where)
        assert [r for r, _ in after] == ["0", "1", "2", "3"]
        assert not {p for _, p in after} & {p for _, p in first}
        assert agents(w) == agent_pids
        assert sched.step(w) == step, "restart started another step"
        assert alive([p for _, p in first], timeout=10) == []


@scenario
def test_heal_false_the_run_after_a_failure_starts_fresh_ranks(sched):
    with sched.world(heal=False) as w:
        first = w.run(_where)
        step = sched.step(w)
        with pytest.raises(mplaunch.WorkerError) as info:
            w.run(fail_in_rank_one)
        assert info.value.rank == 1, str(info.value)
        assert str(info.value).startswith("rank 1 "), str(info.value)
        after = w.run(_where)
        assert [r for r, _ in after] == ["0", "1", "2", "3"]
        assert not {p for _, p in after} & {p for _, p in first}
        assert sched.step(w) == step, "the fresh ranks came in another step"
        assert w.run(allreduce_sum) == [10.0] * 4


@scenario
def test_after_a_nodes_server_was_killed_the_next_run_starts_fresh_ranks(sched):
    with sched.world() as w:
        first, node1 = w.run(_where), names(w)[1]
        server = psutil.Process(w.pids[2]).ppid()      # node 1's: ranks 2, 3 below it
        assert server == psutil.Process(w.pids[3]).ppid() != psutil.Process(
            w.pids[0]).ppid()
        os.kill(server, signal.SIGKILL)
        assert alive([w.pids[2], w.pids[3]], timeout=20) == []   # its ranks go with it
        # the run that finds node 1's ranks gone says why
        with pytest.raises(mplaunch.WorkerError) as info:
            w.run(_where, timeout=60)
        msg = str(info.value)
        assert f"node 1 ({node1}), was lost: mplaunch's server on this node" in msg, msg
        # the next one starts fresh ranks on both nodes
        after = w.run(_where)
        assert [r for r, _ in after] == ["0", "1", "2", "3"]
        assert not {p for _, p in after} & {p for _, p in first}
        assert [n["node"] for n in w.nodes] == [0, 1]
        assert w.run(allreduce_sum) == [10.0] * 4


# -- foreign clients ----------------------------------------------------------------------

class Boom:
    """A pickle that, if anyone unpickled it, would create `path`."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def junk(marker):
    return (pickle.dumps(Boom(marker)).ljust(256, b"\0"), os.urandom(4096), b"")


def _dropped(caplog):
    return [r.getMessage() for r in caplog.records
            if r.name == "mplaunch" and "dropped a connection" in r.getMessage()]


@scenario
def test_foreign_clients_at_the_agents_port_are_dropped_and_the_world_starts(
        sched, tmp_path, caplog):
    """Before any agent is started, two strangers are at the World's agent port: one
    sends a pickle that would create `marker` if unpickled, the other runs the protocol
    with a wrong secret. Both are dropped (the "mplaunch" logger says so), nothing is
    unpickled, and the World starts as ever."""
    from mplaunch._wire import auth
    caplog.set_level(logging.WARNING, logger="mplaunch")
    marker = tmp_path / "unpickled"
    port, impostor, threads = [], [], []

    def wrong_secret(addr, connected):
        try:
            with socket.create_connection(addr, timeout=30) as s:
                connected.set()
                auth.prove(s, "not the World's secret", server=False, timeout=60)
            impostor.append("accepted")
        except (auth.AuthError, OSError) as exc:
            impostor.append(exc)
        finally:
            connected.set()

    def strangers_first(launch):
        addr = agent_port(launch)
        port.append(addr)
        with socket.create_connection(addr, timeout=5) as s:
            s.sendall(junk(marker)[0])
        # the World answers once its scheduler's start returns: in a thread, connected
        # (queued at the port, ahead of every agent) before the agents are started
        connected = threading.Event()
        threads.append(threading.Thread(target=wrong_secret, args=(addr, connected)))
        threads[-1].start()
        assert connected.wait(30)

    with variant(sched.scheduler, sched.scheduler + "-strangers-first",
                 strangers_first) as name:
        try:
            with sched.world(scheduler=name) as w:
                assert w.run(allreduce_sum) == [10.0] * 4
                for t in threads:
                    t.join(60)
                assert len(impostor) == 1 and isinstance(impostor[0], auth.AuthError), \
                    impostor
                # every agent is in: the agent port is closed to anyone else
                with pytest.raises(ConnectionRefusedError):
                    socket.create_connection(port[0], timeout=5).close()
                assert w.run(count_calls) == [1] * 4
                assert [n["node"] for n in w.nodes] == [0, 1]
        finally:
            for t in threads:
                t.join(60)
    dropped = _dropped(caplog)
    assert len(dropped) == 2, caplog.text
    assert any("does not speak mplaunch's World protocol" in m for m in dropped), dropped
    assert any("secret" in m for m in dropped), dropped
    assert not marker.exists()


@scenario
def test_a_silent_client_at_the_agents_port_does_not_hold_the_agents_up(sched, caplog):
    """A stranger connects to the agent port before any agent is started and says
    nothing. Were the connections proven one after another, the agents would wait
    behind it until its proof timed out (10 s; the log would say "did not prove itself
    within"). They join past it, and it is cut once they are in."""
    caplog.set_level(logging.WARNING, logger="mplaunch")
    held = []

    def silent_first(launch):
        held.append(socket.create_connection(agent_port(launch), timeout=5))

    with variant(sched.scheduler, sched.scheduler + "-silent-first",
                 silent_first) as name:
        try:
            with sched.world(scheduler=name) as w:
                w.start()
                assert w.run(count_calls) == [1] * 4
                # it was there, and dropped: cut when every agent had joined
                end = time.monotonic() + 15
                while not _dropped(caplog) and time.monotonic() < end:
                    time.sleep(0.05)
                dropped = _dropped(caplog)
                assert len(dropped) == 1, caplog.text
                assert "within" not in dropped[0], dropped
                # what it reads: the World's challenge, then the end of the connection
                held[0].settimeout(10)
                while held[0].recv(4096):
                    pass
        finally:
            for sock in held:
                sock.close()


@scenario
def test_junk_at_every_port_the_world_opens_runs_nothing_and_breaks_nothing(
        sched, tmp_path):
    """The store's port (this process's), each agent's and each rank's (gloo's: every
    rank has one): a pickle that would create `marker` if unpickled, random bytes,
    nothing. The store's strangers stay connected through a run; nothing is unpickled,
    the ranks stay, and a heal (which rebuilds the group through the store) works."""
    marker = tmp_path / "unpickled"
    with sched.world() as w:
        assert w.run(allreduce_sum) == [10.0] * 4
        pids = dict(w.pids)
        store = w.run(master_addr_port)
        assert len(set(store)) == 1, store
        ports = set()
        for pid in list(pids.values()) + agents(w):
            mine = {("127.0.0.1" if c.laddr.ip in ("0.0.0.0", "::") else c.laddr.ip,
                     c.laddr.port)
                    for c in psutil.Process(pid).net_connections("tcp")
                    if c.status == "LISTEN"}
            assert mine or pid not in pids.values(), f"rank pid {pid} has no gloo port"
            ports |= mine
        held = []
        try:
            for data in junk(marker):       # at the store: held open through a run
                s = socket.create_connection(store[0], timeout=5)
                held.append(s)
                with contextlib.suppress(OSError):
                    s.sendall(data)
            for addr in sorted(ports):
                for data in junk(marker):
                    with socket.create_connection(addr, timeout=5) as s:
                        s.sendall(data)
                        time.sleep(0.05)
            time.sleep(0.5)
            assert w.run(allreduce_sum) == [10.0] * 4
        finally:
            for s in held:
                s.close()
        assert w.run(allreduce_sum) == [10.0] * 4
        assert w.pids == pids
        with pytest.raises(mplaunch.WorkerError):      # a heal still releases and rebuilds
            w.run(fail_in_rank_three)
        assert w.run(allreduce_sum) == [10.0] * 4
        assert w.run(count_calls) == [2] * 4
    assert not marker.exists()


# -- the %ranks magic ---------------------------------------------------------------------

@scenario
def test_the_magic_across_nodes_counts_nprocs_per_node_and_notes_name_the_node(
        sched, capsys):
    # %ranks start N --nodes M runs N ranks on each node, as launch's nprocs; a failing
    # cell's note, and what a heal says of a replaced rank, name the rank's node.
    from mplaunch._magic import _Ranks
    ranks = _Ranks(shell=None)
    ranks.settings.update(nprocs=2, nnodes=2, grace_period=2, **sched.options())
    try:
        ranks.magic("", "import os\nprint('size', os.environ['WORLD_SIZE'])")
        out = capsys.readouterr().out
        shown = ", ".join(names(ranks.world))
        assert (f"%ranks: started 4 ranks on 2 nodes ({shown}), 2 on each, backend "
                "gloo: pids {0: ") in out, out
        assert out.count("size 4") == 4, out
        pids, node1 = ranks.world.pids, names(ranks.world)[1]
        with pytest.raises(ValueError) as info:
            ranks.magic("", "import os\nif os.environ['RANK'] == '3':\n"
                            "    raise ValueError('three')")
        assert info.value.__notes__[-1].startswith(
            f"%%ranks: rank 3 on node 1 ({node1}, pid {pids[3]}) raised this; the world "
            "was kept"), info.value.__notes__
        with pytest.raises(mplaunch.WorkerError) as info:
            ranks.magic("", "import os\nif os.environ['RANK'] == '2':\n    os._exit(3)")
        new = ranks.world.pids[2]
        assert new != pids[2]
        assert f"(rank 2 on node 1 ({node1}), pid {new})" in info.value.__notes__[-1], \
            info.value.__notes__
        capsys.readouterr()
        ranks.magic("")
        status = capsys.readouterr().out
        assert status.startswith("4 ranks on 2 nodes, 2 on each, backend gloo: up"), status
    finally:
        ranks.stop(quiet=True)
