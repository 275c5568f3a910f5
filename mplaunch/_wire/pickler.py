"""mplaunch's cloudpickle: every function, test, result and exception that mplaunch sends
to another process is pickled by a subclass of this Pickler, so that code objects keep
the file they came from whatever cloudpickle version is installed.

cloudpickle 3.1.3 (cloudpipe/cloudpickle#560) writes ``"<dynamic-code>"`` as the file name
of every code object it pickles by value, so that the same function pickles to the same
bytes wherever it was defined. mplaunch has no use for deterministic payloads: a payload
is pickled once per call and read by ranks that run it, never hashed or cached, and what
a rank's traceback, its stacks and a grouped timeout report need is the user's file and
line. So the code object travels as cloudpickle reduces it, plus its real file name,
which the rank puts back. Only mplaunch's own picklers do this: ``cloudpickle.dumps`` in
the same process is left exactly as its release makes it.
"""
from __future__ import annotations

import pickle
import types
from collections import ChainMap

import cloudpickle

__all__ = ["Pickler", "dumps"]

_cloudpickle_reduce_code = cloudpickle.Pickler.dispatch_table[types.CodeType]


def _reduce_code(code: types.CodeType):
    rebuild, args = _cloudpickle_reduce_code(code)[:2]
    if code.co_filename in args:   # this cloudpickle kept it (3.1.2 and older)
        return rebuild, args
    return _named_code, (rebuild, args, code.co_filename)


def _named_code(rebuild, args, filename: str) -> types.CodeType:
    """In the process that loads it: the code object, under its own file name again."""
    code = rebuild(*args)
    return code if code.co_filename == filename else code.replace(co_filename=filename)


class Pickler(cloudpickle.Pickler):
    """cloudpickle's Pickler, with code objects that keep their ``co_filename``."""

    dispatch_table = ChainMap({types.CodeType: _reduce_code},
                              cloudpickle.Pickler.dispatch_table)


def dumps(obj, protocol: int = pickle.HIGHEST_PROTOCOL) -> bytes:
    """``cloudpickle.dumps(obj)``, through mplaunch's Pickler."""
    import io
    out = io.BytesIO()
    Pickler(out, protocol=protocol).dump(obj)
    return out.getvalue()
