"""What a World's ranks keep of the calling process's `__main__`, and the modules the
calling process reloads, as users meet them: a script run with ``python``, and a real
Jupyter kernel where a World and ``%%ranks`` cells are used side by side. (The plugin's
reuse is in test_plugin_reuse.)

The rule under test (docs/world.rst, world-globals and world-modules): a name the
ranks' own code assigned is theirs, and the calling process's global of the same name
does not overwrite it (a warning says so, once per name); a name the ranks only
received still follows the calling process, as do the classes and functions
`__main__` defines; ``%ranks push`` overwrites on purpose. A module the calling process reloaded is reloaded in the ranks
before the next run; ``launch`` reads the file as it is.

Each script runs in a fresh interpreter: what is under test is that interpreter's
`__main__`.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from test_notebook import kernel_config, run_clean_cells  # noqa: F401

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run_script(tmp_path, source: str, *args) -> dict:
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(source))
    proc = subprocess.run([sys.executable, str(script), *args], capture_output=True,
                          text=True, timeout=170, cwd=str(tmp_path),
                          stdin=subprocess.DEVNULL, env=dict(os.environ, PYTHONPATH=ROOT))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert len(lines) == 1, out
    return json.loads(lines[0][len("RESULT "):])


# world.rst's example, with the placeholders a linter asks for at the top of the script,
# and the other kinds of names a script's functions use.
GLOBALS_SCRIPT = """
import json, sys, warnings
import torch
import mplaunch

counter = 0
model = opt = None         # placeholders: setup() assigns them in the ranks
cache = None               # the same, for a list the ranks then append to
lr = 0.1                   # a constant the ranks only read
history = []               # a list of this process's, that the ranks only append to
layer = torch.nn.Linear(2, 1)   # a real object of this process's, that the ranks move


def setup(width):
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP
    global model, opt, counter, cache
    model = DDP(torch.nn.Linear(width, 1))
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    counter = 100
    cache = []


def step():
    import torch
    opt.zero_grad()
    loss = model(torch.randn(8, model.module.in_features)).pow(2).mean()
    loss.backward()
    opt.step()
    return loss.item() >= 0


def bump():
    global counter
    counter += 1
    cache.append(counter)
    history.append(counter)
    return [counter, len(cache), len(history), lr, opt.param_groups[0]["lr"]]


def helper():
    return "first"


def use_helper():
    return helper()


def move_layer():
    global layer
    layer = layer.double()     # the same object (Module.double returns self), assigned


def layer_dtype():
    return str(layer.weight.dtype)


def read_counter():
    return counter


def drop_counter():
    global counter
    del counter


result = {}
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    with mplaunch.World(2, backend="gloo", start_method=sys.argv[1]) as world:
        world.run(setup, args=(4,))
        result["step"] = world.run(step)
        result["bump"] = world.run(bump)
        lr = 0.5                        # changed here: the ranks follow
        result["bump again"] = world.run(bump)

        def helper():                   # redefined here: the ranks follow
            return "redefined"

        result["helper"] = world.run(use_helper)
        result["argument"] = world.run(lambda c: c, args=(counter,))
        world.run(move_layer)
        result["layer"] = world.run(layer_dtype)
        world.run(drop_counter)         # deleted in the ranks: follows this process again
        result["after del"] = world.run(read_counter)
    result["launch"] = mplaunch.launch(read_counter, nprocs=2, start_method=sys.argv[1])
result["warnings"] = [f"{w.category.__name__}: {w.message} @{w.lineno}" for w in caught]
print("RESULT " + json.dumps(result))
"""


@pytest.mark.parametrize("method", ["forkserver", "spawn", "fork"])
def test_a_scripts_placeholders_do_not_reset_what_the_ranks_built(tmp_path, method):
    result = _run_script(tmp_path, GLOBALS_SCRIPT, method)
    # world.rst's example works with `model = opt = None` at the script's top (it used to
    # fail: 'NoneType' object has no attribute 'zero_grad').
    assert result["step"] == [True, True], result
    # counter and cache are the ranks' since setup() assigned them; lr follows this
    # process (0.1, then 0.5), while the optimizer the ranks built keeps its own 0.1;
    # `history` was only appended to in the ranks, so each run brings this process's
    # list again (a name is the ranks' once their code assigns it, not when it mutates).
    assert result["bump"] == [[101, 1, 1, 0.1, 0.1]] * 2, result
    assert result["bump again"] == [[102, 2, 1, 0.5, 0.1]] * 2, result
    assert result["helper"] == ["redefined"] * 2, result
    assert result["argument"] == [0, 0], result      # the way to send this process's
    # `layer = layer.double()` assigns the object the name already held: still the
    # ranks' from then on (their code has the assignment), not this process's float32.
    assert result["layer"] == ["torch.float64"] * 2, result
    assert result["after del"] == [0, 0], result     # the ranks gave the name up
    assert result["launch"] == [0, 0], result        # fresh ranks: nothing of their own
    # One warning per name the ranks kept, at the run() that first met it, saying what
    # was kept and how to send this process's value instead.
    warned = result["warnings"]
    names = ["model", "opt", "counter", "cache", "layer"]
    assert len(warned) == len(names), warned
    lines = GLOBALS_SCRIPT.splitlines()
    for name, text in zip(sorted(names), sorted(warned, key=lambda w: w.split("'")[1])):
        assert text.startswith(f"UserWarning: mplaunch.World: the ranks kept their own "
                               f"{name!r} (their code assigned it), not this process's "
                               f"{name!r}"), warned
        assert "pass it to run() as an argument" in text, text
        line = lines[int(text.rpartition("@")[2]) - 1]
        assert "world.run(" in line, (text, line)   # the caller's own line


MODULES_SCRIPT = """
import importlib, json, os, sys, warnings
import mplaunch

sys.path.insert(0, os.getcwd())


def write(name, text):
    with open(name + ".py", "w") as f:
        f.write(text)


write("helper", "def version():\\n    return 'one'\\n")
write("user", "from helper import version\\n\\ndef via_user():\\n    return version()\\n")
import helper, user


def versions():
    return [helper.version(), user.via_user()]


result = {}
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    with mplaunch.World(2) as world:
        result["first"] = world.run(versions)
        write("helper", "def version():\\n    return 'two, edited'\\n")
        result["edited, not reloaded"] = world.run(versions)
        importlib.reload(helper)
        importlib.reload(user)          # its `version` is helper's: reloaded after it
        result["reloaded"] = world.run(versions)
        result["here"] = versions()
        write("helper", "def version():\\n    return 'three, edited again'\\n")
        importlib.reload(helper)
        write("helper", "def version(:\\n")    # broken before the ranks reload it
        result["broken"] = world.run(versions)
    write("helper", "def version():\\n    return 'four, on disk'\\n")
    result["launch"] = mplaunch.launch(versions, nprocs=1)
    result["here at last"] = versions()
result["warnings"] = [f"{w.category.__name__}: {w.message}" for w in caught]
print("RESULT " + json.dumps(result))
"""


def test_the_ranks_follow_a_module_the_script_reloaded(tmp_path):
    result = _run_script(tmp_path, MODULES_SCRIPT)
    assert result["first"] == [["one", "one"]] * 2, result
    # Edited on disk but not reloaded here: the ranks run what this process runs.
    assert result["edited, not reloaded"] == [["one", "one"]] * 2, result
    # Reloaded here: reloaded in the ranks before the run, in the order that gives
    # `user` the reloaded helper's function.
    assert result["here"] == ["two, edited", "two, edited"], result
    assert result["reloaded"] == [["two, edited", "two, edited"]] * 2, result
    # A reload that fails in the ranks is said, and they keep what they had.
    assert result["broken"] == [["two, edited", "two, edited"]] * 2, result
    [warned] = result["warnings"]
    assert warned.startswith("RuntimeWarning: mplaunch.World: the ranks could not "
                             "reload 'helper', which this process reloaded "
                             "(SyntaxError"), warned
    # A launch's fresh ranks import the file as it is, reloaded here or not.
    assert result["launch"] == [["four, on disk", "four, on disk"]], result
    assert result["here at last"] == ["three, edited again", "two, edited"], result


# -- a real kernel: a World and %%ranks cells side by side ------------------------------

KERNEL_CELLS = {
    "world": (
        "import importlib, sys, os, warnings\n"
        "import mplaunch\n"
        "sys.path.insert(0, os.getcwd())\n"
        "model = None\n"
        "lr = 0.1\n"
        "def setup():\n"
        "    global model\n"
        "    model = {'weights': 7}\n"
        "def train():\n"
        "    return model['weights'], lr\n"
        "world = mplaunch.World(2, backend=None)\n"
        "world.run(setup)\n"
        "print('first', world.run(train))"),
    "again": ("lr = 0.5\n"
              "print('again', world.run(train))"),
    "redefine": ("def train():\n"
                 "    return 'redefined', model['weights'], lr\n"
                 "print('redefined', world.run(train))"),
    "module": ("with open('nbhelper.py', 'w') as f:\n"
               "    f.write('def version():\\n    return 1\\n')\n"
               "import nbhelper\n"
               "print('module', world.run(nbhelper.version))\n"
               "with open('nbhelper.py', 'w') as f:\n"
               "    f.write('def version():\\n    return \"two\"\\n')\n"
               "importlib.reload(nbhelper)\n"
               "print('reloaded', world.run(nbhelper.version))\n"
               "world.close()"),
    "load": "%load_ext mplaunch",
    "cells": ("%%ranks\n"
              "import nbhelper\n"
              "model = {'weights': 3}\n"
              "steps = 0\n"
              "print('ranks', nbhelper.version())"),
    "push": ("def step():\n"
             "    global steps\n"
             "    steps += 1\n"
             "    return model['weights'], steps, lr\n"
             "%ranks push step"),
    "run": "%%ranks\nprint('step', step())",
    "edit": ("with open('nbhelper.py', 'w') as f:\n"
             "    f.write('def version():\\n    return \"three!\"\\n')\n"
             "importlib.reload(nbhelper)"),
    "follows": "%%ranks\nprint('ranks now', nbhelper.version(), step())",
    "push-model": "%ranks push model",
    "pushed": "%%ranks\nprint('pushed', model)",
    "box": ("class Box:\n"
            "    where = 'kernel'\n"
            "    def moved(self):\n"
            "        self.where = 'ranks'\n"
            "        return self\n"
            "box = Box()\n"
            "%ranks push box"),
    "move": "%%ranks\nbox = box.moved()",
    "where": ("def where():\n"
              "    return box.where\n"
              "%ranks push where"),
    "moved": "%%ranks\nprint('box is in the', where())",
}


@pytest.mark.notebook
def test_a_kernel_keeps_the_ranks_names_and_follows_its_reloads(kernel_config, tmp_path):
    _, out, err = run_clean_cells(KERNEL_CELLS, kernel_config, tmp_path)
    # A World from the kernel: setup() made `model`; the kernel's `model = None` does
    # not undo it, and the cell that first met it says so, once; lr follows the kernel,
    # and so does a function redefined in a cell.
    assert "first [(7, 0.1), (7, 0.1)]" in out["world"], out["world"]
    assert err["world"].count("UserWarning") == 1, err["world"]
    assert ("mplaunch.World: the ranks kept their own 'model' (their code assigned it), "
            "not this process's 'model'") in err["world"], err["world"]
    assert "pass it to run() as an argument" in err["world"], err["world"]
    assert "again [(7, 0.5), (7, 0.5)]" in out["again"], out["again"]
    assert "redefined [('redefined', 7, 0.5), ('redefined', 7, 0.5)]" in out["redefine"]
    assert not err["again"] and not err["redefine"], err
    # A helper module reloaded in the kernel is reloaded in the ranks.
    assert "module [1, 1]" in out["module"], out["module"]
    assert "reloaded ['two', 'two']" in out["module"], out["module"]
    # %%ranks cells: `model` is the ranks' (a cell assigned it); a function pushed from
    # the kernel names the kernel's `model` too, which does not overwrite theirs (the
    # warning says how to send it), while `lr` comes with it.
    assert "[rank0]: ranks two" in out["cells"], out["cells"]
    assert "UserWarning" in err["push"] and "'model'" in err["push"], err["push"]
    assert "%ranks push model" in err["push"], err["push"]
    for rank in (0, 1):
        assert f"[rank{rank}]: step (3, 1, 0.5)" in out["run"], out["run"]
        # the kernel reloaded nbhelper: the ranks did too, and kept their names
        assert f"[rank{rank}]: ranks now three! (3, 2, 0.5)" in out["follows"], out
        # %ranks push overwrites on purpose
        assert f"[rank{rank}]: pushed None" in out["pushed"], out["pushed"]
        # a cell's `box = box.moved()` leaves the pushed object there, and still makes
        # `box` the ranks': pushing `where`, which names it, does not bring the
        # kernel's box back
        assert f"[rank{rank}]: box is in the ranks" in out["moved"], out["moved"]
    assert not err["follows"] and not err["push-model"], err
    assert "'box'" in err["where"] and "%ranks push box" in err["where"], err["where"]
