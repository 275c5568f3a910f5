"""Every example in examples/ runs, with small settings, as a user would run it: in its
own interpreter, from the repository root."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import psutil
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")
RUN_TIMEOUT = 160  # below pytest's own 180 s, so a hang is reported as this run's

# What each test below runs; the guard test keeps new examples from going untested.
COVERED = {"allreduce.py", "ddp_dataloader.py", "restart_training.py", "train_script.py",
           "pytest_example"}


def run(*argv: str) -> subprocess.CompletedProcess:
    """Run a command to completion; subprocess.run kills and reaps it on timeout (and
    mplaunch's server then stops every rank it started, as its parent is gone)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PYTEST_", "MPLAUNCH_STORE"))}
    proc = subprocess.run([sys.executable, *argv], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=RUN_TIMEOUT, stdin=subprocess.DEVNULL)
    return proc


def explain(proc: subprocess.CompletedProcess) -> str:
    return (f"exit code {proc.returncode}\n--- stdout ---\n{proc.stdout[-4000:]}"
            f"\n--- stderr ---\n{proc.stderr[-4000:]}")


def gone(pids, within: float = 10.0) -> list:
    """The pids that are still running processes (not zombies) after `within` seconds."""
    deadline = time.monotonic() + within
    while True:
        alive = []
        for pid in pids:
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    alive.append(pid)
            except psutil.NoSuchProcess:
                pass
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.05)


def test_every_example_is_run_here():
    present = {name for name in os.listdir(EXAMPLES)
               if name.endswith(".py") or os.path.isdir(os.path.join(EXAMPLES, name))}
    present.discard("__pycache__")
    assert present == COVERED, "add a test for each new example (or drop a removed one)"


@pytest.mark.slow
def test_allreduce():
    proc = run("examples/allreduce.py")
    assert proc.returncode == 0, explain(proc)
    assert "results by rank: [10.0, 10.0, 10.0, 10.0]" in proc.stdout, explain(proc)
    for rank in range(4):
        assert f"[rank{rank}]: rank {rank}: all_reduce -> 10" in proc.stdout, explain(proc)


WORKER_PID = re.compile(r"^\[rank(\d)\]: DataLoader worker (\d) has pid (\d+)$", re.M)


@pytest.mark.slow
def test_ddp_dataloader_trains():
    proc = run("examples/ddp_dataloader.py", "--nprocs", "2", "--steps", "6")
    assert proc.returncode == 0, explain(proc)
    assert re.search(r"^\[rank0\]: step +5 +loss \d", proc.stdout, re.M), explain(proc)
    assert re.search(r"^final loss by rank: \[[\d.]+, [\d.]+\]$", proc.stdout, re.M), \
        explain(proc)
    workers = {(int(r), int(w)): int(pid) for r, w, pid in WORKER_PID.findall(proc.stdout)}
    assert set(workers) == {(0, 0), (0, 1), (1, 0), (1, 1)}, explain(proc)
    assert gone(workers.values()) == []


@pytest.mark.slow
def test_ddp_dataloader_failure_leaves_no_dataloader_worker():
    proc = run("examples/ddp_dataloader.py", "--nprocs", "2", "--steps", "6",
               "--fail-at-step", "2")
    assert proc.returncode == 1, explain(proc)
    assert "[rank1]: RuntimeError: injected failure at step 2" in proc.stderr, explain(proc)
    assert "launch raised WorkerError: rank 1 failed (RuntimeError: injected failure " \
           "at step 2)" in proc.stderr, explain(proc)
    # The example checked right after launch raised; check again from outside.
    assert "DataLoader workers started: 4; still alive: none" in proc.stderr, explain(proc)
    pids = [int(pid) for _r, _w, pid in WORKER_PID.findall(proc.stdout)]
    assert len(pids) == 4, explain(proc)
    assert gone(pids) == []
    assert "final loss" not in proc.stdout


@pytest.mark.slow
def test_restart_training_recovers_bitwise():
    proc = run("examples/restart_training.py", "--nprocs", "2", "--steps", "10",
               "--fail-at-step", "7")
    assert proc.returncode == 0, explain(proc)
    assert "[rank1]: rank 1: crashing on purpose at step 7" in proc.stdout, explain(proc)
    assert ("recovered run: attempt 1, resumed from step 5; parameters bitwise identical "
            "to the uninterrupted run: True") in proc.stdout, explain(proc)


@pytest.mark.slow
def test_train_script_under_the_watcher():
    proc = run("-m", "mplaunch", "--nprocs", "2", "examples/train_script.py", "--steps", "3")
    assert proc.returncode == 0, explain(proc)
    for rank in (0, 1):
        lines = re.findall(rf"^\[rank{rank}\]: rank {rank}/2 step (\d) loss \d", proc.stdout,
                           re.M)
        assert lines == ["0", "1", "2"], explain(proc)


@pytest.mark.slow
def test_train_script_failure_is_the_commands_exit_code():
    proc = run("-m", "mplaunch", "--nprocs", "2", "examples/train_script.py", "--steps", "5",
               "--fail-at-step", "1")
    assert proc.returncode == 3, explain(proc)
    assert "mplaunch: rank 1 (pid " in proc.stderr, explain(proc)
    assert "[rank1]: rank 1: giving up at step 1" in proc.stderr, explain(proc)
    assert "step 4" not in proc.stdout


@pytest.mark.slow
def test_train_script_alone_says_how_to_run_it():
    proc = run("examples/train_script.py", "--steps", "1")
    assert proc.returncode == 1, explain(proc)
    assert "python -m mplaunch --nprocs 2" in proc.stderr, explain(proc)


@pytest.mark.slow
def test_pytest_example():
    proc = run("-m", "pytest", "-p", "no:cacheprovider", "-W", "error", "-q",
               "examples/pytest_example")
    assert proc.returncode == 0, explain(proc)
    assert re.search(r"^5 passed in ", proc.stdout, re.M), explain(proc)
