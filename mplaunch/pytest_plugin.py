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
is closed at the end of the session. Outcomes are those above; any test that does not
pass (fails, skips or xfails in a rank, times out) ends the world, and so does one that
leaves the ranks' process group unusable (destroyed, or a different number of
collectives issued in different ranks), so the next test starts fresh ranks. Before
each test a reused rank gets back its environment variables, working directory and
random number generators' states as they were at its first test.
"""
from __future__ import annotations

import functools
import logging
import pickle
import sys

import cloudpickle
import pytest

from . import _procs
from ._launch import launch as _launch
from ._pytest_rank import _RankOutcome, _run_in_rank, _run_in_reused_rank  # noqa: F401
from ._pytest_sizes import SIZE, gpu_shortfall, parametrize_sizes
from ._world import World
from .errors import LaunchTimeout, MainProcessError, WorkerError

_log = logging.getLogger("mplaunch")
_REUSED = pytest.StashKey["_ReusedWorld"]()

_MARKER_HELP = (
    "mplaunch(nprocs=2, timeout=None, backend='gloo', reuse=False, **launch_kwargs): run "
    "the test body in nprocs ranks with torch.distributed initialised (backend=None: "
    "not); nprocs=[1, 2, 4]: once per size; reuse=True: in ranks kept up for the next "
    "test of the same options; the other keywords (gpus=, cpus=, ...) go to "
    "mplaunch.launch; a test needing more GPUs than the machine has is skipped")

# Ranks unpickle the test with pytest already imported in the warm server: without it
# every rank of every test would import pytest again.
_PRELOAD = ("pytest", "mplaunch.pytest_plugin", "mplaunch._pytest_rank")


def pytest_addoption(parser):
    parser.addini("mplaunch_nprocs", "default number of ranks of an mplaunch test",
                  default="2")
    parser.addini("mplaunch_timeout", "default timeout in seconds of an mplaunch test "
                  "(none: no limit)", default="none")
    parser.addini("mplaunch_reuse", "default of the mplaunch marker's reuse=: run "
                  "consecutive tests of the same options in one mplaunch.World",
                  type="bool", default=False)


def pytest_configure(config):
    config.addinivalue_line("markers", _MARKER_HELP)
    config.stash[_REUSED] = _ReusedWorld()


def pytest_sessionfinish(session):
    reused = session.config.stash.get(_REUSED, None)
    if reused is not None:
        reused.close()


# -- sizes and GPUs (the parent's side of both is _pytest_sizes) -----------------------

def pytest_generate_tests(metafunc):
    markers = list(metafunc.definition.iter_markers("mplaunch"))
    parametrize_sizes(metafunc, markers, _ini_defaults(metafunc.config)["reuse"])


@pytest.fixture(name=SIZE)
def _size(request):
    return request.param


def pytest_collection_modifyitems(session, config, items):
    for item in items:
        if item.get_closest_marker("mplaunch") is not None:
            why = gpu_shortfall(_marker_options(item))
            if why is not None:
                # A mark, not a skip in setup: reported at the test, as any skip mark.
                item.add_marker(pytest.mark.skip(reason=why))
    if config.option.collectonly:
        return
    if any(item.get_closest_marker("mplaunch") for item in items):
        # The server imports torch while the first tests run; get_server does not wait.
        _procs.get_server(_preload_for(None))


def _preload_for(user_preload) -> tuple:
    if user_preload is None:
        base = _procs.default_preload()
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
    if callspec is not None and SIZE in callspec.params:
        opts["nprocs"] = callspec.params[SIZE]
    opts["preload"] = _preload_for(opts.get("preload"))
    return opts


@pytest.fixture
def mplaunch(request):
    """:func:`mplaunch.launch` with this test's ``nprocs`` and ``timeout`` (from its
    ``mplaunch`` marker, else the ini options) as defaults."""
    opts = _marker_options(request.node)
    opts.pop("backend")
    opts.pop("reuse")
    return functools.partial(_launch, **opts)


# -- the parent's side -----------------------------------------------------------------

@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    if pyfuncitem.get_closest_marker("mplaunch") is None:
        return None
    __tracebackhide__ = True
    opts = _marker_options(pyfuncitem)
    backend = opts.pop("backend")
    reuse = opts.pop("reuse")
    func = pyfuncitem.obj
    kwargs = {name: pyfuncitem.funcargs[name]
              for name in pyfuncitem._fixtureinfo.argnames}
    try:
        blob = _dumps_test(func, kwargs)
    except TypeError as err:
        err.__cause__, err.__suppress_context__ = None, True  # the message says it all
        raise _at_test(err, pyfuncitem) from None
    settings = _assertion_settings(pyfuncitem.config)
    if not reuse and opts.get("start_method") in (None, "forkserver"):
        # launch's timeout starts before its server is ready; a cold one (torch being
        # imported) must not eat the first test's timeout. (A World waits for it before
        # its first run's timeout starts.)
        _procs.get_server(opts["preload"]).wait_ready()
    failure = None
    try:
        if reuse:
            pyfuncitem.config.stash[_REUSED].run(blob, settings, backend, opts)
        else:
            _launch(_run_in_rank, (blob, settings), backend=backend, **opts)
    except MainProcessError as err:
        if err.signal_name == "SIGINT":
            raise KeyboardInterrupt from err  # Ctrl-C ends the session, as without us
        raise
    except WorkerError as err:
        failure = err
    if failure is not None:
        # Raised outside the except block, so the rank's own exception chain is shown
        # as it was, not as "during handling of WorkerError".
        raise _outcome_for(failure, opts["nprocs"], pyfuncitem)
    return True


class _ReusedWorld:
    """The one World this pytest process keeps for ``reuse=True`` tests, and the options
    it was made with. One at a time: the ranks of a world that waits for a test that may
    never come would hold memory (and GPUs) that the other tests need."""

    def __init__(self):
        self.world: "World | None" = None
        self.key = None

    def run(self, blob: bytes, settings: dict, backend, opts: dict) -> None:
        """Run the test in the world of these options, made now (after closing the
        current one) if they are not the current world's. Raises as launch() would."""
        world = self._world_for(backend, opts)
        initialized = bool(backend)
        try:
            health = world.run(_run_in_reused_rank, (blob, settings, initialized),
                               timeout=opts["timeout"])
        except BaseException:
            self.close()   # the World has torn its ranks down already; forget it
            raise
        problem = _unhealthy(health, initialized)
        if problem is not None:
            _log.warning("mplaunch: %s; the next reuse test starts fresh ranks", problem)
            self.close()

    def _world_for(self, backend, opts: dict) -> World:
        options = {k: v for k, v in opts.items() if k not in ("nprocs", "timeout")}
        # Compared with ==, not hashed: env may be a dict (or a callable).
        key = (opts["nprocs"], backend, sorted(options.items(), key=lambda kv: kv[0]))
        if self.world is not None and self.key != key:
            self.close()
        if self.world is None:
            self.world = World(opts["nprocs"], backend=backend, **options)
            self.key = key
        return self.world

    def close(self) -> None:
        world, self.world, self.key = self.world, None, None
        if world is not None:
            world.close()


def _unhealthy(health: list, initialized: bool):
    """Why the ranks, which all passed the test, cannot serve the next one (or None).
    Free: every rank's answer already carries what is compared."""
    if any(h["initialized"] != initialized for h in health):
        return ("the test destroyed the process group" if initialized else
                "the test left a process group initialised")
    seqs = {h["seq"] for h in health}
    if len(seqs) > 1:
        # A collective issued in some ranks only would pair with the next test's.
        return (f"the ranks issued different numbers of collectives "
                f"(sequence numbers {[h['seq'] for h in health]})")
    return None


def _dumps_test(func, kwargs) -> bytes:
    """Pickle the test function by value when its module is a test module: that ships
    the assertion-rewritten code this session imported, where a fresh import in the rank
    would not be rewritten (and may not be importable at all)."""
    module = sys.modules.get(getattr(func, "__module__", None) or "")
    register = (module is not None
                and module.__name__ not in cloudpickle.list_registry_pickle_by_value()
                and module.__name__ not in ("__main__", "builtins"))
    if register:
        cloudpickle.register_pickle_by_value(module)
    try:
        try:
            return cloudpickle.dumps((func, kwargs), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:  # noqa: BLE001 - name the culprit below
            for name, value in kwargs.items():
                try:
                    cloudpickle.dumps(value)
                except Exception as inner:  # noqa: BLE001
                    raise TypeError(
                        f"mplaunch cannot send argument {name!r} ({type(value).__name__}) "
                        f"to the ranks: {type(inner).__name__}: {inner}. Fixture values "
                        "and parameters of an mplaunch test must be picklable; create "
                        "the object inside the test instead.") from inner
            raise TypeError(f"mplaunch cannot send the test function to the ranks: "
                            f"{type(exc).__name__}: {exc}") from exc
    finally:
        if register:
            cloudpickle.unregister_pickle_by_value(module)


def _assertion_settings(config) -> dict:
    """What the ranks need to explain a failed comparison as this session would."""
    settings = {"verbose": config.getoption("verbose", 0) or 0,
                "assertmode": config.getoption("assertmode", "rewrite"), "ini": {}}
    try:
        from _pytest.config import Config
        settings["verbose_assertions"] = config.get_verbosity(Config.VERBOSITY_ASSERTIONS)
    except Exception:  # noqa: BLE001 - older pytest: the general verbosity applies
        settings["verbose_assertions"] = settings["verbose"]
    for name in ("truncation_limit_lines", "truncation_limit_chars",
                 "assertion_text_diff_style"):
        try:
            settings["ini"][name] = config.getini(name)
        except (ValueError, KeyError):
            pass
    return settings


_OUTCOMES = {"skip": pytest.skip.Exception, "xfail": pytest.xfail.Exception,
             "fail": pytest.fail.Exception}


def _outcome_for(err: WorkerError, nprocs: int, item) -> BaseException:
    """What the test raises for a failed launch: the first failing rank's own exception
    (or its pytest outcome), noted with the rank. The first decides because the other
    failures are usually its consequences: peers whose collective broke when it left."""
    if isinstance(err, LaunchTimeout):
        return _at_test(err, item)
    first = err.failures[0]
    cause = err.__cause__
    if cause is None:
        return _at_test(err, item)  # a crash, a signal: the message says it all
    where = f"rank {first.rank} of {nprocs}"
    if first.pid is not None:
        where += f" (pid {first.pid})"
    others = [f.describe() for f in err.failures[1:]]
    note = f"[mplaunch] raised in {where}"
    if others:
        note += "; then: " + "; ".join(others[:4]) + (" ..." if len(others) > 4 else "")
    if isinstance(cause, _RankOutcome):
        msg = cause.msg
        if cause.kind == "fail" and not cause.pytrace:
            msg = f"{msg}\n{note}"  # pytest shows nothing but the message
        exc = _OUTCOMES[cause.kind](msg, pytrace=cause.pytrace)
        exc.__traceback__ = cause.__traceback__
        cause = exc
    if not isinstance(cause, (pytest.skip.Exception, pytest.xfail.Exception)):
        _add_note(cause, note)
    return cause


def _at_test(err: BaseException, item) -> BaseException:
    """`err` with a one-frame traceback at the test's definition. Its real traceback is
    mplaunch's monitor loop, which says nothing about the test; with no frame at all
    pytest would only say that every traceback entry is hidden."""
    path, lineno = item.reportinfo()[:2]
    code = compile("raise __mplaunch_error", "<mplaunch>", "exec")
    code = code.replace(co_filename=str(path), co_firstlineno=(lineno or 0) + 1,
                        co_name=getattr(item.obj, "__name__", item.name))
    try:
        exec(code, {"__mplaunch_error": err.with_traceback(None)})
    except type(err) as raised:
        return raised.with_traceback(raised.__traceback__.tb_next)
    return err


def _add_note(exc: BaseException, note: str) -> None:
    if hasattr(exc, "add_note"):
        exc.add_note(note)
    elif len(exc.args) == 1 and isinstance(exc.args[0], str):
        exc.args = (f"{exc.args[0]}\n{note}",)
