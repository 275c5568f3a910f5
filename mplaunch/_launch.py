"""launch(): validate, pickle once, host the store, run attempts, return or raise."""
from __future__ import annotations

import errno
import multiprocessing
import numbers
import os
import socket
import sys
import time
from typing import Any, Callable, Iterable, List, Mapping, Optional, Sequence

from . import _procs, _signals, _store
from ._env import rank_env, user_env_for
from ._monitor import Attempt
from ._output import write_error_file
from ._serialize import dumps_payload
from ._terminal import check_stdin_rank
from . import _sys
from .errors import LaunchTimeout, MainProcessError, WorkerError

START_METHODS = ("forkserver", "spawn", "fork")
DEFAULT_PREFIX = "[rank{rank}]: "


class _Config:
    """The validated arguments of one launch."""


def launch(
    func: Callable[..., Any],
    args: Sequence[Any] = (),
    nprocs: int = 1,
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
    _script: Optional[tuple] = None,
) -> List[Any]:
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
        nprocs: number of ranks on this node.
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
            :class:`~mplaunch.LaunchTimeout` is raised.
        max_restarts: on a failure, start the whole group again up to this many times
            (``RESTART_COUNT`` tells each attempt which it is).
        preload: modules the warm server imports once (default: torch, if this process
            has imported it).
        prefix: template for each relayed line; fields ``rank``, ``local_rank``,
            ``node_rank``, ``host``. ``None`` or ``""`` for none.
        relay: relay the ranks' stdout and stderr to this process's ``sys.stdout`` and
            ``sys.stderr``.
        ranks_filter: relay only these ranks' output (all still go to ``log_dir``).
        log_dir: write ``log_dir/attempt_<n>/<rank>/stdout.log`` and ``stderr.log``, and
            ``error.json`` for a failing rank.
        nnodes, node_rank: for more than one machine: every node calls ``launch``
            with the same ``nprocs``, ``master_addr`` and ``master_port``, and its own
            ``node_rank``; node 0 hosts the store. Global rank = ``node_rank * nprocs +
            local_rank``. Inside an ``srun`` step (one task per node) they are read
            from SLURM when not given. Each node returns its own ranks' results.
        stdin_rank: the rank that reads this process's stdin when that is a terminal,
            so ``breakpoint()`` and ``input()`` work there; ``None`` for none. The other
            ranks, and every rank when stdin is not a terminal (pytest, a notebook, a
            CI job), read ``/dev/null``.

    Raises:
        WorkerError: a rank failed; the first failure's details are its attributes and
            the worker's own exception is its ``__cause__``.
        LaunchTimeout: ``timeout`` expired (also a ``TimeoutError``).
        MainProcessError: this process received SIGINT, SIGTERM, SIGHUP or SIGQUIT.
        TypeError, ValueError: bad arguments, before any process starts.
    """
    cfg = _validate(func, args, nprocs, kwargs, start_method, env, master_addr,
                    master_port, grace_period, timeout, max_restarts, preload, prefix,
                    relay, ranks_filter, log_dir, nnodes, node_rank)
    cfg.script = _script
    cfg.stdin_rank = check_stdin_rank(stdin_rank)
    payload = b"" if _script else dumps_payload(func, args, kwargs or {})
    # Every rank's extra environment is computed (and checked) before anything starts.
    cfg.user_envs = [user_env_for(env, cfg.node_rank * cfg.nprocs + lr)
                     for lr in range(cfg.nprocs)]
    payload_fd = _sys.memfd_with(payload, "mplaunch-payload")
    previous: list = []
    from ._monitor import server_preload
    _procs.get_server(server_preload(cfg))  # a cold server imports torch meanwhile
    try:
        with _store.hosted(cfg) as hosted:
            for attempt in range(cfg.max_restarts + 1):
                try:
                    return _run_attempt(cfg, attempt, payload_fd, hosted)
                except WorkerError as err:
                    if attempt >= cfg.max_restarts:
                        if previous:
                            err.previous_attempts = previous + err.previous_attempts
                            err.args = (err._message(),)
                        raise
                    previous.append(err.failures)
    finally:
        os.close(payload_fd)


def _run_attempt(cfg, attempt: int, payload_fd: int, hosted) -> List[Any]:
    from ._nodes import NodeWatch
    specs = _rank_specs(cfg, attempt, hosted.port, hosted.address)
    from ._monitor import server_preload
    # A cold server is still importing torch: that time is not the ranks' to lose.
    _procs.get_server(server_preload(cfg)).wait_ready()
    cfg.started_at = time.monotonic()
    watch = (NodeWatch(hosted.store, attempt, cfg.node_rank, cfg.nnodes)
             if cfg.nnodes > 1 else None)
    att = Attempt(cfg, attempt, specs, payload_fd, watch)
    with _signals.forwarding(att.on_signal):
        ranks = att.run()
    if att.signal_received is not None:
        raise MainProcessError(att.signal_received, cfg.nprocs)
    if att.failures or att.timed_out or att.remote_node is not None:
        raise _error_for(cfg, att)
    return [r.result for r in ranks]


def _error_for(cfg, att: Attempt) -> WorkerError:
    if att.remote_node is not None:
        # Another node failed first: raise its error, as every node does.
        if att.remote_report is not None and att.remote_report[0]:
            failures, error_msg = att.remote_report
        else:
            failures = [att.node_failure(f"was torn down because node {att.remote_node} "
                                         "failed")]
            error_msg = None
        return _with_cause(WorkerError(failures, note=f"[on node {failures[0].node_rank}]"),
                           att.cause(error_msg))
    failures = att.final_failures()
    for f in failures:
        if cfg.log_dir is not None:
            path = os.path.join(cfg.log_dir, f"attempt_{att.attempt}", str(f.local_rank),
                                "error.json")
            write_error_file(path, f)
    user_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if user_file and failures:
        write_error_file(user_file, failures[0])
    if att.timed_out:
        from ._stacks import summarize_stacks
        err = LaunchTimeout(failures or [_timeout_record(cfg, att)], cfg.timeout,
                            att.stacks, summarize_stacks(att.stacks))
    else:
        err = WorkerError(failures, note=f"[on node {cfg.node_rank}]"
                          if cfg.nnodes > 1 else None)
    return _with_cause(err, att.cause(att.first_error(failures)))


def _with_cause(err: WorkerError, cause) -> WorkerError:
    if cause is not None:
        err.__cause__ = cause
    return err


def _timeout_record(cfg, att):
    from .errors import RankFailure
    stuck = sorted(att.stacks) or [att.specs[0]["global_rank"]]
    return RankFailure(stuck[0], None, None, None, exc_type=None,
                       message=f"was still running after {cfg.timeout:g} s",
                       attempt=att.attempt, timestamp=time.time())


def _rank_specs(cfg, attempt: int, port: int, store_addr: Optional[str]) -> List[dict]:
    base = dict(os.environ)
    host = socket.gethostname()
    world = cfg.nnodes * cfg.nprocs
    cwd = os.getcwd()
    specs = []
    for lr in range(cfg.nprocs):
        rank = cfg.node_rank * cfg.nprocs + lr
        env = rank_env(base=base, rank=rank, local_rank=lr, world_size=world,
                       local_world_size=cfg.nprocs, node_rank=cfg.node_rank,
                       nnodes=cfg.nnodes, master_addr=cfg.master_addr, master_port=port,
                       restart_count=attempt, max_restarts=cfg.max_restarts,
                       extra=cfg.user_envs[lr], store=store_addr,
                       store_prefix=f"mplaunch/attempt_{attempt}/ranks/")
        specs.append({
            "rank": rank, "global_rank": rank, "local_rank": lr,
            "node_rank": cfg.node_rank, "hostname": host,
            "env": env, "cwd": cwd, "sys_path": list(sys.path),
            "argv": cfg.script[2] if cfg.script else None,
            "script": cfg.script[0] if cfg.script else None,
            "script_kind": cfg.script[1] if cfg.script else None,
            "prefix_fields": {"rank": rank, "local_rank": lr, "node_rank": cfg.node_rank,
                              "host": host},
        })
    return specs


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _validate(func, args, nprocs, kwargs, start_method, env, master_addr, master_port,
              grace_period, timeout, max_restarts, preload, prefix, relay, ranks_filter,
              log_dir, nnodes, node_rank) -> _Config:
    if not callable(func):
        raise TypeError(f"func must be callable, got {type(func).__name__} {func!r}; pass "
                        "the function itself, not the result of calling it")
    if isinstance(args, (str, bytes)) or not isinstance(args, (tuple, list)):
        raise TypeError(f"args must be a tuple or list of arguments, got "
                        f"{type(args).__name__}; for a single argument write args=(x,)")
    if kwargs is not None and not isinstance(kwargs, Mapping):
        raise TypeError(f"kwargs must be a dict, got {type(kwargs).__name__}")
    if kwargs is not None and not all(isinstance(k, str) for k in kwargs):
        raise TypeError("kwargs keys must be strings (argument names)")
    if not _is_int(nprocs) or nprocs < 1:
        raise ValueError(f"nprocs must be a positive int, got {nprocs!r}")
    if nnodes is None or node_rank is None or master_addr is None:
        from ._slurm import layout
        slurm = layout(os.environ) if nnodes is None else None
        if slurm is not None and slurm["nnodes"] > 1:
            nnodes = slurm["nnodes"]
            node_rank = slurm["node_rank"] if node_rank is None else node_rank
            master_addr = slurm["master_addr"] if master_addr is None else master_addr
            master_port = slurm["master_port"] if master_port is None else master_port
        nnodes = 1 if nnodes is None else nnodes
        node_rank = 0 if node_rank is None else node_rank
        master_addr = "127.0.0.1" if master_addr is None else master_addr
    for name, value in (("nnodes", nnodes), ("max_restarts", max_restarts)):
        if not _is_int(value) or value < (1 if name == "nnodes" else 0):
            raise ValueError(f"{name} must be an int >= {1 if name == 'nnodes' else 0}, "
                             f"got {value!r}")
    if not _is_int(node_rank) or not 0 <= node_rank < nnodes:
        raise ValueError(f"node_rank must be an int in [0, nnodes={nnodes}), got "
                         f"{node_rank!r}")
    if start_method is None:
        start_method = ("forkserver" if "forkserver" in multiprocessing.get_all_start_methods()
                        else "spawn")
    if start_method not in START_METHODS:
        raise ValueError(f"unknown start_method {start_method!r}; use one of "
                         f"{', '.join(map(repr, START_METHODS))}")
    if start_method not in multiprocessing.get_all_start_methods():
        raise ValueError(f"start_method {start_method!r} is not available on this platform")
    if start_method == "fork" and _procs.cuda_initialized():
        raise RuntimeError("start_method='fork' is refused: CUDA is already initialised "
                           "in this process, and a forked child cannot use it. Use the "
                           "default start_method='forkserver' (as fast once warm, and "
                           "safe), or 'spawn'.")
    if env is not None and not (isinstance(env, Mapping) or callable(env)):
        raise TypeError(f"env must be a dict of str to str, or a callable rank -> dict, "
                        f"got {type(env).__name__}")
    if not isinstance(master_addr, str) or not master_addr:
        raise ValueError(f"master_addr must be a host name or address, got {master_addr!r}")
    if master_port is not None and (not _is_int(master_port)
                                    or not 1 <= master_port <= 65535):
        raise ValueError(f"master_port must be an int in 1-65535 (or None to let mplaunch "
                         f"pick and hold a free port), got {master_port!r}")
    if nnodes > 1 and master_port is None:
        raise ValueError("with nnodes > 1 every node must be given the same master_addr "
                         "and master_port (node 0 hosts the store there)")
    for name, value in (("grace_period", grace_period), ("timeout", timeout)):
        if value is None and name == "timeout":
            continue
        if (not isinstance(value, numbers.Real) or isinstance(value, bool)
                or value != value or value < 0 or (name == "timeout" and value == 0)):
            raise ValueError(f"{name} must be a number of seconds >= 0"
                             f"{' (> 0), or None for no limit' if name == 'timeout' else ''}"
                             f", got {value!r}")
    if preload is None:
        preload_t = _procs.default_preload()
    else:
        if isinstance(preload, str):
            preload = [preload]
        preload_t = tuple(preload)
        if not all(isinstance(m, str) and m for m in preload_t):
            raise TypeError("preload must be a list of module names (str)")
    if prefix is not None:
        if not isinstance(prefix, str):
            raise TypeError(f"prefix must be a str template or None, got {type(prefix).__name__}")
        try:
            prefix.format(rank=0, local_rank=0, node_rank=0, host="h")
        except (KeyError, IndexError, ValueError) as exc:
            raise ValueError(f"prefix {prefix!r} is not a valid template: {exc!r}; the "
                             "fields are {rank}, {local_rank}, {node_rank} and {host}") from None
    if ranks_filter is not None:
        if isinstance(ranks_filter, numbers.Integral):
            ranks_filter = [ranks_filter]
        ranks_filter = frozenset(ranks_filter)
        if not all(_is_int(r) for r in ranks_filter):
            raise TypeError("ranks_filter must be a collection of local rank numbers")
    if log_dir is not None:
        log_dir = os.fspath(log_dir)
    cfg = _Config()
    cfg.nprocs, cfg.start_method, cfg.env = nprocs, start_method, env
    cfg.master_addr, cfg.master_port = master_addr, master_port
    cfg.grace_period, cfg.timeout, cfg.max_restarts = float(grace_period), timeout, max_restarts
    cfg.preload, cfg.prefix, cfg.relay = preload_t, prefix or "", bool(relay)
    cfg.ranks_filter, cfg.log_dir = ranks_filter, log_dir
    cfg.nnodes, cfg.node_rank = nnodes, node_rank
    cfg.stdout, cfg.stderr = sys.stdout, sys.stderr
    return cfg
