"""The TCP endpoints through which the ranks of a process group reach each other: each
rank publishes its own in mplaunch's store when the group is made and reads its peers'
right after, so that the release (_rank.heal) knows which of its connections are the
group's.

Why published, and not found in /proc. A rank blocked in a gloo collective is released
by shutting down its connections to the other ranks, so it must tell those from its
other connections (the store's, a user's). Looking up who holds the other end (the
ranks of one node share their parent) finds nothing across nodes: each node's ranks are
forked by that node's own agent, and a peer's sockets are on another machine. What a
rank does know is the endpoints its peers reach it through: the TCP listening sockets
that appeared while its group was made (gloo's device listeners). Every connection of
the group has one of them at one end, whichever side connected, and whatever the host.

The store. In the group's key space (``pg<n>/``, _rank.rendezvous), key
``KEY + str(rank)`` holds this rank's endpoints as JSON, ``[["10.0.0.7", 41234], ...]``
(IPv4-mapped IPv6 addresses written as IPv4, as /proc/net/tcp6 shows them to us); in
the store itself that is ``<MPLAUNCH_STORE_PREFIX>pg<n>//mplaunch/endpoints/<rank>``
(torch's PrefixStore adds the second slash). The store is unauthenticated: what is read
from it is data, parsed as JSON and checked entry by entry (an IP address, not a name,
and a port), and anything else is ignored with a warning on the ``mplaunch`` logger.

Why read right after the group is made, not at the release. The release runs in a thread
while the main thread is blocked in C: the store's client is not ours to use from a
second thread at that moment, a store may be slow to answer, and a peer that died before
publishing never will. Right after init the ranks have just finished it together (gloo
connects the full mesh inside init), so the peers' keys are there at once; a peer that
does not publish within PEERS_WAIT is left out: the connections this rank opened to it
are then shut from its end only, where it is alive to be released. Only groups whose
backend names gloo take part: an NCCL group is released by aborting it (_rank.heal),
and waiting for peers that finish a lazy init at different times would make every init
a barrier.

Subgroups (``new_group``) have listeners of their own. The rendezvous hook wraps
``torch.distributed.new_group`` too: once it returns, the subgroup's members publish the
listeners it made under ``KEY + "sub<k>/" + str(rank)`` (k counts the new_group calls
since the default group was made, the same in every rank since new_group is called by
all of them) and read each other's, and the release then covers them as well.

Which connections the release shuts: those whose remote endpoint is a peer's published
one, or whose local endpoint is one of this rank's own (the connections its listeners
accepted; a listener bound to a wildcard address matches by its port). Never a listening
socket, and never a connection with the store's endpoint at either end, whatever the
store says.
"""
from __future__ import annotations

import ipaddress
import json
import logging
import os
import re
import socket
import sys
from datetime import timedelta
from typing import Any, Dict, FrozenSet, List, NamedTuple, Optional, Set, Tuple

from .._wire import linux
from .._wire.linux import Endpoint

__all__ = ["KEY", "Known", "rendezvous_started", "group_made", "subgroup_made", "known",
           "parse", "select", "release"]

KEY = "mplaunch/endpoints/"
PEERS_WAIT = 30.0        # seconds for every peer to publish, right after init
MAX_BYTES = 16384        # one rank's value; a few listeners take some 30 bytes each
MAX_ENTRIES = 64

_log = logging.getLogger("mplaunch")

_WILDCARDS = ("0.0.0.0", "::")
_PORT = re.compile(r"[0-9]{1,5}")


class Known(NamedTuple):
    """What the release of the current group needs, read before it is needed."""
    own: FrozenSet[Endpoint]      # this rank's listeners, made with the group
    peers: FrozenSet[Endpoint]    # what the other ranks published
    never: FrozenSet[Endpoint]    # the store's endpoints


class _Pending(NamedTuple):
    store: Any            # the group's PrefixStore
    rank: int
    world_size: int
    store_at: Tuple[str, str]
    listeners_before: FrozenSet[Endpoint]


# Set by the main thread, read by the release thread: each is replaced whole, never
# changed in place, so the release sees one group's values or the next one's.
_known: Optional[Known] = None
_pending: Optional[_Pending] = None
# The current default group's key space, for its subgroups (kept until the next group's
# rendezvous: a client of mplaunch's own store, which ends with the World).
_store: Any = None
_subgroups = 0            # new_group calls since it was made


def rendezvous_started(store, rank: int, world_size: int,
                       store_at: Tuple[str, str]) -> None:
    """Called by the rendezvous hook as it hands `store` (the group's key space) to
    torch: the previous group's endpoints are forgotten, and this process's listeners are
    noted, so that group_made() can tell the new group's apart."""
    global _known, _pending, _store, _subgroups
    _known = _store = None
    _subgroups = 0
    _pending = _Pending(store, rank, world_size, store_at, frozenset(own_listeners()))


def group_made() -> None:
    """Once init_process_group has returned: publish this rank's endpoints and read its
    peers'. Does something only after rendezvous_started, once, and only when the
    group is up (after a failed init it just forgets the rendezvous); never raises (a
    group whose endpoints are unknown is not released, and a rank stuck in it is
    replaced instead)."""
    global _known, _pending
    pending, _pending = _pending, None
    if pending is None:
        return
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is None or not dist.is_initialized() or \
                "gloo" not in str(dist.get_backend()):
            return
        _known = _exchange(pending)
    except Exception as exc:  # noqa: BLE001 - the group works without it
        _log.warning("mplaunch: rank %s could not exchange its process group's "
                     "endpoints (%s: %s); a collective of this group left half-done "
                     "will not be released, and this rank will be replaced instead",
                     pending.rank, type(exc).__name__, exc)


def subgroup_made(group, members, listeners_before: FrozenSet[Endpoint]) -> None:
    """Once new_group has returned `group` (with these `members`, None: every rank):
    its members publish the listeners it made and read each other's, added to what the
    release shuts. Never raises."""
    global _known, _subgroups
    n, _subgroups = _subgroups, _subgroups + 1
    known_now, store = _known, _store
    dist = sys.modules.get("torch.distributed")
    if known_now is None or store is None or dist is None or group is None:
        return
    try:
        if group is dist.GroupMember.NON_GROUP_MEMBER or \
                "gloo" not in str(dist.get_backend(group)):
            return
        me = dist.get_rank()
        members = (list(range(dist.get_world_size())) if members is None
                   else sorted(int(r) for r in members))
        own = own_listeners() - listeners_before
        prefix = f"{KEY}sub{n}/"
        store.set(prefix + str(me), json.dumps(sorted([a, port] for a, port in own)))
        peers: Set[Endpoint] = set()
        for rank, raw in _read_peers(store, me, [r for r in members if r != me], prefix):
            peers.update(parse(raw, f"rank {rank}"))
        _known = Known(known_now.own | own, known_now.peers | peers, known_now.never)
    except Exception as exc:  # noqa: BLE001 - the subgroup works without it
        _log.warning("mplaunch: could not exchange a new_group's endpoints (%s: %s); a "
                     "collective of it left half-done will not be released, and the rank "
                     "will be replaced instead", type(exc).__name__, exc)


def known() -> Optional[Known]:
    """The current group's endpoints, or None when they are not known."""
    return _known


def own_listeners() -> Set[Endpoint]:
    """The local endpoints of this process's TCP listening sockets."""
    table = linux.tcp_sockets()
    out = set()
    for inode in linux.socket_fds(os.getpid()).values():
        ends = table.get(inode)
        if ends is not None and ends[2] == linux.TCP_LISTEN:
            out.add(ends[0])
    return out


def _exchange(p: _Pending) -> Known:
    global _store
    own = own_listeners() - p.listeners_before
    p.store.set(KEY + str(p.rank), json.dumps(sorted([a, port] for a, port in own)))
    _store = p.store
    peers: Set[Endpoint] = set()
    others = [r for r in range(p.world_size) if r != p.rank]
    for rank, raw in _read_peers(p.store, p.rank, others):
        peers.update(parse(raw, f"rank {rank}"))
    return Known(frozenset(own), frozenset(peers), frozenset(_resolve(p.store_at)))


def _read_peers(store, me: int, ranks: List[int],
                prefix: str = KEY) -> List[Tuple[int, bytes]]:
    if not ranks:
        return []
    try:
        store.wait([prefix + str(r) for r in ranks], timedelta(seconds=PEERS_WAIT))
    except Exception:  # noqa: BLE001 - a peer died or is late: the others' still count
        ranks = [r for r in ranks if _present(store, prefix + str(r))]
        _log.warning("mplaunch: rank %s: only ranks %s published their endpoints within "
                     "%s s of the process group's init", me, ranks, PEERS_WAIT)
    return [(r, store.get(prefix + str(r))) for r in ranks]


def _present(store, key: str) -> bool:
    try:
        store.wait([key], timedelta(milliseconds=10))
    except Exception:  # noqa: BLE001 - not there (the wait timed out)
        return False
    return True


def _resolve(store_at: Tuple[str, str]) -> Set[Endpoint]:
    """The store's (address, port) pairs: its host as every address it resolves to."""
    host, port = store_at
    try:
        number = int(port)
        infos = socket.getaddrinfo(host, number, type=socket.SOCK_STREAM)
    except (OSError, ValueError, UnicodeError):
        return set()
    out = set()
    for info in infos:
        try:
            out.add((linux.plain_ip(ipaddress.ip_address(str(info[4][0]).split("%")[0])),
                     number))
        except ValueError:
            continue
    return out


# -- what the store holds --------------------------------------------------------------

def parse(raw, whose: str) -> List[Endpoint]:
    """The endpoints in one rank's value (bytes or str): a JSON list whose entries are
    ``[address, port]`` or ``"address:port"`` (``"[v6 address]:port"``), the address an
    IP address. An entry that is not one is left out, a value that is not such a list is
    left out whole; each with a warning naming `whose` it was."""
    try:
        if len(raw) > MAX_BYTES:
            raise ValueError(f"{len(raw)} bytes, more than {MAX_BYTES}")
        value = json.loads(raw.decode("utf-8") if isinstance(raw, bytes) else raw)
    except (ValueError, TypeError, RecursionError) as exc:
        _ignored(whose, raw, f"not JSON ({type(exc).__name__}: {exc})")
        return []
    if not isinstance(value, list) or len(value) > MAX_ENTRIES:
        _ignored(whose, raw, f"not a list of at most {MAX_ENTRIES} endpoints")
        return []
    out = []
    for entry in value:
        try:
            out.append(parse_entry(entry))
        except ValueError as exc:
            _ignored(whose, entry, str(exc))
    return out


def parse_entry(entry) -> Endpoint:
    """(address, port) of one entry, the address as /proc/net/tcp shows it to us
    (linux.plain_ip); ValueError if it is not an endpoint."""
    if isinstance(entry, str):
        host, sep, port = entry.rpartition(":")
        if not sep or not _PORT.fullmatch(port):
            raise ValueError("not address:port")
        if host.startswith("[") and host.endswith("]"):
            host = host[1:-1]
        number = int(port)
    elif isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], str) \
            and type(entry[1]) is int:
        host, number = entry
    else:
        raise ValueError("neither [address, port] nor \"address:port\"")
    if not 0 < number < 65536:
        raise ValueError(f"port {number} out of range")
    try:
        # A name is not resolved: the release must not wait for a DNS answer.
        address = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        raise ValueError(f"{host[:64]!r} is not an IP address") from None
    return linux.plain_ip(address), number


def _ignored(whose: str, what, why: str) -> None:
    text = repr(what)
    if len(text) > 200:
        text = text[:200] + "..."
    _log.warning("mplaunch: ignored what %s published in the store as its process "
                 "group's endpoints: %s (%s)", whose, text, why)


# -- the release -----------------------------------------------------------------------

def select(mine: Dict[int, int], table: Dict[int, Tuple[Endpoint, Endpoint, int]],
           known_now: Known) -> List[int]:
    """The fds, among `mine` ({fd: socket inode}), of the group's connections according
    to `table` (linux.tcp_sockets()) and `known_now`: see the module's docstring."""
    picked = []
    for fd, inode in sorted(mine.items()):
        ends = table.get(inode)
        if ends is None:
            continue
        local, remote, state = ends
        if state == linux.TCP_LISTEN:
            continue
        if local in known_now.never or remote in known_now.never:
            continue
        if remote in known_now.peers or _is_own(local, known_now.own):
            picked.append(fd)
    return picked


def _is_own(local: Endpoint, own: FrozenSet[Endpoint]) -> bool:
    return local in own or any((w, local[1]) in own for w in _WILDCARDS)


def release() -> int:
    """Shut down (both ways) this process's connections of the current group; the number
    shut down. The fds stay open: gloo owns them and closes them when the group is
    destroyed, so no fd number is reused under gloo's feet. Reads only /proc; safe from
    a thread while the main thread is blocked in C."""
    known_now = _known
    if known_now is None:
        return 0
    mine = linux.socket_fds(os.getpid())
    done = 0
    for fd in select(mine, linux.tcp_sockets(), known_now):
        try:
            dup = os.dup(fd)
        except OSError:
            continue   # closed since it was listed
        try:
            # not closed, its number reused, since it was listed
            s = socket.socket(fileno=dup) if os.fstat(dup).st_ino == mine[fd] else None
        except OSError:
            s = None
        if s is None:
            os.close(dup)
            continue
        try:
            s.shutdown(socket.SHUT_RDWR)
            done += 1
        except OSError:
            pass
        finally:
            s.close()
    return done
