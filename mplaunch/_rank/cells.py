"""What a ``%%ranks`` cell and ``%ranks push``/``pull`` do inside a rank (the notebook's
side is mplaunch._magic): the cell's code, compiled in the rank with its lines where
tracebacks find them, run in the rank's ``__main__``; names copied in and out.
"""
from __future__ import annotations

import linecache
import sys
from typing import Any, Dict, Tuple

from .._wire import mainglobals


# A cell travels as two arguments to the builtin exec: its source (compiled in the rank,
# where its lines are also registered for the rank's own traceback) and the rank's
# __main__ namespace, both resolved when the rank unpickles them. No function of ours
# stands between the rank's call and the cell, so the cell's frames are the whole
# traceback, in the rank's stderr and in the notebook.

class Cell:
    __slots__ = ("filename", "shown", "offset", "body")

    def __init__(self, filename: str, shown: str, offset: int, body: str):
        self.filename, self.shown, self.offset, self.body = filename, shown, offset, body

    def __reduce__(self):
        return cell_code, (self.filename, self.shown, self.offset, self.body)


def cell_code(filename: str, shown: str, offset: int, body: str):
    """The code of a cell's body, whose line numbers are those of the cell as shown
    (the body starts `offset` lines down, below the ``%%ranks`` line); its lines are
    registered in linecache under `filename`, so tracebacks show them."""
    import ast
    lines = shown.splitlines(True)
    # mtime None: linecache.checkcache keeps the entry, as it keeps IPython's own.
    linecache.cache[filename] = (len(shown), None, lines, filename)
    tree = ast.parse("\n" * offset + body, filename, "exec")
    _display_last_expression(tree)
    code = compile(tree, filename, "exec", dont_inherit=True)
    mainglobals.cell_runs(code)   # what it assigns is the rank's (_wire.mainglobals)
    return code


def _display_last_expression(tree) -> None:
    """Pass a last expression statement's value to sys.displayhook, as a REPL (and
    IPython) shows a cell's value: in a rank, its repr is printed and relayed."""
    import ast
    if not tree.body or not isinstance(tree.body[-1], ast.Expr):
        return
    expr = tree.body[-1]
    hook = ast.Attribute(value=ast.Call(func=ast.Name("__import__", ast.Load()),
                                        args=[ast.Constant("sys")], keywords=[]),
                         attr="displayhook", ctx=ast.Load())
    expr.value = ast.Call(func=hook, args=[expr.value], keywords=[])
    ast.fix_missing_locations(expr)  # the new nodes take the statement's position


class MainNamespace:
    """Unpickles as the namespace of the rank's current ``__main__``."""

    def __reduce__(self):
        return _main_namespace, ()


def _main_namespace() -> Dict[str, Any]:
    return vars(sys.modules["__main__"])


def push(values: Dict[str, Any]) -> None:
    # Over the rank's own values on purpose: the names follow the notebook again.
    mainglobals.push(_main_namespace(), values)


def pull(name: str) -> Tuple[str, Any]:
    """("ok", value), or ("missing", None), or ("unpicklable", reason): a look-up that
    fails must not fail the run, which would tear the world down."""
    namespace = _main_namespace()
    if name not in namespace:
        return "missing", None
    value = namespace[name]
    try:
        from .._wire.pickler import dumps
        dumps(value)
    except Exception as exc:  # noqa: BLE001 - any failure is the answer
        return "unpicklable", f"{type(value).__name__}: {type(exc).__name__}: {exc}"
    return "ok", value
