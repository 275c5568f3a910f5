"""The %ranks / %%ranks magic (``%load_ext mplaunch``), in a real Jupyter kernel.

One kernel session runs the whole story of a notebook user: a %%ranks cell's output lands
in it prefixed by rank, names persist to the next cell, a failure shows the rank's
exception at the cell's line and the world heals (the next cell finds the same ranks and
names), an interrupt stops every rank's cell and keeps them, and ``%ranks stop`` leaves
nothing. The example notebook runs in a kernel of
its own. The kernel machinery (kernelspec, process tree, output helpers) is
test_notebook's.
"""
from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys

import psutil
import pytest

pytest.importorskip("nbclient")

import nbformat  # noqa: E402
from nbformat.v4 import new_code_cell, new_notebook  # noqa: E402
from test_notebook import (KernelTree, _cell, _client, _errors,  # noqa: E402,F401
                           _interrupt_when_started, _plain, _stream, kernel_config)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "world_notebook.ipynb")
PIDS = re.compile(r"pids \{0: (\d+), 1: (\d+)\}")


@pytest.mark.no_torch
def test_import_mplaunch_does_not_import_ipython():
    code = ("import sys, mplaunch\n"
            "assert callable(mplaunch.load_ipython_extension)\n"
            "assert callable(mplaunch.unload_ipython_extension)\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('IPython', 'ipykernel')))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]", proc.stdout


def _pids(text: str) -> list:
    match = PIDS.search(text)
    assert match, text
    return [int(p) for p in match.groups()]


def _alive(pids) -> list:
    alive = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.NoSuchProcess:
            pass
    return alive


@pytest.mark.notebook
def test_ranks_magic_in_a_kernel(kernel_config, tmp_path):
    pidfile = tmp_path / "pids"
    tag = {"tags": ["raises-exception"]}
    sources = {
        "load": "%load_ext mplaunch\n%ranks",
        "first": ("%%ranks\n"
                  "import os\n"
                  "rank = int(os.environ['RANK'])\n"
                  "x = rank * 10\n"
                  "print('hello from rank', rank)\n"
                  "x + 1"),
        "persist": ("%%ranks\n"
                    "print('x is still', x)\n"
                    "class Point:\n"
                    "    pass\n"
                    "import pickle\n"
                    "print('by reference:',\n"
                    "      type(pickle.loads(pickle.dumps(Point()))) is Point)"),
        "push": ("scale = 7\n"
                 "%ranks push scale\n"
                 "xs = %ranks pull x\n"
                 "scales = %ranks pull scale\n"
                 "print('pulled:', xs, scales)"),
        "fail": ("%%ranks\n"
                 "print('about to divide')\n"
                 "y = 1 / (x - 10)\n"
                 "print('not reached')"),
        "fresh": ("%%ranks\n"
                  "print('x defined:', 'x' in globals())"),
        "status": "%ranks",
        "interrupt": ("%%ranks\n"
                      "import os, time\n"
                      f"fd = os.open({str(pidfile)!r},\n"
                      "             os.O_WRONLY | os.O_APPEND | os.O_CREAT)\n"
                      "os.write(fd, f'{os.getpid()}\\n'.encode())\n"
                      "os.close(fd)\n"
                      "time.sleep(300)"),
        "after": "%%ranks\nprint('up again')",
        "stop": "%ranks stop\n%ranks",
        "unload": ("%ranks start\n"
                   "%unload_ext mplaunch\n"
                   "magics = get_ipython().magics_manager.magics\n"
                   "print('magic left:', 'ranks' in magics['cell'])"),
    }
    failing = ("fail", "interrupt")
    nb = new_notebook(cells=[new_code_cell(src, id=name,
                                           metadata=tag if name in failing else {})
                             for name, src in sources.items()])
    tree = KernelTree()
    client = _client(nb, kernel_config, tmp_path)

    async def scenario():
        async with client.async_setup_kernel():
            for i, cell in enumerate(nb.cells):
                if cell.id == "interrupt":
                    waiter = asyncio.ensure_future(
                        _interrupt_when_started(client, pidfile, tree))
                    try:
                        await client.async_execute_cell(cell, i)
                    finally:
                        interrupted = waiter.done()
                        if not interrupted:
                            waiter.cancel()
                    assert interrupted, f"the cell ended on its own: {cell.outputs}"
                    interrupted_pids = waiter.result()
                    alive_after_interrupt = _alive(interrupted_pids)
                else:
                    await client.async_execute_cell(cell, i)
                tree.snapshot(client)
                if cell.id == "stop":
                    alive_after_stop = _alive(ranks_seen)
                if cell.id == "unload":
                    alive_after_unload = _alive(_pids(_stream(cell)))
                if cell.id == "first":
                    ranks_seen.extend(_pids(_stream(cell)))
        return interrupted_pids, alive_after_interrupt, alive_after_stop, alive_after_unload

    ranks_seen: list = []
    try:
        (interrupted_pids, alive_after_interrupt, alive_after_stop,
         alive_after_unload) = asyncio.run(scenario())
    finally:
        tree.wait_gone()
    cells = {cell.id: cell for cell in nb.cells}
    for name, cell in cells.items():
        if name not in failing:
            assert not _errors(cell), (name, cell.outputs)

    assert _stream(cells["load"]).strip() == (
        "2 ranks, backend gloo: not started; the next %%ranks cell starts them")

    # Each rank's output, prefixed, in the cell; the last expression shown per rank.
    out = _stream(cells["first"]).splitlines()
    assert out[0].startswith("%ranks: started 2 ranks, backend gloo: pids {0: "), out
    for rank in (0, 1):
        assert f"[rank{rank}]: hello from rank {rank}" in out, out
        assert f"[rank{rank}]: {rank * 10 + 1}" in out, out
    first_pids = _pids(out[0])

    # Names persist; the world is the same processes.
    out = _stream(cells["persist"]).splitlines()
    assert sorted(out) == ["[rank0]: by reference: True", "[rank0]: x is still 0",
                           "[rank1]: by reference: True", "[rank1]: x is still 10"], out
    assert "pulled: [0, 10] [7, 7]" in _stream(cells["push"]), cells["push"].outputs

    # The first failure: the rank's own exception, at the cell's line, with a note; the
    # world heals: same ranks, same names.
    [error] = _errors(cells["fail"])
    assert error["ename"] == "ZeroDivisionError", error
    tb = _plain(error["traceback"])
    marked = [line.split(None, 2)[1:] for line in tb.splitlines()
              if line.startswith("---->")]
    assert ["3", "y = 1 / (x - 10)"] in marked, tb
    assert re.search(r"^Cell In\[\d+\], line 3$", tb, re.M), tb
    assert re.search(r"^%%ranks: rank 1 \(pid \d+\) raised this; the world was kept: its "
                     r"ranks, their state and their process group", tb, re.M), tb
    assert "mplaunch/_" not in tb, tb  # none of our frames
    assert "[rank1]: about to divide" in _stream(cells["fail"]), cells["fail"].outputs
    assert "[rank1]: not reached" not in _stream(cells["fail"])
    err = _stream(cells["fail"], "stderr")
    # The cell's error is shown once, by the notebook: no rank relays its traceback.
    assert "Traceback" not in err and "mplaunch/_" not in err, err

    # The next cell runs in the same ranks, with the old names.
    out = _stream(cells["fresh"]).splitlines()
    assert sorted(out) == ["[rank0]: x defined: True", "[rank1]: x defined: True"], out
    assert _pids(_stream(cells["status"])) == first_pids, _stream(cells["status"])
    # The world's line, then where each rank runs (test_magic_placement has the rest).
    assert re.match(r"2 ranks, backend gloo: up, pids \{0: \d+, 1: \d+\}\n"
                    r"  rank 0 \(pid \d+\): .*, CPUs .*\n  rank 1 \(pid \d+\): .*\n$",
                    _stream(cells["status"])), _stream(cells["status"])

    # The stop button: KeyboardInterrupt in every rank's cell; the world stays.
    [error] = _errors(cells["interrupt"])
    assert error["ename"] == "KeyboardInterrupt", error
    assert "the world was kept" in error["evalue"], error
    assert sorted(interrupted_pids) == sorted(first_pids), interrupted_pids
    assert sorted(alive_after_interrupt) == sorted(first_pids)
    out = _stream(cells["after"]).splitlines()
    assert sorted(out) == ["[rank0]: up again", "[rank1]: up again"], out

    # %ranks stop ends every rank while the kernel goes on.
    assert _stream(cells["stop"]).splitlines() == [
        "%ranks: stopped 2 ranks",
        "2 ranks, backend gloo: not started; the next %%ranks cell starts them"]
    assert len(ranks_seen) == 2 and alive_after_stop == [], ranks_seen

    # %unload_ext closes the world and takes the magics away.
    assert "magic left: False" in _stream(cells["unload"]), cells["unload"].outputs
    assert alive_after_unload == []


@pytest.mark.notebook
def test_world_notebook_example(kernel_config):
    nb = nbformat.read(EXAMPLE, as_version=4)
    for cell in nb.cells:  # committed clean
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, cell.id
    tree = KernelTree()
    client = _client(nb, kernel_config, os.path.dirname(EXAMPLE))
    client.on_cell_executed = lambda **_: tree.snapshot(client)
    try:
        asyncio.run(client.async_execute())
    finally:
        tree.wait_gone()
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert not _errors(cell), (cell.id, cell.outputs)
            assert not _stream(cell, "stderr"), (cell.id, cell.outputs)

    pids = _pids(_stream(_cell(nb, "start")))
    out = _stream(_cell(nb, "build")).splitlines()
    assert sorted(out) == ["[rank0]: rank 0 of 2: model built",
                           "[rank1]: rank 1 of 2: model built"], out

    def losses(cell_id, steps):
        found = dict(re.findall(rf"^\[rank(\d)\]: after {steps} steps: loss ([\d.]+)$",
                                _stream(_cell(nb, cell_id)), re.M))
        assert set(found) == {"0", "1"}, _stream(_cell(nb, cell_id))
        return {int(r): float(v) for r, v in found.items()}

    # The model kept training across cells: step counts go on, and the loss went down.
    first, second = losses("train-1", 5), losses("train-2", 10)
    assert all(second[r] < first[r] for r in (0, 1)), (first, second)

    out = _stream(_cell(nb, "agree")).splitlines()
    assert sorted(out) == ["[rank0]: parameters agree across ranks: True",
                           "[rank1]: parameters agree across ranks: True"], out
    assert "same parameters in every rank: True" in _stream(_cell(nb, "pull"))
    assert _stream(_cell(nb, "stop")) == "%ranks: stopped 2 ranks\n"
    assert not _alive(pids)
