"""Issue 18: what an adversarial sweep found, each with real processes: World.run from
two threads, code execution through the store port, an exception lost with stderr,
daemons escaping a fork launch, large results, bad arguments, a deleted working
directory, and an unguarded script's DataLoader workers under the watcher."""
from __future__ import annotations

import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import psutil
import pytest

import mplaunch

HERE = os.path.dirname(os.path.abspath(__file__))
RUN_TIMEOUT = 150


def _clean_env(**extra):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("SLURM_") and k not in (
               "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
               "MASTER_PORT", "MPLAUNCH_TOKEN")}
    env.update(extra)
    return env


# -- 1. World.run from two threads ------------------------------------------------------

def _tagged(tag, i):
    time.sleep(0.001 * (i % 3))
    return (tag, i, int(os.environ["RANK"]))


def test_world_run_from_two_threads_never_mixes_results():
    wrong, errors = [], []
    with mplaunch.World(2, preload=()) as world:
        def calls(tag):
            try:
                for i in range(25):
                    got = world.run(_tagged, (tag, i))
                    if got != [(tag, i, 0), (tag, i, 1)]:
                        wrong.append((tag, i, got))
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(repr(exc))

        threads = [threading.Thread(target=calls, args=(t,)) for t in "AB"]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    assert not errors, errors
    assert not wrong, wrong[:3]


def _sleep_then(seconds):
    time.sleep(seconds)
    return "slept"


def _touch_then_sleep(path, seconds):
    open(path, "w").close()
    time.sleep(seconds)
    return "slept"


def test_world_close_from_another_thread_ends_a_running_call(tmp_path):
    world = mplaunch.World(1, preload=(), grace_period=1)
    world.start()
    pid = world.pids[0]
    outcome = []
    began = tmp_path / "began"

    def call():
        try:
            outcome.append(world.run(_touch_then_sleep, (str(began), 60)))
        except BaseException as exc:  # noqa: BLE001
            outcome.append(exc)

    t = threading.Thread(target=call)
    t.start()
    deadline = time.monotonic() + 30
    while not began.exists():   # the call runs in the rank (not a sleep's guess)
        assert time.monotonic() < deadline and t.is_alive(), outcome
        time.sleep(0.01)
    world.close()          # must not wait the 60 s out, nor break the call's loop
    t.join(30)
    assert not t.is_alive()
    assert outcome and isinstance(outcome[0], mplaunch.WorkerError), outcome
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == "zombie"
    with pytest.raises(RuntimeError, match="closed"):
        world.run(_sleep_then, (0,))


# -- 2. nothing read from the store is unpickled ----------------------------------------

NODE = os.path.join(HERE, "scripts_nodes", "node.py")


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Evil:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (exec, (f"open({self.path!r}, 'w').close()",))


def test_a_pickle_written_into_the_store_runs_no_code(tmp_path):
    from torch.distributed import TCPStore
    port = _free_port()
    marker = tmp_path / "pwned"
    ready = tmp_path / "ready"
    ready.mkdir()
    env = _clean_env(READY_DIR=str(ready))
    procs = [subprocess.Popen([sys.executable, NODE, str(n), str(port), "sleep"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=env) for n in (0, 1)]
    try:
        deadline = time.monotonic() + 120
        while len(os.listdir(ready)) < 4 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(os.listdir(ready)) == 4, "the two nodes' ranks did not start"
        # Anyone who can reach the port: a report first, then a claimed failure.
        client = TCPStore("127.0.0.1", port, 5, False, timeout=__import__(
            "datetime").timedelta(seconds=30))
        client.set("mplaunch/attempt_0/report", pickle.dumps(_Evil(str(marker))))
        client.set("mplaunch/attempt_0/failed", "0")
        del client
        out1, err1 = procs[1].communicate(timeout=120)
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.communicate()
    assert not marker.exists(), "a launcher unpickled what a store client wrote"
    assert '"error"' in out1, (out1, err1)   # node 1 still reports a failure


def test_node_reports_travel_as_json_and_are_signed_with_a_token(monkeypatch):
    from mplaunch._engine.tasks.sync import decode_report, encode_report
    from mplaunch._wire.messages import Raised
    from mplaunch.errors import RankFailure
    f = RankFailure(rank=3, local_rank=1, node_rank=1, hostname="h", pid=12, exitcode=1,
                    message="boom", traceback="tb text", exc_type="ValueError",
                    timestamp=1.5)
    monkeypatch.setenv("MPLAUNCH_TOKEN", "s3cret")
    raw = encode_report([f], Raised(b"a pickle stays home", "ValueError", "bad value",
                                    "tb text", 1, 2.5))
    assert b"pickle stays home" not in raw
    failures, error = decode_report(raw)
    assert failures == [f]
    assert error == Raised(None, "ValueError", "bad value", "tb text", 1, 2.5)
    monkeypatch.setenv("MPLAUNCH_TOKEN", "other")
    with pytest.raises(ValueError, match="MPLAUNCH_TOKEN"):
        decode_report(raw)
    with pytest.raises(ValueError, match="not a node report"):
        decode_report(pickle.dumps(_Evil("/nonexistent/x")))


# -- 3. the exception travels whatever stderr is ----------------------------------------

def _raise_without_stderr(how):
    if how == "none":
        sys.stderr = None
    else:
        os.close(2)
    raise ValueError(f"lost? {how}")


@pytest.mark.parametrize("how", ["none", "closed_fd"])
def test_exception_travels_when_stderr_is_unusable(how):
    with pytest.raises(mplaunch.WorkerError) as info:
        mplaunch.launch(_raise_without_stderr, (how,), nprocs=1, preload=())
    assert isinstance(info.value.__cause__, ValueError), info.value
    assert f"lost? {how}" in str(info.value)


# -- 4. a daemon started by a fork-mode rank ends with the launch --------------------------

def _start_daemon(pidfile, fail):
    pid = os.fork()
    if pid == 0:
        os.setsid()
        if os.fork() == 0:
            with open(pidfile + ".tmp", "w") as f:
                f.write(str(os.getpid()))
            os.rename(pidfile + ".tmp", pidfile)
            time.sleep(300)
        os._exit(0)
    os.waitpid(pid, 0)
    while not os.path.exists(pidfile):
        time.sleep(0.01)
    if fail:
        raise RuntimeError("rank fails after starting a daemon")
    return "started"


def _gone(pid):
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.mark.parametrize("fail", [False, True])
def test_fork_rank_daemon_does_not_outlive_launch(tmp_path, fail):
    pidfile = str(tmp_path / "daemon.pid")
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        if fail:
            with pytest.raises(mplaunch.WorkerError):
                mplaunch.launch(_start_daemon, (pidfile, fail), nprocs=1,
                                start_method="fork")
        else:
            assert mplaunch.launch(_start_daemon, (pidfile, fail), nprocs=1,
                                   start_method="fork") == ["started"]
        with open(pidfile) as f:
            daemon = int(f.read())
        deadline = time.monotonic() + 5
        while not _gone(daemon) and time.monotonic() < deadline:
            time.sleep(0.05)
        escaped = not _gone(daemon)
        if escaped:
            os.kill(daemon, signal.SIGKILL)   # ours to end, by pid
        assert not escaped, "the rank's daemon outlived the launch"
        # The user's own child is left alone: still running, still theirs to reap.
        assert bystander.poll() is None
    finally:
        bystander.kill()
        assert bystander.wait(10) == -signal.SIGKILL


BYSTANDER = r"""
import os, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
with open(sys.argv[1] + ".tmp", "w") as f:
    f.write(str(child.pid))
os.rename(sys.argv[1] + ".tmp", sys.argv[1])
while not os.path.exists(sys.argv[2]):
    time.sleep(0.01)
"""   # then exits: its child is orphaned while a fork launch runs


def _orphan_a_bystanders_child(go, bystander):
    open(go, "w").close()
    while not _gone(bystander):
        time.sleep(0.01)
    return "orphaned"


def test_fork_launch_leaves_orphans_of_the_users_own_children_alone(tmp_path):
    childfile, go = str(tmp_path / "child.pid"), str(tmp_path / "go")
    bystander = subprocess.Popen([sys.executable, "-c", BYSTANDER, childfile, go],
                                 start_new_session=True)
    grandchild = None
    try:
        while not os.path.exists(childfile):
            time.sleep(0.01)
        with open(childfile) as f:
            grandchild = int(f.read())
        assert mplaunch.launch(_orphan_a_bystanders_child, (go, bystander.pid), nprocs=1,
                               start_method="fork") == ["orphaned"]
        # Adopted by this process while it was a subreaper, but not the launch's to kill.
        assert not _gone(grandchild)
    finally:
        bystander.wait(30)
        if grandchild is not None:
            try:
                os.kill(grandchild, signal.SIGKILL)
            except ProcessLookupError:
                pass
            try:
                if psutil.Process(grandchild).ppid() == os.getpid():
                    os.waitpid(grandchild, 0)
            except psutil.NoSuchProcess:
                pass


def test_subreaper_setting_is_restored_after_a_fork_launch():
    from mplaunch._wire import linux as _sys
    before = _sys.get_child_subreaper()
    mplaunch.launch(_tagged, ("x", 0), nprocs=1, start_method="fork")
    assert _sys.get_child_subreaper() == before


# -- 5. large results cost about one copy -------------------------------------------------

def _big(kind, n):
    import numpy as np
    import torch
    if kind == "bytes":
        return b"\x07" * n
    if kind == "bytearray":
        return bytearray(b"\x05" * n)
    if kind == "numpy":
        return np.full(n // 8, 3.0)
    return {"list": [b"\x01" * n, np.arange(n // 8)], "t": torch.ones(n // 4)}


@pytest.mark.parametrize("kind", ["bytes", "bytearray", "numpy", "nested"])
def test_large_results_travel_outside_the_pickle_stream(kind):
    from mplaunch._wire.payload import dumps_result, loads_result
    value = _big(kind, 1 << 22)
    data, fds = dumps_result(value)
    try:
        assert len(data) < 4096, "a large result was copied into the pickle stream"
    finally:
        back = loads_result(data, fds)
    assert type(back) is type(value)


@pytest.mark.parametrize("kind", ["bytes", "bytearray", "numpy", "nested"])
def test_large_results_come_back_equal(kind):
    import numpy as np
    [got] = mplaunch.launch(_big, (kind, 1 << 21), nprocs=1, preload=())
    want = _big(kind, 1 << 21)
    assert type(got) is type(want)
    if kind == "numpy":
        assert got.dtype == want.dtype and np.array_equal(got, want)
        got[0] = 1.0   # writable, as an unpickled array is
    elif kind == "nested":
        assert got["list"][0] == want["list"][0]
        assert np.array_equal(got["list"][1], want["list"][1])
        assert bool((got["t"] == want["t"]).all())
    else:
        assert got == want


# -- 6. bad arguments refused before any process starts ----------------------------------

# (the refusals themselves are in test_validation.py, which proves nothing started)

def test_nprocs_limit_can_be_raised_from_the_environment(monkeypatch):
    from mplaunch._engine.config import resolve_nprocs
    monkeypatch.setenv("MPLAUNCH_MAX_NPROCS", "100000")
    assert resolve_nprocs(10 ** 5) == 10 ** 5
    monkeypatch.setenv("MPLAUNCH_MAX_NPROCS", "lots")
    with pytest.raises(ValueError, match="MPLAUNCH_MAX_NPROCS"):
        resolve_nprocs(2)


@pytest.mark.parametrize("timeout", [float("inf"), 1e12])
def test_huge_timeouts_mean_no_limit(timeout):
    assert mplaunch.launch(_tagged, ("t", 1), nprocs=1, preload=(),
                           timeout=timeout) == [("t", 1, 0)]


def test_world_run_with_an_infinite_timeout_overrides_the_worlds():
    with mplaunch.World(1, preload=(), timeout=0.5) as world:
        assert world.run(_sleep_then, (1.5,), timeout=float("inf")) == ["slept"]


def test_world_refuses_an_unknown_backend_before_starting():
    with pytest.raises(ValueError, match="backend 'bogus'.*gloo"):
        mplaunch.World(1, backend="bogus")
    with pytest.raises(ValueError, match="backend 'cpu:glooo'"):
        mplaunch.launch(_tagged, ("x", 0), backend="cpu:glooo")
    mplaunch.World(1, backend="gloo").close()


# -- 7. a deleted working directory ------------------------------------------------------

DELETED_CWD = r"""
import os, sys, tempfile
d = tempfile.mkdtemp()
os.chdir(d)
os.rmdir(d)
sys.path.insert(0, {root!r})
import mplaunch

def where():
    return os.getcwd()

try:
    print("RESULT", mplaunch.launch(where, nprocs=1, start_method=sys.argv[1]))
except Exception as exc:
    print("ERROR", type(exc).__name__, exc)
"""


@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_launch_from_a_deleted_working_directory(method):
    code = DELETED_CWD.format(root=os.path.dirname(HERE))
    p = subprocess.run([sys.executable, "-c", code, method], capture_output=True,
                       text=True, timeout=RUN_TIMEOUT, env=_clean_env())
    assert p.returncode == 0, (p.stdout, p.stderr)
    assert "RESULT" in p.stdout or "working directory" in p.stdout, (p.stdout, p.stderr)


# -- 8. the watcher: an unguarded script's DataLoader workers ------------------------------

@pytest.mark.parametrize("context", ["forkserver", "spawn"])
def test_watcher_dataloader_workers_do_not_rerun_an_unguarded_script(context):
    script = os.path.join(HERE, "scripts_cli", "unguarded_loader.py")
    p = subprocess.run([sys.executable, "-m", "mplaunch", "-n", "2", script, context],
                       capture_output=True, text=True, timeout=RUN_TIMEOUT,
                       env=_clean_env())
    totals = [l for l in p.stdout.splitlines() if "TOTAL" in l]
    assert p.returncode == 0, (p.stdout[-3000:], p.stderr[-3000:])
    # (0+1+4+9)*10 per rank, summed over 2 ranks; one line per rank, not per worker
    assert len(totals) == 2 and all("280.0" in l for l in totals), p.stdout
