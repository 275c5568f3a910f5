"""pdb and input() in a rank, answered in a real Jupyter kernel's input box.

A notebook user who writes ``breakpoint()`` in a function a World runs, or in a
``%%ranks`` cell, gets the notebook's own input box, labelled with the rank's prefix,
one rank at a time; what pdb prints lands in the cell as that rank's output. These
tests drive a real kernel as a frontend that allows stdin does: each ``input_request``
on the kernel's stdin channel is answered from a script of answers (or with the stop
button), and every stream and error of the cell is kept in order. nbclient cannot do
that (it refuses stdin), so the kernel is driven with jupyter_client directly.

Each test starts its own kernel from test_notebook's kernelspec (this interpreter, over
unix sockets) and ends only when the kernel, its mplaunch server and every rank are
gone (KernelTree).
"""
from __future__ import annotations

import asyncio
import queue
import re
import time
from dataclasses import dataclass, field
from typing import List, Optional

import psutil
import pytest

pytest.importorskip("nbclient")  # the notebook tests need the [test] extra

from jupyter_client import AsyncKernelManager  # noqa: E402

from test_notebook import CELL_TIMEOUT, STARTUP_TIMEOUT, KernelTree  # noqa: E402
from test_notebook import kernel_config  # noqa: E402,F401 - the fixture

pytestmark = [pytest.mark.notebook, pytest.mark.slow]

PDB = "(Pdb) "


@dataclass
class Answer:
    """What the frontend does at an input request: type `text` after `delay` seconds,
    or press the stop button (text None)."""
    text: Optional[str]
    delay: float = 0.0


STOP = Answer(None)


@dataclass(repr=False)
class Ran:
    """One executed cell, as its frontend saw it."""
    code: str
    events: List[tuple] = field(default_factory=list)   # in arrival order
    seconds: float = 0.0

    def streams(self, name: str) -> str:
        return "".join(e[2] for e in self.events if e[0] == "stream" and e[1] == name)

    @property
    def stdout(self) -> str:
        return self.streams("stdout")

    @property
    def stderr(self) -> str:
        return self.streams("stderr")

    @property
    def lines(self) -> List[str]:
        return self.stdout.splitlines()

    @property
    def prompts(self) -> List[str]:
        return [e[1] for e in self.events if e[0] == "prompt"]

    @property
    def errors(self) -> List[dict]:
        return [e[1] for e in self.events if e[0] == "error"]

    def transcript(self) -> str:
        """What the user sees in the cell: output, and each prompt with what was typed
        in its box (the box itself is not part of the cell's output)."""
        out = []
        for e in self.events:
            if e[0] == "stream":
                out.append(e[2] if e[1] == "stdout" else
                           "".join(f"(stderr) {line}\n" for line in e[2].splitlines()))
            elif e[0] == "prompt":
                out.append(f"{e[1]}")
            elif e[0] == "answer":
                out.append(f"{e[1]}    <- typed in the input box\n"
                           if e[1] is not None else "    <- stop button\n")
            elif e[0] == "error":
                out.append(f"{e[1]['ename']}: {e[1]['evalue']}\n")
            elif e[0] == "result":
                out.append(f"Out: {e[1]}\n")
        return "".join(out)

    def __str__(self) -> str:
        return f"--- cell ---\n{self.code}\n--- seen ({self.seconds:.1f} s) ---\n" \
               f"{self.transcript()}"

    __repr__ = __str__   # what an assertion that names it shows


class Notebook:
    """A kernel and a frontend that allows stdin (unless a cell says otherwise)."""

    def __init__(self, km: AsyncKernelManager, kc, tree: KernelTree):
        self.km, self.kc, self.tree = km, kc, tree
        self.cells: List[Ran] = []

    async def run(self, code: str, answers=(), allow_stdin: bool = True,
            timeout: float = CELL_TIMEOUT) -> Ran:
        """Execute `code` and answer its input requests in order from `answers` (str or
        Answer); the cell as seen once the kernel is idle again. Fails on a prompt with
        no answer left (which it stops), an answer left over, or a cell that does not
        end within `timeout`."""
        script = [a if isinstance(a, Answer) else Answer(a) for a in answers]
        ran = Ran(code)
        self.cells.append(ran)
        msg_id = self.kc.execute(code, allow_stdin=allow_stdin, stop_on_error=False)
        start = time.monotonic()
        pending: Optional[tuple] = None    # (Answer, when to give it)
        unexpected = False
        while True:
            now = time.monotonic()
            if now - start > timeout:
                await self._stop_quietly()
                raise AssertionError(f"the cell did not end within {timeout:g} s; "
                                     f"processes: {self._tree_now()}\n{ran}")
            try:
                msg = await self.kc.get_stdin_msg(timeout=0.02)
            except queue.Empty:
                msg = None
            if msg is not None and msg["msg_type"] == "input_request":
                # What the cell printed before it asked, first (the kernel flushed its
                # streams before asking; iopub is another socket).
                await self._drain_iopub(msg_id, ran)
                ran.events.append(("prompt", msg["content"]["prompt"]))
                if pending is not None or not script:
                    unexpected = True
                    await self.km.interrupt_kernel()   # end the cell rather than hang
                else:
                    answer = script.pop(0)
                    pending = (answer, time.monotonic() + answer.delay)
            if pending is not None and time.monotonic() >= pending[1]:
                answer = pending[0]
                pending = None
                ran.events.append(("answer", answer.text))
                if answer.text is None:
                    await self.km.interrupt_kernel()
                else:
                    self.kc.input(answer.text)
            if await self._drain_iopub(msg_id, ran):
                break
        ran.seconds = time.monotonic() - start
        self.tree.snapshot(self)
        assert not unexpected, f"a prompt came that the script does not answer\n{ran}"
        assert not script and pending is None, \
            f"answers left over: {[a.text for a in script]}\n{ran}"
        return ran

    async def _drain_iopub(self, msg_id: str, ran: Ran) -> bool:
        """Take what iopub has for this cell; True once the kernel is idle again."""
        while True:
            try:
                msg = await self.kc.get_iopub_msg(timeout=0)
            except queue.Empty:
                return False
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            kind, content = msg["msg_type"], msg["content"]
            if kind == "stream":
                ran.events.append(("stream", content["name"], content["text"]))
            elif kind == "error":
                ran.events.append(("error", content))
            elif kind == "execute_result":
                ran.events.append(("result", content["data"].get("text/plain")))
            elif kind == "status" and content["execution_state"] == "idle":
                return True

    async def _stop_quietly(self) -> None:
        try:
            await self.km.interrupt_kernel()
        except Exception:  # noqa: BLE001 - the failure is reported by the caller
            pass

    def _tree_now(self) -> str:
        try:
            self.tree.snapshot(self)
        except psutil.Error:
            pass
        out = []
        for p in self.tree.procs.values():
            try:
                out.append(f"{p.pid} {p.status()} {' '.join(p.cmdline())[:60]!r}")
            except psutil.Error:
                out.append(f"{p.pid} gone")
        return "; ".join(out)


def in_notebook(config, cwd, scenario) -> None:
    """Run ``await scenario(nb)`` with a started kernel; then the kernel is shut down,
    and every process seen below it (the mplaunch server and the ranks included) must
    be gone. What each cell showed is printed (shown with -s, or on failure)."""
    tree = KernelTree()
    cells: List[Ran] = []

    async def session():
        km = AsyncKernelManager(config=config, kernel_name="python3")
        await km.start_kernel(cwd=str(cwd))
        kc = km.client()
        nb = Notebook(km, kc, tree)
        nb.cells = cells
        try:
            kc.start_channels()
            await kc.wait_for_ready(timeout=STARTUP_TIMEOUT)
            tree.snapshot(nb)
            await scenario(nb)
        finally:
            try:
                tree.snapshot(nb)
            except psutil.Error:
                pass
            kc.stop_channels()
            await km.shutdown_kernel(now=False)
            if not kc.context.closed:   # the client's own zmq context: its fds
                kc.context.destroy(linger=100)

    try:
        asyncio.run(session())
    finally:
        print("\n\n".join(str(c) for c in cells))
        tree.wait_gone()


def _error(ran: Ran) -> dict:
    assert len(ran.errors) == 1, ran
    return ran.errors[0]


SETUP = """\
import os, mplaunch
w = mplaunch.World(2, backend='gloo', timeout=5)
w.start()
"""

FUNCS = """\
def keep():
    mplaunch.rank_state()['x'] = 100 * int(os.environ['RANK']) + 1

def kept():
    return mplaunch.rank_state().get('x')

def f(x, linger=0.0):
    import time, torch, torch.distributed as dist
    t = torch.ones(1) * (int(os.environ['RANK']) + x)
    if os.environ['RANK'] == '1':
        breakpoint()
    dist.all_reduce(t)
    time.sleep(linger)
    return t.item()

w.run(keep)
print('kept', w.run(kept))
"""


@pytest.mark.timeout(420)
def test_breakpoint_in_a_world_rank_through_the_input_box(kernel_config, tmp_path):
    async def scenario(nb):
        assert not (await nb.run(SETUP)).errors
        ran = await nb.run(FUNCS)
        assert not ran.errors and "kept [1, 101]" in ran.lines, ran

        # p, n, c; the last answer comes 7 s after its prompt, past the World's 5 s
        # timeout, and the ranks go on for 2 s more after it: the timeout was paused
        # while rank 1 was in pdb, else it would fire in that sleep.
        ran = await nb.run("print('result', w.run(f, (1,), {'linger': 2.0}))",
                           ["p t", "n", Answer("c", delay=7.0)])
        assert not ran.errors, ran
        assert ran.prompts == [f"[rank1]: {PDB}"] * 3, ran
        lines = ran.lines
        assert "result [3.0, 3.0]" in lines, ran
        assert "[rank1]: tensor([2.])" in lines, ran           # p t
        assert "[rank1]: -> dist.all_reduce(t)" in lines, ran  # where it stopped
        assert "[rank1]: -> time.sleep(linger)" in lines, ran  # after n
        assert not any(line.startswith("[rank0]") for line in lines), ran
        assert "timeout" not in (ran.stdout + ran.stderr).lower(), ran
        assert ran.seconds > 9, ran

        # The stop button while rank 1's prompt is open: the call is interrupted, the
        # World kept, and the next call works (and stops again, and continues).
        ran = await nb.run("w.run(f, (1,))", ["p t", STOP])
        assert ran.prompts == [f"[rank1]: {PDB}"] * 2, ran
        error = _error(ran)
        assert error["ename"] == "KeyboardInterrupt", ran
        assert error["evalue"].startswith("mplaunch.World: the ranks were interrupted; "
                                          "the world was kept"), ran
        ran = await nb.run("print('result', w.run(f, (2,)))", ["c"])
        assert not ran.errors and "result [5.0, 5.0]" in ran.lines, ran
        assert ran.prompts == [f"[rank1]: {PDB}"], ran

        # q: rank 1's call raises BdbQuit, a WorkerError in the cell; the World heals
        # and what the ranks kept from an earlier cell is still there.
        ran = await nb.run("w.run(f, (1,))", ["q"])
        assert ran.prompts == [f"[rank1]: {PDB}"], ran
        error = _error(ran)
        assert error["ename"] == "WorkerError", ran
        assert error["evalue"].startswith("rank 1 "), ran
        assert "BdbQuit" in error["evalue"], ran
        ran = await nb.run("print('kept', w.run(kept))\nprint('result', w.run(f, (3,)))", ["c"])
        assert not ran.errors, ran
        assert "kept [1, 101]" in ran.lines and "result [7.0, 7.0]" in ran.lines, ran

        assert not (await nb.run("w.close()")).errors

    in_notebook(kernel_config, tmp_path, scenario)


BOTH = """\
def both():
    import torch.distributed as dist
    rank = int(os.environ['RANK'])
    dist.barrier()
    breakpoint()
    here = rank * 10
    return here

print('result', w.run(both))
"""


@pytest.mark.timeout(300)
def test_breakpoints_in_two_ranks_take_turns(kernel_config, tmp_path):
    async def scenario(nb):
        assert not (await nb.run(SETUP)).errors
        # Both ranks stop at once (after the barrier); the first to ask holds the
        # box until it continues: the other rank's first prompt comes only after
        # that 'c'. The first answers wait a second each so that the other rank has
        # surely asked (and been named) before the first one continues.
        ran = await nb.run(BOTH, [Answer("p rank", delay=1.0), Answer("c", delay=1.0),
                           "p rank", "c"])
        assert not ran.errors and "result [0, 10]" in ran.lines, ran
        first, second = ran.prompts[0], ran.prompts[2]
        assert {first, second} == {f"[rank0]: {PDB}", f"[rank1]: {PDB}"}, ran
        assert ran.prompts == [first, first, second, second], ran
        a, b = (0, 1) if first.startswith("[rank0]") else (1, 0)
        assert f"[rank{a}]: {a}" in ran.lines and f"[rank{b}]: {b}" in ran.lines, ran
        # The waiting rank's pdb printed nothing before its turn: all its output came
        # after the first rank's 'c' was typed.
        continued = [i for i, e in enumerate(ran.events) if e[0] == "answer"][1]
        assert not [e for e in ran.events[:continued]
                    if e[0] == "stream" and f"[rank{b}]:" in e[2]], ran
        # pdb stops at the line after breakpoint() (line 6 of the cell); the note names
        # the breakpoint() call's line (5), as a terminal's does.
        assert ran.lines.count(f"[rank{a}]: -> here = rank * 10") == 1, ran
        assert ran.lines.count(f"[rank{b}]: -> here = rank * 10") == 1, ran
        # The waiting rank is named once, in the kernel's stderr (not a rank's).
        notes = [line for line in ran.stderr.splitlines() if "waits for" in line]
        assert len(notes) == 1, ran
        assert re.fullmatch(
            rf"mplaunch: rank {b} stopped at a breakpoint at \S+:5 and waits for "
            rf"rank {a}'s debugger to continue \('c'\)", notes[0]), ran

        assert not (await nb.run("w.close()")).errors

    in_notebook(kernel_config, tmp_path, scenario)


FAILS = """\
def g():
    secret = 7
    if os.environ['RANK'] == '0':
        raise ValueError('bad shard')
    return 'fine'

def ok():
    return int(os.environ['RANK'])

w.run(g)
"""

CELL_FAILS = """\
%%ranks
import os
def check(n):
    hidden = n * 3
    raise ValueError(f'cell failed {n}')
if os.environ['RANK'] == '1':
    check(14)
"""


@pytest.mark.timeout(420)
def test_post_mortem_after_a_world_run_and_a_ranks_cell(kernel_config, tmp_path):
    async def scenario(nb):
        assert not (await nb.run(SETUP)).errors
        ran = await nb.run(FAILS)
        assert _error(ran)["ename"] == "WorkerError", ran
        assert "raised ValueError: bad shard" in _error(ran)["evalue"], ran

        # A frontend that takes no input: debug() says so, and keeps the error.
        ran = await nb.run("w.debug()", allow_stdin=False)
        assert _error(ran)["ename"] == "RuntimeError", ran
        assert "nobody can answer" in _error(ran)["evalue"], ran
        assert not ran.prompts, ran

        ran = await nb.run("w.debug()", ["p secret * 6", "c"])
        assert not ran.errors, ran
        assert ran.prompts == [f"[rank0]: {PDB}"] * 2, ran
        assert "[rank0]: 42" in ran.lines, ran
        assert "[rank0]: mplaunch: rank 0 post-mortem: ValueError: bad shard" in ran.lines, ran
        assert "[rank0]: -> raise ValueError('bad shard')" in ran.lines, ran
        ran = await nb.run("print('ranks', w.run(ok))")
        assert not ran.errors and "ranks [0, 1]" in ran.lines, ran
        assert not (await nb.run("w.close()")).errors

        # The same through the magics, for a %%ranks cell's error in rank 1.
        assert not (await nb.run("%load_ext mplaunch")).errors
        ran = await nb.run(CELL_FAILS)
        assert _error(ran)["ename"] == "ValueError", ran
        assert _error(ran)["evalue"] == "cell failed 14", ran
        ran = await nb.run("%ranks debug 0")   # rank 0 raised nothing: a usage error
        assert not ran.prompts, ran
        assert ran.stderr.startswith("UsageError: rank 0 holds no error to debug"), ran
        ran = await nb.run("%ranks debug", ["p hidden", "w", "c"])
        assert not ran.errors, ran
        assert ran.prompts == [f"[rank1]: {PDB}"] * 3, ran
        assert "[rank1]: 42" in ran.lines, ran
        assert "[rank1]: -> raise ValueError(f'cell failed {n}')" in ran.lines, ran
        # The debugger's stack ('w') is the user's: the cell and check, none of
        # mplaunch's frames.
        assert not any("mplaunch/" in line for line in ran.lines), ran
        ran = await nb.run("%%ranks\nprint('after', os.environ['RANK'])")
        assert not ran.errors, ran
        assert sorted(ran.lines) == ["[rank0]: after 0", "[rank1]: after 1"], ran
        assert not (await nb.run("%ranks stop")).errors

    in_notebook(kernel_config, tmp_path, scenario)


@pytest.mark.timeout(300)
def test_input_and_a_frontend_without_stdin(kernel_config, tmp_path):
    async def scenario(nb):
        assert not (await nb.run("%load_ext mplaunch")).errors
        ran = await nb.run("%%ranks\n"
                           "import os\n"
                           "rank = int(os.environ['RANK'])\n"
                           "if rank == 1:\n"
                           "    name = input('name? ')\n"
                           "    print('got', repr(name))\n",
                           ["mplaunch rocks"])
        assert not ran.errors, ran
        assert ran.prompts == ["[rank1]: name? "], ran
        assert [line for line in ran.lines if line.startswith("[rank")] == [
            "[rank1]: got 'mplaunch rocks'"], ran

        # nbclient, nbconvert --execute: no input box. breakpoint() is skipped with a
        # note, input() raises EOFError, and the cell completes.
        ran = await nb.run("%%ranks\n"
                           "breakpoint()\n"
                           "try:\n"
                           "    input('x? ')\n"
                           "except EOFError:\n"
                           "    print('eof', rank)\n"
                           "print('past', rank)\n", allow_stdin=False)
        assert not ran.errors and not ran.prompts, ran
        assert sorted(ran.lines) == ["[rank0]: eof 0", "[rank0]: past 0",
                                     "[rank1]: eof 1", "[rank1]: past 1"], ran
        for r in (0, 1):
            assert any(line.startswith(f"[rank{r}]: mplaunch: breakpoint() skipped in "
                                       f"rank {r}: nobody can answer its prompt here")
                       for line in ran.stderr.splitlines()), ran

        # The next cell's frontend takes input again: the same world asks it.
        ran = await nb.run("%%ranks\n"
                           "if rank == 0:\n"
                           "    breakpoint()\n"
                           "    rank = rank + 0\n"
                           "print('done', rank)\n", ["p rank + 40", "c"])
        assert not ran.errors, ran
        assert ran.prompts == [f"[rank0]: {PDB}"] * 2, ran
        assert "[rank0]: 40" in ran.lines, ran
        assert "[rank0]: done 0" in ran.lines and "[rank1]: done 1" in ran.lines, ran

        # pdb.set_trace() asks the same way (pdb's own input()).
        ran = await nb.run("%%ranks\n"
                           "import pdb\n"
                           "if rank == 1:\n"
                           "    pdb.set_trace()\n"
                           "    rank = rank * 3\n"
                           "print('set_trace', rank)\n", ["p rank + 20", "n", "c"])
        assert not ran.errors, ran
        assert ran.prompts == [f"[rank1]: {PDB}"] * 3, ran
        assert "[rank1]: 21" in ran.lines and "[rank1]: -> rank = rank * 3" in ran.lines, ran
        assert "[rank1]: set_trace 3" in ran.lines and "[rank0]: set_trace 0" in ran.lines, ran
        assert not (await nb.run("%ranks stop")).errors

    in_notebook(kernel_config, tmp_path, scenario)
