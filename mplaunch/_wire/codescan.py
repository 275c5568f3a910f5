"""Which of `__main__`'s names the code a World's rank ran assigns: read from the code.

The ledger (_wire.mainglobals) tells the names a rank's own code bound by identity (a
name no longer holds the caller's object) and by assignment, which catches
``model = model.to(device)``, a rebinding to the same object. The assignments are read
here (`assigned_by`), from the code the call ran or brought:

- the call's function and every function of the caller's `__main__` the call brought,
  wherever it was (an argument, the closure of a decorator such as
  ``@torch.no_grad()`` or one made with `functools.wraps`, an object's class), and a
  ``%%ranks`` cell's statements: the ledger collects these;
- the functions and classes of the rank's `__main__` that this code reads as globals,
  and theirs; the functions a decorator wraps (``__wrapped__``, closures). Only a name
  read as a global counts: ``opt.step()`` is not a use of a function ``step``.

What it assigns: ``global`` statements (STORE_GLOBAL), a cell's own assignments
(STORE_NAME), and ``globals()["name"] = ...`` with the name written out, read from the
bytecode. Code that binds a name another way (``globals().update(...)``, ``setattr`` on
the module, ``exec`` of a string, another module's code) is not seen here: the ledger
tells those by identity alone, and docs/world.rst says so. Only what the code's names
or constants could answer is scanned: most code costs a set test and a few look-ups.

Rejected: watching the namespace's writes instead. A module's namespace is a plain
dict, whose ``STORE_GLOBAL`` no ``__setitem__`` sees, and CPython's dict watchers are
for C code only.
"""
from __future__ import annotations

import functools
import opcode
import sys
import types
from typing import Set

__all__ = ["assigned_by"]

_STORE_GLOBAL = opcode.opmap["STORE_GLOBAL"]
_STORE_NAME = opcode.opmap["STORE_NAME"]
_STORE_SUBSCR = opcode.opmap["STORE_SUBSCR"]
_LOAD_CONST = opcode.opmap["LOAD_CONST"]
_LOAD_GLOBAL = opcode.opmap["LOAD_GLOBAL"]
# Since 3.11 LOAD_GLOBAL's argument is the name's index times two (plus a flag).
_LOAD_GLOBAL_SHIFT = 1 if sys.version_info >= (3, 11) else 0
# Reads that fall through to the module's namespace: a module's or class body's names,
# and (3.12) a class body's in a function or with type parameters.
_LOAD_NAMES = frozenset(opcode.opmap[n] for n in ("LOAD_NAME",
                                                  "LOAD_FROM_DICT_OR_GLOBALS")
                        if n in opcode.opmap)
_EXTENDED_ARG = opcode.EXTENDED_ARG
# As _wire.mainmod.MAIN_NAMES (which imports mainglobals, which imports us).
_MAIN_NAMES = ("__main__", "__mp_main__")
# What a global, a closure or a ``__wrapped__`` may hold that leads to code to read.
_FOLLOWED = (types.FunctionType, types.MethodType, functools.partial, staticmethod,
             classmethod, property)


def assigned_by(runs, namespace: dict, wanted: Set[str]) -> Set[str]:
    """The names of `wanted` that the code in `runs` assigns: a function's ``global``
    statements and ``globals()["name"] = ...``, a ``%%ranks`` cell's assignments (a code
    object run in `namespace`), and those of the functions and classes of `namespace`
    that they read as globals, and of theirs; a decorated function's, wherever the
    decorator came from (``__wrapped__``, a closure). Code that may not have run counts
    too: a function that declares ``global best`` and assigns it makes ``best`` state
    of the process it runs in."""
    found: Set[str] = set()
    seen: Set[int] = set()
    todo = list(runs)
    while todo:
        obj = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, functools.partial):
            todo.append(obj.func)
        elif isinstance(obj, (types.MethodType, staticmethod, classmethod)):
            todo.append(obj.__func__)
        elif isinstance(obj, property):
            todo.extend(f for f in (obj.fget, obj.fset, obj.fdel) if f is not None)
        elif isinstance(obj, type):
            if obj.__module__ in _MAIN_NAMES:
                todo.extend(vars(obj).values())
        elif isinstance(obj, (types.FunctionType, types.CodeType)):
            cell = isinstance(obj, types.CodeType)
            if not cell:
                # A decorator's function (torch.no_grad's is torch's own) holds the
                # decorated one in its closure; functools.wraps names it too.
                todo.extend(_wrapped(obj))
                if obj.__globals__ is not namespace:
                    continue   # another module's: its globals are not __main__'s
            for code in _codes(obj if cell else obj.__code__):
                # A cell's own statements bind names with STORE_NAME (a module's code);
                # in the functions and classes it defines, that is a local or a class
                # attribute.
                stores, loads = _scan(code, namespace, wanted, cell and code is obj)
                found |= stores
                todo.extend(namespace[name] for name in loads)
        else:
            todo.extend(_wrapped(obj))   # functools.lru_cache's wrapper, say
    return found


def _wrapped(obj) -> list:
    """The callables a decorator's result `obj` holds: its ``__wrapped__`` (read from
    its own dict: no descriptor or ``__getattr__`` runs) and, for a function, its
    closure's."""
    found = []
    wrapped = _own_dict(obj).get("__wrapped__")
    if wrapped is not None:
        found.append(wrapped)
    if type(obj) is types.FunctionType and obj.__closure__:
        for cell in obj.__closure__:
            try:
                value = cell.cell_contents
            except ValueError:   # empty
                continue
            if isinstance(value, _FOLLOWED):
                found.append(value)
    return found


def _own_dict(obj) -> dict:
    # The object's own attributes, read without running its __getattr__ or a property.
    try:
        own = object.__getattribute__(obj, "__dict__")
    except Exception:  # noqa: BLE001 - no __dict__, or an odd one
        return {}
    return own if type(own) is dict else {}


def _codes(code):
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _codes(const)


def _followed(value, namespace: dict) -> bool:
    """Whether a global holding `value` leads to code that may assign `__main__`'s
    names: a function of `__main__`, one that wraps another (a decorator's), a class of
    `__main__`. Another module's plain function does not, nor does any other object."""
    if type(value) is types.FunctionType:
        return (value.__globals__ is namespace or value.__closure__ is not None
                or "__wrapped__" in value.__dict__)
    if isinstance(value, type):
        return value.__module__ in _MAIN_NAMES
    return isinstance(value, _FOLLOWED) or "__wrapped__" in _own_dict(value)


def _scan(code, namespace: dict, wanted: Set[str], module_level: bool):
    """(the names of `wanted` that `code` assigns in its module, the names it reads
    from there that hold functions or `__main__` classes). The bytecode is read only
    where `code`'s names or constants could give an answer: most code costs a set test
    and a few look-ups."""
    names = code.co_names
    candidates = [n for n in names if _followed(namespace.get(n), namespace)]
    subscripts = "globals" in names and any(
        type(c) is str and c in wanted for c in code.co_consts)
    if not candidates and not subscripts and wanted.isdisjoint(names):
        return set(), ()
    stores_ops = (_STORE_GLOBAL, _STORE_NAME) if module_level else (_STORE_GLOBAL,)
    consts, count = code.co_consts, len(names)
    stores, loads, keys = set(), set(), set()
    raw, extended, const = code.co_code, 0, None
    for i in range(0, len(raw), 2):
        op, arg = raw[i], raw[i + 1] | extended
        if op == _EXTENDED_ARG:
            extended = arg << 8
            continue
        extended = 0
        if op in stores_ops:
            if arg < count:
                stores.add(names[arg])
        elif op == _LOAD_GLOBAL:
            arg >>= _LOAD_GLOBAL_SHIFT
            if arg < count:
                loads.add(names[arg])
        elif op in _LOAD_NAMES:
            if arg < count:
                loads.add(names[arg])
        elif op == _STORE_SUBSCR and type(const) is str:
            keys.add(const)   # x["name"] = ...: the namespace's when x is globals()
        const = consts[arg] if op == _LOAD_CONST and arg < len(consts) else None
    if "globals" in loads:
        stores |= keys
    return stores & wanted, [n for n in candidates if n in loads]
