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

Submodules. For a function pickled by value, cloudpickle lists the imported submodules
its code can reach as attributes (``torch.distributed`` from ``torch``) by testing every
name in ``sys.modules`` against each package the function uses: with torch imported,
thousands of names per package, 2 ms of every World call and reused test. mplaunch's
picklers find the same modules from the other side: for each package, only the names its
code mentions are looked up, level by level (a submodule is in ``sys.modules`` only
below its parent package, which the import system puts there first). Other users of
cloudpickle in the process keep cloudpickle's own search.
"""
from __future__ import annotations

import pickle
import sys
import threading
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


_ours = threading.local()     # set while one of mplaunch's picklers dumps, in this thread


def _submodules(code: types.CodeType, dependencies) -> list:
    """The submodules cloudpickle's ``_find_imported_submodules`` finds (every imported
    module below a package among `dependencies` whose name's parts are all names in
    `code`), looked up from `code`'s names instead of by scanning ``sys.modules``."""
    names = frozenset(code.co_names)
    modules = sys.modules
    found = []
    for dep in dependencies:
        if not isinstance(dep, types.ModuleType) or not getattr(dep, "__package__", None):
            continue
        below = [dep.__name__]
        while below:
            parent = below.pop()
            for name in names:
                module = modules.get(f"{parent}.{name}")
                if module is not None:
                    found.append(module)
                    below.append(f"{parent}.{name}")
    return found


def _install_submodule_search() -> None:
    """Route cloudpickle's submodule search through _submodules while, and only while,
    one of mplaunch's picklers is dumping in the calling thread. A cloudpickle whose
    function state is built elsewhere keeps its own search (slower, same result)."""
    for module_name in ("cloudpickle.cloudpickle", "cloudpickle.cloudpickle_fast"):
        getstate = getattr(sys.modules.get(module_name), "_function_getstate", None)
        namespace = getattr(getstate, "__globals__", None)
        original = (namespace or {}).get("_find_imported_submodules")
        if original is None or getattr(original, "_mplaunch", False):
            continue

        def search(code, dependencies, _original=original):
            if getattr(_ours, "depth", 0):
                return _submodules(code, dependencies)
            return _original(code, dependencies)

        search._mplaunch = True   # type: ignore[attr-defined]
        namespace["_find_imported_submodules"] = search


_install_submodule_search()


class Pickler(cloudpickle.Pickler):
    """cloudpickle's Pickler, with code objects that keep their ``co_filename``, and a
    submodule search that costs what the function names (see the module's docstring)."""

    dispatch_table = ChainMap({types.CodeType: _reduce_code},
                              cloudpickle.Pickler.dispatch_table)

    def dump(self, obj):
        _ours.depth = getattr(_ours, "depth", 0) + 1
        try:
            return super().dump(obj)
        finally:
            _ours.depth -= 1


def dumps(obj, protocol: int = pickle.HIGHEST_PROTOCOL) -> bytes:
    """``cloudpickle.dumps(obj)``, through mplaunch's Pickler."""
    import io
    out = io.BytesIO()
    Pickler(out, protocol=protocol).dump(obj)
    return out.getvalue()
