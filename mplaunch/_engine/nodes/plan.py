"""The plan of a World across nodes, checked before anything starts: its configuration
(what every node's ranks share) and its nodes (how many, chosen by which scheduler,
reached at which address, placed how)."""
from __future__ import annotations

import dataclasses
import socket
from typing import Any, Callable, Dict, Optional

from ..config import DEFAULT_PREFIX, placement_args, validate
from . import schedulers

NODES_PREFIX = "[{host} rank{rank}]: "


@dataclasses.dataclass(frozen=True)
class NodesPlan:
    """A World across nodes: `nnodes` agents started by `scheduler`
    (schedulers.Scheduler), reaching this process at `address`; `gpus` and `cpus` are
    the placement each node applies to its own ranks."""
    nnodes: int
    address: str
    gpus: object = None
    cpus: object = None
    scheduler: Optional[schedulers.Scheduler] = None
    env: object = None            # env=: a callable is called for each node's ranks
    spare_nodes: int = 0          # nodes beyond nnodes that the scheduler must have


def plan_nodes(setup: Callable, nprocs, nnodes, backend, options: Dict[str, Any]):
    """The configuration of a World of `nprocs` ranks on each of `nnodes` nodes that
    its scheduler (options' ``scheduler``) places, and the plan of its nodes: checked,
    the scheduler's own checks included, before anything starts. `setup` is the ranks'
    first call (the process group's set-up)."""
    options = dict(options)
    scheduler = schedulers.choose(options.pop("scheduler", None))
    own = schedulers.split_options(scheduler, options)
    if not isinstance(nnodes, int) or isinstance(nnodes, bool) or nnodes < 1:
        raise ValueError(f"nnodes must be an int >= 1 (the nodes of this allocation the "
                         f"World spans), got {nnodes!r}")
    spare = options.pop("spare_nodes", 0)
    if not isinstance(spare, int) or isinstance(spare, bool) or spare < 0:
        raise ValueError(f"spare_nodes must be an int >= 0 (nodes the World does not use "
                         f"until one of its nodes is lost), got {spare!r}")
    for name in ("node_rank", "nnodes"):
        if options.get(name) is not None:
            raise TypeError(f"World(nnodes=...) places its nodes itself; leave {name} out")
    if nprocs is not None and (not isinstance(nprocs, int) or isinstance(nprocs, bool)
                               or nprocs < 1):
        # 'auto' too: it would count this machine's GPUs or CPUs, not each node's.
        raise ValueError(f"World(nprocs={nprocs!r}, nnodes={nnodes}): nprocs is the number "
                         f"of ranks on each node, an int >= 1 (World(2, nnodes={nnodes}) "
                         f"has {2 * nnodes} ranks), or None: one per entry of gpus=, else 1")
    if options.get("start_method") == "fork":
        raise ValueError("start_method='fork' cannot start ranks on other nodes; each "
                         "node's agent starts its ranks with 'forkserver' (the default) "
                         "or 'spawn'")
    if options.get("stdin_rank") not in (None, 0):
        raise ValueError("across nodes no rank reads this terminal; leave stdin_rank out")
    gpus, cpus = placement_args(options.get("gpus"), options.get("cpus"))
    if nprocs is None and isinstance(gpus, (list, tuple)):
        nprocs = len(gpus)
    try:
        # Room for the spares too: a lost node's replacement goes to one of them.
        scheduler.check(nnodes + spare, nprocs, gpus, own)
    except ValueError as exc:
        if not spare:
            raise
        raise ValueError(f"World(nnodes={nnodes}, spare_nodes={spare}) needs "
                         f"{nnodes + spare} nodes: {exc}") from None
    address = (options.pop("master_addr", None) or scheduler.address()
               or _this_host_address())
    if options.get("prefix", DEFAULT_PREFIX) == DEFAULT_PREFIX:
        options["prefix"] = NODES_PREFIX
    # Each node places its own ranks on its own GPUs and CPUs (its agent, at start): this
    # machine's, which may have none (a Ray head pod, a login node), are not asked.
    cfg = validate(setup, (backend,), nprocs,
                   dict(options, backend=backend, stdin_rank=None, master_addr=address,
                        gpus=None, cpus=None))
    cfg = dataclasses.replace(cfg, nnodes=nnodes, node_rank=0)
    return cfg, NodesPlan(nnodes, address, gpus, cpus, scheduler, options.get("env"),
                          spare)


def _this_host_address() -> str:
    """The address the nodes reach this process at: its host name's."""
    host = socket.gethostname()
    try:
        return socket.gethostbyname(host)
    except OSError as exc:
        raise ValueError(f"this host's name {host!r} does not resolve ({exc}); give "
                         "master_addr= an address of this machine that every node of "
                         "the allocation reaches") from None
