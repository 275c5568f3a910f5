"""mplaunch's error types: they pickle (an error may have to cross a process boundary
again: out of a pytest-xdist worker, out of a rank of an outer launch), they read well,
and they are what the public module says they are."""
from __future__ import annotations

import errno
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
import traceback

import cloudpickle
import pytest

import mplaunch
from mplaunch._wire import exceptions as _exceptions
from mplaunch.errors import signal_name
from timeout_ranks import sleep_forever

# Nothing here needs torch but the launches, which skip without it: these run under
# every Python that setup.cfg claims (.ci/other-pythons.sh).
pytestmark = pytest.mark.no_torch

PUBLIC = {
    "launch", "start", "spawn", "SpawnContext", "Handle", "World", "rank_state",
    "WorkerError", "MainProcessError", "LaunchTimeout", "RankFailure",
    "RemoteException", "MPLaunchError", "StragglerReport", "__version__",
}
ERROR_TYPES = [mplaunch.WorkerError, mplaunch.LaunchTimeout, mplaunch.MainProcessError,
               mplaunch.RankFailure, mplaunch.RemoteException, mplaunch.MPLaunchError]

FIELDS = ("rank", "worker_id", "pid", "exitcode", "signal", "traceback", "stderr_tail",
          "exc_type", "failures", "previous_attempts", "note")


def _failure(rank=1, **kw):
    base = dict(pid=4242, exitcode=1, exc_type="ValueError", message="boom",
                traceback="Traceback (most recent call last):\n  ...\nValueError: boom\n",
                stderr_tail="some warning\nanother line", attempt=0, timestamp=1.5e9,
                hostname="node7")
    base.update(kw)
    return mplaunch.RankFailure(rank, **base)


def _examples():
    segv = _failure(0, pid=99, exitcode=-11, signal="SIGSEGV", exc_type=None,
                    message=None, traceback=None, stderr_tail="Fatal Python error: ...")
    earlier = [_failure(1, attempt=0, pid=7), _failure(0, attempt=0, pid=8, exitcode=3,
                                                       exc_type=None, message=None)]
    return {
        "worker_error": mplaunch.WorkerError([_failure(1), segv]),
        "worker_error_restarts": mplaunch.WorkerError(
            [_failure(1, attempt=1)], previous_attempts=[earlier]),
        "worker_error_note": mplaunch.WorkerError([segv], note="(while saving)"),
        "timeout": mplaunch.LaunchTimeout(
            [_failure(0, exc_type=None, message="was still running after 2 s",
                      exitcode=None, pid=None)],
            2.0, {0: 'File "x.py", line 3 in f\n', 1: 'File "y.py", line 4 in g\n'},
            "rank 0 is in f (x.py:3)\nrank 1 is in g (y.py:4)"),
        "main_process_error": mplaunch.MainProcessError(signal.SIGINT, 4),
        "main_process_error_no_nprocs": mplaunch.MainProcessError(signal.SIGTERM),
        "remote_exception": mplaunch.RemoteException(
            "pkg.mod.CustomError", "it broke", "Traceback ...\npkg.mod.CustomError: it broke\n"),
        "remote_exception_no_tb": mplaunch.RemoteException("Weird", ""),
        "rank_failure": _failure(3, signal="SIGKILL", exitcode=-9, exc_type=None),
    }


def _fields(obj):
    names = [n for n in FIELDS + ("timeout", "stacks", "summary", "signal_no",
                                  "signal_name", "nprocs", "type_name", "message",
                                  "args") if hasattr(obj, n)]
    if isinstance(obj, mplaunch.RankFailure):
        names = list(mplaunch.RankFailure.__slots__)
    return {n: getattr(obj, n) for n in names}


EXAMPLES = _examples()


@pytest.mark.parametrize("dumps", [pickle.dumps, cloudpickle.dumps],
                         ids=["pickle", "cloudpickle"])
@pytest.mark.parametrize("name", list(EXAMPLES))
def test_round_trip(name, dumps):
    err = EXAMPLES[name]
    again = pickle.loads(dumps(err))
    assert type(again) is type(err)
    assert _fields(again) == _fields(err)
    assert str(again) == str(err)
    assert repr(again) == repr(err)


@pytest.mark.parametrize("name", list(EXAMPLES))
def test_str_has_a_one_line_summary_first(name):
    text = str(EXAMPLES[name])
    first = text.splitlines()[0]
    assert first.strip() == first and first, text
    assert len(first) < 200, first
    assert "\n\n\n" not in text and not text.endswith("\n")


def test_worker_error_message():
    err = EXAMPLES["worker_error"]
    lines = str(err).splitlines()
    assert lines[0] == "rank 1 (pid 4242 on node7) raised ValueError: boom"
    assert lines[1] == ("1 more rank(s) failed after it: rank 0 (pid 99 on node7) was "
                        "killed by SIGSEGV (exit code -11)")
    assert "some warning" in str(err) and "stderr" in str(err)
    assert err.first is err.failures[0]
    assert (err.rank, err.worker_id, err.pid, err.exitcode, err.signal) == \
        (1, 1, 4242, 1, None)

    restarted = EXAMPLES["worker_error_restarts"]
    assert "[attempt 1]" in str(restarted).splitlines()[0]
    assert "earlier attempt 0" in str(restarted)
    assert str(EXAMPLES["worker_error_note"]).splitlines()[0].endswith("(while saving)")


def test_describe_each_kind_of_failure():
    R = mplaunch.RankFailure
    assert R(2, 10, 7).describe() == "rank 2 (pid 10) exited with code 7"
    assert R(2, 10, -9, "SIGKILL").describe() == \
        "rank 2 (pid 10) was killed by SIGKILL (exit code -9)"
    assert R(0, None, 1, message="could not start: fork failed").describe() == \
        "rank 0 could not start: fork failed"
    assert R(1, 3, 1, exc_type="KeyError", message="'k'").describe() == \
        "rank 1 (pid 3) raised KeyError: 'k'"
    assert str(R(1, 3, 1, exc_type="KeyError")) == "rank 1 (pid 3) raised KeyError"
    assert R(1, local_rank=0).local_rank == 0 and R(5).local_rank == 5


def test_worker_error_needs_a_failure():
    with pytest.raises(ValueError, match="at least one"):
        mplaunch.WorkerError([])


def test_many_failures_are_summarised_not_listed():
    err = mplaunch.WorkerError([_failure(r) for r in range(20)])
    second = str(err).splitlines()[1]
    assert second.startswith("19 more rank(s) failed after it:") and second.endswith("...")
    assert "rank 19" not in second


def test_launch_timeout_is_a_timeout_and_a_worker_error():
    err = EXAMPLES["timeout"]
    assert isinstance(err, TimeoutError) and isinstance(err, mplaunch.WorkerError)
    assert isinstance(err, mplaunch.MPLaunchError)
    with pytest.raises(TimeoutError):
        raise err
    lines = str(err).splitlines()
    assert lines[0] == "launch timed out after 2 s; 2 rank(s) still running: [0, 1]"
    assert lines[1:] == ["rank 0 is in f (x.py:3)", "rank 1 is in g (y.py:4)"]
    assert err.stacks[1].startswith('File "y.py"') and err.timeout == 2.0


def test_main_process_error():
    err = EXAMPLES["main_process_error"]
    assert err.signal_no == signal.SIGINT and err.signal_name == "SIGINT"
    assert str(err) == ("the launching process received SIGINT; all 4 ranks were sent "
                        "SIGINT and torn down")
    assert isinstance(err, mplaunch.MPLaunchError)
    assert not isinstance(err, mplaunch.WorkerError)
    assert "the ranks were" in str(EXAMPLES["main_process_error_no_nprocs"])


def test_remote_exception():
    err = EXAMPLES["remote_exception"]
    assert str(err).splitlines()[0] == "pkg.mod.CustomError: it broke"
    assert "Worker traceback:" in str(err)
    assert str(EXAMPLES["remote_exception_no_tb"]) == "Weird"
    assert isinstance(err, Exception) and not isinstance(err, mplaunch.MPLaunchError)


def test_signal_name():
    assert signal_name(None) is None
    assert signal_name(11) == "SIGSEGV"
    assert signal_name(200) == "signal 200"


@pytest.mark.parametrize("cls", ERROR_TYPES, ids=lambda c: c.__name__)
def test_public_module_and_name(cls):
    assert cls.__module__ == "mplaunch"
    assert getattr(mplaunch, cls.__name__) is cls
    assert repr(cls) == f"<class 'mplaunch.{cls.__name__}'>"


def test_exports():
    assert set(mplaunch.__all__) == PUBLIC
    assert len(mplaunch.__all__) == len(PUBLIC)  # no duplicates
    for name in mplaunch.__all__:
        obj = getattr(mplaunch, name)
        if name == "__version__":
            assert isinstance(obj, str) and obj[0].isdigit()
            continue
        own_doc = vars(obj).get("__doc__") if isinstance(obj, type) else obj.__doc__
        assert own_doc and own_doc.strip(), f"mplaunch.{name} has no docstring"
    from mplaunch import errors
    assert set(errors.__all__) == {c.__name__ for c in ERROR_TYPES}
    # `from mplaunch import *` gives exactly the public names.
    ns: dict = {}
    exec("from mplaunch import *", ns)
    assert set(ns) - {"__builtins__"} == PUBLIC


def test_worker_error_with_cause_crosses_a_process_again():
    """An error a rank raises may itself be a WorkerError (a nested launch): it arrives
    with its fields and its own cause, traceback frames included."""
    try:
        try:
            raise KeyError("deep")
        except KeyError as exc:
            raise mplaunch.WorkerError([_failure(1)]) from exc
    except mplaunch.WorkerError as exc:
        blob, type_name, message, tb = _exceptions.pack_exception(exc)
    assert blob is not None and type_name == "mplaunch.WorkerError"
    again = _exceptions.unpack_exception(blob, type_name, message, tb)
    assert type(again) is mplaunch.WorkerError
    assert again.failures == [_failure(1)] and str(again) == message
    assert type(again.__cause__) is KeyError and again.__cause__.args == ("deep",)
    assert again.__traceback__ is not None


def test_exception_pickling_leaves_the_process_alone():
    """Packing an exception must not change how this process pickles exceptions from
    then on (registering picklers in copyreg would: SystemExit.code would come back
    None for every later pickle.dumps in the user's program)."""
    import copyreg
    before = dict(copyreg.dispatch_table)
    try:
        raise SystemExit(3)
    except SystemExit as exc:
        again = _exceptions.unpack_exception(*_exceptions.pack_exception(exc))
    assert again.code == 3 and again.__traceback__ is not None
    assert copyreg.dispatch_table == before
    assert pickle.loads(pickle.dumps(SystemExit(3))).code == 3


# -- real errors from real launches ------------------------------------------------------

def fail_in_rank_one():
    if os.environ["RANK"] == "1":
        print("about to fail", file=sys.stderr, flush=True)
        raise ValueError("real failure")
    time.sleep(60)


def _assert_same(err, again):
    assert type(again) is type(err)
    for name in FIELDS:
        assert getattr(again, name) == getattr(err, name), name
    assert str(again) == str(err)


@pytest.mark.parametrize("dumps", [pickle.dumps, cloudpickle.dumps],
                         ids=["pickle", "cloudpickle"])
def test_real_worker_error_round_trips(dumps):
    pytest.importorskip("torch")  # launches ranks
    with pytest.raises(mplaunch.WorkerError) as info:
        mplaunch.launch(fail_in_rank_one, nprocs=2, grace_period=1)
    err = info.value
    assert err.rank == 1 and "real failure" in err.traceback
    assert "about to fail" in err.stderr_tail
    _assert_same(err, pickle.loads(dumps(err)))


def test_real_worker_error_unpickles_in_another_interpreter():
    pytest.importorskip("torch")  # launches ranks
    """By reference to the public module: a process that has only imported nothing
    more than `pickle` can rebuild it."""
    with pytest.raises(mplaunch.WorkerError) as info:
        mplaunch.launch(fail_in_rank_one, nprocs=2, grace_period=1)
    err = info.value
    code = ("import pickle, sys; e = pickle.loads(sys.stdin.buffer.read()); "
            "print(type(e).__module__, type(e).__name__, e.rank, e.pid, e.exitcode); "
            "print(str(e).splitlines()[0])")
    out = subprocess.run([sys.executable, "-c", code], input=pickle.dumps(err),
                         capture_output=True, check=True, timeout=120).stdout.decode()
    assert out.splitlines() == [f"mplaunch WorkerError 1 {err.pid} 1",
                                str(err).splitlines()[0]]


def test_real_launch_timeout_round_trips():
    pytest.importorskip("torch")  # launches ranks
    with pytest.raises(mplaunch.LaunchTimeout) as info:
        mplaunch.launch(sleep_forever, nprocs=2, timeout=2.0, grace_period=1)
    err = info.value
    assert isinstance(err, TimeoutError)
    assert sorted(err.stacks) == [0, 1]
    # Where each rank is depends on how far it got (on a slow machine, maybe still
    # importing this module); that it is a Python stack does not.
    assert all('File "' in s for s in err.stacks.values()), err.stacks
    for dumps in (pickle.dumps, cloudpickle.dumps):
        again = pickle.loads(dumps(err))
        _assert_same(err, again)
        assert (again.timeout, again.stacks, again.summary) == \
            (err.timeout, err.stacks, err.summary)


# -- exceptions of every shape cross the process boundary -------------------------------

class PrefixError(Exception):
    def __init__(self, msg="default"):
        super().__init__(f"prefix: {msg}")


class KeywordOnlyError(Exception):
    def __init__(self, *, code):
        super().__init__(f"code {code}")
        self.code = code


def _raised(exc):
    try:
        raise exc
    except BaseException as caught:  # noqa: BLE001
        return caught


def _cross(exc):
    return _exceptions.unpack_exception(*_exceptions.pack_exception(exc))


def test_exception_shapes_round_trip():
    again = _cross(_raised(PrefixError("x")))
    assert type(again) is PrefixError and str(again) == "prefix: x"

    again = _cross(_raised(KeywordOnlyError(code=5)))
    assert type(again) is KeywordOnlyError and again.code == 5 and str(again) == "code 5"

    again = _cross(_raised(FileNotFoundError(errno.ENOENT, "No such file", "/nope")))
    assert type(again) is FileNotFoundError
    assert (again.errno, again.strerror, again.filename) == (errno.ENOENT, "No such file",
                                                             "/nope")

    again = _cross(_raised(KeyError("k")))
    assert type(again) is KeyError and str(again) == "'k'"

    exc = _raised(ValueError("noted"))
    exc.__notes__ = ["a note from the rank"]  # add_note() is new in 3.11
    assert _cross(exc).__notes__ == ["a note from the rank"]


@pytest.mark.skipif(sys.version_info < (3, 11), reason="ExceptionGroup is new in 3.11")
def test_exception_group_keeps_its_picklable_members():
    group = _raised(ExceptionGroup("two", [ValueError("fine"),
                                           _raised(UnpicklableError("locked"))]))
    again = _cross(group)
    assert type(again) is ExceptionGroup and again.message == "two"
    first, second = again.exceptions
    assert type(first) is ValueError and str(first) == "fine"
    assert type(second) is mplaunch.RemoteException
    assert second.type_name == "test_errors.UnpicklableError"
    assert second.message == "locked" and "UnpicklableError: locked" in second.traceback


class UnpicklableError(Exception):
    def __init__(self, msg):
        super().__init__(msg)
        self.lock = threading.Lock()


def test_pytest_outcomes_arrive_as_pytest_classes():
    """pytest declares Skipped and Failed to live in builtins; they must still arrive as
    pytest's own classes, so that `except pytest.skip.Exception` catches them."""
    for raise_it, cls in ((lambda: pytest.skip("s"), pytest.skip.Exception),
                          (lambda: pytest.fail("f"), pytest.fail.Exception),
                          (lambda: pytest.xfail("x"), pytest.xfail.Exception)):
        try:
            raise_it()
        except BaseException as exc:  # noqa: BLE001 - outcomes are BaseExceptions
            original, again = exc, _cross(exc)
        assert type(again) is cls and again.msg == original.msg


# -- tracebacks --------------------------------------------------------------------------

def _deep(n):
    if n == 0:
        values = {"a": 1}
        return values["a"] + values[
            "b"]  # a multi-line expression fails
    return _deep(n - 1)


def _hidden_helper():
    __tracebackhide__ = True
    raise LookupError("from a hidden frame")


def test_rebuilt_traceback_renders_as_the_original():
    try:
        try:
            _deep(3)
        except KeyError as exc:
            raise RuntimeError("wrapped") from exc
    except RuntimeError as exc:
        original = exc
    again = _cross(original)
    assert traceback.format_exception(type(again), again, again.__traceback__) == \
        traceback.format_exception(type(original), original, original.__traceback__)
    for a, b in zip(traceback.walk_tb(again.__cause__.__traceback__),
                    traceback.walk_tb(original.__cause__.__traceback__)):
        assert a[0].f_code.co_name == b[0].f_code.co_name
        # The function's own first line, not the failing one: IPython and inspect
        # number a function's source from it.
        assert a[0].f_code.co_firstlineno == b[0].f_code.co_firstlineno
        assert a[1] == b[1]


def test_deep_traceback_round_trips():
    def recurse(n):
        return recurse(n + 1)

    try:
        recurse(0)
    except RecursionError as exc:
        original = exc
    again = _cross(original)
    assert type(again) is RecursionError
    depth = len(list(traceback.walk_tb(original.__traceback__)))
    assert depth > 100
    assert len(list(traceback.walk_tb(again.__traceback__))) == depth


def test_pytest_hidden_frames_stay_hidden():
    try:
        _hidden_helper()
    except LookupError as exc:
        again = _cross(exc)
    frames = [f for f, _ in traceback.walk_tb(again.__traceback__)]
    assert frames[-1].f_code.co_name == "_hidden_helper"
    assert frames[-1].f_locals.get("__tracebackhide__") is True
    assert not frames[0].f_locals.get("__tracebackhide__")
