"""The ``%ranks`` and ``%%ranks`` IPython magics: one :class:`mplaunch.World` per shell,
and cells whose code runs in every rank of it.

``%load_ext mplaunch`` calls :func:`load_ipython_extension`. ``import mplaunch`` imports
this module, so it imports nothing at module level that a launch does not need (IPython,
argparse, ast): those come when a magic runs.

A ``%%ranks`` cell runs in each rank's ``__main__`` namespace: the names it defines are
there for the next cell and for ``%ranks pull``, and a class defined in a cell pickles
by reference there, as it would in a script (``torch.save(model)``, DataLoader
workers). The notebook's own names are not sent: ``%ranks push`` copies chosen ones, as
ipyparallel's ``push`` does. docs/notebooks.rst describes what users see; what a failed
cell or pull shows is made in mplaunch._magic_errors.

The magics parse their flags into World's arguments and let World check them: a bad
one is World's own error, shown as a usage error, and the world that was up stays up
(the new one is made, and so checked, before the old one stops). ``--scheduler`` offers
the schedulers the engine has registered. Rejected: checking here what World checks
(sizes, GPU lists, nodes, scheduler names), a second copy of each rule that drifted
from the first.
"""
from __future__ import annotations

import importlib.util
import linecache
import sys
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

from ._magic_errors import (Usage, not_rebuilt, notebook_name_note, rebuilt, shown_error,
                            why_torn_down)
from ._rank import cells
from .errors import LaunchTimeout, MainProcessError, WorkerError

if TYPE_CHECKING:   # annotations only: argparse is imported when a magic runs
    import argparse

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


# -- the notebook's side -----------------------------------------------------------------

class _Done(Exception):
    """--help was printed."""


def _parsers() -> Tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    import argparse

    from ._engine.nodes import schedulers
    from ._placement_flags import placement_flags

    class _Parser(argparse.ArgumentParser):
        def error(self, message):
            raise Usage(f"{self.prog}: {message}")

        def exit(self, status=0, message=None):
            if message:
                raise Usage(message)
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
    start.add_argument("--nodes", dest="nnodes", type=int, default=None, metavar="M",
                       help="run NPROCS ranks on each of M nodes (of this allocation, or "
                            "those --scheduler places), NPROCS * M in all (default 1)")
    start.add_argument("--scheduler", default=None, choices=schedulers.names(),
                       help=f"with --nodes: the scheduler the nodes come from (default: "
                            f"{schedulers.DEFAULT}, the allocation this kernel runs in)")
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
    debug = sub.add_parser("debug", help="pdb at the frame that raised the last cell's "
                                         "error, in the rank that raised it")
    debug.add_argument("rank", nargs="?", type=int, default=None,
                       help="the rank to open (default: the first whose error it was)")
    report = sub.add_parser("report", help="who the others waited for in the last cell: "
                                           "per rank, how often it started a "
                                           "collective last, and how late")
    report.add_argument("--trace", metavar="PATH", default=None,
                        help="also write the cell's collectives as a Perfetto trace")
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
        raise Usage(str(exc)) from None


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
        stacks`` (where each rank is now), ``%ranks debug [RANK]`` (pdb at the last
        cell's error in that rank), ``%ranks report [--trace PATH]`` (who the others
        waited for in the last cell), and ``%ranks`` (status). ``%ranks --help``
        and ``%ranks start --help`` list the options.
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
        except Usage as exc:
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
            self._start_world("restarted")
        elif args.command == "push":
            self.push(args.names)
        elif args.command == "pull":
            return self.pull(args.name)
        elif args.command == "stacks":
            print(self.world.stacks() if self.world is not None and self.world.pids
                  else "no rank is running")
        elif args.command == "report":
            if self.world is None or not self.world.pids:
                raise Usage("no rank is running: %ranks report is about the last cell")
            try:
                report = self.world.report()
            except RuntimeError as exc:
                raise Usage(str(exc)) from None
            if args.trace:
                report.trace(args.trace)
            return report
        elif args.command == "debug":
            if self.world is None or not self.world.pids:
                raise Usage("no rank is running: %ranks debug opens the last cell's "
                            "error in the rank that raised it")
            try:
                self.world.debug(args.rank)
            except (RuntimeError, ValueError) as exc:
                raise Usage(str(exc)) from None
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
        if args.backend is not None:
            settings["backend"] = None if args.backend.lower() == "none" else args.backend
        for key in ("nprocs", "nnodes", "timeout", "grace_period", "log_dir", "heal",
                    "master_addr", "scheduler"):
            value = getattr(args, key)
            if value is not None:
                settings[key] = value
        settings.update(_placement(args, "%ranks start"))
        if args.nprocs is None:
            _sized_by_gpus(settings)
        if args.env:
            env = {}
            for item in args.env:
                name, sep, value = item.partition("=")
                if not sep or not name:
                    raise Usage(f"%ranks start: --env takes NAME=VALUE, got {item!r}")
                env[name] = value
            settings["env"] = env
        self._start_world("started", settings)

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
            raise Usage(f"%ranks push: not defined in the notebook: {', '.join(missing)}")
        self._run(cells.push, ({n: namespace[n] for n in names},), None)

    def pull(self, name: str) -> list:
        try:
            answers = self._run(cells.pull, (name,), None)
        except WorkerError as err:
            # The ranks answered, but the kernel could not rebuild what one sent (a
            # DistributedDataParallel module needs a process group): no rank raised, and
            # the world is as it was. The pickles, rebuilt here, say why.
            if not (not_rebuilt(err) and self.world is not None and self.world.pids):
                raise
            answers = None
        if answers is None:
            answers = self._run(cells.pull, (name, True), None)
        missing = [rank for rank, (state, _) in enumerate(answers) if state == "missing"]
        if missing:
            raise Usage(f"%ranks pull: {name!r} is not defined in rank(s) "
                         f"{', '.join(map(str, missing))}")
        for rank, (state, reason) in enumerate(answers):
            if state == "unpicklable":
                raise Usage(f"%ranks pull: rank {rank}'s {name!r} cannot be pickled "
                             f"({reason}); pull something derived from it")
        return [rebuilt(name, rank, value) if state == "pickled" else value
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
            settings = dict(self.settings, **placement)
            if "gpus" in placement:
                _sized_by_gpus(settings)
            self._start_world("started", settings, "%%ranks")   # ranks placed so
        self._run(exec, (cells.Cell(filename, shown, 1, body), cells.MainNamespace()), args.timeout,
                  cell=filename)

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
    def _start_world(self, verb: str, settings: Optional[Dict[str, Any]] = None,
                     command: str = "%ranks start") -> None:
        """Start a world of `settings` (else the last ones) in place of the current one,
        which stops only once World has taken them: a bad one is a usage error of
        `command`, and the world stays as it was."""
        s = dict(self.settings if settings is None else settings)
        nprocs, backend = s.pop("nprocs"), s.pop("backend")
        try:
            world = _notebook_world(nprocs, backend=backend, **s)
        except (TypeError, ValueError) as exc:
            raise Usage(f"{command}: {exc}") from None
        self.stop(quiet=True)
        # The size World made of them (one rank per GPU of a list): the next start's.
        self.settings = dict(s, nprocs=world.nprocs, backend=backend)
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
            self._start_world("started")
        world = self.world
        try:
            return world.run(func, args, timeout=timeout)
        except (WorkerError, LaunchTimeout, MainProcessError) as err:
            failure = err
        if not world.pids:
            self.torn_down = why_torn_down(failure)
        # Out of the except block, so that it carries no __context__ of ours. The error
        # says why, and what became of the ranks.
        raise shown_error(failure, world.size, cell, bool(world.pids), world.nnodes > 1,
                          (lambda exc: notebook_name_note(self.shell, exc)) if cell
                          else None)


def _sized_by_gpus(settings: Dict[str, Any]) -> None:
    """Where `settings` list the ranks' GPUs and no NPROCS was given, World makes one
    rank per GPU listed: it counts them, not the magic."""
    if isinstance(settings.get("gpus"), list):
        settings["nprocs"] = None


_NotebookWorld = None


def _notebook_world(*args, **kwargs):
    """A World whose warning about a name the ranks kept says ``%ranks push NAME``: a
    subclass overriding World's class attribute, made at the first world (loading the
    extension imports no launching side). Rejected: writing World's private attribute
    from here, and a private keyword of World's (it would show in its documented
    signature, or be one more option to take out before World's checks)."""
    global _NotebookWorld
    if _NotebookWorld is None:
        from ._world import World

        class NotebookWorld(World):
            _send_hint = "To send the notebook's value: %ranks push {name}"
        _NotebookWorld = NotebookWorld
    return _NotebookWorld(*args, **kwargs)


def _ranks(nprocs: int, nnodes: int, names=()) -> str:
    """'2 ranks'; across nodes, the total and how many on each node (NPROCS counts one
    node's): '4 ranks on 2 nodes (n1, n2), 2 on each'."""
    if nnodes == 1:
        return f"{nprocs} ranks"
    named = f" ({', '.join(names)})" if names else ""
    return f"{nprocs * nnodes} ranks on {nnodes} nodes{named}, {nprocs} on each"
