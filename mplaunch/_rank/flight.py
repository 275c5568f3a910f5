"""A rank's collectives, as torch's Flight Recorder saw them: what the straggler report
(_engine.stragglers) lines up across ranks.

torch records every collective a process group starts (its group, its sequence number
in that group, its name, the wall-clock time it was created) in a ring buffer, for gloo
too since torch 2.13, with no code in the rank. Reading it is the cost: torch serialises
the whole buffer each time (3 to 5 ms for 256 entries here, idle; about 55 us an entry
with a test suite running beside it), so a rank reads it once per call,
and only for a call that lasted long enough for a straggler to matter (MIN_CALL_S);
records it already sent, or made before the call began, are left out.

NCCL keeps its own recorder (its records hold CUDA events): read through
``_dump_nccl_trace`` where torch has it, beside ``_dump_fr_trace`` (gloo's and the other
backends'), each with its own record ids; a collective is one record whichever dump
holds it. Found on the first GPU run: ``_dump_fr_trace`` alone read no NCCL collective,
and the report said it was off for NCCL.

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

# The dumps a rank reads: the backends' shared recorder, and NCCL's own.
DUMPS = ("_dump_fr_trace", "_dump_nccl_trace")
# The settings a user may make of the buffer: torch's current name, and NCCL's older
# one, which is the user's to set (torch 2.11 warns in every rank that it is deprecated:
# found on the first GPU run, where mplaunch set it too).
SETTINGS = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")

_last_ids: dict = {}   # per dump: the last record id it sent
_began = 0.0
_began_ns = 0     # wall clock: a record created before the call is an earlier call's
_ended_ns = 0
_asked: Optional[Collectives] = None   # what last_call read, for take(own=True)


def arm() -> None:
    """At the rank's start, before its code makes a process group: the buffer size,
    unless the rank's environment has any TORCH_FR_* setting (those are kept)."""
    if not any(name.startswith("TORCH_FR_") or name.startswith("TORCH_NCCL_TRACE_")
               for name in os.environ):
        os.environ[SETTINGS[0]] = BUFFER


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
    # Sent even where empty: the launching process tells a rank that read nothing new
    # from one whose call was too short to read (its records would be missing from
    # the report, which would then blame the wrong rank: _engine.stragglers.take_records)
    return Collectives(tuple(records), why)


@uninterrupted
def last_call() -> None:
    """World.report()'s own call, for a user's call too short to have been read as it
    ended (take): the collectives the rank started between its beginning and end, as
    far as the recorder's ring buffer still holds them, sent as a call's are (take)."""
    global _asked
    records, why = _read(since_id=False)
    _asked = Collectives(tuple(r for r in records if r[3] <= _ended_ns), why)


def _read(since_id: bool = True):
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return [], None
    size = next((os.environ[n] for n in SETTINGS if n in os.environ), "").strip()
    if size == "0":
        name = next(n for n in SETTINGS if n in os.environ)
        return [], f"{name}=0 in the rank's environment"
    c10d = getattr(sys.modules.get("torch._C"), "_distributed_c10d", None)
    dumps = [(n, getattr(c10d, n)) for n in DUMPS if hasattr(c10d, n)]
    if not dumps:
        return [], "this torch has no Flight Recorder dump (_dump_fr_trace)"
    out, seen, read_any, why = [], set(), False, None
    for name, dump in dumps:
        try:
            entries = pickle.loads(dump(True, False, False)).get("entries", [])
        except Exception as exc:  # noqa: BLE001 - a backend without a recorder
            why = why or f"{type(exc).__name__}: {exc}"[:200]
            continue
        read_any = read_any or bool(entries)
        last = _last_ids.get(name, -1)
        for e in entries:
            rid = e.get("record_id", -1)
            if (since_id and rid <= last) or e.get("is_p2p") \
                    or e["time_created_ns"] < _began_ns:
                continue
            group = e.get("process_group") or ("?",)
            record = (str(group[0]), int(e["collective_seq_id"]),
                      str(e.get("profiling_name", "?")).split(":")[-1],
                      int(e["time_created_ns"]))
            if record[:2] not in seen:   # one collective, whichever dump holds it
                seen.add(record[:2])
                out.append(record)
        if entries:
            _last_ids[name] = max(last, max(e.get("record_id", -1) for e in entries))
    if not read_any and sequence_number():
        return [], why or (f"this torch's Flight Recorder records no collective of the "
                           f"{dist.get_backend()} backend")
    out.sort(key=lambda r: r[3])
    return out, None
