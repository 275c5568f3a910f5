"""The errors mplaunch raises.

Every error carries its facts as attributes, reads well as ``str()``, and survives a
pickle round trip (so it can cross a process boundary again, e.g. from a pytest-xdist
worker or a rank of an outer launch).
"""
from __future__ import annotations

import signal as _signal
from typing import Dict, List, Optional

from ._wire import stacks as _stacks

__all__ = [
    "MPLaunchError",
    "WorkerError",
    "MainProcessError",
    "LaunchTimeout",
    "RankFailure",
    "RemoteException",
]


def signal_name(signo: Optional[int]) -> Optional[str]:
    """'SIGSEGV' for 11; None for None; 'signal 77' for numbers with no name."""
    if signo is None:
        return None
    try:
        return _signal.Signals(signo).name
    except ValueError:
        return f"signal {signo}"


class MPLaunchError(Exception):
    """Base class of the errors mplaunch raises about a launch (not about bad input,
    which raises the builtin ``TypeError``/``ValueError`` before any process starts)."""

    __module__ = "mplaunch"


class RankFailure:
    """What is known about one failed rank: a plain record, one per failing rank.

    ``exitcode`` is the process exit code (negative for a signal, as in
    :attr:`multiprocessing.Process.exitcode`); ``signal`` its name ("SIGSEGV") or None;
    ``exc_type`` and ``message`` describe the exception the rank raised (None if it
    raised none); ``traceback`` is the worker's formatted traceback text, and
    ``location`` where in the user's code it raised ("train.py:7 in train");
    ``stderr_tail`` the last lines the rank wrote to stderr; ``attempt`` the restart
    attempt of a launch with ``max_restarts`` (0 for the first run, and always for a
    :class:`~mplaunch.World`'s ranks, whose calls are never tried again); ``timestamp`` when the failure was observed
    (``time.time()`` in the worker when it raised, else in the parent); ``max_rss`` the
    rank's peak resident memory in bytes, once its process was reaped (None while it
    was not, or for a failure of no process). For a rank killed by a signal,
    ``message`` says what is known of why (the kernel's OOM killer, when it says so).
    ``released`` is set for a rank of a :class:`~mplaunch.World` that failed only
    because the World ended the call (another rank failed, Ctrl-C, the timeout): how,
    "released from torch.distributed.all_reduce" or "interrupted"; its exception
    (gloo's lost connection, KeyboardInterrupt) is that ending's, not its own error.
    """

    __module__ = "mplaunch"
    __slots__ = (
        "rank", "pid", "exitcode", "signal", "exc_type", "message", "traceback",
        "stderr_tail", "attempt", "timestamp", "local_rank", "node_rank", "hostname",
        "max_rss", "released",
    )

    def __init__(self, rank, pid=None, exitcode=None, signal=None, exc_type=None,
                 message=None, traceback=None, stderr_tail=None, attempt=0,
                 timestamp=None, local_rank=None, node_rank=0, hostname=None,
                 max_rss=None, released=None):
        self.rank = rank
        self.pid = pid
        self.exitcode = exitcode
        self.signal = signal
        self.exc_type = exc_type
        self.message = message
        self.traceback = traceback
        self.stderr_tail = stderr_tail
        self.attempt = attempt
        self.timestamp = timestamp
        self.local_rank = rank if local_rank is None else local_rank
        self.node_rank = node_rank
        self.hostname = hostname
        self.max_rss = max_rss
        self.released = released   # last: pickles made before it existed still load

    def __reduce__(self):
        return (RankFailure, tuple(getattr(self, k) for k in self.__slots__))

    def __eq__(self, other):
        if not isinstance(other, RankFailure):
            return NotImplemented
        return all(getattr(self, k) == getattr(other, k) for k in self.__slots__)

    __hash__ = None  # mutable record

    def describe(self) -> str:
        """One line: what happened to this rank. For an exception: its type, the first
        line of its message, where it was raised (:attr:`location`) and, for
        ``SystemExit``, the exit code; for a rank the World ``released``: how, and
        where."""
        who = f"rank {self.rank}"
        if self.pid is not None:
            who += f" (pid {self.pid}"
            if self.hostname:
                who += f" on {self.hostname}"
            who += ")"
        if self.released:
            where = self.location
            what = f"was {self.released}" + (f" at {where}" if where else "")
        elif self.exc_type is not None:
            what = f"raised {self.exc_type}"
            head = _first_line(self.message)[0]
            if head:
                what += f": {head}"
            where = self.location
            facts = [f"exit code {self.exitcode}"] if self.exc_type == "SystemExit" else []
            if where:
                facts.append(f"at {where}")
            if facts:
                what += f" ({', '.join(facts)})"
        elif self.signal is not None:
            what = f"was killed by {self.signal} (exit code {self.exitcode}"
            if self.max_rss is not None:
                what += f", peak RSS {_size(self.max_rss)}"
            what += ")"
            if self.message:
                what += f": {self.message}"
        elif self.message:
            what = self.message
        else:
            what = f"exited with code {self.exitcode}"
        if self.attempt:
            what += f" [attempt {self.attempt}]"
        return f"{who} {what}"

    __str__ = describe

    @property
    def location(self) -> Optional[str]:
        """'train.py:7 in train': where the rank raised, read from its traceback (the
        innermost frame of the user's code; see ``describe``); None without one."""
        site = _stacks.failure_site(self.traceback)
        if site is None:
            return None
        file, line, func = site
        return f"{_stacks.short_path(file)}:{line} in {func}"

    def __repr__(self):
        return f"<RankFailure {self.describe()}>"


class WorkerError(MPLaunchError):
    """A rank failed: it raised, exited non-zero, was killed by a signal, or exited
    without returning a result.

    The first failure (by time) is described by the attributes ``rank``
    (also ``worker_id``), ``pid``, ``exitcode``, ``signal`` (a name such as "SIGSEGV",
    or None), ``traceback`` (the worker's traceback text, or None) and
    ``stderr_tail``. ``failures`` lists every rank that failed, first first, as
    :class:`RankFailure` records; ``previous_attempts`` holds the failures of earlier
    attempts when ``max_restarts`` was used.

    When the rank raised, ``__cause__`` is the worker's own exception, rebuilt with its
    type, message, traceback frames, ``__cause__`` and ``__context__`` (or a
    :class:`RemoteException` standing in for one that could not be pickled), so a
    debugger or pytest shows where the worker failed. Catch it around
    :func:`mplaunch.launch` and inspect ``err.__cause__`` or ``err.failures``.
    """

    __module__ = "mplaunch"

    #: Set by a healing :class:`mplaunch.World`: what the world kept (or why it could
    #: not), also the message's last line; None otherwise.
    healed: Optional[str] = None

    def __init__(self, failures: List[RankFailure], previous_attempts=None, note=None):
        if not failures:
            raise ValueError("WorkerError needs at least one RankFailure")
        self.failures = list(failures)
        self.previous_attempts: List[List[RankFailure]] = list(previous_attempts or [])
        self.note = note
        super().__init__(self._message())

    @property
    def first(self) -> RankFailure:
        return self.failures[0]

    rank = property(lambda self: self.first.rank)
    worker_id = property(lambda self: self.first.rank)
    pid = property(lambda self: self.first.pid)
    exitcode = property(lambda self: self.first.exitcode)
    signal = property(lambda self: self.first.signal)
    traceback = property(lambda self: self.first.traceback)
    stderr_tail = property(lambda self: self.first.stderr_tail)
    exc_type = property(lambda self: self.first.exc_type)

    def __str__(self) -> str:
        text = super().__str__()
        return f"{text}\n[mplaunch.World] {self.healed}" if self.healed else text

    def _message(self) -> str:
        first = self.first
        lines = [first.describe()]
        if self.note:
            lines[0] += f" {self.note}"
        if first.exc_type is not None:
            # describe() keeps to the message's first line; the rest is said here.
            lines.extend(_first_line(first.message)[1])
        others = [f for f in self.failures[1:] if not f.released]
        if others:
            lines.append(f"{len(others)} more rank(s) failed after it: "
                         + "; ".join(f.describe() for f in others[:8])
                         + (" ..." if len(others) > 8 else ""))
        released = [f for f in self.failures[1:] if f.released]
        if released:
            lines.append(_released_line(released))
        for i, attempt in enumerate(self.previous_attempts):
            if attempt:
                lines.append(f"earlier attempt {attempt[0].attempt}: "
                             + "; ".join(f.describe() for f in attempt[:4]))
        if first.stderr_tail:
            lines.append(f"--- last lines of rank {first.rank}'s stderr ---")
            lines.append(first.stderr_tail.rstrip("\n"))
        return "\n".join(lines)

    def __reduce__(self):
        return (_rebuild_worker_error,
                (type(self), self.failures, self.previous_attempts, self.note,
                 self.__dict__))


def _released_line(failures: List[RankFailure]) -> str:
    """One line for the ranks a World's release or interrupt ended (they raised only
    because of it), those at the same place together: "mplaunch ended the call in 3
    other rank(s): ranks 0, 2, 3 released from torch.distributed.all_reduce at
    train.py:42 in step"."""
    places: Dict[tuple, List[int]] = {}
    for f in failures:
        places.setdefault((f.released, f.location), []).append(f.rank)
    said = []
    for (how, where), ranks in list(places.items())[:8]:
        who = (f"rank {ranks[0]}" if len(ranks) == 1
               else "ranks " + ", ".join(str(r) for r in sorted(ranks)))
        said.append(f"{who} {how}" + (f" at {where}" if where else ""))
    more = " ..." if len(places) > 8 else ""
    return (f"mplaunch ended the call in {len(failures)} other rank(s): "
            f"{'; '.join(said)}{more}")


def _size(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB"):
        if value < 1024:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GiB"


def _first_line(message: Optional[str]):
    """(first line, [the other lines]) of a possibly multi-line message."""
    if not message:
        return message, []
    head, *more = message.splitlines() or [""]
    return head, more


def _rebuild_worker_error(cls, failures, previous, note, state):
    err = cls.__new__(cls)
    WorkerError.__init__(err, failures, previous, note)
    err.__dict__.update(state)
    return err


class LaunchTimeout(WorkerError, TimeoutError):
    """The launch ran past its ``timeout``.

    ``stacks`` maps each rank that was still running to where it was when the time ran
    out, as the message shows it: the innermost frames of each thread, main thread
    first, with source lines and without mplaunch's own frames. So the rank that never
    reached a collective stands out: compare ``stacks[0]`` with ``stacks[1]``.
    ``raw_stacks`` holds the full faulthandler dump of each rank (every frame of every
    thread). ``timeout`` is the limit in seconds.
    """

    __module__ = "mplaunch"

    def __init__(self, failures, timeout=None, stacks: Optional[Dict[int, str]] = None,
                 summary: Optional[str] = None, previous_attempts=None):
        # `stacks` is what the ranks sent: raw dumps. The readable texts are derived
        # here, so every way of building one (launch, unpickling) agrees with its message.
        self.timeout = timeout
        self.raw_stacks = dict(stacks or {})
        self.stacks = {rank: _stacks.readable_stack(text)
                       for rank, text in self.raw_stacks.items()}
        self.summary = _stacks.summarize_stacks(self.raw_stacks) if summary is None else summary
        WorkerError.__init__(self, failures, previous_attempts)

    def _message(self) -> str:
        head = f"launch timed out after {self.timeout:g} s" if self.timeout else "launch timed out"
        running = sorted(self.stacks)
        head += f"; {len(running)} rank(s) still running: {running}" if running else ""
        return head + ("\n" + self.summary if self.summary else "")

    def __reduce__(self):
        return (_rebuild_timeout,
                (type(self), self.failures, self.timeout, self.raw_stacks, self.summary,
                 self.previous_attempts, self.__dict__))


def _rebuild_timeout(cls, failures, timeout, raw_stacks, summary, previous, state):
    err = cls.__new__(cls)
    LaunchTimeout.__init__(err, failures, timeout, raw_stacks, summary, previous)
    err.__dict__.update(state)
    return err


class MainProcessError(MPLaunchError):
    """The launching process received a signal (SIGINT, SIGTERM, SIGHUP or SIGQUIT)
    while :func:`mplaunch.launch` ran in its main thread.

    The signal was forwarded to every rank, the ranks were torn down, and then this was
    raised. ``signal_no`` is the signal's number and ``signal_name`` its name. A launch
    with ``max_restarts`` is never restarted after this. To stop a launch on purpose,
    send the launching process SIGINT (Ctrl-C, or "interrupt kernel" in Jupyter).
    """

    __module__ = "mplaunch"

    def __init__(self, signal_no: int, nprocs: Optional[int] = None):
        self.signal_no = signal_no
        self.nprocs = nprocs
        super().__init__(signal_no, nprocs)

    @property
    def signal_name(self) -> str:
        return signal_name(self.signal_no)

    def __str__(self):
        ranks = f"all {self.nprocs} ranks were" if self.nprocs else "the ranks were"
        return (f"the launching process received {self.signal_name}; {ranks} sent "
                f"{self.signal_name} and torn down")


class RemoteException(Exception):
    """Stands in for an exception a worker raised that could not be pickled (or
    unpickled in the parent): it keeps the original type's name, its message and the
    worker's traceback text."""

    __module__ = "mplaunch"

    def __init__(self, type_name: str, message: str, traceback: Optional[str] = None):
        self.type_name = type_name
        self.message = message
        self.traceback = traceback
        super().__init__(type_name, message, traceback)

    def __str__(self):
        text = f"{self.type_name}: {self.message}" if self.message else self.type_name
        if self.traceback:
            text += "\n\nWorker traceback:\n" + self.traceback.rstrip("\n")
        return text
