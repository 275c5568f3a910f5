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
  again until the rank binds it anew; a name the rank deleted follows the caller again;
- a name the caller deleted, that a function it sends names, is deleted in the rank too
  where it still holds the caller's object (`launch` would raise NameError there): the
  caller says which names its functions name but it lacks (`function_reduce`).

How the rank tells its own names: the ledger remembers, for each name, the object it
last put there from the caller. After each call, a name that no longer holds that very
object was bound by the rank; so was one that the code the call ran assigns, which
catches ``model = model.to(device)``, a rebinding to the same object. That code is the
call's function, every function of the caller's `__main__` that the call brought,
wherever it was (the rank's load notes each as it makes it, `function_setstate`, so no
object of the payload is searched for them), a ``%%ranks`` cell's statements, and what
they read as globals; what it assigns is read from its bytecode (_wire.codescan, which
says what is seen and what is not). Where code binds a name in a way not seen there,
identity alone decides: where it binds the very object the caller sent (a small int,
None, the model it sent), the name stays the caller's; docs/world.rst says so.

Identity and assignment, not equality: an object the rank changes in place
(``history.append(x)``) is still the caller's, and the caller's next copy replaces it,
as before; but not a torch module, optimizer, LR scheduler or tensor that the caller
still holds unchanged (a model and its optimizer built in a notebook's cell and
stepped by a run, ``opt.step()``: each run started training again, silently). For
those the caller sends, with each name, a fingerprint (_wire.fingerprints: who the
object is, what in it can change in place). Where the caller's object is the one whose
copy the rank holds, unchanged since, the rank keeps its copy, changed in place or not,
and the caller's new copy is dropped; where the caller rebound the name or changed the
object, the rank takes it, and where the rank had changed its copy the caller is told
that this was lost (``replaced``), once per object of the caller's.
Objects that share tensors (an optimizer holds its model's parameters; a scheduler its
optimizer) are kept or taken together, or the rank's optimizer would step a model that
is no longer its `__main__`'s; so is a kept object that anything else the call brought
holds (an argument, a dict, a trainer of the user's): those hold the caller's copy.
A name the rank's own code bound is said once per object of the caller's, not once
per name: another model here under that name is said again.

Rejected: ipyparallel's ``@interactive`` way, where a function resolves every global in
the engine's namespace and nothing travels unless pushed: mplaunch's functions run with
the caller's constants and helpers without a push (in `launch` as in a World), and users
rely on it. (What was rejected for telling changes is said in _wire.codescan and
_wire.fingerprints.)
"""
from __future__ import annotations

import gc
import sys
import types
from typing import Dict, Iterable, List, Optional

from . import codescan, fingerprints

__all__ = ["track", "function_reduce", "function_setstate", "install", "push",
           "cell_runs", "settle", "take_kept"]

_MISSING = object()
# Values whose == is plain data comparison, safe to call and a real bool: where the
# rank's value and the caller's are equal, keeping the rank's changes nothing worth
# saying. (Any other type is said to differ: no user __eq__ runs here.)
_PLAIN = (type(None), bool, int, float, complex, str, bytes, tuple, list, dict, set,
          frozenset)


class _Ledger:
    __slots__ = ("namespace", "given", "told", "kept", "brought", "prints", "own",
                 "since", "loads", "spared")

    def __init__(self, namespace: dict):
        self.namespace = namespace
        self.given: Dict[str, object] = {}   # name -> the caller's object put there last
        self.told: set = set()               # (name, the caller's token) reported
        # What to report after this load: (kind, name, the caller's token, why).
        self.kept: List[tuple] = []
        # The code this call brought: the caller's `__main__` functions its payload
        # held, the code of the %%ranks cells it runs. Kept until `settle` reads it.
        self.brought: list = []
        # The torch objects among `given` (see the module's docstring): name -> the
        # (token, state) the caller sent with it, its own state's digest when it came,
        # and the load it came with (`loads` counts them).
        self.prints: Dict[str, tuple] = {}
        self.own: Dict[str, int] = {}
        self.since: Dict[str, int] = {}
        self.loads = 0
        # name -> the caller's copy this load brought and did not install, the rank's
        # staying: dropped at the load's end (`take_kept`).
        self.spared: Dict[str, object] = {}


_ledger: Optional[_Ledger] = None


def track(namespace: dict) -> None:
    """In a rank: `namespace` (its `__main__`'s) is the one whose names are kept apart;
    the same namespace keeps its ledger from call to call."""
    global _ledger
    if _ledger is None or _ledger.namespace is not namespace:
        _ledger = _Ledger(namespace)


def function_reduce(rv, defined: Iterable[str], missing: Iterable[str] = ()):
    """cloudpickle's reduction `rv` of a function of the caller's `__main__`, rewritten
    so that the rank installs the function's globals through `install` (`defined`: the
    names among them that the caller's `__main__` defines as that class or function;
    `missing`: the globals the function's code names that the caller's `__main__` does
    not hold, deleted or never made). Any other shape of `rv` is returned as it is."""
    if type(rv) is not tuple or len(rv) != 6 or rv[5] is None:
        return rv
    make, args, state, items, pairs, setter = rv
    defined = tuple(defined)
    return (make, args, (setter, state, defined, tuple(missing), _prints(state, defined)),
            items, pairs, function_setstate)


def _prints(state, defined: tuple) -> dict:
    """{name: (token, state)} of the globals in cloudpickle's `state` of a function: who
    each object is here and, for a torch object, what it holds (_wire.fingerprints)."""
    try:
        named = state[1]["__globals__"]
    except (TypeError, LookupError):
        return {}
    return {k: (fingerprints.token(v), fingerprints.state(v)) for k, v in named.items()
            if k not in defined and not _dunder(k)}


def function_setstate(func, packed) -> None:
    """The rank's side of `function_reduce`: cloudpickle's own state setter, given no
    globals, then the globals through the ledger; the function is noted as code this
    call brought (`settle` reads what it assigns, wherever the payload held it)."""
    setter, state, defined, missing, prints = packed
    inner, slots = state
    values = slots.get("__globals__") or {}
    slots["__globals__"] = {}
    setter(func, (inner, slots))
    ledger = _ledger
    if ledger is not None and func.__globals__ is ledger.namespace:
        ledger.brought.append(func)
    install(func.__globals__, values, defined, missing, prints)


def install(namespace: dict, values: dict, defined: Iterable[str] = (),
            missing: Iterable[str] = (), prints: Optional[dict] = None) -> None:
    """Put the caller's `values` into `namespace`, but not over a name the rank's own
    code bound (see the module's docstring), nor over a torch object the rank holds
    a copy of that the caller did not change since (`prints`: `_prints`); `defined`
    names always go in. The `missing` names (the caller has none) leave `namespace`
    where they still hold the caller's object: the rank's own stay."""
    ledger = _ledger
    if ledger is None or namespace is not ledger.namespace:
        namespace.update(values)   # a namespace nobody ran code in yet: all of it
        return
    given, defined = ledger.given, set(defined)
    for name in missing:
        obj = given.get(name, _MISSING)
        if obj is not _MISSING and namespace.get(name, _MISSING) is obj:
            del namespace[name], given[name]
            _forget(ledger, name)
    for name, value in values.items():
        current = namespace.get(name, _MISSING)
        token, state = prints.get(name, (None, None)) if prints else (None, None)
        if (current is not _MISSING and current is not given.get(name, _MISSING)
                and name not in defined and not _dunder(name)):
            if (name, token) not in ledger.told and _differ(current, value):
                ledger.told.add((name, token))
                ledger.kept.append(("kept", name, token, None))
            continue
        if current is value:
            continue   # a second function of this load that names it
        why = None
        if (state is not None and current is not _MISSING and name not in defined
                and ledger.prints.get(name) == (token, state)):
            # The caller's object is the one the rank's copy came from, unchanged:
            # the copy stays, with what the rank changed in it, unless an object it
            # shares tensors with came later (the two would no longer be linked).
            other = _taken_after(ledger, name)
            if other is None:
                ledger.spared[name] = value
                continue
            why = "shares:" + other
        _take(ledger, name, value, token, state, why)


def _take(ledger: _Ledger, name: str, value, token, state, why=None) -> None:
    """The caller's `value` goes in under `name`; where a copy the rank had changed in
    place goes, that is reported. Spared copies that share tensors with it follow."""
    namespace, prints = ledger.namespace, ledger.prints
    old, own, before = (namespace.get(name, _MISSING), ledger.own.get(name),
                        prints.get(name))
    if own is not None and old is ledger.given.get(name, _MISSING) and \
            fingerprints.digest(old) != own:
        if why is None:
            why = "changed" if before is not None and before[0] == token else "new"
        ledger.kept.append(("replaced", name, token, why))
    namespace[name] = ledger.given[name] = value
    _forget(ledger, name)
    if state is None:
        return
    prints[name], ledger.own[name] = (token, state), fingerprints.digest(value)
    ledger.since[name] = ledger.loads
    ids = set(state[1])
    for other in [n for n in ledger.spared if not ids.isdisjoint(prints[n][1][1])]:
        if other in ledger.spared:   # not taken meanwhile, by the recursion
            _take(ledger, other, ledger.spared.pop(other), *prints[other],
                  why="shares:" + name)


def _taken_after(ledger: _Ledger, name: str) -> Optional[str]:
    """A name whose torch object shares tensors with `name`'s and came to the rank
    with a later load (or earlier in this one), if any."""
    ids, since = set(ledger.prints[name][1][1]), ledger.since[name]
    for other, (_, state) in ledger.prints.items():
        if ledger.since[other] > since and not ids.isdisjoint(state[1]):
            return other
    return None


def _forget(ledger: _Ledger, name: str) -> None:
    ledger.prints.pop(name, None)
    ledger.own.pop(name, None)
    ledger.since.pop(name, None)


def push(namespace: dict, values: dict) -> None:
    """``%ranks push``: the caller's values, over the rank's own on purpose; the names
    follow the caller again (until the rank's code binds them anew)."""
    namespace.update(values)
    ledger = _ledger
    if ledger is not None and namespace is ledger.namespace:
        ledger.given.update(values)
        for name, value in values.items():
            # Not from a run: the next run's object replaces it, said if the rank
            # changed this one in place meanwhile.
            _forget(ledger, name)
            digest = fingerprints.digest(value)
            if digest is not None:
                ledger.own[name] = digest


def cell_runs(code) -> None:
    """A ``%%ranks`` cell's code is about to run in the rank's `__main__` (_rank.cells):
    `settle` reads what it assigns. (Not in the notebook, which compiles it too.)"""
    if _ledger is not None:
        _ledger.brought.append(code)


def settle(func=None) -> None:
    """After a call of `func`: the names the code it ran or brought assigned, or that no
    longer hold the caller's object, are the rank's from now on; the caller's objects
    they held are forgotten, so that they are freed now rather than at the next call."""
    ledger = _ledger
    if ledger is None:
        return
    namespace, given = ledger.namespace, ledger.given
    runs, ledger.brought = [f for f in (func, *ledger.brought) if f is not None], []
    ledger.spared.clear()   # a load that did not end: nothing of it stays
    for name in [n for n, obj in given.items() if namespace.get(n, _MISSING) is not obj]:
        del given[name]
        _forget(ledger, name)
    if given and runs:
        try:
            assigned = codescan.assigned_by(runs, namespace, set(given))
        except Exception:  # noqa: BLE001 - odd code or objects: identity alone decides
            assigned = set()
        for name in assigned:
            del given[name]
            _forget(ledger, name)


def take_kept() -> List[tuple]:
    """At the end of a load (before the call runs): what the caller is told of it,
    (kind, name, the caller's token, why): ``kept``, a name the rank's own code bound
    kept over the caller's value (once per name and caller's object in the rank's
    life); ``replaced``, a torch object the rank had changed in place, replaced by the
    caller's (why: ``new``, ``changed``, ``shares:NAME``, ``held``). The caller's
    copies that the rank did not install are dropped, but those that something else
    the load brought holds (an argument, a dict): the rank takes those instead."""
    ledger = _ledger
    if ledger is None:
        return []
    if ledger.spared:
        try:
            held = _held_elsewhere(ledger)
        except Exception:  # noqa: BLE001 - cannot tell: the caller's copies, as before
            held = list(ledger.spared)
        for name in held:
            if name in ledger.spared:
                _take(ledger, name, ledger.spared.pop(name), *ledger.prints[name],
                      why="held")
        ledger.spared.clear()
    ledger.loads += 1
    kept, ledger.kept = ledger.kept, []
    return kept


def _held_elsewhere(ledger: _Ledger) -> List[str]:
    """The names of `spared` whose copy something of the load holds besides the spared
    copies themselves (each other, what they hold): another global (a trainer, a dict),
    an argument. Told by reference counts: each copy's, less the references that the
    spared copies' own objects hold to it (their walk stops at classes, modules and
    functions, which lead everywhere), against a probe's, which only this function
    holds as it holds the copies. No search of the payload or of the heap, and only the
    top of each copy: a model's thousand modules are not walked."""
    spared = ledger.spared
    spared[""] = object()   # the probe ("": no global's name), held only here
    try:
        pairs = list(spared.items())
        inner = {id(copy): 0 for _, copy in pairs}
        seen = {id(spared), id(pairs)}
        todo = [(copy, 0) for _, copy in pairs]
        while todo:
            obj, depth = todo.pop()
            if id(obj) in seen or isinstance(obj, _OPAQUE):
                continue
            seen.add(id(obj))
            for ref in gc.get_referents(obj):
                if id(ref) in inner:
                    inner[id(ref)] += 1
                if depth < _DEPTH:
                    todo.append((ref, depth + 1))
        del todo, obj
        counts = {name: sys.getrefcount(copy) - inner[id(copy)] for name, copy in pairs}
    finally:
        del spared[""]
    base = counts.pop("")
    return [name for name, count in counts.items() if count > base]


_OPAQUE = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType,
           types.CodeType)
# How deep a copy's references to the others are looked for: its attributes' dict, the
# attributes, theirs (a scheduler's optimizer, an optimizer's patched ``step``). One
# deeper is taken for a holder of its own: the copies are then taken, as before.
_DEPTH = 2


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
