"""A World's nodes on a Ray cluster: one placement group for the World's life, with one
bundle per node (STRICT_SPREAD: never two on one node), and in each bundle one small
actor that starts that node's agent (_agent.agent, the process SLURM's step starts) and
reports its end. The agents then connect back and prove the secret exactly as on SLURM
(_engine.nodes.hub.Hub): from there on, nothing of the World goes through Ray.

Where the secret goes: not in an actor's constructor arguments, nor in a runtime_env
(Ray keeps both in its GCS, where any client of the cluster can read them: see
docs/multinode.rst). It goes as the argument of one actor method call, which Ray sends
from this process to the actor's process directly and keeps nowhere, and from the actor
to the agent through a pipe (the agent's stdin), never its environment.

The driver must already be connected to the cluster (``ray.init(address=...)``), or name
it in RAY_ADDRESS, which ``ray.init()`` reads.
"""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence

from .agents import AGENT_MODULE, NodesError
from .schedulers import AgentLaunch
from ..._wire import auth, tunnel

log = logging.getLogger("mplaunch")

PLACE_TIMEOUT = 60.0     # for the cluster to place every bundle
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
    ray = _ray()
    fits = []
    alive = [n for n in ray.nodes() if n.get("Alive")]
    for node in alive:
        have = node.get("Resources", {})
        if all(have.get(k, 0.0) >= v for k, v in bundle.items()):
            fits.append(node)
    if len(fits) < nnodes:
        raise ValueError(
            f"World(nnodes={nnodes}, scheduler='ray') needs {nnodes} nodes with "
            f"{_show(bundle)} each, and this Ray cluster has {len(fits)} of its "
            f"{len(alive)} live node(s) that large: ask for fewer nodes or ranks, add "
            f"nodes, or say what each node's bundle reserves with ray_resources=")


def _show(bundle: Dict[str, float]) -> str:
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


def _actor_class():
    """NodeAgent as a Ray actor class, made once."""
    global _ACTOR
    if _ACTOR is None:
        _ACTOR = _ray().remote(NodeAgent)
    return _ACTOR


class RayStep:
    """A World's placement group and agent actors: what a SLURM step is to a World
    there; the Hub asks of it what it asks of every step (schedulers.Step)."""

    def __init__(self, nnodes: int, bundle: Dict[str, float], output):
        self.nnodes = nnodes
        self.bundle = bundle
        self.output = output
        self.pg = None
        self.actors: List[object] = []
        self.names: List[str] = []
        self.waits: List[object] = []
        self.returncode: Optional[int] = None
        self._ending = False
        self._watcher: Optional[threading.Thread] = None

    @property
    def command(self) -> str:
        return (f"Ray placement group of {self.nnodes} bundle(s) {_show(self.bundle)}, "
                "STRICT_SPREAD, one mplaunch agent actor in each")

    def start(self, addr: str, secret: str, place_timeout: float = PLACE_TIMEOUT) -> None:
        ray = _ray()
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        self.pg = placement_group([dict(self.bundle)] * self.nnodes,
                                  strategy="STRICT_SPREAD", name="mplaunch-world")
        ready, _ = ray.wait([self.pg.ready()], timeout=place_timeout)
        if not ready:
            remove_placement_group(self.pg)
            self.pg = None
            raise NodesError(f"the Ray cluster did not place {self.command} within "
                             f"{place_timeout:g} s: it has too few free nodes that large "
                             "(each bundle on a node of its own)")
        remote_cls = _actor_class()
        for i in range(self.nnodes):
            strategy = PlacementGroupSchedulingStrategy(
                self.pg, placement_group_bundle_index=i,
                placement_group_capture_child_tasks=False)
            self.actors.append(remote_cls.options(
                num_cpus=self.bundle.get("CPU", 0.0), num_gpus=self.bundle.get("GPU", 0.0),
                resources={k: v for k, v in self.bundle.items() if k not in ("CPU", "GPU")},
                max_concurrency=4, max_restarts=0, scheduling_strategy=strategy).remote())
        where = ray.get([a.where.remote() for a in self.actors], timeout=place_timeout)
        self.names = [node_short(w["node_id"]) for w in where]
        ray.get([a.start.remote(i, self.names[i], addr, secret)
                 for i, a in enumerate(self.actors)], timeout=place_timeout)
        self.waits = [a.wait.remote() for a in self.actors]

    def watch(self, on_end: Callable[[int, str], None]) -> None:
        """From now on, ``on_end(node index, why)`` as soon as Ray reports a node's
        actor ended (its process killed, its node lost: Ray knows a lost node within
        seconds, before TCP keepalive would), in a thread of its own."""
        self._watcher = threading.Thread(target=self._watch, args=(on_end,), daemon=True,
                                         name="mplaunch-ray-watch")
        self._watcher.start()

    def _watch(self, on_end) -> None:
        ray = _ray()
        pending = list(self.waits)
        while pending and not self._ending:
            try:
                done, pending = ray.wait(pending, num_returns=1, timeout=1.0)
            except Exception:  # noqa: BLE001 - Ray shut down under us
                return
            for ref in done:
                if self._ending:
                    return
                i = self.waits.index(ref)
                try:
                    code, _text = ray.get(ref, timeout=10)
                    why = f"Ray reports its agent ended (exit status {code})"
                except Exception as exc:  # noqa: BLE001 - the actor or its node died
                    why = (f"Ray reports its agent's actor died "
                           f"({type(exc).__name__}: {str(exc).splitlines()[0][:200]})")
                try:
                    on_end(i, why)
                except Exception:  # noqa: BLE001 - never let this thread die noisily
                    log.exception("mplaunch: handling the end of node %d", i)

    def poll(self) -> Optional[int]:
        if self.returncode is not None or not self.waits:
            return self.returncode
        ray = _ray()
        done, _ = ray.wait(list(self.waits), num_returns=len(self.waits), timeout=0)
        for ref in done:
            self.returncode = self._collect(ref)
        return self.returncode if done else None

    def _collect(self, ref) -> int:
        ray = _ray()
        i = self.waits.index(ref)
        try:
            code, text = ray.get(ref, timeout=10)
        except Exception as exc:  # noqa: BLE001 - the actor or its node died
            code, text = -signal.SIGKILL, f"its actor died: {type(exc).__name__}: {exc}"
        self._say(f"node {i} ({self.names[i] if i < len(self.names) else '?'}): "
                  f"agent exit status {code}\n{text.strip()}\n")
        return code

    def _say(self, text: str) -> None:
        try:
            self.output.write(text.encode(errors="replace"))
        except (OSError, ValueError, AttributeError):
            pass

    def end(self, grace: float, nodes: Sequence = ()) -> None:
        """The agents end with their connections; then every actor is killed and the
        placement group removed: nothing of the World is left on any node."""
        self._ending = True
        ray = _ray()
        if not ray.is_initialized():
            return
        if self.waits:
            ray.wait(list(self.waits), num_returns=len(self.waits), timeout=grace)
        ends = []
        for actor in self.actors:
            try:
                ends.append(actor.end.remote(5.0))
            except Exception:  # noqa: BLE001 - already dead
                pass
        if ends:
            ray.wait(ends, num_returns=len(ends), timeout=15.0)
        for actor in self.actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001
                pass
        self.actors = []
        if self.pg is not None:
            from ray.util.placement_group import remove_placement_group
            try:
                remove_placement_group(self.pg)
            except Exception:  # noqa: BLE001
                pass
            self.pg = None
        self.waits = []


def driver_address() -> str:
    """This process's address as the cluster's nodes reach it (Ray's node address)."""
    ray = _ray()
    try:
        return ray.util.get_node_ip_address()
    except Exception:  # noqa: BLE001
        return "127.0.0.1"


class Ray:
    """The nodes of the Ray cluster this process is connected to: one placement group,
    an agent actor in each bundle."""
    name = "ray"
    about = "the Ray cluster this process is connected to"
    options = ("ray_resources",)

    def __init__(self):
        self.bundle: Dict[str, float] = {}

    def check(self, nnodes: int, nprocs: Optional[int], gpus: Any,
              options: Mapping[str, Any]) -> None:
        resources = options.get("ray_resources")
        if resources is not None and not (
                isinstance(resources, Mapping) and all(
                    isinstance(k, str) and isinstance(v, (int, float))
                    and not isinstance(v, bool) and v >= 0
                    for k, v in resources.items())):
            raise ValueError(f"ray_resources must map resource names to amounts >= 0, "
                             f"like {{'CPU': 4, 'GPU': 4}}, got {resources!r}")
        self.bundle = bundle_for(nprocs or 1, gpus, resources)
        connect()
        check_cluster(nnodes, self.bundle)

    def address(self) -> Optional[str]:
        return driver_address()

    def start(self, launch: AgentLaunch) -> RayStep:
        """The placement group and its actors; each actor hands its agent the node's
        index and Ray's node id (RayStep.start)."""
        step = RayStep(launch.nnodes, self.bundle, launch.output)
        try:
            step.start(launch.address, launch.secret)
        except BaseException:
            step.end(0.0)
            raise
        return step

    def node_environ(self, agent_environ: Mapping[str, str]) -> Dict[str, str]:
        environ = dict(agent_environ)
        # Ray points its workers' breakpoint() at its own debugger (ray.util.rpdb),
        # which works only in a Ray worker: the agent is an actor, its ranks are not.
        # Without it a rank's breakpoint() asks this World's caller, as anywhere.
        if environ.get("PYTHONBREAKPOINT", "").startswith("ray."):
            del environ["PYTHONBREAKPOINT"]
        return environ


SCHEDULER = Ray
