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
import signal
import threading
import time
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence

from .agents import NodesError
from .ray_actor import (_ray, actor_class, bundle_for, check_cluster, connect,
                        node_short, show)
from .schedulers import AgentLaunch

log = logging.getLogger("mplaunch")

PLACE_TIMEOUT = 60.0     # for the cluster to place every bundle


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
        self.indices: List[int] = list(range(nnodes))   # each actor's node index
        self._ending = False
        self._watcher: Optional[threading.Thread] = None

    @property
    def command(self) -> str:
        return (f"Ray placement group of {self.nnodes} bundle(s) {show(self.bundle)}, "
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
        remote_cls = actor_class()
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
                i = self.indices[self.waits.index(ref)]
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
        self._say(f"node {self.indices[i]} ({self.names[i] if i < len(self.names) else '?'}): "
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


    def replace(self, index: int, launch: AgentLaunch, nodes: Sequence) -> "RayPart":
        """Lost node `index`'s agent again (schedulers.Step.replace): an actor in the
        World's placement group's bundle `index`, wherever Ray has that bundle now: on
        the same node if it is alive (its agent was what died), else on the live node
        Ray moved the bundle to when it declared the node dead (a node of the cluster
        that the World does not use and that fits it; an autoscaler's new one), within
        PLACE_TIMEOUT, else a clear error."""
        if type(self) is RayStep and index < len(self.actors):
            try:   # its first actor (its agent gone, it may live on): the bundle freed
                _ray().kill(self.actors[index], no_restart=True)
            except Exception:  # noqa: BLE001 - dead already
                pass
        part = RayPart(index, self.bundle, launch.output)
        try:
            part.start_in(self.pg, launch.address, launch.secret)
        except BaseException:
            part.end(0.0)
            raise
        return part


class RayPart(RayStep):
    """One agent actor that replaces a lost node's, in that node's bundle of the World's
    placement group (which the World's step keeps, and removes at its end)."""

    def __init__(self, index: int, bundle: Dict[str, float], output):
        super().__init__(1, bundle, output)
        self.indices = [index]

    @property
    def command(self) -> str:
        return (f"a Ray actor in bundle {self.indices[0]} {show(self.bundle)} of the "
                f"World's placement group")

    def start_in(self, pg, addr: str, secret: str, timeout: float = PLACE_TIMEOUT) -> None:
        """Placed again until it lives: an actor placed in the bundle while Ray still
        had it on the dying node (the agent's connection ended before Ray's verdict)
        dies with that node, and the next one goes where Ray moved the bundle."""
        ray = _ray()
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        index, end, why = self.indices[0], time.monotonic() + timeout, ""
        while True:
            actor = actor_class().options(
                num_cpus=self.bundle.get("CPU", 0.0), num_gpus=self.bundle.get("GPU", 0.0),
                resources={k: v for k, v in self.bundle.items() if k not in ("CPU", "GPU")},
                max_concurrency=4, max_restarts=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    pg, placement_group_bundle_index=index,
                    placement_group_capture_child_tasks=False)).remote()
            self.actors = [actor]
            try:
                where = ray.get(actor.where.remote(),
                                timeout=max(0.1, end - time.monotonic()))
                break
            except Exception as exc:  # noqa: BLE001 - GetTimeoutError, or it died
                why = type(exc).__name__
                try:
                    ray.kill(actor, no_restart=True)
                except Exception:  # noqa: BLE001
                    pass
            if time.monotonic() >= end:
                raise NodesError(f"Ray placed no replacement for node {index} within "
                                 f"{timeout:g} s ({why}): no live node the World does "
                                 f"not use has {show(self.bundle)} free; add one, or let "
                                 f"the cluster's autoscaler bring one")
            time.sleep(0.5)
        self.names = [node_short(where["node_id"])]
        ray.get(actor.start.remote(index, self.names[0], addr, secret), timeout=timeout)
        self.waits = [actor.wait.remote()]


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
