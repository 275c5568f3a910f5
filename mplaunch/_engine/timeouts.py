"""When a launch's time is up: ask every live rank where it is, and collect the answers
within a bounded time.

Each rank has faulthandler registered on STACK_SIGNAL at C level, writing to a pipe of
its own, so a rank answers even while blocked inside a gloo collective. A rank that
cannot answer (signals blocked, or a C loop faulthandler cannot interrupt) must not hang
the launch: collection stops after _STACK_WAIT, or once every rank has written and gone
quiet.
"""
from __future__ import annotations

import time
from typing import Dict

from .group import RankGroup
from .._wire.messages import STACK_SIGNAL

_STACK_WAIT = 2.0      # the most a timed-out launch waits for the ranks' stack dumps
_QUIET = 0.1           # a dump is complete once its pipe has been quiet this long


def collect_stacks(group: RankGroup) -> Dict[int, str]:
    """{global rank: raw faulthandler dump} of every rank alive now."""
    alive = [r for r in group.ranks if r.signalable]
    group.watch_stacks(alive)
    group.send_signal(STACK_SIGNAL, alive)
    end = time.monotonic() + _STACK_WAIT
    quiet_since = None
    while time.monotonic() < end:
        before = sum(len(r.stack_text) for r in alive)
        group.wait(0.05)
        after = sum(len(r.stack_text) for r in alive)
        if all(r.stack_text or not r.alive for r in alive):
            if after != before:
                quiet_since = None
            elif quiet_since is None:
                quiet_since = time.monotonic()
            elif time.monotonic() - quiet_since > _QUIET:
                break
    return {r.spec.rank: r.stack_text.decode("utf-8", "replace") for r in alive}
