"""A World's ranks follow every way the calling process changes one of the user's
modules (docs/world.rst, world-modules), as users meet them: a script (a reload before
the first run with fork, a reload that fails here, one that fails in one rank only, a
module imported anew), IPython's deduperreload driven directly, and a real Jupyter
kernel with ``%autoreload 2`` in the default mode of the IPython installed and in
``--full`` mode, in World.run and in ``%%ranks`` cells.

The common path (a run with nothing reloaded) is timed in bench, not here.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from test_notebook import kernel_config, run_clean_cells  # noqa: F401

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(ROOT, "tests", "scripts_reloads")


def _run_script(tmp_path, script: str, *args) -> dict:
    proc = subprocess.run([sys.executable, os.path.join(SCRIPTS, script), *args],
                          capture_output=True, text=True, timeout=170, cwd=str(tmp_path),
                          stdin=subprocess.DEVNULL, env=dict(os.environ, PYTHONPATH=ROOT))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert len(lines) == 1, out
    return json.loads(lines[0][len("RESULT "):])


@pytest.mark.parametrize("start_method", ["fork", "forkserver"])
def test_the_ranks_follow_each_way_a_script_changes_a_module(tmp_path, start_method):
    result = _run_script(tmp_path, "follow.py", start_method)
    here = result["here"]
    # Reloaded after world.start(), before the first run: followed (with fork the
    # ranks had the old module from the start).
    assert [r[0] for r in result["first"]] == ["early two"] * 3, result
    # A reload that raised a SyntaxError here ran nothing here: the ranks do not load
    # the file, since fixed, that this process never ran.
    assert here[1] == "syntax one", result
    assert [r[1] for r in result["syntax"]] == ["syntax one"] * 3, result
    # A reload that fails in rank 1 only: rank 1 runs the version it had, whole (not
    # new `a` with old `b`), and the warning says which rank runs what and what to do.
    assert [r[2:4] for r in result["onerank"]] == [
        ["a two", "b two"], ["a one", "b one"], ["a two", "b two"]], result
    [warned] = result["onerank warnings"]
    assert warned == (
        "mplaunch.World: rank 1 could not reload 'onerank', which this process reloaded "
        "(RuntimeError: only on rank 1), and runs the version it had, while ranks 0 and "
        "2 run it as reloaded: the ranks now run different code. To run the same code "
        "everywhere, make 'onerank' load in every rank and reload it here again (the "
        "next run follows), or call world.restart() for fresh ranks"), warned
    # Imported anew after `del sys.modules[name]`: followed.
    assert [r[4] for r in result["anew"]] == ["anew two"] * 3, result
    assert result["warnings"] == [], result
    # The note of a reload that failed reaches the caller before the call's payload is
    # loaded, even where that load then fails because of it.
    assert result["new function"] == [1, "AttributeError"], result
    [warned] = result["new function warnings"]
    assert warned.startswith("mplaunch.World: rank 1 could not reload 'onerank', which "
                             "this process reloaded (RuntimeError: only on rank 1, "
                             "again)"), warned
    # With warnings as errors, the call's error is raised, the warning its context; the
    # failed call's reloads were sent again (rank 1 warned again).
    assert result["as errors"] == [1, "RuntimeWarning"], result


def test_the_ranks_follow_deduperreload(tmp_path):
    """IPython 9's deduperreload patches the module's functions in place: no new spec.
    The ranks' functions run the new code, those they kept in globals included."""
    pytest.importorskip("IPython.extensions.deduperreload.deduperreload")
    result = _run_script(tmp_path, "deduper.py", "forkserver")
    assert result["first"] == [["one", "one", "one in a method", 1]] * 2, result
    assert result["patched"] is True, result    # patched by deduperreload, in place
    assert result["here"] == ["two", "two", "two in a method"], result
    assert result["ranks"] == [["two", "two", "two in a method", 1]] * 2, result
    assert result["warnings"] == [], result


# -- a real kernel: %autoreload 2 as a user types it -------------------------------------

def _edit(version: str) -> str:
    """A cell that edits the helper, as a user's editor saves it: a new mtime."""
    return ("import os, time\n"
            "with open('arhelper.py', 'w') as f:\n"
            f"    f.write(HELPER.format(version={version!r}))\n"
            "tick = os.stat('arhelper.py').st_mtime_ns + 10_000_000 * len(os.listdir())\n"
            "os.utime('arhelper.py', ns=(tick, tick))")


KERNEL_CELLS = {
    "setup": (
        "%load_ext autoreload\n"
        "%autoreload 2\n"
        "import os, sys\n"
        "import mplaunch\n"
        "sys.path.insert(0, os.getcwd())\n"
        "HELPER = 'def version():\\n    return {version!r}\\n'\n"
        "with open('arhelper.py', 'w') as f:\n"
        "    f.write(HELPER.format(version='b1'))\n"
        "import arhelper\n"
        "from arhelper import version\n"
        "world = mplaunch.World(2, backend=None)\n"
        "print('first', world.run(arhelper.version))"),
    "edit": _edit("b2"),
    "run": "print('run', version(), world.run(arhelper.version), world.run(version))",
    "load": "%load_ext mplaunch\n%ranks start 2 --backend none",
    "cells": ("%%ranks\n"
              "import arhelper\n"
              "from arhelper import version as kept\n"
              "print('ranks', kept())"),
    "edit-again": _edit("b3"),
    "follows": "%%ranks\nprint('ranks now', kept(), arhelper.version())",
    "full": "%autoreload --full 2\n" + _edit("b4"),
    "full-run": ("print('full', version(), world.run(arhelper.version))\n"
                 "world.close()"),
    "full-cells": "%%ranks\nprint('ranks full', kept(), arhelper.version())",
}


@pytest.mark.notebook
def test_autoreload_in_a_kernel_reaches_the_ranks(kernel_config, tmp_path):
    _, out, err = run_clean_cells(KERNEL_CELLS, kernel_config, tmp_path)
    assert not any(err.values()), err
    assert "first ['b1', 'b1']" in out["setup"], out["setup"]
    # %autoreload 2 in its default mode: the kernel runs b2, and so do the ranks, for
    # the module's function and for the kernel's `version` (patched in place here).
    assert "run b2 ['b2', 'b2'] ['b2', 'b2']" in out["run"], out["run"]
    for rank in (0, 1):
        assert f"[rank{rank}]: ranks b2" in out["cells"], out["cells"]
        # a name the ranks kept (`kept`, from a %%ranks cell) runs the new code too
        assert f"[rank{rank}]: ranks now b3 b3" in out["follows"], out["follows"]
        assert f"[rank{rank}]: ranks full b4 b4" in out["full-cells"], out["full-cells"]
    # --full: superreload, a new spec; followed as well.
    assert "full b4 ['b4', 'b4']" in out["full-run"], out["full-run"]


def test_a_patched_class_keeps_its_instances_and_super(tmp_path, monkeypatch):
    """In a rank (_rank.reloads, in this process): after %autoreload in the caller, an
    instance made from the old class runs the new methods, a method the edit added
    included, whose super() must name the old class."""
    from mplaunch._rank import reloads
    monkeypatch.syspath_prepend(str(tmp_path))
    source = ("class Base:\n    def hello(self):\n        return 'base'\n\n"
              "class Model(Base):\n    def where(self):\n        return {!r}\n")
    (tmp_path / "patchme.py").write_text(source.format("one"))
    import patchme
    try:
        model, where = patchme.Model(), patchme.Model.where
        (tmp_path / "patchme.py").write_text(
            source.format("two") + "\n    def hello(self):\n"
                                   "        return 'sub of ' + super().hello()\n")
        os.utime(tmp_path / "patchme.py", ns=(1, 1))   # a mtime the pyc cannot have
        assert reloads.reload_modules([("patchme", "patch")]) == {}
        assert (model.where(), where(model), model.hello()) == \
            ("two", "two", "sub of base"), "old objects do not run the new code"
        assert patchme.Model().hello() == "sub of base"
        (tmp_path / "patchme.py").write_text("raise RuntimeError('half-way')\n")
        os.utime(tmp_path / "patchme.py", ns=(2, 2))
        assert reloads.reload_modules([("patchme", "reload")]) == {
            "patchme": "RuntimeError: half-way"}
        assert patchme.Model().where() == "two"   # restored whole
    finally:
        sys.modules.pop("patchme", None)
