"""pytest plugin (registered through the pytest11 entry point): distributed tests.

``@pytest.mark.mplaunch(nprocs=2, timeout=60)`` runs the test function's body in every
rank, with ``torch.distributed`` initialised (``backend="gloo"`` by default,
``backend=None`` for none) and destroyed when the body returns (a failed rank just
exits); any other keyword goes to
:func:`mplaunch.launch` (``start_method``, ``env``, ``grace_period``, ...). The test
passes only when every rank passes. Parametrized arguments and fixture values are
pickled and sent to the ranks, so they must be picklable (``tmp_path`` is;
``monkeypatch`` and ``capsys`` are not).

Outcomes, decided by the first rank to fail (the others are stopped then, and what
fails in them afterwards is most often a consequence, a collective that lost a peer):

- a rank raised: the test fails with that rank's exception, with its traceback in the
  rank and a note naming the rank (and the ranks that failed after it);
- ``pytest.skip`` / ``pytest.xfail`` / ``pytest.fail`` in a rank: the test is skipped /
  xfailed / failed, whatever the other ranks were doing;
- past ``timeout`` seconds: the test fails with :class:`mplaunch.LaunchTimeout`, whose
  message shows where each rank was waiting; every rank is killed, the session goes on.

Assertions in the ranks are pytest's rewritten ones: the test module is pickled by value
(its rewritten code, as imported by this session), so a failing ``assert`` shows the
compared values. ``pytest_assertrepr_compare`` hooks of conftest files do not run in
the ranks; pytest's own detailed comparisons (lists, dicts, strings) do.

``nprocs=[1, 2, 4]`` runs the test once per size (ids such as ``test_x[nprocs=2]``). A
test whose ``backend`` is on CUDA (``"nccl"``), or that gives ``gpus=``, and needs more
GPUs than the machine has is skipped with the counts, never failed.

The ``mplaunch`` fixture is :func:`mplaunch.launch` with the test's defaults (``nprocs``
and ``timeout`` from the marker, else from the ``mplaunch_nprocs`` and
``mplaunch_timeout`` ini options), for tests that launch their own functions.

Every process (and every pytest-xdist worker) keeps one warm server with torch and
pytest imported, so a distributed test costs a fork per rank, not an interpreter start.

``reuse=True`` on the marker (or ``mplaunch_reuse = true`` in the ini, with
``reuse=False`` to opt a test out) runs consecutive tests that want the same world (the
same launch options but ``timeout``) in one :class:`mplaunch.World`: the ranks and their
process group stay up between tests. One world at a time per pytest process (per xdist
worker): a reuse test that wants another world closes the current one first; the last
is closed at the end of the session. Outcomes are those above; a test that does not
pass (fails, skips or xfails in a rank, times out) keeps the world if the World healed
(see :class:`mplaunch.World`: its ranks were interrupted and its process group rebuilt
if a collective was left half-done, a dead rank replaced), else ends it; with
``mplaunch_reuse_heal = false`` any such test ends it. A test that passes but leaves the
ranks' process group unusable (destroyed, or a different number of collectives issued
in different ranks) ends it too, so the next test starts fresh ranks. Before
each test a reused rank gets back its environment variables, working directory and
random number generators' states as they were at its first test.

``nnodes=M`` (with ``reuse=True``), or ``MPLAUNCH_TEST_NNODES=M`` in the environment for
every reuse test, runs the World across M nodes of the SLURM allocation the session
runs in, with ``nprocs`` ranks on each node (``nprocs * M`` in all), as ``launch`` and
:class:`mplaunch.World` count them. ``scheduler=NAME`` (or
``MPLAUNCH_TEST_SCHEDULER=NAME``) takes the nodes from another scheduler World knows,
passed to it as given: ``"ray"``, the Ray cluster the session is connected to
(``RAY_ADDRESS``, or ``ray.init`` in a conftest). ``pytest --markers`` lists them.

The plugin passes the options through to :func:`mplaunch.launch` and
:class:`mplaunch.World`, which check them. Rejected: checking here what they check (a
scheduler's name among them): a second copy of each rule, loaded by every session.
"""
from __future__ import annotations

import functools
import os
import sys

import pytest

# Nothing else is imported here: this module is loaded in every pytest session of an
# environment where mplaunch is installed. What a marked test needs (_pytest_run, and
# through it launch, World and torch) is imported when one runs.


_MARKER_HELP = (
    "mplaunch(nprocs=2, timeout=None, backend='gloo', reuse=False, **launch_kwargs): run "
    "the test body in nprocs ranks with torch.distributed initialised (backend=None: "
    "not); nprocs=[1, 2, 4]: once per size; reuse=True: in ranks kept up for the next "
    "test of the same options (with nnodes=M, or MPLAUNCH_TEST_NNODES=M: across M nodes "
    "of the allocation the session runs in, nprocs ranks on each; scheduler=NAME, or "
    "MPLAUNCH_TEST_SCHEDULER=NAME: the nodes that scheduler places{names}); the other "
    "keywords (gpus=, cpus=, ...) go to mplaunch.launch; a test needing more GPUs than "
    "the machine has is skipped")

# Ranks unpickle the test with pytest already imported in the warm server: without it
# every rank of every test would import pytest again.
_PRELOAD = ("pytest", "mplaunch._rank.pytest_rank")


def pytest_addoption(parser):
    parser.addini("mplaunch_nprocs", "default number of ranks of an mplaunch test",
                  default="2")
    parser.addini("mplaunch_timeout", "default timeout in seconds of an mplaunch test "
                  "(none: no limit)", default="none")
    parser.addini("mplaunch_reuse", "default of the mplaunch marker's reuse=: run "
                  "consecutive tests of the same options in one mplaunch.World",
                  type="bool", default=False)
    parser.addini("mplaunch_reuse_heal", "reuse: keep a world that healed after a test "
                  "failed in it (its ranks and process group); false: any failed test "
                  "ends the world (strict isolation)", type="bool", default=True)


@pytest.hookimpl(trylast=True)   # after pytest's debugging plugin registers pdbinvoke
def pytest_configure(config):
    config.addinivalue_line("markers", _MARKER_HELP.format(names=_scheduler_names(config)))
    pdbinvoke = config.pluginmanager.getplugin("pdbinvoke")
    if pdbinvoke is not None:
        # --pdb: a failing rank opens pdb in the rank (_pytest_run); pytest's own then
        # skips that test's WorkerError in this process.
        from ._pytest_run import RankPdbInvoke
        config.pluginmanager.unregister(pdbinvoke)
        config.pluginmanager.register(RankPdbInvoke(pdbinvoke), "pdbinvoke")


def _scheduler_names(config) -> str:
    """Where ``pytest --markers`` shows the marker's help: the schedulers World knows
    (their registry is imported then only: every other session skips it)."""
    if not getattr(config.option, "markers", False):
        return ""
    from ._engine.nodes import schedulers
    return (f", one of {', '.join(schedulers.names())} (default "
            f"{schedulers.DEFAULT})")


def pytest_sessionfinish(session):
    # Only a marked test that ran imported _pytest_run; without one nothing was reused
    # (and importing it here would cost every session the launching side).
    run = sys.modules.get("mplaunch._pytest_run")
    if run is not None:
        run.close_reused(session.config)


# -- sizes and GPUs (the parent's side of both is _pytest_sizes) -----------------------

_SIZE = "_mplaunch_nprocs"   # the parametrized argument of a test with several sizes


def pytest_generate_tests(metafunc):
    markers = list(metafunc.definition.iter_markers("mplaunch"))
    if markers:
        from ._pytest_sizes import parametrize_sizes
        parametrize_sizes(metafunc, markers, _ini_defaults(metafunc.config)["reuse"],
                          _SIZE)


@pytest.fixture(name=_SIZE)
def _size(request):
    return request.param


def pytest_collection_modifyitems(session, config, items):
    marked = [item for item in items if item.get_closest_marker("mplaunch")]
    if marked:
        from ._pytest_sizes import gpu_shortfall
    for item in marked:
        why = gpu_shortfall(_marker_options(item))
        if why is not None:
            # A mark, not a skip in setup: reported at the test, as any skip mark.
            item.add_marker(pytest.mark.skip(reason=why))
    if config.option.collectonly:
        return
    if marked:
        # The server imports torch while the first tests run; get_server does not wait.
        from ._engine import servers
        servers.get_server(_preload_for(None))


def _preload_for(user_preload) -> tuple:
    if user_preload is None:
        from ._engine import servers
        base = servers.default_preload()
    elif isinstance(user_preload, str):
        base = (user_preload,)
    else:
        base = tuple(user_preload)
    return base + tuple(m for m in _PRELOAD if m not in base)


def _ini_defaults(config) -> dict:
    nprocs = config.getini("mplaunch_nprocs")
    timeout = str(config.getini("mplaunch_timeout")).strip().lower()
    try:
        return {"nprocs": int(nprocs),
                "timeout": None if timeout in ("", "none") else float(timeout),
                "reuse": bool(config.getini("mplaunch_reuse"))}
    except ValueError:
        raise pytest.UsageError(f"mplaunch_nprocs must be an int and mplaunch_timeout a "
                                f"number or none, got {nprocs!r} and {timeout!r}") from None


def _marker_options(item) -> dict:
    """The marker's keywords (the closest marker wins), over the ini defaults."""
    opts = _ini_defaults(item.config)
    opts["backend"] = "gloo"
    for marker in reversed(list(item.iter_markers("mplaunch"))):
        if len(marker.args) > 1:
            raise TypeError(f"@pytest.mark.mplaunch takes nprocs as its only positional "
                            f"argument, got {marker.args!r}")
        if marker.args:
            opts["nprocs"] = marker.args[0]
        opts.update(marker.kwargs)
    callspec = getattr(item, "callspec", None)
    if callspec is not None and _SIZE in callspec.params:
        opts["nprocs"] = callspec.params[_SIZE]
    opts["preload"] = _preload_for(opts.get("preload"))
    nodes_env = os.environ.get("MPLAUNCH_TEST_NNODES")
    if opts.get("nnodes") is None and opts.get("reuse") and nodes_env:
        try:
            opts["nnodes"] = int(nodes_env)
        except ValueError:
            raise pytest.UsageError(f"MPLAUNCH_TEST_NNODES must be an int, got "
                                    f"{nodes_env!r}") from None
    scheduler_env = os.environ.get("MPLAUNCH_TEST_SCHEDULER")
    if opts.get("scheduler") is None and opts.get("nnodes") not in (None, 1) \
            and scheduler_env:
        opts["scheduler"] = scheduler_env
    if (opts.get("nnodes") not in (None, 1) or opts.get("scheduler")) \
            and not opts.get("reuse"):
        what = (f"nnodes={opts['nnodes']}" if opts.get("nnodes") not in (None, 1)
                else f"scheduler={opts['scheduler']!r}")
        raise pytest.UsageError(
            f"{item.nodeid}: {what} runs the test in a World across the nodes of this "
            "SLURM allocation (or those its scheduler places), which is kept for the "
            "next tests: mark it reuse=True too")
    return opts


@pytest.fixture
def mplaunch(request):
    """:func:`mplaunch.launch` with this test's ``nprocs`` and ``timeout`` (from its
    ``mplaunch`` marker, else the ini options) as defaults."""
    opts = _marker_options(request.node)
    opts.pop("backend")
    opts.pop("reuse")
    from ._launch import launch
    return functools.partial(launch, **opts)


# -- the parent's side -----------------------------------------------------------------

@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    if pyfuncitem.get_closest_marker("mplaunch") is None:
        return None
    __tracebackhide__ = True
    from ._pytest_run import run_test
    return run_test(pyfuncitem, _marker_options(pyfuncitem))
