"""The launching process's side of pdb and input() in a rank (_rank.debugging): it
answers each rank's request for a line with a line from wherever its user is, one
rank at a time.

Where the user is (a *front-end*: _engine.prompts) is looked up when a rank first
asks, not when the ranks start: a World started in one cell and called from another
asks the kernel that runs the call. In order:

- a front-end the caller set (the pytest plugin under ``--pdb``: its terminal, with
  pytest's capture suspended while a rank holds it);
- an IPython kernel whose frontend takes input (Jupyter, VS Code): the kernel's own
  ``input()``, so the prompt is the notebook's input box;
- a terminal that this process may read (unless ``stdin_rank=None``): the prompt is
  written to stdout, and the line read from fd 0 on the group's selector, so the
  ranks' output, their deaths and Ctrl-C are handled while the user types;
- nobody: ``breakpoint()`` is skipped with a note and ``input()`` raises EOFError.

The turn: the first rank to ask holds it (for pdb, until it continues or quits, or
its call ends); another rank asking meanwhile is named once and answered after. While
a rank holds it or waits, the launch's and the call's timeouts are paused (their
deadlines are on ``clock()``): a debugged rank is not a hung one.
"""
from __future__ import annotations

import os
import selectors
import sys
import threading
import time
import weakref
from typing import List, Optional

from .._wire.channel import send_framed
from .._wire.messages import DEBUG_TAG, DebugAsk
from . import prompts
from .output import relay_pending

_sessions = [0]   # debugger sessions opened in this process (the pytest plugin asks)


def sessions() -> int:
    return _sessions[0]


class Debugging:
    """One RankGroup's requests for lines."""

    def __init__(self, sel: selectors.BaseSelector, cfg, group=None):
        self._sel = sel
        # The terminal answers unless the user said no rank reads it (stdin_rank=None);
        # across nodes (a World's nodes are started with stdin_rank=None: no remote rank
        # gets this fd 0) it answers the remote ranks' prompts all the same.
        self._terminal = cfg.stdin_rank is not None or cfg.nnodes > 1
        # Its group, by a weak reference: a cycle would keep the group, and the results
        # its ranks returned (their tensors' memfds), alive until the cycle collector.
        self._group = (lambda: None) if group is None else weakref.ref(group)
        self._frontend = None
        self._holder = None            # the RankState whose request is being answered
        self._holding = False          # its pdb keeps the turn between prompts
        self._waiting: List[tuple] = []   # (RankState, DebugAsk) in order
        self._asked = None             # the request the front-end is answering
        self._interrupted = False
        self._lock = threading.Lock()
        self._inbox: List[tuple] = []     # post()ed from another thread
        self._relay_moved = None       # the relays' sinks before the front-end's
        self._paused = 0.0
        self._since: Optional[float] = None

    # -- what the group tells it ---------------------------------------------------------
    def on_ask(self, r, ask: DebugAsk) -> None:
        if ask.kind in ("open", "post-mortem"):
            wanted = ask.kind == "open" or _post_mortem_wanted()
            if not wanted or self._interrupted or self._front() is None:
                self._answer(r, "I" if self._interrupted else "n")
                return
        if ask.kind == "end":
            if self._holder is r:
                self._release()
            return
        self._clock(True)
        if self._holder is None or self._holder is r:
            self._serve(r, ask)
            return
        self._waiting.append((r, ask))
        if ask.kind != "line" or ask.hold:
            what = "an error" if ask.kind == "post-mortem" else "a breakpoint"
            at = f" at {ask.where}" if ask.where else ""
            prompts.note(f"mplaunch: rank {r.spec.rank} stopped at {what}{at} and waits "
                         f"for rank {self._holder.spec.rank}'s debugger to continue ('c')")

    def refuse(self, r) -> None:
        self._answer(r, "I")

    def gone(self, r) -> None:
        """Rank `r` answered its call or died: its requests are over."""
        self._waiting = [(w, a) for w, a in self._waiting if w is not r]
        if self._holder is r:
            self._release()

    def interrupt(self) -> None:
        """The call is being interrupted or torn down: every request is answered so (a
        pdb continues, into the World's interrupt; input() raises), and no rank opens
        another until the next call."""
        if self._interrupted:
            return
        self._interrupted = True
        asked = [self._holder] if self._asked is not None else []
        asked += [w for w, _ in self._waiting]
        self._waiting = []
        self._stop_reading()
        self._holder, self._asked, self._holding = None, None, False
        for r in asked:
            self._answer(r, "I")
        self._clock(False)

    def new_call(self) -> None:
        self._interrupted = False
        self._frontend = None

    def clock(self) -> float:
        """time.monotonic() less the time ranks held or waited for the turn: the
        clock of the launch's and a call's deadlines (a debugged rank is not a hung
        one)."""
        if self._since is not None:
            return self._since - self._paused   # stopped while a rank is debugged
        return time.monotonic() - self._paused

    # -- serving -----------------------------------------------------------------------
    def _front(self):
        if self._frontend is None:
            self._frontend = prompts.choose(self._terminal, self)
        return self._frontend or None

    def _serve(self, r, ask: DebugAsk) -> None:
        front = self._front()
        if front is None or self._interrupted:
            self._answer(r, "I" if self._interrupted else "N" if ask.kind == "line"
                         else "n")
            self.gone(r)
            return
        if self._holder is not r:
            self._holder = r
            _sessions[0] += 1
            front.opened()
            self._relay_moved = self._move_relays(front)
        if ask.kind != "line":   # pdb is about to stop there: the turn is its own
            self._holding = True
            self._answer(r, "y")
            return
        self._holding = ask.hold
        self._asked = ask
        # What it printed before asking (pdb's answer to the last line) is all in its
        # pipes, flushed before the ask was sent: on screen before the prompt, which
        # would otherwise cut into it wherever the pipe held more than one read.
        relay_pending(r, end_line=False)
        prompt = _prefix(r) + ask.text
        front.ask(prompt, self._sel, self._on_line)

    def _on_line(self, line: Optional[str]) -> None:
        """The front-end's answer to the request: the line, or None at end of input."""
        r = self._holder
        if r is None or self._asked is None:
            return
        self._asked = None
        self._answer(r, "E" if line is None else "L" + line)
        if not self._holding:
            self._release()

    def on_interrupt(self) -> None:
        """The kernel's interrupt came while its input box was open (this thread's):
        as Ctrl-C would have, it goes to this process's SIGINT handler (the World's)."""
        self.interrupt()
        prompts.resignal()

    def post(self, func, *args) -> None:
        """From another thread: run func(*args) in the group's loop (take_posts)."""
        with self._lock:
            self._inbox.append((func, args))
        group = self._group()
        if group is not None:
            group._waker.wake()

    def take_posts(self) -> None:
        with self._lock:
            inbox, self._inbox = self._inbox, []
        for func, args in inbox:
            func(*args)

    def _release(self) -> None:
        self._stop_reading()
        front = self._frontend
        self._holder, self._asked, self._holding = None, None, False
        if front:
            front.closed()
            group = self._group()
            if self._relay_moved is not None and group is not None:
                group.relay_to(*self._relay_moved)
            self._relay_moved = None
        if self._waiting:
            r, ask = self._waiting.pop(0)
            self._serve(r, ask)
        else:
            self._clock(False)

    def _move_relays(self, front):
        """Where the front-end swapped this process's streams (pytest's capture,
        suspended), the ranks' output goes to the ones now in place while a rank holds
        the turn: what pdb prints is read with its prompt. The sinks before, or None."""
        group = self._group()
        if not getattr(front, "moves_streams", False) or group is None:
            return None
        r = next((r for r in group.ranks if r.out is not None and r.err is not None),
                 None)
        if r is None:
            return None
        before = (r.out.sink, r.err.sink)
        group.relay_to(sys.stdout, sys.stderr)
        return before

    def _stop_reading(self) -> None:
        front = self._frontend
        if front:
            front.cancel(self._sel)
        prompts.forget_deferred(self)

    def _clock(self, running: bool) -> None:
        now = time.monotonic()
        if running and self._since is None:
            self._since = now
        elif not running and self._since is not None:
            self._paused += now - self._since
            self._since = None

    @staticmethod
    def _answer(r, text: str) -> None:
        try:
            send_framed(r.reader.sock, DEBUG_TAG + text.encode("utf-8", "replace"))
        except (OSError, ValueError):
            pass   # it is gone: its exit says so


def _prefix(r) -> str:
    """The rank's output prefix, so its prompt reads as its other lines do."""
    prefix = r.out.prefix.decode("utf-8", "replace") if r.out is not None else ""
    return prefix or f"[rank{r.spec.rank}]: "


def _post_mortem_wanted() -> bool:
    """A rank's error opens pdb there: ``MPLAUNCH_POST_MORTEM=1`` in this process's
    environment (``mplaunch --pdb`` sets it), or pytest's ``--pdb`` (the plugin's
    front-end)."""
    if getattr(prompts.override, "post_mortem", False):
        return True
    return os.environ.get("MPLAUNCH_POST_MORTEM", "") not in ("", "0")
