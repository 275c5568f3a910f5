"""A large value that a function of `__main__` reads as a global (a tensor a notebook
cell or a script made) crosses as an argument does (issue 38): written once into the
call's shared memory and mapped by every rank, not unpickled into a copy per rank. The
same for ``%ranks push`` of such a function, and for a rank's spawn and forkserver
children, which load `__main__` again from the rank.

Each case is a script run as `__main__` in a fresh interpreter (what is under test is
that interpreter's `__main__`); memory is the kernel's accounting of every rank
(/proc/PID/smaps_rollup, read by the script while the ranks hold the value)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("torch")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MiB = 1 << 20

COMMON = """
import json, os, sys
import torch
import mplaunch
from mplaunch._rank import cells

from smaps import MiB, rollup


def grown(before, after):
    return {r: {k: after[r][k] - before[r][k] for k in ("USS", "Pss", "Pss_Shmem")}
            for r in before}


def payload_files(at_least):
    # the payload files of `at_least` bytes or more that this process holds open (a
    # mapping's own fd, Python's mmap keeps one, counts as its file)
    files = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            if "mplaunch-payload" in os.readlink(f"/proc/self/fd/{name}"):
                st = os.fstat(int(name))
                if st.st_size >= at_least:
                    files.add((st.st_dev, st.st_ino))
        except OSError:
            pass
    return len(files)
"""


def _run_script(tmp_path, source: str) -> dict:
    script = tmp_path / "script.py"
    script.write_text(COMMON + textwrap.dedent(source))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=170, cwd=str(tmp_path), stdin=subprocess.DEVNULL,
                          env=dict(os.environ, PYTHONPATH=os.pathsep.join(
                              [ROOT, os.path.join(ROOT, "tests")])))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert len(lines) == 1, out
    return json.loads(lines[0][len("RESULT "):])


def _one_copy(grown: dict, size: int) -> None:
    """Each rank holds its share of one copy, and nothing of its own."""
    for r, g in grown.items():
        assert g["USS"] < 8 * MiB, (r, g)
        assert g["Pss_Shmem"] == pytest.approx(size / len(grown), rel=0.05), (r, g)
    # and the ranks' memory grew by that copy, and little else
    assert sum(g["Pss"] for g in grown.values()) < size + 8 * MiB * len(grown), grown


def test_a_global_read_by_a_main_function_is_one_copy_that_every_rank_maps(tmp_path):
    result = _run_script(tmp_path, """
        x = torch.rand(2 ** 23)                      # 32 MiB, made at the top level

        def train(scale):
            return float(x.sum()) * scale, payload_files(x.nbytes)

        with mplaunch.World(3) as world:
            world.run(len, ((),))                    # what a first call imports, done
            before = {r: rollup(p) for r, p in world.pids.items()}
            calls, want = [], []
            for _ in range(3):
                x.add_(1.0)                          # by value: each call sees it
                want.append(float(x.sum()))
                calls.append(world.run(train, (1.0,)))
            after = {r: rollup(p) for r, p in world.pids.items()}   # x is held there
        print("RESULT " + json.dumps({"calls": calls, "want": want,
                                      "grown": grown(before, after)}))
    """)
    for call, want in zip(result["calls"], result["want"]):
        for total, files in call:
            assert total == pytest.approx(want, rel=1e-4)
            # the call's payload only: the last call's file is not held meanwhile
            assert files == 1
    _one_copy(result["grown"], 32 * MiB)


def test_ranks_push_of_a_main_function_sends_its_globals_by_the_same_path(tmp_path):
    # what `%ranks push train` runs, then a `%%ranks` cell that calls it: the builtin
    # with the rank's own __main__ namespace, nothing of this process's
    result = _run_script(tmp_path, """
        x = torch.rand(2 ** 23)                      # 32 MiB

        def train():
            return float(x.sum())

        with mplaunch.World(2) as world:
            world.run(len, ((),))
            before = {r: rollup(p) for r, p in world.pids.items()}
            world.run(cells.push, ({"train": train},))
            totals = world.run(eval, ("train()", cells.MainNamespace()))
            after = {r: rollup(p) for r, p in world.pids.items()}
        print("RESULT " + json.dumps({"totals": totals, "want": float(x.sum()),
                                      "grown": grown(before, after)}))
    """)
    assert result["totals"] == [pytest.approx(result["want"], rel=1e-4)] * 2
    _one_copy(result["grown"], 32 * MiB)


@pytest.mark.slow
@pytest.mark.parametrize("context", ["forkserver", "spawn"])
def test_a_ranks_spawned_dataloader_workers_map_the_global_from_the_rank(tmp_path,
                                                                        context):
    # A worker started with spawn or forkserver rebuilds __main__ from the rank's
    # payload: it maps the rank's pages of x, and has no copy of its own.
    result = _run_script(tmp_path, f"""
        x = torch.rand(2 ** 22)                      # 16 MiB

        def mapped():
            found = []
            with open("/proc/self/smaps") as f:
                current = None
                for line in f:
                    parts = line.split()
                    if "-" in parts[0] and len(parts) >= 5:
                        current = {{}} if "mplaunch-payload" in line else None
                        if current is not None:
                            found.append(current)
                    elif current is not None and len(parts) == 3 and parts[2] == "kB":
                        current[parts[0].rstrip(":")] = int(parts[1]) * 1024
            return found


        class Whole(torch.utils.data.Dataset):
            def __len__(self):
                return 1

            def __getitem__(self, i):
                total = float(x.sum())
                return total, [(m["Rss"], m["Anonymous"]) for m in mapped()]


        def load():
            loader = torch.utils.data.DataLoader(Whole(), batch_size=None, num_workers=1,
                                                 multiprocessing_context="{context}")
            return list(loader)

        with mplaunch.World(1) as world:
            ((item,),) = world.run(load)
        print("RESULT " + json.dumps({{"item": item, "want": float(x.sum())}}))
    """)
    total, mappings = result["item"]
    assert total == pytest.approx(result["want"], rel=1e-4)
    # x's pages, read through a mapping of the rank's payload, none of them copied
    assert any(rss >= 15 * MiB and anon == 0 for rss, anon in mappings), mappings
