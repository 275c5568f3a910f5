"""Every ```python block of README.md runs as written, each in a fresh interpreter: a
reader who copies one into a file gets no NameError for a name another block (or no
block) defined.

A block that cannot run here (it needs a GPU, or a network) says so on the line before
it, ``<!-- readme: not run: needs a GPU -->``; the test skips it with that reason. Prefer
a block that runs."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
RUN_TIMEOUT = 120   # each block takes a few seconds (one warm server, one torch import)
NOT_RUN = re.compile(r"<!--\s*readme:\s*not run:\s*(.+?)\s*-->")


def python_blocks(text: str):
    """[(first line number, source, reason not to run it or None)] of the ```python
    blocks of a Markdown text."""
    blocks, lines = [], text.splitlines()
    i = 0
    while i < len(lines):
        if lines[i].strip() == "```python":
            start = i + 1
            end = next(j for j in range(start, len(lines)) if lines[j].strip() == "```")
            before = lines[i - 1] if i > 0 else ""
            marked = NOT_RUN.search(before)
            blocks.append((start + 1, "\n".join(lines[start:end]) + "\n",
                           marked.group(1) if marked else None))
            i = end
        i += 1
    return blocks


with open(README) as _f:
    BLOCKS = python_blocks(_f.read())


def test_the_readme_has_python_blocks_to_run():
    assert len(BLOCKS) >= 2, "README.md lost its ```python blocks, or this parser broke"
    assert python_blocks("x\n<!-- readme: not run: needs a GPU -->\n```python\na = 1\n```\n"
                         ) == [(4, "a = 1\n", "needs a GPU")]


@pytest.mark.parametrize("line, source, not_run", BLOCKS,
                         ids=[f"line{b[0]}" for b in BLOCKS])
def test_readme_block_runs_in_a_fresh_interpreter(line, source, not_run, tmp_path):
    if not_run:
        pytest.skip(f"README.md line {line}: {not_run}")
    script = tmp_path / f"readme_line{line}.py"
    script.write_text(source)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PYTEST_", "MPLAUNCH_STORE"))}
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=RUN_TIMEOUT,
                          stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, (
        f"README.md's block at line {line} failed (exit code {proc.returncode}):\n"
        f"{proc.stderr[-4000:]}")
