"""What a failure prints, front-end by front-end: the rank's traceback (relayed on
stderr, and the error's ``__cause__``) starts at the user's code, with none of
mplaunch's frames above it, as pytest leaves out its own; the user's frames and the
exception's cause chain are all there; the error raised here shows one frame of
mplaunch's, the public call the user made."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import traceback

import pytest

import mplaunch

PKG = os.path.dirname(os.path.abspath(mplaunch.__file__)) + os.sep
FILE_LINE = re.compile(r'^\s*File "([^"]+)", line \d+, in (\S+)', re.M)


def _fail_in_rank_1(scale=1):
    if os.environ["RANK"] == "1":
        _divide(0)
    return scale


def _divide(x):
    try:
        return 1 / x
    except ZeroDivisionError as exc:
        raise ValueError("bad x") from exc


def _spawned(i):
    _fail_in_rank_1()


def _blocks(text):
    """The frames (file, function) of each 'Traceback (most recent call last):' block."""
    parts = text.split("Traceback (most recent call last):")[1:]
    return [FILE_LINE.findall(part.split("\nThe above exception")[0]) for part in parts]


def _ours(path):
    return path.startswith(PKG) or "/mplaunch/_" in path


def _assert_users_frames_first(text, entries=()):
    """Every block starts with a frame of the user's; mplaunch's frames appear only as
    the last frame of a block, and only the public calls named in `entries`."""
    blocks = _blocks(text)
    assert blocks, text
    for frames in blocks:
        assert frames and not _ours(frames[0][0]), (frames, text)
        ours = [name for path, name in frames if _ours(path)]
        assert ours in ([], [n for n in entries if n in ours][:1]), (frames, text)
        if ours:
            assert _ours(frames[-1][0]) and len(ours) == 1, (frames, text)


def _assert_chain(printed):
    assert "ZeroDivisionError: division by zero" in printed
    assert "The above exception was the direct cause of the following exception" in printed
    assert "ValueError: bad x" in printed
    assert printed.index("ZeroDivisionError") < printed.index("ValueError: bad x")


def _relayed(err_text, rank=1):
    prefix = f"[rank{rank}]: "
    return "\n".join(line[len(prefix):] for line in err_text.splitlines()
                     if line.startswith(prefix))


@pytest.mark.parametrize("front", ["launch", "world", "spawn", "start"])
def test_a_failure_prints_the_users_frames_first(front, capfd):
    with pytest.raises(mplaunch.WorkerError) as info:
        if front == "launch":
            mplaunch.launch(_fail_in_rank_1, nprocs=2)
        elif front == "world":
            with mplaunch.World(nprocs=2) as world:
                world.run(_fail_in_rank_1)
        elif front == "spawn":
            mplaunch.spawn(_spawned, nprocs=2)   # through mplaunch's with_local_rank
        else:
            mplaunch.start(_fail_in_rank_1, nprocs=2).result()   # a monitor thread's
    err = info.value
    relayed = _relayed(capfd.readouterr().err)
    _assert_chain(relayed)
    _assert_users_frames_first(relayed)
    assert PKG not in relayed and PKG not in err.traceback

    # The exception as Python prints it: the rank's, then the error with its cause.
    cause = err.__cause__
    assert type(cause) is ValueError and type(cause.__cause__) is ZeroDivisionError
    printed = "".join(traceback.format_exception(type(err), err, err.__traceback__))
    _assert_chain(printed)
    assert "\nmplaunch.WorkerError: rank 1 " in printed
    _assert_users_frames_first(printed, entries=("launch", "run", "spawn", "result"))
    frames = [name for _, name in FILE_LINE.findall(printed)]
    assert "_divide" in frames and "_fail_in_rank_1" in frames
    assert "results_or_raise" not in frames and "drive" not in frames  # the engine's


def test_the_watcher_relays_the_scripts_frames_only(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        import os

        def divide(x):
            try:
                return 1 / x
            except ZeroDivisionError as exc:
                raise ValueError("bad x") from exc

        if os.environ["RANK"] == "1":
            divide(0)
    """))
    proc = subprocess.run([sys.executable, "-m", "mplaunch", "--nprocs", "2", str(script)],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr
    relayed = _relayed(proc.stderr)
    _assert_chain(relayed)
    _assert_users_frames_first(relayed)
    assert "runpy" not in relayed and PKG not in relayed, relayed
    assert FILE_LINE.findall(relayed)[-1][1] == "divide"


PLUGIN_TESTS = """
    import pytest

    def divide(x):
        try:
            return 1 / x
        except ZeroDivisionError as exc:
            raise ValueError("bad x") from exc

    @pytest.mark.mplaunch(nprocs=2)
    def test_launched():
        import os
        if os.environ["RANK"] == "1":
            divide(0)

    @pytest.mark.mplaunch(nprocs=2, reuse=True)
    def test_reused():
        import os
        if os.environ["RANK"] == "1":
            divide(0)
"""


def test_a_failing_plugin_test_shows_no_frame_of_mplaunch(pytester):
    pytester.makeini("[pytest]\naddopts = -p no:cacheprovider\nfilterwarnings = error\n")
    pytester.makepyfile(test_fails=textwrap.dedent(PLUGIN_TESTS))
    result = pytester.runpytest_subprocess("-rA", timeout=150)
    result.assert_outcomes(failed=2)
    out = result.stdout.str()
    assert out.count("ValueError: bad x") >= 2 and "ZeroDivisionError" in out
    assert out.count("[rank1]:   File ") >= 4   # the relayed tracebacks, captured
    for test in ("test_launched", "test_reused"):
        section = out.split(f"_ {test} _")[1].split("\n___")[0].split("= short test")[0]
        _assert_chain(_relayed(section))
        _assert_users_frames_first(_relayed(section))
        assert f"in {test}" in section
    assert PKG not in out and "pytest_rank" not in out and "_run_in_rank" not in out, out
