"""Which of a World rank's TCP connections belong to its process group, so that the
release (_rank.heal) can shut them and nothing else: noted by the rank itself, from its
own file descriptors, while the group is made.

What is noted. The sockets this process gained while ``init_process_group`` ran (and
while torch made each subgroup): gloo connects its full mesh inside init, so every
connection of the group, whichever side connected and wherever the peer runs (this node
or another one), is among them, with the listeners gloo made. Besides those, a
connection accepted later by one of those listeners (a group made with gloo's lazy init
connects on first use) is the group's too. Never a listener itself, and never a
connection with the store's endpoint at either end (a torch that opens a second store
connection during init must keep it).

Why from the rank's own fds. An earlier version read ``/proc/net/tcp{,6}`` to find the
listeners and published them in the store for the peers to read after init. That table
holds every TCP socket of the network namespace: thousands of TIME_WAIT sockets after
any test suite (a 64-rank gloo group leaves some 4,000 by itself), so each init cost
what the machine held, 0.6 s per rank on a busy machine, and every rank then read every
peer's key: O(N^2) store traffic, and a wait of up to 30 s for a peer that died right
after init. Asking the rank's own sockets (readlink of /proc/self/fd, then getsockname
and getpeername: _wire.linux.socket_ends) costs what the rank owns, needs nothing from
the peers, and sends nothing through the store.

Who pays. Only a World's ranks heal; the release is armed by _rank.heal.arm_release,
which calls enable(). A rank of ``launch`` or ``start`` notes nothing: its init costs
what torch's does.

The release itself runs in a thread while the main thread is blocked in C: it reads
/proc/self/fd and asks the sockets, never the store.
"""
from __future__ import annotations

import ipaddress
import os
import socket
import sys
from typing import Dict, FrozenSet, List, NamedTuple, Optional, Set, Tuple

from .._wire import linux
from .._wire.linux import Endpoint, SocketEnds

__all__ = ["Known", "enable", "rendezvous_started", "group_made", "subgroup_started",
           "subgroup_made", "known", "select", "release"]

_WILDCARDS = ("0.0.0.0", "::")


class Known(NamedTuple):
    """What the release of the current group needs, noted as the group was made."""
    sockets: FrozenSet[int]       # inodes of the group's connections
    own: FrozenSet[Endpoint]      # the group's listeners, in this rank
    never: FrozenSet[Endpoint]    # the store's endpoints


class _Pending(NamedTuple):
    store_at: Tuple[str, str]
    before: FrozenSet[int]        # socket inodes this process had before the group


# Set by the main thread, read by the release thread: each is replaced whole, never
# changed in place, so the release sees one group's values or the next one's.
_enabled = False
_known: Optional[Known] = None
_pending: Optional[_Pending] = None


def enable() -> None:
    """This rank heals (a World's): note its groups' connections from now on."""
    global _enabled
    _enabled = True


def _inodes() -> FrozenSet[int]:
    return frozenset(linux.socket_fds(os.getpid()).values())


def rendezvous_started(store_at: Tuple[str, str]) -> None:
    """Called by the rendezvous hook as it hands the store to torch: the previous
    group's connections are forgotten, and this process's sockets noted, so that
    group_made() can tell the new group's apart."""
    global _known, _pending
    _known = None
    _pending = _Pending(store_at, _inodes()) if _enabled else None


def group_made() -> None:
    """Once init_process_group has returned: note the group's connections. Does
    something only after rendezvous_started, once, and only when a gloo group is up
    (after a failed init it just forgets the rendezvous); never raises (a group whose
    connections are unknown is not released, and a rank stuck in it is replaced)."""
    global _known, _pending
    pending, _pending = _pending, None
    if pending is None or not _gloo(None):
        return
    _known = _noted(pending.before, Known(frozenset(), frozenset(),
                                          frozenset(_resolve(pending.store_at))))


def subgroup_started() -> Optional[FrozenSet[int]]:
    """Before torch makes a subgroup: this process's sockets. None when nothing is
    noted, and while no default group is up: the group torch is making is then the
    default one (init_process_group goes through the same helper), which the rendezvous
    notes (group_made)."""
    if not _enabled or _known is None or not _initialized():
        return None
    return _inodes()


def subgroup_made(group, before: Optional[FrozenSet[int]], parent=None) -> None:
    """Once torch has made `group` (None or NON_GROUP_MEMBER where this rank is not in
    it): the connections and listeners it made are the release's too. `parent`: the
    group to ask the backend of, for a split that torch registers only later. Never
    raises."""
    global _known
    known_now = _known
    if before is None or known_now is None or group is None:
        return
    if not _gloo(group if parent is None else parent):
        return
    _known = _noted(before, known_now)


def _initialized() -> bool:
    dist = sys.modules.get("torch.distributed")
    try:
        return dist is not None and bool(dist.is_initialized())
    except Exception:  # noqa: BLE001 - a torch we cannot ask makes no subgroup we note
        return False


def _gloo(group) -> bool:
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is None or not dist.is_initialized():
            return False
        if group is not None and group is dist.GroupMember.NON_GROUP_MEMBER:
            return False
        return "gloo" in str(dist.get_backend(group))
    except Exception:  # noqa: BLE001 - a group we cannot ask about is not released
        return False


def _noted(before: FrozenSet[int], known_now: Known) -> Known:
    """`known_now` with the sockets this process gained since `before`."""
    sockets, own = set(known_now.sockets), set(known_now.own)
    for fd, inode in linux.socket_fds(os.getpid()).items():
        if inode in before:
            continue
        ends = linux.socket_ends(fd)
        if ends is None:
            continue
        local, remote, listening = ends
        if listening:
            own.add(local)
        elif local not in known_now.never and remote not in known_now.never:
            sockets.add(inode)
    return Known(frozenset(sockets), frozenset(own), known_now.never)


def known() -> Optional[Known]:
    """The current group's connections, or None when they are not known."""
    return _known


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


# -- the release -----------------------------------------------------------------------

def select(mine: Dict[int, Tuple[int, Optional[SocketEnds]]],
           known_now: Known) -> List[int]:
    """The fds, among `mine` ({fd: (socket inode, its ends or None)}), of the group's
    connections: see the module's docstring."""
    picked = []
    for fd, (inode, ends) in sorted(mine.items()):
        if ends is None or ends[2]:
            continue            # not TCP, or a listener
        local, remote, _ = ends
        if local in known_now.never or remote in known_now.never:
            continue
        if inode in known_now.sockets or _is_own(local, known_now.own):
            picked.append(fd)
    return picked


def _is_own(local: Endpoint, own: FrozenSet[Endpoint]) -> bool:
    return local in own or any((w, local[1]) in own for w in _WILDCARDS)


def release() -> int:
    """Shut down (both ways) this process's connections of the current group; the number
    shut down. The fds stay open: gloo owns them and closes them when the group is
    destroyed, so no fd number is reused under gloo's feet. Asks only this process's
    own sockets; safe from a thread while the main thread is blocked in C."""
    known_now = _known
    if known_now is None:
        return 0
    fds = linux.socket_fds(os.getpid())
    mine = {fd: (inode, linux.socket_ends(fd)) for fd, inode in fds.items()}
    done = 0
    for fd in select(mine, known_now):
        try:
            dup = os.dup(fd)
        except OSError:
            continue   # closed since it was listed
        try:
            # not closed, its number reused, since it was listed
            s = socket.socket(fileno=dup) if os.fstat(dup).st_ino == fds[fd] else None
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
