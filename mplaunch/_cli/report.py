"""What the mplaunch command says when a launch fails: one summary on stderr, pointing at
a traceback that was relayed rather than repeating it, and the exit code a shell would
report for the failing rank."""
from __future__ import annotations

import os
import sys
from typing import List, Optional

from .._engine.config import node_layout
from .._engine.screen import lines_above

def say(text: str) -> None:
    lines = text.rstrip("\n").split("\n")
    try:
        # A rank's progress bar may be drawn (SIGUSR1 comes while ranks run): the
        # message goes on lines of its own, not after the bar.
        with lines_above():
            sys.stderr.write("".join(f"mplaunch: {line}\n" for line in lines))
            sys.stderr.flush()
    except (OSError, ValueError):
        pass


def exit_code_of(failure) -> int:
    """The command's exit code for a rank's failure, as a shell would report it."""
    code = failure.exitcode
    if code is None or code == 0:
        return 1  # torn down, or left without a result: still a failure
    if code < 0:
        return 128 + (-code)
    return code if code < 256 else 1


def _tail_of(failure, max_lines: int = 40) -> str:
    # The traceback was cut out of the stderr tail (launch raises it as __cause__ for
    # Python callers); here the tail is all the user gets, so it goes back in.
    tb = failure.traceback if failure.exc_type != "SystemExit" else None
    parts = [t.rstrip("\n") for t in (failure.stderr_tail, tb) if t]
    if not parts:
        return ""
    lines = "\n".join(parts).split("\n")
    if tb and len(lines) > max_lines:
        lines = ["..."] + lines[-max_lines:]
    return "\n".join(lines)


def _raised_at(tb: str) -> List[str]:
    """The innermost frame of a traceback's last exception: its 'File "...", line N, in
    f' line and the source line under it, as Python printed them (so that terminals and
    editors still recognise them)."""
    lines = tb.rstrip("\n").split("\n")
    for i in range(len(lines) - 1, -1, -1):
        head = lines[i].lstrip(" |")  # exception groups draw their frames with '|'
        if not head.startswith('File "'):
            continue
        out = ["  " + head]
        if i + 1 < len(lines):
            source = lines[i + 1].lstrip(" |")
            deeper = len(lines[i + 1]) - len(source) > len(lines[i]) - len(head)
            if deeper and source and not set(source) <= set("^~ "):
                out.append("    " + source)
        return out
    return []


class Shown:
    """What this command's own terminal already showed of a rank: whether a failing
    rank's stderr was relayed here (its traceback with it), under which prefix, and
    where its log file is."""

    def __init__(self, relay: bool = False, ranks_filter=None, node_rank: int = 0,
                 prefix: str = "", log_dir: Optional[str] = None):
        self.relay, self.node_rank, self.prefix = relay, node_rank, prefix
        self.ranks_filter = None if ranks_filter is None else set(ranks_filter)
        self.log_dir = log_dir

    @classmethod
    def for_command_line(cls, ns) -> "Shown":
        from .._engine.config import DEFAULT_PREFIX
        return cls(relay=ns.relay, ranks_filter=ns.ranks_filter,
                   node_rank=_this_node(ns),
                   prefix=DEFAULT_PREFIX if ns.prefix is None else ns.prefix,
                   log_dir=ns.log_dir)

    def here(self, failure) -> bool:
        return failure.node_rank == self.node_rank

    def relayed(self, failure) -> bool:
        return (self.relay and self.here(failure)
                and (self.ranks_filter is None or failure.local_rank in self.ranks_filter))

    def prefix_of(self, failure) -> str:
        import socket
        try:
            return self.prefix.format(rank=failure.rank, local_rank=failure.local_rank,
                                      node_rank=failure.node_rank,
                                      host=failure.hostname or socket.gethostname())
        except (KeyError, IndexError, ValueError):
            return ""

    def log_of(self, failure) -> Optional[str]:
        if self.log_dir is None or not self.here(failure):
            return None
        return os.path.join(self.log_dir, f"attempt_{failure.attempt}",
                            str(failure.local_rank), "stderr.log")


def _this_node(ns) -> int:
    # As launch() decided it: the option, else SLURM's layout inside an srun step.
    return node_layout(ns.nnodes, ns.node_rank, ns.master_addr, ns.master_port)[1]


def _where_to_look(failure, shown: Shown) -> List[str]:
    """For a rank whose traceback was just relayed here line by line: where it is, and
    where the exception was raised, instead of the traceback again."""
    prefix = shown.prefix_of(failure).rstrip()
    where = f"rank {failure.rank}'s traceback is above"
    if prefix:
        where += f" (lines starting {prefix!r})"
    log = shown.log_of(failure)
    if log:
        where += f" and in {log}"
    at = _raised_at(failure.traceback)
    return [where + ("; raised at:" if at else "")] + at


def report_failure(err, code: int, shown: Optional[Shown] = None) -> None:
    shown = shown or Shown()
    first = err.failures[0]
    lines = [f"{first.describe()}{' ' + err.note if err.note else ''}; exiting with {code}"]
    others = err.failures[1:]
    if others:
        lines.append(f"{len(others)} more rank(s) failed after it: "
                     + "; ".join(f.describe() for f in others[:8])
                     + (" ..." if len(others) > 8 else ""))
    for attempt in err.previous_attempts:
        if attempt:
            lines.append(f"earlier attempt {attempt[0].attempt}: "
                         + "; ".join(f.describe() for f in attempt[:4]))
    if first.traceback and first.exc_type != "SystemExit" and shown.relayed(first):
        # The rank printed its traceback as it raised, and it was relayed here: a second
        # copy right under the first only pushes the first off the screen.
        lines.extend(_where_to_look(first, shown))
    else:
        tail = _tail_of(first)
        if tail:
            lines.append(f"last lines of rank {first.rank}'s stderr:")
            lines.extend("  " + line for line in tail.split("\n"))
            log = shown.log_of(first)
            if log:
                lines.append(f"all of it is in {log}")
    say("\n".join(lines))


def flush_stdout() -> None:
    try:
        sys.stdout.flush()
    except (OSError, ValueError):
        # The reader went away (mplaunch ... | head): say nothing more there, and keep
        # the interpreter's final flush from failing too.
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            os.close(devnull)
        except (OSError, ValueError):
            pass


def print_stacks() -> None:
    """Where each rank of the launches running now is (the command's SIGUSR1)."""
    from .._engine.run import running
    runs = running()
    if not runs:
        say("SIGUSR1: no rank is running")
    for run in runs:
        say("SIGUSR1: where each rank is now (the launch goes on)\n" + str(run.stacks()))
