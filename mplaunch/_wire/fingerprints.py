"""What tells a torch object of the caller's unchanged since it was sent: its fingerprint.

A World's rank keeps a torch module, optimizer, LR scheduler or tensor that its runs
changed in place (``opt.step()``) while the caller still holds, unchanged, the object
that copy came from: a model and its optimizer built in a notebook's cell and stepped by
a run would otherwise start training again at every run, silently (_wire.mainglobals
owns that rule). To tell, the caller sends, with each global a function names, who the
object is here (`token`: a serial number, as ids are reused) and, for a torch object,
what can change in it in place (`state`): its tensors' ids, version counters and
storage, its modules' train/eval mode, its hyperparameters. The rank compares the
caller's next fingerprint with the one its copy came with, and keeps a `digest` of its
own copy when it takes it, to tell whether it changed that copy since.

Rejected: telling changes by comparing values (``==`` on arbitrary objects, tensors
among them, is neither cheap nor a truthful bool) or by keeping a snapshot of each value
sent (a second copy of every global). Version counters are what torch itself bumps on
every in-place change; a look at them costs no copy.
"""
from __future__ import annotations

import functools
import itertools
import sys
import weakref
from typing import Dict, Optional

__all__ = ["token", "state", "digest"]

_SCALARS = (type(None), bool, int, float, complex, str, bytes)
_serials: Dict[int, tuple] = {}    # id -> (a weak reference to the object, its serial)
_counter = itertools.count(1)


def token(value):
    """Who `value` is in the caller, for as long as it lives: a serial number (an id
    is reused by the next object), or for a scalar its hash (the same value is the
    same), or where no weak reference can be made (a list), its id."""
    if type(value) in _SCALARS:
        return ("=", hash(value))
    key = id(value)
    entry = _serials.get(key)
    if entry is not None and entry[0]() is value:
        return entry[1]
    try:
        ref = weakref.ref(value, functools.partial(_unserial, key))
    except TypeError:
        return ("id", key)
    serial = next(_counter)
    _serials[key] = (ref, serial)
    return serial


def _unserial(key: int, ref) -> None:
    entry = _serials.get(key)
    if entry is not None and entry[0] is ref:
        del _serials[key]


def state(value):
    """(a digest of what can change in place, the ids of its tensors) of a torch
    module, optimizer, LR scheduler or tensor: the tensors' ids, version counters
    (every in-place change bumps them), storage and requires_grad; a module's
    train/eval modes; an optimizer's hyperparameters and state; a scheduler's
    attributes. None for any other object, or one that cannot be read so."""
    torch = sys.modules.get("torch")
    if torch is None or type(value) in _SCALARS:
        return None
    try:
        if isinstance(value, torch.Tensor):
            tensors, extra = [value], ()
        elif isinstance(value, torch.nn.Module):
            tensors = [*value.parameters(), *value.buffers()]
            extra = tuple(m.training for m in value.modules())
        elif isinstance(value, torch.optim.Optimizer):
            tensors = [p for g in value.param_groups for p in g["params"]]
            extra = (tuple(_plain(v) for g in value.param_groups
                           for k, v in sorted(g.items()) if k != "params"),
                     tuple(_plain(v) for s in value.state.values() for v in s.values()))
        elif isinstance(value, _schedulers(torch)):
            tensors = [p for g in value.optimizer.param_groups for p in g["params"]]
            extra = tuple(_plain(v) for k, v in sorted(vars(value).items())
                          if k != "optimizer")
        else:
            return None
        seen = tuple((id(t), t._version, t.data_ptr(), t.requires_grad) for t in tensors)
        return hash((seen, extra)), tuple(id(t) for t in tensors)
    except Exception:  # noqa: BLE001 - an inference tensor, a sparse one: untracked
        return None


def digest(value) -> Optional[int]:
    """The first half of `state`: whether `value` changed, not what it holds."""
    found = state(value)
    return None if found is None else found[0]


def _schedulers(torch) -> tuple:
    lr = torch.optim.lr_scheduler
    return tuple(c for c in (getattr(lr, "LRScheduler", None),
                             getattr(lr, "_LRScheduler", None),
                             getattr(lr, "ReduceLROnPlateau", None)) if c is not None)


def _plain(value):
    """A hashable stand-in for `value` that changes when it does, as far as a look
    at it can tell: scalars as they are, a tensor's id and version, others' ids."""
    if type(value) in _SCALARS:
        return value
    if type(value) in (list, tuple):
        return tuple(_plain(v) for v in value)
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        return id(value), value._version
    return "id", id(value)
