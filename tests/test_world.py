"""mplaunch.World, proved with real ranks: results by rank, state that stays between
runs, failures/hangs/signals that tear the world down (and the next run that starts
fresh ranks), parent death and interpreter exit that take every process with them, and
output that lands where each run was called."""
import contextlib
import io
import logging
import os
import signal
import sys
import threading
import time

import pytest

import mplaunch

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPTS = os.path.join(HERE, "scripts")
WORLD_SCRIPTS = os.path.join(HERE, "scripts_world")
for _d in (SCRIPTS, WORLD_SCRIPTS):
    if _d not in sys.path:
        sys.path.insert(0, _d)

from proctree import describe, wait_gone  # noqa: E402
from worldproc import (EXIT_MAIN_PROCESS_ERROR, GONE_DEADLINE_S, KILL_BOUND_S,  # noqa: E402
                       assert_closed_at_exit, gone, world_parent)


# -- rank functions (module level: the ranks import them by reference) -------------------

def whoami(x=None):
    return int(os.environ["RANK"]), os.getpid(), x


def count_calls():
    state = mplaunch.rank_state()
    state["calls"] = state.get("calls", 0) + 1
    return state["calls"]


def group_info():
    import torch.distributed as dist
    return dist.is_initialized(), dist.get_rank(), dist.get_world_size()


def keep_group_id():
    import torch.distributed as dist
    mplaunch.rank_state()["group"] = id(dist.group.WORLD)


def allreduce_rank_plus_one():
    # No init_process_group here: the world's group from its setup is still there.
    import torch
    import torch.distributed as dist
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return t.item(), id(dist.group.WORLD) == mplaunch.rank_state()["group"]


def fail_in_rank_one():
    if os.environ["RANK"] == "1":
        raise ValueError("rank one fails")
    time.sleep(60)  # rank 0 is ended by the teardown


def hang_in_rank_one():
    if os.environ["RANK"] == "1":
        time.sleep(600)
    return "rank 0 returns"


def stuck_everywhere():
    time.sleep(600)


def say(word):
    rank = os.environ["RANK"]
    print(f"out {word} {rank}")
    print(f"err {word} {rank}", file=sys.stderr)
    return rank


def say_without_newline(word):
    print(f"partial {word}", end="")
    return word


def say_lines(n):
    # One write just before the reply: the pipe holds all of it when the ranks reply.
    sys.stdout.write("".join(f"{i:06d}" + "x" * 93 + "\n" for i in range(n)))
    return n


# -- results and state -----------------------------------------------------------------

def test_results_by_rank_and_state_kept_between_runs():
    with mplaunch.World(3) as world:
        assert world.pids == {}  # nothing starts before the first run
        first = world.run(whoami, ("a",))
        assert [r for r, _, _ in first] == [0, 1, 2]
        assert [x for _, _, x in first] == ["a"] * 3
        pids = {r: p for r, p, _ in first}
        assert world.pids == pids
        assert world.run(count_calls) == [1, 1, 1]
        assert world.run(count_calls) == [2, 2, 2]
        again = world.run(whoami, kwargs={"x": "b"})
        assert {r: p for r, p, _ in again} == pids  # the same processes
        assert [x for _, _, x in again] == ["b"] * 3
    assert world.pids == {}
    assert not gone(pids.values())


def test_on_one_node_size_and_nprocs_are_the_same():
    world = mplaunch.World(3)
    try:
        assert (world.nprocs, world.nnodes, world.size) == (3, 1, 3)
        assert repr(world) == "<mplaunch.World nprocs=3 backend=None not started>"
    finally:
        world.close()


def test_backend_means_the_group_exists_before_the_first_run_and_stays():
    with mplaunch.World(2, backend="gloo", timeout=60) as world:
        assert world.run(group_info) == [(True, 0, 2), (True, 1, 2)]
        world.run(keep_group_id)
        # Run 3 uses the group without initialising anything: the same group object.
        assert world.run(allreduce_rank_plus_one) == [(3.0, True), (3.0, True)]


def test_start_starts_the_ranks_before_any_run():
    with mplaunch.World(2) as world:
        assert world.start() is world
        pids = world.pids
        assert sorted(pids) == [0, 1]
        assert [p for _, p, _ in world.run(whoami)] == [pids[0], pids[1]]
        assert world.start().pids == pids  # idempotent while up


# -- failures --------------------------------------------------------------------------

def test_failing_run_raises_tears_down_and_next_run_is_fresh(caplog):
    caplog.set_level(logging.WARNING, logger="mplaunch")
    with mplaunch.World(2, grace_period=1, heal=False) as world:
        world.run(count_calls)
        old = world.pids
        with pytest.raises(mplaunch.WorkerError) as info:
            world.run(fail_in_rank_one)
        err = info.value
        assert err.rank == 1 and err.pid == old[1]
        assert type(err.__cause__) is ValueError
        assert str(err.__cause__) == "rank one fails"
        assert world.pids == {}
        assert not gone(old.values()), "a failed run left ranks running"
        warnings = [r.getMessage() for r in caplog.records
                    if r.name == "mplaunch" and r.levelno == logging.WARNING]
        assert any("fresh ranks" in w for w in warnings), caplog.text
        # The next run starts new processes, with new state.
        assert world.run(count_calls) == [1, 1]
        assert not set(world.pids.values()) & set(old.values())


def test_a_worlds_errors_name_no_attempt_however_often_it_was_torn_down():
    # launch's "[attempt N]" counts its restarts (max_restarts); a World tries no call
    # again, so the fresh ranks after a teardown are no new attempt of anything.
    with mplaunch.World(2, grace_period=1, heal=False) as world:
        errors = []
        for _ in range(2):
            with pytest.raises(mplaunch.WorkerError) as info:
                world.run(fail_in_rank_one)
            errors.append(info.value)
        world.restart()
        with pytest.raises(mplaunch.LaunchTimeout) as info:
            world.run(hang_in_rank_one, timeout=2)
        errors.append(info.value)
    for err in errors:
        assert "[attempt" not in str(err), str(err)
        assert {f.attempt for f in err.failures} == {0}
        assert "earlier attempt" not in str(err) and err.previous_attempts == []


def test_hang_with_timeout_raises_with_every_ranks_stack():
    with mplaunch.World(2, grace_period=1, heal=False) as world:
        world.run(count_calls)
        old = world.pids
        t0 = time.monotonic()
        with pytest.raises(mplaunch.LaunchTimeout) as info:
            world.run(hang_in_rank_one, timeout=3)
        assert time.monotonic() - t0 < 60  # a deadline for a hang, not a speed claim
        err = info.value
        assert err.timeout == 3
        assert sorted(err.stacks) == [0, 1]
        # Rank 0 had returned and waits for the next call; rank 1 is in the sleep.
        assert "hang_in_rank_one" in err.stacks[1]
        assert "time.sleep(600)" in str(err)
        assert world.pids == {}
        assert not gone(old.values())
        assert world.run(count_calls) == [1, 1]


def test_world_timeout_applies_to_each_run_and_run_timeout_overrides_it():
    with mplaunch.World(1, timeout=2, grace_period=1) as world:
        assert world.run(count_calls) == [1]
        with pytest.raises(mplaunch.LaunchTimeout) as info:
            world.run(stuck_everywhere)
        assert info.value.timeout == 2
        # A run's own timeout wins over the world's.
        with pytest.raises(mplaunch.LaunchTimeout) as info:
            world.run(stuck_everywhere, timeout=1)
        assert info.value.timeout == 1


def test_restart_gives_fresh_ranks():
    with mplaunch.World(2) as world:
        world.run(count_calls)
        old = world.pids
        assert world.restart() is world
        new = world.pids
        assert sorted(new) == [0, 1] and not set(new.values()) & set(old.values())
        assert not gone(old.values())
        assert world.run(count_calls) == [1, 1]


def test_close_is_idempotent_and_a_closed_world_refuses_to_run():
    world = mplaunch.World(2)
    world.run(count_calls)
    pids = world.pids
    world.close()
    world.close()
    assert world.pids == {}
    assert not gone(pids.values())
    assert "closed" in repr(world)
    with pytest.raises(RuntimeError, match="closed"):
        world.run(count_calls)
    with pytest.raises(RuntimeError, match="closed"):
        world.start()
    # closed before it ever started
    never = mplaunch.World(2)
    never.close()
    with pytest.raises(RuntimeError, match="closed"):
        never.run(count_calls)


# -- bad arguments: raise before anything starts ------------------------------------------

@pytest.mark.parametrize("kwargs,exc,match", [
    ({"nprocs": 0}, ValueError, "nprocs"),
    ({"backend": 5}, TypeError, "backend"),
    ({"max_restarts": 1}, ValueError, "max_restarts"),
    # across nodes: checked before any step or agent starts
    ({"nnodes": 2, "node_rank": 0, "master_addr": "127.0.0.1", "master_port": 29400},
     TypeError, "leave node_rank out"),
    ({"nprocs": 0, "nnodes": 2}, ValueError, "ranks on each node"),
    ({"nprocs": "auto", "nnodes": 2}, ValueError, "ranks on each node"),
    ({"nprocs": 4, "nnodes": 0}, ValueError, "nnodes must be an int >= 1"),
    ({"nprocs": 4, "nnodes": 2, "start_method": "fork"}, ValueError, "forkserver"),
    ({"nprocs": 4, "nnodes": 2}, RuntimeError, "not inside a SLURM allocation"),
    ({"kwargs": {"a": 1}}, TypeError, "kwargs"),
    ({"start_method": "threads"}, ValueError, "start_method"),
    ({"timeout": -1}, ValueError, "timeout"),
])
def test_bad_world_arguments_raise_at_once(kwargs, exc, match, monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    with pytest.raises(exc, match=match):
        mplaunch.World(**kwargs)


@pytest.mark.parametrize("call,exc", [
    (lambda w: w.run(42), TypeError),
    (lambda w: w.run(whoami, args=5), TypeError),
    (lambda w: w.run(whoami, kwargs=[1]), TypeError),
    (lambda w: w.run(whoami, timeout=-1), ValueError),
    # an argument that cannot be pickled: refused here, not in the ranks
    (lambda w: w.run(whoami, args=(threading.Lock(),)), TypeError),
])
def test_bad_run_arguments_raise_before_any_rank_starts(call, exc):
    with mplaunch.World(2) as world:
        with pytest.raises(exc):
            call(world)
        assert world.pids == {}


# -- output ----------------------------------------------------------------------------

def test_each_runs_output_lands_in_the_capture_of_its_call(capsys):
    with mplaunch.World(2, prefix="<{rank}> ") as world:
        world.run(say, ("one",))
        out, err = capsys.readouterr()
        assert sorted(out.splitlines()) == ["<0> out one 0", "<1> out one 1"]
        assert sorted(err.splitlines()) == ["<0> err one 0", "<1> err one 1"]
        # The next run under another capture goes there, and only there.
        other_out, other_err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(other_out), contextlib.redirect_stderr(other_err):
            world.run(say, ("two",))
        assert sorted(other_out.getvalue().splitlines()) == ["<0> out two 0",
                                                             "<1> out two 1"]
        assert sorted(other_err.getvalue().splitlines()) == ["<0> err two 0",
                                                             "<1> err two 1"]
        world.run(say, ("three",))
        out, err = capsys.readouterr()
        assert sorted(out.splitlines()) == ["<0> out three 0", "<1> out three 1"]
        assert sorted(err.splitlines()) == ["<0> err three 0", "<1> err three 1"]


def test_a_runs_last_line_without_newline_stays_with_that_run():
    with mplaunch.World(2, prefix="<{rank}> ") as world:
        first, second = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(first):
            world.run(say_without_newline, ("one",))
        with contextlib.redirect_stdout(second):
            world.run(say, ("two",))
    assert sorted(first.getvalue().splitlines()) == ["<0> partial one",
                                                     "<1> partial one"]
    assert sorted(second.getvalue().splitlines()) == ["<0> out two 0", "<1> out two 1"]


class SlowSink(io.StringIO):
    """A sink that takes its time (a notebook's, a slow terminal's): while the relay
    writes one chunk the ranks reply, with most of their output still in the pipe."""

    def write(self, s):
        time.sleep(0.005)
        return super().write(s)


def test_a_runs_output_larger_than_one_read_stays_with_that_run():
    n = 5000  # 500 kB per rank, in its 1 MB pipe: many reads left when the ranks reply
    with mplaunch.World(2) as world:
        first, second = SlowSink(), SlowSink()
        with contextlib.redirect_stdout(first):
            world.run(say_lines, (n,))
        with contextlib.redirect_stdout(second):
            world.run(say_lines, (2,))
    assert len(first.getvalue().splitlines()) == 2 * n
    assert len(second.getvalue().splitlines()) == 2 * 2


# -- start methods and leaks ---------------------------------------------------------------

@pytest.mark.parametrize("method", ["forkserver", "spawn", "fork"])
def test_every_start_method(method):
    with mplaunch.World(2, start_method=method) as world:
        first = world.run(whoami, (1,))
        assert [r for r, _, _ in first] == [0, 1]
        assert world.run(count_calls) == [1, 1]
        assert world.run(count_calls) == [2, 2]
        assert [p for _, p, _ in world.run(whoami)] == [p for _, p, _ in first]
        pids = world.pids
    assert not gone(pids.values())


def test_many_worlds_in_a_row_leak_nothing():
    from test_lifecycle import _back_to, _settled_state
    with mplaunch.World(2) as world:  # warm
        world.run(count_calls)
    before = _settled_state()
    for i in range(15):
        with mplaunch.World(2, backend="gloo" if i % 5 == 0 else None) as world:
            assert world.run(whoami, (i,))[1][2] == i
            assert world.run(count_calls) == [1, 1]
    assert _back_to(before) == before


def test_many_runs_in_one_world_leak_nothing():
    from test_lifecycle import _back_to, _settled_state
    with mplaunch.World(2) as world:
        world.run(count_calls)
        before = _settled_state()
        for i in range(200):
            world.run(whoami, (i,))
        assert _back_to(before) == before
        assert world.run(count_calls) == [2, 2]


# -- signals, parent death and interpreter exit (a separate launching process) --------------

def _recorded(records):
    return {pid for rec in records for pid in (rec["pid"], *rec["descendants"])}


def test_sigint_during_world_run_raises_main_process_error_and_leaves_nothing(tmp_path):
    with world_parent(tmp_path, "run") as wp:
        records = wp.wait_ranks()
        os.kill(wp.proc.pid, signal.SIGINT)
        assert wp.proc.wait(timeout=60) == EXIT_MAIN_PROCESS_ERROR, wp.log()
        res = wp.result()
        assert res["type"] == "MainProcessError" and res["signal_no"] == signal.SIGINT
        # The world was torn down before run raised; the next run got fresh ranks.
        assert res["running_at_raise"] == [], res
        assert res["pids_after"] == {}
        assert not {r["pid"] for r in records} & set(res["next_run"])
        for rec in records:  # the rank got the forwarded SIGINT itself
            assert (tmp_path / f"signal.{rec['rank']}").read_text().split() == [
                str(int(signal.SIGINT)), str(rec["pid"])]
        _, alive = wait_gone(wp.tree, GONE_DEADLINE_S)
        assert not alive, describe(alive)


@pytest.mark.parametrize("mode,grandchildren", [
    ("idle", "light"),       # ranks idle between runs, holding grandchildren
    ("run", "light"),        # ranks busy in a run
    pytest.param("idle+dl", "DataLoader", marks=pytest.mark.slow),
    pytest.param("run+dl", "DataLoader", marks=pytest.mark.slow),
])
def test_sigkilled_parent_takes_the_whole_world_with_it(tmp_path, mode, grandchildren):
    with world_parent(tmp_path, mode) as wp:
        if mode.startswith("idle"):
            wp.wait_ready()
        records = wp.wait_ranks()
        for rec in records:
            assert {rec["plain"], rec["detached"]} <= set(rec["descendants"]), rec
            assert len(rec["descendants"]) >= 3, rec
        assert _recorded(records) <= {p.pid for p in wp.tree}
        killed_at = time.monotonic()
        os.kill(wp.proc.pid, signal.SIGKILL)
        elapsed, alive = wait_gone(wp.tree, GONE_DEADLINE_S, since=killed_at)
        assert wp.proc.wait() == -signal.SIGKILL
        assert not alive, (f"still running {elapsed:.2f} s after the parent was "
                           f"SIGKILLed:\n{describe(alive)}\n{wp.log()}")
        assert elapsed < KILL_BOUND_S, f"{len(wp.tree)} processes took {elapsed:.2f} s"


def test_world_left_open_is_closed_at_interpreter_exit(tmp_path):
    with world_parent(tmp_path, "exit-idle") as wp:
        assert_closed_at_exit(wp, tmp_path)
