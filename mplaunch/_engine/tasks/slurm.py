"""What SLURM's environment says of a task's place, read when mplaunch runs as one srun
task per node (launch()'s layout), and rewritten for each rank started inside a step
(a World's on SLURM too): the one module that reads a SLURM task's variables."""
from __future__ import annotations

import re
from typing import Dict, Mapping, Optional


def first_host(nodelist: str) -> Optional[str]:
    """The first host of a SLURM hostlist: 'n[1-2]' -> 'n1', 'gpu[07,09],cpu1' ->
    'gpu07', 'a,b' -> 'a'."""
    if not nodelist:
        return None
    depth = 0
    head = nodelist
    for i, ch in enumerate(nodelist):
        depth += ch == "["
        depth -= ch == "]"
        if ch == "," and depth == 0:
            head = nodelist[:i]
            break
    m = re.match(r"^([^\[]*)\[([^\]]*)\](.*)$", head)
    if not m:
        return head
    prefix, ranges, suffix = m.groups()
    first = ranges.split(",")[0].split("-")[0]
    return f"{prefix}{first}{suffix}"


def layout(env: Mapping[str, str]) -> Optional[dict]:
    """nnodes, node_rank, master_addr and master_port for this srun task, or None when
    not inside an srun step. One task per node is expected: each task is one node's
    launcher, and SLURM_PROCID is its node rank."""
    if "SLURM_JOB_ID" not in env or "SLURM_STEP_ID" not in env:
        return None
    try:
        ntasks = int(env.get("SLURM_NTASKS") or env.get("SLURM_NPROCS") or "1")
        procid = int(env.get("SLURM_PROCID", "0"))
        job = int(env["SLURM_JOB_ID"])
    except ValueError:
        return None
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or ""
    port = env.get("MASTER_PORT")
    return {
        "nnodes": max(1, ntasks),
        "node_rank": procid,
        "master_addr": env.get("MASTER_ADDR") or first_host(nodelist) or "127.0.0.1",
        # Every task must agree on the port without talking: derive it from the job.
        "master_port": int(port) if port and port.isdigit() else 20000 + job % 20000,
    }


def task_vars(env: Dict[str, str], rank: int, local_rank: int, node_rank: int,
              world_size: int, local_world_size: int, nnodes: int) -> None:
    """Inside a SLURM step the launching process's task variables describe it, not a
    rank: a framework that reads them (Lightning's SLURM environment) would take every
    rank for task 0 of a step of one. Each rank is a task of its own: `env` (a rank's
    environment) is rewritten so."""
    if "SLURM_PROCID" not in env:
        return
    env.update({"SLURM_PROCID": str(rank), "SLURM_LOCALID": str(local_rank),
                "SLURM_NODEID": str(node_rank), "SLURM_NTASKS": str(world_size),
                "SLURM_NPROCS": str(world_size), "SLURM_NNODES": str(nnodes),
                "SLURM_NTASKS_PER_NODE": str(local_world_size),
                "SLURM_STEP_NUM_TASKS": str(world_size),
                "SLURM_STEP_NUM_NODES": str(nnodes),
                "SLURM_TASKS_PER_NODE": f"{local_world_size}(x{nnodes})",
                "SLURM_STEP_TASKS_PER_NODE": f"{local_world_size}(x{nnodes})",
                "SLURM_GTIDS": ",".join(str(node_rank * local_world_size + i)
                                        for i in range(local_world_size))})
