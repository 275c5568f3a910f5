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
import subprocess
import sys
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


# -- a real terminal --------------------------------------------------------------------

LAUNCHER = '''
import fcntl, os, sys, termios
if os.isatty(0):
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)  # our terminal, as in a shell: we are in front
sys.path.insert(0, {here!r})
import mplaunch, streams_ranks
print("RESULT", mplaunch.launch(getattr(streams_ranks, sys.argv[1]), nprocs=2,
                                start_method=sys.argv[2], **eval(sys.argv[3])), flush=True)
'''


class Pty:
    """A script run with a new pseudo-terminal as its stdin, stdout and stderr (and as
    its controlling terminal); what it writes is read from the master side."""

    def __init__(self, func, method="forkserver", kwargs="{}", columns=100, env=None):
        import struct
        import termios
        self.master, slave = os.openpty()
        fcntl_ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 30, columns, 0, 0))
        full_env = dict(os.environ, PYTHONPATH=ROOT)
        for name in ("PYTHONBREAKPOINT", "COLUMNS", "LINES", "NO_COLOR", "FORCE_COLOR"):
            full_env.pop(name, None)
        full_env.update(env or {})
        self.proc = subprocess.Popen(
            [sys.executable, "-c", LAUNCHER.format(here=HERE), func, method, kwargs],
            stdin=slave, stdout=slave, stderr=slave, start_new_session=True,
            env=full_env)
        os.close(slave)
        self.data = b""

    def read_until(self, pattern: bytes, timeout=30.0) -> bytes:
        deadline = time.monotonic() + timeout
        while pattern not in self.data:
            left = deadline - time.monotonic()
            assert left > 0, f"{pattern!r} never came; got {self.data!r}"
            ready, _, _ = select.select([self.master], [], [], left)
            if not ready:
                continue
            try:
                chunk = os.read(self.master, 65536)
            except OSError:  # EIO: every slave fd is closed
                chunk = b""
            assert chunk, f"{pattern!r} never came; got {self.data!r}"
            self.data += chunk
        return self.data

    def send(self, text: str) -> None:
        os.write(self.master, text.encode())

    def finish(self, timeout=30.0) -> str:
        """Everything the script writes until it exits (the pty's EOF)."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            assert left > 0, f"the script did not end; got {self.data!r}"
            ready, _, _ = select.select([self.master], [], [], left)
            if not ready:
                continue
            try:
                chunk = os.read(self.master, 65536)
            except OSError:  # EIO: every slave fd is closed
                break
            if not chunk:
                break
            self.data += chunk
        assert self.proc.wait(timeout) == 0, self.data
        os.close(self.master)
        return self.data.decode()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        try:
            os.close(self.master)
        except OSError:
            pass


def fcntl_ioctl(fd, request, arg):
    import fcntl
    return fcntl.ioctl(fd, request, arg)


@pytest.fixture
def pty_run():
    runs = []

    def start(*args, **kwargs):
        runs.append(Pty(*args, **kwargs))
        return runs[-1]

    yield start
    for run in runs:
        run.close()


def result_of(text: str):
    line = text[text.index("RESULT "):].splitlines()[0]
    return eval(line[len("RESULT "):])


@pytest.mark.parametrize("method", ["forkserver", "spawn", "fork"])
def test_rank_0_reads_the_terminal_and_its_prompt_shows_at_once(pty_run, method):
    run = pty_run("ask_name", method)
    # The prompt is shown before its line ends: that is where the user types.
    run.read_until(b"[rank0]: name? ")
    run.send("bob\n")
    text = run.finish()
    assert "[rank0]: name? bob\r\n" in text  # the terminal's echo, after the prompt
    assert "got 'bob'" in text
    assert result_of(text) == [("bob", True), ("", False)]


def test_breakpoint_in_every_rank_is_a_working_pdb_one_rank_at_a_time(pty_run):
    run = pty_run("stop_at_breakpoint")
    # Whichever rank reaches its breakpoint first holds the prompt (first come, first
    # served: on a loaded machine rank 1 may; test_debugging makes each come first);
    # the other stopped too: it waits, named, and its pdb shows nothing meanwhile.
    data = run.read_until(b" stopped at a breakpoint")
    b = int(re.search(rb"rank (\d) stopped at a breakpoint", data).group(1))
    a = 1 - b
    run.read_until(f"[rank{a}]: (Pdb) ".encode())
    run.send("p x * 2\n")
    run.read_until(f"[rank{a}]: {2 * (41 + a)}".encode())
    assert f"[rank{b}]: (Pdb)".encode() not in run.data
    run.send("c\n")
    run.read_until(f"[rank{b}]: (Pdb) ".encode())
    run.send("p x * 2\n")
    run.read_until(f"[rank{b}]: {2 * (41 + b)}".encode())
    run.send("c\n")
    text = run.finish()
    assert result_of(text) == [41, 42]
    assert "skipped" not in text


def breakpoint_without_terminal():
    breakpoint()
    return "went on"


def test_breakpoint_without_a_terminal_is_skipped_with_a_note(capfd):
    assert mplaunch.launch(breakpoint_without_terminal, nprocs=2) == ["went on"] * 2
    err = capfd.readouterr().err
    for r in (0, 1):
        assert (f"[rank{r}]: mplaunch: breakpoint() skipped in rank {r}: nobody can "
                "answer its prompt here" in err)


def test_stdin_rank_chooses_the_rank_that_reads_and_none_gives_none(pty_run):
    run = pty_run("who_reads", kwargs="dict(stdin_rank=1)")
    run.read_until(b"[rank1]: line? ")
    run.send("one\n")
    assert result_of(run.finish()) == [None, "one"]
    run = pty_run("who_reads", kwargs="dict(stdin_rank=None)")
    assert result_of(run.finish()) == [None, None]


def test_ranks_see_a_terminal_and_its_width_less_the_prefix(pty_run):
    run = pty_run("describe_streams", env={"FORCE_COLOR": "1", "TERM": "xterm-256color"},
                  columns=100)
    out = run.finish()
    width = str(100 - len("[rank0]: "))
    assert result_of(out) == [
        {"stdin": True, "stdout": True, "stderr": True, "fd1": False, "columns": width,
         "lines": "30", "FORCE_COLOR": "1", "NO_COLOR": None, "TERM": "xterm-256color"},
        {"stdin": False, "stdout": True, "stderr": True, "fd1": False, "columns": width,
         "lines": "30", "FORCE_COLOR": "1", "NO_COLOR": None, "TERM": "xterm-256color"}]


def _without_size(environ):
    # pytest-xdist's workers set COLUMNS; the launching process's own value would pass on.
    return {k: v for k, v in environ.items() if k not in ("COLUMNS", "LINES")}


def test_without_a_terminal_ranks_see_pipes_and_dev_null(tmp_path):
    # stdin closed altogether (as `<&-` leaves it): the launch neither fails nor waits.
    code = (LAUNCHER.format(here=HERE).replace("import fcntl", "os = __import__('os'); "
                                              "os.close(0); import fcntl"))
    proc = subprocess.run([sys.executable, "-c", code, "describe_streams", "forkserver",
                           "{}"], capture_output=True, text=True, timeout=60,
                          env=dict(_without_size(os.environ), PYTHONPATH=ROOT,
                                   NO_COLOR="1"))
    assert proc.returncode == 0, proc.stderr
    for r in result_of(proc.stdout):
        assert (r["stdin"], r["stdout"], r["stderr"]) == (False, False, False)
        assert r["NO_COLOR"] == "1"
        assert r["columns"] is None


def read_stdin():
    try:
        input("never answered? ")
    except EOFError as exc:
        eof = str(exc)
    # input() is mplaunch's (it asks the launching process), not one the rank inherited
    # from it (a kernel's, pytest's)
    return sys.stdin.isatty(), sys.stdin.read(), input.__module__, eof


def test_under_pytest_capture_ranks_read_eof_at_once():
    # pytest puts /dev/null on fd 0: nothing to read, and nobody waits; pytest without
    # --pdb answers no prompt.
    t0 = time.monotonic()
    eof = ("mplaunch: nobody can answer input() in this rank here (this process's stdin "
           "is not a terminal, or stdin_rank=None, or the notebook's frontend takes no "
           "input, or pytest ran without --pdb)")
    assert mplaunch.launch(read_stdin, nprocs=2) == [
        (False, "", "mplaunch._rank.debugging", eof)] * 2
    assert time.monotonic() - t0 < 30


# -- progress bars of several ranks -----------------------------------------------------

_CSI = re.compile(r"\x1b\[(\d*)([A-Za-z])")


def render(text: str):
    """A small terminal: returns (lines on the screen, frames), where a frame is
    (row, the row's text) each time a progress bar has been drawn."""
    lines, frames = [[]], []
    row = col = 0
    i = 0
    while i < len(text):
        m = _CSI.match(text, i)
        if m:
            if m.group(2) == "K":
                del lines[row][col:]
            i = m.end()
            continue
        c = text[i]
        if c == "\r":
            # A bar drawn: a \r that is not a line's end (\r\n, the pty's newline) or
            # the start of an erase just after a draw.
            if text[i + 1:i + 2] != "\n" and text[i - 1:i] != "\r":
                frames.append((row, "".join(lines[row])))
            col = 0
        elif c == "\n":
            row += 1
            col = 0
            if row == len(lines):
                lines.append([])
        else:
            line = lines[row]
            line.extend(" " * (col - len(line)))
            if col < len(line):
                line[col] = c
            else:
                line.append(c)
            col += 1
        i += 1
    return ["".join(line) for line in lines], frames


PREFIX = re.compile(r"\[rank(\d)\]: ")


def test_tqdm_in_a_rank_draws_when_the_launch_has_a_terminal(pty_run):
    pytest.importorskip("tqdm")
    text = pty_run("two_bars").finish()
    assert result_of(text) == [True, True]
    assert "[rank0]: rank0: 100%" in text and "[rank1]: rank1: 100%" in text


def test_two_ranks_bars_do_not_take_turns_on_one_line(pty_run):
    pytest.importorskip("tqdm")
    text = pty_run("two_bars_drawn_anyway").finish()
    screen, frames = render(text)
    # No rank's bar is ever drawn over another's line: every row shows one rank's bar.
    drawn = {}
    for row, line in frames:
        ranks = PREFIX.findall(line)
        if ranks:
            assert len(ranks) == 1 and line.startswith(f"[rank{ranks[0]}]: "), line
            drawn.setdefault(row, set()).add(ranks[0])
    assert drawn and all(len(ranks) == 1 for ranks in drawn.values()), drawn
    # What stays on the screen: each rank's finished bar once, whole, on its own line.
    for r in ("0", "1"):
        done = [line for line in screen if line.startswith(f"[rank{r}]: rank{r}")]
        assert len(done) == 1, screen
        assert "100%" in done[0] and "30/30" in done[0], done
        assert len(PREFIX.findall(done[0])) == 1, done
    assert sorted(line for line in screen if "after the bar" in line) == [
        "[rank0]: after the bar", "[rank1]: after the bar"]


# -- the relay's screen, line by line ----------------------------------------------------

class FakeTerminal:
    """A text sink that is a terminal (a real pty's slave, for its identity) and keeps
    what is written to it."""

    def __init__(self, fd):
        self.fd = fd
        self.text = ""

    def isatty(self):
        return True

    def fileno(self):
        return self.fd

    def write(self, s):
        self.text += s

    def flush(self):
        pass


@pytest.fixture
def terminal():
    master, slave = os.openpty()
    yield FakeTerminal(slave)
    os.close(master)
    os.close(slave)


def test_lines_go_above_a_drawn_bar_and_a_waiting_bar_is_drawn_next(terminal):
    from mplaunch._engine.output import StreamRelay
    r0 = StreamRelay(terminal, "[0]: ")
    r1 = StreamRelay(terminal, "[1]: ")
    assert r0.is_terminal and r1.is_terminal
    r0.feed(b"\r10%")
    r1.feed(b"\r50%")          # waits: rank 0's bar has the line
    r1.feed(b"\r60%")
    r1.feed(b"\nhello\n")       # its bar ends (final state), then an ordinary line
    r1.feed(b"\r70%")
    r0.feed(b"\r20%\n")         # rank 0's bar ends: rank 1's waiting bar is drawn
    r0.close()
    r1.close()
    assert terminal.text == (
        "[0]: 10%\x1b[K\r"
        "\r\x1b[K[1]: 60%\n[1]: hello\n[0]: 10%\x1b[K\r"   # above rank 0's bar
        "\r\x1b[K[0]: 20%\n"                             # its end, in its place
        "[1]: 70%\x1b[K\r"                               # the next bar
        "\r\x1b[K[1]: 70%\n")


def test_a_prompt_shows_at_once_and_its_answer_continues_it(terminal):
    from mplaunch._engine.output import StreamRelay
    r0 = StreamRelay(terminal, "[0]: ")
    r1 = StreamRelay(terminal, "[1]: ")
    r0.show_prompts()  # rank 0 reads the terminal
    r1.feed(b"\r5%")
    r0.feed(b"line\n(Pdb) ")    # the line goes above rank 1's bar; the prompt replaces it
    r1.feed(b"\r6%")            # waits
    r1.feed(b"\nother\n")       # goes above the prompt, which is drawn again
    r0.feed(b"82\n(Pdb) ")      # the answer continues the prompt's line
    r0.close()
    r1.close()
    assert terminal.text == (
        "[1]: 5%\x1b[K\r"
        "\r\x1b[K[0]: line\n[1]: 5%\x1b[K\r"
        "\r\x1b[K[0]: (Pdb) "
        "\r\x1b[K[1]: 6%\n[1]: other\n[0]: (Pdb) "
        "82\n[0]: (Pdb) "
        "\n")


def test_a_sink_that_is_no_terminal_gets_no_erasing_and_no_prompts():
    import io

    from mplaunch._engine.output import StreamRelay
    sink = io.StringIO()
    r0 = StreamRelay(sink, "[0]: ")
    r1 = StreamRelay(sink, "[1]: ")
    r0.show_prompts()
    assert not r0.is_terminal
    r0.feed(b"\r10%")
    r1.feed(b"\r50%")          # waits
    r1.feed(b"\nhello\n")
    r0.feed(b"\nname? ")        # not shown before its line ends
    r0.feed(b"bob\n")
    r0.close()
    r1.close()
    # Rank 0's bar is ended where it stands before rank 1's lines (a file cannot erase
    # it), and is not written again when it ends unchanged.
    assert sink.getvalue() == ("[0]: 10%\n[1]: 50%\n[1]: hello\n"
                               "[0]: name? bob\n")


@pytest.mark.parametrize("bad", [-1, True, "0", 1.0])
def test_stdin_rank_must_be_a_rank_or_none(bad):
    with pytest.raises(ValueError, match="stdin_rank must be a rank number"):
        mplaunch.launch(print, stdin_rank=bad)
