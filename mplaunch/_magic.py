"""The ``%ranks`` and ``%%ranks`` IPython magics: one :class:`mplaunch.World` per shell,
and cells whose code runs in every rank of it.

``%load_ext mplaunch`` calls :func:`load_ipython_extension`. ``import mplaunch`` imports
this module, so it imports nothing at module level that a launch does not need (IPython,
argparse, ast): those come when a magic runs.

A ``%%ranks`` cell runs in each rank's ``__main__`` namespace: the names it defines are
there for the next cell and for ``%ranks pull``, and a class defined in a cell pickles
by reference there, as it would in a script (``torch.save(model)``, DataLoader
workers). The notebook's own names are not sent: ``%ranks push`` copies chosen ones, as
ipyparallel's ``push`` does. docs/notebooks.rst describes what users see.
"""
from __future__ import annotations

import importlib.util
import linecache
import sys
from typing import Any, Dict, List, Optional, Tuple

from ._rank import cells
from ._wire.stacks import rank_list, short_path
from .errors import LaunchTimeout, MainProcessError, WorkerError

__all__ = ["load_ipython_extension", "unload_ipython_extension", "DEFAULT_NPROCS"]

# The size of the world a %%ranks cell starts when no `%ranks start N` came first.
DEFAULT_NPROCS = 2

_MAGIC = "ranks"
# Where the shell keeps its _Ranks, so that loading twice reuses one world.
_ATTR = "_mplaunch_ranks"


def load_ipython_extension(ipython) -> None:
    """Register ``%ranks`` and ``%%ranks`` in an IPython shell (``%load_ext mplaunch``)."""
    ranks = getattr(ipython, _ATTR, None)
    if ranks is None:
        ranks = _Ranks(ipython)
        setattr(ipython, _ATTR, ranks)
    ipython.register_magic_function(ranks.magic, magic_kind="line_cell",
                                    magic_name=_MAGIC)


def unload_ipython_extension(ipython) -> None:
    """Close the shell's world and remove the magics (``%unload_ext mplaunch``)."""
    ranks = getattr(ipython, _ATTR, None)
    if ranks is not None:
        ranks.stop(quiet=True)
        delattr(ipython, _ATTR)
    for kind in ("line", "cell"):
        ipython.magics_manager.magics[kind].pop(_MAGIC, None)


# -- the ranks' side ---------------------------------------------------------------------
#
# -- the notebook's side -----------------------------------------------------------------

class _Usage(Exception):
    """A bad %ranks line; shown as IPython's UsageError (a one-line message)."""


class _Done(Exception):
    """--help was printed."""


def _parsers() -> Tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    import argparse

    from ._placement_flags import placement_flags

    class _Parser(argparse.ArgumentParser):
        def error(self, message):
            raise _Usage(f"{self.prog}: {message}")

        def exit(self, status=0, message=None):
            if message:
                raise _Usage(message)
            raise _Done

    line = _Parser(prog="%ranks", description=(
        "Start, stop or look at the world that %%ranks cells run in. With no "
        "subcommand: its size, backend and the ranks' pids."))
    sub = line.add_subparsers(dest="command", parser_class=_Parser)
    start = sub.add_parser("start", help="(re)start the world with NPROCS ranks (on "
                                         "each node)")
    start.add_argument("nprocs", nargs="?", type=int, default=None,
                       help=f"number of ranks, on each node with --nodes (default: the "
                            f"last size, else {DEFAULT_NPROCS})")
    start.add_argument("--nodes", type=int, default=None, metavar="M",
                       help="run NPROCS ranks on each of M nodes of this SLURM "
                            "allocation (or Ray cluster: --scheduler ray), NPROCS * M in "
                            "all (default 1)")
    start.add_argument("--scheduler", default=None, choices=("slurm", "ray"),
                       help="with --nodes: where the nodes come from: slurm (this "
                            "allocation, the default) or ray (the Ray cluster this kernel "
                            "is connected to: ray.init(address=...) or RAY_ADDRESS)")
    start.add_argument("--master-addr", default=None,
                       help="with --nodes: this machine's address that the nodes reach "
                            "(default: its host name's)")
    start.add_argument("--backend", "-b", default=None,
                       help="init_process_group backend of each rank: gloo (the default "
                            "where torch is installed), nccl, ..., or none")
    start.add_argument("--timeout", type=float, default=None,
                       help="seconds a cell may run before every rank's stack is shown "
                            "and its ranks interrupted (default: none)")
    start.add_argument("--grace-period", type=float, default=None,
                       help="seconds between SIGTERM and SIGKILL at teardown")
    start.add_argument("--no-heal", dest="heal", action="store_false", default=None,
                       help="tear the world down after any failed cell instead of "
                            "keeping its ranks and their state")
    start.add_argument("--log-dir", default=None,
                       help="also write each rank's output to files in this directory")
    start.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                       help="an environment variable for every rank (repeatable)")
    placement_flags(start)
    sub.add_parser("stop", help="end every rank")
    sub.add_parser("restart", help="end the ranks and start fresh ones, same settings")
    push = sub.add_parser("push", help="copy notebook variables into every rank's "
                                       "namespace")
    push.add_argument("names", nargs="+")
    pull = sub.add_parser("pull", help="a variable of the ranks' namespace, as a list "
                                       "by rank")
    pull.add_argument("name")
    sub.add_parser("stacks", help="where each rank is now (every thread's innermost "
                                  "frames, grouped), without stopping anything")
    cell = _Parser(prog="%%ranks", description="Run the cell in every rank.")
    cell.add_argument("--timeout", type=float, default=None,
                      help="seconds this cell may run (default: the world's)")
    placement_flags(cell, " (the world is restarted with it if it differs)")
    return line, cell


def _placement(args, command: str) -> Dict[str, Any]:
    from ._placement_flags import placement_settings
    try:
        return placement_settings(args, command)
    except ValueError as exc:
        raise _Usage(str(exc)) from None


def _default_backend() -> Optional[str]:
    # find_spec, not import: importing torch in the kernel takes seconds, and the
    # ranks import it in their server anyway.
    return "gloo" if importlib.util.find_spec("torch") is not None else None


class _Ranks:
    """A shell's world, and the magics' state around it."""

    def __init__(self, shell):
        self.shell = shell
        self.world = None
        self.settings: Dict[str, Any] = {"nprocs": DEFAULT_NPROCS,
                                         "backend": _default_backend()}
        # Why the next cell starts fresh ranks (said in its output), if it does.
        self.torn_down: Optional[str] = None
        self._cells = 0

    def magic(self, line: str, cell: Optional[str] = None):
        """Run code in every rank of a world that stays up between cells.

        ``%%ranks`` runs the cell in every rank (a world of 2 ranks with the gloo
        backend is started on first use); names it defines stay in each rank for the
        next ``%%ranks`` cell. Each rank's output shows, prefixed, under the cell; the
        first failure is raised in the cell and the world heals (its ranks and names
        stay; the stop button interrupts every rank); what cannot be healed is torn
        down and the next cell starts fresh ranks. ``%%ranks --timeout S`` limits one.

        ``%ranks start [N] [--backend B] [--timeout S] [--grace-period S] [--no-heal]
        [--log-dir D] [--env NAME=VALUE]``, ``%ranks stop``, ``%ranks restart``,
        ``%ranks push NAME...``, ``%ranks pull NAME`` (a list by rank), ``%ranks
        stacks`` (where each rank is now), and ``%ranks`` (status). ``%ranks --help`` and ``%ranks start --help`` list the options.
        """
        __tracebackhide__ = True  # noqa: F841 - IPython leaves our frames out
        import shlex
        line_parser, cell_parser = _parsers()
        try:
            if cell is None:
                return self._line(line_parser.parse_args(shlex.split(line)))
            return self._cell(cell_parser.parse_args(shlex.split(line)), line, cell)
        except _Done:
            return None
        except _Usage as exc:
            from IPython.core.error import UsageError
            raise UsageError(str(exc)) from None

    # -- %ranks ----------------------------------------------------------------------
    def _line(self, args: argparse.Namespace):
        if args.command is None:
            print(self.status())
        elif args.command == "start":
            self.start(args)
        elif args.command == "stop":
            self.stop()
        elif args.command == "restart":
            self.stop(quiet=True)
            self._start_world("restarted")
        elif args.command == "push":
            self.push(args.names)
        elif args.command == "pull":
            return self.pull(args.name)
        elif args.command == "stacks":
            print(self.world.stacks() if self.world is not None and self.world.pids
                  else "no rank is running")
        return None

    def status(self) -> str:
        s = self.settings
        what = (f"{_ranks(s['nprocs'], s.get('nnodes') or 1)}, backend "
                f"{s['backend'] or 'none'}")
        if self.world is not None and self.world.pids:
            from ._placement_flags import placement_lines
            fresh = self.world.fresh_ranks   # replaced: their names are gone
            return (f"{what}: up, pids {self.world.pids}\n" + (
                f"fresh since the last cell: ranks {fresh}\n" if fresh else "")
                + placement_lines(self.world))
        if self.torn_down:
            return f"{what}: torn down ({self.torn_down}); the next %%ranks cell starts " \
                   "fresh ranks"
        return f"{what}: not started; the next %%ranks cell starts them"

    def start(self, args: argparse.Namespace) -> None:
        settings = dict(self.settings)
        if args.nprocs is not None:
            if args.nprocs < 1:
                raise _Usage(f"%ranks start: NPROCS must be at least 1, got {args.nprocs}")
            settings["nprocs"] = args.nprocs
        if args.backend is not None:
            settings["backend"] = None if args.backend.lower() == "none" else args.backend
        if args.nodes is not None:
            if args.nodes < 1:
                raise _Usage(f"%ranks start: --nodes must be at least 1, got {args.nodes}")
            settings["nnodes"] = args.nodes
        for key in ("timeout", "grace_period", "log_dir", "heal", "master_addr",
                    "scheduler"):
            value = getattr(args, key)
            if value is not None:
                settings[key] = value
        settings.update(_placement(args, "%ranks start"))
        if "gpus" in settings and isinstance(settings["gpus"], list) \
                and args.nprocs is None:
            settings["nprocs"] = len(settings["gpus"])
        if args.env:
            env = {}
            for item in args.env:
                name, sep, value = item.partition("=")
                if not sep or not name:
                    raise _Usage(f"%ranks start: --env takes NAME=VALUE, got {item!r}")
                env[name] = value
            settings["env"] = env
        self.stop(quiet=True)
        self.settings = settings
        self._start_world("started")

    def stop(self, quiet: bool = False) -> None:
        world, self.world = self.world, None
        self.torn_down = None
        if world is None:
            if not quiet:
                print("%ranks: no world is up")
            return
        n = len(world.pids)
        world.close()
        if not quiet:
            print(f"%ranks: stopped {n} ranks" if n else "%ranks: stopped")

    def push(self, names: List[str]) -> None:
        namespace = self.shell.user_ns
        missing = [n for n in names if n not in namespace]
        if missing:
            raise _Usage(f"%ranks push: not defined in the notebook: {', '.join(missing)}")
        self._run(cells.push, ({n: namespace[n] for n in names},), None)

    def pull(self, name: str) -> list:
        try:
            answers = self._run(cells.pull, (name,), None)
        except WorkerError as err:
            # The ranks answered, but the kernel could not rebuild what one sent (a
            # DistributedDataParallel module needs a process group): no rank raised, and
            # the world is as it was. The pickles, rebuilt here, say why.
            if not (_not_rebuilt(err) and self.world is not None and self.world.pids):
                raise
            answers = None
        if answers is None:
            answers = self._run(cells.pull, (name, True), None)
        missing = [rank for rank, (state, _) in enumerate(answers) if state == "missing"]
        if missing:
            raise _Usage(f"%ranks pull: {name!r} is not defined in rank(s) "
                         f"{', '.join(map(str, missing))}")
        for rank, (state, reason) in enumerate(answers):
            if state == "unpicklable":
                raise _Usage(f"%ranks pull: rank {rank}'s {name!r} cannot be pickled "
                             f"({reason}); pull something derived from it")
        return [_rebuilt(name, rank, value) if state == "pickled" else value
                for rank, (state, value) in enumerate(answers)]

    # -- %%ranks ---------------------------------------------------------------------
    def _cell(self, args: argparse.Namespace, line: str, body: str) -> None:
        __tracebackhide__ = True  # noqa: F841
        self._cells += 1
        shown = f"%%{_MAGIC}{' ' if line.strip() else ''}{line.strip()}\n{body}"
        filename = self._register(shown)
        # Compiled here first: a syntax error shows at once, and spends no world.
        try:
            cells.cell_code(filename, shown, 1, body)
        except SyntaxError as exc:
            error = exc
        else:
            error = None
        if error is not None:
            raise error.with_traceback(None)  # the cell's line, not ours or ast's
        placement = _placement(args, "%%ranks")
        if any(self.settings.get(k) != v for k, v in placement.items()):
            self.settings.update(placement)
            if isinstance(placement.get("gpus"), list):
                self.settings["nprocs"] = len(placement["gpus"])
            self.stop(quiet=True)   # the next _run starts ranks placed so
        self._run(exec, (cells.Cell(filename, shown, 1, body), cells.MainNamespace()), args.timeout,
                  cell=filename)

    def _notebook_name(self, err: BaseException) -> Optional[str]:
        """For a NameError of a cell whose name is one of the notebook's own variables
        (not IPython's): what to do about it, since the ranks have their own names."""
        import re
        import types
        match = re.fullmatch(r"name '(\w+)' is not defined", str(err))
        if not isinstance(err, NameError) or match is None or self.shell is None:
            return None
        name = match[1]
        namespace = self.shell.user_ns
        hidden = getattr(self.shell, "user_ns_hidden", {})
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

    def _register(self, shown: str) -> str:
        """The file name the cell's code is compiled under, its lines in linecache being
        the cell as shown.

        For a cell that is just ``%%ranks`` (as typed in a notebook), the running cell's
        own name: IPython labels its frames "Cell In[7], line 3" from that name, so the
        rank's frames read as the cell's own. IPython's entry for it holds the one line
        of transformed code (``get_ipython().run_cell_magic(...)``); the cell as shown
        replaces it. Called from other code, a name of our own."""
        transformed = f"get_ipython().run_cell_magic('{_MAGIC}',"
        frame = sys._getframe(1)
        while frame is not None:
            name = frame.f_code.co_filename
            entry = linecache.cache.get(name)
            if (entry is not None and len(entry) == 4 and entry[1] is None
                    and len(entry[2]) == 1
                    and entry[2][0].startswith(transformed)):
                break
            frame = frame.f_back
        else:
            name = f"<%%{_MAGIC} cell {self._cells}>"
        linecache.cache[name] = (len(shown), None, shown.splitlines(True), name)
        return name

    # -- the world ---------------------------------------------------------------------
    def _start_world(self, verb: str) -> None:
        from ._world import World
        s = dict(self.settings)
        nprocs, backend = s.pop("nprocs"), s.pop("backend")
        world = World(nprocs, backend=backend, **s)
        world._send_hint = "To send the notebook's value: %ranks push {name}"
        world.start()
        self.world, self.torn_down = world, None
        names = [n["name"] for n in world.nodes]
        print(f"%ranks: {verb} {_ranks(world.nprocs, world.nnodes, names)}, backend "
              f"{backend or 'none'}: pids {world.pids}")

    def _run(self, func, args: tuple, timeout: Optional[float],
             cell: Optional[str] = None):
        """`func(*args)` in every rank; `cell`: the file name of the %%ranks cell it
        runs."""
        __tracebackhide__ = True  # noqa: F841
        if self.world is None or not self.world.pids:
            if self.torn_down:
                print(f"%ranks: the world was torn down ({self.torn_down}); starting "
                      "fresh ranks")
            self.stop(quiet=True)
            self._start_world("started")
        world = self.world
        try:
            return world.run(func, args, timeout=timeout)
        except (WorkerError, LaunchTimeout, MainProcessError) as err:
            failure = err
        if not world.pids:
            self.torn_down = _why(failure)
        # Out of the except block, so that it carries no __context__ of ours. The error
        # says why, and what became of the ranks.
        raise _shown(failure, world.size, cell, bool(world.pids), world.nnodes > 1,
                     self._notebook_name if cell else None)


def _ranks(nprocs: int, nnodes: int, names=()) -> str:
    """'2 ranks'; across nodes, the total and how many on each node (NPROCS counts one
    node's): '4 ranks on 2 nodes (n1, n2), 2 on each'."""
    if nnodes == 1:
        return f"{nprocs} ranks"
    named = f" ({', '.join(names)})" if names else ""
    return f"{nprocs * nnodes} ranks on {nnodes} nodes{named}, {nprocs} on each"


def _why(err: BaseException) -> str:
    if isinstance(err, LaunchTimeout):
        return "a cell ran past its timeout"
    if isinstance(err, WorkerError):
        return f"rank {err.rank} failed"
    if isinstance(err, MainProcessError):
        return f"the kernel received {err.signal_name}"
    return type(err).__name__


def _shown(err: BaseException, size: int, cell: Optional[str], kept=False,
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


def _not_rebuilt(err: WorkerError) -> bool:
    """Whether every failure of `err` is a value the kernel could not rebuild: the rank
    raised nothing (no traceback), the kernel's unpickling did."""
    return all(f.exc_type is not None and f.traceback is None and f.signal is None
               for f in err.failures)


def _rebuilt(name: str, rank: int, answer) -> Any:
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
        raise _Usage(f"{text}. A {what['type']} can be rebuilt only inside a process "
                     "group, and the kernel is in none: pull the module it wraps, or its "
                     f"weights. In a %%ranks cell: net = {name}.module (or weights = "
                     f"{name}.module.state_dict()), then %ranks pull net")
    if what["module"]:
        raise _Usage(f"{text}. Pull its weights: in a %%ranks cell, weights = "
                     f"{name}.state_dict(), then %ranks pull weights")
    raise _Usage(f"{text}; pull something derived from it")
