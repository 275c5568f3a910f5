"""How an attempt ended: one value, decided in one place.

An attempt can end six ways, and more than one thing can happen before its last rank is
gone (a rank fails, then the user presses Ctrl-C during the teardown; a stop() races a
timeout). :func:`decide` applies the precedence once, from what the attempt recorded;
the error to raise (_engine.outcome) and the multi-node report read the result, never
the raw events.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Dict, List, Optional


class EndKind(enum.Enum):
    COMPLETED = "completed"     # every rank returned
    FAILED = "failed"           # a rank raised, died or could not start
    TIMED_OUT = "timed out"     # the launch's (or the run's) timeout expired
    STOPPED = "stopped"         # stop() or close() was asked while ranks ran
    SIGNALLED = "signalled"     # the launching process received SIGINT/TERM/HUP/QUIT
    NODE_LOST = "node lost"     # another node failed first


@dataclass
class Ending:
    kind: EndKind
    signal: Optional[int] = None                            # SIGNALLED: which
    time_limit: Optional[float] = None                      # TIMED_OUT: the limit
    stacks: Dict[int, str] = field(default_factory=dict)    # TIMED_OUT: raw dumps by rank
    stopped: List[int] = field(default_factory=list)        # STOPPED: ranks still running
    remote_node: Optional[int] = None                       # NODE_LOST: the node

    @property
    def ok(self) -> bool:
        return self.kind is EndKind.COMPLETED


def decide(early: Optional[Ending], signal: Optional[int], failed: bool,
           remote_node: Optional[int]) -> Ending:
    """The attempt's ending. `early` is what made the loop tear down before the ranks
    ended on their own (a stop or a timeout: the first of them), `signal` a signal to
    this process (at any moment), `failed` whether this node recorded a failure, and
    `remote_node` another node that failed first.

    A signal wins over everything: the user asked this process to end, and an error
    from a teardown they caused is not news. A stop that found ranks running is what the
    caller asked for, unless a rank had already failed. Another node's failure is every
    node's error. A timeout is reported as such even if ranks failed while they were
    torn down."""
    if signal is not None:
        return Ending(EndKind.SIGNALLED, signal=signal)
    if early is not None and early.kind is EndKind.STOPPED and early.stopped and not failed:
        return early
    if remote_node is not None:
        return Ending(EndKind.NODE_LOST, remote_node=remote_node)
    if early is not None and early.kind is EndKind.TIMED_OUT:
        return early
    if failed:
        return Ending(EndKind.FAILED)
    return Ending(EndKind.COMPLETED)
