"""The rank's side of the pytest plugin: run the test body with pytest's assertion
rewriting and comparisons, turn pytest outcomes into something the parent reads, and
give a reused rank back the state it had before its first test."""
from __future__ import annotations

import os
import pickle
import random
import sys

import pytest

from . import torchapi


class _RankOutcome(Exception):
    """pytest.skip/xfail/fail in a rank, in a form that pickles: pytest's own outcome
    classes claim to live in ``builtins`` (for shorter messages), so pickle cannot find
    them by reference and a copy of the class would not be pytest's."""

    def __init__(self, kind: str, msg, pytrace: bool = True):
        super().__init__(kind, msg, pytrace)
        self.kind, self.msg, self.pytrace = kind, msg, pytrace

    def __str__(self):
        return f"{self.kind}: {self.msg}"


def _run_in_rank(blob: bytes, assertion_settings: dict):
    """The test body in this rank. The process group (the marker's ``backend``) is
    launch's: made before this runs, ended after the rank's outcome is sent."""
    __tracebackhide__ = True
    _install_reprcompare(assertion_settings)
    func, kwargs = pickle.loads(blob)
    try:
        func(**kwargs)
    except (pytest.skip.Exception, pytest.fail.Exception) as exc:
        kind = ("skip" if isinstance(exc, pytest.skip.Exception) else
                "xfail" if isinstance(exc, pytest.xfail.Exception) else "fail")
        raise _RankOutcome(kind, exc.msg, exc.pytrace).with_traceback(
            _without_hidden_tail(exc.__traceback__)) from None


# What a reused rank had before its first test, given back before each later one.
_first_state: dict = {}


def _run_in_reused_rank(blob: bytes, settings: dict, initialized: bool) -> dict:
    """_run_in_rank in a World's rank, which keeps its process group (the World made it)
    and its process between tests: undo what is cheap to undo of the last test, run this
    one, and say whether the process group can serve the next."""
    __tracebackhide__ = True
    if not _first_state:
        _first_state.update(_snapshot())
    else:
        _restore(_first_state)
    _run_in_rank(blob, settings)
    return _group_health()


def _snapshot() -> dict:
    state = {"environ": dict(os.environ), "cwd": os.getcwd(), "random": random.getstate()}
    torch = sys.modules.get("torch")
    if torch is not None:
        state["torch"] = torch.get_rng_state()
    np = sys.modules.get("numpy")
    if np is not None:
        state["numpy"] = np.random.get_state()
    return state


def _restore(state: dict) -> None:
    if os.environ != state["environ"]:
        os.environ.clear()
        os.environ.update(state["environ"])
    try:
        cwd = os.getcwd()
    except OSError:
        cwd = None   # the last test removed the directory it moved to
    if cwd != state["cwd"]:
        os.chdir(state["cwd"])
    random.setstate(state["random"])
    if "torch" in state:
        sys.modules["torch"].set_rng_state(state["torch"])
    if "numpy" in state:
        sys.modules["numpy"].random.set_state(state["numpy"])


def _group_health() -> dict:
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return {"initialized": False, "seq": None}
    return {"initialized": True, "seq": torchapi.sequence_number()}


def _without_hidden_tail(tb):
    """Cut pytest.skip's own frames off the end: their __tracebackhide__ does not travel
    to the parent, which would then report the skip at _pytest/outcomes.py."""
    keep, t = None, tb
    while t is not None:
        if not t.tb_frame.f_locals.get("__tracebackhide__"):
            keep = t
        t = t.tb_next
    if keep is not None:
        keep.tb_next = None
    return tb


class _RankConfig:
    """Answers the few questions pytest's comparison explanation asks of its config,
    with the parent session's answers; there is no session in a rank."""

    def __init__(self, settings):
        self._s = settings
        self.pluginmanager = self  # has_plugin("terminalreporter") -> plain text

    def has_plugin(self, name):
        return False

    def get_verbosity(self, verbosity_type=None):
        return self._s["verbose_assertions" if verbosity_type else "verbose"]

    def getoption(self, name, default=None, skip=False):
        return self._s.get(name, default) if name in ("verbose", "assertmode") else default

    getvalue = getoption

    def getini(self, name):
        if name not in self._s["ini"]:
            raise ValueError(f"unknown ini option {name!r}")
        return self._s["ini"][name]


def _install_reprcompare(settings: dict) -> None:
    """Give rewritten asserts in this rank pytest's detailed comparisons (list, dict and
    string diffs). Best effort: if this pytest's internals differ, the plain rewritten
    explanation ("assert 1 == 2", "where 1 = f()") still arrives."""
    try:
        from _pytest import assertion
        from _pytest.assertion import util
    except ImportError:
        return
    config = _RankConfig(settings)

    def reprcompare(op, left, right):
        try:
            lines = assertion.pytest_assertrepr_compare(config=config, op=op, left=left,
                                                        right=right)
        except Exception:  # noqa: BLE001
            return None
        if not lines:
            return None
        res = "\n~".join(line.replace("\n", "\\n") for line in lines)
        return res.replace("%", "%%") if settings["assertmode"] == "rewrite" else res

    util._reprcompare = reprcompare
    util._config = config
