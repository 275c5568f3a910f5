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
    out: Dict[str, Any] = {}
    if args.gpus is not None:
        text = args.gpus.strip().lower()
        if text in ("none", "per-rank"):
            out["gpus"] = None if text == "none" else text
        else:
            try:
                out["gpus"] = [int(p) for p in text.split(",") if p.strip()]
            except ValueError:
                raise ValueError(f"{command}: --gpus takes per-rank, a list of positions "
                                 f"such as 2,0, or none; got {args.gpus!r}") from None
    if args.cpus is not None:
        text = args.cpus.strip().lower()
        if text not in ("none", "per-rank"):
            raise ValueError(f"{command}: --cpus takes per-rank or none; got {args.cpus!r}")
        out["cpus"] = None if text == "none" else text
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
