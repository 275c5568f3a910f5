"""pdb and input() in any rank, answered through the launching process, one rank at a
time (_rank.debugging, _engine.debugging), end to end.

A script that launches runs under a real pseudo-terminal (pexpect: the pty is its
stdin, stdout, stderr and controlling terminal, as in a shell); the test types into it
as a user would and reads back what the user would see. Ctrl-C is the terminal's (the
VINTR character, so the terminal sends SIGINT to its foreground process group). The
last tests run where nobody can answer: this pytest process, whose stdin is no
terminal.
"""
from __future__ import annotations

import io
import os
import re
import signal
import sys
import textwrap
import time

import psutil
import pytest

import mplaunch
from procs import assert_gone

pexpect = pytest.importorskip("pexpect")

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
TIMEOUT = 30   # for anything to show up on the terminal


class Term:
    """A script run under a new pseudo-terminal; everything it wrote is kept (`text`),
    and `wait_for` reads on until a string shows up after the last one waited for."""

    def __init__(self, child, script):
        self.child = child
        self.script = script
        self.pos = 0
        self.status = None

    @property
    def text(self) -> str:
        return self.child.logfile_read.getvalue()

    def wait_for(self, needle: str, timeout: float = TIMEOUT, anywhere=False) -> str:
        """Read until `needle` shows up (after the last needle waited for, or anywhere
        in what was written with anywhere=True); returns everything written so far."""
        deadline = time.monotonic() + timeout
        while True:
            i = self.text.find(needle, 0 if anywhere else self.pos)
            if i >= 0:
                if not anywhere:
                    self.pos = max(self.pos, i + len(needle))
                return self.text
            left = deadline - time.monotonic()
            assert left > 0, \
                f"{needle!r} never came; the terminal shows, last:\n{self.text[-3000:]}"
            try:
                self.child.read_nonblocking(65536, timeout=min(left, 0.5))
            except pexpect.TIMEOUT:
                pass
            except pexpect.EOF:
                assert needle in self.text[0 if anywhere else self.pos:], \
                    f"the script ended without {needle!r}; it wrote, last:\n" \
                    f"{self.text[-3000:]}"

    def send(self, line: str) -> None:
        self.child.sendline(line)

    def interrupt(self) -> None:
        self.child.sendintr()    # ^C typed: SIGINT to the terminal's foreground group

    def finish(self, timeout: float = TIMEOUT) -> str:
        """Everything the script writes until it exits; its exit status in `status`
        (a negative number: the signal that ended it)."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            assert left > 0, f"the script did not end; it wrote:\n{self.text}"
            try:
                self.child.read_nonblocking(65536, timeout=min(left, 0.5))
            except pexpect.TIMEOUT:
                pass
            except pexpect.EOF:
                break
        self.child.wait()
        self.child.close()
        self.status = (self.child.exitstatus if self.child.signalstatus is None
                       else -self.child.signalstatus)
        return self.text


@pytest.fixture
def term(tmp_path):
    """start(source, args=("{script}",), env=None): the script `source` run by this
    Python under a new terminal; "{script}" in args stands for its path."""
    runs = []

    def start(source, args=("{script}",), env=None, name="script.py"):
        script = tmp_path / name
        script.write_text(textwrap.dedent(source))
        full_env = {k: v for k, v in os.environ.items()
                    if k not in ("PYTHONBREAKPOINT", "MPLAUNCH_POST_MORTEM", "COLUMNS",
                                 "LINES", "PYTEST_CURRENT_TEST", "PYTEST_ADDOPTS")}
        full_env["PYTHONPATH"] = ROOT
        full_env.update(env or {})
        child = pexpect.spawn(sys.executable, [a.format(script=script) for a in args],
                              cwd=str(tmp_path), env=full_env, encoding="utf-8",
                              codec_errors="replace", timeout=TIMEOUT,
                              dimensions=(40, 200))
        child.logfile_read = io.StringIO()
        runs.append(Term(child, str(script)))
        return runs[-1]

    yield start
    for run in runs:
        # A test that failed midway: Ctrl-C, as a user would, so that the script tears
        # its ranks down; a second one hurries it; then SIGKILL.
        for signo, wait in ((signal.SIGINT, 2), (signal.SIGINT, 10), (signal.SIGKILL, 5)):
            if not run.child.isalive():
                break
            run.child.kill(signo)
            deadline = time.monotonic() + wait
            while run.child.isalive() and time.monotonic() < deadline:
                time.sleep(0.05)
        run.child.close(force=True)


def line_of(path, needle) -> int:
    with open(path) as f:
        lines = f.read().splitlines()
    return next(i for i, line in enumerate(lines, 1) if needle in line)


def result_of(text: str, tag="RESULT"):
    line = text[text.index(tag + " "):].splitlines()[0]
    return eval(line[len(tag) + 1:])


# -- launch(), a terminal --------------------------------------------------------------

BREAK_IN_EVERY_RANK = """
import os, time
import mplaunch

def f(base):
    rank = int(os.environ["RANK"])
    secret = base * 100 + rank
    while rank == 0 and GO and not os.path.exists(GO):
        time.sleep(0.02)   # rank 0 late: until rank 1 holds the prompt
    breakpoint()  # STOP
    return secret + 1

if __name__ == "__main__":
    print("RESULT", mplaunch.launch(f, (7,), nprocs=2, timeout=120), flush=True)
"""


@pytest.mark.parametrize("late", [False, True], ids=["as-they-come", "rank-0-late"])
def test_breakpoint_in_every_rank_one_rank_at_a_time(term, tmp_path, late):
    go = str(tmp_path / "go") if late else None
    run = term(BREAK_IN_EVERY_RANK.replace("GO", repr(go)))
    stop = line_of(run.script, "# STOP")
    # Whichever rank reaches its breakpoint first holds the prompt (first come, first
    # served: on a loaded machine rank 1 may); the other is named as waiting for it,
    # and shows no prompt meanwhile. Rank 0 late: it goes on once rank 1 has the prompt
    if late:
        run.wait_for("[rank1]: (Pdb) ", anywhere=True)
        open(go, "w").close()
    text = run.wait_for(" stopped at a breakpoint at ", anywhere=True)
    b = int(re.search(r"mplaunch: rank (\d) stopped at a breakpoint", text).group(1))
    a = 1 - b
    if late:   # rank 0 came second: rank 1 holds the prompt, rank 0 waits
        assert a == 1, text
    run.wait_for(f"mplaunch: rank {b} stopped at a breakpoint at {run.script}:{stop} and "
                 f"waits for rank {a}'s debugger to continue ('c')", anywhere=True)
    run.wait_for(f"[rank{a}]: (Pdb) ")
    run.send("p secret, rank")
    run.wait_for(f"[rank{a}]: ({700 + a}, {a})\r\n")      # its locals
    run.wait_for(f"[rank{a}]: (Pdb) ")
    run.send("p secret * 2")
    run.wait_for(f"[rank{a}]: {2 * (700 + a)}\r\n")
    run.wait_for(f"[rank{a}]: (Pdb) ")
    time.sleep(0.3)   # what the other would show, had it a prompt now
    assert f"[rank{b}]: (Pdb)" not in run.text
    run.send("c")
    run.wait_for(f"[rank{b}]: (Pdb) ")
    run.send("p secret, rank")
    run.wait_for(f"[rank{b}]: ({700 + b}, {b})\r\n")      # the other's own
    run.wait_for(f"[rank{b}]: (Pdb) ")
    run.send("c")
    text = run.finish()
    assert run.status == 0, text
    assert result_of(text) == [701, 702]
    assert text.count("stopped at a breakpoint") == 1, text
    assert f"[rank{a}]: (Pdb)" not in text[text.index(f"[rank{b}]: (Pdb)"):]
    assert "skipped" not in text


BIG_LOCAL = """
import os
import mplaunch

def f():
    big = list(range(150000))   # pdb prints 1.1 MB: more than the pipe holds
    breakpoint()
    return len(big)

if __name__ == "__main__":
    print("RESULT", mplaunch.launch(f, nprocs=1, timeout=120), flush=True)
"""


def test_what_pdb_printed_is_on_screen_before_its_next_prompt(term):
    # pdb writes to the rank's stdout pipe and then asks for the next line on its
    # result socket: the launching process relays all of that output before it shows
    # the prompt, or the answer to 'p big' lands under a prompt already shown.
    run = term(BIG_LOCAL)
    run.wait_for("[rank0]: (Pdb) ")
    for _ in range(2):
        run.send("p big")
        text = run.wait_for("[rank0]: (Pdb) ")
        shown = text[:run.pos]
        assert shown.rstrip().endswith("[rank0]: (Pdb)"), shown[-300:]
        assert "149999]" in shown[shown.rindex("p big"):], \
            "the prompt came before the value was all shown"
        time.sleep(0.3)
        assert "149999]" not in run.text[run.pos:], "the value came after its prompt"
    run.send("c")
    text = run.finish()
    assert run.status == 0, text[-2000:]
    assert result_of(text) == [150000]


BREAK_IN_A_DATALOADER_WORKER = """
import os
import torch
import mplaunch
from torch.utils.data import DataLoader, Dataset

class Items(Dataset):
    def __len__(self):
        return 6

    def __getitem__(self, i):
        breakpoint()  # IN-WORKER
        return torch.tensor([i])

def f():
    got = [int(b) for b in DataLoader(Items(), num_workers=2, batch_size=None)]
    breakpoint()  # IN-RANK
    return got

if __name__ == "__main__":
    print("RESULT", mplaunch.launch(f, nprocs=1, timeout=120), flush=True)
"""


def test_breakpoint_in_a_dataloader_worker_is_skipped_and_the_rank_still_stops(term):
    # A DataLoader's workers are forked from the rank and share its result socket: their
    # asks and answers would cross the rank's. Each says once that it skips, and the
    # rank's own breakpoint() after the loop is answered as ever.
    run = term(BREAK_IN_A_DATALOADER_WORKER)
    where = f"{run.script}:{line_of(run.script, '# IN-WORKER')}"
    run.wait_for("[rank0]: (Pdb) ")
    run.send("p got")
    run.wait_for("[rank0]: [0, 1, 2, 3, 4, 5]\r\n")
    run.wait_for("[rank0]: (Pdb) ")
    run.send("c")
    text = run.finish()
    assert run.status == 0, text[-3000:]
    assert result_of(text) == [[0, 1, 2, 3, 4, 5]]
    notes = re.findall(rf"breakpoint\(\) at {re.escape(where)} skipped in process "
                       r"(\d+), a child of rank 0", text)
    assert len(notes) == 2 and len(set(notes)) == 2, text[-3000:]   # once per worker
    assert text.count("(Pdb)") == 2, text[-3000:]   # the rank's prompt, twice


INPUT_IN_RANK_1 = """
import os
import mplaunch

def f():
    if int(os.environ["RANK"]) == 1:
        return input("question? ")
    return "rank 0 asked nothing"

if __name__ == "__main__":
    print("RESULT", mplaunch.launch(f, nprocs=2, timeout=120), flush=True)
"""


def test_input_in_a_rank_that_is_not_the_stdin_rank(term):
    run = term(INPUT_IN_RANK_1)
    run.wait_for("[rank1]: question? ")
    assert "RESULT" not in run.text
    run.send("forty two")
    text = run.finish()
    assert run.status == 0, text
    assert "[rank1]: question? forty two\r\n" in text   # the echo, after its prompt
    assert result_of(text) == ["rank 0 asked nothing", "forty two"]


PAUSE_PAST_TIMEOUT = """
import os, time
import mplaunch
import torch
import torch.distributed as dist

def f():
    rank = int(os.environ["RANK"])
    t = torch.tensor([rank + 1.0])
    if rank == 0:
        breakpoint()
    dist.all_reduce(t)   # rank 1 waits here meanwhile
    return t.item()

if __name__ == "__main__":
    t0 = time.monotonic()
    try:
        print("RESULT", mplaunch.launch(f, nprocs=2, backend="gloo", timeout=3),
              flush=True)
    except mplaunch.LaunchTimeout as e:
        print("TIMED OUT", e, flush=True)
    print("ELAPSED", time.monotonic() - t0, flush=True)
"""


@pytest.mark.slow
def test_the_launch_timeout_waits_while_a_rank_is_debugged(term):
    run = term(PAUSE_PAST_TIMEOUT)
    run.wait_for("[rank0]: (Pdb) ")
    time.sleep(5)   # the user reads, longer than timeout=3
    run.send("c")
    text = run.finish()
    assert run.status == 0, text
    assert "TIMED OUT" not in text
    assert result_of(text) == [3.0, 3.0]
    assert result_of(text, "ELAPSED") > 5


def sleep_five():
    time.sleep(5)
    return "slept"


def test_the_same_timeout_fires_without_a_debugger():
    # the control of the test above: 5 s without a debugger is past timeout=3
    with pytest.raises(mplaunch.LaunchTimeout):
        mplaunch.launch(sleep_five, nprocs=2, timeout=3)


# -- post-mortem -----------------------------------------------------------------------

FAILS_IN_RANK_1 = """
import os
import mplaunch

def f():
    rank = int(os.environ["RANK"])
    if rank == 1:
        doomed = {"answer": 41 + rank}
        raise ValueError(f"bad value in rank {rank}")  # RAISES
    return rank

if __name__ == "__main__":
    try:
        mplaunch.launch(f, nprocs=2, timeout=120)
    except mplaunch.WorkerError as e:
        print("CAUGHT", [(type(e).__name__, x.rank, x.exc_type) for x in e.failures],
              flush=True)
"""


def test_post_mortem_opens_pdb_where_the_rank_raised(term):
    run = term(FAILS_IN_RANK_1, env={"MPLAUNCH_POST_MORTEM": "1"})
    raises = line_of(run.script, "# RAISES")
    run.wait_for("[rank1]: mplaunch: rank 1 post-mortem: ValueError: bad value in rank 1")
    run.wait_for(f"[rank1]: > {run.script}({raises})f()")
    run.wait_for("[rank1]: (Pdb) ")
    run.send('p doomed["answer"], rank')
    run.wait_for("[rank1]: (42, 1)\r\n")
    run.wait_for("[rank1]: (Pdb) ")
    assert "CAUGHT" not in run.text   # the error is sent once pdb is done
    run.send("c")
    text = run.finish()
    assert run.status == 0, text
    assert result_of(text, "CAUGHT") == [("WorkerError", 1, "ValueError")]
    assert "[rank0]: (Pdb)" not in text
    assert text.count("(Pdb) ") == 2, text


def test_without_post_mortem_a_failing_rank_opens_no_pdb(term):
    # the control: the same script on the same terminal, MPLAUNCH_POST_MORTEM unset
    run = term(FAILS_IN_RANK_1)
    text = run.finish()
    assert run.status == 0, text
    assert result_of(text, "CAUGHT") == [("WorkerError", 1, "ValueError")]
    assert "(Pdb)" not in text and "post-mortem" not in text


SCRIPT_FAILS_IN_RANK_1 = """
import os
rank = int(os.environ["RANK"])
doomed = rank * 10 + 1
if rank == 1:
    raise ValueError("the script fails in rank 1")  # RAISES
print("rank", rank, "went through", flush=True)
"""


def test_the_cli_pdb_flag_opens_a_failing_script_rank_in_pdb(term):
    run = term(SCRIPT_FAILS_IN_RANK_1,
               args=("-m", "mplaunch", "-n", "2", "--pdb", "{script}"))
    raises = line_of(run.script, "# RAISES")
    run.wait_for("[rank1]: mplaunch: rank 1 post-mortem: ValueError: the script fails "
                 "in rank 1")
    run.wait_for(f"[rank1]: > {run.script}({raises})<module>()")
    run.wait_for("[rank1]: (Pdb) ")
    run.send("p doomed, rank")
    run.wait_for("[rank1]: (11, 1)\r\n")
    run.wait_for("[rank1]: (Pdb) ")
    run.send("c")
    text = run.finish()
    assert run.status not in (0, None), text   # the rank's error is the script's
    assert "[rank0]: rank 0 went through" in text
    assert "rank 1 went through" not in text
    assert "ValueError: the script fails in rank 1" in text[text.rindex("(Pdb) "):]


# -- World -----------------------------------------------------------------------------

WORLD_DEBUG = """
import os, time
import mplaunch
import torch
import torch.distributed as dist

def add(x, stop):
    rank = int(os.environ["RANK"])
    t = torch.tensor([float(rank + x)])
    if rank == 1 and stop == "sleep":
        time.sleep(5)
    elif rank == 1 and stop:
        breakpoint()
    dist.all_reduce(t)   # rank 0 waits here while rank 1 is debugged
    return t.item()

def fail(x):
    rank = int(os.environ["RANK"])
    if rank == 1:
        culprit = x * 3
        raise ValueError("fails in rank 1")  # RAISES
    return rank

if __name__ == "__main__":
    with mplaunch.World(2, backend="gloo", timeout=3) as w:
        print("FIRST", w.run(add, (1, True)), flush=True)
        try:
            w.run(fail, (5,))
        except mplaunch.WorkerError as e:
            print("FAILED", [x.rank for x in e.failures], flush=True)
        try:
            w.debug(rank=0)
        except RuntimeError as e:
            print("NOTHING IN RANK 0:", e, flush=True)
        w.debug()
        print("DEBUGGED", flush=True)
        print("AFTER", w.run(add, (2, False)), flush=True)
        try:   # the control: the same wait without a debugger is past the timeout
            w.run(add, (3, "sleep"))
        except mplaunch.LaunchTimeout:
            print("TIMED OUT", flush=True)
"""


@pytest.mark.slow
def test_world_breakpoint_past_its_timeout_then_debug_of_a_failed_run(term):
    run = term(WORLD_DEBUG)
    raises = line_of(run.script, "# RAISES")
    run.wait_for("[rank1]: (Pdb) ")
    run.send("p t")
    run.wait_for("[rank1]: tensor([2.])\r\n")
    run.wait_for("[rank1]: (Pdb) ")
    time.sleep(5)   # longer than the World's timeout=3: the call waits
    run.send("c")
    run.wait_for("FIRST [3.0, 3.0]")
    run.wait_for("FAILED [1]")
    run.wait_for("NOTHING IN RANK 0: rank 0 holds no error to debug")
    run.wait_for("[rank1]: mplaunch: rank 1 post-mortem: ValueError: fails in rank 1")
    run.wait_for(f"[rank1]: > {run.script}({raises})fail()")
    run.wait_for("[rank1]: (Pdb) ")
    run.send("p culprit, x")
    run.wait_for("[rank1]: (15, 5)\r\n")
    run.wait_for("[rank1]: (Pdb) ")
    assert "DEBUGGED" not in run.text
    run.send("c")
    text = run.finish()
    assert run.status == 0, text
    assert "DEBUGGED" in text
    assert result_of(text, "AFTER") == [5.0, 5.0]
    assert "timed out" not in text[:text.index("AFTER")].lower()
    assert "TIMED OUT" in text[text.index("AFTER"):]
    assert text.count("(Pdb) ") == 4, text


# A World's rank keeps a value in its __main__ (the next run reads it back).
REMEMBER = '''
def remember(v):
    global kept
    kept = v * 10 + int(os.environ["RANK"])
'''

WORLD_QUIT = """
import os
import mplaunch
""" + REMEMBER + """
def stop():
    rank = int(os.environ["RANK"])
    if rank == 1:
        breakpoint()
        print("went on after the breakpoint", flush=True)
    return rank

def recall():
    return kept

if __name__ == "__main__":
    with mplaunch.World(2, backend="gloo", timeout=60) as w:
        w.run(remember, (4,))
        try:
            w.run(stop)
            print("NOT QUIT", flush=True)
        except mplaunch.WorkerError as e:
            print("QUIT", [(x.rank, x.exc_type) for x in e.failures], flush=True)
        print("KEPT", w.run(recall), flush=True)
"""


def test_quit_in_a_world_rank_fails_the_run_and_the_world_goes_on(term):
    run = term(WORLD_QUIT)
    run.wait_for("[rank1]: (Pdb) ")
    run.send("q")
    text = run.finish()
    assert run.status == 0, text
    assert result_of(text, "QUIT") == [(1, "bdb.BdbQuit")]
    assert "[rank1]: went on after the breakpoint" not in text
    assert result_of(text, "KEPT") == [40, 41]


WORLD_INTERRUPTED = """
import os
import mplaunch
import torch.distributed as dist
""" + REMEMBER + """
def stop():
    rank = int(os.environ["RANK"])
    if rank == 1:
        breakpoint()
    dist.barrier()   # rank 0 waits here
    return rank

def recall():
    dist.barrier()
    return kept

if __name__ == "__main__":
    with mplaunch.World(2, backend="gloo", timeout=60) as w:
        w.run(remember, (4,))
        try:
            w.run(stop)
            print("NOT INTERRUPTED", flush=True)
        except KeyboardInterrupt:
            print("INTERRUPTED", flush=True)
        print("AGAIN", w.run(recall), flush=True)
"""


def test_ctrl_c_at_a_world_ranks_prompt_interrupts_the_run_only(term):
    run = term(WORLD_INTERRUPTED)
    run.wait_for("[rank1]: (Pdb) ")
    run.interrupt()
    run.wait_for("INTERRUPTED")
    text = run.finish()
    assert run.status == 0, text
    assert "NOT INTERRUPTED" not in text
    assert result_of(text, "AGAIN") == [40, 41]


LAUNCH_INTERRUPTED = """
import os
import mplaunch

def f():
    print("PIDS", (os.getpid(), os.getppid()), flush=True)
    breakpoint()
    return "went on"

if __name__ == "__main__":
    print("RESULT", mplaunch.launch(f, nprocs=2, timeout=120), flush=True)
"""


def test_ctrl_c_at_a_launch_ranks_prompt_ends_everything(term):
    run = term(LAUNCH_INTERRUPTED)
    # Whichever rank reaches its breakpoint first holds the prompt (first come, first
    # served: on a loaded machine rank 1 may); the other is named as waiting.
    text = run.wait_for("stopped at a breakpoint", anywhere=True)
    waiting = int(re.search(r"rank (\d) stopped at a breakpoint", text).group(1))
    run.wait_for(f"[rank{1 - waiting}]: (Pdb) ", anywhere=True)
    text = run.wait_for("[rank1]: PIDS", anywhere=True)
    text = run.wait_for("[rank0]: PIDS", anywhere=True)
    pids = {}
    for _rank, pid, ppid in re.findall(r"\[rank(\d)\]: PIDS \((\d+), (\d+)\)", text):
        pids[int(pid)] = psutil.Process(int(pid)).create_time()
        if int(ppid) != run.child.pid:
            pids.setdefault(int(ppid), psutil.Process(int(ppid)).create_time())
    assert len(pids) >= 2, text
    run.interrupt()
    text = run.finish()
    assert run.status != 0, text
    assert "RESULT [" not in text
    assert "KeyboardInterrupt" in text or "MainProcessError" in text, text
    assert_gone(pids, within=5)   # the ranks, and their parent


LAUNCH_INTERRUPTED_IN_A_COMMAND = """
import os, time
import mplaunch

def f():
    breakpoint()
    for i in range(60):
        print("working", i, flush=True)
        time.sleep(1)
    return "went on"

if __name__ == "__main__":
    print("RESULT", mplaunch.launch(f, nprocs=1, timeout=300, grace_period=60),
          flush=True)
"""


@pytest.mark.slow
def test_ctrl_c_while_pdb_runs_a_command_ends_a_launch_at_once(term):
    # The user evaluates something slow at the prompt, then gives up: Ctrl-C ends the
    # launch as it would without a debugger, not after the grace period (60 s here).
    run = term(LAUNCH_INTERRUPTED_IN_A_COMMAND)
    run.wait_for("[rank0]: (Pdb) ")
    run.send("import time; time.sleep(30)")
    time.sleep(1.5)
    run.interrupt()
    text = run.finish(timeout=15)
    assert run.status != 0, text
    assert "RESULT [" not in text
    assert "[rank0]: working" not in text, text


# -- pytest --pdb ----------------------------------------------------------------------

@pytest.mark.slow
def test_pytest_pdb_opens_the_failing_rank_and_not_pytests_own(pytester):
    pytester.makeini("[pytest]\naddopts = --strict-markers\nfilterwarnings = error\n")
    pytester.makepyfile(test_ranks="""
        import os
        import pytest

        @pytest.mark.mplaunch(nprocs=2, timeout=20)
        def test_rank_fails():
            rank = int(os.environ["RANK"])
            some_local = rank * 10 + 7
            assert rank != 1, "rank one fails"  # FAILS
        """)
    fails = line_of(pytester.path / "test_ranks.py", "# FAILS")
    child = pytester.spawn_pytest("--pdb -p no:cacheprovider", expect_timeout=TIMEOUT)
    try:
        child.expect(rb"\[rank1\]: mplaunch: rank 1 post-mortem: AssertionError: "
                     rb"rank one fails")
        child.expect(rf"\[rank1\]: > \S*test_ranks\.py\({fails}\)test_rank_fails\(\)"
                     .encode())
        child.expect(rb"\[rank1\]: \(Pdb\) ")
        child.sendline("p some_local, rank")
        child.expect(rb"\[rank1\]: \(17, 1\)\r\n")
        child.expect(rb"\[rank1\]: \(Pdb\) ")
        child.sendline("c")
        child.expect(pexpect.EOF)
        after = child.before.decode("utf-8", "replace")
        child.wait()
    finally:
        child.close(force=True)
    assert "1 failed" in after, after
    assert "PDB post_mortem" not in after and "(Pdb)" not in after, after
    assert child.exitstatus == 1, after


# -- nobody to answer ------------------------------------------------------------------

# the reasons in parentheses are the library's wording, not checked word for word
NOBODY = re.compile(r"mplaunch: nobody can answer input\(\) in this rank here \(.*\)")


def skip_then_ask():
    rank = int(os.environ["RANK"])
    breakpoint()
    try:
        input("anyone? ")
    except EOFError as e:
        return rank, str(e)
    return rank, "answered"


def fail_in_rank_1():
    if int(os.environ["RANK"]) == 1:
        raise ValueError("fails in rank 1")
    return "ok"


def rank_of():
    return int(os.environ["RANK"])


def test_without_a_terminal_breakpoint_is_skipped_input_ends_and_debug_refuses(
        capfd, monkeypatch):
    monkeypatch.delenv("PYTHONBREAKPOINT", raising=False)
    monkeypatch.delenv("MPLAUNCH_POST_MORTEM", raising=False)
    if os.isatty(0):   # pytest's capture puts /dev/null there; not so under -s
        pytest.skip("this pytest's stdin is a terminal (pytest -s)")
    t0 = time.monotonic()
    with mplaunch.World(2, backend="gloo", timeout=30) as w:
        answers = w.run(skip_then_ask)
        assert [rank for rank, _ in answers] == [0, 1]
        for _, message in answers:
            assert NOBODY.fullmatch(message), message
        err = capfd.readouterr().err
        for r in (0, 1):
            assert (f"[rank{r}]: mplaunch: breakpoint() skipped in rank {r}: nobody can "
                    "answer its prompt here (" in err), err
        with pytest.raises(mplaunch.WorkerError):
            w.run(fail_in_rank_1)
        with pytest.raises(RuntimeError, match="nobody can answer"):
            w.debug()
        assert w.run(rank_of) == [0, 1]   # the World goes on
    assert time.monotonic() - t0 < 30
