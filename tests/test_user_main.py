"""The classes and functions of the user's `__main__` (a script, `python -c`, a notebook)
pickle by reference inside a rank and inside the rank's own children, as they do under
torch.multiprocessing.spawn: `pickle.dumps(P(1))`, `torch.save(model)`, Pool workers and
DataLoader workers started with spawn, forkserver or fork. And a launch works from a
child of multiprocessing's spawn or forkserver, whose `__main__` is `__mp_main__`.

Each case runs in a fresh interpreter (a script file, or the same code with -c), since
what is under test is that interpreter's `__main__`. The scripts have no
`if __name__ == "__main__":` guard and record each run of their top level: neither a
rank nor a rank's child may run it again.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from test_notebook import kernel_config  # noqa: F401 - a fixture

SCRIPTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts_main")
METHODS = ["forkserver", "spawn", "fork"]
ALL_CONTEXTS = "spawn,forkserver,fork"


def _run(tmp_path, name, *args, as_c=False, timeout=170):
    """Run a script of scripts_main as a file or, with as_c, its text with -c; return
    its RESULT and the pids that ran its top level."""
    path = os.path.join(SCRIPTS, name)
    if as_c:
        with open(path) as f:
            cmd = [sys.executable, "-c", f.read(), *args]
    else:
        cmd = [sys.executable, path, *args]
    runs = tmp_path / "top-level-runs"
    env = dict(os.environ, MAIN_RUNS_FILE=str(runs))
    proc = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=str(tmp_path))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert len(lines) == 1, out
    pids = runs.read_text().split() if runs.exists() else []
    return json.loads(lines[0][len("RESULT "):]), pids, out


POOL_RESULT = {"pickle": 3, **{ctx: [101, 104, 109] for ctx in ALL_CONTEXTS.split(",")}}


@pytest.mark.parametrize("as_c", [False, True], ids=["script", "dash-c"])
@pytest.mark.parametrize("method", METHODS)
def test_main_classes_and_functions_pickle_by_reference_in_ranks_and_pool_workers(
        tmp_path, method, as_c):
    result, pids, out = _run(tmp_path, "pool.py", method, ALL_CONTEXTS, as_c=as_c)
    # pickle.dumps(P(3)) in the rank, and Pool(2).map(square) with each start method;
    # and __file__ is the script's, as in the launching process.
    expected = dict(POOL_RESULT, file="-" if as_c else "pool.py")
    assert result["ranks"] == [expected, expected], out
    # What a rank returns is of the launching process's own class.
    assert result["same_class"] == [True, True], out
    assert len(pids) == 1, (pids, out)  # nobody ran the script's top level again


@pytest.mark.slow
@pytest.mark.parametrize("method, as_c, contexts", [
    ("forkserver", False, ALL_CONTEXTS),
    ("spawn", True, "forkserver"),
    ("fork", False, "spawn"),
], ids=["forkserver-script", "spawn-dash-c", "fork-script"])
def test_torch_save_and_dataloader_workers_over_main_classes(tmp_path, method, as_c,
                                                             contexts):
    result, pids, out = _run(tmp_path, "torch_io.py", method, contexts, as_c=as_c)
    expected = {"torch_load": "Net",
                **{ctx: [[0, 10], [40, 90]] for ctx in contexts.split(",")}}
    assert result == [expected], out
    assert len(pids) == 1, (pids, out)


@pytest.mark.parametrize("context, method", [
    ("spawn", "forkserver"),
    ("forkserver", "spawn"),
    ("spawn", "fork"),
])
def test_launch_from_a_child_of_multiprocessing_spawn_or_forkserver(tmp_path, context,
                                                                    method):
    # The launched function and the class it pickles live in `__mp_main__` there.
    result, _, out = _run(tmp_path, "launch_in_child.py", context, method)
    assert result == [10, 11], out


LIMIT = """
import pickle, mplaunch
class Q:
    pass
def load(blob):
    return pickle.loads(blob)
try:
    mplaunch.launch(load, args=(pickle.dumps(Q()),), nprocs=1, relay=False)
except mplaunch.WorkerError as err:
    print("RESULT " + repr(str(err.__cause__)))
"""


def test_main_definitions_the_launch_does_not_reach_are_not_in_the_ranks_main(tmp_path):
    # docs/errors.rst: Q travels only inside bytes pickled here, so no rank has it.
    proc = subprocess.run([sys.executable, "-c", LIMIT], capture_output=True, text=True,
                          timeout=120, cwd=str(tmp_path), stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert ("RESULT \"Can't get attribute 'Q' on <module '__main__' (in an mplaunch "
            "rank: what the launch uses of it)>\"") in proc.stdout.splitlines(), proc.stdout


NOTEBOOK_CELLS = [
    "import json, multiprocessing, os, pickle\nimport mplaunch",
    # The same definitions as scripts_main/pool.py, typed into a cell.
    "OFFSET = 100\n"
    "\n"
    "class P:\n"
    "    def __init__(self, x):\n"
    "        self.x = x\n"
    "\n"
    "def square(x):\n"
    "    return x * x + OFFSET\n"
    "\n"
    "def work(contexts):\n"
    "    out = {'pickle': pickle.loads(pickle.dumps(P(3))).x,\n"
    "           'file': os.path.basename(globals().get('__file__', '-'))}\n"
    "    for ctx in contexts:\n"
    "        with multiprocessing.get_context(ctx).Pool(2) as pool:\n"
    "            out[ctx] = pool.map(square, [1, 2, 3])\n"
    "    return out, P(int(os.environ['RANK']))",
    "results = {}\n"
    "for method in ('forkserver', 'spawn', 'fork'):\n"
    f"    [(out, p)] = mplaunch.launch(work, args=({ALL_CONTEXTS!r}.split(','),),\n"
    "                                 nprocs=1, start_method=method)\n"
    "    results[method] = [out, type(p) is P]\n"
    "print('RESULT ' + json.dumps(results))",
    # DataLoader workers over a Dataset defined in a cell, with forkserver: Python
    # 3.14's default start method.
    "import torch\n"
    "\n"
    "class Squares(torch.utils.data.Dataset):\n"
    "    def __len__(self):\n"
    "        return 4\n"
    "\n"
    "    def __getitem__(self, i):\n"
    "        return i * i * OFFSET\n"
    "\n"
    "def load():\n"
    "    loader = torch.utils.data.DataLoader(Squares(), batch_size=2, num_workers=1,\n"
    "                                         multiprocessing_context='forkserver')\n"
    "    return [b.tolist() for b in loader]\n"
    "\n"
    "print('RESULT ' + json.dumps(mplaunch.launch(load, nprocs=1)))",
]


@pytest.mark.notebook
@pytest.mark.slow
def test_cell_classes_and_functions_pickle_by_reference_in_ranks_and_their_children(
        kernel_config, tmp_path):
    import asyncio

    import nbformat.v4 as v4
    from test_notebook import KernelTree, _client, _errors, _stream

    nb = v4.new_notebook(cells=[v4.new_code_cell(c) for c in NOTEBOOK_CELLS],
                         metadata={"kernelspec": {"name": "python3", "language": "python",
                                                  "display_name": "Python 3"}})
    tree = KernelTree()
    client = _client(nb, kernel_config, tmp_path)
    client.on_cell_executed = lambda **_: tree.snapshot(client)
    try:
        asyncio.run(client.async_execute())
    finally:
        tree.wait_gone()
    for cell in nb.cells:
        assert not _errors(cell), cell.outputs

    def result(cell):
        lines = [ln for ln in _stream(cell).splitlines() if ln.startswith("RESULT ")]
        assert len(lines) == 1, cell.outputs
        return json.loads(lines[0][len("RESULT "):])

    expected = dict(POOL_RESULT, file="-")
    assert result(nb.cells[2]) == {m: [expected, True] for m in METHODS}
    assert result(nb.cells[3]) == [[[0, 100], [400, 900]]]
