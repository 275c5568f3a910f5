"""What one finished attempt amounts to: the ranks' results, or the error to raise.

The first failure by time is the one reported; its rank's own exception becomes the
error's ``__cause__``; the end of its stderr (less the traceback, which travels as the
cause) is kept; error files are written for torch elastic's tools.
"""
from __future__ import annotations

import os
import time
from typing import Any, List, Optional

from ._group import RankGroup
from ._tails import summarize_tail, write_error_file
from ._exceptions import unpack_exception
from ._stacks import summarize_stacks
from .errors import LaunchTimeout, MainProcessError, RankFailure, WorkerError


def results_or_raise(attempt) -> List[Any]:
    """Each rank's return value, by local rank; or raise what the attempt ended in.
    `attempt` is a finished _attempt.Attempt."""
    if attempt.signal_received is not None:
        raise MainProcessError(attempt.signal_received, attempt.cfg.nprocs)
    nodes = attempt.nodes
    if attempt.stopped and not attempt.group.failures:
        raise WorkerError([_stopped_record(attempt, rank) for rank in attempt.stopped])
    if attempt.group.failures or attempt.timed_out or (
            nodes is not None and nodes.remote_node is not None):
        raise error_for(attempt)
    return [r.result for r in attempt.group.ranks]


def error_for(attempt) -> WorkerError:
    cfg, group, nodes = attempt.cfg, attempt.group, attempt.nodes
    if nodes is not None and nodes.remote_node is not None:
        # Another node failed first: raise its error, as every node does.
        if nodes.remote_report is not None and nodes.remote_report[0]:
            failures, error_msg = nodes.remote_report
        else:
            failures = [group.node_failure(
                f"was torn down because node {nodes.remote_node} failed")]
            error_msg = None
        return _with_cause(WorkerError(failures, note=f"[on node {failures[0].node_rank}]"),
                           error_msg)
    failures = local_failures(group)
    if cfg.log_dir is not None:
        for f in failures:
            write_error_file(os.path.join(cfg.log_dir, f"attempt_{attempt.number}",
                                          str(f.local_rank), "error.json"), f)
    user_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if user_file and failures:
        write_error_file(user_file, failures[0])
    if attempt.timed_out:
        err = LaunchTimeout(failures or [_timeout_record(attempt)], attempt.time_limit,
                            attempt.stacks, summarize_stacks(attempt.stacks))
    else:
        err = WorkerError(failures, note=f"[on node {cfg.node_rank}]"
                          if cfg.nnodes > 1 else None)
    return _with_cause(err, first_error(group, failures))


def local_failures(group: RankGroup) -> List[RankFailure]:
    """This node's failures, first first, each with the end of its stderr."""
    failures = sorted(group.failures, key=lambda f: (f.timestamp or 0.0))
    for f in failures:
        if f.pid is not None and f.stderr_tail is None:
            f.stderr_tail = _stderr_tail(group, f.local_rank) or None
    return failures


def first_error(group: RankGroup, failures: List[RankFailure]):
    """The "err" message of the first of `failures` (from local_failures), if that rank
    raised."""
    if not failures:
        return None
    return group.ranks[failures[0].local_rank].error


def _stderr_tail(group: RankGroup, local_rank: int) -> str:
    r = group.ranks[local_rank]
    text = r.err.tail_text()
    if r.error is not None and r.error[4]:
        # The traceback travels as the error's __cause__; do not repeat it.
        head, sep, rest = text.rpartition(r.error[4])
        if sep and not rest.strip():
            text = head
    return summarize_tail(text)


def _with_cause(err: WorkerError, error_msg) -> WorkerError:
    if error_msg is not None:
        _, blob, type_name, message, tb_text, _code, _ts = error_msg
        err.__cause__ = unpack_exception(blob, type_name, message, tb_text)
    return err


def _stopped_record(attempt, rank: int) -> RankFailure:
    r = attempt.group.ranks[rank - attempt.cfg.global_rank(0)]
    return RankFailure(rank, r.pid, None, None, message="was stopped before it returned "
                       "(stop() was called)", attempt=attempt.number,
                       timestamp=attempt.group.stop_wall, local_rank=r.local_rank,
                       node_rank=r.spec.node_rank, hostname=r.spec.hostname)


def _timeout_record(attempt) -> RankFailure:
    stuck: Optional[int] = min(attempt.stacks) if attempt.stacks else None
    first = attempt.group.ranks[0].spec
    return RankFailure(first.rank if stuck is None else stuck, None, None, None,
                       exc_type=None,
                       message=f"was still running after {attempt.time_limit:g} s",
                       attempt=attempt.number, timestamp=time.time())
