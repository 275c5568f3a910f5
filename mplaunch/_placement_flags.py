"""``gpus=`` and ``cpus=`` as flags (``--gpus per-rank``, ``--cpus per-rank``) of the
command and the magics, and what ``%ranks`` says of each rank's place. Nothing here
imports torch or IPython: ``import mplaunch`` imports the magic."""
from __future__ import annotations

from typing import Any, Dict, Mapping, Optional, Sequence

from ._engine.devices import PER_RANK, Placement, format_cpus, uses_cuda


def parse_gpus_flag(text: str):
    """A command line's --gpus: "per-rank", "2,0" (positions) or "none", as gpus=."""
    text = text.strip().lower()
    if text in ("none", PER_RANK):
        return None if text == "none" else text
    try:
        return [int(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise ValueError(f"--gpus takes per-rank, a list of positions in the visible list "
                         f"such as 2,0, or none; got {text!r}") from None


def parse_cpus_flag(text: str):
    """A command line's --cpus: "per-rank" or "none", as cpus=."""
    text = text.strip().lower()
    if text not in ("none", PER_RANK):
        raise ValueError(f"--cpus takes per-rank or none; got {text!r}")
    return None if text == "none" else text


def argparse_type(parse):
    """A parse_*_flag above as an argparse ``type=``."""
    def parse_flag(text: str):
        import argparse
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return parse_flag


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

    from ._engine.env import allowed_cpus
    cfg, pids = world.cfg, world.pids
    nodes = world.nodes
    if nodes:
        # Across nodes: each node placed its own ranks, from what it has.
        lines = []
        for node in nodes:
            placement = Placement(node["gpus"], node["cpus"])
            for lr in range(cfg.nprocs):
                rank = node["node"] * cfg.nprocs + lr
                where = describe_rank(lr, cfg.backend, placement, node["environ"],
                                      node["allowed"], "its node")
                lines.append(f"  rank {rank} on node {node['node']} ({node['name']}, pid "
                             f"{pids.get(rank)}): {where}")
        return "\n".join(lines)
    placement = Placement(cfg.gpus, cfg.cpus)
    allowed = allowed_cpus()
    return "\n".join(f"  rank {lr} (pid {pids.get(lr)}): "
                     f"{describe_rank(lr, cfg.backend, placement, os.environ, allowed)}"
                     for lr in range(cfg.nprocs))


def describe_rank(local_rank: int, backend: Optional[str], placement: Placement,
                  environ: Mapping[str, str], allowed: Sequence[int],
                  whose: str = "the launching process") -> str:
    """"GPU 2 (its CUDA_VISIBLE_DEVICES), CPUs 0-3": where one rank runs, for %ranks."""
    if placement.gpus is not None:
        device = f"GPU {placement.gpus[local_rank]} (its CUDA_VISIBLE_DEVICES)"
    elif uses_cuda(backend):
        visible = environ.get("CUDA_VISIBLE_DEVICES")
        device = f"cuda:{local_rank}" + (f" of CUDA_VISIBLE_DEVICES={visible}"
                                         if visible is not None else "")
    else:
        device = f"{whose}'s GPUs, none chosen"
    if placement.cpus is not None:
        cpus = f"CPUs {format_cpus(placement.cpus[local_rank])}"
    else:
        cpus = f"CPUs {format_cpus(allowed)} (shared)"
    return f"{device}, {cpus}"
