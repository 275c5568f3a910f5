"""Progress bars relayed into something that is not a terminal (a log file the watcher's
output is redirected to, a file or pytest's capture as launch()'s sys.stdout and
sys.stderr, a notebook's stream): a bar's line is ended before any other line is written
there, whoever writes it (another rank, the same rank on its other stream, mplaunch
itself), and a bar still open when its rank exits is ended too (issue 24).

The ranks are real and draw with real tqdm, or write raw ``"50%\\r"``. So that the lines
meet in the order that broke them, each rank waits until what it wrote has been relayed
before the other goes on: the launching process copies a rank's bytes to its log_dir
file in the same step as it relays them, and the ranks read those files.
"""
import io
import os
import re
import signal
import subprocess
import sys
import time

import pytest

import mplaunch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
HEAD = re.compile(r"\[rank(\d+)\]: |mplaunch: ")
WAIT_S = 60


# -- the ranks ---------------------------------------------------------------------------

def _wait_until(check, what):
    deadline = time.monotonic() + WAIT_S
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {WAIT_S} s for {what}")
        time.sleep(0.01)


def _relayed(run, rank, stream, text):
    """Wait until `text` of this rank's `stream` has been relayed: the launching process
    copies it to the stream's log_dir file (``run/logs``) in the step that relays it."""
    path = os.path.join(run, "logs", "attempt_0", str(rank), f"{stream}.log")

    def check():
        try:
            with open(path, "rb") as f:
                return text.encode() in f.read()
        except FileNotFoundError:
            return False
    _wait_until(check, f"{text!r} in {path}")


def _touch(sync, name):
    open(os.path.join(sync, name), "w").close()


def _wait_for(sync, name):
    _wait_until(lambda: os.path.exists(os.path.join(sync, name)), name)


def _bar(kind):
    """A function that moves a bar on stderr by a quarter and returns its text, and the
    bar (None for raw writes)."""
    if kind == "tqdm":
        from tqdm import tqdm
        bar = tqdm(total=4, file=sys.stderr, desc="bar", ascii=True, ncols=60,
                   mininterval=0, miniters=1)

        def step():
            bar.update(1)
            return f"{bar.n * 25:3d}%|"
        return step, bar
    done = [0]

    def step():
        done[0] += 25
        sys.stderr.write(f"{done[0]}%\r")  # as a bar that puts \r after its state
        sys.stderr.flush()
        return f"{done[0]}%"
    return step, None


def bar_meets_lines(kind, run):
    """Rank 0 moves a bar on stderr and leaves it open at 100%; while it is drawn, rank 0
    prints on stdout and rank 1 prints on both streams, and rank 1 prints again after
    it. Each waits until what it wrote was relayed (files in `run` are the handshakes)."""
    if int(os.environ["RANK"]) == 0:
        step, bar = _bar(kind)
        _relayed(run, 0, "stderr", step())                 # 25%
        print("rank 0 on stdout", flush=True)              # the same rank's other stream
        _relayed(run, 0, "stdout", "rank 0 on stdout")
        _relayed(run, 0, "stderr", step())                 # 50%
        _relayed(run, 0, "stderr", step())                 # 75%
        _touch(run, "drawn")
        _wait_for(run, "printed")
        _relayed(run, 0, "stderr", step())                 # 100%, left open
        if bar is not None:
            bar.disable = True  # never closed: tqdm writes no newline after it
        _touch(run, "done")
        return 0
    _wait_for(run, "drawn")
    print("rank 1 on stdout", flush=True)
    print("rank 1 on stderr", file=sys.stderr, flush=True)
    _relayed(run, 1, "stdout", "rank 1 on stdout")
    _relayed(run, 1, "stderr", "rank 1 on stderr")
    _touch(run, "printed")
    _wait_for(run, "done")
    print("rank 1 after the bar", flush=True)
    print("rank 1 after the bar, stderr", file=sys.stderr, flush=True)
    return 1


def bar_then_failure(run):
    """Rank 0's bar is open when rank 1 complains and fails: the teardown ends it, and
    mplaunch reports the failure."""
    if int(os.environ["RANK"]) == 0:
        sys.stderr.write("50%\r")
        sys.stderr.flush()
        _relayed(run, 0, "stderr", "50%")
        _touch(run, "drawn")
        time.sleep(WAIT_S)  # until the teardown
        return 0
    _wait_for(run, "drawn")
    print("rank 1 gives up", file=sys.stderr, flush=True)
    sys.exit(3)


def bar_under_own_message(run):
    """Rank 0's bar is open while the watcher prints where every rank is (SIGUSR1)."""
    if int(os.environ["RANK"]) == 0:
        sys.stderr.write("50%\r")
        sys.stderr.flush()
        _relayed(run, 0, "stderr", "50%")
        _touch(run, "drawn")
        _wait_for(run, "go")
        sys.stderr.write("100%\n")
    else:
        _wait_for(run, "go")
    return 0


def bar_left_open(kind, run):
    """Rank 0 exits with its bar open at 100%, after rank 1's last line."""
    if int(os.environ["RANK"]) == 0:
        step, bar = _bar(kind)
        _relayed(run, 0, "stderr", step())
        _touch(run, "drawn")
        _wait_for(run, "printed")
        for _ in range(3):
            step()
        if bar is not None:
            bar.disable = True
        return 0
    _wait_for(run, "drawn")
    print("rank 1 is done", file=sys.stderr, flush=True)
    _relayed(run, 1, "stderr", "rank 1 is done")
    _touch(run, "printed")
    return 1


SCENARIOS = {"bar_meets_lines": bar_meets_lines, "bar_then_failure": bar_then_failure,
             "bar_under_own_message": bar_under_own_message, "bar_left_open": bar_left_open}


# -- what a non-terminal must hold -------------------------------------------------------

def assert_whole_lines(text):
    """Every line is one writer's: each state of a bar redrawn after \\r starts with the
    same prefix, nothing follows a bar on its line, and the text ends its last line."""
    assert text.endswith("\n"), repr(text[-300:])
    for line in text[:-1].split("\n"):
        heads = set()
        for seg in line.split("\r"):
            if not seg:
                continue
            found = HEAD.findall(seg)
            assert HEAD.match(seg) and len(found) == 1, f"two writers on one line: {line!r}"
            heads.add(found[0])
        assert len(heads) <= 1, f"two writers on one line: {line!r}"


def last_state(text, what):
    """The line that shows `what`, as a file viewer shows it (its last state)."""
    lines = [line.split("\r")[-1] for line in text.split("\n") if what in line]
    assert lines, text
    return lines[-1]


def check_bar_meets_lines(texts, kind):
    """texts: what the sinks got (one text when stdout and stderr are one file)."""
    every = "".join(texts)
    for text in texts:
        assert_whole_lines(text)
    for line in ("rank 0 on stdout", "rank 1 on stdout", "rank 1 on stderr",
                 "rank 1 after the bar", "rank 1 after the bar, stderr"):
        assert f"\n[rank{line[5]}]: {line}\n" in "\n" + every, (line, every)
    end = last_state(every, "100%")
    assert end.startswith("[rank0]: "), every
    if kind == "tqdm":
        assert "4/4" in end, every
    # Ended where it stood, the final state is not written again when the rank exits.
    assert every.count("100%") == 1, every
    # In the order they were relayed (the ranks waited for that), where it can be seen:
    # in the one file both streams went to, else on stderr.
    text = texts[0] if len(texts) == 1 else texts[1]
    order = ([("[rank0]: rank 0 on stdout", "50%")] if len(texts) == 1 else []) + [
        ("[rank1]: rank 1 on stderr", "100%"), ("100%", "[rank1]: rank 1 after the bar")]
    if len(texts) == 1:
        order.append(("[rank1]: rank 1 on stdout", "100%"))
    for before, after in order:
        assert text.index(before) < text.index(after), (before, after, text)


# -- launch(), relaying into what is not a terminal -------------------------------------

class Cell(io.TextIOBase):
    """A notebook's output stream: text only, no file under it."""

    def __init__(self):
        self.text = ""

    def writable(self):
        return True

    def write(self, s):
        self.text += s
        return len(s)


@pytest.fixture
def sinks(request, monkeypatch, tmp_path):
    """A function that makes sys.stdout and sys.stderr what launch() relays into, and
    returns a function that returns what they got: one file for both (a script run as
    ``> log 2>&1``), pytest's capture, or two notebook streams. (pytest sets sys.stdout
    again when the test starts, so they are set from the test.)"""
    opened = []

    def start():
        if request.param == "capture":
            return lambda: list(capsys.readouterr())
        if request.param == "file":
            path = tmp_path / "run.log"
            out = open(path, "w")  # noqa: SIM115 - closed after the test
            err = open(os.dup(out.fileno()), "w", buffering=1)  # 2>&1, line-buffered
            opened.extend((out, err))

            def read():
                out.flush()
                err.flush()
                return [path.read_bytes().decode()]  # \r kept as written
        else:
            out, err = Cell(), Cell()

            def read():
                return [out.text, err.text]
        monkeypatch.setattr(sys, "stdout", out)
        monkeypatch.setattr(sys, "stderr", err)
        return read

    capsys = request.getfixturevalue("capsys") if request.param == "capture" else None
    yield start
    monkeypatch.undo()
    for f in opened:
        f.close()


@pytest.mark.parametrize("sinks", ["file", "capture", "notebook"], indirect=True)
@pytest.mark.parametrize("kind", ["tqdm", "raw"])
def test_launch_ends_a_bars_line_before_other_lines(sinks, kind, tmp_path):
    if kind == "tqdm":
        pytest.importorskip("tqdm")
    logs = tmp_path / "logs"
    read = sinks()
    assert mplaunch.launch(bar_meets_lines, (kind, str(tmp_path)), nprocs=2,
                           log_dir=str(logs)) == [0, 1]
    check_bar_meets_lines(read(), kind)
    # The log files are each rank's own bytes, as it wrote them: the bar left open too.
    if kind == "raw":
        assert (logs / "attempt_0" / "0" / "stderr.log").read_bytes() == \
            b"25%\r50%\r75%\r100%\r"
    assert (logs / "attempt_0" / "1" / "stdout.log").read_bytes() == \
        b"rank 1 on stdout\nrank 1 after the bar\n"


# -- the watcher, its output redirected to a file ----------------------------------------

SCRIPT = """\
import sys
sys.path.insert(0, {here!r})
import test_progress_lines
test_progress_lines.SCENARIOS[sys.argv[1]](*sys.argv[2:])
"""


def _env():
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("SLURM_") and k not in (
               "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
               "MASTER_PORT", "TORCHELASTIC_ERROR_FILE", "PYTHONUNBUFFERED")}
    env["PYTHONPATH"] = ROOT
    return env


class Watcher:
    """``python -m mplaunch --nproc-per-node 2 train.py ARGS > run.log 2>&1``
    (with --log-dir, for the ranks to see what was relayed)"""

    def __init__(self, tmp_path, *args):
        self.log = tmp_path / "run.log"
        self.sync = tmp_path / "run"  # the ranks' handshakes, and the log_dir they read
        self.sync.mkdir()
        script = tmp_path / "train.py"
        script.write_text(SCRIPT.format(here=HERE))
        with open(self.log, "wb") as f:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "mplaunch", "--nproc-per-node", "2",
                 "--preload", "", "--grace-period", "1", "--log-dir",
                 str(self.sync / "logs"), str(script), *args, str(self.sync)],
                cwd=tmp_path, env=_env(), stdout=f, stderr=subprocess.STDOUT)

    def wait_for(self, name):
        _wait_until(lambda: (self.sync / name).exists() or self.proc.poll() is not None,
                    name)
        assert (self.sync / name).exists(), self.finish()

    def finish(self):
        try:
            self.proc.wait(timeout=150)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
        return self.log.read_bytes().decode()


@pytest.mark.parametrize("kind", ["tqdm", "raw"])
def test_watcher_log_file_gets_whole_lines(tmp_path, kind):
    if kind == "tqdm":
        pytest.importorskip("tqdm")
    w = Watcher(tmp_path, "bar_meets_lines", kind)
    text = w.finish()
    assert w.proc.returncode == 0, text
    check_bar_meets_lines([text], kind)


@pytest.mark.parametrize("kind", ["tqdm", "raw"])
def test_watcher_ends_a_bar_left_open_at_the_ranks_exit(tmp_path, kind):
    if kind == "tqdm":
        pytest.importorskip("tqdm")
    w = Watcher(tmp_path, "bar_left_open", kind)
    text = w.finish()
    assert w.proc.returncode == 0, text
    assert_whole_lines(text)
    assert "\n[rank1]: rank 1 is done\n" in "\n" + text, text
    end = text[:-1].split("\n")[-1].split("\r")[-1]  # the file's last line, as shown
    assert end.startswith("[rank0]: ") and "100%" in end, text


def test_watcher_failure_summary_starts_its_own_line(tmp_path):
    w = Watcher(tmp_path, "bar_then_failure")
    text = w.finish()
    assert w.proc.returncode == 3, text
    assert_whole_lines(text)
    assert "\n[rank1]: rank 1 gives up\n" in text, text
    assert last_state(text, "50%") == "[rank0]: 50%", text
    assert re.search(r"(^|\n)mplaunch: rank 1 .*exit code 3", text), text


def test_watcher_own_message_starts_its_own_line(tmp_path):
    w = Watcher(tmp_path, "bar_under_own_message")
    try:
        w.wait_for("drawn")
        w.proc.send_signal(signal.SIGUSR1)
        _wait_until(lambda: b"where each rank is now" in w.log.read_bytes(),
                    "the watcher's SIGUSR1 message")
    finally:
        _touch(str(w.sync), "go")
    text = w.finish()
    assert w.proc.returncode == 0, text
    assert_whole_lines(text)
    assert "mplaunch: SIGUSR1: where each rank is now" in text
    assert last_state(text, "100%") == "[rank0]: 100%", text
