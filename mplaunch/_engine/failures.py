"""Every RankFailure the launching process records, built in one place: what a rank's
exit, its exception, a stop or a timeout says about it, with the rank's identity (rank,
local rank, node, host, attempt) filled in alike everywhere.
"""
from __future__ import annotations

import time
from typing import Optional

from .ranks import RankState
from .._wire import linux
from .._wire.memory import killed_why
from .._wire.messages import EXIT_CHANNEL_CLOSED, Raised
from .._wire.spec import RankSpec
from ..errors import RankFailure, signal_name


def of_rank(r: RankState, attempt: int, **fields) -> RankFailure:
    """A failure of rank `r`'s process; `fields` are RankFailure's."""
    fields.setdefault("timestamp", r.exited_at or time.time())
    fields.setdefault("max_rss", r.max_rss)
    return RankFailure(r.spec.rank, r.pid, attempt=attempt, local_rank=r.local_rank,
                       node_rank=r.spec.node_rank, hostname=r.spec.hostname, **fields)


def raised(r: RankState, attempt: int, msg: Raised) -> RankFailure:
    """Rank `r`'s function raised (what it sent): by itself, or as the World's release
    or interrupt made it (``released``)."""
    return of_rank(r, attempt, exitcode=msg.exitcode, exc_type=msg.type_name,
                   message=msg.message, traceback=msg.traceback, timestamp=msg.timestamp,
                   released=msg.released)


def exited(r: RankState, attempt: int, status: int) -> Optional[RankFailure]:
    """What rank `r`'s exit with raw wait `status` says, if it is a failure: a signal
    (with its peak memory and what the kernel knows), or an exit without a result."""
    exitcode, signo = linux.describe_status(status)
    if r.has_result and exitcode == 0 and not r.spec.serve:
        return None
    if signo is not None:
        return of_rank(r, attempt, exitcode=exitcode, signal=signal_name(signo),
                       message=killed_why(signo, r.exit_note))
    if exitcode == EXIT_CHANNEL_CLOSED and not r.has_result:
        return of_rank(r, attempt, exitcode=exitcode, message=(
            "closed its result channel before it returned, so its result or error "
            "could not be sent (did it close file descriptors it did not open, e.g. "
            "os.closerange(3, ...)?)"))
    if r.spec.serve:
        return of_rank(r, attempt, exitcode=exitcode,
                       message=f"exited with code {exitcode} while its World was up")
    if exitcode == 0:
        return of_rank(r, attempt, exitcode=0, message="exited with code 0 without "
                       "returning a result (did it call os._exit(0)?)")
    return of_rank(r, attempt, exitcode=exitcode)


def gone_with_node(r: RankState, attempt: int, message: Optional[str]) -> RankFailure:
    """Rank `r` is gone with its node (a World across nodes): how it ended is not known
    here, since the news went with the node. `message` for the first such rank."""
    return of_rank(r, attempt, exitcode=None,
                   message=message or "is gone with it (on the same node)")


def of_node(first: RankSpec, attempt: int, message: str) -> RankFailure:
    """A failure of a node as a whole (not of one rank's process), recorded under its
    first rank."""
    return RankFailure(first.rank, None, None, None, message=message, attempt=attempt,
                       timestamp=time.time(), local_rank=first.local_rank,
                       node_rank=first.node_rank, hostname=first.hostname)


def stopped(r: RankState, attempt: int, when: Optional[float]) -> RankFailure:
    """Rank `r` was still running when stop() tore the ranks down at `when`."""
    return RankFailure(r.spec.rank, r.pid, None, None, message="was stopped before it "
                       "returned (stop() was called)", attempt=attempt, timestamp=when,
                       local_rank=r.local_rank, node_rank=r.spec.node_rank,
                       hostname=r.spec.hostname)


def timed_out(rank: int, attempt: int, limit: float) -> RankFailure:
    """The launch's time ran out with `rank` still running (no rank failed by itself)."""
    return RankFailure(rank, None, None, None, exc_type=None,
                       message=f"was still running after {limit:g} s",
                       attempt=attempt, timestamp=time.time())
