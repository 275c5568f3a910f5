"""SLURM as a World's scheduler: the nodes of the allocation this process runs in, one
srun step with one agent per node. Its variables are read here and nowhere else of the
World across nodes (the env table below): the agent is told which of them name its node.
"""
from __future__ import annotations

import logging
import os
import shlex
import shutil
import subprocess
from typing import Any, Dict, List, Mapping, Optional, Sequence

from .agents import ProcessStep
from .schedulers import AgentLaunch
from ..._wire import tunnel

log = logging.getLogger("mplaunch")

# What SLURM sets in each task of a step, that the agent reads for its node's index
# and name (one task per node), and what the allocation is.
ENV = {"index": "SLURM_NODEID", "name": "SLURMD_NODENAME", "job": "SLURM_JOB_ID",
       "step": "SLURM_STEP_ID", "job_name": "SLURM_JOB_NAME"}


# -- starting the step -------------------------------------------------------------------

def slurm_nodes_available(environ=os.environ) -> int:
    """How many nodes this SLURM allocation has (0 outside one)."""
    for name in ("SLURM_JOB_NUM_NODES", "SLURM_NNODES"):
        value = environ.get(name, "")
        if value.isdigit():
            return int(value)
    return 0


def check_allocation(nnodes: int, environ=os.environ) -> None:
    """Before anything starts: inside an allocation with enough nodes, srun found."""
    if "SLURM_JOB_ID" not in environ:
        raise RuntimeError(
            f"World(nnodes={nnodes}) starts one agent per node through SLURM, and this "
            "process is not inside a SLURM allocation (SLURM_JOB_ID is not set): run it "
            "in an salloc shell, a batch script, or a Jupyter server started inside the "
            "allocation")
    have = slurm_nodes_available(environ)
    if have and nnodes > have:
        raise ValueError(f"World(nnodes={nnodes}): this allocation (job "
                         f"{environ['SLURM_JOB_ID']}) has {have} node(s); ask for fewer, "
                         f"or allocate more (salloc -N {nnodes})")
    if shutil.which("srun") is None:
        raise RuntimeError(f"World(nnodes={nnodes}) needs SLURM's srun on PATH")


def srun_argv(nnodes: int, agent_argv: Sequence[str], environ=os.environ) -> List[str]:
    """The World's one step: one agent per node, sharing the allocation with the steps
    already running (``--overlap``: the kernel's own step may hold every CPU), not
    killed when one task fails nor when one node does (``--no-kill``: in a job that
    outlives a failed node, the other nodes' agents and ranks go on; the launching
    process decides), unbuffered."""
    argv = ["srun", "--overlap", f"--nodes={nnodes}", f"--ntasks={nnodes}",
            "--ntasks-per-node=1", "--kill-on-bad-exit=0", "--no-kill", "--wait=0", "-u",
            "--input=none", "--job-name=mplaunch-world"]
    cpus = job_cpus_per_node(environ)
    if cpus is not None:
        # The ranks may use the node's CPUs, not the one CPU a task gets by default.
        argv.append(f"--cpus-per-task={cpus}")
    return argv + list(agent_argv)


def job_cpus_per_node(environ=os.environ) -> Optional[int]:
    """The fewest CPUs the job has on any of its nodes: every task of the step can get
    that many. SLURM_JOB_CPUS_PER_NODE reads like "4(x2),2" (4 on two nodes, 2 on the
    third); SLURM_CPUS_ON_NODE (this node's) where it is missing."""
    counts = []
    for part in environ.get("SLURM_JOB_CPUS_PER_NODE", "").split(","):
        head = part.strip().split("(")[0]
        if head.isdigit():
            counts.append(int(head))
    if counts:
        return min(counts)
    here = environ.get("SLURM_CPUS_ON_NODE", "")
    return int(here) if here.isdigit() else None


def slurm_step_id(environs) -> Optional[str]:
    """"JOB.STEP" of the agents' SLURM step, from their environments (None outside one)."""
    for env in environs:
        if env.get(ENV["job"]) and env.get(ENV["step"]):
            return f"{env[ENV['job']]}.{env[ENV['step']]}"
    return None


def cancel_step(nodes: Sequence):
    """End a step still there after its connections ended (an agent frozen, or cut
    off): ``scancel JOB.STEP`` (slurmstepd kills every process of the step, on every
    node, stopped ones included). Its JOB.STEP; False where it cannot."""
    step_id = slurm_step_id(node.environ for node in nodes)
    if step_id is None or shutil.which("scancel") is None:
        return False
    for argv in (["scancel", "--signal=KILL", step_id], ["scancel", step_id]):
        subprocess.run(argv, timeout=10, stdin=subprocess.DEVNULL, capture_output=True)
    return step_id


class Slurm:
    """The nodes of this SLURM allocation, started as one srun step."""
    name = "slurm"
    about = "the nodes of this SLURM allocation"
    options = ()

    def check(self, nnodes: int, nprocs: Optional[int], gpus: Any,
              options: Mapping[str, Any]) -> None:
        check_allocation(nnodes)

    def address(self) -> Optional[str]:
        return None

    def start(self, launch: AgentLaunch) -> ProcessStep:
        """One srun step, in a session of its own (a Ctrl-C at the terminal is the
        launching process's to handle; a second one would make srun cancel the step);
        each agent is told which of SLURM's variables name its node."""
        env = dict(launch.env)
        env[tunnel.NODE_FROM_ENV] = f"{ENV['index']}:{ENV['name']}"
        return self._step(srun_argv(launch.nnodes, launch.argv, env), env, launch)

    def _replace(self, index: int, launch: AgentLaunch, nodes: Sequence) -> ProcessStep:
        """Lost node `index`'s agent again: one task on a spare node of the allocation
        (one the World does not use), else on the lost node itself if SLURM still has
        it; told its index (NODE_ENV), reading its name from SLURM."""
        env = dict(launch.env)
        env[tunnel.NODE_ENV] = str(index)
        env[tunnel.NODE_FROM_ENV] = f":{ENV['name']}"
        used = {n.name for n in nodes}
        spare = slurm_nodes_available(os.environ) > len(used)
        leave_out = sorted(used if spare else used - {n.name for n in nodes
                                                      if n.slot == index})
        argv = srun_argv(1, launch.argv, env)
        if leave_out:
            argv.insert(1, f"--exclude={','.join(leave_out)}")
        return self._step(argv, env, launch)

    def _step(self, argv: List[str], env: Dict[str, str], launch: AgentLaunch):
        return ProcessStep(subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL,
                                            stdout=launch.output, stderr=launch.output,
                                            start_new_session=True),
                           shlex.join(argv), cancel_step, step_replace=self._replace)

    def node_environ(self, agent_environ: Mapping[str, str]) -> Dict[str, str]:
        """The agent's, with the job's name as this process sees it (the step's
        ``--job-name`` is mplaunch's, not the job's; Lightning reads it to tell an
        interactive allocation)."""
        base = dict(agent_environ)
        if ENV["job_name"] in os.environ:
            base[ENV["job_name"]] = os.environ[ENV["job_name"]]
        return base


SCHEDULER = Slurm
