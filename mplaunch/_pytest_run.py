"""The pytest plugin's side in the launching process, imported only when a test marked
``mplaunch`` runs: run the body in ranks (a launch, or a World kept for ``reuse=True``),
and turn what the ranks raised into the test's outcome. See pytest_plugin for the
behaviour users see.
"""
from __future__ import annotations

import contextlib
import logging
import sys

import cloudpickle
import pytest

from ._engine import debugging, prompts, servers
from ._launch import launch as _launch
from ._wire import pickler
from ._rank.pytest_rank import _RankOutcome, _run_in_rank, _run_in_reused_rank
from ._world import World
from .errors import LaunchTimeout, MainProcessError, WorkerError

_log = logging.getLogger("mplaunch")


# The session's reused worlds, in its config's stash (closed at the session's end).
_REUSED = pytest.StashKey["_ReusedWorld"]()


def close_reused(config) -> None:
    """At the end of the session (pytest_plugin): end the worlds its tests reused."""
    reused = config.stash.get(_REUSED, None)
    if reused is not None:
        reused.close()


def _reused_world(config) -> "_ReusedWorld":
    reused = config.stash.get(_REUSED, None)
    if reused is None:
        reused = config.stash[_REUSED] = _ReusedWorld()
    return reused


def run_test(pyfuncitem, opts: dict) -> bool:
    """Run a marked test's body in its ranks (`opts`: the marker's options over the ini
    defaults); raise what the test should raise."""
    __tracebackhide__ = True
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
        servers.get_server(opts["preload"]).wait_ready()
    failure = None
    try:
        with _ranks_debugged(pyfuncitem):
            _run(pyfuncitem, blob, settings, backend, reuse, opts)
    except MainProcessError as err:
        if err.signal_name == "SIGINT":
            raise KeyboardInterrupt from err  # Ctrl-C ends the session, as without us
        raise
    except WorkerError as err:
        failure = err
    if failure is not None:
        # Raised outside the except block, so the rank's own exception chain is shown
        # as it was, not as "during handling of WorkerError".
        raise _outcome_for(failure, _size(opts), pyfuncitem)
    return True


def _run(pyfuncitem, blob, settings, backend, reuse: bool, opts: dict) -> None:
    __tracebackhide__ = True
    if reuse:
        heal = bool(pyfuncitem.config.getini("mplaunch_reuse_heal"))
        _reused_world(pyfuncitem.config).run(blob, settings, backend,
                                             dict(opts, heal=heal))
    else:
        _launch(_run_in_rank, (blob, settings), backend=backend, **opts)


# A test whose failing rank was opened in pdb (pytest --pdb): pytest's own post-mortem
# of the WorkerError in this process is skipped (RankPdbInvoke).
DEBUGGED = pytest.StashKey[bool]()


@contextlib.contextmanager
def _ranks_debugged(item):
    """Under ``--pdb``, a rank's breakpoint() and its error open pdb in this terminal,
    pytest's capture suspended meanwhile (as pytest's own pdb does)."""
    config = item.config
    if not config.getoption("usepdb", False):
        yield
        return
    capman = config.pluginmanager.getplugin("capturemanager")

    def front():
        return prompts.Suspending(
            lambda: capman.suspend_global_capture(in_=True) if capman else None,
            lambda: capman.resume_global_capture() if capman else None)
    front.post_mortem = True
    before = debugging.sessions()
    prompts.override = front
    try:
        yield
    finally:
        prompts.override = None
        if debugging.sessions() != before:
            item.stash[DEBUGGED] = True


class RankPdbInvoke:
    """pytest's --pdb plugin, except for a test whose rank was debugged already: its
    WorkerError in this process has nothing more to show."""

    def __init__(self, inner):
        self.inner = inner

    def pytest_exception_interact(self, node, call, report):
        if node.stash.get(DEBUGGED, False):
            return None
        return self.inner.pytest_exception_interact(node, call, report)

    def pytest_internalerror(self, excinfo):
        return self.inner.pytest_internalerror(excinfo)


def _size(opts: dict):
    """How many ranks the test ran in: nprocs is per node, as for launch and World."""
    nprocs, nnodes = opts["nprocs"], opts.get("nnodes") or 1
    return nprocs * nnodes if isinstance(nprocs, int) and nnodes > 1 else nprocs


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
            if not world.pids:
                self.close()   # the World has torn its ranks down already; forget it
            # else it healed: its ranks, their process group and state stay for the
            # next test (which gets its environment and RNG states back as usual)
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
            return pickler.dumps((func, kwargs))
        except Exception as exc:  # noqa: BLE001 - name the culprit below
            for name, value in kwargs.items():
                try:
                    pickler.dumps(value)
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


def _outcome_for(err: WorkerError, size: int, item) -> BaseException:
    """What the test raises for a failed launch: the first failing rank's own exception
    (or its pytest outcome), noted with the rank. The first decides because the other
    failures are usually its consequences: peers whose collective broke when it left."""
    if isinstance(err, LaunchTimeout):
        return _at_test(err, item)
    first = err.failures[0]
    cause = err.__cause__
    if cause is None:
        return _at_test(err, item)  # a crash, a signal: the message says it all
    where = f"rank {first.rank} of {size}"
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
