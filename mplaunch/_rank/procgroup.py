"""The rank's process group when mplaunch sets it up (``backend=`` on launch, start, World,
the pytest marker, the magics, the command): made before the user's code, ended after it.

One module for every front-end, so that they set up and tear down alike: on CUDA the
rank selects its own GPU first and binds the group to it (``device_id=``); without that
every rank's NCCL communicator lands on cuda:0. The tear-down runs once the rank's
outcome has been sent, so a peer whose collective breaks when this rank's group goes
never reports before the failure that caused it.
"""
from __future__ import annotations

import os
import signal
import sys
from typing import Optional

from .._wire.spec import uses_cuda
from . import call_loop as serve, endpoints, torchapi

_ours = False   # the default group was made here, and is ours to end


def local_device(environ=os.environ) -> int:
    """This rank's CUDA device index: 0 when it sees exactly one GPU (``gpus=`` gave it
    its own, or the user's ``env=`` did), else LOCAL_RANK."""
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and len([e for e in visible.split(",") if e.strip()]) == 1:
        return 0
    return int(environ.get("LOCAL_RANK", "0"))


@serve.uninterrupted
def setup(backend: Optional[str]) -> None:
    """init_process_group(backend) for this rank, on its own GPU when the backend uses
    CUDA. Nothing without a backend, or when the group exists already."""
    global _ours
    if not backend:
        return
    import torch.distributed as dist
    if dist.is_initialized():
        return
    kwargs = {}
    if uses_cuda(backend):
        import torch
        index = local_device()
        count = torch.cuda.device_count()
        if index >= count:
            raise RuntimeError(
                f"backend={backend!r}: rank LOCAL_RANK={os.environ.get('LOCAL_RANK')} "
                f"would use cuda:{index}, but it sees {count} GPU(s) "
                f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})")
        torch.cuda.set_device(index)
        kwargs.update(torchapi.init_kwargs_for_device(index))
    dist.init_process_group(backend, **kwargs)
    _ours = True
    # Done already by the rendezvous hook's init_process_group; not where it could not
    # wrap it (a caller that took torch's function first). Once either way.
    endpoints.group_made()


def teardown(failed: bool) -> None:
    """At the rank's exit: end the group setup() made, if it is still up. After a
    success the ranks leave together first (see below); after a failure the group is
    aborted where the backend can (NCCL: destroying it would wait on collectives that
    will never complete), else destroyed. Never raises: the rank's outcome has been
    reported already."""
    global _ours
    if not _ours:
        return
    if failed:
        shield()
    _ours = False
    _end_group(failed)


def shield() -> None:
    """Before a failing rank reports: the launcher answers the report with SIGTERM to
    every rank, this one included, and the group's (quick) abort must come first.
    Ignored, not blocked: a mask is per thread, and the backend's threads would take
    the signal. Until the rank exits, which it is about to do; SIGKILL still comes
    after the grace period."""
    if _ours:
        try:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        except ValueError:
            pass   # not the main thread: the abort races the SIGTERM


def _end_group(failed: bool) -> None:
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is None or not dist.is_initialized():
            return   # the user's code destroyed it
        if failed:
            if uses_cuda(dist.get_backend()) and torchapi.abort_default_group():
                return   # else destroyed, below
        elif "gloo" in str(dist.get_backend()):
            # A rank that destroys its group and exits right after init can break a
            # gloo peer whose connect has not finished ("Connection closed by peer").
            dist.barrier()
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - a peer already gone; the rank exits anyway
        pass
