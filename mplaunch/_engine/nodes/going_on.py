"""A World across nodes that goes on without a lost node (issue 42). Where a lost node
cannot be replaced (no spare node, a scheduler that cannot start one, a replacement
that failed), a healing World keeps the other nodes' ranks, their processes and their
state, instead of tearing every node down; the failed call's error says so, and
``World.restart(nnodes=M)``, M being the nodes left, goes on with them:

- the lost nodes' links leave the Hub, and the others are renumbered in their order
  (their ranks' NODE_RANK); each keeps its slot, the scheduler's number for it, which
  its step and part-steps go on speaking of (Hub.drop);
- the ranks on the lost nodes leave the group, and the others are renumbered in their
  order: each is told what changes in its environment (RANK, WORLD_SIZE, NODE_RANK and
  the variables that follow them: _rank.heal.renumber), keeping its process and state;
- the process group is rebuilt among them in a new key space, and a rank that died
  on a node that stays starts fresh there, as after any heal.

Any other call (a run, restart() without nnodes, restart(nnodes=) with another count)
ends the kept ranks and starts fresh ones on a new step, as before.

Rejected: going on with fewer nodes at once, in the failed call's heal. A World sized
for N nodes that silently becomes smaller changes what every later call computes (its
batch per step, its learning rate's scale, the ranks a sharded checkpoint expects);
the user says so, once, knowing the new size. And renumbering nobody (a World whose
ranks are 0, 1, 4, 5): torch.distributed, DDP and every framework expect ranks
0..WORLD_SIZE-1.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

from .agents import NodesError
from ..heal import forget_failures, remake

__mplaunch_plumbing__ = True


def kept(engine, exc: BaseException) -> Optional[str]:
    """After a heal that found a lost node with no replacement (`exc`, a NodesError):
    what the World kept, said for the error, where the other nodes' ranks are kept;
    None where nothing can be (another error, or no node left)."""
    hub, attempt = engine.hub, engine.attempt
    if not isinstance(exc, NodesError) or hub is None or attempt is None:
        return None
    nodes = [link for link in hub.links if link.lost is None]
    ranks = [r.spec.rank for r in attempt.group.ranks if r.alive]
    if not nodes or not ranks:
        return None
    engine.waiting = True
    m = len(nodes)
    return (f"the world could not be healed ({exc}); the ranks on the other {m} node(s) "
            f"were kept, with their processes and state (ranks {_runs(ranks)}): "
            f"world.restart(nnodes={m}) goes on with them, renumbered 0.."
            f"{m * engine.cfg.nprocs - 1} in their order (each one's RANK, WORLD_SIZE "
            f"and NODE_RANK change); anything else ends them: a run or restart() starts "
            f"fresh ranks on a new step of {hub.nnodes} nodes")


def lost_for_good(engine) -> Optional[list]:
    """The lost links of a healing World across nodes that is up, once no replacement
    is under way (waited for), where none of them is being replaced: what going on
    would leave out (None: nothing, or a replacement is coming)."""
    hub = engine.hub
    if not engine.heal or engine.attempt is None or hub is None:
        return None
    hub.mends.settle()
    with hub.mends.lock:
        lost = [(i, link) for i, link in enumerate(hub.links) if link.lost is not None]
    if not lost or any(hub.mends.mending(i) for i, _ in lost):
        return None
    return [link for _, link in lost]


def leaving(engine, nnodes: int, nprocs: Optional[int]) -> Optional[list]:
    """The lost links that restart(nnodes=`nnodes`, nprocs=`nprocs`) goes on without,
    keeping the ranks that are up; None where it cannot: it needs a healing World
    across nodes, up, with lost nodes that nothing replaces, `nnodes` the nodes left.
    Read once, and handed to go_on: a replacement that came between two reads would
    have left go_on nothing to leave out."""
    lost = lost_for_good(engine)
    if (lost is None or nnodes != len(engine.hub.links) - len(lost)
            or nprocs not in (None, engine.cfg.nprocs)):
        return None
    return lost


def go_on(engine, cfg, plan, lost: list) -> str:
    """Go on with the nodes left, without `lost` (leaving's; see the module's text);
    `cfg` and `plan`: the World's on them. What was done, said plainly. Whatever fails
    from the moment the lost nodes leave (another node lost meanwhile, a rank that does
    not follow, an interrupt) tears the ranks down and raises: the next call starts
    fresh ones, on the nodes the World has then."""
    attempt, hub = engine.attempt, engine.hub
    group = attempt.group
    gone = {link.info.index: link.describe() for link in lost}
    was = {i: r.spec.rank for i, r in enumerate(group.ranks)}
    keep = [i for i, r in enumerate(group.ranks) if r.spec.node_rank not in gone]
    hub.drop(lost)
    engine.cfg, engine.nodes, engine.waiting = cfg, plan, False
    try:
        if (len(hub.links) != cfg.nnodes or len(keep) != cfg.world_size
                or any(lk.lost for lk in hub.links)):
            raise NodesError(f"another node was lost while the World went on without "
                             f"{', '.join(gone.values())}: its ranks were ended; the next "
                             f"run starts fresh ones")
        specs = engine._node_specs(engine._session, attempt.number)
        attempt.cfg = dataclasses.replace(attempt.cfg, nnodes=cfg.nnodes)
        changes = group.renumber(keep, specs, attempt.cfg)
        forget_failures(attempt)
        live = [r for r in group.ranks if r.alive]
        dead = [i for i, r in enumerate(group.ranks) if not r.alive]
        engine._control(engine.calls.renumber, (changes,), live)
        states = engine._control(engine.calls.group_state, (), live)
        backends = {s["backend"] for s in states if s["initialized"]}
        backend = backends.pop() if len(backends) == 1 else engine.backend
        stale = engine._rebuild(backend, max(s["incarnation"] for s in states), dead,
                                live)
        if not group.running or group.stopping:
            raise NodesError("a rank did not follow the World going on: its ranks were "
                             "ended; the next run starts fresh ones")
    except BaseException:
        engine.stop()
        raise
    engine.fresh = [group.ranks[i].spec.rank for i in dead]
    moved = ", ".join(f"{was[i]}->{group.ranks[j].spec.rank}"
                      for j, i in enumerate(keep) if was[i] != group.ranks[j].spec.rank)
    return (f"mplaunch.World: going on with {cfg.nnodes} node(s) of {cfg.nprocs} ranks "
            f"({cfg.world_size} ranks) without {', '.join(gone.values())}: the ranks "
            f"there are gone; the others kept their processes and state"
            + (f", renumbered ({moved})" if moved else ", and their numbers")
            + (f"; rank(s) {engine.fresh} were dead and started fresh" if engine.fresh
               else "") + "; the process group was rebuilt among them" + remake(stale))


def _runs(ranks) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'."""
    out, start = [], None
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            out.append(str(r) if r == start else f"{start}-{r}")
            start = None
    return ", ".join(out)
