"""mplaunch.start and its Handle, proved with real ranks: it returns while the ranks run,
its outcome is exactly launch()'s, stop() tears down, and signals, parent death and
interpreter exit leave nothing behind."""
import os
import signal
import sys
import threading
import time

import pytest

import mplaunch

HERE = os.path.dirname(os.path.abspath(__file__))
for _d in (os.path.join(HERE, "scripts"), os.path.join(HERE, "scripts_world")):
    if _d not in sys.path:
        sys.path.insert(0, _d)

from proctree import describe, wait_gone  # noqa: E402
from worldproc import (EXIT_MAIN_PROCESS_ERROR, GONE_DEADLINE_S, KILL_BOUND_S,  # noqa: E402
                       assert_closed_at_exit, gone, world_parent)
from timeout_ranks import sleep_forever  # noqa: E402


def whoami(x=None):
    return int(os.environ["RANK"]), os.getpid(), x


def wait_for_file(path, timeout=60):
    """Block until `path` exists: the test decides when the ranks may return."""
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise RuntimeError(f"{path} never appeared")
        time.sleep(0.01)
    return int(os.environ["RANK"])


def fail_in_rank_one():
    if os.environ["RANK"] == "1":
        raise ValueError("rank one fails")
    time.sleep(60)


def exit_three_in_rank_one():
    if os.environ["RANK"] == "1":
        sys.exit(3)
    time.sleep(60)


# -- the handle ---------------------------------------------------------------------------

def test_handle_returns_while_ranks_run_then_gives_the_results(tmp_path):
    release = tmp_path / "release"
    with mplaunch.start(wait_for_file, (str(release),), 2) as handle:
        pids = handle.pids
        assert sorted(pids) == [0, 1] and all(p > 0 for p in pids.values())
        t0 = time.monotonic()
        assert handle.done() is False
        assert time.monotonic() - t0 < 0.5  # done() never blocks
        assert handle.wait(0.2) is False
        with pytest.raises(TimeoutError, match="still running"):
            handle.result(timeout=0.1)
        assert "running" in repr(handle)
        release.touch()
        assert handle.wait(60) is True
        assert handle.done() is True
        assert handle.result() == [0, 1]
        assert handle.result() == [0, 1]  # asking twice gives the same
        assert handle.pids == pids
        assert "done" in repr(handle)
    assert not gone(pids.values())


def test_stop_tears_down_and_result_names_the_stopped_ranks():
    handle = mplaunch.start(sleep_forever, nprocs=2, grace_period=1)
    pids = handle.pids
    handle.stop()
    assert handle.done()
    assert not gone(pids.values(), timeout=0.5)  # stop() returns once all are gone
    handle.stop()   # idempotent
    handle.stop(grace_period=0)
    with pytest.raises(mplaunch.WorkerError) as info:
        handle.result()
    err = info.value
    assert sorted(f.rank for f in err.failures) == [0, 1]
    assert "stop" in str(err)


def test_stop_after_the_ranks_finished_keeps_their_results():
    handle = mplaunch.start(whoami, ("x",), 2)
    assert handle.wait(60)
    handle.stop()
    assert [(r, x) for r, _, x in handle.result()] == [(0, "x"), (1, "x")]


def test_leaving_the_block_stops_a_running_handle():
    with mplaunch.start(sleep_forever, nprocs=2, grace_period=1) as handle:
        pids = handle.pids
    assert handle.done()
    assert not gone(pids.values(), timeout=0.5)
    with pytest.raises(mplaunch.WorkerError):
        handle.result()


def test_wait_and_result_from_another_thread(tmp_path):
    release = tmp_path / "release"
    handle = mplaunch.start(wait_for_file, (str(release),), 2)
    got = {}
    t = threading.Thread(target=lambda: got.setdefault("r", handle.result()))
    t.start()
    release.touch()
    t.join(60)
    assert got == {"r": [0, 1]}
    assert handle.wait(0) is True


# -- the same outcome as launch ------------------------------------------------------------

def _same_error(a, b):
    assert type(a) is type(b)
    assert [(f.rank, f.exitcode, f.exc_type) for f in a.failures] == \
        [(f.rank, f.exitcode, f.exc_type) for f in b.failures]
    assert type(a.__cause__) is type(b.__cause__)
    assert str(a.__cause__) == str(b.__cause__)


@pytest.mark.parametrize("func,options", [
    (fail_in_rank_one, {"grace_period": 1}),
    (exit_three_in_rank_one, {"grace_period": 1}),
    (sleep_forever, {"timeout": 2, "grace_period": 1}),
])
def test_start_raises_what_launch_raises(func, options):
    with pytest.raises(mplaunch.WorkerError) as launched:
        mplaunch.launch(func, nprocs=2, **options)
    handle = mplaunch.start(func, nprocs=2, **options)
    with pytest.raises(mplaunch.WorkerError) as started:
        handle.result(60)
    _same_error(started.value, launched.value)
    if isinstance(launched.value, mplaunch.LaunchTimeout):
        assert sorted(started.value.stacks) == [0, 1]
        assert "sleep_forever" in started.value.stacks[0]


def test_start_with_max_restarts_restarts_like_launch(tmp_path):
    handle = mplaunch.start(fail_in_rank_one, nprocs=2, max_restarts=1, grace_period=1)
    with pytest.raises(mplaunch.WorkerError) as info:
        handle.result(60)
    assert len(info.value.previous_attempts) == 1


@pytest.mark.parametrize("call,exc", [
    (lambda: mplaunch.start(42), TypeError),
    (lambda: mplaunch.start(whoami, nprocs=0), ValueError),
    (lambda: mplaunch.start(whoami, args=5), TypeError),
    (lambda: mplaunch.start(whoami, start_method="threads"), ValueError),
    (lambda: mplaunch.start(whoami, timeout=-1), ValueError),
    (lambda: mplaunch.start(whoami, bogus=1), TypeError),
])
def test_bad_arguments_raise_before_anything_starts(call, exc):
    with pytest.raises(exc):
        call()


@pytest.mark.parametrize("method", ["forkserver", "spawn", "fork"])
def test_every_start_method(method, tmp_path):
    release = tmp_path / "release"
    handle = mplaunch.start(wait_for_file, (str(release),), 2, start_method=method)
    assert sorted(handle.pids) == [0, 1]
    assert not handle.done()
    release.touch()
    assert handle.result(60) == [0, 1]


def test_many_handles_in_a_row_leak_nothing():
    from test_lifecycle import _back_to, _settled_state
    assert mplaunch.start(whoami, nprocs=2).result(60)  # warm
    before = _settled_state()
    for i in range(20):
        h = mplaunch.start(whoami, (i,), 2)
        if i % 4 == 3:
            assert h.wait(60)
            h.stop()  # after the ranks returned: the results stay
        assert [x for _, _, x in h.result(60)] == [i, i]
    for i in range(5):
        h = mplaunch.start(sleep_forever, nprocs=2, grace_period=1)
        h.stop()
    assert _back_to(before) == before


# -- signals, parent death and interpreter exit ---------------------------------------------

@pytest.mark.parametrize("mode", ["wait", "result"])
def test_sigint_while_waiting_on_a_handle_raises_main_process_error(tmp_path, mode):
    with world_parent(tmp_path, mode) as wp:
        wp.wait_ready()
        records = wp.wait_ranks()
        os.kill(wp.proc.pid, signal.SIGINT)
        assert wp.proc.wait(timeout=60) == EXIT_MAIN_PROCESS_ERROR, wp.log()
        res = wp.result()
        assert res["type"] == "MainProcessError" and res["signal_no"] == signal.SIGINT
        assert res["done"] is True
        assert res["running_at_raise"] == [], res
        for rec in records:  # forwarded to each rank, which handled it itself
            assert (tmp_path / f"signal.{rec['rank']}").read_text().split() == [
                str(int(signal.SIGINT)), str(rec["pid"])]
        _, alive = wait_gone(wp.tree, GONE_DEADLINE_S)
        assert not alive, describe(alive)


@pytest.mark.parametrize("mode", ["handle", pytest.param("handle+dl", marks=pytest.mark.slow)])
def test_sigkilled_parent_takes_a_running_handle_with_it(tmp_path, mode):
    with world_parent(tmp_path, mode) as wp:
        wp.wait_ready()
        records = wp.wait_ranks()
        for rec in records:
            assert {rec["plain"], rec["detached"]} <= set(rec["descendants"]), rec
        killed_at = time.monotonic()
        os.kill(wp.proc.pid, signal.SIGKILL)
        elapsed, alive = wait_gone(wp.tree, GONE_DEADLINE_S, since=killed_at)
        assert wp.proc.wait() == -signal.SIGKILL
        assert not alive, f"{describe(alive)}\nrecorded: {records}"
        assert elapsed < KILL_BOUND_S, f"{len(wp.tree)} processes took {elapsed:.2f} s"


def test_handle_left_running_is_stopped_at_interpreter_exit(tmp_path):
    with world_parent(tmp_path, "exit-handle") as wp:
        wp.wait_ready()
        assert_closed_at_exit(wp, tmp_path)
