"""What a World on Ray runs on the cluster, and what it asks of the cluster: the agent
actor (NodeAgent: one per node, in the World's placement group, or alone on a node
that replaces a lost one), and the checks of the cluster's nodes. The step of those
actors, the World's side, is ray_step.py's.
"""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import tempfile
from typing import Dict, List, Optional

from .agents import AGENT_MODULE
from ..._wire import auth, tunnel

log = logging.getLogger("mplaunch")

# The variables torch's launchers and Ray Train set for a rank: never taken from a
# Ray worker's environment into the World's ranks (each rank gets its own from mplaunch).
TORCH_LAUNCHER_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                       "NODE_RANK", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
                       "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT",
                       "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT",
                       "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_USE_AGENT_STORE",
                       "TORCHELASTIC_ERROR_FILE", "TORCH_NCCL_ASYNC_ERROR_HANDLING")


def _ray():
    try:
        import ray
    except ImportError:
        raise ImportError("World(nnodes=..., scheduler='ray') needs Ray on this machine "
                          "and every node: pip install 'mplaunch[ray]'") from None
    return ray


def connect() -> None:
    """Connected to a cluster already, or to the one RAY_ADDRESS names; never a new
    local one started by mistake."""
    ray = _ray()
    if ray.is_initialized():
        return
    if not os.environ.get("RAY_ADDRESS"):
        raise RuntimeError(
            "World(scheduler='ray') runs on the Ray cluster this process is connected "
            "to, and it is connected to none: call ray.init(address=...) first (on a "
            "cluster's head node, ray.init(address='auto')), or set RAY_ADDRESS")
    ray.init(log_to_driver=False, logging_level=logging.WARNING)


def node_short(node_id: str) -> str:
    """A Ray node id as the output prefix and errors show it (its first 8 hex digits:
    the nodes of one machine share a host name and an address, never an id)."""
    return node_id[:8]


def bundle_for(nprocs: int, gpus, resources: Optional[Dict[str, float]]) -> Dict[str, float]:
    """What each node's bundle reserves: a CPU per rank, and a GPU per rank where the
    ranks are placed on GPUs; `resources` (World(ray_resources=)) replaces it."""
    if resources is not None:
        return {str(k): float(v) for k, v in resources.items() if v}
    bundle = {"CPU": float(nprocs)}
    if gpus is not None:
        count = nprocs if isinstance(gpus, str) else len(gpus)
        bundle["GPU"] = float(count)
    return bundle


def check_cluster(nnodes: int, bundle: Dict[str, float]) -> None:
    """Before anything starts: enough live nodes, each with room for a bundle."""
    alive = [n for n in _ray().nodes() if n.get("Alive")]
    fits = fitting_nodes(bundle)
    if len(fits) < nnodes:
        raise ValueError(
            f"World(nnodes={nnodes}, scheduler='ray') needs {nnodes} nodes with "
            f"{show(bundle)} each, and this Ray cluster has {len(fits)} of its "
            f"{len(alive)} live node(s) that large: ask for fewer nodes or ranks, add "
            f"nodes, or say what each node's bundle reserves with ray_resources=")


def show(bundle: Dict[str, float]) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in bundle.items()) + "}"


def _working_dir() -> Optional[str]:
    """The runtime_env working_dir of the job this actor runs in, if it has one (Ray
    then runs the actor, as every task, in that directory's copy on this node)."""
    try:
        return _ray().get_runtime_context().runtime_env.get("working_dir") or None
    except Exception:  # noqa: BLE001 - an older Ray without it
        return None


class NodeAgent:
    """The actor in one node's bundle (Ray runs it as ``ray.remote(NodeAgent)``)."""

    def __init__(self):
        self.proc: Optional[subprocess.Popen] = None
        self.log = None

    def where(self) -> dict:
        ray = _ray()
        return {"node_id": ray.get_runtime_context().get_node_id(), "pid": os.getpid(),
                "cuda": os.environ.get("CUDA_VISIBLE_DEVICES")}

    def start(self, index: int, name: str, addr: str, secret: str) -> int:
        """Start this node's agent; the secret goes down its stdin."""
        env = {k: v for k, v in os.environ.items() if k not in TORCH_LAUNCHER_VARS}
        env.update({tunnel.NODE_ENV: str(index), tunnel.NAME_ENV: name,
                    tunnel.ADDR_ENV: addr, tunnel.SECRET_STDIN_ENV: "1",
                    tunnel.PARENT_ENV: str(os.getpid()), "PYTHONUNBUFFERED": "1"})
        if _working_dir():
            env[tunnel.CWD_ENV] = os.getcwd()   # Ray runs this actor there
        env.pop(auth.SECRET_ENV, None)
        self.log = tempfile.TemporaryFile(prefix="mplaunch-agent-")
        self.proc = subprocess.Popen([sys.executable, "-m", AGENT_MODULE], env=env,
                                     stdin=subprocess.PIPE, stdout=self.log,
                                     stderr=subprocess.STDOUT, close_fds=True)
        try:
            self.proc.stdin.write(secret.encode() + b"\n")
            self.proc.stdin.close()
        except OSError:
            pass
        return self.proc.pid

    def wait(self) -> tuple:
        """(exit status, the end of what the agent printed), once it has ended."""
        code = self.proc.wait() if self.proc is not None else 0
        text = ""
        if self.log is not None:
            try:
                self.log.seek(0)
                text = self.log.read()[-3000:].decode(errors="replace")
            except (OSError, ValueError):
                pass
        return code, text

    def end(self, grace: float) -> None:
        """The agent ends with its connection; one still there is ended here."""
        proc = self.proc
        if proc is None:
            return
        for signo, wait in ((None, grace), (signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
            if signo is not None and proc.poll() is None:
                proc.send_signal(signo)
            try:
                proc.wait(wait)
                return
            except subprocess.TimeoutExpired:
                continue


_ACTOR = None


def actor_class():
    """NodeAgent as a Ray actor class, made once."""
    global _ACTOR
    if _ACTOR is None:
        _ACTOR = _ray().remote(NodeAgent)
    return _ACTOR




def fitting_nodes(bundle: Dict[str, float]) -> List[dict]:
    """The cluster's live nodes (ray.nodes() entries) with room for `bundle` in all."""
    return [n for n in _ray().nodes() if n.get("Alive") and all(
        n.get("Resources", {}).get(k, 0.0) >= v for k, v in bundle.items())]
