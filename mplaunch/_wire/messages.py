"""The protocol between mplaunch's three processes: every message that crosses a process
boundary, one small typed record each, and the constants both ends must agree on.

Three links carry them (framing in _wire.channel):

- the *lifeline* (launching process <-> server, one per server): :class:`OpenChannel`
  one way, :class:`Hello` the other;
- a *launch channel* (launching process <-> server, one per group of ranks): the
  requests :class:`StartRank`, :class:`SignalGroups`, :class:`SignalRanks`,
  :class:`Watch`, :class:`Unwatch`, :class:`Sweep`; the server's reports
  :class:`Started`, :class:`StartFailed`, :class:`Exited`, :class:`Swept`. Inside the
  server, :class:`BecomeRank` hands a spec to an idle pre-forked child, and
  :class:`ExecRank` to a fresh interpreter (start_method="spawn");
- a rank's *result socket* (rank <-> launching process): the rank answers each call
  with :class:`Returned` or :class:`Raised`, or with a result pickled with its tensors in
  shared memory (:data:`RESULT_TAG`), after a :class:`KeptGlobals` note where it has
  one; a World's rank gets each further call as :data:`CALL_TAG` with the payload's fd,
  after a :data:`CALL_TAG` frame without an fd carrying the modules to reload first,
  where the launching process reloaded some since the last call.

A World across nodes adds a fourth link, the *agent link* (launching process <-> a node's
agent, over TCP): its records, made the same way, are in _wire.link, since a rank there
is named by its token and not its pid.

Records are NamedTuples, so they pickle small and fast (the class by reference, the
fields as a tuple) and every reader names the field it wants. Each carries its ``tag``
(for logs and the docs); readers dispatch on the type. Both ends of every link run the
same mplaunch, so the records may change between versions: none is ever stored.
"""
from __future__ import annotations

import signal
from typing import Any, Dict, NamedTuple, Optional, Tuple

from .spec import RankSpec

# mplaunch's own plumbing: an interrupt is never raised in its frames (_rank.call_loop)
__mplaunch_plumbing__ = True

# Sent by the launching process to ask a rank for its Python stack: faulthandler answers
# it at C level, even while the rank is blocked inside a gloo collective.
STACK_SIGNAL = signal.SIGRTMIN + 2 if hasattr(signal, "SIGRTMIN") else signal.SIGUSR2
# Sent by a healing World to every rank: shut down the connections to the other ranks,
# which releases a collective left half-done (taken by a thread: _rank.heal).
RELEASE_SIGNAL = signal.SIGRTMIN + 4 if hasattr(signal, "SIGRTMIN") else None

# What a collective raises in a rank when a peer left it (died, or was released): a
# consequence of another rank's failure, never a cause (_rank.heal, _engine.heal).
LOST_PEER = ("Connection closed by peer", "Connection reset by peer")

# Exit codes of a rank that the launching process reads as a reason.
EXIT_ERROR = 1          # the function raised (its Raised message says what)
EXIT_PARENT_GONE = 70   # the server died before the rank could arm its death signal
EXIT_CHANNEL_CLOSED = 71  # the rank closed its result socket before it could answer

# Tags of the framed messages on a rank's result socket (first byte of each frame).
RESULT_TAG = b"o"       # a return value, pickled with its tensors' fds (_wire.payload)
MESSAGE_TAG = b"p"      # a pickled record of this module (Returned or Raised)
CALL_TAG = b"c"         # launching process -> a World's rank: run the attached payload
DEBUG_TAG = b"d"        # launching process -> a rank: the answer to its DebugAsk


# -- the lifeline ----------------------------------------------------------------------

class OpenChannel(NamedTuple):
    """Launching process -> server: a new launch channel; its socket is the one fd."""
    tag = "channel"


class Hello(NamedTuple):
    """Server -> launching process, once: ready to fork ranks."""
    tag = "hello"
    pid: int
    preload_errors: Dict[str, str]   # module -> why it could not be imported
    threads: int                     # threads alive in the server (forking needs 1)


# -- a launch channel: requests --------------------------------------------------------

class StartRank(NamedTuple):
    """Start a rank from `spec`; the rank's fds (_wire.channel.RANK_FDS) are attached."""
    tag = "start"
    token: int          # echoed in Started / StartFailed (the rank's local rank)
    spec: RankSpec


class SignalGroups(NamedTuple):
    """`signo` to each of these ranks and its whole process group (None: every rank of
    this channel)."""
    tag = "signal"
    signo: int
    pids: Optional[Tuple[int, ...]]


class SignalRanks(NamedTuple):
    """`signo` to these ranks' processes alone (a stack dump request)."""
    tag = "kill"
    signo: int
    pids: Tuple[int, ...]


class Watch(NamedTuple):
    """A rank the launching process forked itself (start_method="fork"): the server
    kills it with the channel's other ranks if the launching process dies."""
    tag = "watch"
    pid: int


class Unwatch(NamedTuple):
    """That forked rank has been reaped; its pid is no longer ours to kill."""
    tag = "unwatch"
    pid: int


class Sweep(NamedTuple):
    """Kill every orphan below the server (what dead ranks left), then answer Swept."""
    tag = "sweep"


# -- a launch channel: reports ---------------------------------------------------------

class Started(NamedTuple):
    tag = "started"
    token: int
    pid: int


class StartFailed(NamedTuple):
    tag = "error"
    token: int
    reason: str


class Exited(NamedTuple):
    """A rank of this channel was reaped by the server."""
    tag = "exited"
    pid: int
    status: int         # raw wait status
    max_rss: Optional[int] = None   # its peak resident memory, bytes (rusage of wait4)
    note: Optional[str] = None      # what the kernel says of its death (the OOM killer)


class Swept(NamedTuple):
    tag = "swept"
    killed: int


# -- inside the server -----------------------------------------------------------------

class BecomeRank(NamedTuple):
    """Server -> an idle pre-forked child: become this rank (its fds attached)."""
    tag = "run"
    spec: RankSpec


class ExecRank(NamedTuple):
    """Server -> a rank it execs (start_method="spawn"), in a memfd named on the new
    interpreter's command line: what it needs to become the rank."""
    tag = "exec"
    spec: RankSpec
    fds: Dict[str, int]     # RANK_FDS name -> fd number, inherited across the exec
    parent: int             # the server's pid: the rank checks it is still its parent


# -- a rank's result socket ------------------------------------------------------------

class Returned(NamedTuple):
    """The call returned `value` (small values; see RESULT_TAG for the others)."""
    tag = "ok"
    value: Any


class KeptGlobals(NamedTuple):
    """Sent before a call's answer, not in its place: what the rank's `__main__` did
    with values the call brought from the caller that the caller should be told of
    (_wire.mainglobals): each a (kind, name, token, why) tuple, "kept" for a name its
    own code bound and kept over the caller's value, or a caller's object that took
    the place of one the ranks had changed; said once per caller object and reason.
    Also ("unfollowed", module, None, why): a module the rank could not reload before
    the call (_rank.reloads)."""
    tag = "kept"
    names: Tuple[tuple, ...]


class Collectives(NamedTuple):
    """Sent before a call's answer: the collectives the rank started during the call
    (_rank.flight: (group, seq, name, created ns) each), or why none could be read."""
    tag = "coll"
    records: Tuple[tuple, ...]
    why_off: Optional[str]


class DebugAsk(NamedTuple):
    """A rank asks its user for something (_rank.debugging): ``open``, whether anybody
    can answer (a pdb about to stop at `where`); ``line``, a line for input() or pdb,
    shown after `text` (`hold`: pdb's, which keeps the turn until ``end``); ``end``, its
    pdb continued or quit. The answer is a DEBUG_TAG frame."""
    tag = "debug"
    kind: str
    text: str
    where: str
    hold: bool


class Raised(NamedTuple):
    """The call raised. The exception travels three ways, so that something always
    arrives: pickled with its frames (`blob`, None if it would not pickle), and as text."""
    tag = "err"
    blob: Optional[bytes]
    type_name: str
    message: str
    traceback: Optional[str]
    exitcode: int
    timestamp: float    # time.time() when it was raised
    # Set when the exception is what mplaunch's own ending of the call raised in this
    # rank (a World's release of a collective, or its interrupt), not an error of the
    # rank's own: how, e.g. "released from torch.distributed.all_reduce" (_rank.heal).
    released: Optional[str] = None
