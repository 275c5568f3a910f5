"""The rank's side of a healing World: releasing a collective left half-done, the
group's state after a failed call, and rebuilding the group (in a new key space of the
rendezvous: see _rank.rendezvous). Setting the group up and tearing it down is
_rank.procgroup's; the launching side of a heal is _engine.heal and _engine.serving.

Release. A gloo collective waiting for a peer that will never send blocks in C for the
group's timeout (30 min), and neither ``abort()`` (a no-op for gloo) nor a signal reaches
it. Shutting down the TCP connections to the other ranks does: gloo's pairs see the
connection closed and the collective raises. The launching process asks for it with
RELEASE_SIGNAL, taken by a thread of ours (sigwait) since the main thread is the one
blocked. Which connections are the group's the rank noted itself as the group was made
(_rank.endpoints): the sockets it gained during init, and any accepted later by the
group's listeners. That works wherever the peers run, on this node or another one; the
thread reads only /proc/self and asks its own sockets, never the store.
"""
from __future__ import annotations

import gc
import signal
import sys
import threading
from typing import List, Optional

from .._wire.messages import RELEASE_SIGNAL
from . import endpoints, rendezvous, torchapi


# -- release ---------------------------------------------------------------------------

def block_release() -> None:
    """Block RELEASE_SIGNAL in this (main) thread before any other thread exists, so
    that every thread inherits the mask: the rank's first lines, before the spec is
    applied (torch.set_num_threads there starts OpenMP's threads whenever
    OMP_NUM_THREADS > 1; one of them, not blocking it, would die of the signal)."""
    if RELEASE_SIGNAL is not None and hasattr(signal, "sigwait"):
        signal.pthread_sigmask(signal.SIG_BLOCK, {RELEASE_SIGNAL})


def arm_release() -> None:
    """Block RELEASE_SIGNAL (block_release, if it was not yet), and start the thread
    that takes it."""
    sig = RELEASE_SIGNAL
    if sig is None or not hasattr(signal, "sigwait"):
        return
    endpoints.enable()   # only a rank that can be released notes its groups' sockets
    block_release()
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
    """Shut down this process's TCP connections to the other ranks of its process group
    (see _rank.endpoints); the number shut down. The fds stay open (gloo owns them and
    closes them when the group is destroyed), so no fd number is reused under gloo's
    feet."""
    return endpoints.release()


# -- rebuild ---------------------------------------------------------------------------

def group_state() -> dict:
    """What the launching process compares across ranks after a failed run."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return {"initialized": False, "seq": None, "incarnation": rendezvous.incarnation()}
    return {"initialized": True, "seq": torchapi.sequence_number(),
            "subgroups": torchapi.group_sequence_numbers(),
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
        # The old group's connections are shut before it is destroyed. A rank whose
        # wait in a collective was interrupted (torch 2.13's work.wait() is) leaves the
        # collective running on gloo's thread, waiting for peers that never send; the
        # group's destructor joins that thread, and so hung forever, here or wherever
        # the collector later freed a group kept alive by a cycle (a traceback's
        # frames): once shut, the thread's collective raises and the thread ends.
        release_connections()
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - a broken group still goes
            pass
        # A group held by a reference cycle is freed now, its threads released, not
        # at a random later allocation in the next call.
        gc.collect()
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
