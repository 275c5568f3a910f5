"""The rank's standard streams, end to end: nothing a rank wrote is lost when it dies
hard, one rank can read the terminal (breakpoint(), input()), ranks see a terminal when
the launching process has one, and progress bars of several ranks stay readable.

Terminal behaviour is tested through a real pseudo-terminal: a script that launches is
run with a pty as its stdin, stdout and stderr, and what it draws is read back from the
pty's master side.
"""
import ctypes
import os
import re
import select
import signal
import subprocess
import sys
import textwrap
import time

import pytest

import mplaunch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


# -- nothing lost before a hard exit ----------------------------------------------------

def partial_then_os_exit():
    print("partial", end="")
    sys.stderr.write("err")
    os._exit(3)


@pytest.mark.parametrize("method", ["forkserver", "spawn", "fork"])
def test_partial_lines_before_os_exit_reach_relay_logs_and_tail(capsys, tmp_path, method):
    with pytest.raises(mplaunch.WorkerError) as info:
        mplaunch.launch(partial_then_os_exit, start_method=method, log_dir=tmp_path)
    assert info.value.exitcode == 3
    out, err = capsys.readouterr()
    assert out == "[rank0]: partial\n"
    assert err == "[rank0]: err\n"
    assert info.value.stderr_tail == "err"
    logs = tmp_path / "attempt_0" / "0"
    assert (logs / "stdout.log").read_bytes() == b"partial"
    assert (logs / "stderr.log").read_bytes() == b"err"


def partial_then_segfault():
    print("before", "the", "crash", end="")
    sys.stderr.write("stderr before the crash")
    ctypes.string_at(0)


def test_partial_lines_before_a_segfault_are_relayed(capsys):
    with pytest.raises(mplaunch.WorkerError) as info:
        mplaunch.launch(partial_then_segfault)
    assert info.value.signal == "SIGSEGV"
    out, err = capsys.readouterr()
    assert out == "[rank0]: before the crash\n"
    # faulthandler's report follows on the same line: that is where the rank left it.
    assert "[rank0]: stderr before the crashFatal Python error: Segmentation fault" in err
    assert "stderr before the crash" in info.value.stderr_tail


class BadStr:
    def __str__(self):
        raise ValueError("no str")


def print_every_way():
    print()
    print("a", 1, 2.5, None, sep="-", end="|\n")
    print("to", "stderr", file=sys.stderr)
    print("x", sep=None, end=None, flush=True)
    try:
        print("before", "bad", BadStr(), "never")
    except ValueError:
        print("<raised")
    import io
    buf = io.StringIO()
    print("into", "a buffer", file=buf)
    print(buf.getvalue(), end="")
    print("no newline", end="")
    os._exit(0)


def test_print_writes_what_the_builtin_writes(capsys):
    with pytest.raises(mplaunch.WorkerError):
        mplaunch.launch(print_every_way)
    out, err = capsys.readouterr()
    assert out == ("[rank0]: \n[rank0]: a-1-2.5-None|\n[rank0]: x\n"
                   "[rank0]: before bad <raised\n[rank0]: into a buffer\n"
                   "[rank0]: no newline\n")
    assert err.startswith("[rank0]: to stderr\n")
