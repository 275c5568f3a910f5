"""What one finished attempt amounts to: the ranks' results, or the error to raise.

The first failure by time is the one reported; its rank's own exception becomes the
error's ``__cause__``; the end of its stderr (less the traceback, which travels as the
cause) is kept; error files are written for torch elastic's tools.
"""
from __future__ import annotations

import os
from typing import Any, List, Optional

from .failures import stopped as stopped_failure, timed_out as timeout_failure
from .ending import Ending, EndKind
from .group import RankGroup
from .tails import summarize_tail, write_error_file
from .._wire.exceptions import unpack_exception
from .._wire.messages import Raised
from .._wire.stacks import summarize_stacks
from ..errors import LaunchTimeout, MainProcessError, RankFailure, WorkerError


def results_or_raise(attempt) -> List[Any]:
    """Each rank's return value, by local rank; or raise what the attempt ended in.
    `attempt` is a finished _engine.attempt.Attempt."""
    ending = attempt.ending
    if ending.kind is EndKind.COMPLETED:
        return [r.result for r in attempt.group.ranks]
    if ending.kind is EndKind.SIGNALLED:
        raise MainProcessError(ending.signal, attempt.cfg.nprocs)
    if ending.kind is EndKind.STOPPED:
        raise WorkerError([_stopped_record(attempt, rank) for rank in ending.stopped])
    raise error_for(attempt, ending)


def error_for(attempt, ending: Ending) -> WorkerError:
    """The error of an attempt that failed, timed out or lost another node."""
    cfg, group, nodes = attempt.cfg, attempt.group, attempt.nodes
    if ending.kind is EndKind.NODE_LOST:
        # Another node failed first: raise its error, as every node does.
        if nodes.remote_report is not None and nodes.remote_report[0]:
            failures, raised = nodes.remote_report
        else:
            failures = [group.node_failure(
                f"was torn down because node {ending.remote_node} failed")]
            raised = None
        return _with_cause(WorkerError(failures, note=f"[on node {failures[0].node_rank}]"),
                           raised)
    failures = local_failures(group)
    if cfg.log_dir is not None:
        for f in failures:
            r = _state_of(group, f.rank)
            name = r.log_name if r is not None else str(f.local_rank)
            write_error_file(os.path.join(cfg.log_dir, f"attempt_{attempt.number}",
                                          name, "error.json"), f)
    user_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if user_file and failures:
        write_error_file(user_file, failures[0])
    if ending.kind is EndKind.TIMED_OUT:
        err = LaunchTimeout(failures or [_timeout_record(attempt, ending)],
                            ending.time_limit, ending.stacks,
                            summarize_stacks(ending.stacks))
    else:
        # The failing rank's node: this one for a launch, any for a World across nodes.
        node = failures[0].node_rank if failures else cfg.node_rank
        err = WorkerError(failures, note=f"[on node {node}]" if cfg.nnodes > 1 else None)
    return _with_cause(err, first_error(group, failures))


def local_failures(group: RankGroup) -> List[RankFailure]:
    """This node's failures, first first, each with the end of its stderr."""
    failures = sorted(group.failures, key=lambda f: (f.timestamp or 0.0))
    for f in failures:
        if f.pid is not None and f.stderr_tail is None:
            f.stderr_tail = _stderr_tail(group, f.rank) or None
    return failures


def first_error(group: RankGroup, failures: List[RankFailure]):
    """The "err" message of the first of `failures` (from local_failures), if that rank
    raised."""
    if not failures:
        return None
    r = _state_of(group, failures[0].rank)
    return r.error if r is not None else None


def _stderr_tail(group: RankGroup, rank: int) -> str:
    r = _state_of(group, rank)
    if r is None:
        return ""
    text = r.err.tail_text()
    if r.error is not None and r.error.traceback:
        # The traceback travels as the error's __cause__; do not repeat it.
        head, sep, rest = text.rpartition(r.error.traceback)
        if sep and not rest.strip():
            text = head
    return summarize_tail(text)


def _with_cause(err: WorkerError, raised: Optional[Raised]) -> WorkerError:
    if raised is not None:
        err.__cause__ = unpack_exception(raised.blob, raised.type_name, raised.message,
                                         raised.traceback)
    return err


def _stopped_record(attempt, rank: int) -> RankFailure:
    r = attempt.group.ranks[rank - attempt.cfg.global_rank(0)]
    return stopped_failure(r, attempt.group.attempt, attempt.group.teardown.wall)


def _timeout_record(attempt, ending: Ending) -> RankFailure:
    stuck: Optional[int] = min(ending.stacks) if ending.stacks else None
    rank = attempt.group.ranks[0].spec.rank if stuck is None else stuck
    return timeout_failure(rank, attempt.group.attempt, ending.time_limit)


def _state_of(group, rank: int):
    """The RankState of global rank `rank`, if `group` holds it."""
    return next((r for r in group.ranks if r.spec.rank == rank), None)
