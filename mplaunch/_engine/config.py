"""What a launch was asked to do: its arguments checked into a frozen LaunchConfig, and
each rank's RankSpec derived from it.

Every check happens here, in the launching process, before any process starts, and each
refusal says what to write instead. Nothing after validation reads the raw arguments.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import multiprocessing
import numbers
import os
import socket
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, FrozenSet, List, Mapping, Optional, Tuple

from . import devices
from .checks import (check_backend, check_nprocs_limit, cuda_initialized, log_dir,
                     working_directory)
from .env import allowed_cpus, cpu_count, rank_env, user_env_for
from .tasks.slurm import layout as slurm_layout
from .terminal import check_stdin_rank
from .._wire.spec import RankSpec, Script

START_METHODS = ("forkserver", "spawn", "fork")
DEFAULT_PREFIX = "[rank{rank}]: "

# launch()'s keyword options and their defaults: one table, so launch, start and World
# cannot drift apart.
# What a warm server imports before forking ranks (preload=None): torch, whose import in
# every rank is what makes spawn slow, and which mplaunch's ranks nearly always use.
DEFAULT_PRELOAD: Tuple[str, ...] = ("torch", "torch.distributed")

OPTION_DEFAULTS: Dict[str, Any] = {
    "kwargs": None,
    "start_method": None,
    "env": None,
    "master_addr": None,
    "master_port": None,
    "grace_period": 5.0,
    "timeout": None,
    "max_restarts": 0,
    "preload": None,
    "prefix": DEFAULT_PREFIX,
    "relay": True,
    "ranks_filter": None,
    "log_dir": None,
    "nnodes": None,
    "node_rank": None,
    "stdin_rank": 0,
    "backend": None,
    "gpus": None,
    "cpus": None,
}


@dataclass(frozen=True)
class LaunchConfig:
    """The validated arguments of one launch."""
    nprocs: int
    nnodes: int
    node_rank: int
    start_method: str
    master_addr: str
    master_port: Optional[int]
    grace_period: float
    timeout: Optional[float]
    max_restarts: int
    preload: Tuple[str, ...]
    prefix: str
    relay: bool
    ranks_filter: Optional[FrozenSet[int]]
    log_dir: Optional[str]
    user_envs: Tuple[Dict[str, str], ...]   # the user's extra variables, by local rank
    stdin_rank: Optional[int] = 0           # the rank that may read this terminal
    script: Optional[Script] = None
    backend: Optional[str] = None           # the process group each rank sets up
    gpus: Optional[Tuple[str, ...]] = None  # each local rank's CUDA_VISIBLE_DEVICES
    cpus: Optional[Tuple[Tuple[int, ...], ...]] = None   # each local rank's CPUs
    # Where relayed output goes: the streams current when launch() was called (in a
    # notebook, the calling cell's).
    stdout: Any = field(default=None, repr=False, compare=False)
    stderr: Any = field(default=None, repr=False, compare=False)

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nprocs

    @property
    def server_preload(self) -> Tuple[str, ...]:
        """Which warm server this launch uses: spawn and fork need no preloads (their
        server only execs, or only watches)."""
        return self.preload if self.start_method == "forkserver" else ()

    def global_rank(self, local_rank: int) -> int:
        return self.node_rank * self.nprocs + local_rank


def rank_specs(cfg: LaunchConfig, attempt: int, port: int,
               store_address: Optional[str], serve: bool = False,
               base: Optional[Mapping[str, str]] = None,
               host: Optional[str] = None) -> List[RankSpec]:
    """The specs of this node's ranks for one attempt (each attempt has its own keys in
    the store and its own RESTART_COUNT). `base` and `host`: the node's environment and
    name, where the node is another (a World across nodes: its agent's)."""
    base = dict(os.environ if base is None else base)
    host = socket.gethostname() if host is None else host
    cwd = working_directory()
    path = tuple(sys.path)
    specs = []
    for lr in range(cfg.nprocs):
        rank = cfg.global_rank(lr)
        cpus = cfg.cpus[lr] if cfg.cpus is not None else None
        env = rank_env(base=base, rank=rank, local_rank=lr, world_size=cfg.world_size,
                       local_world_size=cfg.nprocs, node_rank=cfg.node_rank,
                       nnodes=cfg.nnodes, master_addr=cfg.master_addr, master_port=port,
                       restart_count=attempt, max_restarts=cfg.max_restarts,
                       extra=cfg.user_envs[lr], store=store_address,
                       store_prefix=f"mplaunch/attempt_{attempt}/ranks/",
                       gpu=cfg.gpus[lr] if cfg.gpus is not None else None,
                       threads=len(cpus) if cpus is not None else None)
        specs.append(RankSpec(rank=rank, local_rank=lr, node_rank=cfg.node_rank,
                              hostname=host, env=env, cwd=cwd, sys_path=path,
                              script=cfg.script,
                              fresh_interpreter=cfg.start_method == "spawn",
                              serve=serve, backend=cfg.backend, cpus=cpus))
    return specs


# -- validation ------------------------------------------------------------------------

def node_user_envs(env, node_rank: int, nprocs: int) -> Tuple[Dict[str, str], ...]:
    """The user's extra variables (env=) for each of node `node_rank`'s ranks, by local
    rank, checked."""
    return tuple(user_env_for(env, node_rank * nprocs + lr) for lr in range(nprocs))


def placement_args(gpus, cpus):
    """``gpus=`` and ``cpus=`` checked, in the form devices.place takes (for a node
    that places its own ranks)."""
    return _gpus(gpus), _cpus(cpus)


def validate(func: Callable[..., Any], args: Any, nprocs: Any,
             options: Mapping[str, Any], script: Optional[Script] = None) -> LaunchConfig:
    """Check launch()'s arguments (``options`` are its keyword options) and build the
    configuration. Raises TypeError or ValueError, before anything has started."""
    unknown = sorted(set(options) - set(OPTION_DEFAULTS))
    if unknown:
        raise TypeError(_unknown_option_message(unknown[0]))
    working_directory()   # before anything imports torch: it cannot, from a deleted one
    o = dict(OPTION_DEFAULTS, **options)
    check_call(func, args, o["kwargs"])
    backend, gpus, cpus = _backend(o["backend"]), _gpus(o["gpus"]), _cpus(o["cpus"])
    nprocs = resolve_nprocs(nprocs, gpus)
    nnodes, node_rank, master_addr, master_port = node_layout(
        o["nnodes"], o["node_rank"], o["master_addr"], o["master_port"])
    max_restarts = o["max_restarts"]
    if not _is_int(max_restarts) or max_restarts < 0:
        raise ValueError(f"max_restarts must be an int >= 0, got {max_restarts!r}")
    env = o["env"]
    if env is not None and not (isinstance(env, Mapping) or callable(env)):
        raise TypeError(f"env must be a dict of str to str, or a callable rank -> dict, "
                        f"got {type(env).__name__}")
    # Every rank's extra environment is computed (and checked) before anything starts.
    user_envs = node_user_envs(env, node_rank, nprocs)
    if gpus is not None and any("CUDA_VISIBLE_DEVICES" in e for e in user_envs):
        raise ValueError("gpus= and env= both set CUDA_VISIBLE_DEVICES; give the ranks "
                         "their GPUs with one of them")
    placement = devices.place(nprocs, gpus, cpus, backend, os.environ, allowed_cpus())
    stdin_rank = check_stdin_rank(o["stdin_rank"])
    if stdin_rank is not None and stdin_rank >= nnodes * nprocs:
        raise ValueError(f"stdin_rank={stdin_rank} is not a rank of this launch (ranks "
                         f"0-{nnodes * nprocs - 1}); name one of them, or None for none")
    return LaunchConfig(
        nprocs=nprocs, nnodes=nnodes, node_rank=node_rank,
        start_method=_start_method(o["start_method"]),
        master_addr=master_addr, master_port=master_port,
        grace_period=float(seconds("grace_period", o["grace_period"])),
        timeout=seconds("timeout", o["timeout"], optional=True),
        max_restarts=max_restarts,
        preload=_preload(o["preload"]),
        prefix=_prefix(o["prefix"]),
        relay=bool(o["relay"]),
        ranks_filter=_ranks_filter(o["ranks_filter"], nprocs),
        log_dir=log_dir(o["log_dir"]),
        user_envs=user_envs, stdin_rank=stdin_rank, script=script,
        backend=backend, gpus=placement.gpus, cpus=placement.cpus,
        stdout=sys.stdout, stderr=sys.stderr)


def with_streams(cfg: LaunchConfig) -> LaunchConfig:
    """The same configuration relaying to the streams current now (a World's later run
    in another notebook cell)."""
    if cfg.stdout is sys.stdout and cfg.stderr is sys.stderr:
        return cfg
    return dataclasses.replace(cfg, stdout=sys.stdout, stderr=sys.stderr)


def resolve_nprocs(nprocs: Any, gpus: Any = None) -> int:
    """An int >= 1, or "auto": one rank per visible GPU, else one per usable CPU; None:
    one per GPU of a ``gpus=`` list, else 1."""
    if isinstance(gpus, tuple) and nprocs in (None, "auto"):
        return len(gpus)
    if nprocs is None:
        return 1
    if nprocs == "auto":
        return auto_nprocs()
    if not _is_int(nprocs) or nprocs < 1:
        raise ValueError(f"nprocs must be a positive int, 'auto', or None (1, or one per "
                         f"entry of a gpus= list), got {nprocs!r}")
    check_nprocs_limit(nprocs)
    return int(nprocs)


def auto_nprocs() -> int:
    return gpu_count() or cpu_count()


def gpu_count() -> int:
    """CUDA GPUs visible to this process, counted without initialising CUDA here (NVML
    or the driver's /proc, and CUDA_VISIBLE_DEVICES), so that fork stays possible."""
    return len(devices.visible_gpus(os.environ, devices.driver_gpus()))


# One helper per option below: each names its argument and says what to write instead.

def _backend(backend) -> Optional[str]:
    if backend is not None and (not isinstance(backend, str) or not backend.strip()):
        raise TypeError(f"backend must be a str such as 'gloo', 'nccl' or "
                        f"'cpu:gloo,cuda:nccl', or None, got {backend!r}")
    check_backend(backend)   # a name torch.distributed knows
    return backend


def _gpus(gpus):
    """None, "per-rank", or a tuple of positions in the visible list."""
    if gpus is None or gpus == devices.PER_RANK:
        return gpus
    if isinstance(gpus, (list, tuple)) and gpus and all(_is_int(i) and i >= 0
                                                        for i in gpus):
        if len(set(gpus)) != len(gpus):
            raise ValueError(f"gpus={list(gpus)} names a GPU twice; each rank gets its own")
        return tuple(int(i) for i in gpus)
    raise ValueError(f"gpus must be None (the ranks see this process's GPUs), "
                     f"'per-rank' (one each), or a non-empty list of positions in the "
                     f"visible list such as [2, 0], got {gpus!r}")


def _cpus(cpus):
    if cpus is None or cpus == devices.PER_RANK:
        return cpus
    raise ValueError(f"cpus must be None (the ranks inherit this process's CPUs) or "
                     f"'per-rank' (disjoint slices, one per rank), got {cpus!r}")


def _unknown_option_message(name: str) -> str:
    close = difflib.get_close_matches(name, OPTION_DEFAULTS, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else (
        f"; the options are {', '.join(OPTION_DEFAULTS)}")
    return f"unexpected keyword argument {name!r}{hint}"


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def check_call(func, args, kwargs) -> None:
    """func is callable, args a tuple or list, kwargs a dict of str keys or None."""
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


def node_layout(nnodes, node_rank, master_addr, master_port):
    """(nnodes, node_rank, master_addr, master_port): as given, else from SLURM inside
    an srun step, else one node on loopback."""
    slurm = slurm_layout(os.environ) if nnodes is None else None
    if slurm is not None and slurm["nnodes"] > 1:
        nnodes = slurm["nnodes"]
        node_rank = slurm["node_rank"] if node_rank is None else node_rank
        master_addr = slurm["master_addr"] if master_addr is None else master_addr
        master_port = slurm["master_port"] if master_port is None else master_port
    nnodes = 1 if nnodes is None else nnodes
    node_rank = 0 if node_rank is None else node_rank
    master_addr = "127.0.0.1" if master_addr is None else master_addr
    if not _is_int(nnodes) or nnodes < 1:
        raise ValueError(f"nnodes must be an int >= 1, got {nnodes!r}")
    if not _is_int(node_rank) or not 0 <= node_rank < nnodes:
        raise ValueError(f"node_rank must be an int in [0, nnodes={nnodes}), got "
                         f"{node_rank!r}")
    if not isinstance(master_addr, str) or not master_addr:
        raise ValueError(f"master_addr must be a host name or address, got {master_addr!r}")
    if master_port is not None and (not _is_int(master_port)
                                    or not 1 <= master_port <= 65535):
        raise ValueError(f"master_port must be an int in 1-65535 (or None to let mplaunch "
                         f"pick and hold a free port), got {master_port!r}")
    if nnodes > 1 and master_port is None:
        raise ValueError("with nnodes > 1 every node must be given the same master_addr "
                         "and master_port (node 0 hosts the store there)")
    return nnodes, node_rank, master_addr, master_port


def _start_method(start_method) -> str:
    available = multiprocessing.get_all_start_methods()
    if start_method is None:
        return "forkserver" if "forkserver" in available else "spawn"
    if start_method not in START_METHODS:
        raise ValueError(f"unknown start_method {start_method!r}; use one of "
                         f"{', '.join(map(repr, START_METHODS))}")
    if start_method not in available:
        raise ValueError(f"start_method {start_method!r} is not available on this platform")
    if start_method == "fork" and cuda_initialized():
        raise RuntimeError("start_method='fork' is refused: CUDA is already initialised "
                           "in this process, and a forked child cannot use it. Use the "
                           "default start_method='forkserver' (as fast once warm, and "
                           "safe), or 'spawn'.")
    return start_method


def seconds(name: str, value, optional: bool = False):
    """A number of seconds; for an optional limit, None or inf mean no limit."""
    if value is None and optional:
        return None
    if (not isinstance(value, numbers.Real) or isinstance(value, bool)
            or value != value or value < 0 or (optional and value == 0)
            or (not optional and math.isinf(value))):
        allowed = ("a number of seconds > 0, or None for no limit (inf too)" if optional
                   else "a number of seconds >= 0, and finite")
        raise ValueError(f"{name} must be {allowed}, got {value!r}")
    if optional and math.isinf(value):
        return None
    return value


def _preload(preload) -> Tuple[str, ...]:
    if preload is None:
        return DEFAULT_PRELOAD
    if isinstance(preload, str):
        preload = [preload]
    names = tuple(preload)
    if not all(isinstance(m, str) and m for m in names):
        raise TypeError("preload must be a list of module names (str)")
    return names


def _prefix(prefix) -> str:
    if prefix is None:
        return ""
    if not isinstance(prefix, str):
        raise TypeError(f"prefix must be a str template or None, got {type(prefix).__name__}")
    try:
        prefix.format(rank=0, local_rank=0, node_rank=0, host="h")
    except (KeyError, IndexError, ValueError) as exc:
        raise ValueError(f"prefix {prefix!r} is not a valid template: {exc!r}; the "
                         "fields are {rank}, {local_rank}, {node_rank} and {host}") from None
    return prefix


def _ranks_filter(ranks_filter, nprocs: int) -> Optional[FrozenSet[int]]:
    if ranks_filter is None:
        return None
    if isinstance(ranks_filter, numbers.Integral):
        ranks_filter = [ranks_filter]
    ranks = frozenset(ranks_filter)
    if not all(_is_int(r) for r in ranks):
        raise TypeError("ranks_filter must be a collection of local rank numbers")
    outside = sorted(r for r in ranks if not 0 <= r < nprocs)
    if outside:
        raise ValueError(f"ranks_filter names local rank {outside[0]}, but this node "
                         f"has ranks 0-{nprocs - 1} (nprocs={nprocs}); name ranks in "
                         f"that range")
    return ranks
