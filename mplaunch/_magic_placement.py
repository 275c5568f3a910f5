"""The magics' --gpus and --cpus, and what ``%ranks`` says of each rank's place: a
World's ``gpus=`` and ``cpus=`` as notebook flags. Nothing here imports torch or
IPython: ``import mplaunch`` imports the magic."""
from __future__ import annotations

from typing import Any, Dict


def placement_flags(parser, more: str = "") -> None:
    parser.add_argument("--gpus", default=None, metavar="per-rank|I,J,...|none",
                        help="each rank's GPU: per-rank (one each), positions in the "
                             "kernel's visible list, or none (they share the kernel's)"
                             + more)
    parser.add_argument("--cpus", default=None, metavar="per-rank|none",
                        help="per-rank: disjoint CPU slices, one per rank" + more)


def placement_settings(args, command: str) -> Dict[str, Any]:
    """--gpus and --cpus as World's gpus= and cpus= (only those given)."""
    from ._devices import parse_cpus_flag, parse_gpus_flag
    out: Dict[str, Any] = {}
    try:
        if args.gpus is not None:
            out["gpus"] = parse_gpus_flag(args.gpus)
        if args.cpus is not None:
            out["cpus"] = parse_cpus_flag(args.cpus)
    except ValueError as exc:
        raise ValueError(f"{command}: {exc}") from None
    return out


def placement_lines(world) -> str:
    """Each rank's device and CPUs, as its World placed it."""
    import os

    from ._devices import Placement, describe_rank
    from ._env import allowed_cpus
    cfg, pids = world.cfg, world.pids
    placement = Placement(cfg.gpus, cfg.cpus)
    allowed = allowed_cpus()
    return "\n".join(f"  rank {lr} (pid {pids.get(lr)}): "
                     f"{describe_rank(lr, cfg.backend, placement, os.environ, allowed)}"
                     for lr in range(cfg.nprocs))
