"""What a World says of a run besides its values: the warnings about where its ranks did
otherwise than the calling process, from the notes of the engine's Reply
(_engine.world_engine): a module that some ranks could not reload (_rank.reloads), a
`__main__` name the ranks kept as theirs, an object of theirs that this process's
replaced (_wire.mainglobals). Each is said in the user's terms, with what to do.

Apart from mplaunch._world, which keeps the ranks and takes one call at a time, because
none of this needs the world: each function turns a note into words, as
mplaunch._magic_errors does for the magics. Rejected: the engine saying them, which
would then speak to the user, in one front-end's words (the ``%ranks`` magic's World
says ``%ranks push NAME`` where a script's says to pass an argument).
"""
from __future__ import annotations

import logging
import sys
import types
import warnings
from typing import List, Optional, Set

__all__ = ["answer", "present"]


def answer(reply, told: Set[tuple], size: int, send_hint: str):
    """(values, None), or (None, the error for run() to raise), after warning of
    `reply`'s notes (present); where warnings are errors (``-W error``), the call's
    error is still the one raised (its cause, the rank's exception, kept), the warning
    its context."""
    error = reply.error
    try:
        present(reply, told, size, send_hint)
    except Exception as warned:
        if error is None:
            raise
        error.__context__ = warned
    if error is None:
        return reply.values, None
    return None, _raisable(error)


def first_raised(error) -> Optional[int]:
    """The first rank whose own exception `error` (a run's) is, for World.debug()."""
    for failure in getattr(error, "failures", ()):
        if failure.exc_type is not None and failure.released is None:
            return failure.rank
    return None


def _raisable(error: BaseException) -> BaseException:
    """An mplaunch error as raised here (its traceback from this frame, _launch)."""
    from ._launch import from_here
    from .errors import MPLaunchError
    return from_here(error) if isinstance(error, MPLaunchError) else error


def present(reply, told: Set[tuple], size: int, send_hint: str) -> None:
    """Warn of `reply`'s notes (a world_engine.Reply of a World of `size` ranks): each
    module that some ranks could not reload, then each `__main__` value they kept or
    took anew, once per note in the World's life (`told`, updated). `send_hint`: how
    to send this process's value of a name ({name}) instead of the ranks' own."""
    for name, whys in reply.unfollowed.items():
        warnings.warn(unfollowed(name, whys, size), RuntimeWarning,
                      stacklevel=_outside_mplaunch())
    for said, ranks in sorted(reply.kept.items(), key=repr):
        if said in told:
            continue
        told.add(said)
        kind, name, _, why = said
        who = ("the ranks" if len(ranks) >= size else
               f"rank{'s' * (len(ranks) > 1)} {', '.join(map(str, sorted(ranks)))}")
        if kind == "kept":
            text = (f"{who} kept their own {name!r} (their code assigned it), not "
                    f"this process's {name!r}, which the function also names: a name "
                    f"the ranks assign is theirs from then on. "
                    f"{send_hint.format(name=name)}")
        else:
            text = replaced(who, name, why)
        warnings.warn(f"mplaunch.World: {text}", UserWarning,
                      stacklevel=_outside_mplaunch())


def replaced(who: str, name: str, why: str) -> str:
    """What a warning says where this process's object `name` replaced the copy that
    `who` had changed in place, and `why` (_wire.mainglobals.take_kept)."""
    kind, _, other = why.partition(":")
    reason = {"new": f"this process's {name!r} is not the object it sent before",
              "changed": f"this process changed its {name!r} since it sent it",
              "shares": f"it shares tensors with this process's {other!r}, which the "
                        f"ranks took anew, and the two must stay linked",
              "held": f"something else this run sent holds this process's {name!r}, "
                      f"an argument or another global"}.get(kind, why)
    return (f"{who} had changed their {name!r} in place since they got it (trained "
            f"it, say), and took this process's {name!r} instead: {reason}. What they "
            f"changed is gone. The ranks keep a module, optimizer, LR scheduler or "
            f"tensor of this process's that they change in place only while this "
            f"process's stays the same object, unchanged here. To go on from theirs, "
            f"build it in the ranks (global {name}; {name} = ...) or fetch it first "
            f"(return {name}.state_dict() from a run)")


def unfollowed(name: str, whys: dict, size: int) -> str:
    """What a warning says of module `name`, which ranks could not reload ({why:
    ranks}) of the World's `size`: which ranks run what, and how to get them equal."""
    failed = sorted(r for ranks in whys.values() for r in ranks)
    if len(failed) == size and len(whys) == 1:
        said = (f"the ranks could not reload {name!r}, which this process reloaded "
                f"({next(iter(whys))}); they run the version they had")
    else:
        one = len(failed) == 1
        why = next(iter(whys)) if len(whys) == 1 else "; ".join(
            f"{_ranks(ranks)}: {why}" for why, ranks in whys.items())
        said = (f"{_ranks(failed)} could not reload {name!r}, which this process "
                f"reloaded ({why}), and run{'s' * one} the version "
                f"{'it' if one else 'they'} had")
        followed = [r for r in range(size) if r not in failed]
        if followed:
            said += (f", while {_ranks(followed)} run{'s' * (len(followed) == 1)} it "
                     f"as reloaded: the ranks now run different code")
    return (f"mplaunch.World: {said}. To run the same code everywhere, make {name!r} "
            f"load in every rank and reload it here again (the next run follows), or "
            f"call world.restart() for fresh ranks")


def _ranks(ranks: List[int]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return f"ranks {', '.join(map(str, ranks[:-1]))} and {ranks[-1]}"


def _outside_mplaunch() -> int:
    """The stacklevel of a warning given here: the first frame of the user's code, past
    mplaunch's own and, for a ``%ranks`` magic, IPython's that ran it (the warning then
    shows the cell's line)."""
    level = 1
    frame: Optional[types.FrameType] = sys._getframe(1)
    while frame is not None and \
            frame.f_globals.get("__name__", "").partition(".")[0] in _NOT_USERS:
        level, frame = level + 1, frame.f_back
    return level


_NOT_USERS = ("mplaunch", "IPython")


def stragglers(collectives, told: Set[tuple], off: Optional[str] = None, late=None):
    """The straggler report of a World's call whose ranks sent `collectives` ({rank:
    records}), or None where they sent none; said once per rank (`told`) where one
    rank kept the others waiting for a large share of the call. `off`: why the ranks
    could read no collectives (this torch), said once; `late`: the stacks sampled from
    a rank while the others waited for it (_engine.sampling)."""
    from ._engine.stragglers import analyse, off_line, worth_saying
    if off is not None:
        # Logged, not warned: a user on an older torch did not ask for the report, and
        # a warning (an error under pytest's -W error) would fail their run for it
        if ("straggler-off",) not in told:
            told.add(("straggler-off",))
            logging.getLogger("mplaunch").warning("mplaunch.World: %s", off_line(off))
        return None
    if not collectives:
        return None
    report = analyse(collectives)
    report.late_stacks = dict(late or {})
    line = worth_saying(report, told)
    if line:
        warnings.warn(f"mplaunch.World: {line}; world.report() has every rank's "
                      "figures", RuntimeWarning, stacklevel=_outside_mplaunch())
    return report
