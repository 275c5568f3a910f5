"""Which names of a rank's `__main__` follow the calling process, and which are the
rank's own.

A function from the caller's `__main__` travels with the globals it names, at the
caller's values (cloudpickle), and loading it puts them into the rank's `__main__`. A
rank that runs one call (`launch`, `start`) needs nothing more. A World's rank runs many
and keeps what its code built: ``global model; model = Net()`` in one run is ``model``
in the next. There the caller's values must not land on every name: the placeholder
``model = None`` at the top of a script (or in a notebook cell) would undo the rank's
model at every call, and nothing would say why.

The rule, per name:

- a name the rank's own code bound (a function's ``global`` assignment, a ``%%ranks``
  cell, ``globals()[...]``) belongs to the rank: the caller's value does not replace
  it, and the caller is told once per name where the two differ (`take_kept`, sent as
  ``_wire.messages.KeptGlobals``);
- every other name follows the caller, as it always did: a constant changed in a cell
  and run again arrives;
- a class or function that the caller's `__main__` defines under that very name always
  follows the caller (a function redefined in a cell is the common case): the caller
  says which names those are, at pickling time (`function_reduce`);
- `push` (``%ranks push``) replaces a name on purpose, and the name follows the caller
  again until the rank binds it anew; a name the rank deleted follows the caller again.

How the rank tells its own names: the ledger remembers, for each name, the object it
last put there from the caller. After each call, a name that no longer holds that very
object was bound by the rank; so was one that the code the call ran assigns (a
``global`` statement of the call's function or of the `__main__` functions and classes
it names, a statement of a ``%%ranks`` cell), which catches ``model =
model.to(device)``, a rebinding to the same object.
Identity and assignment, not equality: an object the rank changes in place
(``history.append(x)``) is still the caller's, and the caller's next copy replaces it,
as before.

Rejected: ipyparallel's ``@interactive`` way, where a function resolves every global in
the engine's namespace and nothing travels unless pushed: mplaunch's functions run with
the caller's constants and helpers without a push (in `launch` as in a World), and users
rely on it. Rejected too: telling changes by comparing values (``==`` on arbitrary
objects, tensors among them, is neither cheap nor a truthful bool) or by keeping a
snapshot of each value sent (a second copy of every global).
"""
from __future__ import annotations

import functools
import opcode
import types
from typing import Dict, Iterable, List, Optional, Set

__all__ = ["track", "function_reduce", "function_setstate", "install", "push",
           "cell_runs", "settle", "take_kept"]

_MISSING = object()
# Values whose == is plain data comparison, safe to call and a real bool: where the
# rank's value and the caller's are equal, keeping the rank's changes nothing worth
# saying. (Any other type is said to differ: no user __eq__ runs here.)
_PLAIN = (type(None), bool, int, float, complex, str, bytes, tuple, list, dict, set,
          frozenset)


class _Ledger:
    __slots__ = ("namespace", "given", "told", "kept", "cells")

    def __init__(self, namespace: dict):
        self.namespace = namespace
        self.given: Dict[str, object] = {}   # name -> the caller's object put there last
        self.told: set = set()               # names already reported
        self.kept: List[str] = []            # names to report after this load
        self.cells: list = []                # the code of %%ranks cells this call runs


_ledger: Optional[_Ledger] = None


def track(namespace: dict) -> None:
    """In a rank: `namespace` (its `__main__`'s) is the one whose names are kept apart;
    the same namespace keeps its ledger from call to call."""
    global _ledger
    if _ledger is None or _ledger.namespace is not namespace:
        _ledger = _Ledger(namespace)


def function_reduce(rv, defined: Iterable[str]):
    """cloudpickle's reduction `rv` of a function of the caller's `__main__`, rewritten
    so that the rank installs the function's globals through `install` (`defined`: the
    names among them that the caller's `__main__` defines as that class or function).
    Any other shape of `rv` is returned as it is."""
    if type(rv) is not tuple or len(rv) != 6 or rv[5] is None:
        return rv
    make, args, state, items, pairs, setter = rv
    return make, args, (setter, state, tuple(defined)), items, pairs, function_setstate


def function_setstate(func, packed) -> None:
    """The rank's side of `function_reduce`: cloudpickle's own state setter, given no
    globals, then the globals through the ledger."""
    setter, state, defined = packed
    inner, slots = state
    values = slots.get("__globals__") or {}
    slots["__globals__"] = {}
    setter(func, (inner, slots))
    install(func.__globals__, values, defined)


def install(namespace: dict, values: dict, defined: Iterable[str] = ()) -> None:
    """Put the caller's `values` into `namespace`, but not over a name the rank's own
    code bound (see the module's docstring); `defined` names always go in."""
    ledger = _ledger
    if ledger is None or namespace is not ledger.namespace:
        namespace.update(values)   # a namespace nobody ran code in yet: all of it
        return
    given, defined = ledger.given, set(defined)
    for name, value in values.items():
        current = namespace.get(name, _MISSING)
        if (current is not _MISSING and current is not given.get(name, _MISSING)
                and name not in defined and not _dunder(name)):
            if name not in ledger.told and _differ(current, value):
                ledger.told.add(name)
                ledger.kept.append(name)
            continue
        namespace[name] = value
        given[name] = value


def push(namespace: dict, values: dict) -> None:
    """``%ranks push``: the caller's values, over the rank's own on purpose; the names
    follow the caller again (until the rank's code binds them anew)."""
    namespace.update(values)
    ledger = _ledger
    if ledger is not None and namespace is ledger.namespace:
        ledger.given.update(values)


def cell_runs(code) -> None:
    """A ``%%ranks`` cell's code is about to run in the rank's `__main__` (_rank.cells):
    `settle` reads what it assigns. (Not in the notebook, which compiles it too.)"""
    if _ledger is not None:
        _ledger.cells.append(code)


def settle(func=None) -> None:
    """After a call of `func`: the names its code assigned (or a cell's), or that no
    longer hold the caller's object, are the rank's from now on; the caller's objects
    they held are forgotten, so that they are freed now rather than at the next call."""
    ledger = _ledger
    if ledger is None:
        return
    namespace, given = ledger.namespace, ledger.given
    runs, ledger.cells = [f for f in (func, *ledger.cells) if f is not None], []
    for name in [n for n, obj in given.items() if namespace.get(n, _MISSING) is not obj]:
        del given[name]
    if given and runs:
        try:
            assigned = _assigned_by(runs, namespace, set(given))
        except Exception:  # noqa: BLE001 - odd code or objects: identity alone decides
            assigned = set()
        for name in assigned:
            del given[name]


def take_kept() -> List[str]:
    """The names whose caller's values the last load did not install over the rank's
    own, each reported once in the rank's life."""
    ledger = _ledger
    if ledger is None or not ledger.kept:
        return []
    kept, ledger.kept = ledger.kept, []
    return kept


def _dunder(name: str) -> bool:
    # __file__, __builtins__ ...: the module's own attributes, not the user's state
    return name.startswith("__") and name.endswith("__")


def _differ(current, value) -> bool:
    if current is value:
        return False
    if type(current) is not type(value) or type(current) not in _PLAIN:
        return True
    try:
        return not bool(current == value)
    except Exception:  # noqa: BLE001 - a container of tensors, say
        return True


_STORE_GLOBAL = opcode.opmap["STORE_GLOBAL"]
_STORE_NAME = opcode.opmap["STORE_NAME"]
_MAIN_NAMES = ("__main__", "__mp_main__")   # as _wire.mainmod.MAIN_NAMES (which imports us)


def _assigned_by(runs, namespace: dict, wanted: Set[str]) -> Set[str]:
    """The names of `wanted` that the code in `runs` assigns: a function's ``global``
    statements, a ``%%ranks`` cell's assignments (a code object run in `namespace`),
    and the ``global`` statements of the functions and classes of `namespace` that
    they name, and of theirs. Code that may not have run counts too: a function that
    declares ``global best`` and assigns it makes ``best`` state of the process it
    runs in."""
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
            todo.extend(vars(obj).values())
        elif isinstance(obj, (types.FunctionType, types.CodeType)):
            cell = isinstance(obj, types.CodeType)
            if not cell and obj.__globals__ is not namespace:
                continue   # another module's: its globals are not __main__'s
            for code in _codes(obj if cell else obj.__code__):
                # A cell's own statements bind names with STORE_NAME (a module's code);
                # in the functions and classes it defines, that is a local or a class
                # attribute.
                found |= _stores(code, wanted, cell and code is obj)
                for name in code.co_names:
                    value = namespace.get(name)
                    if isinstance(value, types.FunctionType) or (
                            isinstance(value, type) and value.__module__ in _MAIN_NAMES):
                        todo.append(value)
    return found


def _codes(code):
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _codes(const)


def _stores(code, wanted: Set[str], module_level: bool) -> Set[str]:
    names = code.co_names
    if wanted.isdisjoint(names):
        return set()
    ops = (_STORE_GLOBAL, _STORE_NAME) if module_level else (_STORE_GLOBAL,)
    found, raw, extended = set(), code.co_code, 0
    for i in range(0, len(raw), 2):
        op, arg = raw[i], raw[i + 1] | extended
        extended = arg << 8 if op == opcode.EXTENDED_ARG else 0
        if op in ops and arg < len(names) and names[arg] in wanted:
            found.add(names[arg])
    return found
