"""launch(): validate the arguments, pickle the function once, and drive a Run (the
store, the attempts, the restarts: _engine.run) to its results or its error."""
from __future__ import annotations

import logging
import warnings
from typing import (Any, Callable, Iterable, List, Mapping, Optional, Sequence, TypeVar,
                    Union)

from ._engine.config import DEFAULT_PREFIX, OPTION_DEFAULTS, Script, validate
from ._engine.run import Run
from ._engine.stragglers import analyse, off_line, worth_saying
from ._wire.payload import dumps_payload
from .errors import MPLaunchError

_said_off: List[bool] = []   # the straggler report's off line was said in this process

T = TypeVar("T")


def launch(
    func: Callable[..., T],
    args: Sequence[Any] = (),
    nprocs: Union[int, str, None] = None,
    *,
    kwargs: Optional[Mapping[str, Any]] = None,
    start_method: Optional[str] = None,
    env: Any = None,
    master_addr: Optional[str] = None,
    master_port: Optional[int] = None,
    grace_period: float = 5.0,
    timeout: Optional[float] = None,
    max_restarts: int = 0,
    preload: Optional[Iterable[str]] = None,
    prefix: Optional[str] = DEFAULT_PREFIX,
    relay: bool = True,
    ranks_filter: Optional[Iterable[int]] = None,
    log_dir: Optional[str] = None,
    nnodes: Optional[int] = None,
    node_rank: Optional[int] = None,
    stdin_rank: Optional[int] = 0,
    backend: Optional[str] = None,
    gpus: Union[None, str, Sequence[int]] = None,
    cpus: Optional[str] = None,
) -> List[T]:
    """Run ``func(*args, **kwargs)`` in ``nprocs`` new processes and return their results.

    Returns a list with each rank's return value, index = rank. Each rank is its own
    process with ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``,
    ``MASTER_ADDR`` and ``MASTER_PORT`` set, so ``torch.distributed.init_process_group``
    works with its default ``env://`` method; ``MASTER_PORT`` names a store this process
    already hosts, so ports never race.

    Example::

        import mplaunch, torch, torch.distributed as dist

        def work(scale):
            dist.init_process_group("gloo")
            t = torch.tensor([float(dist.get_rank())]) * scale
            dist.all_reduce(t)
            dist.destroy_process_group()
            return t.item()

        print(mplaunch.launch(work, args=(2.0,), nprocs=4))   # [12.0, 12.0, 12.0, 12.0]

    Args:
        func: any callable; it is shipped to the ranks with cloudpickle, so lambdas,
            closures and functions defined in ``__main__`` or a notebook cell work.
        args, kwargs: what ``func`` is called with; pickled once, here, before any
            process starts.
        nprocs: number of ranks on this node, or ``"auto"``: one per visible GPU, else
            one per CPU this process may use. Default: one per entry of a ``gpus``
            list, else 1. At most 32 per CPU (at least 256), and no more than the
            process limit (``ulimit -u``) or half the kernel's ``pid_max``; set
            ``MPLAUNCH_MAX_NPROCS`` to allow more.
        start_method: ``"forkserver"`` (default: ranks are forked from a warm server
            process that has imported torch, never the caller's process), ``"spawn"``
            (each rank a fresh interpreter) or ``"fork"`` (a fork of the caller; refused
            once CUDA is initialised).
        env: extra variables for every rank: a dict of str, or a callable
            ``rank -> dict``. Applied before ``func`` is unpickled.
        master_addr, master_port: where the rendezvous store listens (default
            127.0.0.1, or under ``srun`` the first node of the step). With
            ``master_port=None`` on one node a free port is bound and held for the
            whole launch.
        grace_period: seconds between SIGTERM and SIGKILL when tearing ranks down.
        timeout: seconds; past it every rank's stack is collected and
            :class:`~mplaunch.LaunchTimeout` is raised. ``None`` or ``float("inf")``
            for no limit.
        max_restarts: on a failure, start the whole group again up to this many times
            (``RESTART_COUNT`` tells each attempt which it is).
        preload: modules the forkserver imports once, before it forks any rank, so
            that ranks start with them already imported (default: ``torch`` and
            ``torch.distributed``; ``()`` for none). A module that fails to import there
            is logged and skipped; one that starts threads is refused, since forking a
            threaded process is unsafe. Ignored by ``spawn`` and ``fork``.
        prefix: template for each relayed line; fields ``rank``, ``local_rank``,
            ``node_rank``, ``host``. ``None`` or ``""`` for none.
        relay: relay the ranks' stdout and stderr to this process's ``sys.stdout`` and
            ``sys.stderr``.
        ranks_filter: relay only these local ranks' output (all still go to
            ``log_dir``).
        log_dir: write ``log_dir/attempt_<n>/<rank>/stdout.log`` and ``stderr.log``, and
            ``error.json`` for a failing rank. Created if missing; checked (a
            directory this process may write in) before anything starts.
        nnodes, node_rank: for more than one machine: every node calls ``launch``
            with the same ``nprocs``, ``master_addr`` and ``master_port``, and its own
            ``node_rank``; node 0 hosts the store. Global rank = ``node_rank * nprocs +
            local_rank``. Inside an ``srun`` step (one task per node) they are read
            from SLURM when not given. Each node returns its own ranks' results.
        stdin_rank: the rank that reads this process's stdin when that is a terminal,
            so ``breakpoint()`` and ``input()`` work there; ``None`` for none. The other
            ranks, and every rank when stdin is not a terminal (pytest, a notebook, a
            CI job), read ``/dev/null``.
        backend: each rank calls ``torch.distributed.init_process_group(backend)``
            before ``func`` and ``destroy_process_group()`` after it (also after a
            failure, once the failure is reported). On CUDA (``"nccl"``,
            ``"cpu:gloo,cuda:nccl"``) each rank first selects its GPU and binds the group
            to it (``device_id``); more ranks than GPUs is refused.
        gpus: ``None``: the ranks see this process's GPUs (rank ``LOCAL_RANK`` uses
            device ``LOCAL_RANK``); ``"per-rank"``: each rank sees one GPU, the
            ``LOCAL_RANK``-th of this process's (its ``CUDA_VISIBLE_DEVICES`` entries
            as written); a list such as ``[2, 0]``: those positions of the visible
            list, one per rank. See :doc:`gpus`.
        cpus: ``"per-rank"``: this process's allowed CPUs split into disjoint slices,
            one per rank (within one NUMA node each, its GPU's with ``gpus``), applied
            before ``func`` runs; ``OMP_NUM_THREADS`` is the slice's size unless set.

    Raises:
        WorkerError: a rank failed; the first failure's details are its attributes and
            the worker's own exception is its ``__cause__``.
        LaunchTimeout: ``timeout`` expired (also a ``TimeoutError``).
        MainProcessError: this process received SIGINT, SIGTERM, SIGHUP or SIGQUIT.
        TypeError, ValueError: bad arguments, before any process starts.
    """
    # Every keyword option, by name: launch's signature is the one place they are spelt.
    options = {name: value for name, value in locals().items() if name in OPTION_DEFAULTS}
    try:
        return run(func, args, nprocs, options)
    except MPLaunchError as err:
        failure = err
    raise from_here(failure)


def from_here(failure: MPLaunchError) -> MPLaunchError:
    """`failure` with no traceback of its own, for the public call to raise: the frames
    of the engine that decided the outcome say nothing about it (the rank's own frames
    are in its ``__cause__``), as pytest leaves its own frames out of a report. The
    user's frames above the call, and the call's one line, are all Python then shows."""
    return failure.with_traceback(None)


def run(func: Callable[..., Any], args: Any, nprocs: Any, options: Mapping[str, Any],
        script: Optional[Script] = None) -> List[Any]:
    """launch() for any caller: the mplaunch command passes a Script to run instead of
    `func`."""
    cfg = validate(func, args, nprocs, options, script)
    payload = b"" if script is not None else dumps_payload(func, args,
                                                           options.get("kwargs") or {})
    run = Run(cfg, payload)
    try:
        return run.drive()
    finally:
        line = (worth_saying(analyse(run.collectives), set())
                if run.collectives and not run.flight_off else None)
        # (the late rank's stacks are in start(...).report(); the line stays one line)
        if line:   # stacklevel: run() <- launch() <- the user's line
            warnings.warn(f"mplaunch.launch: {line}; mplaunch.start(...).report() has "
                          f"every rank's figures", RuntimeWarning, stacklevel=3)
        elif run.flight_off and not _said_off:
            _said_off.append(True)   # once per process, logged (_world_notes.stragglers)
            logging.getLogger("mplaunch").warning("mplaunch.launch: %s",
                                                  off_line(run.flight_off))
