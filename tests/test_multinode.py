"""Two nodes on one machine: two separate processes each calling launch() with 2 ranks,
node 0 hosting the store on a fixed port."""
import json
import os
import socket
import subprocess
import sys
import time

import pytest

import mplaunch
from mplaunch._engine.tasks.slurm import first_host, layout

NODE = os.path.join(os.path.dirname(__file__), "scripts_nodes", "node.py")


def _port():
    # The test itself must pick a port both nodes agree on; mplaunch never does this.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def nodes():
    """Starts node processes; whatever happens, each is ended and reaped."""
    started = []

    def start(rank, port, mode, ready_dir=None):
        env = dict(os.environ, READY_DIR=str(ready_dir or ""))
        p = subprocess.Popen([sys.executable, NODE, str(rank), str(port), mode],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=env)
        started.append(p)
        return p

    yield start
    for p in started:
        if p.poll() is None:
            p.kill()
        p.communicate()


def _result(proc, timeout=150):
    out, err = proc.communicate(timeout=timeout)
    lines = [l for l in out.splitlines() if l.startswith("{")]
    assert lines, f"node printed no result (rc {proc.returncode}):\n{out}\n{err}"
    return json.loads(lines[-1])


def test_all_reduce_across_two_nodes(nodes):
    port = _port()
    started = [nodes(0, port, "ok"), nodes(1, port, "ok")]
    r0, r1 = (_result(p) for p in started)
    # sum of 1..4 on every rank; global ranks node_rank*2+local
    assert r0["ok"] == [[10.0, 0, 0, 0, 4], [10.0, 1, 1, 0, 4]]
    assert r1["ok"] == [[10.0, 2, 0, 1, 4], [10.0, 3, 1, 1, 4]]


def test_failure_on_node_one_ends_node_zero_with_the_same_error(nodes):
    port = _port()
    started = [nodes(0, port, "fail"), nodes(1, port, "fail")]
    r0, r1 = (_result(p) for p in started)
    assert r0 == r1, (r0, r1)
    assert r0["rank"] == 3
    assert r0["cause"] == "RuntimeError"
    assert r0["cause_msg"] == "rank 3 fails on purpose"


def test_node_started_late_still_joins(nodes):
    port = _port()
    n0 = nodes(0, port, "ok")
    time.sleep(3)
    n1 = nodes(1, port, "ok")
    assert _result(n0)["ok"][0][0] == 10.0
    assert _result(n1)["ok"][1][1] == 3


def test_slurm_layout_is_read_from_srun_variables():
    env = {"SLURM_JOB_ID": "1234", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "2",
           "SLURM_PROCID": "1", "SLURM_JOB_NODELIST": "gpu[07-08]"}
    assert layout(env) == {"nnodes": 2, "node_rank": 1, "master_addr": "gpu07",
                           "master_port": 20000 + 1234 % 20000}
    assert layout({"SLURM_JOB_ID": "1"}) is None  # an allocation, not an srun step
    assert first_host("a,b") == "a"
    assert first_host("node[001-004,010],login1") == "node001"
    assert first_host("x[3]") == "x3"


def task_pid():
    return os.environ.get("SLURM_TASK_PID"), os.getpid()


@pytest.mark.parametrize("start_method", ["forkserver", "spawn", "fork"])
def test_in_a_slurm_step_each_rank_has_its_own_slurm_task_pid(monkeypatch, start_method):
    # srun gives each task its own pid there; a rank is a task of its own (as its
    # SLURM_PROCID says), not the launching process whose environment it copies.
    monkeypatch.setenv("SLURM_TASK_PID", str(os.getpid()))
    got = mplaunch.launch(task_pid, nprocs=2, start_method=start_method)
    assert [t for t, _ in got] == [str(pid) for _, pid in got], got
    assert str(os.getpid()) not in [t for t, _ in got]


def test_nnodes_needs_a_master_port():
    with pytest.raises(ValueError, match="master_port"):
        mplaunch.launch(print, nprocs=1, nnodes=2, node_rank=0)
    with pytest.raises(ValueError, match="node_rank"):
        mplaunch.launch(print, nprocs=1, nnodes=2, node_rank=2, master_port=1234)


def test_a_signal_to_one_node_ends_the_others_with_a_worker_error(nodes, tmp_path):
    import signal
    port = _port()
    n0 = nodes(0, port, "sleep", tmp_path)
    n1 = nodes(1, port, "sleep", tmp_path)
    ready = tmp_path  # the ranks of node.py "sleep" mode touch files here
    deadline = time.monotonic() + 120
    while len(list(ready.glob("ready-*"))) < 4 and time.monotonic() < deadline:
        time.sleep(0.1)
    n1.send_signal(signal.SIGINT)
    r0 = _result(n0)
    r1 = _result(n1)
    assert r1 == {"main_process_error": "SIGINT"}
    assert "node 1's launcher received SIGINT" in r0["error"], r0
