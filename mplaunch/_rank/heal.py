"""The rank's side of a healing World: releasing a collective left half-done, the
group's state after a failed call, and rebuilding the group (in a new key space of the
rendezvous: see _rank.rendezvous). Setting the group up and tearing it down is
_rank.procgroup's; the launching side of a heal is _engine.heal and _engine.world_engine.

Release. A gloo collective waiting for a peer that will never send blocks in C for the
group's timeout (30 min), and neither ``abort()`` (a no-op for gloo) nor a signal reaches
it. Shutting down the TCP connections to the other ranks does: gloo's pairs see the
connection closed and the collective raises. The launching process asks for it with
RELEASE_SIGNAL, taken by a thread of ours (sigwait) since the main thread is the one
blocked. Which connections are the group's the rank noted itself as the group was made
(_rank.endpoints): the sockets it gained during init, and any accepted later by the
group's listeners. That works wherever the peers run, on this node or another one; the
thread reads only /proc/self and asks its own sockets, never the store. What the release
(or the World's interrupt) raises in a rank is said in one line, as its doing, not shown
as the rank's own error (ended_by_world).
"""
from __future__ import annotations

import gc
import os
import signal
import sys
import threading
from typing import List, Optional

from .._wire import stacks
from .._wire.messages import LOST_PEER, RELEASE_SIGNAL
from . import call_loop as serve, endpoints, rendezvous, torchapi


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
    global _armed
    endpoints.enable()   # only a rank that can be released notes its groups' sockets
    block_release()
    t = threading.Thread(target=_release_loop, name="mplaunch-release", daemon=True)
    t.start()
    _armed = True


def _release_loop() -> None:
    assert RELEASE_SIGNAL is not None
    while True:
        signal.sigwait({RELEASE_SIGNAL})
        _released.set()   # first: the collective this releases raises in a moment
        for release in (_abort_nccl, release_connections):
            try:
                release()
            except Exception:  # noqa: BLE001 - never let this thread die
                pass


def _abort_nccl() -> None:
    """NCCL: abort the communicators, which makes a collective (or the stream
    synchronisation) blocked in the main thread return with an error; the group is
    then destroyed and built again as for gloo. Run on one GPU (tests/test_gpu_runs.py:
    a rank blocked in a kernel, its group aborted, then made again in the same process,
    the rank kept); a peer blocked in a NCCL collective needs two GPUs, not yet run.

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


# -- what a release or an interrupt ended --------------------------------------------------
#
# A rank the World released, or interrupted, raises too: gloo's "Connection closed by
# peer", or KeyboardInterrupt. That is mplaunch's doing, not an error of the rank's own:
# the rank says so in one line (where it was) instead of a traceback, and its answer
# says so (Raised.released), so that the error names the rank that failed and where
# the others were, not 7 tracebacks and "raised KeyboardInterrupt" 7 times.

_armed = False                   # the release thread runs (arm_release)
_released = threading.Event()    # it ran during the current call
# A peer's release (or death) closes its connections, and so ends our collective, a
# moment before our own release arrives (the World sends it to every rank at once, or
# as soon as it learns that a rank died): how long a rank that lost a peer waits for it.
_RELEASE_WAIT = 1.0


def call_begins() -> int:
    """A call begins: what ended_by_world compares with at its end."""
    _released.clear()
    return serve.interrupts()


def ended_by_world(exc: BaseException, interrupts: int) -> Optional[str]:
    """How the World's own ending of the call raised `exc` in this rank, if it did
    (`interrupts`: what call_begins returned): "released from
    torch.distributed.all_reduce" when its release ended a collective (gloo's lost
    connection, or the interrupt that came with it), "interrupted" when its interrupt
    did ("interrupted in torch.distributed.barrier" inside a collective); None for an
    error of the rank's own."""
    chain = _chain(exc)
    lost = next((e for e in chain if _lost_peer(e)), None)
    if lost is not None and _armed and not _released.is_set():
        _released.wait(_RELEASE_WAIT)
    interrupted = isinstance(exc, KeyboardInterrupt) and serve.interrupts() != interrupts
    if lost is not None and _released.is_set() and (lost is exc or interrupted):
        how, where = "released", "from"
    elif interrupted:
        how, where = "interrupted", "in"
    else:
        return None
    name = _collective_of(chain)
    return f"{how} {where} torch.distributed.{name}" if name else how


def released_line(rank: int, how: str, tb_text: Optional[str]) -> str:
    """The line a released rank writes instead of its traceback: what ended its call
    and where ("[mplaunch] rank 3: released from torch.distributed.all_reduce at
    train.py:42 in step")."""
    site = stacks.failure_site(tb_text)
    where = f" at {stacks.short_path(site[0])}:{site[1]} in {site[2]}" if site else ""
    return f"[mplaunch] rank {rank}: {how}{where}\n"


def _chain(exc: BaseException) -> List[BaseException]:
    """`exc` and the exceptions it was raised from or while handling, outermost first."""
    out: List[BaseException] = []
    pending: List[Optional[BaseException]] = [exc]
    while pending:
        e = pending.pop(0)
        if e is None or any(e is seen for seen in out):
            continue
        out.append(e)
        pending += [e.__cause__, e.__context__]
    return out


def _lost_peer(exc: BaseException) -> bool:
    return isinstance(exc, RuntimeError) and any(s in str(exc) for s in LOST_PEER)


_C10D = os.sep + os.path.join("torch", "distributed", "distributed_c10d.py")


def _collective_of(chain: List[BaseException]) -> Optional[str]:
    """The torch.distributed function the user's code called that these exceptions'
    frames are in ("all_reduce"; broadcast_object_list, not the broadcast inside it).
    The collective's own error is asked first: an interrupt that landed while torch
    handled it (torch 2.1's logging wrapper asks is_initialized() there) is not in it;
    and a query (is_*, get_*) is never the collective."""
    for exc in sorted(chain, key=lambda e: not _lost_peer(e)):
        tb = exc.__traceback__
        while tb is not None:
            code = tb.tb_frame.f_code
            if code.co_filename.endswith(_C10D) and not code.co_name.startswith(
                    ("_", "is_", "get_")):
                return code.co_name
            tb = tb.tb_next
    return None


# -- rebuild ---------------------------------------------------------------------------

@serve.uninterrupted
def group_state() -> dict:
    """What the launching process compares across ranks after a failed run."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return {"initialized": False, "seq": None, "incarnation": rendezvous.incarnation()}
    return {"initialized": True, "seq": torchapi.sequence_number(),
            "subgroups": torchapi.group_sequence_numbers(),
            "incarnation": rendezvous.incarnation(),
            "backend": dist.get_backend()}


@serve.uninterrupted
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


def renumber(changes: dict) -> int:
    """World.restart(nnodes=M) goes on without a lost node: this rank's number and
    environment as the new layout has them (`changes`: {old rank: {name: value, or None
    where it goes}}), before the group is rebuilt in it (rebuild). Its new rank."""
    from . import debugging
    mine = changes.get(debugging.rank(), {})
    for name, value in mine.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    new = int(mine.get("RANK", debugging.rank()))
    debugging.renumbered(new)
    return new


def stale_holders() -> List[str]:
    """Names of the objects this rank's user code keeps that hold the current group."""
    try:
        from torch.nn.parallel import DistributedDataParallel
        from torch.distributed import ProcessGroup
    except ImportError:
        return []
    kinds = (DistributedDataParallel, ProcessGroup)
    from .call_loop import rank_state
    names = []
    main = sys.modules.get("__main__")
    for where, space in (("", getattr(main, "__dict__", {})),
                         ("rank_state()", rank_state())):
        for key, value in list(space.items()):
            if isinstance(value, kinds):
                names.append(f"{where}[{key!r}]" if where else str(key))
    return names
