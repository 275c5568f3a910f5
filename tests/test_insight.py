"""Seeing inside running and failed ranks (issue 17), with real ranks.

Stacks on demand (Handle.stacks, World.stacks, the command's SIGUSR1) while a run goes
on; several ranks' stacks grouped; the collective each rank is in and which ranks are
behind; frames whose source cannot be read; peak memory and the OOM killer; a dead
server named; and the two messages that used to mislead (a closed result channel, an
unpicklable return value).
"""
from __future__ import annotations

import os
import pickle
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time

import psutil
import pytest

import mplaunch
from mplaunch import RankFailure
from timeout_ranks import (barrier_but_rank_1_sleeps, file_rendezvous_barrier,
                           subgroup_rank_missing)

try:
    from test_notebook import kernel_config  # noqa: F401 - a fixture
except ImportError:  # no nbclient: the notebook test skips
    @pytest.fixture
    def kernel_config():
        pytest.skip("needs nbclient and ipykernel")

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def _wait_for(path, timeout=120.0):
    """Poll for a file a rank writes (a flag, not a timing assertion)."""
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise AssertionError(f"{path} never appeared")
        time.sleep(0.02)


def _stacks_in_the_loop(ask, nranks, timeout=30.0):
    """`ask()`'s stacks once every rank is in waits_for_go's loop: its flag comes a
    line before the loop, and a loaded machine may hold a rank between the two (asked
    again, as a user would; the last answer at `timeout`)."""
    deadline = time.monotonic() + timeout
    while True:
        stacks = ask()
        if all("os.access(go, os.F_OK)" in stacks.get(r, "") for r in range(nranks)) \
                or time.monotonic() > deadline:
            return stacks
        time.sleep(0.05)


# -- ranks --------------------------------------------------------------------------------

def one_rank_lags(flagdir):
    """Every rank runs three all_reduces; rank 1 then waits for a file before the fourth,
    which the others are already blocked in."""
    import torch
    import torch.distributed as dist
    dist.init_process_group("gloo")
    t = torch.ones(1)
    for _ in range(3):
        dist.all_reduce(t)
    rank = dist.get_rank()
    open(os.path.join(flagdir, f"ready{rank}"), "w").close()
    if rank == 1:
        while not os.path.exists(os.path.join(flagdir, "go")):
            time.sleep(0.02)
    dist.all_reduce(t)
    dist.destroy_process_group()
    return rank


def waits_for_go(flagdir):
    rank = int(os.environ["RANK"])
    open(os.path.join(flagdir, f"ready{rank}"), "w").close()
    go = os.path.join(flagdir, "go")
    # One line of C calls only (os.path.exists is Python): whenever the stacks are read,
    # every rank is at the same line with the same frames.
    while not os.access(go, os.F_OK): time.sleep(0.02)  # noqa: E701
    return rank


def big_then_sigkill(nbytes):
    block = bytearray(nbytes)
    for i in range(0, nbytes, 4096):
        block[i] = 1  # resident, not merely reserved
    os.kill(os.getpid(), signal.SIGKILL)


def sleeps():
    time.sleep(600)


def closes_its_fds():
    os.closerange(3, 1024)
    return 1


def returns_a_lock():
    lock = threading.Lock()
    return lock


# -- 1. stacks on demand --------------------------------------------------------------------

def test_handle_stacks_while_running_from_another_thread(tmp_path):
    """Asked from a thread of ours while start()'s monitor thread drives the ranks:
    the ranks go on and return; the stacks say where each was, grouped, with the
    collective each is in and which rank is behind."""
    with mplaunch.start(one_rank_lags, (str(tmp_path),), nprocs=4) as handle:
        for rank in range(4):
            _wait_for(tmp_path / f"ready{rank}")
        # A rank's flag comes just before its next line: asked again until ranks 0, 2
        # and 3 are in the fourth collective and rank 1 in its sleep (a loaded machine
        # may hold a rank between the two)
        deadline = time.monotonic() + 30
        while True:
            got = {}
            asker = threading.Thread(target=lambda: got.update(stacks=handle.stacks()))
            asker.start()
            asker.join()
            stacks = got["stacks"]
            if (all("collective 4 of its default group" in stacks.get(r, "")
                    for r in (0, 2, 3)) and "time.sleep(0.02)" in stacks.get(1, "")) \
                    or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert not handle.done()
        open(tmp_path / "go", "w").close()
        assert handle.result() == [0, 1, 2, 3]  # nothing was stopped
    assert sorted(stacks) == [0, 1, 2, 3]
    for rank in (0, 2, 3):
        assert "dist.all_reduce(t)" in stacks[rank], stacks[rank]
        assert "in torch.distributed.all_reduce: collective 4 of its default group" \
            in stacks[rank], stacks[rank]
    assert "time.sleep(0.02)" in stacks[1]
    assert "in no collective; its default group has started 3" in stacks[1]
    text = str(stacks)
    assert text.startswith("collectives: rank 1 is at collective 3; ranks 0, 2, 3 wait "
                           "in 4\n"), text
    # identical stacks once, under their ranks, the biggest group first
    assert text.count("dist.all_reduce(t)") == 1, text
    assert text.index("\nranks 0, 2, 3:\n") < text.index("\nrank 1:\n"), text
    assert "mplaunch/_" not in text  # none of mplaunch's own frames


def test_stacks_for_8_ranks_without_stopping_them(tmp_path):
    with mplaunch.start(waits_for_go, (str(tmp_path),), nprocs=8, preload=()) as handle:
        for rank in range(8):
            _wait_for(tmp_path / f"ready{rank}")
        stacks = _stacks_in_the_loop(handle.stacks, 8)
        assert sorted(stacks) == list(range(8))
        text = str(stacks)
        assert text.startswith("ranks 0-7:\n"), text
        assert text.count("in waits_for_go") == 1, text
        open(tmp_path / "go", "w").close()
        assert handle.result() == list(range(8))
    assert handle.stacks() == {}  # ended: nothing to ask


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_stacks_in_every_start_method(tmp_path, start_method):
    with mplaunch.start(waits_for_go, (str(tmp_path),), nprocs=2,
                        start_method=start_method) as handle:
        for rank in range(2):
            _wait_for(tmp_path / f"ready{rank}")
        stacks = _stacks_in_the_loop(handle.stacks, 2)
        open(tmp_path / "go", "w").close()
        assert handle.result() == [0, 1]
    assert str(stacks).startswith("ranks 0, 1:\n"), str(stacks)
    assert "in waits_for_go" in stacks[0]


def test_world_stacks_while_another_thread_runs(tmp_path):
    """World.run drives its loop in the caller's thread; stacks() from another thread
    reads the ranks without disturbing that run."""
    with mplaunch.World(2, preload=()) as world:
        out = {}
        runner = threading.Thread(target=lambda: out.update(
            result=world.run(waits_for_go, (str(tmp_path),))))
        runner.start()
        try:
            for rank in range(2):
                _wait_for(tmp_path / f"ready{rank}")
            stacks = _stacks_in_the_loop(world.stacks, 2)
        finally:
            open(tmp_path / "go", "w").close()
            runner.join()
        assert out["result"] == [0, 1]
        assert sorted(stacks) == [0, 1]
        assert "in waits_for_go" in stacks[0] and stacks[0] == stacks[1]
        assert str(stacks).startswith("ranks 0, 1:\n")
        # between runs the ranks wait in mplaunch's own code, and say so
        idle = world.stacks()
        assert "between calls" in idle[0], idle[0]
        assert world.run(int, ("5",)) == [5, 5]


# -- 2. grouped in a timeout's message -------------------------------------------------------

@pytest.mark.slow
def test_timeout_message_groups_identical_stacks():
    with pytest.raises(mplaunch.LaunchTimeout) as info:
        mplaunch.launch(barrier_but_rank_1_sleeps, nprocs=4, timeout=10, grace_period=1)
    text = str(info.value)
    assert "\nranks 0, 2, 3:\n" in text, text
    assert "\nrank 1:\n" in text, text
    assert text.count("dist.barrier()") == 1, text
    assert text.index("ranks 0, 2, 3:") < text.index("rank 1:")
    assert "in torch.distributed.barrier: collective 1 of its default group" in text
    assert "collectives: rank 1 is at collective 0; ranks 0, 2, 3 wait in 1" in text
    # each rank's own entry is still there, and it all survives pickling
    assert "time.sleep(600)" in info.value.stacks[1]
    again = pickle.loads(pickle.dumps(info.value))
    assert str(again) == text


def test_a_collective_whose_number_cannot_be_read_says_so(tmp_path):
    with pytest.raises(mplaunch.LaunchTimeout) as info:
        mplaunch.launch(file_rendezvous_barrier, (str(tmp_path / "rdzv"),), nprocs=2,
                        timeout=8, grace_period=1)
    assert info.value.stacks[0].startswith(
        "in torch.distributed.barrier: collective number unknown (the rank did not "
        "report it)\n"), info.value.stacks[0]
    assert "collective" not in info.value.stacks[1]  # it is in none, and says nothing
    assert "collectives:" not in str(info.value)     # nothing to compare


# -- 4. frames without source ----------------------------------------------------------------

def test_frames_of_a_function_from_python_c_are_shown():
    code = textwrap.dedent("""
        import time, mplaunch
        def stuck_in_c_code():
            time.sleep(600)
        try:
            mplaunch.launch(stuck_in_c_code, nprocs=1, timeout=5, grace_period=1,
                            preload=())
        except mplaunch.LaunchTimeout as err:
            print(err)
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=150, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert re.search(r'File "<string>", line 4, in stuck_in_c_code', proc.stdout), \
        proc.stdout


# -- 5. memory ------------------------------------------------------------------------------

@pytest.mark.parametrize("start_method", ["forkserver", "fork"])
def test_peak_rss_of_a_rank_killed_by_sigkill(start_method):
    size = 200 * 1024 * 1024
    with pytest.raises(mplaunch.WorkerError) as info:
        mplaunch.launch(big_then_sigkill, (size,), nprocs=1, start_method=start_method,
                        preload=())
    failure = info.value.failures[0]
    assert failure.signal == "SIGKILL"
    assert failure.max_rss >= size, failure.max_rss
    text = str(info.value)
    assert re.search(r"was killed by SIGKILL \(exit code -9, peak RSS \d+\.\d MiB\)",
                     text), text
    # not attributed without evidence, but memory is named, with how to check
    assert "OOM killer killed" not in text
    assert "running out of memory is a common cause" in text and "dmesg" in text
    again = pickle.loads(pickle.dumps(failure))
    assert again == failure and again.max_rss == failure.max_rss


def test_a_rank_failure_pickled_before_max_rss_existed_still_loads():
    class Old:
        # what RankFailure.__reduce__ produced before the field: 13 positional values
        def __reduce__(self):
            return (RankFailure, (1, 123, -9, "SIGKILL", None, None, None, None, 0, 1.0,
                                  1, 0, "host"))

    failure = pickle.loads(pickle.dumps(Old()))
    assert isinstance(failure, RankFailure)
    assert failure.max_rss is None and failure.hostname == "host"
    assert pickle.loads(pickle.dumps(failure)) == failure
    assert "peak RSS" not in failure.describe()


def _memory_cgroup_parent():
    """A memory cgroup directory we may make children in, or the reason we cannot."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError as exc:
        return None, f"/proc/self/cgroup unreadable: {exc}"
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            base = "/sys/fs/cgroup/memory" + path.rstrip("/")
            limit = "memory.limit_in_bytes"
            break
    else:
        base = "/sys/fs/cgroup" + [l for l in lines if l.startswith("0::")][0][3:].rstrip("/")
        limit = "memory.max"
    if not os.access(base, os.W_OK):
        return None, f"{base} is not writable here"
    return (base, limit), None


OOM_SCRIPT = """
import os, sys, mplaunch
sys.path.insert(0, {here!r})
with open(os.path.join({cg!r}, "cgroup.procs"), "w") as f:
    f.write(str(os.getpid()))
from test_insight import allocates_forever
try:
    mplaunch.launch(allocates_forever, nprocs=1, preload=())
except mplaunch.WorkerError as err:
    print(err)
"""


def allocates_forever():
    blocks = []
    while True:
        blocks.append(bytearray(16 * 1024 * 1024))
        for i in range(0, len(blocks[-1]), 4096):
            blocks[-1][i] = 1


@pytest.mark.slow
def test_the_oom_killer_is_named_when_the_kernel_says_so():
    where, why = _memory_cgroup_parent()
    if where is None:
        pytest.skip(f"no memory cgroup can be made here: {why}")
    base, limit = where
    cg = os.path.join(base, f"mplaunch-test-oom-{os.getpid()}")
    # Room for the launching process and the server, each with torch imported (a CUDA
    # build is twice a CPU build's size), so that the rank is the biggest when the limit
    # is reached and the one the kernel kills: 600 MiB failed with torch 2.14's CUDA build.
    room = 600 * 1024 * 1024 + 2 * psutil.Process().memory_info().rss
    try:
        os.mkdir(cg)
        with open(os.path.join(cg, limit), "w") as f:
            f.write(str(room))
    except OSError as exc:
        pytest.skip(f"no memory cgroup can be made here: {exc}")
    try:
        proc = subprocess.run([sys.executable, "-c", OOM_SCRIPT.format(here=HERE, cg=cg)],
                              capture_output=True, text=True, timeout=170, cwd=ROOT)
    finally:
        for _ in range(100):
            try:
                os.rmdir(cg)
                break
            except OSError:
                time.sleep(0.05)  # its last process is still leaving
    assert "was killed by SIGKILL (exit code -9, peak RSS" in proc.stdout, \
        proc.stdout + proc.stderr
    assert "OOM killer killed" in proc.stdout, proc.stdout + proc.stderr


# -- 6. a dead server -----------------------------------------------------------------------

def test_a_dead_server_is_named(tmp_path):
    handle = mplaunch.start(sleeps, nprocs=2, preload=())
    try:
        server = psutil.Process(handle.pids[0]).ppid()
        assert server != os.getpid()
        os.kill(server, signal.SIGKILL)
        with pytest.raises(mplaunch.WorkerError) as info:
            handle.result(timeout=60)
    finally:
        handle.stop()
    text = str(info.value)
    assert (f"mplaunch's server process (pid {server}) was killed by SIGKILL, and every "
            "rank was killed with it; the next launch starts a new server") in text, text
    # and it does
    assert mplaunch.launch(int, ("3",), nprocs=2, preload=()) == [3, 3]


# -- 7. messages that used to mislead ---------------------------------------------------------

def test_a_rank_that_closed_its_result_channel_is_told_so():
    with pytest.raises(mplaunch.WorkerError) as info:
        mplaunch.launch(closes_its_fds, nprocs=1, preload=())
    text = str(info.value)
    assert "closed its result channel before it returned" in text, text
    assert "os._exit(0)" not in text


def test_an_unpicklable_return_value_is_located_at_the_return():
    with pytest.raises(mplaunch.WorkerError) as info:
        mplaunch.launch(returns_a_lock, nprocs=1, preload=())
    failure = info.value.failures[0]
    line = returns_a_lock.__code__.co_firstlineno + 2
    assert failure.location == f"tests/test_insight.py:{line} in returns_a_lock" or \
        failure.location.endswith(f"test_insight.py:{line} in returns_a_lock"), \
        failure.location
    assert "could not be pickled" in str(info.value)


# -- the watcher command --------------------------------------------------------------------

WATCHED = """
import os, sys, time
rank = os.environ["RANK"]
flagdir = sys.argv[1]
def wait_here():
    open(os.path.join(flagdir, "ready" + rank), "w").close()
    go = os.path.join(flagdir, "go")
    while not os.access(go, os.F_OK): time.sleep(0.02)  # one line: both ranks on it
wait_here()
"""


def test_the_command_prints_stacks_on_sigusr1_and_goes_on(tmp_path):
    script = tmp_path / "watched.py"
    script.write_text(WATCHED)
    proc = subprocess.Popen([sys.executable, "-m", "mplaunch", "-n", "2", "--preload", "",
                             str(script), str(tmp_path)], cwd=str(tmp_path),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for rank in range(2):
            _wait_for(tmp_path / f"ready{rank}")
        proc.send_signal(signal.SIGUSR1)
        # the stacks are read before their heading is printed (one write): the flag
        # then lets the ranks finish (waiting for a line of the stack itself would
        # hang where a rank was in os.access, not in the sleep)
        lines = []
        for line in proc.stderr:
            lines.append(line)
            if "SIGUSR1: where each rank is now" in line:
                break
        open(tmp_path / "go", "w").close()
        err = proc.stderr.read()   # the rest, with what the line reader holds already
        proc.wait(timeout=120)
    finally:
        open(tmp_path / "go", "w").close()
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        proc.stdout.close()
        proc.stderr.close()
    err = "".join(lines) + err
    assert proc.returncode == 0, err
    assert "mplaunch: SIGUSR1: where each rank is now (the launch goes on)" in err, err
    assert "mplaunch: ranks 0, 1:" in err, err
    assert "in wait_here" in err, err


# -- %ranks stacks in a real kernel ----------------------------------------------------------

@pytest.mark.notebook
def test_ranks_stacks_magic_in_a_kernel(kernel_config, tmp_path):
    import asyncio

    from nbformat.v4 import new_code_cell, new_notebook
    from test_notebook import _errors, _stream, run_cells

    sources = {
        "load": "%load_ext mplaunch\n%ranks start 2 --backend none",
        "spin": ("%%ranks\n"
                 "import threading, time\n"
                 "def spins_in_the_background():\n"
                 "    time.sleep(600)\n"
                 "threading.Thread(target=spins_in_the_background, daemon=True).start()"),
        "stacks": "%ranks stacks",
        "stop": "%ranks stop",
    }
    cells = run_cells(sources, kernel_config, tmp_path)
    for name, cell in cells.items():
        assert not _errors(cell), (name, cell.outputs)
    out = _stream(cells["stacks"])
    assert out.startswith("ranks 0, 1:\n"), out
    assert out.count("in spins_in_the_background") == 1, out
    assert "between calls" in out, out  # the main thread waits for the next cell


def test_a_rank_missing_from_a_subgroups_collective_is_named_in_that_group():
    # The timeout's report covers every group: rank 0 waits in collective 17 of the
    # pair's group (not of the default one, where it is at 16 like rank 1), and the
    # rank missing there is named with its stack.
    with pytest.raises(mplaunch.LaunchTimeout) as info:
        mplaunch.launch(subgroup_rank_missing, (), nprocs=4, timeout=8)
    text = str(info.value)
    assert "collectives: ranks 0, 1 are at collective 16; ranks 2, 3 wait in 17\n" in text
    assert ("collectives of group 1 (ranks 0, 1): rank 1 is at collective 16; rank 0 "
            "waits in 17\n") in text, text
    rank0 = text[text.index("\nrank 0:\n"):]
    assert rank0.startswith("\nrank 0:\n  in torch.distributed.all_reduce: collective 17 "
                            "of group 1\n"), text
    assert "# PAIR-17" in rank0.split("\nrank")[1], text
    assert "# RANK-1-ELSEWHERE" in text[text.index("\nrank 1:\n"):], text
