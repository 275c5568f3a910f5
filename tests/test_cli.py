"""The `mplaunch` command, run as a real subprocess with real signals.

Most runs pass --preload '' so that ranks which do not use torch are forked from a bare
server (the command itself still imports torch, to host the store)."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import psutil
import pytest

from mplaunch import RankFailure
from mplaunch._cli import main as _cli, report as _cli_report, targets as _cli_targets

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPTS = os.path.join(HERE, "scripts_cli")
BARE = ("--preload", "")
RUN_TIMEOUT = 150


def _env(**extra):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("SLURM_") and k not in (
               "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
               "MASTER_PORT", "TORCHELASTIC_ERROR_FILE")}
    env.update(extra)
    return env


def _command(args, exe=None):
    return ([sys.executable, "-m", "mplaunch"] if exe is None else [exe]) + list(args)


def run_cli(*args, cwd=SCRIPTS, exe=None, env=None):
    return subprocess.run(_command(args, exe), cwd=cwd, env=env or _env(),
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          timeout=RUN_TIMEOUT)


def records(stdout, tag, prefix=r"\[rank(\d+)\]: "):
    """{rank: json} from the lines the helper scripts print as 'TAG {json}'."""
    out = {}
    for line in stdout.splitlines():
        m = re.match(prefix + re.escape(tag) + r" (.*)$", line)
        if m:
            out[int(m.group(1))] = json.loads(m.group(2))
    return out


def summary(stderr):
    """The command's own lines on stderr (the ranks' are prefixed [rankN]: )."""
    return [line[len("mplaunch: "):] for line in stderr.splitlines()
            if line.startswith("mplaunch: ")]


def explain(proc):
    return f"rc={proc.returncode}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"


# -- running things ----------------------------------------------------------------------

def test_script_with_gloo_prefixes_each_ranks_output():
    proc = run_cli("-n", "2", "gloo_sum.py")
    assert proc.returncode == 0, explain(proc)
    lines = proc.stdout.splitlines()
    assert "[rank0]: rank 0 of 2 sum 3" in lines, explain(proc)
    assert "[rank1]: rank 1 of 2 sum 3" in lines, explain(proc)
    assert summary(proc.stderr) == [], explain(proc)


def test_script_sees_its_own_argv_and_path(tmp_path):
    sub = tmp_path / "sub"
    sub.mkdir()
    shutil.copy(os.path.join(SCRIPTS, "argv_dump.py"), sub)
    script_args = ["--lr", "0.1", "-n", "5", "--", "--x", "-m", "y", "--nprocs=9"]
    proc = run_cli("-n", "2", *BARE, "sub/argv_dump.py", *script_args, cwd=tmp_path)
    assert proc.returncode == 0, explain(proc)
    got = records(proc.stdout, "ARGV")
    assert sorted(got) == [0, 1], explain(proc)
    for rank, rec in got.items():
        assert rec["rank"] == rank and rec["world"] == 2
        # what `python sub/argv_dump.py ARGS` would give it
        assert rec["argv"] == ["sub/argv_dump.py"] + script_args
        assert rec["name"] == "__main__"
        assert rec["path0"] == str(sub)
        assert not rec["cwd_in_path"]  # the command's own sys.path[0] is not the script's


def test_module_flag_runs_module_as_main():
    proc = run_cli("-n", "2", *BARE, "-m", "cli_pkg.argv_mod", "x", "--y")
    assert proc.returncode == 0, explain(proc)
    got = records(proc.stdout, "MOD")
    assert sorted(got) == [0, 1], explain(proc)
    for rec in got.values():
        assert rec["argv"] == [os.path.join(SCRIPTS, "cli_pkg", "argv_mod.py"), "x", "--y"]
        assert rec["path0"] == SCRIPTS  # python -m puts the current directory first


def test_function_target_gets_argv():
    proc = run_cli("-n", "2", *BARE, "cli_pkg.entry:main", "a", "-b", "--", "c")
    assert proc.returncode == 0, explain(proc)
    got = records(proc.stdout, "ENTRY")
    assert sorted(got) == [0, 1], explain(proc)
    for rec in got.values():
        assert rec["argv"] == ["cli_pkg.entry:main", "a", "-b", "--", "c"]


def test_function_returning_int_is_the_exit_code():
    proc = run_cli("-n", "2", *BARE, "cli_pkg.entry:exit_four_in_rank_one")
    assert proc.returncode == 4, explain(proc)
    assert summary(proc.stderr)[0].startswith("rank 1 "), explain(proc)


def test_console_script(tmp_path):
    exe = os.path.join(os.path.dirname(sys.executable), "mplaunch")
    if not os.path.exists(exe):
        exe = shutil.which("mplaunch")
    assert exe, "the mplaunch console script is not installed (pip install -e .)"
    bindir = os.path.dirname(os.path.abspath(exe))
    proc = run_cli("-n", "2", *BARE, "argv_dump.py", "a", exe=exe,
                   env=_env(CLI_TEST_WATCHER_DIR=bindir))
    assert proc.returncode == 0, explain(proc)
    got = records(proc.stdout, "ARGV")
    assert sorted(got) == [0, 1], explain(proc)
    for rec in got.values():
        assert rec["argv"] == ["argv_dump.py", "a"]
        assert not rec["watcher_dir_in_path"]  # the console script's bin/ is not theirs


def test_options_reach_launch(tmp_path):
    logs = tmp_path / "logs"
    proc = run_cli("-n", "2", *BARE, "--start-method", "spawn", "--prefix", "<{rank}> ",
                   "--ranks-filter", "1", "--log-dir", str(logs), "--grace-period", "1",
                   "argv_dump.py")
    assert proc.returncode == 0, explain(proc)
    assert sorted(records(proc.stdout, "ARGV", prefix=r"<(\d+)> ")) == [1], explain(proc)
    assert "ARGV" in (logs / "attempt_0" / "0" / "stdout.log").read_text()


# -- failures ----------------------------------------------------------------------------

def test_failing_rank_exit_code_is_the_commands():
    proc = run_cli("-n", "2", *BARE, "--grace-period", "1", "fail.py", "exit", "3")
    assert proc.returncode == 3, explain(proc)
    lines = summary(proc.stderr)
    assert lines and lines[0].startswith("rank 1 "), explain(proc)
    assert "exiting with 3" in lines[0], explain(proc)


def test_raised_exception_exits_1_with_traceback_relayed():
    proc = run_cli("-n", "2", *BARE, "--grace-period", "1", "fail.py", "raise")
    assert proc.returncode == 1, explain(proc)
    lines = summary(proc.stderr)
    assert lines[0].startswith("rank 1 ") and "raised ValueError: boom from rank 1" in lines[0], \
        explain(proc)
    # the rank's own stderr was relayed, traceback and all (the summary does not repeat
    # it: see test_cli_torchrun.py)
    assert "[rank1]: ValueError: boom from rank 1" in proc.stderr.splitlines(), explain(proc)
    assert "[rank1]: Traceback (most recent call last):" in proc.stderr.splitlines()


@pytest.mark.parametrize("signame", ["SIGKILL", "SIGSEGV"])
def test_rank_killed_by_signal_exits_128_plus_signo(signame):
    proc = run_cli("-n", "2", *BARE, "--grace-period", "1", "fail.py", "signal", signame)
    signo = getattr(signal, signame)
    assert proc.returncode == 128 + signo, explain(proc)
    lines = summary(proc.stderr)
    assert lines[0].startswith("rank 1 ") and f"killed by {signame}" in lines[0], explain(proc)
    assert "  about to die" in lines, explain(proc)  # the tail of its stderr


def test_max_restarts_reports_every_attempt():
    proc = run_cli("-n", "2", *BARE, "--grace-period", "1", "--max-restarts", "1",
                   "fail.py", "exit", "3")
    assert proc.returncode == 3, explain(proc)
    lines = summary(proc.stderr)
    assert "[attempt 1]" in lines[0], explain(proc)
    assert any(line.startswith("earlier attempt 0: rank 1 ") for line in lines), explain(proc)


@pytest.mark.slow
def test_timeout_exits_124_with_stacks():
    proc = run_cli("-n", "2", *BARE, "--timeout", "8", "--grace-period", "1", "stuck.py")
    assert proc.returncode == 124, explain(proc)
    lines = summary(proc.stderr)
    assert "timed out after 8 s" in lines[0], explain(proc)
    text = "\n".join(lines)
    # both at the same line: one stack, under both ranks
    assert "ranks 0, 1:" in lines, explain(proc)
    assert text.count("in stuck_here") == 1, explain(proc)
    assert text.count("time.sleep(600)") == 1, explain(proc)


# -- signals to the command ------------------------------------------------------------

def _wait_for_files(directory, n, proc, deadline_s=RUN_TIMEOUT):
    deadline = time.monotonic() + deadline_s
    while True:
        names = [f for f in os.listdir(directory) if not f.endswith(".tmp")]
        if len(names) >= n:
            return names
        if proc.poll() is not None or time.monotonic() > deadline:
            return None
        time.sleep(0.05)


def _not_gone(procs, deadline_s=10.0):
    """Those still running after a deadline (a zombie is dead: only its parent's wait is
    missing)."""
    deadline = time.monotonic() + deadline_s
    while True:
        alive = []
        for p in procs:
            try:
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    alive.append(p)
            except psutil.NoSuchProcess:
                pass
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.05)


@pytest.mark.parametrize("signame,code", [("SIGTERM", 143), ("SIGINT", 130)])
def test_signal_to_command_tears_everything_down(tmp_path, signame, code):
    proc = subprocess.Popen(_command(["-n", "2", *BARE, "--grace-period", "2",
                                      "pids_and_sleep.py", str(tmp_path)]),
                            cwd=SCRIPTS, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        names = _wait_for_files(tmp_path, 2, proc)
        if names is None:
            proc.kill()
            out, err = proc.communicate()
            pytest.fail(f"the ranks never started; rc={proc.returncode}\n{out}\n{err}")
        watched = []
        for name in names:
            for pid in (tmp_path / name).read_text().split():
                watched.append(psutil.Process(int(pid)))  # a rank and its grandchild
        watched += psutil.Process(proc.pid).children(recursive=True)  # and the server
        proc.send_signal(getattr(signal, signame))
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == code, f"rc={proc.returncode}\n{out}\n{err}"
    assert f"received {signame}" in "\n".join(summary(err)), err
    assert not _not_gone(watched), [p.pid for p in _not_gone(watched, 0)]


# -- bad command lines -----------------------------------------------------------------

@pytest.mark.parametrize("args,message", [
    (["nope.py"], "can't open file"),
    (["-m", "no_such_module_xyz"], "no module named 'no_such_module_xyz'"),
    (["-m", "cli_pkg"], "no __main__ module"),
    (["no_such_pkg_xyz.mod:main"], "no module named 'no_such_pkg_xyz'"),
    (["cli_pkg.entry:nope"], "has no attribute 'nope'"),
    (["cli_pkg.entry:not_callable"], "not a function"),
    (["--nprocs", "0", "argv_dump.py"], "must be at least 1"),
    (["--bogus", "argv_dump.py"], "unrecognized arguments"),
    ([], "required"),
])
def test_bad_command_line_exits_2_before_starting_anything(args, message):
    if "--nprocs" not in args:
        args = ["-n", "2"] + args
    proc = subprocess.Popen(_command(args), cwd=SCRIPTS, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    seen = set()
    try:
        me = psutil.Process(proc.pid)
        while proc.poll() is None:
            try:
                seen.update(p.pid for p in me.children(recursive=True))
            except psutil.NoSuchProcess:
                break
            time.sleep(0.005)
        out, err = proc.communicate(timeout=RUN_TIMEOUT)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 2, f"{out}\n{err}"
    assert "mplaunch: error:" in err and message in err, err
    assert not seen, f"processes were started: {seen}"


# -- multi-node ------------------------------------------------------------------------

def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_nodes_on_loopback():
    port = str(_free_port())
    procs = [subprocess.Popen(_command(["-n", "1", "--nnodes", "2", "--node-rank", str(i),
                                        "--master-addr", "127.0.0.1", "--master-port", port,
                                        "gloo_sum.py"]),
                              cwd=SCRIPTS, env=_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
             for i in (0, 1)]
    results = []
    try:
        for p in procs:
            results.append(p.communicate(timeout=RUN_TIMEOUT))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    for i, (p, (out, err)) in enumerate(zip(procs, results)):
        assert p.returncode == 0, f"node {i}: rc={p.returncode}\n{out}\n{err}"
        assert f"[rank{i}]: rank {i} of 2 sum 3" in out.splitlines(), f"{out}\n{err}"


# -- in-process: the command line and exit codes ---------------------------------------

@pytest.mark.parametrize("argv,target,rest", [
    (["-n", "2", "t.py", "--lr", "1"], "t.py", ["--lr", "1"]),
    (["-n", "2", "t.py", "-n", "5", "--", "x"], "t.py", ["-n", "5", "--", "x"]),
    (["-n", "2", "--", "t.py", "--", "x"], "t.py", ["--", "x"]),
    (["-n2", "--timeout=3", "t.py"], "t.py", []),
    (["--nprocs", "2", "--prefix", "", "--no-relay", "t.py", "a"], "t.py", ["a"]),
    (["-n", "2", "-m", "pkg.mod", "-m", "z"], "pkg.mod", ["-m", "z"]),
    (["-n", "2", "--", "-odd.py"], "-odd.py", []),
])
def test_split_at_the_target(argv, target, rest):
    _, ns = _cli.parse_args(argv)
    assert ns.target == target
    assert ns.args == rest
    assert ns.nprocs == 2


def test_nprocs_auto():
    _, ns = _cli.parse_args(["-n", "auto", "t.py"])
    assert isinstance(ns.nprocs, int) and ns.nprocs >= 1


def test_options_map_to_launch_arguments():
    _, ns = _cli.parse_args(["-n", "3", "--start-method", "spawn", "--prefix", "",
                             "--no-relay", "--ranks-filter", "0,2", "--log-dir", "d",
                             "--timeout", "1.5", "--max-restarts", "2",
                             "--grace-period", "0", "--preload", "torch,numpy",
                             "--nnodes", "2", "--node-rank", "1", "--master-addr", "h",
                             "--master-port", "29500", "t.py"])
    assert _cli._launch_kwargs(ns) == {
        "start_method": "spawn", "prefix": "", "relay": False, "ranks_filter": [0, 2],
        "log_dir": "d", "timeout": 1.5, "max_restarts": 2, "grace_period": 0.0,
        "preload": ["torch", "numpy"], "nnodes": 2, "node_rank": 1, "master_addr": "h",
        "master_port": 29500}
    _, ns = _cli.parse_args(["-n", "1", "t.py"])
    # what is not given is left to launch (and to its SLURM detection)
    assert _cli._launch_kwargs(ns) == {"relay": True, "max_restarts": 0}


@pytest.mark.parametrize("exitcode,signame,expected", [
    (3, None, 3), (1, None, 1), (-11, "SIGSEGV", 139), (-9, "SIGKILL", 137),
    (0, None, 1), (None, None, 1),
])
def test_exit_code_of(exitcode, signame, expected):
    assert _cli_report.exit_code_of(RankFailure(1, 123, exitcode, signame)) == expected


@pytest.fixture
def cli_pkg_importable(monkeypatch):
    monkeypatch.syspath_prepend(SCRIPTS)
    yield
    for name in ("cli_pkg.entry", "cli_pkg"):
        sys.modules.pop(name, None)


def test_entry_point_in_process(monkeypatch, cli_pkg_importable):
    monkeypatch.setattr(sys, "argv", ["pytest"])
    monkeypatch.setenv("RANK", "1")
    assert _cli_targets.EntryPoint("cli_pkg.entry", "Tool.run", ["t", "a"])() is None
    assert sys.argv == ["t", "a"]
    with pytest.raises(SystemExit) as info:
        _cli_targets.EntryPoint("cli_pkg.entry", "exit_four_in_rank_one", ["t"])()
    assert info.value.code == 4
    monkeypatch.setenv("RANK", "0")
    assert _cli_targets.EntryPoint("cli_pkg.entry", "exit_four_in_rank_one", ["t"])() is None
