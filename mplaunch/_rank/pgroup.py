"""The rank's side of the process group's life: incarnations, release and rebuild.

Incarnations. torch names the default group "0" again after every destroy (it resets its
group counter), and the store outlives the group: a new group built with the same store
writes and reads the very keys of the old one (gloo's peer addresses). A rank that is
quicker through destroy/init reads the old group's entries and connects to sockets that
are closing: "Connection reset by peer", or a hang in DDP's first collective. So every
env:// rendezvous against mplaunch's store (our hook, _rank.rendezvous) gets a key space of its
own, ``pg<n>/``, where n counts this rank's rendezvous. Ranks run the same code, so they
count alike; when a heal rebuilds the group the launching process sets one number for all
of them (a replaced rank starts at 0, its peers do not).

Release. A gloo collective waiting for a peer that will never send blocks in C for the
group's timeout (30 min), and neither ``abort()`` (a no-op for gloo) nor a signal reaches
it. Shutting down the TCP connections to the other ranks does: gloo's pairs see the
connection closed and the collective raises. The launching process asks for it with
RELEASE_SIGNAL, taken by a thread of ours (sigwait) since the main thread is the one
blocked; which connections are the ranks' is read from /proc: those whose other end is
held by a sibling process (the ranks of one World share their parent).
"""
from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Dict, List, Optional, Set, Tuple

from .._wire import linux
from .._wire.messages import RELEASE_SIGNAL
from . import torchapi


_incarnation = 0
_backend: Optional[str] = None     # the backend of the last group built through our hook


def next_key_space() -> str:
    """The store prefix of the next group this rank builds (called by the env:// hook)."""
    global _incarnation
    n = _incarnation
    _incarnation += 1
    return f"pg{n}/"


def incarnation() -> int:
    return _incarnation


def set_incarnation(n: int) -> None:
    global _incarnation
    _incarnation = n


# -- release ---------------------------------------------------------------------------

def arm_release() -> None:
    """Block RELEASE_SIGNAL in this (main) thread, before any other thread exists so that
    every thread inherits the mask, and start the thread that takes it."""
    sig = RELEASE_SIGNAL
    if sig is None or not hasattr(signal, "sigwait"):
        return
    signal.pthread_sigmask(signal.SIG_BLOCK, {sig})
    t = threading.Thread(target=_release_loop, name="mplaunch-release", daemon=True)
    t.start()


def _release_loop() -> None:
    assert RELEASE_SIGNAL is not None
    while True:
        signal.sigwait({RELEASE_SIGNAL})
        for release in (_abort_nccl, release_connections):
            try:
                release()
            except Exception:  # noqa: BLE001 - never let this thread die
                pass


def _abort_nccl() -> None:
    """NCCL: abort the communicators, which makes a collective (or the stream
    synchronisation) blocked in the main thread return with an error; the group is
    then destroyed and built again as for gloo. Reasoned about from torch's API, not
    run: no GPU where this was written.

    A torch without the abort (torchapi.abort_default_group) gets nothing here: a
    destroy from this thread would not reach the communicators while the main thread's
    collective holds the group, so that collective ends at the group's timeout, when
    NCCL's watchdog ends the rank and the World replaces it."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return
    if dist.get_backend() != "nccl":
        return
    torchapi.abort_default_group()


def release_connections() -> int:
    """Shut down this process's TCP connections to its sibling processes (the other
    ranks); the number shut down. The fds stay open (gloo owns them and closes them when
    the group is destroyed), so no fd number is reused under gloo's feet."""
    import socket
    me = os.getpid()
    mine = _socket_fds(me)
    if not mine:
        return 0
    peers_inodes: Set[int] = set()
    for pid in linux.children_of(os.getppid()):   # the ranks share their parent
        if pid != me:
            peers_inodes.update(_socket_fds(pid).values())
    table = _tcp_table()
    peer_locals = {table[i][0] for i in peers_inodes if i in table}
    done = 0
    for fd, inode in mine.items():
        ends = table.get(inode)
        if ends is None or ends[1] not in peer_locals:
            continue
        try:
            s = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            s.shutdown(socket.SHUT_RDWR)
            done += 1
        except OSError:
            pass
        finally:
            s.close()
    return done


def _socket_fds(pid: int) -> Dict[int, int]:
    """{fd: socket inode} of a process (empty if it cannot be read)."""
    out: Dict[int, int] = {}
    base = f"/proc/{pid}/fd"
    try:
        names = os.listdir(base)
    except OSError:
        return out
    for name in names:
        try:
            target = os.readlink(f"{base}/{name}")
        except OSError:
            continue
        if target.startswith("socket:["):
            out[int(name)] = int(target[8:-1])
    return out


def _tcp_table() -> Dict[int, Tuple[str, str]]:
    """{inode: (local address, remote address)} of this network namespace's TCP sockets,
    addresses as /proc/net/tcp writes them."""
    table = {}
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(path) as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            parts = line.split()
            if len(parts) > 9:
                table[int(parts[9])] = (parts[1], parts[2])
    return table


def close_inherited_store_sockets() -> int:
    """In a rank forked from the launching process (start_method="fork"), close the
    copies of the store server's sockets (its listening socket and its connections to
    the other ranks) that the fork inherited; the number closed.

    The server's event loop (libuv, epoll) registered those sockets; epoll keeps a
    registration while any copy of the socket is open, so after the server closed a
    connection (a rank that died) our copy kept reporting its events under an fd
    number the server had closed, and could then reuse: seen as a store that no longer
    answers a replaced rank's rendezvous. Those fds belong to C++ objects of the
    launching process, never to a Python object of ours, so closing them is safe."""
    store = os.environ.get("MPLAUNCH_STORE", "")
    _, _, port = store.rpartition(":")
    if not port.isdigit():
        return 0
    hexport = f":{int(port):04X}"
    table = _tcp_table()
    closed = 0
    for fd, inode in _socket_fds(os.getpid()).items():
        ends = table.get(inode)
        if ends is not None and ends[0].endswith(hexport):
            try:
                os.close(fd)
                closed += 1
            except OSError:
                pass
    return closed


# -- rebuild ---------------------------------------------------------------------------

def group_state() -> dict:
    """What the launching process compares across ranks after a failed run."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return {"initialized": False, "seq": None, "incarnation": _incarnation}
    return {"initialized": True, "seq": torchapi.sequence_number(),
            "incarnation": _incarnation,
            "backend": dist.get_backend()}


def rebuild(backend: Optional[str], n: int) -> List[str]:
    """Destroy the default group (if any) and build a new one with `backend` in key
    space `n`; the names (of __main__'s globals and rank_state()'s keys) of objects that
    hold the old group and must be made again."""
    set_incarnation(n)
    if backend is None:
        return []
    import torch.distributed as dist
    stale = stale_holders()
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - a broken group still goes
            pass
    from . import procgroup
    procgroup.setup(backend)   # as the World's first one was made (its GPU on CUDA)
    return stale


def stale_holders() -> List[str]:
    """Names of the objects this rank's user code keeps that hold the current group."""
    try:
        from torch.nn.parallel import DistributedDataParallel
        from torch.distributed import ProcessGroup
    except ImportError:
        return []
    kinds = (DistributedDataParallel, ProcessGroup)
    from .serve import rank_state
    names = []
    main = sys.modules.get("__main__")
    for where, space in (("", getattr(main, "__dict__", {})),
                         ("rank_state()", rank_state())):
        for key, value in list(space.items()):
            if isinstance(value, kinds):
                names.append(f"{where}[{key!r}]" if where else str(key))
    return names
