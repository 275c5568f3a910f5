"""Signals to the launching process: forwarded to every rank, turned into
MainProcessError once everything is down, and the process's own handlers left exactly as
they were. Handlers are only ever installed from the main thread."""
import logging
import os
import signal
import sys
import threading
import time

import pytest

import mplaunch

SCRIPTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts")
if SCRIPTS not in sys.path:
    sys.path.insert(0, SCRIPTS)

from proctree import (FORK_DETACHED, DetachedEscaped, describe,  # noqa: E402
                      tree_parent, wait_gone)

FORWARDED = [signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT]
EXIT_MAIN_PROCESS_ERROR = 3  # tree_parent.py's exit code after MainProcessError


@pytest.mark.parametrize("signo,method", [
    pytest.param(signal.SIGTERM, "forkserver", id="SIGTERM-forkserver"),
    pytest.param(signal.SIGINT, "forkserver", id="SIGINT-forkserver"),
    pytest.param(signal.SIGHUP, "forkserver", id="SIGHUP-forkserver"),
    # fork mode signals its ranks itself rather than through the server.
    pytest.param(signal.SIGTERM, "fork", id="SIGTERM-fork"),
])
def test_signal_to_parent_is_forwarded_then_raised(tmp_path, signo, method):
    # "light": grandchildren without torch (the SIGKILL tests cover DataLoader workers).
    with tree_parent(tmp_path, method, light=True) as tp:
        records = tp.wait_ranks()
        for rec in records:
            assert len(rec["descendants"]) >= 3, rec  # sleep, detached sleep, mp child
        os.kill(tp.proc.pid, signo)
        assert tp.proc.wait(timeout=60) == EXIT_MAIN_PROCESS_ERROR, tp.log()
        res = tp.result()
        assert res["type"] == "MainProcessError"
        assert res["signal_no"] == signo
        assert res["signal_name"] == signal.Signals(signo).name
        assert res["nprocs"] == 2
        for rec in records:
            # The rank's own handler ran: it got the forwarded signal, not a SIGKILL.
            marker = tmp_path / f"signal.{rec['rank']}"
            assert marker.exists(), f"rank {rec['rank']} never saw the signal:\n{tp.log()}"
            assert marker.read_text().split() == [str(signo), str(rec["pid"])]
        rank_pids = {rec["pid"] for rec in records}
        detached = {rec["detached"] for rec in records}
        # Ranks are reaped before launch raises; what they left behind was sent SIGKILL
        # by then and is given a moment to finish dying.
        assert not set(res["running_at_raise"]) & rank_pids, res
        assert not set(res["running_after_deadline"]) - detached, res
        # The launching process has exited, so its server is gone with it.
        _, alive = wait_gone([p for p in tp.tree if p.pid not in detached], 5.0)
        assert not alive, describe(alive)
        if res["running_after_deadline"]:
            raise DetachedEscaped(f"still running after launch raised: {res}")


def _custom(signo, frame):
    raise AssertionError(f"the test's own handler got signal {signo}")


def _other_custom(signo, frame):
    raise AssertionError(f"the test's other handler got signal {signo}")


@pytest.fixture
def own_handlers():
    """Distinctive handlers on every forwarded signal, put back afterwards."""
    saved = {s: signal.getsignal(s) for s in FORWARDED}
    mine = {signal.SIGINT: _custom, signal.SIGTERM: _other_custom,
            signal.SIGHUP: signal.SIG_IGN, signal.SIGQUIT: signal.SIG_DFL}
    for s, h in mine.items():
        signal.signal(s, h)
    try:
        yield mine
    finally:
        for s, h in saved.items():
            signal.signal(s, h)


def _handlers():
    return {s: signal.getsignal(s) for s in FORWARDED}


def fail_in_rank_one():
    if os.environ["RANK"] == "1":
        raise ValueError("rank one fails")
    time.sleep(30)


def interrupt_launcher(pid):
    if os.environ["RANK"] == "0":
        os.kill(pid, signal.SIGINT)
    time.sleep(20)  # ended by the forwarded SIGINT well before this
    return "not interrupted"


def test_handlers_restored_after_return(own_handlers):
    assert mplaunch.launch(int, ("7",), 2) == [7, 7]
    assert _handlers() == own_handlers


def test_handlers_restored_after_worker_error(own_handlers):
    with pytest.raises(mplaunch.WorkerError):
        mplaunch.launch(fail_in_rank_one, nprocs=2, grace_period=1)
    assert _handlers() == own_handlers


def test_handlers_restored_after_main_process_error(own_handlers):
    # The test's own SIGINT handler would raise inside pytest: mplaunch's must be the
    # one that gets the signal, for as long as launch runs.
    with pytest.raises(mplaunch.MainProcessError) as info:
        mplaunch.launch(interrupt_launcher, (os.getpid(),), 2, grace_period=1)
    assert info.value.signal_no == signal.SIGINT
    assert _handlers() == own_handlers


def wait_for_release(d):
    rank = os.environ["RANK"]
    open(os.path.join(d, f"started.{rank}"), "w").close()
    while not os.path.exists(os.path.join(d, "release")):
        time.sleep(0.01)
    return int(rank)


def test_launch_off_main_thread_installs_no_handlers(tmp_path, own_handlers, caplog):
    caplog.set_level(logging.WARNING, logger="mplaunch")
    out = {}

    def run():
        try:
            out["result"] = mplaunch.launch(wait_for_release, (str(tmp_path),), 2,
                                            timeout=120)
        except BaseException as exc:  # noqa: BLE001 - reported below
            out["error"] = exc

    t = threading.Thread(target=run)
    t.start()
    try:
        deadline = time.monotonic() + 90
        while not all((tmp_path / f"started.{r}").exists() for r in range(2)):
            assert t.is_alive() and time.monotonic() < deadline, out
            time.sleep(0.01)
        # Both ranks are running, so launch is inside its monitor loop right now.
        assert _handlers() == own_handlers
    finally:
        (tmp_path / "release").touch()
        t.join()
    assert out == {"result": [0, 1]}
    assert _handlers() == own_handlers
    warnings = [r for r in caplog.records
                if r.name == "mplaunch" and r.levelno == logging.WARNING]
    assert len(warnings) == 1, caplog.text
    assert "main thread" in warnings[0].getMessage()
