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
import time
from typing import Dict

from .group import RankGroup
from .._wire.messages import STACK_SIGNAL
from .._wire.stacks import REPORTER

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


def collect_stacks(group: RankGroup) -> Dict[int, str]:
    """{global rank: raw faulthandler dump} of every rank alive now. Thread-safe."""
    with group.lock:
        alive = [r for r in group.ranks if r.signalable and r.stack_fd is not None]
        texts = {r.stack_fd: b"" for r in alive}
        for r in alive:
            stale = b""
            while True:
                chunk = _read(r.stack_fd)
                if not chunk:
                    break
                stale += chunk  # an announcement, or an answer too late for a request
            if REPORTER.encode() in stale:
                r.reporter = True
        asked = [r for r in alive if r.reporter]
        for r in asked:
            try:
                os.write(r.stack_fd, b"?")
            except OSError:
                pass
        group.send_signal(STACK_SIGNAL, [r for r in alive if not r.reporter])
        begun = time.monotonic()
        _read_until_quiet(alive, texts, asked, group, begun)
        return {r.spec.rank: texts[r.stack_fd].decode("utf-8", "replace") for r in alive}


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
