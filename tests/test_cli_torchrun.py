"""The watcher for a user coming from torchrun: torchrun's flags, a summary that does not
repeat a relayed traceback, a clear word when torch is missing, and the typing marker."""
from __future__ import annotations

import importlib.resources
import os
import re
import shutil
import subprocess
import sys
import venv
import zipfile

import pytest

import mplaunch
from mplaunch import RankFailure, WorkerError
from mplaunch._cli import main as _cli, report as _cli_report
from test_cli import BARE, SCRIPTS, _env, explain, records, run_cli, summary

REPO = os.path.dirname(os.path.dirname(os.path.abspath(mplaunch.__file__)))
DOCS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs")


# -- 7: the summary does not repeat a relayed traceback ---------------------------------

def test_relayed_traceback_is_not_repeated_in_the_summary():
    proc = run_cli("-n", "2", *BARE, "--grace-period", "1", "fail.py", "raise")
    assert proc.returncode == 1, explain(proc)
    lines = summary(proc.stderr)
    assert lines[0].startswith("rank 1 ") and "raised ValueError: boom from rank 1" in lines[0]
    # once, relayed line by line as the rank raised...
    assert proc.stderr.count("Traceback (most recent call last):") == 1, explain(proc)
    assert "[rank1]: Traceback (most recent call last):" in proc.stderr.splitlines()
    # ...and the summary says where it is and where the exception was raised
    assert lines[1:] == [
        "rank 1's traceback is above (lines starting '[rank1]:'); raised at:",
        '  File "fail.py", line 13, in fail',
        '    raise ValueError("boom from rank 1")',
    ], explain(proc)


@pytest.mark.parametrize("hide", [["--local-ranks-filter", "0"], ["--no-relay"]],
                         ids=["filtered-out", "no-relay"])
def test_traceback_not_relayed_is_in_the_summary(hide, tmp_path):
    proc = run_cli("-n", "2", *BARE, "--grace-period", "1", *hide,
                   "--log-dir", str(tmp_path), "fail.py", "raise")
    assert proc.returncode == 1, explain(proc)
    assert "[rank1]:" not in proc.stderr, explain(proc)
    lines = summary(proc.stderr)
    assert lines[1] == "last lines of rank 1's stderr:", explain(proc)
    tail = "\n".join(lines[2:])
    assert "Traceback (most recent call last):" in tail, explain(proc)
    assert 'raise ValueError("boom from rank 1")' in tail, explain(proc)
    log = os.path.join(str(tmp_path), "attempt_0", "1", "stderr.log")
    assert lines[-1] == f"all of it is in {log}", explain(proc)


def _failure(**kw):
    tb = ('Traceback (most recent call last):\n'
          '  File "train.py", line 9, in <module>\n'
          '    main()\n'
          '  File "train.py", line 5, in main\n'
          '    loss = model(batch)\n'
          '           ^^^^^^^^^^^^\n'
          'RuntimeError: shapes do not match\n')
    fields = dict(rank=3, pid=10, exitcode=1, exc_type="RuntimeError",
                  message="shapes do not match", traceback=tb,
                  stderr_tail="epoch 1\n", local_rank=1, node_rank=1, hostname="n1")
    fields.update(kw)
    return RankFailure(**fields)


def _report(failure, shown, capsys):
    _cli_report.report_failure(WorkerError([failure]), 1, shown)
    return summary(capsys.readouterr().err)


def test_summary_for_a_relayed_traceback_in_process(capsys):
    shown = _cli_report.Shown(relay=True, node_rank=1, prefix="<{node_rank}.{local_rank}@{host}> ",
                       log_dir="logs")
    assert _report(_failure(), shown, capsys)[1:] == [
        "rank 3's traceback is above (lines starting '<1.1@n1>') and in "
        f"{os.path.join('logs', 'attempt_0', '1', 'stderr.log')}; raised at:",
        '  File "train.py", line 5, in main',
        "    loss = model(batch)",
    ]
    shown = _cli_report.Shown(relay=True, node_rank=1, prefix="")
    assert _report(_failure(), shown, capsys)[1] == "rank 3's traceback is above; raised at:"


@pytest.mark.parametrize("shown", [
    _cli_report.Shown(relay=True, node_rank=0),                      # it failed on another node
    _cli_report.Shown(relay=True, node_rank=1, ranks_filter=[0]),    # its output was filtered out
    _cli_report.Shown(relay=False, node_rank=1),                     # nothing was relayed
], ids=["other-node", "filtered", "no-relay"])
def test_summary_shows_a_traceback_that_was_not_relayed(shown, capsys):
    lines = _report(_failure(), shown, capsys)
    assert lines[1] == "last lines of rank 3's stderr:"
    assert lines[2:] == ["  " + line for line in
                         ("epoch 1\n" + _failure().traceback).rstrip("\n").split("\n")]


def test_summary_keeps_the_last_words_of_a_rank_that_raised_nothing(capsys):
    # A rank that exited or was killed printed no traceback: its last lines are short
    # and are the only clue, so they stay even when they were relayed.
    shown = _cli_report.Shown(relay=True, node_rank=1)
    failure = _failure(exc_type="SystemExit", message="3", exitcode=3,
                       stderr_tail="giving up at step 2\n")
    assert _report(failure, shown, capsys)[1:] == [
        "last lines of rank 3's stderr:", "  giving up at step 2"]


@pytest.mark.parametrize("tb,expected", [
    # chained: the last exception's innermost frame
    ('Traceback (most recent call last):\n  File "a.py", line 1, in f\n    x()\n'
     'KeyError: 1\n\nDuring handling of the above exception, another exception occurred:'
     '\n\nTraceback (most recent call last):\n  File "a.py", line 3, in g\n    raise E\n'
     'E\n', ['  File "a.py", line 3, in g', "    raise E"]),
    # an exception group's frames are drawn with '|'
    ('  + Exception Group Traceback (most recent call last):\n'
     '  |   File "g.py", line 2, in <module>\n  |     raise ExceptionGroup("x", [E()])\n'
     '  | ExceptionGroup: x (1 sub-exception)\n  +-+---------------- 1 ----------------\n'
     '    | E\n    +------------------------------------\n',
     ['  File "g.py", line 2, in <module>', '    raise ExceptionGroup("x", [E()])']),
    # no source line (a frame in C, or source not found)
    ('Traceback (most recent call last):\n  File "<string>", line 1, in <module>\n'
     'ValueError\n', ['  File "<string>", line 1, in <module>']),
    ("RuntimeError: no frames at all\n", []),
])
def test_raised_at(tb, expected):
    assert _cli_report._raised_at(tb) == expected


# -- 9: torchrun's flags ------------------------------------------------------------------

def _parse(argv):
    _, ns = _cli.parse_args(argv)
    return ns


@pytest.mark.parametrize("argv,expected", [
    (["--nproc-per-node", "3"], {}),
    (["--nproc_per_node=3"], {}),
    (["-n", "3", "--standalone", "--nnodes", "1"], {"nnodes": 1}),
    (["-n", "3", "--standalone"], {"nnodes": 1}),
    (["-n", "3", "--nnodes=2:2", "--node_rank=1", "--master_addr", "h",
      "--master_port=29500"],
     {"nnodes": 2, "node_rank": 1, "master_addr": "h", "master_port": 29500}),
    (["-n", "3", "--local-ranks-filter", "0,2"], {"ranks_filter": [0, 2]}),
    (["-n", "3", "--local_ranks_filter=1"], {"ranks_filter": [1]}),
    (["-n", "3", "--max_restarts", "2"], {"max_restarts": 2}),
    (["-n", "3", "--start_method", "spawn"], {"start_method": "spawn"}),
    (["-n", "3", "--log_dir", "d"], {"log_dir": "d"}),
    (["-n", "3", "--shutdown-timeout", "7"], {"grace_period": 7.0}),
    (["-n", "3", "--log-dir", "d", "--redirects", "3"], {"log_dir": "d", "relay": False}),
    (["-n", "3", "--log-dir", "d", "-r3"], {"log_dir": "d", "relay": False}),
    (["-n", "3", "-r", "0"], {}),
    (["-n", "3", "--log-dir", "d", "--tee", "3"], {"log_dir": "d"}),
    (["-n", "3", "--log-dir", "d", "-t", "0:1,1:2"], {"log_dir": "d"}),
    (["-n", "3", "-t", "0"], {}),
    (["-n", "3", "--signals_to_handle", "SIGTERM,SIGINT"], {}),
    (["-n", "3", "--no_relay", "--grace_period", "1", "--ranks_filter", "0"],
     {"relay": False, "grace_period": 1.0, "ranks_filter": [0]}),
])
def test_torchrun_flags_map_onto_options(argv, expected):
    ns = _parse(argv + ["train.py", "--nproc_per_node", "9", "--log_dir=x"])
    assert ns.nprocs == 3
    assert ns.target == "train.py"
    assert ns.args == ["--nproc_per_node", "9", "--log_dir=x"]  # the script's, untouched
    assert _cli._launch_kwargs(ns) == {"relay": True, "max_restarts": 0, **expected}
    assert ns.notes == []


def test_nproc_per_node_counts():
    from mplaunch._engine.env import cpu_count
    assert _parse(["--nproc-per-node", "cpu", "t.py"]).nprocs == cpu_count()
    assert _parse(["--nproc_per_node", "auto", "t.py"]).nprocs >= 1


@pytest.mark.parametrize("argv,note", [
    (["--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0", "--rdzv_id", "7",
      "--rdzv-conf", "a=1"],
     "note: --rdzv-backend, --rdzv-endpoint, --rdzv-id, --rdzv-conf ignored: one node "
     "needs no rendezvous"),
    (["--monitor_interval", "0.1"], "note: --monitor-interval ignored: mplaunch waits"),
    (["--role", "trainer"], "note: --role ignored"),
    (["--run-path"], "note: --run-path ignored"),
    (["--local-addr", "10.0.0.1"], "note: --local-addr ignored"),
    (["--event-log-handler", "null"], "note: --event-log-handler ignored"),
])
def test_torchrun_flags_ignored_with_a_note(argv, note):
    ns = _parse(["-n", "2", *argv, "t.py"])
    assert _cli._launch_kwargs(ns) == {"relay": True, "max_restarts": 0}
    assert len(ns.notes) == 1 and ("note: " + ns.notes[0]).startswith(note), ns.notes


@pytest.mark.parametrize("mode", ["node", "socket", "exclusive", "core-complex"])
def test_numa_binding_is_cpus_per_rank(mode):
    ns = _parse(["-n", "2", "--numa_binding", mode, "t.py"])
    assert _cli._launch_kwargs(ns)["cpus"] == "per-rank"
    assert len(ns.notes) == 1 and "is --cpus per-rank" in ns.notes[0], ns.notes
    assert ("do not share" in ns.notes[0]) == (mode != "exclusive")


def test_backend_gpus_and_cpus_flags_go_to_launch():
    ns = _parse(["-n", "2", "--backend", "nccl", "--gpus", "1,0", "--cpus", "per-rank",
                 "t.py"])
    kw = _cli._launch_kwargs(ns)
    assert (kw["backend"], kw["gpus"], kw["cpus"]) == ("nccl", [1, 0], "per-rank")
    assert _cli._launch_kwargs(_parse(["-n", "2", "--gpus", "per-rank", "t.py"]))[
        "gpus"] == "per-rank"


@pytest.mark.parametrize("argv,message", [
    (["--no-python"], "--no-python is not supported: each rank runs Python"),
    (["--no_python"], "--no-python is not supported"),
    (["--virtual-local-rank"], "--gpus per-rank gives each rank one GPU"),
    (["--numa-binding", "everywhere"], "torchrun's modes are node, socket, exclusive"),
    (["--logs-specs", "x"], "--log-dir DIR writes"),
    (["--duplicate-stdout-filters", "a,b"], "grep the --log-dir files"),
    (["--duplicate_stderr_filters", "a"], "grep the --log-dir files"),
    (["--nnodes", "2", "--node-rank", "0", "--rdzv-backend", "c10d", "--rdzv-endpoint",
      "h:29400"], "no rendezvous backend; give every node --nnodes N --node-rank I"),
    (["--nnodes", "1:4"], "no elastic MIN:MAX range"),
    (["--standalone", "--nnodes", "2"], "--standalone is a single node"),
    (["--standalone", "--master-port", "29500"], "drop --master-port"),
    (["--redirects", "3"], "add --log-dir DIR"),
    (["--log-dir", "d", "--redirects", "1"], "cannot redirect one stream"),
    (["--log-dir", "d", "-r", "0:3,1:3"], "cannot redirect one stream"),
    (["--tee", "3"], "add --log-dir DIR"),
    (["--signals-to-handle", "SIGTERM,SIGUSR1"], "cannot forward SIGUSR1"),
    (["--nproc", "2"], "unrecognized arguments: --nproc (did you mean --nprocs?)"),
    (["--nproc-per-nod", "2"], "(did you mean --nproc-per-node?)"),
    (["--local-rank-filter", "0"], "(did you mean --local-ranks-filter?)"),
    (["--max_restart=2"], "unrecognized arguments: --max-restart=2 (did you mean "
                          "--max-restarts?)"),
    (["--standalon"], "(did you mean --standalone?)"),
    (["--rdzv-endpont", "h"], "(did you mean --rdzv-endpoint?)"),
])
def test_refused_with_one_line_that_says_what_to_use(argv, message, capsys):
    if "-n" not in argv and not any(a.startswith("--nproc") for a in argv):
        argv = ["-n", "2"] + argv
    with pytest.raises(SystemExit) as info:
        _parse(argv + ["t.py"])
    assert info.value.code == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("usage: mplaunch"), err
    assert len(err) == 2 and err[1].startswith("mplaunch: error: "), err
    assert message in err[1], err


def test_unknown_flag_with_nothing_close():
    assert _cli._did_you_mean(_cli.build_parser(), "--xyzzy") == ""


def _torchrun_flags():
    from torch.distributed.run import get_args_parser
    flags = set()
    for action in get_args_parser()._actions:
        for opt in action.option_strings:
            flags.add(opt)
    return flags


def test_every_torchrun_flag_is_understood():
    """Each flag torch's torchrun has is an mplaunch option, mapped, ignored with a note
    or refused with a message: none is an unknown argument."""
    parser = _cli.build_parser()
    known = parser._option_string_actions
    missing = [f for f in sorted(_torchrun_flags()) if _cli._normalize(f) not in known]
    assert not missing, f"torchrun flags mplaunch does not know: {missing}"


def test_every_torchrun_flag_is_in_the_docs_table():
    with open(os.path.join(DOCS, "watcher.rst")) as f:
        text = f.read()
    section = text[text.index("Coming from torchrun"):]
    longs = {_cli._normalize(f) for f in _torchrun_flags() if f.startswith("--")}
    longs -= {"--help"}
    missing = sorted(f for f in longs if f"``{f}" not in section)
    assert not missing, f"docs/watcher.rst 'Coming from torchrun' lacks {missing}"


def test_torchrun_command_line_runs():
    """A command line as written for torchrun, underscores and all."""
    proc = run_cli("--nproc_per_node=2", "--standalone", "--nnodes=1", *BARE,
                   "--local_ranks_filter=1", "--monitor_interval=1", "argv_dump.py",
                   "--nproc_per_node=5")
    assert proc.returncode == 0, explain(proc)
    got = records(proc.stdout, "ARGV")
    assert sorted(got) == [1], explain(proc)  # rank 0 ran, but was filtered out
    assert got[1]["world"] == 2 and got[1]["argv"] == ["argv_dump.py", "--nproc_per_node=5"]
    assert summary(proc.stderr) == [
        "note: --monitor-interval ignored: mplaunch waits on the ranks' exits and output, "
        "it does not poll"], explain(proc)


# -- without torch ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def python_without_torch(tmp_path_factory):
    """A real virtual environment with mplaunch and its pure-Python dependencies on
    PYTHONPATH, and no torch: what a user gets with pip install mplaunch --no-deps, or
    the wrong venv activated."""
    root = tmp_path_factory.mktemp("notorch")
    venv.create(root / "venv", with_pip=False, symlinks=True)
    deps = root / "deps"
    deps.mkdir()
    import cloudpickle
    import tblib
    for mod in (cloudpickle, tblib):
        (deps / mod.__name__).symlink_to(os.path.dirname(mod.__file__))
    python = str(root / "venv" / "bin" / "python")
    env = _env(PYTHONPATH=os.pathsep.join([REPO, str(deps)]))
    check = subprocess.run([python, "-c", "import torch"], env=env, capture_output=True)
    assert check.returncode != 0, "torch is importable in the test's bare venv"
    return python, env


def test_without_torch_one_line_and_nothing_started(python_without_torch):
    python, env = python_without_torch
    proc = subprocess.run([python, "-m", "mplaunch", "-n", "2", *BARE, "argv_dump.py"],
                          cwd=SCRIPTS, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, explain(proc)
    assert proc.stdout == "", explain(proc)
    assert proc.stderr.splitlines() == [
        f"mplaunch: error: torch is not installed in this Python ({python}); install it "
        "with pip install torch (mplaunch hosts the ranks' store with torch.distributed)"
    ], explain(proc)


def test_without_torch_help_still_works(python_without_torch):
    python, env = python_without_torch
    proc = subprocess.run([python, "-m", "mplaunch", "--help"], cwd=SCRIPTS, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, explain(proc)
    assert "coming from torchrun:" in proc.stdout


# -- 12: typing -----------------------------------------------------------------------------

def test_py_typed_is_in_the_package():
    assert importlib.resources.files("mplaunch").joinpath("py.typed").is_file()


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    """mplaunch's wheel, built from a copy of the source (so the work tree gets no
    build/ or egg-info)."""
    root = tmp_path_factory.mktemp("wheel")
    src = root / "src"
    src.mkdir()
    for name in ("setup.cfg", "setup.py", "pyproject.toml", "README.md"):
        shutil.copy(os.path.join(REPO, name), src)
    shutil.copytree(os.path.join(REPO, "mplaunch"), src / "mplaunch",
                    ignore=shutil.ignore_patterns("__pycache__"))
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps",
                           "--no-build-isolation", "--no-index", "-q", "-w",
                           str(root / "out"), str(src)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, explain(proc)
    (whl,) = (root / "out").glob("mplaunch-*.whl")
    return whl


def test_wheel_ships_py_typed(wheel):
    with zipfile.ZipFile(wheel) as whl:
        assert "mplaunch/py.typed" in whl.namelist()


_TYPED_USER = '''
import mplaunch
from mplaunch import RankFailure, WorkerError

def work(x: int) -> int:
    return x

try:
    reveal_type(mplaunch.launch(work, (1,), nprocs=2))
    reveal_type(mplaunch.start(work, (1,), nprocs=2).result())
    reveal_type(mplaunch.World(2).run(work, (1,)))
except WorkerError as err:
    first: RankFailure = err.failures[0]
    reveal_type(err.failures)
    reveal_type(first.describe())
'''


def test_mypy_reads_the_installed_package(wheel, tmp_path):
    """With the wheel installed, mypy uses mplaunch's annotations instead of skipping it
    as an untyped package."""
    try:
        import mypy  # noqa: F401
    except ImportError:
        pytest.skip("mypy is not installed (pip install -e '.[test]' installs it)")
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=False, symlinks=True)
    python = env_dir / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()"
                           "['purelib'])"], capture_output=True, text=True, check=True)
    with zipfile.ZipFile(wheel) as whl:
        whl.extractall(site.stdout.strip())
    (tmp_path / "user.py").write_text(_TYPED_USER)
    # mypy and its dependencies on the path, not mplaunch's source: mplaunch must be
    # found where pip put it, as a user's type checker would find it.
    env = {k: v for k, v in os.environ.items() if k not in ("MYPYPATH", "PYTHONPATH")}
    env["PYTHONPATH"] = os.path.dirname(os.path.dirname(os.path.abspath(mypy.__file__)))
    proc = subprocess.run([sys.executable, "-m", "mypy", "--python-executable", str(python),
                           "--cache-dir", str(tmp_path / "cache"), "--no-error-summary",
                           "user.py"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert "py.typed" not in out and "import-untyped" not in out, out
    revealed = [t.replace("builtins.", "") for t in
                re.findall(r'Revealed type is "([^"]+)"', out)]
    # launch's, start's and World.run's results follow the function's return type.
    assert revealed == ["list[int]", "list[int]", "list[int]",
                        "list[mplaunch.errors.RankFailure]", "str"], out
