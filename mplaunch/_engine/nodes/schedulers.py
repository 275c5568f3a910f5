"""The one place a scheduler's name becomes code: what every scheduler offers a World
across nodes (the seam, written as typed Protocols), and the registry that chooses one
by name. A new scheduler is one module with one class that offers `Scheduler`, and one
line in `_BUILTIN` (or a `register()` call, as the tests' stand-in makes); nothing else
of mplaunch names a scheduler. The front-ends pass the user's `scheduler=` through and
list `names()`.

The split: a scheduler checks its own options and its cluster before anything starts,
says where its nodes reach this process, starts one step of node agents (_agent.agent)
and hands each agent its node's index and name; it may report a node it lost (`watch`),
and ends the step. Everything after the agents have joined (their links, the ranks,
heals) is the Hub's (hub.py), the same for every scheduler.

Rejected: a `starter` callable passed through the World (before): the choice of
scheduler, its option checks and its cluster checks were then spread over the front-end
(an ``if scheduler == "ray"`` in `_world.py`), and the test stand-in took a private
door (`World(_starter=)`) that no real scheduler went through.
"""
from __future__ import annotations

import dataclasses
import importlib
from typing import (IO, Any, Callable, Dict, List, Mapping, Optional, Protocol,
                    Sequence, Tuple, runtime_checkable)

# The schedulers mplaunch ships: name -> the module whose SCHEDULER offers `Scheduler`,
# imported only when chosen (Ray's is imported only for scheduler="ray").
_BUILTIN: Dict[str, str] = {"slurm": "mplaunch._engine.nodes.slurm_step",
                            "ray": "mplaunch._engine.nodes.ray_step"}
# A World made with nnodes > 1 and no scheduler=: the allocation it runs in.
DEFAULT = "slurm"


@dataclasses.dataclass(frozen=True)
class AgentLaunch:
    """What a scheduler starts on each of `nnodes` nodes: the agent's command, the
    environment it is given (where this process listens, the World's secret), and the
    file the step's own output goes to (quoted when the step fails)."""
    argv: Tuple[str, ...]
    env: Dict[str, str]
    nnodes: int
    output: IO[bytes]
    secret: str
    address: str          # host:port of this process's agent port


@runtime_checkable
class Step(Protocol):
    """One step of node agents, as its scheduler started it."""
    command: str                      # named in errors: what was started

    @property
    def returncode(self) -> Optional[int]: ...

    def poll(self) -> Optional[int]:
        """The step's exit status once it ended (before every agent joined?), else None."""

    def watch(self, on_end: Callable[[int, str], None]) -> None:
        """From now on, ``on_end(node index, why)`` when the scheduler learns that a
        node's agent ended; a scheduler that learns nothing the agents' connections do
        not does nothing. A node's index here is the scheduler's own: the one its agent
        was handed (NodeInfo.slot)."""

    def end(self, grace: float, nodes: Sequence[Any] = ()) -> None:
        """End the step: its agents end with their connections, within `grace`
        seconds, else the scheduler ends them. `nodes`: the Hub's NodeInfo."""

    # Optional (a step without it ends the World when a node is lost):
    #   def replace(self, index: int, launch: AgentLaunch, nodes) -> Step
    # Start one agent (launch.nnodes == 1) for lost node `index`, on another node that
    # can take it (or the same one, back), handed `index` as its node index; `nodes`:
    # the Hub's NodeInfo (the nodes in use, to leave out; each's `slot` is the index it
    # was handed, -1 for a node that failed before). Returns the part-step that
    # runs it, ended as a step is. The Hub does the rest (hub.py, mend.py).


@runtime_checkable
class Scheduler(Protocol):
    """Where a World's nodes come from. One instance per World plan."""
    name: str                         # what World(scheduler=) names it by
    about: str                        # what it is, for errors and help texts
    options: Tuple[str, ...]          # World keyword options only this scheduler takes

    def check(self, nnodes: int, nprocs: Optional[int], gpus: Any,
              options: Mapping[str, Any]) -> None:
        """Before anything starts: this scheduler can place `nnodes` nodes of `nprocs`
        ranks (on `gpus`), with its own `options` (given or not); raises what to do
        otherwise."""

    def address(self) -> Optional[str]:
        """The address its nodes reach this process at, if it knows (else the host
        name's)."""

    def start(self, launch: AgentLaunch) -> Step:
        """Start one agent per node. Each agent is handed its node's index and name, in
        its environment (_wire.tunnel.NODE_ENV, NAME_ENV) or by naming the variables
        its scheduler sets per node (NODE_FROM_ENV)."""

    def node_environ(self, agent_environ: Mapping[str, str]) -> Dict[str, str]:
        """A node's environment for its ranks, from its agent's."""


_registry: Dict[str, Callable[[], Scheduler]] = {}


def register(name: str, factory: Callable[[], Scheduler], replace: bool = False) -> None:
    """Make `name` a scheduler: ``factory()`` gives one per World plan."""
    if not isinstance(name, str) or not name:
        raise TypeError(f"a scheduler's name is a non-empty str, got {name!r}")
    if not replace and (name in _registry or name in _BUILTIN):
        raise ValueError(f"a scheduler named {name!r} is registered already")
    _registry[name] = factory


def unregister(name: str) -> None:
    _registry.pop(name, None)


def names() -> List[str]:
    """The schedulers a World can name, mplaunch's own first."""
    return list(_BUILTIN) + [n for n in _registry if n not in _BUILTIN]


def _factory(name: str) -> Callable[[], Scheduler]:
    if name not in _registry and name in _BUILTIN:
        _registry[name] = importlib.import_module(_BUILTIN[name]).SCHEDULER
    return _registry[name]


def choose(name: Optional[str]) -> Scheduler:
    """The scheduler `name` (None: DEFAULT), a fresh instance; a clear error for a name
    nobody registered."""
    if name is None:
        name = DEFAULT
    if not isinstance(name, str) or name not in names():
        raise ValueError(f"scheduler must be one of {', '.join(map(repr, names()))} "
                         f"({'; '.join(f'{n}: {_about(n)}' for n in names())}), got "
                         f"{name!r}")
    scheduler = _factory(name)()
    if not isinstance(scheduler, Scheduler):
        raise TypeError(f"scheduler {name!r} does not offer what a scheduler must "
                        f"(mplaunch._engine.nodes.schedulers.Scheduler)")
    return scheduler


def _about(name: str) -> str:
    return getattr(_factory(name), "about", name)


def split_options(chosen: Scheduler, options: Dict[str, Any]) -> Dict[str, Any]:
    """Take every scheduler's own options out of `options`: the chosen one's are
    returned, another's is refused, naming whose it is."""
    mine = {k: options.pop(k) for k in list(options) if k in chosen.options}
    for name in names():
        if name == chosen.name:
            continue
        for key in getattr(_factory(name), "options", ()):
            if key in options:
                raise TypeError(f"{key}= is an option of scheduler={name!r} "
                                f"({_about(name)}); this World's scheduler is "
                                f"{chosen.name!r}")
    return mine


def all_options() -> Tuple[str, ...]:
    """Every registered scheduler's own option names."""
    return tuple(k for n in names() for k in getattr(_factory(n), "options", ()))
