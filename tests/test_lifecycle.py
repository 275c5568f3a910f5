"""Process lifecycle guarantees, proved with real processes: whatever a launch started
(ranks, their children, detached grandchildren, mplaunch's server) is gone when launch
returns, and within about a second of the launching process being SIGKILLed."""
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest

import mplaunch
from mplaunch._engine import servers as _procs

SCRIPTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts")
if SCRIPTS not in sys.path:
    sys.path.insert(0, SCRIPTS)

from proctree import (FORK_DETACHED, DetachedEscaped, describe,  # noqa: E402
                      tree_parent, wait_gone)

# Issue 2 promises "within about a second"; twice that still catches a regression to
# "whenever a watchdog next looks" (DataLoader workers poll their parent every 5 s).
KILL_BOUND_S = 2.0
GONE_DEADLINE_S = 5.0


@pytest.mark.parametrize("method", [
    "forkserver", "spawn",
    pytest.param("fork", marks=pytest.mark.xfail(raises=DetachedEscaped, strict=True,
                                                 reason=FORK_DETACHED)),
])
def test_sigkilled_parent_takes_everything_with_it(tmp_path, method):
    with tree_parent(tmp_path, method) as tp:
        records = tp.wait_ranks()
        tree_pids = {p.pid for p in tp.tree}
        servers = {p.pid for p in tp.servers()}
        assert servers, f"no mplaunch server below the parent:\n{describe(tp.tree)}"
        for rec in records:
            # Every kind of grandchild is there: a plain child, one in a session of its
            # own, and the two DataLoader workers.
            assert {rec["plain"], rec["detached"]} <= set(rec["descendants"])
            assert len(rec["descendants"]) >= 4, rec
            assert {rec["pid"], *rec["descendants"]} <= tree_pids
            expected_parent = servers if method != "fork" else {tp.proc.pid}
            assert rec["ppid"] in expected_parent, (rec, servers)
        detached_pids = {rec["detached"] for rec in records}
        detached = [p for p in tp.tree if p.pid in detached_pids]
        others = [p for p in tp.tree if p.pid not in detached_pids]

        killed_at = time.monotonic()
        os.kill(tp.proc.pid, signal.SIGKILL)
        elapsed, alive = wait_gone(others, GONE_DEADLINE_S, since=killed_at)
        assert tp.proc.wait() == -signal.SIGKILL
        assert not alive, (f"still running {elapsed:.2f} s after the launching process "
                           f"was SIGKILLed:\n{describe(alive)}\nparent log:\n{tp.log()}")
        assert elapsed < KILL_BOUND_S, (f"{len(others)} processes took {elapsed:.2f} s to "
                                        f"die after the launching process was SIGKILLed")
        elapsed, escaped = wait_gone(detached, GONE_DEADLINE_S, since=killed_at)
        if escaped:
            raise DetachedEscaped(f"still running {elapsed:.2f} s after the launching "
                                  f"process was SIGKILLed:\n{describe(escaped)}")
        assert elapsed < KILL_BOUND_S, (f"{len(tp.tree)} processes took {elapsed:.2f} s to "
                                        f"die after the launching process was SIGKILLed")
        print(f"{method}: {len(tp.tree)} processes gone {elapsed:.3f} s after SIGKILL")


def _run_script(name, *args, timeout=120):
    return subprocess.run([sys.executable, os.path.join(SCRIPTS, name), *args],
                          stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=timeout)


def _result_line(out):
    lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
    assert len(lines) == 1, out
    return json.loads(lines[0][len("RESULT "):])


@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_unguarded_main_script_runs_its_top_level_once(tmp_path, method):
    countfile = tmp_path / "top-level-runs"
    proc = _run_script("unguarded.py", method, str(countfile))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert _result_line(proc.stdout) == {"lambda": [0, 2], "closure": [108, 109]}
    # A rank that re-ran the script's top level would have appended its own line.
    assert len(countfile.read_text().splitlines()) == 1, countfile.read_text()


@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_environment_is_applied_before_the_function_is_unpickled(method):
    # fork is left out on purpose: a forked rank inherits this process's already
    # imported modules, so nothing is imported while unpickling. The ranks find
    # envcheck_mod on this process's sys.path (SCRIPTS, added above).
    import envcheck_mod
    assert envcheck_mod.RANK_AT_IMPORT is None
    before = dict(os.environ)
    out = mplaunch.launch(envcheck_mod.seen_at_import, nprocs=2, start_method=method,
                          env=lambda r: {"ENVCHECK_EXTRA": f"extra{r}"})
    assert out == [("0", "extra0", "0"), ("1", "extra1", "1")]
    assert dict(os.environ) == before
    assert not {"RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT",
                "ENVCHECK_EXTRA"} & set(os.environ)


def _threads():
    return len(os.listdir("/proc/self/task"))


def _fd_targets(pid="self"):
    out = set()
    for name in os.listdir(f"/proc/{pid}/fd"):
        try:
            out.add((int(name), os.readlink(f"/proc/{pid}/fd/{name}")))
        except OSError:
            pass
    return out


def _sems():
    return {n for n in os.listdir("/dev/shm") if n.startswith("sem.")}


def _descendants():
    # A server's idle pre-forked children are replaced as launches use them: they are
    # part of the server, not something a launch left behind.
    pool = set(_procs.idle_pool_pids())
    return {p.pid for p in psutil.Process().children(recursive=True)} - pool


def _fd_kinds(pid):
    """How many fds of each kind a process holds ('socket', 'pipe', a path...): the
    sockets to a server's idle children are new ones after each refill."""
    kinds = {}
    for _, target in _fd_targets(pid):
        kind = target.split(":[")[0]
        kinds[kind] = kinds.get(kind, 0) + 1
    return kinds


def _state():
    servers = sorted(_procs.server_pids())
    return {
        "fds": _fd_targets(), "threads": _threads(), "sems": _sems(),
        "descendants": _descendants(), "servers": servers,
        # A server lives across launches, so a leak there grows without bound too.
        "server_fds": {pid: _fd_kinds(pid) for pid in servers},
        "server_threads": {pid: len(os.listdir(f"/proc/{pid}/task")) for pid in servers},
    }


def _settled_state(timeout=10.0, still=5):
    """The state once it stops changing (the same `still` looks in a row, 0.1 s apart):
    a server closes a finished launch's channel, and reaps its ranks, a moment after
    launch has returned."""
    deadline = time.monotonic() + timeout
    last, same = _state(), 1
    while time.monotonic() < deadline and same < still:
        time.sleep(0.1)
        now = _state()
        same = same + 1 if now == last else 1
        last = now
    return last


def _back_to(before, timeout=10.0):
    """The state, once it is `before` again (or the last one seen, at `timeout`): two
    equal looks 0.1 s apart are no proof of a settled state on a loaded machine (a
    server held off the CPU longer reaps its finished ranks later), and a leak never
    goes back."""
    deadline = time.monotonic() + timeout
    now = _state()
    while now != before and time.monotonic() < deadline:
        time.sleep(0.1)
        now = _state()
    return now


@pytest.mark.parametrize("method,count", [
    pytest.param("forkserver", 200, marks=pytest.mark.slow),
    ("fork", 30),
])
def test_many_launches_in_a_row_leak_nothing(method, count):
    def rank_plus(i):
        return i + int(os.environ["RANK"])

    assert mplaunch.launch(rank_plus, (0,), 2, start_method=method) == [0, 1]
    before = _settled_state()
    for i in range(count):
        assert mplaunch.launch(rank_plus, (i,), 2, start_method=method) == [i, i + 1]
    assert _back_to(before) == before


def allreduce_scaled(scale):
    import torch
    import torch.distributed as dist
    dist.init_process_group("gloo")
    t = torch.tensor([float(dist.get_rank() + 1) * scale])
    dist.all_reduce(t)
    dist.destroy_process_group()
    return t.item(), os.environ["MASTER_PORT"]


def test_concurrent_launches_from_threads():
    n = 4
    results, errors = {}, {}
    barrier = threading.Barrier(n)

    def one(i):
        try:
            barrier.wait()
            results[i] = mplaunch.launch(allreduce_scaled, (i + 1.0,), 2, timeout=120)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors[i] = exc

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    ports = set()
    for i in range(n):
        (v0, p0), (v1, p1) = results[i]
        # A rank that joined another launch's group would sum other scales.
        assert v0 == v1 == 3.0 * (i + 1)
        assert p0 == p1
        ports.add(p0)
    assert len(ports) == n, results


def _start_time(pid):
    """The process's start time in clock ticks, or None: tells a pid from its reuse."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
    except OSError:
        return None
    if fields[0] in ("Z", "X"):
        return None
    return int(fields[19])


def leave_sleepers():
    plain = subprocess.Popen(["sleep", "60"])
    detached = subprocess.Popen(["sleep", "60"], start_new_session=True)
    return [(p.pid, _start_time(p.pid)) for p in (plain, detached)]


@pytest.mark.parametrize("method", ["forkserver", "spawn", "fork"])
def test_leftover_grandchildren_are_killed_when_launch_returns(method):
    out = mplaunch.launch(leave_sleepers, nprocs=2, start_method=method)
    assert len(out) == 2 and all(t is not None for rank in out for _, t in rank)
    plain = [pid for rank in out for pid, _ in rank[:1]]
    # launch returns once the leftovers were sent SIGKILL, not once they are dead (a
    # busy kernel takes a moment to act on it): a short deadline, not an instant check.
    deadline = time.monotonic() + 1.0
    while True:
        running = [pid for rank in out for pid, t in rank if _start_time(pid) == t]
        if not running or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    for pid in running:  # ours, checked by start time: leave nothing for the next test
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    assert not set(running) & set(plain), f"grandchildren left running: {running}"
    if running:
        raise DetachedEscaped(f"grandchildren in their own session left running: {running}")
