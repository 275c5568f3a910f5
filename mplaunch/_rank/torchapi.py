"""Every private or version-dependent torch API the rank calls, looked up here and nowhere
else, each with the fallback mplaunch takes when this torch does not have it.

setup.cfg admits a range of torch releases, and torch moves or renames its private
helpers between them without notice. Spelt out at each call site, a missing one either
raised from a place that then had to guess what went wrong, or was caught by a broad
``except`` that hid which API was gone. Here each lookup is a feature check (``getattr``
or the signature), never a version comparison: a backport or a build from source has the
API whatever its version says. Each function's docstring states what the rank does
without it; tests/test_torch_api.py hides each API, in this process and in real ranks,
and checks that fallback.

torch is read from ``sys.modules`` where the caller runs with or without it (the stack
reporter, the process-group health checks): nothing here imports torch.distributed into
a rank that did not.
"""
from __future__ import annotations

import sys
from typing import Optional, Tuple

__all__ = ["sequence_number", "sequence_number_and_why", "group_sequence_numbers",
           "group_name_and_count",
           "abort_default_group",
           "init_kwargs_for_device", "rendezvous_handlers"]


def _dist():
    """torch.distributed when this rank imported it and it is initialised, else None."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    return dist


def sequence_number_and_why() -> Tuple[Optional[int], Optional[str]]:
    """(how many collectives the default process group has started, None) or (None, why
    that number is unknown); (None, None) when torch.distributed is not initialised.

    Uses ``distributed_c10d._get_default_group()._get_sequence_number_for_group()``
    (every torch 2.x; gloo and NCCL count, other backends may raise). Fallback: None with
    the reason, which a stack report prints as "collective number unknown (...)"; a
    World's health check then cannot compare ranks by it and rebuilds the group after
    a failed run instead of trusting it."""
    dist = _dist()
    if dist is None:
        return None, None
    get_group = getattr(dist.distributed_c10d, "_get_default_group", None)
    if get_group is None:
        return None, "this torch has no distributed_c10d._get_default_group"
    try:
        group = get_group()
    except Exception as exc:  # noqa: BLE001 - destroyed between the check and here
        return None, f"{type(exc).__name__}: {exc}"[:200]
    count = getattr(group, "_get_sequence_number_for_group", None)
    if count is None:
        return None, "this torch has no ProcessGroup._get_sequence_number_for_group"
    try:
        return int(count()), None
    except Exception as exc:  # noqa: BLE001 - a backend that does not count them
        return None, f"{type(exc).__name__}: {exc}"[:200]


def sequence_number() -> Optional[int]:
    """The default group's collective count, or None when it is unknown (not
    initialised, the API missing, or a backend that does not count): see
    sequence_number_and_why for the fallback."""
    return sequence_number_and_why()[0]


def group_sequence_numbers() -> dict:
    """{group name: how many collectives it has started} for every process group this
    rank belongs to besides the default one (new_group's, new_subgroups', a device
    mesh's). Names are the same in every member (torch derives them from the ranks and
    the order of creation).

    Uses ``distributed_c10d._world.pg_names`` (every torch 2.x) and each group's
    ``_get_sequence_number_for_group``. Fallback: {} (or a group left out), and a
    World's health check compares the default group alone, as it did before subgroups
    were counted."""
    dist = _dist()
    if dist is None:
        return {}
    c10d = dist.distributed_c10d
    world = getattr(c10d, "_world", None)
    names = getattr(world, "pg_names", None)
    if not isinstance(names, dict):
        return {}
    try:
        default = c10d._get_default_group()
    except Exception:  # noqa: BLE001
        default = None
    counts = {}
    for group, name in list(names.items()):
        if group is default:
            continue
        count = getattr(group, "_get_sequence_number_for_group", None)
        try:
            counts[str(name)] = int(count())
        except Exception:  # noqa: BLE001 - a backend that does not count, or none
            continue
    return counts


def group_name_and_count(group) -> Optional[Tuple[str, int]]:
    """(name, collectives started) of `group` as a collective's ``group`` argument
    holds it (None or ``GroupMember.WORLD``: the default group), or None.

    Uses ``distributed_c10d._world.pg_names`` and ``_get_sequence_number_for_group``
    (every torch 2.x). Fallback: None, and the stack report names the default group's
    count alone."""
    dist = _dist()
    if dist is None:
        return None
    c10d = dist.distributed_c10d
    try:
        if group is None or group is getattr(c10d.GroupMember, "WORLD", None):
            group = c10d._get_default_group()
        name = c10d._world.pg_names.get(group)
        count = group._get_sequence_number_for_group()
    except Exception:  # noqa: BLE001 - another layout, a destroyed group
        return None
    return (str(name), int(count)) if name is not None else None


def abort_default_group() -> bool:
    """Abort the default process group: its communicators are torn down at once, so a
    collective blocked on a peer that will never come returns with an error (NCCL).
    True when done; False when torch.distributed is not initialised or this torch has no
    ``distributed_c10d._abort_process_group`` (pytorch PR 132291, mid-2024; torch 2.1.2
    has none).

    Fallback (the caller's). A rank that exits after a failure destroys the group
    instead (procgroup): in the torch releases without the abort, ProcessGroupNCCL's
    destructor aborts its communicators, so the group still ends without waiting on its
    peers. The release thread (_rank.heal) does nothing: while the main thread's collective
    holds the group no destroy reaches its communicators, so that collective ends at
    the group's timeout."""
    dist = _dist()
    if dist is None:
        return False
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    if abort is None:
        return False
    abort()
    return True


def init_kwargs_for_device(index: int) -> dict:
    """The keyword arguments that bind init_process_group to CUDA device `index`:
    ``{"device_id": torch.device("cuda", index)}`` where init_process_group takes
    ``device_id`` (pytorch PR 114916, December 2023; torch 2.1.2 does not), else ``{}``.

    Fallback: nothing is passed, and the group finds its device the way those releases
    always did, from ``torch.cuda.set_device(index)``, which the caller has already
    done; only the eager communicator set-up that device_id brings is lost."""
    import inspect

    import torch
    import torch.distributed as dist
    try:
        params = inspect.signature(dist.init_process_group).parameters
    except (TypeError, ValueError):   # wrapped by something that hides its signature
        return {}
    if "device_id" not in params:
        return {}
    return {"device_id": torch.device("cuda", index)}


def rendezvous_handlers(module) -> Optional[dict]:
    """torch.distributed.rendezvous's table of URL schemes to handlers
    (``_rendezvous_handlers``; every torch 2.x), which the rank's env:// and tcp:// hook
    (_rank.rendezvous) wraps; None when `module` has no such table.

    Fallback (the caller's): the hook is not installed and torch's own handlers run, so
    rank 0's ``init_process_group()`` tries to host a store on MASTER_PORT, which the
    launching process holds, and fails saying the address is in use; a user's own
    ``store=`` or address still works."""
    handlers = getattr(module, "_rendezvous_handlers", None)
    return handlers if isinstance(handlers, dict) else None
