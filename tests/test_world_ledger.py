"""The ledger of a World's `__main__` names (_wire.mainglobals; docs/world.rst,
world-globals) where the run's code is not all in the run function's own body: a
decorated function, one passed as an argument, an attribute that shares a function's
name, a global deleted in the calling process, ``globals()[...] = ...``.

Each case runs tests/scripts_ledger/ledger_cases.py in a fresh interpreter, with a real
World: what is under test is that interpreter's `__main__` and its ranks'. The start
methods differ from case to case: the ledger is the same code under each.
"""
from __future__ import annotations

import functools
import os
import types

from test_world_main import _run_script

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "scripts_ledger", "ledger_cases.py")


def _case(tmp_path, case: str, method: str) -> dict:
    with open(SCRIPT) as f:
        source = f.read()
    return _run_script(tmp_path, source, case, method)


def _kept(warned, name):
    return [w for w in warned if w.startswith(
        f"UserWarning: mplaunch.World: the ranks kept their own {name!r} (their code "
        f"assigned it)")]


def test_a_decorated_or_passed_function_that_rebinds_the_same_object(tmp_path):
    # `model = model.double()` leaves the very object there: only the assignment in the
    # code says the name is the ranks'. That code was behind torch.no_grad(), a
    # functools.wraps decorator, or in a function passed as an argument; the next run
    # got this process's untrained float32 model instead of the ranks' own.
    result = _case(tmp_path, "decorated", "forkserver")
    assert result["no_grad"] == [["torch.float64", 1.0]] * 2, result
    assert result["wraps"] == [["torch.float64", 2.0]] * 2, result
    assert result["passed"] == [["torch.float64", 3.0]] * 2, result
    assert result["passed kwarg"] == [["torch.float32", 4.0]] * 2, result
    assert result["caller"][0] == "torch.float32", result   # this process's, untouched
    # The ranks' model differs from this process's: said once (per World).
    assert len(_kept(result["warnings"], "model")) == 1, result["warnings"]
    assert len(result["warnings"]) == 1, result["warnings"]


def test_an_attribute_named_like_a_main_function_is_not_a_call_of_it(tmp_path):
    # `opt.step()` in the run, and a function `step` in the ranks' __main__ that
    # assigns `lr`: `lr` became the ranks' (with a warning that their code assigned
    # it), and this process's 0.01 and 0.001 never arrived.
    result = _case(tmp_path, "attribute", "spawn")
    assert result["lr"] == [[0.1, 0.1], [0.01, 0.01], [0.001, 0.001]], result
    assert result["warnings"] == [], result


def test_a_global_deleted_here_is_deleted_in_the_ranks(tmp_path):
    # As in launch's fresh ranks: NameError, not the value the ranks got last time.
    result = _case(tmp_path, "deleted", "fork")
    assert result["before"] == [5, 5] and result["helper"] == ["helper"] * 2, result
    assert result["flag deleted"] == "NameError", result
    assert result["helper deleted"] == "NameError", result   # a function too
    assert result["launch"] == "NameError", result
    # A name the ranks assigned is theirs: deleting this process's placeholder does not
    # take it from them.
    assert result["mine"] == [7, 7], result
    assert result["warnings"] == [], result


def test_globals_subscript_binding_the_same_small_int_is_the_ranks(tmp_path):
    # `globals()["flag"] = 5` in the ranks, where this process's `flag` is that very
    # cached int: identity cannot tell, the code can. This process's 6 does not
    # replace the ranks' own, and the warning says so.
    result = _case(tmp_path, "globals", "forkserver")
    assert result["before"] == [5, 5], result
    assert result["flag"] == [5, 5], result
    assert len(_kept(result["warnings"], "flag")) == 1, result["warnings"]


# -- the ledger's own walk, in this process: the rank's own decorated functions --------

def test_the_walk_follows_a_ranks_own_decorated_function_from_a_cell():
    """A ``%%ranks`` cell calls a function an earlier cell defined behind a decorator
    of another module (here functools.lru_cache's wrapper, and a wraps decorator):
    the cell's code names the wrapper, whose globals are not __main__'s."""
    from mplaunch._wire import mainglobals

    namespace = {"__name__": "__main__"}
    exec(compile(
        "import functools\n"
        "def logged(fn):\n"
        "    @functools.wraps(fn)\n"
        "    def wrapper(*a):\n"
        "        return fn(*a)\n"
        "    return wrapper\n"
        "@functools.lru_cache\n"
        "def cached():\n"
        "    global model\n"
        "    model = model\n"
        "@logged\n"
        "def wrapped():\n"
        "    global other\n"
        "    other = other\n"
        "class Opt:\n"
        "    def step(self):\n"
        "        pass\n"
        "def step():\n"
        "    global lr\n"
        "    lr = 0\n", "<cell 1>", "exec"), namespace)
    mainglobals.track(namespace)
    try:
        model, other, lr = object(), object(), 0.1
        mainglobals.install(namespace, {"model": model, "other": other, "lr": lr})
        mainglobals.cell_runs(compile("cached()\nwrapped()\nOpt().step()\n",
                                      "<cell 2>", "exec"))
        mainglobals.settle()
        given = mainglobals._ledger.given
        # model and other are the rank's now (their code assigns them); lr is not:
        # the cell's `.step` is an attribute, not the function `step`.
        assert "model" not in given and "other" not in given, given
        assert given.get("lr") is lr, given
    finally:
        mainglobals._ledger = None
    assert isinstance(namespace["cached"], functools._lru_cache_wrapper)
    assert type(namespace["wrapped"]) is types.FunctionType
