"""Where every live rank is, asked without stopping anything: on a launch's timeout, and
on demand (Handle.stacks, World.stacks, %ranks stacks, the watcher's SIGUSR1).

Each rank has faulthandler registered on STACK_SIGNAL at C level, writing to a socket of
its own, so a rank answers even while blocked inside a gloo collective. A rank with
torch.distributed initialised runs a collectives reporter instead (_rank.collectives):
it is asked with a byte on that socket and answers with its collective sequence number
and the dump; the signal goes to it only if it does not answer. A rank that cannot
answer (signals blocked, or a C loop faulthandler cannot interrupt) must not hang the
caller: collection stops after _STACK_WAIT, or once every rank has written and gone
quiet.

Any thread may ask while another drives the group's loop: the asker reads the stack
sockets itself (the loop never does), holding the group's lock, which keeps the ranks'
fds open and their pids unreaped meanwhile.
"""
from __future__ import annotations

import os
import selectors
import sys
import threading
import time
from typing import Dict, Optional

from .ending import EndKind, Ending
from .group import RankGroup
from .._wire.messages import STACK_SIGNAL
from .._wire.stacks import REPORTER, split_record, summarize_stacks

_STACK_WAIT = 2.0      # the most a caller waits for the ranks' stack dumps
_QUIET = 0.1           # a dump is complete once its socket has been quiet this long
_ANSWER_WAIT = 0.3     # how long a rank's collectives reporter may take to answer


def _read(fd: int):
    try:
        return os.read(fd, 1 << 16)
    except BlockingIOError:
        return None
    except OSError:
        return b""


# A timeout's report goes with its error; where the ranks take longer than this to be
# released (a World) or ended (a launch), as 64 ranks do (6 s here), it is said at once
# too, so that the rank that is missing and its line come within a second.
SAY_EARLY_AFTER_S = 0.4


def timed_out(group: RankGroup, time_limit: float) -> Ending:
    """The TIMED_OUT ending of `group`'s call, with every rank's stack; the report is
    printed on stderr unless the call ends (hush) within SAY_EARLY_AFTER_S."""
    stacks = collect_stacks(group)

    def say():
        try:
            sys.stderr.write(f"mplaunch: timed out after {time_limit:g} s; where each "
                             f"rank is (the error follows once the ranks are released or "
                             f"ended):\n{summarize_stacks(stacks)}\n")
            sys.stderr.flush()
        except Exception:  # noqa: BLE001 - a closed stream: the error still says it
            pass
    hush(group)
    group.said_early = timer = threading.Timer(SAY_EARLY_AFTER_S, say)
    timer.daemon = True
    timer.start()
    return Ending(EndKind.TIMED_OUT, time_limit=time_limit, stacks=stacks)


def hush(group: Optional[RankGroup]) -> None:
    """`group`'s call has ended (its error is about to be raised): nothing said early."""
    timer = getattr(group, "said_early", None)
    if timer is not None:
        timer.cancel()
        group.said_early = None


def collect_stacks(group: RankGroup, only=None) -> Dict[int, str]:
    """{global rank: raw faulthandler dump} of every rank alive now (or of the ranks
    in `only`). Thread-safe."""
    with group.lock:
        alive = _reachable(group, only)
        texts = {r.stack_fd: b"" for r in alive}
        asked = _ask_reporters(alive, b"?")
        group.send_signal(STACK_SIGNAL, [r for r in alive if not r.reporter])
        begun = time.monotonic()
        _read_until_quiet(alive, texts, asked, group, begun)
        return {r.spec.rank: texts[r.stack_fd].decode("utf-8", "replace") for r in alive}


def _reachable(group: RankGroup, only=None) -> list:
    """The ranks of `group` (or those in `only`) alive now, with a stack channel."""
    return [r for r in group.ranks if r.signalable and r.stack_fd is not None
            and (only is None or r.spec.rank in only)]


def _ask_reporters(ranks, request: bytes) -> list:
    """Empty each rank's stack channel (its reporter's announcement, or an answer too
    late for an earlier request), then send `request` to the ranks whose collectives
    reporter runs (_rank.collectives): those asked."""
    for r in ranks:
        stale = b""
        while (chunk := _read(r.stack_fd)):
            stale += chunk
        if REPORTER.encode() in stale:
            r.reporter = True
    asked = [r for r in ranks if r.reporter]
    for r in asked:
        try:
            os.write(r.stack_fd, request)
        except OSError:
            pass
    return asked


def _read_until_quiet(alive, texts, asked, group: RankGroup, begun: float) -> None:
    done = set()
    sel = selectors.DefaultSelector()
    try:
        for fd in texts:
            sel.register(fd, selectors.EVENT_READ)
        last_data = begun
        while time.monotonic() < begun + _STACK_WAIT:
            for key, _ in sel.select(0.02):
                chunk = _read(key.fd)
                if chunk:
                    texts[key.fd] += chunk
                    last_data = time.monotonic()
                elif chunk == b"":
                    sel.unregister(key.fd)
                    done.add(key.fd)
            if asked and time.monotonic() - begun > _ANSWER_WAIT:
                # Its main thread holds the GIL: only the signal's handler can answer.
                silent = [r for r in asked if not texts[r.stack_fd]]
                group.send_signal(STACK_SIGNAL, silent)
                asked = []
            answered = all(texts[r.stack_fd] or r.stack_fd in done or not r.alive
                           for r in alive)
            if answered and time.monotonic() - last_data > _QUIET:
                break
    finally:
        sel.close()


def collect_records(group: RankGroup, wait: float = 0.2) -> Dict[int, Optional[dict]]:
    """{global rank: its collectives record (_rank.collectives.report)} of the ranks
    whose reporter runs, asked for the record alone (no stacks: a fraction of a
    millisecond in each); a rank that does not answer within `wait` is left out.
    Thread-safe."""
    with group.lock:
        asked = _ask_reporters(_reachable(group), b"c")
        texts = {r.stack_fd: b"" for r in asked}
        sel = selectors.DefaultSelector()
        try:
            for fd in texts:
                sel.register(fd, selectors.EVENT_READ)
            end = time.monotonic() + wait
            while time.monotonic() < end and not all(
                    t.endswith(b"\x00") and t.count(b"\x00") >= 2 for t in texts.values()):
                for key, _ in sel.select(0.01):
                    chunk = _read(key.fd)
                    if chunk:
                        texts[key.fd] += chunk
                    elif chunk == b"":
                        sel.unregister(key.fd)
        finally:
            sel.close()
        return {r.spec.rank: split_record(texts[r.stack_fd].decode("utf-8", "replace"))[1]
                for r in asked if texts[r.stack_fd]}
