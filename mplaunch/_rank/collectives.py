"""The rank's side of "which collective is each rank in": a reporter thread that answers
the launching process's stack requests with the sequence number of the default process
group.

A rank blocked inside a collective runs no Python in its main thread, so no signal
handler of ours could read the number there; torch releases the GIL while it waits, so
another thread can. The thread starts only once torch.distributed is being initialised
(from the env:// rendezvous hook, _rank.rendezvous): before that there is nothing to report,
and a rank without torch.distributed keeps a single thread. It reads requests from the
rank's stack socket (the same one faulthandler writes its dump to) and answers each with
a record, marked so that the parent finds it in the text, then the dump itself.

The dump is written by this thread, not by the signal handler: faulthandler's
all-threads dump from a signal reads every thread's frames while they run, and this
thread, answering, would be running Python at that very moment (a rank crashed so). From
here the other threads are either waiting for the GIL or inside C without it, so their
frames hold still. A rank whose main thread keeps the GIL in C cannot answer; the parent
sends it the signal after a while instead. The thread announces itself when it starts,
so the parent knows which ranks to ask this way.
"""
from __future__ import annotations

import faulthandler
import json
import os
import sys
import threading

from .._wire.stacks import COLLECTIVE_END, COLLECTIVE_MARK
from . import torchapi

_fd = None            # the rank's stack socket, set when the rank takes over its process
_started = False


def set_stack_fd(fd: int) -> None:
    global _fd, _started
    _fd, _started = fd, False


def start() -> None:
    """Start the reporter (once per rank process)."""
    global _started
    if _started or _fd is None:
        return
    _started = True
    try:
        os.write(_fd, _record({"reporter": True}))
    except OSError:
        return
    threading.Thread(target=_serve, args=(_fd,), name="mplaunch-collectives",
                     daemon=True).start()


def _serve(fd: int) -> None:
    while True:
        try:
            data = os.read(fd, 64)
        except InterruptedError:
            continue
        except OSError:
            return  # the rank closed it, or the parent is gone
        if not data:
            return
        try:
            info = report()
            info["main"] = f"0x{threading.main_thread().ident:016x}"
            os.write(fd, _record(info))
            if b"?" in data:   # b"c" alone: the record, without the stacks
                faulthandler.dump_traceback(file=fd, all_threads=True)
        except OSError:
            return


def _record(info: dict) -> bytes:
    return (COLLECTIVE_MARK + json.dumps(info) + COLLECTIVE_END).encode()


def report() -> dict:
    """{"initialized": bool, "seq": the default group's collective count or None,
    "why": why it is None, "groups": {name: collectives started} of every group of the
    rank, "current": [name, number] of the collective its main thread is in}."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_initialized():
        return {"initialized": False}
    seq, why = torchapi.sequence_number_and_why()
    out = {"initialized": True, "seq": seq} if why is None else \
        {"initialized": True, "seq": None, "why": why}
    if seq is not None:
        # every group's count, and the group whose collective the main thread is in
        out["groups"] = {_DEFAULT: seq, **torchapi.group_sequence_numbers()}
        current = _current_group()
        if current is not None:
            out["current"] = list(current)
    return out


_DEFAULT = "0"   # the default group's name (distributed_c10d._world.pg_names)
_C10D = os.path.join("torch", "distributed", "distributed_c10d.py")


def _current_group():
    """(name, number) of the collective the main thread is in: the ``group`` argument
    of the innermost distributed_c10d function with one on its stack, read from this
    thread while the main thread waits in C; or None."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    while frame is not None:
        code = frame.f_code
        if code.co_filename.endswith(_C10D) and "group" in code.co_varnames[
                :code.co_argcount + code.co_kwonlyargcount]:
            return torchapi.group_name_and_count(frame.f_locals.get("group"))
        frame = frame.f_back
    return None
