"""mplaunch inside a real Jupyter kernel (ipykernel, driven by nbclient).

What a notebook user relies on: a function defined in a cell runs on the ranks, each
rank's output lands in the outputs of the cell that launched it (not in the kernel's log
or in a later cell), a failing rank's traceback shows in the cell, and the stop button
(SIGINT to the kernel) ends every rank and leaves the kernel usable.

Each test starts its own kernel from a kernelspec that runs this very interpreter, and
ends only when the kernel, its mplaunch server and every rank are gone: the server is a
grandchild of the test process and is orphaned when the kernel exits, so the autouse leak
check cannot see it; these tests check it themselves.
"""
from __future__ import annotations

import asyncio
import json
import linecache
import os
import re
import shutil
import sys
import tempfile
import time

import psutil
import pytest

pytest.importorskip("nbclient")  # the notebook tests need the [test] extra

import nbformat  # noqa: E402
from jupyter_client.kernelspec import KernelSpecManager  # noqa: E402
from nbclient import NotebookClient  # noqa: E402
from nbclient.exceptions import CellTimeoutError, DeadKernelError  # noqa: E402
from nbformat.v4 import new_code_cell, new_notebook  # noqa: E402
from traitlets.config import Config  # noqa: E402

import mplaunch

pytestmark = pytest.mark.notebook

EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                       "examples", "notebook.ipynb")
# Below pytest's 180 s: a cell that hangs fails as itself (run_cells names it), not as
# the whole test's timeout.
CELL_TIMEOUT = 100
STARTUP_TIMEOUT = 120
GONE_TIMEOUT = 60.0


@pytest.fixture
def kernel_config(tmp_path, monkeypatch):
    """Configuration for a kernel that runs this very interpreter (a user's or the
    system's "python3" kernelspec may run one without mplaunch) and talks over unix
    sockets (TCP ports picked in advance can be taken by another test run meanwhile)."""
    jupyter = tmp_path / "jupyter"
    spec_dir = jupyter / "kernels" / "python3"
    spec_dir.mkdir(parents=True)
    (spec_dir / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "Python 3 (mplaunch tests)",
        "language": "python",
        "interrupt_mode": "signal",
    }))
    monkeypatch.setenv("JUPYTER_PATH", str(jupyter))  # searched before all other places
    # A short directory: unix socket paths are limited to 107 bytes.
    runtime = tempfile.mkdtemp(prefix="mplaunch-nb-")
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", runtime)
    # No profile or startup files of whoever runs the tests.
    monkeypatch.setenv("IPYTHONDIR", str(tmp_path / "ipython"))
    spec = KernelSpecManager().get_kernel_spec("python3")
    assert spec.argv[0] == sys.executable, spec.argv
    config = Config()
    config.KernelManager.transport = "ipc"
    config.KernelManager.ip = os.path.join(runtime, "k")
    yield config
    shutil.rmtree(runtime, ignore_errors=True)


class KernelTree:
    """Every process seen below the kernel, so that the test can wait for all of them
    to end after the kernel shut down."""

    def __init__(self):
        self.procs = {}

    def snapshot(self, client) -> None:
        kernel = psutil.Process(client.km.provisioner.pid)
        for p in [kernel] + kernel.children(recursive=True):
            self.procs.setdefault(p.pid, p)

    def wait_gone(self) -> None:
        procs = list(self.procs.values())
        _, alive = psutil.wait_procs(procs, timeout=GONE_TIMEOUT)
        alive = [p for p in alive if _running(p)]
        if alive:
            text = "\n".join(_describe(p) for p in alive)
            for p in alive:
                try:
                    p.kill()
                except psutil.Error:
                    pass
            psutil.wait_procs(alive, timeout=5)
            pytest.fail(f"still running {GONE_TIMEOUT:g} s after the kernel shut "
                        f"down:\n{text}")


def _running(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _describe(p: psutil.Process) -> str:
    try:
        return f"pid {p.pid} ppid {p.ppid()} {' '.join(p.cmdline())[:150]}"
    except psutil.Error:
        return f"pid {p.pid} (gone)"


def _client(nb, config, cwd) -> NotebookClient:
    return NotebookClient(nb, timeout=CELL_TIMEOUT, startup_timeout=STARTUP_TIMEOUT,
                          kernel_name="python3", config=config,
                          resources={"metadata": {"path": str(cwd)}})


def _stream(cell, name="stdout") -> str:
    return "".join(o["text"] for o in cell.get("outputs", ())
                   if o["output_type"] == "stream" and o["name"] == name)


def _errors(cell) -> list:
    return [o for o in cell.outputs if o["output_type"] == "error"]


def _plain(traceback_lines) -> str:
    """An error output's traceback as text, without the terminal colours."""
    return re.sub(r"\x1b\[[0-9;]*m", "", "\n".join(traceback_lines))


def _cell(nb, cell_id):
    return next(c for c in nb.cells if c.get("id") == cell_id)


def test_example_notebook_runs_and_output_lands_in_the_cell(kernel_config):
    nb = nbformat.read(EXAMPLE, as_version=4)
    # The committed notebook is clean: no outputs, no execution counts.
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, cell.id
    tree = KernelTree()
    client = _client(nb, kernel_config, os.path.dirname(EXAMPLE))
    client.on_cell_executed = lambda **_: tree.snapshot(client)
    try:
        asyncio.run(client.async_execute())
    finally:
        tree.wait_gone()

    launch = _cell(nb, "launch")
    out = _stream(launch)
    lines = out.splitlines()
    # Each rank's line, relayed with its prefix, in the launching cell itself.
    assert "[rank0]: rank 0 of 2: all_reduce -> 30" in lines, out
    assert "[rank1]: rank 1 of 2: all_reduce -> 30" in lines, out
    assert "results by rank: [30.0, 30.0]" in lines, out
    assert not _errors(launch)
    for cell in nb.cells:
        if cell is not launch:
            assert "all_reduce ->" not in _stream(cell), cell.id

    failing = _cell(nb, "failing-rank")
    assert not _errors(failing)
    out = _stream(failing)
    assert "rank 1 (pid " in out and "raised ValueError: shard 1 is corrupt" in out, out
    assert "in check_shard" in out, out
    assert "the worker raised: ValueError('shard 1 is corrupt')" in out, out
    # The worker's own traceback also went to its stderr, relayed into this cell.
    err = _stream(failing, "stderr")
    assert "[rank1]: Traceback (most recent call last):" in err, err
    assert "[rank1]: ValueError: shard 1 is corrupt" in err, err


def _pids_in(path) -> list:
    try:
        with open(path) as f:
            return [int(line) for line in f.read().split()]
    except FileNotFoundError:
        return []


async def _interrupt_when_started(client, pidfile, tree: KernelTree) -> list:
    """Wait until both ranks of the running cell are up, then press the stop button
    (also when the wait fails: the cell must end either way)."""
    try:
        deadline = time.monotonic() + CELL_TIMEOUT / 2
        while len(_pids_in(pidfile)) < 2:
            assert time.monotonic() < deadline, "the ranks never wrote their pids"
            await asyncio.sleep(0.1)
        pids = _pids_in(pidfile)
        tree.snapshot(client)
        assert set(pids) <= set(tree.procs), (pids, tree.procs)  # ranks below the kernel
        return pids
    finally:
        await client.km.interrupt_kernel()


def _tree_now(client, tree: KernelTree) -> str:
    """The processes seen below the kernel, with their state now."""
    try:
        tree.snapshot(client)
    except psutil.Error:
        pass
    out = []
    for p in tree.procs.values():
        try:
            out.append(f"{p.pid} {p.status()} {' '.join(p.cmdline())[:60]!r}")
        except psutil.Error:
            out.append(f"{p.pid} gone")
    return "; ".join(out)


def run_cells(sources: dict, config, cwd, failing=(), interrupt=None) -> dict:
    """Run one notebook of these cells ({id: source}) in a real kernel, in order, and
    return them by id once every process below the kernel is gone. The `failing` cells
    may raise; the `interrupt` cell, a (cell id, pidfile) pair, gets the stop button
    once both of its ranks have written their pid to pidfile."""
    tag = {"tags": ["raises-exception"]}
    nb = new_notebook(cells=[new_code_cell(src, id=name,
                                           metadata=tag if name in failing else {})
                             for name, src in sources.items()])
    tree = KernelTree()
    client = _client(nb, config, cwd)

    async def scenario():
        async with client.async_setup_kernel():
            for i, cell in enumerate(nb.cells):
                waiter = None
                if interrupt is not None and cell.id == interrupt[0]:
                    waiter = asyncio.ensure_future(
                        _interrupt_when_started(client, interrupt[1], tree))
                try:
                    await client.async_execute_cell(cell, i)
                except (CellTimeoutError, DeadKernelError) as exc:
                    # Say which cell stopped, and how, before the test's own timeout
                    # would end the session's view of it with a bare traceback.
                    alive = await client.km.is_alive()
                    raise AssertionError(
                        f"cell {cell.id!r} (#{i}) did not complete: "
                        f"{type(exc).__name__}: {str(exc)[:300]}; the kernel is "
                        f"{'alive' if alive else 'dead'}; its processes: "
                        f"{_tree_now(client, tree)}; outputs so far: "
                        f"{[o.get('text', o.get('evalue')) for o in cell.outputs]}"
                    ) from exc
                finally:
                    if waiter is not None and not waiter.done():
                        waiter.cancel()
                tree.snapshot(client)

    try:
        asyncio.run(scenario())
    finally:
        tree.wait_gone()
    return {cell.id: cell for cell in nb.cells}


def run_clean_cells(sources: dict, config, cwd):
    """run_cells for cells none of which may raise: the cells by id, and what each
    wrote to stdout and to stderr ({id: text})."""
    cells = run_cells(sources, config, cwd)
    for cell in cells.values():
        assert not _errors(cell), cell
    out = {name: _stream(cell) for name, cell in cells.items()}
    err = {name: _stream(cell, "stderr") for name, cell in cells.items()}
    return cells, out, err


def test_failing_rank_and_interrupt_in_a_kernel(kernel_config, tmp_path):
    pidfile = tmp_path / "pids"
    tag = {"tags": ["raises-exception"]}
    nb = new_notebook(cells=[
        new_code_cell("import os, time\nimport mplaunch"),
        new_code_cell(
            "def explode_on_rank_one():\n"
            "    if os.environ['RANK'] == '1':\n"
            "        raise RuntimeError('rank one exploded')\n"
            "    return 'ok'\n"
            "\n"
            "mplaunch.launch(explode_on_rank_one, nprocs=2)", metadata=tag),
        new_code_cell(
            "def sleep_long(path):\n"
            "    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)\n"
            "    os.write(fd, f'{os.getpid()}\\n'.encode())\n"
            "    os.close(fd)\n"
            "    time.sleep(300)\n"
            "\n"
            f"mplaunch.launch(sleep_long, args=({str(pidfile)!r},), nprocs=2, grace_period=2)",
            metadata=tag),
        new_code_cell("print(1 + 1)"),
        new_code_cell(
            "def hello():\n"
            "    print('hello from', os.environ['RANK'])\n"
            "    return int(os.environ['RANK']) * 10\n"
            "\n"
            "print('results:', mplaunch.launch(hello, nprocs=2))"),
    ], metadata={"kernelspec": {"name": "python3", "language": "python",
                                "display_name": "Python 3"}})
    setup, failing, long_, after, relaunch = nb.cells
    tree = KernelTree()
    client = _client(nb, kernel_config, tmp_path)

    async def scenario():
        async with client.async_setup_kernel():
            await client.async_execute_cell(setup, 0)
            await client.async_execute_cell(failing, 1)
            tree.snapshot(client)
            waiter = asyncio.ensure_future(_interrupt_when_started(client, pidfile, tree))
            try:
                await client.async_execute_cell(long_, 2)
            finally:
                interrupted = waiter.done()
                if not interrupted:
                    waiter.cancel()
            assert interrupted, f"the cell ended on its own: {long_.outputs}"
            pids = waiter.result()
            # launch raised only after every rank was gone.
            alive = [p for p in pids if psutil.pid_exists(p)]
            await client.async_execute_cell(after, 3)
            await client.async_execute_cell(relaunch, 4)
            tree.snapshot(client)
            return pids, alive

    try:
        pids, alive = asyncio.run(scenario())
    finally:
        tree.wait_gone()

    # (1) The failing rank: WorkerError in the cell, and above it the worker's own
    # exception with its frame in the function defined in the cell.
    [error] = _errors(failing)
    assert error["ename"] == "WorkerError", error
    assert "rank 1 (pid " in error["evalue"], error
    assert "raised RuntimeError: rank one exploded" in error["evalue"], error
    tb = _plain(error["traceback"])
    cause, sep, _ = tb.partition("The above exception was the direct cause")
    assert sep, tb
    assert "explode_on_rank_one" in cause and "RuntimeError: rank one exploded" in cause, tb
    # IPython marks the line that raised (it reads a cell's source from linecache and
    # numbers it from the code object's first line, so that must be the def line).
    marked = [line.split(None, 2)[1:] for line in cause.splitlines()
              if line.startswith("---->")]
    assert marked == [["3", "raise RuntimeError('rank one exploded')"]], tb
    # The worker's traceback as the worker printed it, relayed into the same cell.
    err = _stream(failing, "stderr")
    assert re.search(r'^\[rank1\]:   File ".*", line 3, in explode_on_rank_one$', err, re.M), err
    assert "[rank1]: RuntimeError: rank one exploded" in err.splitlines(), err

    # (2) The interrupt: MainProcessError naming SIGINT, and no rank left.
    [error] = _errors(long_)
    assert error["ename"] == "MainProcessError", error
    assert "SIGINT" in error["evalue"], error
    assert len(pids) == 2 and not alive, (pids, alive)

    # (3) The same kernel goes on normally, launches included.
    assert not _errors(after) and _stream(after) == "2\n", after.outputs
    assert not _errors(relaunch), relaunch.outputs
    out = _stream(relaunch).splitlines()
    assert "[rank0]: hello from 0" in out and "[rank1]: hello from 1" in out, out
    assert "results: [0, 10]" in out, out


def test_worker_traceback_shows_the_source_of_cell_code(tmp_path):
    """err.traceback and the rank's stderr, as a notebook user reads them: code typed
    into a cell is in the kernel's linecache only, under a made-up file name (set up
    here in-process, as ipykernel does it), never in a file a rank could read."""
    source = ("import os\n"
              "\n"
              "def check_shard(rank):\n"
              "    raise ValueError(f'shard {rank} is corrupt')\n"
              "\n"
              "def work():\n"
              "    check_shard(int(os.environ['RANK']))\n")
    filename = str(tmp_path / "ipykernel_0" / "0.py")  # no such file
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    try:
        namespace = {"__name__": "__main__"}
        exec(compile(source, filename, "exec"), namespace)
        with pytest.raises(mplaunch.WorkerError) as info:
            mplaunch.launch(namespace["work"], nprocs=1, relay=False)
    finally:
        del linecache.cache[filename]
    lines = [line.strip() for line in info.value.traceback.splitlines()]
    assert "check_shard(int(os.environ['RANK']))" in lines, info.value.traceback
    assert "raise ValueError(f'shard {rank} is corrupt')" in lines, info.value.traceback
