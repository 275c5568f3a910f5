"""The agent link's records: every message between a launching process and a node agent
(a World across nodes), one small typed record each, as _wire.messages is for the links
inside one node. _wire.tunnel frames them on the node's one TCP connection.

- launching process -> agent: :class:`Configure` (then :class:`OpenGroup` per group of
  ranks), :class:`StartRank`, :class:`ToRank` (a call), :class:`SignalGroups`,
  :class:`SignalRanks`, :class:`Sweep`, :class:`CloseGroup`, :class:`Credit` (output
  written on), :class:`Payload` and :class:`Drop` (a payload the node keeps, by its key),
  :class:`StackBytes` (to a rank's stack socket), :class:`Bye`;
- agent -> launching process: :class:`Hello` (once, after the proof), :class:`Ready` or
  :class:`NotReady` (the configuration's answer), the group's reports
  :class:`Started`, :class:`StartFailed`, :class:`Exited`, :class:`ServerLost`, the
  answers :class:`Signaled`, :class:`Swept`, :class:`Closed`, and a rank's bytes:
  :class:`Output`, :class:`StackBytes`, :class:`RankMessage` (what its channel said,
  with the contents of the memfds attached to it).

A rank is named by its token, its place in the group (pids of two nodes may be the same
number). Records are NamedTuples as _wire.messages' are: the class pickles by reference
and the fields as a tuple, each reader dispatches on the type and names the fields, and
both ends run the same mplaunch, so none is ever stored. Four carry bulk bytes, which
are never pickled: Output, StackBytes, RankMessage and Payload go on the wire as raw
frames of their own (_wire.tunnel.RAW), and are records only in each end's memory.

Rejected: the records of _wire.messages themselves. Same names, other meanings: a rank
here is a token, not a pid, and a report of this link is about a node (a lost server, a
lost node) as well as a rank; and an integer kind with a positional body per message
(before): three dispatch tables that had to agree on each body's shape by position.
"""
from __future__ import annotations

from typing import Any, Dict, List, NamedTuple, Optional, Tuple

__mplaunch_plumbing__ = True

Key = Tuple[int, int]   # a payload's name while its file is open: (device, inode)


# -- launching process -> agent --------------------------------------------------------

class Configure(NamedTuple):
    """The World's configuration: start the warm server, place the node's ranks on its
    GPUs and CPUs (`gpus`, `cpus`: the World's placement arguments), answer Ready."""
    tag = "configure"
    cfg: Any            # _engine.config.LaunchConfig, without its stdout and stderr
    gpus: Any
    cpus: Any


class OpenGroup(NamedTuple):
    """A new group of ranks: open a launch channel to the node's server."""
    tag = "open"


class StartRank(NamedTuple):
    """Start rank `token` from `spec` with the payload the node holds under `payload`."""
    tag = "start"
    token: int
    spec: Any           # _wire.spec.RankSpec, made the node's own by the agent
    payload: Key


class ToRank(NamedTuple):
    """A message for rank `token`'s channel (a call), its fds the payloads the node
    holds under these keys."""
    tag = "to-rank"
    token: int
    data: bytes
    payloads: Tuple[Key, ...]


class SignalGroups(NamedTuple):
    """`signo` to these ranks and their process groups; answered Signaled."""
    tag = "signal"
    signo: int
    tokens: Tuple[int, ...]


class SignalRanks(NamedTuple):
    """`signo` to these ranks' processes alone (a stack dump); answered Signaled."""
    tag = "kill"
    signo: int
    tokens: Tuple[int, ...]


class Sweep(NamedTuple):
    """Kill every orphan below the node's server, then answer Swept."""
    tag = "sweep"


class CloseGroup(NamedTuple):
    """The group ended: kill what is left of its ranks, send the rest of their output,
    drop the node's payload, answer Closed."""
    tag = "close"


class Credit(NamedTuple):
    """`n` more bytes of rank `token`'s `stream` ("out" or "err") were written on: the
    agent may send as many more (_wire.tunnel.OUTPUT_WINDOW)."""
    tag = "credit"
    token: int
    stream: str
    n: int


class Payload(NamedTuple):
    """A payload file for the node's ranks, kept under `key` until the next one, a Drop
    or the group's end. Raw on the wire: the file streams into a memfd, `fd` here."""
    tag = "payload"
    key: Key
    fd: int


class Drop(NamedTuple):
    """The payload under `key` is no longer needed."""
    tag = "drop"
    key: Key


class Clock(NamedTuple):
    """A clock reading, sent back at once with `theirs` filled: the launching side's wall
    clock when it asked and the agent's when it answered (ns), so that the Flight
    Recorder's times of every node line up (_engine.nodes.hub._clock_offset)."""
    tag = "clock"
    sent: int
    theirs: int = 0


class Bye(NamedTuple):
    """The World is closing: the agent ends, and its ranks with it."""
    tag = "bye"


# -- agent -> launching process --------------------------------------------------------

class Hello(NamedTuple):
    """Once, right after the proof: who this agent is, and what its node offers."""
    tag = "hello"
    node: int           # its node's index, as its scheduler handed it
    name: str           # what the output prefix and errors call the node
    host: str
    pid: int
    environ: Dict[str, str]
    cpus: List[int]     # the CPUs it may run on


class Ready(NamedTuple):
    """The server is up and the node's ranks are placed."""
    tag = "ready"
    gpus: Any
    cpus: Any


class NotReady(NamedTuple):
    """The node cannot run this World: why."""
    tag = "not-ready"
    reason: str


class Started(NamedTuple):
    tag = "started"
    token: int
    pid: int


class StartFailed(NamedTuple):
    tag = "start-failed"
    token: int
    reason: str


class Exited(NamedTuple):
    """Rank `token` was reaped on its node (after everything its channel said)."""
    tag = "exited"
    token: int
    status: int                     # raw wait status
    max_rss: Optional[int] = None   # its peak resident memory, bytes
    note: Optional[str] = None      # what the kernel says of its death (the OOM killer)


class ServerLost(NamedTuple):
    """The node's server died, and every rank of the node with it."""
    tag = "server-lost"
    why: str


class Signaled(NamedTuple):
    """A signal request was carried out: the agent is alive (lost-node detection)."""
    tag = "signaled"


class Swept(NamedTuple):
    tag = "swept"


class Closed(NamedTuple):
    tag = "closed"


# Once a group is open, an agent says it is alive every BEAT_S; a node whose agent says
# nothing at all for SILENT_S (frozen, cut off: TCP still answers for a stopped process)
# is lost, between calls too (_engine.nodes.pump).
BEAT_S = 1.0
SILENT_S = 10.0


class Beat(NamedTuple):
    tag = "beat"


# -- a rank's bytes, either way (raw frames on the wire) -------------------------------

class Output(NamedTuple):
    """What rank `token` wrote to its `stream` ("out" or "err"); b"" at its end."""
    tag = "output"
    token: int
    stream: str
    data: bytes


class StackBytes(NamedTuple):
    """Bytes of rank `token`'s stack socket; b"" from the agent when the rank closed it."""
    tag = "stack"
    token: int
    data: bytes


class RankMessage(NamedTuple):
    """A message rank `token` wrote to its channel (its answer to a call), with the memfds
    attached to it: the files' contents cross, and are memfds again on the other side,
    where the receiver owns (and closes) `fds`."""
    tag = "from-rank"
    token: int
    data: bytes
    fds: Tuple[int, ...]
