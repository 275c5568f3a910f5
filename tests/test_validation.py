"""Bad input is refused before any rank starts, with a message that says what to do."""
from __future__ import annotations

import errno
import os
import re
import socket
import sys
import threading

import psutil
import pytest

import mplaunch
from mplaunch._engine import group as _group, servers as _procs, spawners as _spawners


# Input is checked before torch is imported: these run under every Python that
# setup.cfg claims (.ci/other-pythons.sh), but for the few that get as far as ranks.
pytestmark = pytest.mark.no_torch


def ok(*args, **kwargs):
    return "ran"


def _trip(path):
    # Runs only where the argument is unpickled: in a rank.
    with open(path, "w") as f:
        f.write(str(os.getpid()))
    return path


class Tripwire:
    """An argument that leaves a file behind if any rank ever unpickles it."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (_trip, (self.path,))


@pytest.fixture
def refuses(monkeypatch, tmp_path):
    """refuses(exc_type, match, **launch_kwargs): launch() raises exc_type (message
    matching `match`) and no rank was started, nor any process but a warm server."""

    def started(self, *a, **kw):
        raise AssertionError("launch() went as far as starting ranks")

    # Before the group makes its selector and pipes, so the guard leaks nothing itself.
    monkeypatch.setattr(_group.RankGroup, "__init__", started)
    monkeypatch.setattr(_spawners, "fork_rank", started)
    wire = str(tmp_path / "rank-was-here")

    def check(exc_type, match, func=ok, args=None, **kwargs):
        if args is None:
            args = (Tripwire(wire),)
        before = {p.pid for p in psutil.Process().children(recursive=True)}
        with pytest.raises(exc_type, match=match) as info:
            mplaunch.launch(func, args, **kwargs)
        servers = set(_procs.server_pids()) | set(_procs.idle_pool_pids())
        new = [p for p in psutil.Process().children(recursive=True)
               if p.pid not in before and p.pid not in servers]
        assert not new, f"processes started: {new}"
        assert not os.path.exists(wire), "a rank unpickled the arguments"
        return info.value

    return check


# -- nprocs, func, args, kwargs ----------------------------------------------------------

@pytest.mark.parametrize("nprocs", [0, -1, 1.5, True, "2"])
def test_nprocs(refuses, nprocs):
    err = refuses((TypeError, ValueError), "nprocs must be a positive int", nprocs=nprocs)
    assert repr(nprocs) in str(err)


@pytest.mark.parametrize("func", [None, 42, "ok", ok(1)])
def test_func_not_callable(refuses, func):
    refuses(TypeError, "func must be callable.*pass the function itself", func=func)


@pytest.mark.parametrize("args", ["ab", b"ab", 5, {"a": 1}, {1, 2}])
def test_args_not_a_sequence(refuses, args):
    err = refuses(TypeError, r"args must be a tuple or list", args=args)
    assert "args=(x,)" in str(err)


def test_list_args_are_fine_up_to_the_rank(refuses):
    """The guard itself: valid input gets as far as starting ranks, and the fixture
    notices. Without this, every test here could pass for the wrong reason."""
    pytest.importorskip("torch")  # launches ranks
    with pytest.raises(AssertionError, match="starting ranks"):
        refuses(ValueError, "never", args=[1, 2])


@pytest.mark.parametrize("kwargs,match", [
    ([("a", 1)], "kwargs must be a dict"),
    ({1: "x"}, "kwargs keys must be strings"),
])
def test_kwargs(refuses, kwargs, match):
    refuses(TypeError, match, kwargs=kwargs)


# -- start method ------------------------------------------------------------------------

@pytest.mark.parametrize("method", ["Spawn", "threads", "", 3])
def test_unknown_start_method(refuses, method):
    err = refuses(ValueError, "unknown start_method", start_method=method)
    for known in ("'forkserver'", "'spawn'", "'fork'"):
        assert known in str(err)


def test_fork_refused_once_cuda_is_initialised(refuses, monkeypatch):
    pytest.importorskip("torch")  # launches ranks
    from mplaunch._engine import config
    monkeypatch.setattr(config, "cuda_initialized", lambda: True)
    err = refuses(RuntimeError, "start_method='fork' is refused: CUDA",
                  start_method="fork")
    assert "forkserver" in str(err) and "spawn" in str(err)
    # Only fork is refused: the other methods do not inherit this process's CUDA state.
    with pytest.raises(AssertionError, match="starting ranks"):
        refuses(RuntimeError, "never", start_method="spawn")


# -- env ---------------------------------------------------------------------------------

@pytest.mark.parametrize("env,match", [
    ({"A": 1}, r"'A': 1 is not str -> str.*str\(1\)"),
    ({"A": None}, r"'A': None is not str -> str"),
    ({1: "x"}, r"1: 'x' is not str -> str"),
    (lambda rank: {"A": rank}, r"env for rank 0: 'A': 0 is not str"),
    (lambda rank: {"A": "x"} if rank == 0 else {"B": 2.5}, r"env for rank 1: 'B': 2.5"),
    (lambda rank: ["A=x"], r"callable rank -> dict; for rank 0 it gave a list"),
    ("A=1", r"env must be a dict of str to str, or a callable"),
    ([("A", "1")], r"env must be a dict of str to str, or a callable"),
])
def test_env_values_must_be_strings(refuses, env, match):
    refuses(TypeError, match, env=env, nprocs=2)


@pytest.mark.parametrize("key", ["A=B", "", "A\0"])
def test_env_names_must_be_valid(refuses, key):
    refuses(ValueError, "is not a valid variable name", env={key: "1"})


# -- numbers -----------------------------------------------------------------------------

@pytest.mark.parametrize("port", [0, -1, 65536, 1.5, "29500", True])
def test_master_port_range(refuses, port):
    err = refuses(ValueError, r"master_port must be an int in 1-65535 \(or None",
                  master_port=port)
    assert repr(port) in str(err)


@pytest.mark.parametrize("value", [-1, -0.5, float("nan"), "1", True])
def test_grace_period(refuses, value):
    refuses(ValueError, "grace_period must be a number of seconds >= 0",
            grace_period=value)


@pytest.mark.parametrize("value", [0, 0.0, -1, float("nan"), "10"])
def test_timeout(refuses, value):
    refuses(ValueError, r"timeout must be a number of seconds .*None for no limit",
            timeout=value)


@pytest.mark.parametrize("kw,match", [
    # issue 18: accepted, or refused only after processes had started
    (dict(nprocs=10 ** 6), r"nprocs=1000000 is more ranks .*MPLAUNCH_MAX_NPROCS"),
    (dict(nprocs=2, ranks_filter=[99]), r"ranks_filter names local rank 99.*ranks 0-1"),
    (dict(nprocs=2, stdin_rank=5), r"stdin_rank=5 is not a rank of this launch"),
    (dict(grace_period=float("inf")), "grace_period must be .* finite"),
    (dict(max_restarts=-1), "max_restarts must be an int >= 0"),
    (dict(max_restarts=1.0), "max_restarts must be an int >= 0"),
    (dict(nnodes=0), "nnodes must be an int >= 1"),
    (dict(nnodes=2, node_rank=2, master_port=29500), r"node_rank must be an int in \[0, nnodes=2\)"),
    (dict(nnodes=2, node_rank=0), "every node must be given the same master_addr and master_port"),
    (dict(master_addr=""), "master_addr must be a host name or address"),
    (dict(prefix="{rnk}"), r"not a valid template.*\{rank\}"),
])
def test_other_values(refuses, kw, match):
    refuses(ValueError, match, **kw)


@pytest.mark.parametrize("kw,match", [
    (dict(prefix=5), "prefix must be a str template or None"),
    (dict(preload=[1]), r"preload must be a list of module names"),
    (dict(ranks_filter=["0"]), "ranks_filter must be a collection of local rank numbers"),
    (dict(log_dir=3), r"log_dir must be a directory path .* got int 3"),
])
def test_other_types(refuses, kw, match):
    refuses(TypeError, match, **kw)


def test_log_dir_that_is_a_file_or_unwritable(refuses, tmp_path):
    a_file = tmp_path / "f"
    a_file.write_text("")
    refuses(ValueError, "log_dir .* is not a directory", log_dir=str(a_file / "logs"))
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        if os.access(locked, os.W_OK):
            pytest.skip("this process may write anywhere (root)")
        refuses(ValueError, "log_dir .* is not writable", log_dir=str(locked / "logs"))
    finally:
        locked.chmod(0o700)


@pytest.mark.parametrize("where", ["/proc/mplaunch-logs", "/proc/self/mplaunch-logs",
                                   "/sys/mplaunch-logs/run"])
def test_log_dir_where_folders_cannot_be_made_is_refused_before_anything_starts(
        refuses, where):
    """/proc passes every permission check for root, then fails at the first mkdir: that
    used to be a raw FileNotFoundError after the ranks had been forked."""
    refuses(ValueError, "log_dir .* (cannot hold the ranks' log folders|is not writable)",
            log_dir=where)
    assert not os.path.exists(where)


def test_log_dir_is_made_by_the_check_and_holds_no_probe(tmp_path):
    from mplaunch._engine.checks import log_dir
    target = tmp_path / "a" / "b"
    assert log_dir(str(target)) == str(target)
    assert target.is_dir() and list(target.iterdir()) == []


# -- pickling ----------------------------------------------------------------------------

def test_unpicklable_argument_is_named(refuses):
    err = refuses(TypeError, r"could not pickle args\[1\] \(a lock\)",
                  args=(1, threading.Lock(), 3))
    assert "pass things that can be pickled" in str(err)
    assert isinstance(err.__cause__, TypeError)


def test_unpicklable_keyword_argument_is_named(refuses):
    refuses(TypeError, r"could not pickle kwargs\['lock'\] \(a lock\)",
            kwargs={"fine": 1, "lock": threading.Lock()})


def test_unpicklable_function_is_named(refuses):
    lock = threading.Lock()

    def uses_a_lock():
        with lock:
            return 1

    refuses(TypeError, r"could not pickle the function .*uses_a_lock", func=uses_a_lock)


def test_unpicklable_generator_argument(refuses):
    refuses(TypeError, r"could not pickle args\[0\] \(a generator\)",
            args=((i for i in range(3)),))


# -- the rendezvous port -----------------------------------------------------------------

def test_master_port_in_use(refuses):
    pytest.importorskip("torch")  # launches ranks
    taken = socket.socket()
    try:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        err = refuses(OSError, re.escape(f"master_port {port} on 127.0.0.1 is already in use"),
                      master_port=port)
        assert err.errno == errno.EADDRINUSE
        assert "master_port=None" in str(err)
    finally:
        taken.close()


# -- the public signature ----------------------------------------------------------------

def test_launch_shows_no_private_parameter():
    # The command line enters through an internal function, not a hidden keyword.
    import inspect
    params = inspect.signature(mplaunch.launch).parameters
    assert not [p for p in params if p.startswith("_")]
    assert "_script" not in mplaunch.launch.__doc__


def test_nprocs_auto_is_one_rank_per_cpu_without_gpus():
    pytest.importorskip("torch")
    from mplaunch._engine.env import cpu_count
    assert mplaunch.launch(os.getpid, nprocs="auto", preload=()).__len__() == cpu_count()


def test_unknown_keyword_of_start_and_world_says_what_was_meant(refuses):
    with pytest.raises(TypeError, match="did you mean 'timeout'"):
        mplaunch.start(ok, (), 2, timout=3)
    with pytest.raises(TypeError, match="did you mean 'grace_period'"):
        mplaunch.World(2, grace_perod=3)


@pytest.mark.no_torch
def test_launchs_keyword_defaults_are_the_engines():
    """launch()'s signature is where users read the defaults, OPTION_DEFAULTS is what
    start(), World and the command fill in: they must say the same."""
    import inspect

    from mplaunch._engine.config import OPTION_DEFAULTS
    params = inspect.signature(mplaunch.launch).parameters
    keywords = {name: p.default for name, p in params.items()
                if p.kind is inspect.Parameter.KEYWORD_ONLY}
    assert keywords == OPTION_DEFAULTS


# -- a World on Ray, before anything starts ----------------------------------------------

def test_a_ray_world_without_ray_installed_says_which_extra_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)     # import ray raises ImportError
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(ImportError, match=r"pip install 'mplaunch\[ray\]'"):
        mplaunch.World(2, nnodes=2, scheduler="ray")
    with pytest.raises(ValueError, match="scheduler must be one of 'slurm', 'ray'"):
        mplaunch.World(2, nnodes=2, scheduler="kubernetes")
    with pytest.raises(TypeError, match=r"ray_resources= is an option of scheduler='ray' "
                                        r"\(the Ray cluster .*'slurm'"):
        mplaunch.World(2, nnodes=2, ray_resources={"CPU": 2})
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= before | set(
        _procs.server_pids()) | set(_procs.idle_pool_pids())
