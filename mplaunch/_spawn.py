"""mplaunch.spawn(): torch.multiprocessing.spawn's signature and calling convention, on
mplaunch's launch (its errors, output relay, teardown and rendezvous)."""
from __future__ import annotations

from typing import Any, Callable, List, Optional

from ._engine.config import check_call
from ._handle import Handle, start
from ._launch import from_here
from ._rank.calls import with_local_rank
from .errors import MPLaunchError


class SpawnContext:
    """What ``spawn(..., join=False)`` returns: torch's ``ProcessContext`` shape.

    ``join(timeout=None)`` waits up to ``timeout`` seconds (None: until the ranks end)
    and returns True once every rank has returned, False while they still run; a failed
    rank raises :class:`~mplaunch.WorkerError` from it (torch raises
    ``ProcessRaisedException``). ``pids()`` lists the ranks' process ids in rank order.
    ``handle`` is the underlying :class:`~mplaunch.Handle` (results, ``stacks()``,
    ``stop()``).
    """

    __module__ = "mplaunch"

    def __init__(self, handle: Handle):
        self.handle = handle

    def pids(self) -> List[int]:
        """The ranks' process ids, in rank order."""
        pids = self.handle.pids
        return [pids[r] for r in sorted(pids)]

    def join(self, timeout: Optional[float] = None,
             grace_period: Optional[float] = None) -> bool:
        """True once every rank has returned; False if they still run after `timeout`
        seconds (None: wait). A failed rank raises :class:`~mplaunch.WorkerError`, once
        every rank is gone. `grace_period` is accepted for torch's signature: the
        teardown after a failure already waits the launch's ``grace_period``."""
        if not self.handle.wait(timeout):
            return False
        try:
            self.handle.result()   # raises the first failure
        except MPLaunchError as err:
            failure = err
        else:
            return True
        raise from_here(failure)

    def __repr__(self) -> str:
        return f"<mplaunch.SpawnContext {self.handle!r}>"


def spawn(fn: Callable[..., Any], args: Any = (), nprocs: int = 1, join: bool = True,
          daemon: bool = False, start_method: Optional[str] = None,
          **options: Any) -> Optional[SpawnContext]:
    """A drop-in for ``torch.multiprocessing.spawn``: runs ``fn(i, *args)`` in ``nprocs``
    ranks, ``i`` being each rank's index (its ``LOCAL_RANK``; its ``RANK`` on one node).

    ``join=True`` waits and returns None, as torch's does (use :func:`mplaunch.launch`
    for the return values); ``join=False`` returns a :class:`SpawnContext` at once. A
    failing rank raises :class:`~mplaunch.WorkerError` with its traceback, the other
    ranks and their children are ended, and every rank's output reaches this process.

    ``start_method``: None picks mplaunch's default (a warm forkserver: fast, and the
    launching process's CUDA state is never inherited, which is why torch defaults to
    ``"spawn"``); ``"spawn"``, ``"forkserver"`` and ``"fork"`` are honoured. ``daemon``
    is accepted and has nothing to do: every rank is ended with this process anyway.
    Any keyword argument of :func:`mplaunch.launch` (``timeout``, ``env``, ...) may be
    added. The function sets up its own process group as it would under torch, with
    its own ``MASTER_ADDR``/``MASTER_PORT`` or with the ones mplaunch set.
    """
    check_call(fn, args, None)   # fn callable, args a tuple or list: as launch checks
    if isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1:
        raise ValueError(f"nprocs must be an int >= 1, got {nprocs!r}")
    handle = start(with_local_rank, (fn, *args), nprocs, start_method=start_method,
                   **options)
    context = SpawnContext(handle)
    if not join:
        return context
    try:
        context.join()
    except MPLaunchError as err:
        failure = err
    else:
        return None
    raise from_here(failure)
