"""What `__main__` holds in a rank, and in the processes a rank starts with spawn or
forkserver: the launching process's `__main__` definitions that the launch uses.

A function defined in a script, a `python -c` string or a notebook cell lives in
`__main__`, which no other process can import, so it travels by value. But code in the
rank pickles by reference: `pickle.dumps(P(1))`, `torch.save(model)`, a DataLoader
worker's Dataset, `Pool.map(fn)` all write "`__main__`.P" and expect the process that
reads it to find `P` there. So:

- the launching process pickles the classes and functions of its `__main__` that the
  launch reaches *by value once*, in a part of the payload of their own, and everything
  else refers to them by name (`main_attr`);
- the rank loads that part into a fresh module that becomes its `sys.modules["__main__"]`
  (also under `__mp_main__` when that was the launching process's name for it): the
  objects are found by name and are the very objects the rank's code uses, and the
  functions' globals are that module's namespace, as in the launching process;
- a child the rank starts with spawn or forkserver rebuilds `__main__` from the rank's
  `__main__.__spec__`, which names mplaunch/_rank/mp_main.py: multiprocessing runs that file
  there as `__mp_main__`, and it loads the same part of the payload, read from the rank
  (`/proc/<rank>/fd/<payload>`, named by MPLAUNCH_MAIN). A fork child inherits the
  rank's `__main__` as it is.

Neither the rank nor its children ever run the user's script again: an unguarded script
(no `if __name__ == "__main__":`) would launch again from every DataLoader worker.

A rank that runs a script itself (the `mplaunch` command) has no payload of definitions:
its `__main__` is the script, still running when it starts children. There
`_rank.script_main.guard_script_children` hooks multiprocessing's preparation data (computed in the rank
for every spawn or forkserver child): the child is told to run mplaunch/_mp_main.py
instead of the script, and the classes and functions the script has defined so far are
written, by value, where that reads them.
"""
from __future__ import annotations

import builtins
import os
import pickle
import sys
import types

from . import buffers as _buffers, mainglobals

__all__ = ["MAIN_NAMES", "ENV", "main_qualname", "main_attr", "MainGlobals",
           "main_offset", "become_main", "publish", "fill_child_main"]

# The names multiprocessing gives the main module (`__mp_main__` in its spawn and
# forkserver children, where `__main__` is an alias of it).
MAIN_NAMES = ("__main__", "__mp_main__")
# Where a rank's children find the definitions of its `__main__`.
ENV = "MPLAUNCH_MAIN"
# What multiprocessing runs as `__mp_main__` in a rank's spawn and forkserver children;
# a module of its own, which importing mplaunch never imports (runpy would warn).
CHILD_MAIN = "mplaunch._rank.mp_main"

# The namespace a load fills: set while a rank's children load theirs.
_filling = None


def main_qualname(obj, main):
    """The dotted name under which `obj` (a class or function) is found in the module
    `main`, or None: a lambda, a function local to another, a name rebound since."""
    module = getattr(obj, "__module__", None)
    if module not in MAIN_NAMES or sys.modules.get(module) is not main:
        return None
    qualname = getattr(obj, "__qualname__", None)
    if not isinstance(qualname, str) or "<" in qualname:
        return None
    target = main
    for part in qualname.split("."):
        try:
            # vars(), not getattr(): no descriptor or __getattr__ runs.
            target = vars(target)[part]
        except (KeyError, TypeError):
            return None
    return qualname if target is obj else None


def main_attr(qualname: str):
    """The object a payload names, in this rank's `__main__`."""
    target = sys.modules["__main__"]
    for part in qualname.split("."):
        target = getattr(target, part)
    return target


def _main_namespace() -> dict:
    return _filling if _filling is not None else vars(sys.modules["__main__"])


class MainGlobals(dict):
    """Stands, in a pickle, for the globals of the functions defined in `__main__`:
    they unpickle as the namespace of the `__main__` of the process that loads them, so
    those functions and `__main__` share one namespace there, as they did here (a
    `global` statement in one is seen by the others and by pickle's look-ups)."""

    def __reduce__(self):
        return _main_namespace, ()


class _RankMain(types.ModuleType):
    def __repr__(self):
        # What pickle's "Can't get attribute 'Q' on <module ...>" shows: the spec would
        # make it mplaunch._rank.mp_main, and say nothing of why Q is missing.
        return "<module '__main__' (in an mplaunch rank: what the launch uses of it)>"


def main_offset(payload) -> int:
    """Where, in a payload from `_wire.payload.dumps_payload`, the pickle of the `__main__`
    definitions starts (it ends 8 bytes before the end, which hold this offset)."""
    return int.from_bytes(payload[-8:], "little")


def become_main(data, path: str, buffers=()) -> None:
    """In a rank: make a fresh `__main__` and fill it from `data` (the pickle of the
    `__main__` definitions in the payload, and `buffers`, its out-of-band ones: the
    large tensors and arrays its functions' globals hold); the rank's children will
    read it again from `path`. Must run before the rest of the payload is unpickled."""
    main = sys.modules.get("__main__")
    if not isinstance(main, _RankMain):
        main = _RankMain("__main__")
        main.__builtins__ = builtins
        # The spec is what multiprocessing's spawn and forkserver children rebuild
        # `__main__` from: our module, never the user's script.
        main.__spec__ = _child_main_spec()
        sys.modules["__main__"] = main
    # else: a World's rank, on a later call: its `__main__` (the globals of the
    # functions it ran) stays, and takes this call's definitions on top, but not over
    # the names its own code bound (_wire.mainglobals).
    mainglobals.track(vars(main))
    mainglobals.settle()
    os.environ.pop(ENV, None)  # a nested launch's value is not ours
    part = pickle.loads(data, buffers=buffers)
    if part is None:  # nothing from `__main__` in this launch
        return
    names, attrs, objects = part
    for name in names:
        sys.modules[name] = main
    _fill(vars(main), attrs, objects)
    os.environ[ENV] = path


def _child_main_spec():
    import importlib.util
    return importlib.util.find_spec(CHILD_MAIN)


def _fill(namespace: dict, attrs: dict, objects: dict) -> None:
    namespace.update(attrs)
    # Classes and functions the caller's `__main__` defines: they follow the caller.
    mainglobals.install(namespace, objects, defined=objects)


def publish(payload_fd: int) -> str:
    """The path under which a rank's children read its payload: the rank keeps the fd
    open, and the file lives as long as the rank does (its children die with it)."""
    return f"/proc/{os.getpid()}/fd/{payload_fd}"


def fill_child_main(namespace: dict) -> None:
    """In a child of a rank (spawn or forkserver), where multiprocessing runs
    mplaunch/_rank/mp_main.py as `__mp_main__`: turn its namespace into the rank's
    `__main__`."""
    global _filling
    for key in [k for k in namespace if not k.startswith("__")]:
        del namespace[key]  # this file's own definitions are not the user's
    path = os.environ.get(ENV)
    if not path:
        return
    try:
        with open(path, "rb") as f:
            f.seek(-8, os.SEEK_END)
            at = main_offset(f.read(8))
            # the rank's pages of the large values its functions' globals hold
            mapped = _buffers.main_buffers(f.fileno())
            f.seek(at)
            _filling = namespace
            try:
                part = pickle.load(f, buffers=mapped)
            finally:
                _filling = None
    except OSError as exc:
        raise RuntimeError(
            f"mplaunch: this process was started by a rank with spawn or forkserver and "
            f"could not read the definitions of the rank's __main__ from {path} "
            f"({exc}); it can only do so while that rank runs") from exc
    if part is not None:
        _, attrs, objects = part
        _fill(namespace, attrs, objects)
