"""What the notebook shows when a ``%%ranks`` cell or a ``%ranks`` command fails: the
rank's own exception as the failing cell would show it, grouped with the ranks that
raised the same; the other errors with a note saying what became of the world; a hint
when a cell names one of the notebook's own variables; and why a pulled value the
ranks sent could not be rebuilt in the kernel (a DistributedDataParallel module).

It is apart from mplaunch._magic, which runs the magics and keeps the world, because
none of this needs the world: each function turns an error (or a pickle) into words.
Like the magics, it imports IPython nowhere (mplaunch._magic turns :class:`Usage` into
IPython's UsageError).
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

from ._wire.stacks import rank_list, short_path
from .errors import LaunchTimeout, MainProcessError, WorkerError

__all__ = ["Usage", "why_torn_down", "shown_error", "notebook_name_note", "not_rebuilt",
           "rebuilt"]


class Usage(Exception):
    """A bad %ranks line; shown as IPython's UsageError (a one-line message)."""


def why_torn_down(err: BaseException) -> str:
    if isinstance(err, LaunchTimeout):
        return "a cell ran past its timeout"
    if isinstance(err, WorkerError):
        return f"rank {err.rank} failed"
    if isinstance(err, MainProcessError):
        return f"the kernel received {err.signal_name}"
    return type(err).__name__


def shown_error(err: BaseException, size: int, cell: Optional[str], kept=False,
                nodes=False, explain=None) -> BaseException:
    """What the notebook shows for a failed run, without mplaunch's frames.

    A rank's exception raised by the code of the `cell` (its file name; None for other
    calls) is shown itself, as a failing cell would show it: its type, its frames in the
    cell's lines, and a note naming the rank (across `nodes`, its node too, as
    ``%ranks`` shows it), the ranks that raised the same, and whether the world was
    kept; `explain` may add a note of its own before that one. The ranks do not print
    it (_rank.cells.raised_by_cell): it shows once.
    Anything else (a rank killed by a signal, a timeout, an interrupt) is the
    WorkerError, LaunchTimeout or MainProcessError as launch raises it, with a note
    saying what became of the world: that note alone, not the message's last line too
    (``[mplaunch.World] ...``, which a healing World's ``healed`` adds)."""
    healed = getattr(err, "healed", None)
    after = healed or ("the world was kept" if kept else
                       f"the world's {size} ranks were torn down; the next %%ranks cell "
                       "starts fresh ones")
    cause = err.__cause__
    if cell and type(err) is WorkerError and isinstance(cause, Exception):
        first = err.first
        where = (f"on node {first.node_rank} ({first.hostname}, pid {first.pid})"
                 if nodes else f"(pid {first.pid})")
        same, others = _same_as_first(err.failures, cell)
        note = (f"%%ranks: rank {err.rank} {where} raised this"
                + (f"; {rank_list(same)} raised the same" if same else "")
                + (f"; {others}" if others else "")
                + f"; {after}.")
        hint = explain(cause) if explain is not None else None
        cause.__notes__ = [*getattr(cause, "__notes__", ()),
                           *([hint] if hint else []), note]
        return cause
    if healed:
        err.healed = None   # said by the note
    err.__notes__ = [*getattr(err, "__notes__", ()), f"%ranks: {after}."]
    return err.with_traceback(None)


def _same_as_first(failures, filename: str) -> Tuple[List[int], str]:
    """The ranks after the first failure that raised the same exception (type, message
    and the user's frames), and the others in words, alike ones together (ranks that the
    World released or interrupted, at the same place), a line of the cell (`filename`)
    named as such."""
    groups: Dict[Any, List[Any]] = {}
    for i, f in enumerate(failures):
        released = getattr(f, "released", None)
        key = (("released", released, f.location) if released and i else
               (f.exc_type, f.message, _users_frames(f.traceback))
               if f.exc_type is not None else i)
        groups.setdefault(key, []).append(f)
    same, said = [], []
    for group in groups.values():
        if group[0] is failures[0]:
            same = [f.rank for f in group[1:]]
            continue
        text = group[0].describe()
        for path in {filename, short_path(filename)}:
            text = text.replace(f"at {path}:", "at the cell's line ")
        if len(group) > 1:
            text += f", and {rank_list([f.rank for f in group[1:]])} the same"
        said.append(text)
    if not said:
        return same, ""
    n = len(failures) - 1 - len(same)
    return same, (f"{n} more rank(s) failed otherwise: " + "; ".join(said[:8])
                  + (" ..." if len(said) > 8 else ""))


def _users_frames(tb_text: Optional[str]) -> tuple:
    """(file, line, function) of each frame of a rank's traceback text outside Python's
    library, torch and mplaunch (paths that may differ from node to node)."""
    import os
    import re
    import sysconfig
    paths = sysconfig.get_paths()
    library = tuple({os.path.realpath(paths[k]) + os.sep for k in
                     ("stdlib", "platstdlib", "purelib", "platlib") if paths.get(k)}
                    | {os.path.dirname(os.path.abspath(__file__)) + os.sep})
    return tuple(m.groups() for m in re.finditer(
        r'^  File "(.*)", line (\d+), in (.*)$', tb_text or "", re.M)
        if not os.path.realpath(m[1]).startswith(library))


def notebook_name_note(shell, err: BaseException) -> Optional[str]:
    """For a NameError of a cell whose name is one of the notebook's own variables
    (not IPython's): what to do about it, since the ranks have their own names."""
    import re
    import types
    match = re.fullmatch(r"name '(\w+)' is not defined", str(err))
    if not isinstance(err, NameError) or match is None or shell is None:
        return None
    name = match[1]
    namespace = shell.user_ns
    hidden = getattr(shell, "user_ns_hidden", {})
    if name not in namespace or (name in hidden and hidden[name] is namespace[name]):
        return None
    value = namespace[name]
    if isinstance(value, types.ModuleType):
        alias = "" if value.__name__ == name else f" as {name}"
        return (f"%%ranks: {name!r} is a module imported in the notebook; the ranks "
                f"have their own imports: import {value.__name__}{alias} in a "
                "%%ranks cell")
    return (f"%%ranks: {name!r} is a variable of the notebook, not of the ranks (a "
            "%%ranks cell sees only the ranks' own names). To send it to every "
            f"rank: %ranks push {name}")


def not_rebuilt(err: WorkerError) -> bool:
    """Whether every failure of `err` is a value the kernel could not rebuild: the rank
    raised nothing (no traceback), the kernel's unpickling did."""
    return all(f.exc_type is not None and f.traceback is None and f.signal is None
               for f in err.failures)


def rebuilt(name: str, rank: int, answer) -> Any:
    """A rank's value, from its pickle (cells.pull, pickled=True); what it is and why,
    when the kernel cannot rebuild it."""
    import pickle
    what, blob = answer
    try:
        return pickle.loads(blob)
    except Exception as exc:  # noqa: BLE001 - any failure is said
        why = f"{type(exc).__name__}: {str(exc).rstrip('.')}"
    text = (f"%ranks pull: rank {rank} raised nothing, but the kernel could not rebuild "
            f"its {name!r}, a {what['type']} ({why})")
    if what["wraps"]:
        raise Usage(f"{text}. A {what['type']} can be rebuilt only inside a process "
                    "group, and the kernel is in none: pull the module it wraps, or its "
                    f"weights. In a %%ranks cell: net = {name}.module (or weights = "
                    f"{name}.module.state_dict()), then %ranks pull net")
    if what["module"]:
        raise Usage(f"{text}. Pull its weights: in a %%ranks cell, weights = "
                    f"{name}.state_dict(), then %ranks pull weights")
    raise Usage(f"{text}; pull something derived from it")
