"""What travels from the launching process to a rank before it runs anything: the
RankSpec (its environment, cwd, import path and role) and, for the mplaunch command, the
Script it runs instead of a function. Read by the server and the rank, so it lives on the
wire, apart from the validation that builds it (_engine.config).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Dict, Optional, Sequence, Tuple


@dataclass(frozen=True)
class Script:
    """A script (``kind="path"``) or module (``kind="module"``) each rank runs as
    ``__main__`` instead of a function: what the ``mplaunch`` command launches."""
    target: str
    kind: str
    argv: Tuple[str, ...]


@dataclass(frozen=True)
class RankSpec:
    """Everything one rank's process needs to become that rank; sent to the server and
    read by the worker."""
    rank: int
    local_rank: int
    node_rank: int
    hostname: str
    env: Dict[str, str]
    cwd: str
    sys_path: Tuple[str, ...]
    script: Optional[Script] = None
    fresh_interpreter: bool = False    # start_method="spawn": exec a new Python
    serve: bool = False                # stays up for more calls (a World's rank)
    backend: Optional[str] = None      # init_process_group before the first call
    cpus: Optional[Tuple[int, ...]] = None   # the rank's CPU affinity
    # {"stdout": bool, "stderr": bool}: whether each relayed stream ends on a terminal
    terminal: Optional[Dict[str, bool]] = None

    def prefix(self, template: str) -> str:
        """The relay prefix of this rank's lines, from the launch's template."""
        if not template:
            return ""
        return template.format(rank=self.rank, local_rank=self.local_rank,
                               node_rank=self.node_rank, host=self.hostname)


def uses_cuda(backend: Optional[str]) -> bool:
    """Whether a torch.distributed backend string (RankSpec.backend) puts a process group
    on CUDA: "nccl", or a device map such as "cpu:gloo,cuda:nccl". The launching process
    places GPUs by it and the rank selects its device by it: one reading for both."""
    if not backend:
        return False
    parts = [p.strip().lower() for p in backend.split(",")]
    return any(p == "nccl" or p.startswith("cuda:") for p in parts)


def for_this_node(spec: RankSpec, node_cwd: Optional[str], here_cwd: str,
                  here_path: Sequence[str]) -> RankSpec:
    """A rank's spec as this node can honour it. The launching process's working
    directory and import path name its own machine's files, which a node that shares no
    filesystem with it (a Ray cluster's, often) does not have: a rank starts in the
    directory the node's starter named (`node_cwd`: the Ray job's runtime_env
    working_dir, where Ray's own tasks run), else the launcher's where it exists here,
    else the agent's; and the agent's import path entries the launcher's lacks (Ray's
    working_dir and py_modules, this node's PYTHONPATH and site-packages) follow the
    launcher's, so code Ray ships to the node imports in its ranks."""
    cwd = node_cwd or (spec.cwd if os.path.isdir(spec.cwd) else here_cwd)
    extra = tuple(dict.fromkeys(p for p in here_path if p and p not in spec.sys_path))
    if cwd == spec.cwd and not extra:
        return spec
    return replace(spec, cwd=cwd, sys_path=tuple(spec.sys_path) + extra)
