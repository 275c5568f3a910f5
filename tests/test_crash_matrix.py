"""The crash matrix: every way a rank can fail, under every start method that runs ranks
in a server, and what launch() must report about it.

In each case rank 1 fails while rank 0 waits (so the survivor's teardown runs too). Both
ranks record their pid in a file first, so the test knows exactly which processes it
must find gone afterwards.
"""
from __future__ import annotations

import ctypes
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Callable, Optional

import psutil
import pytest

import mplaunch

METHODS = ["forkserver", "spawn"]
GRACE = 1.0


# -- what rank 1 does --------------------------------------------------------------------

class LockedError(Exception):
    """Cannot be pickled: it holds a lock."""

    def __init__(self, msg):
        super().__init__(msg)
        self.lock = threading.Lock()


class RefusesPickleError(Exception):
    def __reduce__(self):
        raise RuntimeError("this exception refuses to be pickled")


class TwoArgError(Exception):
    """Plain pickle cannot rebuild it: BaseException.__reduce__ replays args, which hold
    one value where __init__ wants two."""

    def __init__(self, a, b):
        super().__init__(f"{a} and {b}")


def _raise(exc):
    raise exc


def _chained(tmp):
    try:
        {}["missing"]
    except KeyError:
        raise ValueError("boom") from OSError("root cause")


def _unpicklable_cause(tmp):
    try:
        raise LockedError("inner, with a lock")
    except LockedError as exc:
        raise ValueError("outer") from exc


def _class_only_in_rank(tmp):
    # A module the launching process has never seen and cannot import.
    with open(os.path.join(tmp, "rank_only_errors.py"), "w") as f:
        f.write("class RankOnlyError(Exception):\n    pass\n")
    sys.path.insert(0, tmp)
    import rank_only_errors
    raise rank_only_errors.RankOnlyError("from a module only the rank has")


def _segfault(tmp):
    ctypes.string_at(0)


def _grandchild_popen(tmp, new_session):
    p = subprocess.Popen(["sleep", "60"], start_new_session=new_session)
    _write(tmp, "grandchild", p.pid)
    raise RuntimeError("failed after starting a grandchild")


def _grandchild_mp_fork(tmp):
    import multiprocessing
    p = multiprocessing.get_context("fork").Process(target=time.sleep, args=(60,))
    p.start()
    _write(tmp, "grandchild", p.pid)
    raise RuntimeError("failed after forking a grandchild")


def _outcome_skip(tmp):
    pytest.skip("skipped inside a rank")


def _outcome_fail(tmp):
    pytest.fail("failed inside a rank")


ACTIONS: dict = {
    "chained": _chained,
    "sys_exit": lambda tmp: sys.exit(3),
    "sys_exit_message": lambda tmp: sys.exit("giving up"),
    "os_exit": lambda tmp: os._exit(7),
    "segfault": _segfault,
    "sigkill": lambda tmp: os.kill(os.getpid(), signal.SIGKILL),
    "abort": lambda tmp: os.abort(),
    "unpicklable_lock": lambda tmp: _raise(LockedError("held a lock")),
    "unpicklable_reduce": lambda tmp: _raise(RefusesPickleError("no")),
    "mismatched_init": lambda tmp: _raise(TwoArgError("x", "y")),
    "unpicklable_cause": _unpicklable_cause,
    "class_only_in_rank": _class_only_in_rank,
    "bad_return": lambda tmp: threading.Lock(),
    "keyboard_interrupt": lambda tmp: _raise(KeyboardInterrupt()),
    "pytest_skip": _outcome_skip,
    "pytest_fail": _outcome_fail,
    "exit_zero": lambda tmp: os._exit(0),
    "grandchild_popen": lambda tmp: _grandchild_popen(tmp, False),
    "grandchild_session": lambda tmp: _grandchild_popen(tmp, True),
    "grandchild_mp_fork": _grandchild_mp_fork,
}


def _write(tmp, name, pid):
    path = os.path.join(tmp, name)
    with open(path + ".tmp", "w") as f:
        f.write(str(pid))
    os.replace(path + ".tmp", path)  # readers never see a half-written pid


def _read(tmp, name) -> Optional[int]:
    try:
        with open(os.path.join(tmp, name)) as f:
            return int(f.read())
    except FileNotFoundError:
        return None


def crash(tmp, action, survivor=None):
    rank = int(os.environ["RANK"])
    if rank == 0:
        if survivor == "ignores_sigterm":
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        elif survivor == "notes_sigterm":
            # Says it was asked to stop, then goes on sleeping: only SIGKILL ends it.
            signal.signal(signal.SIGTERM, lambda *_: _write(tmp, "sigterm0", os.getpid()))
        _write(tmp, "pid0", os.getpid())
        # Longer than pytest's own timeout: if teardown did not kill it, the test fails.
        time.sleep(600)
        return "rank 0 was never torn down"
    _write(tmp, "pid1", os.getpid())
    # Fail only once rank 0 is in place, so the teardown of a live survivor is tested.
    while _read(tmp, "pid0") is None:
        time.sleep(0.01)
    return ACTIONS[action](tmp)


# -- expectations ------------------------------------------------------------------------

@dataclass
class Case:
    action: str
    exitcode: int
    signal: Optional[str] = None
    cause: Optional[type] = None            # type of err.__cause__, None for no cause
    exc_type: Optional[str] = None          # RankFailure.exc_type
    in_message: tuple = ()                  # substrings of str(err)
    in_traceback: tuple = ()                # substrings of err.traceback
    check: Optional[Callable] = None        # extra checks: check(err, tmp)
    survivor: Optional[str] = None          # how rank 0 treats SIGTERM (None: dies)


def _assert_equal(a, b):
    assert a == b


def _worker_frames(exc):
    return [f.name for f in traceback.extract_tb(exc.__traceback__)]


def check_chained(err, tmp):
    cause = err.__cause__
    assert type(cause) is ValueError and str(cause) == "boom"
    assert type(cause.__cause__) is OSError and str(cause.__cause__) == "root cause"
    assert type(cause.__context__) is KeyError and cause.__context__.args == ("missing",)
    assert cause.__suppress_context__ is True
    # The worker's own frames, not the parent's: a debugger lands where it failed.
    frames = _worker_frames(cause)
    assert "_chained" in frames and "crash" in frames, frames
    assert "run_rank" not in frames and "_run_and_report" not in frames, frames
    assert err.traceback.rstrip().endswith("ValueError: boom")
    # Rendered here, the rebuilt chain reads exactly as the worker printed it: same
    # frames, lines, and underlined expressions.
    assert "".join(traceback.format_exception(cause)) == err.traceback
    # Python's own rendering: the cause is shown, the suppressed context is not.
    assert "OSError: root cause" in err.traceback and "KeyError" not in err.traceback


def check_sys_exit(err, tmp):
    assert err.__cause__.code == 3


def check_crash_dump(func_name):
    def check(err, tmp):
        tail = err.stderr_tail
        assert tail and "Fatal Python error" in tail, tail
        assert func_name in tail, tail  # faulthandler's stack of the crashing thread
        assert "Fatal Python error" in str(err)
        assert err.traceback is None and err.__cause__ is None
    return check


def check_remote(type_suffix, message):
    def check(err, tmp):
        cause = err.__cause__
        assert type(cause) is mplaunch.RemoteException
        assert cause.type_name.endswith(type_suffix), cause.type_name
        assert cause.type_name == err.exc_type
        assert cause.message == message
        assert "crash" in cause.traceback and type_suffix in cause.traceback
        assert cause.traceback == err.traceback
        assert str(cause).startswith(f"{cause.type_name}: {message}")
        # It stands in for the original anywhere an exception goes, pickle included.
        again = pickle.loads(pickle.dumps(cause))
        assert (again.type_name, again.message, again.traceback) == \
            (cause.type_name, cause.message, cause.traceback)
    return check


def check_mismatched_init(err, tmp):
    cause = err.__cause__
    assert cause.args == ("x and y",) and str(cause) == "x and y"
    assert "crash" in _worker_frames(cause)


def check_unpicklable_cause(err, tmp):
    # The part that pickles arrives as itself; only the lock-holding link is a stand-in,
    # and it keeps the worker's frames.
    outer = err.__cause__
    assert str(outer) == "outer"
    inner = outer.__cause__
    assert type(inner) is mplaunch.RemoteException
    assert inner.type_name == "test_crash_matrix.LockedError"
    assert inner.message == "inner, with a lock"
    assert "_unpicklable_cause" in _worker_frames(inner)
    assert "_unpicklable_cause" in _worker_frames(outer)


def check_bad_return(err, tmp):
    cause = err.__cause__
    assert "lock" in str(cause) and "could not be pickled" in str(cause), str(cause)
    assert "rank 1" in str(cause)


def check_exit_zero(err, tmp):
    assert err.__cause__ is None
    assert "without returning" in err.first.message


def check_sigterm_first(err, tmp):
    # Teardown asks first (SIGTERM, which rank 0 noted and ignored), then kills.
    assert _read(tmp, "sigterm0") == _read(tmp, "pid0")


def check_grandchild(err, tmp):
    pid = _read(tmp, "grandchild")
    assert pid is not None
    _assert_gone(pid, "the failing rank's child")


CASES = {
    "exception_with_cause": Case(
        "chained", 1, cause=ValueError, exc_type="ValueError",
        in_message=("rank 1", "raised ValueError: boom"),
        in_traceback=("_chained", "raise ValueError"), check=check_chained),
    "sys_exit_3": Case(
        "sys_exit", 3, cause=SystemExit, exc_type="SystemExit", check=check_sys_exit),
    "sys_exit_message": Case(
        "sys_exit_message", 1, cause=SystemExit, exc_type="SystemExit",
        in_message=("raised SystemExit: giving up",),
        check=lambda err, tmp: _assert_equal(err.__cause__.code, "giving up")),
    "os_exit_7": Case("os_exit", 7, in_message=("exited with code 7",)),
    "sigsegv": Case("segfault", -11, signal="SIGSEGV",
                    in_message=("killed by SIGSEGV",), check=check_crash_dump("_segfault")),
    "sigkill_self": Case("sigkill", -9, signal="SIGKILL", in_message=("killed by SIGKILL",)),
    "abort": Case("abort", -6, signal="SIGABRT", in_message=("killed by SIGABRT",),
                  check=check_crash_dump("crash")),
    "unpicklable_exception_lock": Case(
        "unpicklable_lock", 1, cause=mplaunch.RemoteException,
        exc_type="test_crash_matrix.LockedError", in_message=("LockedError: held a lock",),
        in_traceback=("LockedError",), check=check_remote("LockedError", "held a lock")),
    "unpicklable_exception_reduce": Case(
        "unpicklable_reduce", 1, cause=mplaunch.RemoteException,
        exc_type="test_crash_matrix.RefusesPickleError",
        check=check_remote("RefusesPickleError", "no")),
    "exception_with_mismatched_init": Case(
        "mismatched_init", 1, cause=TwoArgError, exc_type="test_crash_matrix.TwoArgError",
        in_message=("TwoArgError: x and y",), check=check_mismatched_init),
    "unpicklable_cause": Case(
        "unpicklable_cause", 1, cause=ValueError, exc_type="ValueError",
        in_traceback=("LockedError: inner, with a lock",), check=check_unpicklable_cause),
    "exception_class_only_in_rank": Case(
        "class_only_in_rank", 1, cause=mplaunch.RemoteException,
        exc_type="rank_only_errors.RankOnlyError",
        check=check_remote("RankOnlyError", "from a module only the rank has")),
    "unpicklable_return_value": Case(
        "bad_return", 1, cause=TypeError, exc_type="TypeError",
        in_message=("could not be pickled",), check=check_bad_return),
    "keyboard_interrupt": Case(
        "keyboard_interrupt", 1, cause=KeyboardInterrupt, exc_type="KeyboardInterrupt",
        in_traceback=("KeyboardInterrupt",)),
    "pytest_skip": Case(
        "pytest_skip", 1, cause=pytest.skip.Exception,
        exc_type="Skipped", in_message=("skipped inside a rank",)),
    "pytest_fail": Case(
        "pytest_fail", 1, cause=pytest.fail.Exception,
        exc_type="Failed", in_message=("failed inside a rank",)),
    "exit_zero_without_result": Case(
        "exit_zero", 0, in_message=("without returning",), check=check_exit_zero),
    "grandchild_popen": Case(
        "grandchild_popen", 1, cause=RuntimeError, exc_type="RuntimeError",
        check=check_grandchild),
    "grandchild_new_session": Case(
        "grandchild_session", 1, cause=RuntimeError, exc_type="RuntimeError",
        check=check_grandchild),
    "grandchild_multiprocessing_fork": Case(
        "grandchild_mp_fork", 1, cause=RuntimeError, exc_type="RuntimeError",
        check=check_grandchild),
    "survivor_ignores_sigterm": Case(
        "chained", 1, cause=ValueError, exc_type="ValueError", check=check_chained,
        survivor="ignores_sigterm"),
    "survivor_catches_sigterm": Case(
        "os_exit", 7, in_message=("exited with code 7",), check=check_sigterm_first,
        survivor="notes_sigterm"),
}


def _assert_gone(pid, what, timeout=10.0):
    """Dead, and reaped by whoever is its parent now. A deadline, not a timing claim:
    a SIGKILLed process takes a moment to be reaped on a loaded machine."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            status = psutil.Process(pid).status()
        except psutil.NoSuchProcess:
            return
        if time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert status == psutil.STATUS_ZOMBIE, f"{what} (pid {pid}) is still {status}"
    pytest.fail(f"{what} (pid {pid}) is a zombie nobody reaped")


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("name", list(CASES))
def test_crash(name, method, tmp_path):
    case = CASES[name]
    tmp = str(tmp_path)
    with pytest.raises(mplaunch.WorkerError) as info:
        mplaunch.launch(crash, (tmp, case.action, case.survivor), 2,
                        start_method=method, grace_period=GRACE)
    err = info.value
    assert type(err) is mplaunch.WorkerError  # not a timeout, not a MainProcessError

    pid0, pid1 = _read(tmp, "pid0"), _read(tmp, "pid1")
    assert pid0 is not None and pid1 is not None

    assert err.rank == 1 and err.worker_id == 1
    assert isinstance(err.pid, int) and err.pid == pid1
    assert err.exitcode == case.exitcode
    assert err.signal == case.signal
    assert err.exc_type == case.exc_type
    if case.cause is None:
        assert err.__cause__ is None
    else:
        assert type(err.__cause__) is case.cause, repr(err.__cause__)
    if case.exc_type is None:
        assert err.traceback is None
    else:
        assert err.traceback, "an exception's traceback text must arrive"
    for text in case.in_traceback:
        assert text in err.traceback
    # Rank 0 was torn down by us: it is not a failure of its own.
    assert [f.rank for f in err.failures] == [1]
    first = err.failures[0]
    assert first is err.first
    assert (first.pid, first.exitcode, first.signal) == (err.pid, err.exitcode, err.signal)
    assert first.attempt == 0 and first.local_rank == 1 and first.node_rank == 0
    assert isinstance(first.timestamp, float)

    summary = str(err).splitlines()[0]
    assert summary.startswith(f"rank 1 (pid {pid1}")
    for text in case.in_message:
        assert text in str(err), str(err)
    if case.check is not None:
        case.check(err, tmp)

    _assert_gone(pid0, "the surviving rank 0")
    _assert_gone(pid1, "the failing rank 1")


def test_cause_traceback_is_the_workers(tmp_path):
    """The rebuilt cause keeps line numbers of the worker's frames (it is not just a
    name): the last frame is the `raise` line of _chained."""
    with pytest.raises(mplaunch.WorkerError) as info:
        mplaunch.launch(crash, (str(tmp_path), "chained"), 2, grace_period=GRACE)
    last = traceback.extract_tb(info.value.__cause__.__traceback__)[-1]
    assert last.name == "_chained"
    assert last.filename == __file__
    assert "raise ValueError" in last.line


def _return_rank_only_object(tmp):
    with open(os.path.join(tmp, "rank_only_results.py"), "w") as f:
        f.write("class Result:\n    pass\n")
    sys.path.insert(0, tmp)
    import rank_only_results
    return rank_only_results.Result()


def return_what_the_parent_cannot_load(tmp):
    if os.environ["RANK"] == "0":
        return 0
    return _return_rank_only_object(tmp)


def test_return_value_the_parent_cannot_unpickle(tmp_path):
    with pytest.raises(mplaunch.WorkerError) as info:
        mplaunch.launch(return_what_the_parent_cannot_load, (str(tmp_path),), 2,
                        grace_period=GRACE)
    err = info.value
    assert type(err) is mplaunch.WorkerError
    assert err.rank == 1 and isinstance(err.pid, int)
    assert "could not unpickle rank 1's return value" in str(err)
    assert "rank_only_results" in str(err)
