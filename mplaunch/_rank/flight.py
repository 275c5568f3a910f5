"""A rank's collectives, as torch's Flight Recorder saw them: what the straggler report
(_engine.stragglers) lines up across ranks.

torch records every collective a process group starts (its group, its sequence number
in that group, its name, the wall-clock time it was created) in a ring buffer, for gloo
too since torch 2.13, with no code in the rank. Reading it is the cost: torch serialises
the whole buffer each time (3 to 5 ms for 256 entries here, idle; about 55 us an entry
with a test suite running beside it), so a rank reads it once per call,
and only for a call that lasted long enough for a straggler to matter (MIN_CALL_S);
records it already sent, or made before the call began, are left out.

A torch without the recorder's dump, or a rank whose ``TORCH_FR_BUFFER_SIZE=0``: nothing
is read, and the reason travels instead, for the launching process to say once.
"""
from __future__ import annotations

import os
import pickle
import sys
import time
from typing import Optional

from .._wire.messages import Collectives
from .call_loop import uninterrupted
from .torchapi import sequence_number

MIN_CALL_S = 1.0
# The ring buffer a rank gets where it sets no TORCH_FR_* of its own: reading costs up
# to 55 us an entry (torch's default buffer, 2000, would cost ~0.1 s a call); 256
# holds 128 steps of a 2-bucket DDP model, more than a straggler needs to be named.
BUFFER = "256"

_last_id = -1
_began = 0.0
_began_ns = 0     # wall clock: a record created before the call is an earlier call's
_ended_ns = 0
_asked: Optional[Collectives] = None   # what last_call read, for take(own=True)


def arm() -> None:
    """At the rank's start, before its code makes a process group: the buffer size,
    unless the rank's environment has any TORCH_FR_* setting (those are kept)."""
    if not any(name.startswith("TORCH_FR_") for name in os.environ):
        os.environ["TORCH_FR_BUFFER_SIZE"] = BUFFER


def call_begins() -> None:
    global _began, _began_ns
    _began, _began_ns = time.monotonic(), time.time_ns()


def take(own: bool) -> Optional[Collectives]:
    """The records new since the last take, or why there are none to read; None where
    there is nothing to say (no process group, a short call). After mplaunch's own call
    (`own`), what last_call read, if it was that call."""
    global _ended_ns, _asked
    if own:
        taken, _asked = _asked, None
        return taken
    _ended_ns = time.time_ns()
    if time.monotonic() - _began < MIN_CALL_S:
        return None
    records, why = _read()
    return Collectives(tuple(records), why) if records or why else None


@uninterrupted
def last_call() -> None:
    """World.report()'s own call, for a user's call too short to have been read as it
    ended (take): the collectives the rank started between its beginning and end, as
    far as the recorder's ring buffer still holds them, sent as a call's are (take)."""
    global _asked
    records, why = _read(since_id=False)
    _asked = Collectives(tuple(r for r in records if r[3] <= _ended_ns), why)


def _read(since_id: bool = True):
    global _last_id
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return [], None
    if os.environ.get("TORCH_FR_BUFFER_SIZE", "").strip() == "0":
        return [], "TORCH_FR_BUFFER_SIZE=0 in the rank's environment"
    c10d = getattr(sys.modules.get("torch._C"), "_distributed_c10d", None)
    dump = getattr(c10d, "_dump_fr_trace", None)
    if dump is None:
        return [], "this torch has no Flight Recorder dump (_dump_fr_trace)"
    try:
        entries = pickle.loads(dump(True, False, False)).get("entries", [])
    except Exception as exc:  # noqa: BLE001 - a backend without a recorder
        return [], f"{type(exc).__name__}: {exc}"[:200]
    if not entries and sequence_number():
        return [], (f"this torch's Flight Recorder records no collective of the "
                    f"{dist.get_backend()} backend")
    out = []
    for e in entries:
        rid = e.get("record_id", -1)
        if (since_id and rid <= _last_id) or e.get("is_p2p") \
                or e["time_created_ns"] < _began_ns:
            continue
        group = e.get("process_group") or ("?",)
        out.append((str(group[0]), int(e["collective_seq_id"]),
                    str(e.get("profiling_name", "?")).split(":")[-1],
                    int(e["time_created_ns"])))
    if entries:
        _last_id = max(_last_id, max(e.get("record_id", -1) for e in entries))
    return out, None
