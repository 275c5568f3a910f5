"""Starting and ending a World's one step of node agents (_agent.agent): where SLURM
is asked for it, how the launching process listens for the agents."""
from __future__ import annotations

import logging
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
from typing import Dict, List, Optional, Sequence

from .. import servers, store

log = logging.getLogger("mplaunch")

AGENT_MODULE = "mplaunch._agent.agent"


class NodesError(RuntimeError):
    """The World's nodes could not be started or reached."""


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
    killed when one task fails (the launching process decides), unbuffered."""
    argv = ["srun", "--overlap", f"--nodes={nnodes}", f"--ntasks={nnodes}",
            "--ntasks-per-node=1", "--kill-on-bad-exit=0", "--wait=0", "-u",
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


class ProcessStep:
    """A step of node agents that is one process on this machine: srun (or a test's
    stand-in for it). What a Hub asks of any step (ray_step.RayStep is the other):
    ``poll()`` and ``returncode`` (the step ended before every agent joined?),
    ``command`` (named in errors), ``watch(on_end)`` (a scheduler that learns of a lost
    node by itself calls ``on_end(index, why)``; srun tells nothing the agents'
    connections do not) and ``end(grace, nodes)``."""

    def __init__(self, proc: subprocess.Popen, command: str):
        self.proc = proc
        self.command = command

    @property
    def returncode(self) -> Optional[int]:
        return self.proc.returncode

    def poll(self) -> Optional[int]:
        return self.proc.poll()

    def watch(self, on_end) -> None:
        """Nothing to watch: a node lost is known by its agent's connection."""

    def end(self, grace: float, nodes: Sequence = ()) -> None:
        """End the step (end_step); `nodes` (the Hub's NodeInfo) say its SLURM id."""
        end_step(self.proc, grace, slurm_step_id(node.environ for node in nodes))


def slurm_step_id(environs) -> Optional[str]:
    """"JOB.STEP" of the agents' SLURM step, from their environments (None outside one)."""
    for env in environs:
        if env.get("SLURM_JOB_ID") and env.get("SLURM_STEP_ID"):
            return f"{env['SLURM_JOB_ID']}.{env['SLURM_STEP_ID']}"
    return None


def start_srun_step(agent_argv: Sequence[str], env: Dict[str, str], nnodes: int,
                    output) -> ProcessStep:
    """The default way of starting the agents: one srun step, in a session of its own
    (a Ctrl-C at the terminal is the launching process's to handle; a second one would
    make srun cancel the step)."""
    argv = srun_argv(nnodes, agent_argv, env)
    return ProcessStep(subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL,
                                        stdout=output, stderr=output,
                                        start_new_session=True), shlex.join(argv))


def end_step(step: subprocess.Popen, grace: float, step_id: Optional[str] = None) -> None:
    """The agents end when their connection does, and the step with them. A step still
    there after `grace` (an agent frozen, or cut off) is cancelled by SLURM
    (``scancel JOB.STEP``: slurmstepd kills every process of the step, on every node,
    stopped ones included), then srun is ended."""
    try:
        step.wait(grace)
        return
    except subprocess.TimeoutExpired:
        pass
    if step_id is not None and shutil.which("scancel"):
        log.warning("mplaunch: the World's step %s did not end with its connections; "
                    "cancelling it", step_id)
        try:
            subprocess.run(["scancel", "--signal=KILL", step_id], timeout=10,
                           stdin=subprocess.DEVNULL, capture_output=True)
            subprocess.run(["scancel", step_id], timeout=10,
                           stdin=subprocess.DEVNULL, capture_output=True)
            step.wait(grace)
            return
        except (subprocess.TimeoutExpired, OSError):
            pass
    for signo, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        try:
            step.send_signal(signo)
            step.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue
        except ProcessLookupError:
            return
    log.warning("mplaunch: the World's srun step (pid %d) did not end", step.pid)


def listen(address: str) -> socket.socket:
    """The port the World's agents connect to, bound as the store's is (store.bind)."""
    try:
        sock = store.bind(address, 0)
    except OSError as exc:
        raise NodesError(f"cannot listen on {address!r} for the World's node agents: "
                         f"{exc}; give master_addr= an address of this machine that the "
                         "nodes reach") from None
    servers.own_socket(sock)
    return sock


def agent_argv() -> List[str]:
    """What each task of the step runs: this interpreter, as an agent."""
    return [sys.executable, "-m", AGENT_MODULE]


def join_addr(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
