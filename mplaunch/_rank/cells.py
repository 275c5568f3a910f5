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
# traceback in the notebook (which shows it once for all ranks: raised_by_cell).

class Cell:
    __slots__ = ("filename", "shown", "offset", "body")

    def __init__(self, filename: str, shown: str, offset: int, body: str):
        self.filename, self.shown, self.offset, self.body = filename, shown, offset, body

    def __reduce__(self):
        return cell_code, (self.filename, self.shown, self.offset, self.body)


# The code of the cell this rank runs (or ran last): cell_code's.
_running = None


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
    global _running
    _running = code
    return code


def raised_by_cell(exc: BaseException) -> bool:
    """Whether `exc` is an exception that came out of the ``%%ranks`` cell this rank
    runs. The notebook shows it as the cell's error, once, with which ranks raised the
    same (mplaunch._magic), so the rank does not print it to its stderr as well, which
    would relay one traceback per rank above it (_rank.worker's _send_exception). An
    interrupt (a BaseException) is still printed: it shows where each rank was."""
    if _running is None or not isinstance(exc, Exception):
        return False
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code is _running:
            return True
        tb = tb.tb_next
    return False


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


def pull(name: str, pickled: bool = False) -> Tuple[str, Any]:
    """("ok", value), or ("missing", None), or ("unpicklable", reason): a look-up that
    fails must not fail the run, which would tear the world down.

    `pickled`: ("pickled", (what, blob)) for "ok", the value's pickle and what it is
    (:func:`_what`), for the notebook to rebuild itself: asked when the kernel could not
    rebuild the value (a DistributedDataParallel module needs a process group), so that
    it can say why."""
    namespace = _main_namespace()
    if name not in namespace:
        return "missing", None
    value = namespace[name]
    try:
        from .._wire.pickler import dumps
        blob = dumps(value)
    except Exception as exc:  # noqa: BLE001 - any failure is the answer
        return "unpicklable", f"{type(value).__name__}: {type(exc).__name__}: {exc}"
    if pickled:
        return "pickled", (_what(value), blob)
    return "ok", value


def _what(value) -> Dict[str, Any]:
    """What the notebook says about a value it could not rebuild: its type's name,
    whether it is a torch module, and whether it wraps one in ``.module`` (DDP, FSDP,
    DataParallel), which is what to pull instead."""
    nn = getattr(sys.modules.get("torch"), "nn", None)
    module = getattr(nn, "Module", None)
    is_module = module is not None and isinstance(value, module)
    return {"type": type(value).__name__,
            "module": is_module,
            "wraps": is_module and isinstance(getattr(value, "module", None), module)}
