"""What a rank is told about the launching process's terminal, decided when it starts.

- stdin: one rank (``stdin_rank``, default 0) reads this process's stdin when that is a
  terminal this process may read, so ``breakpoint()``, ``pdb`` and ``input()`` work
  there. Every other rank, and every rank when stdin is anything else (pytest's
  capture, a notebook kernel, nohup, a CI job, a closed fd, a background job), reads
  /dev/null: ``input()`` raises EOFError at once instead of waiting for input that
  nobody will type.
- stdout and stderr: when the rank's relayed stream ends on a terminal, the rank's
  Python stream says it is a terminal, and ``COLUMNS``/``LINES`` give the terminal's
  size less the prefix, so a progress bar fits on one line after it.
"""
from __future__ import annotations

import dataclasses
import numbers
import os
from typing import Optional

def check_stdin_rank(value) -> Optional[int]:
    """launch()'s ``stdin_rank``: a global rank, or None for no rank."""
    if value is None:
        return None
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 0:
        raise ValueError(f"stdin_rank must be a rank number (an int >= 0) or None, got "
                         f"{value!r}")
    return int(value)


def stdin_is_terminal() -> bool:
    """Whether this process's stdin is a terminal it may read now.

    A background job's terminal belongs to the foreground job (the shell, say): a rank
    reading it would take the keystrokes meant for that, so it is not passed on then."""
    if not os.isatty(0):
        return False
    try:
        return os.tcgetpgrp(0) == os.getpgrp()
    except OSError:
        return True  # not our controlling terminal: we cannot be in its background


def for_rank(cfg, spec, out, err):
    """What to add to one rank's start: the fds after its required ones (its stdin,
    for the rank that reads the terminal), and its spec with the terminal described.
    `out` and `err` are its StreamRelays."""
    fds = []
    if cfg.stdin_rank is not None and spec.rank == cfg.stdin_rank and stdin_is_terminal():
        fds.append(0)
        out.show_prompts()
        err.show_prompts()
    terminal = {"stdout": out.is_terminal, "stderr": err.is_terminal}
    env = spec.env
    size = err.terminal_size() or out.terminal_size()
    if size is not None and "COLUMNS" not in env:
        width = len(out.prefix if out.is_terminal else err.prefix)
        env = dict(env, COLUMNS=str(max(20, size.columns - width)),
                   LINES=str(size.lines))
    return fds, dataclasses.replace(spec, terminal=terminal, env=env)
