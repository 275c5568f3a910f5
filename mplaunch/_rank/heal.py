"""The rank's side of a healing World: releasing a collective left half-done, the
group's state after a failed call, and rebuilding the group (in a new key space of the
rendezvous: see _rank.rendezvous). Setting the group up and tearing it down is
_rank.procgroup's; the launching side of a heal is _engine.heal and _engine.serving.

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
from typing import List, Optional, Set

from .._wire import linux
from .._wire.messages import RELEASE_SIGNAL
from . import rendezvous, torchapi


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
    mine = linux.socket_fds(me)
    if not mine:
        return 0
    peers_inodes: Set[int] = set()
    for pid in linux.children_of(os.getppid()):   # the ranks share their parent
        if pid != me:
            peers_inodes.update(linux.socket_fds(pid).values())
    table = linux.tcp_table()
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


# -- rebuild ---------------------------------------------------------------------------

def group_state() -> dict:
    """What the launching process compares across ranks after a failed run."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return {"initialized": False, "seq": None, "incarnation": rendezvous.incarnation()}
    return {"initialized": True, "seq": torchapi.sequence_number(),
            "incarnation": rendezvous.incarnation(),
            "backend": dist.get_backend()}


def rebuild(backend: Optional[str], n: int) -> List[str]:
    """Destroy the default group (if any) and build a new one with `backend` in key
    space `n`; the names (of __main__'s globals and rank_state()'s keys) of objects that
    hold the old group and must be made again."""
    rendezvous.set_incarnation(n)
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
