"""What a failure report says: the worker's frames at their failing lines under every
Python, where a rank failed in one line, where each rank waited at a timeout, and a hint
for functions written for torch.multiprocessing.spawn.

The tests marked no_torch run in .ci/run under every Python that setup.cfg claims."""
from __future__ import annotations

import os
import pickle
import subprocess
import sys
import textwrap
import traceback

import cloudpickle
import pytest

import mplaunch
from mplaunch._wire import exceptions as _exceptions
from timeout_ranks import sleep_forever

no_torch = pytest.mark.no_torch


def _run_child(tmp_path, source: str, name: str = "child.py") -> bytes:
    """Run `source` as a script in a fresh interpreter and return its stdout."""
    path = tmp_path / name
    path.write_text(textwrap.dedent(source))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.path.dirname(os.path.dirname(mplaunch.__file__))] + sys.path))
    proc = subprocess.run([sys.executable, str(path)], capture_output=True, env=env,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr.decode()
    return proc.stdout


# -- item: rebuilt frames point at the failing line, under every Python ----------------

# The failing lines sit far below their `def` lines (one more than 127 lines below:
# before 3.10 a line table entry moves at most 127 lines).
_CHAINED = '''
import pickle
import sys

from mplaunch._wire.exceptions import pack_exception


def inner(x):
    y = x + 1
    # a comment
    raise ValueError("inner %d" % y)
''' + "\n" * 130 + '''

def middle(x):
    a = 1
    try:
        inner(x)
    except ValueError as e:
        b = 2
        raise RuntimeError("middle") from e


def train(step):
    c = 3
    try:
        middle(step)
    except RuntimeError:
        d = 4
        {}["missing key"]


try:
    train(3)
except Exception as exc:
    sys.stdout.buffer.write(pickle.dumps(pack_exception(exc)))
'''


def _line_of(source: str, text: str) -> int:
    """The number of the (only) line of `source` that starts with `text`."""
    found = [i for i, line in enumerate(source.splitlines(), 1)
             if line.strip().startswith(text)]
    assert len(found) == 1, (text, found)
    return found[0]


@no_torch
def test_rebuilt_traceback_reads_as_the_worker_printed_it(tmp_path):
    packed = pickle.loads(_run_child(tmp_path, _CHAINED))
    exc = _exceptions.unpack_exception(*packed)
    assert type(exc) is KeyError and type(exc.__context__) is RuntimeError
    assert type(exc.__context__.__cause__) is ValueError
    shown = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    # every frame of every exception of the chain: the right line, and its source text
    for func, text in [("inner", 'raise ValueError("inner %d" % y)'),
                       ("middle", "inner(x)"),
                       ("middle", 'raise RuntimeError("middle") from e'),
                       ("train", "middle(step)"),
                       ("train", '{}["missing key"]'),
                       ("<module>", "train(3)")]:
        line = _line_of(_CHAINED, text)
        frame = f'  File "{tmp_path / "child.py"}", line {line}, in {func}\n    {text}\n'
        assert frame in shown, shown
    # and the whole report, the same as the worker's own
    assert shown == packed[3]


@no_torch
def test_rebuilt_frames_report_their_lines_to_tools(tmp_path):
    exc = _exceptions.unpack_exception(*pickle.loads(_run_child(tmp_path, _CHAINED)))
    tb = exc.__context__.__cause__.__traceback__
    frames = traceback.extract_tb(tb)
    assert [(f.name, f.lineno, f.line) for f in frames] == [
        ("middle", _line_of(_CHAINED, "inner(x)"), "inner(x)"),
        ("inner", _line_of(_CHAINED, "raise ValueError"), 'raise ValueError("inner %d" % y)')]
    # the code objects still start at their functions' def, as a debugger expects
    assert tb.tb_frame.f_code.co_firstlineno == _line_of(_CHAINED, "def middle")
    assert tb.tb_next.tb_frame.f_code.co_firstlineno == _line_of(_CHAINED, "def inner")


# -- item: str(WorkerError) says where it failed ---------------------------------------

def _tb_text(*frames, exc="ValueError: boom"):
    lines = ["Traceback (most recent call last):"]
    for file, line, func in frames:
        lines += [f'  File "{file}", line {line}, in {func}', "    something()"]
    return "\n".join(lines + [exc, ""])


LIB = os.path.dirname(os.__file__)  # the standard library: not the user's code


@no_torch
def test_location_is_the_innermost_frame_of_the_users_code(tmp_path):
    text = _tb_text(("/work/train.py", 20, "<module>"), ("/work/train.py", 7, "train"),
                    (f"{LIB}/json/decoder.py", 337, "decode"))
    f = mplaunch.RankFailure(1, 4242, 1, exc_type="ValueError", message="boom",
                             traceback=text, hostname="vm")
    assert f.location == "/work/train.py:7 in train"
    assert f.describe() == ("rank 1 (pid 4242 on vm) raised ValueError: boom "
                            "(at /work/train.py:7 in train)")
    err = mplaunch.WorkerError([f])
    assert str(err) == f.describe()
    for dumps in (pickle.dumps, cloudpickle.dumps):
        again = pickle.loads(dumps(err))
        assert str(again) == str(err) and again.first.location == f.location


@no_torch
def test_location_reads_the_last_exception_of_a_chain():
    text = (_tb_text(("/w/a.py", 3, "first"), exc="KeyError: 'k'")
            + "\nDuring handling of the above exception, another exception occurred:\n\n"
            + _tb_text(("/w/a.py", 9, "handler")))
    assert mplaunch.RankFailure(0, exc_type="ValueError", traceback=text).location == \
        "/w/a.py:9 in handler"


@no_torch
def test_location_falls_back_to_the_innermost_frame_and_to_nothing():
    only_lib = _tb_text((f"{LIB}/a.py", 1, "f"), (f"{LIB}/b.py", 2, "g"))
    assert mplaunch.RankFailure(0, exc_type="E", traceback=only_lib).location == \
        f"{LIB}/b.py:2 in g"
    no_frames = "ValueError: boom\n"  # raised by the call itself: no frame of the user's
    f = mplaunch.RankFailure(0, 9, 1, exc_type="ValueError", message="boom",
                             traceback=no_frames)
    assert f.location is None and f.describe() == "rank 0 (pid 9) raised ValueError: boom"


@no_torch
def test_location_is_relative_to_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    text = _tb_text((str(tmp_path / "pkg" / "train.py"), 7, "train"))
    assert mplaunch.RankFailure(0, exc_type="E", traceback=text).location == \
        f"pkg{os.sep}train.py:7 in train"


@no_torch
def test_system_exit_names_its_exit_code_and_a_long_message_stays_below():
    f = mplaunch.RankFailure(1, 10, 3, exc_type="SystemExit", message="3",
                             traceback=_tb_text(("/w/t.py", 9, "main"), exc="SystemExit: 3"))
    assert f.describe() == "rank 1 (pid 10) raised SystemExit: 3 (exit code 3, at /w/t.py:9 in main)"
    long = mplaunch.RankFailure(1, 10, 1, exc_type="RuntimeError",
                                message="first line\nsecond line\nthird line",
                                traceback=_tb_text(("/w/t.py", 4, "step")))
    assert long.describe() == "rank 1 (pid 10) raised RuntimeError: first line (at /w/t.py:4 in step)"
    lines = str(mplaunch.WorkerError([long, f])).splitlines()
    assert lines[0] == long.describe()
    assert lines[1:3] == ["second line", "third line"]
    assert lines[3].startswith("1 more rank(s) failed after it: rank 1 (pid 10) raised "
                          "SystemExit: 3 (exit code 3")


# -- item: LaunchTimeout.stacks is the readable text ------------------------------------

_DUMPER = '''
import faulthandler
import sys

from mplaunch._wire.exceptions import _rebuild_exception


def waits_here():
    faulthandler.dump_traceback(sys.stdout, all_threads=True)
    return Exception()


def step():
    # called through one of mplaunch's own functions, whose frame must not show
    _rebuild_exception(waits_here, (), None, None, None, None, False, None)


step()
'''


@no_torch
def test_launch_timeout_stacks_are_the_readable_text_of_the_message(tmp_path):
    raw = _run_child(tmp_path, _DUMPER).decode()
    assert "mplaunch/_wire/exceptions.py" in raw  # a real dump, with one of mplaunch's frames in it
    failure = mplaunch.RankFailure(0, message="was still running after 2 s")
    err = mplaunch.LaunchTimeout([failure], 2.0, {0: raw, 1: ""})
    assert err.raw_stacks == {0: raw, 1: ""}
    stack = err.stacks[0]
    assert "exceptions.py" not in stack and "Current thread" not in stack
    child = tmp_path / "child.py"
    assert stack.splitlines() == [
        f'  File "{child}", line {_line_of(_DUMPER, "step()")}, in <module>', "    step()",
        f'  File "{child}", line {_line_of(_DUMPER, "_rebuild_exception(w")}, in step',
        "    _rebuild_exception(waits_here, (), None, None, None, None, False, None)",
        f'  File "{child}", line {_line_of(_DUMPER, "faulthandler.dump")}, in waits_here',
        "    faulthandler.dump_traceback(sys.stdout, all_threads=True)"]
    assert "no stack arrived" in err.stacks[1]
    text = str(err)
    assert text.splitlines()[0] == "launch timed out after 2 s; 2 rank(s) still running: [0, 1]"
    assert "rank 0:\n" + textwrap.indent(stack, "  ") in text
    for dumps in (pickle.dumps, cloudpickle.dumps):
        again = pickle.loads(dumps(err))
        assert (again.stacks, again.raw_stacks, str(again)) == (err.stacks, err.raw_stacks,
                                                                text)


# -- with real ranks (these need torch) ------------------------------------------------

def _fails_deep(step):
    value = step * 2
    if value:
        raise ValueError(f"boom-{value}")


def fails_in_user_code(step):
    total = 0
    _fails_deep(step)
    return total


def test_worker_error_names_where_the_rank_failed():
    with pytest.raises(mplaunch.WorkerError) as info:
        mplaunch.launch(fails_in_user_code, (21,), 2, grace_period=1)
    err = info.value
    line = _fails_deep.__code__.co_firstlineno + 3
    first = str(err).splitlines()[0]
    assert first.startswith(f"rank {err.rank} (pid {err.pid}")
    assert "raised ValueError: boom-42 (at " in first, first
    assert first.endswith(f"test_reports.py:{line} in _fails_deep)"), first
    # and the cause's frames are at their failing lines, with their source text
    frames = traceback.extract_tb(err.__cause__.__traceback__)
    assert [(f.name, f.lineno, f.line) for f in frames] == [
        ("fails_in_user_code", fails_in_user_code.__code__.co_firstlineno + 2,
         "_fails_deep(step)"),
        ("_fails_deep", line, 'raise ValueError(f"boom-{value}")')]


def exits_3():
    import os
    import sys
    if os.environ["RANK"] == "1":
        sys.exit(3)


def test_worker_error_names_the_exit_code_of_sys_exit():
    with pytest.raises(mplaunch.WorkerError) as info:
        mplaunch.launch(exits_3, nprocs=2, grace_period=1)
    first = str(info.value).splitlines()[0]
    line = exits_3.__code__.co_firstlineno + 4
    assert "raised SystemExit: 3 (exit code 3, at " in first, first
    assert first.endswith(f":{line} in exits_3)"), first


def written_for_spawn(rank, world_size):
    return rank, world_size


def calls_a_helper_wrongly():
    written_for_spawn(0)


SPAWN_HINT = "mplaunch passes no rank argument"


def test_function_written_for_spawn_gets_a_hint():
    with pytest.raises(mplaunch.WorkerError) as info:
        mplaunch.launch(written_for_spawn, (2,), 2, grace_period=1)
    err = info.value
    assert isinstance(err.__cause__, TypeError)
    lines = str(err).splitlines()
    assert "missing 1 required positional argument" in lines[0]
    assert SPAWN_HINT in lines[1] and "RANK" in lines[1] and "get_rank()" in lines[1]
    assert any(SPAWN_HINT in n for n in err.__cause__.__notes__)
    assert str(err.__cause__) == \
        "written_for_spawn() missing 1 required positional argument: 'world_size'"


def test_a_type_error_inside_the_function_gets_no_hint():
    with pytest.raises(mplaunch.WorkerError) as info:
        mplaunch.launch(calls_a_helper_wrongly, nprocs=1)
    err = info.value
    assert "missing 1 required positional argument" in str(err)
    assert SPAWN_HINT not in str(err)
    assert not getattr(err.__cause__, "__notes__", None)


def test_real_launch_timeout_stacks_match_the_message():
    with pytest.raises(mplaunch.LaunchTimeout) as info:
        mplaunch.launch(sleep_forever, nprocs=2, timeout=3, grace_period=1)
    err = info.value
    assert sorted(err.stacks) == sorted(err.raw_stacks) == [0, 1]
    text = str(err)
    for rank in (0, 1):
        assert "Current thread" in err.raw_stacks[rank]
        stack = err.stacks[rank]
        assert "time.sleep(600)" in stack and "mplaunch" + os.sep not in stack
    # the same place: shown once, under both ranks
    assert err.stacks[0] == err.stacks[1]
    assert text.count("time.sleep(600)") == 1
    assert "ranks 0, 1:\n" + textwrap.indent(err.stacks[0], "  ") in text
