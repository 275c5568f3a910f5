"""A rank's exception across the process boundary: pickled with its chain, notes and
real traceback frames (code objects rebuilt so that every Python shows the failing line),
rebuilt in the parent with the same type; a RemoteException with the text when it will
not pickle.

mplaunch's own pickler does this instead of tblib's ``pickling_support.install()``,
which changes pickling for the whole process: after it, ``SystemExit(3)`` came back
with ``code=None`` in the user's process. tblib only rebuilds the frames whose code
cannot be compiled here.
"""
from __future__ import annotations

import io
import pickle
import sys
import traceback as _tb
from types import TracebackType

from ..errors import RemoteException
from .pickler import Pickler

__all__ = ["pack_exception", "unpack_exception", "exception_type_name"]


def pack_exception(exc: BaseException):
    """(pickled exception or None, type name, message, traceback text). The text always
    arrives, even when the exception itself will not pickle."""
    tb_text = "".join(_tb.format_exception(type(exc), exc, exc.__traceback__))
    type_name = exception_type_name(exc)
    message = _message_of(exc)
    blob = None
    try:
        buf = io.BytesIO()
        _ExceptionPickler(buf).dump(exc)
        blob = buf.getvalue()
        # Prove it comes back in one piece here, where we can still fall back to text.
        pickle.loads(blob)
    except Exception:  # noqa: BLE001
        blob = None
    return blob, type_name, message, tb_text


def unpack_exception(blob, type_name, message, tb_text) -> BaseException:
    """The exception from pack_exception's parts. Without a blob (another node's report
    carries none: nothing read from the network is unpickled), a built-in exception
    type is rebuilt from its name and message, the worker's traceback as a note."""
    if blob is not None:
        try:
            return pickle.loads(blob)
        except Exception:  # noqa: BLE001 - e.g. the class is not importable here
            pass
    return _builtin(type_name, message, tb_text) or RemoteException(type_name, message,
                                                                    tb_text)


def _builtin(type_name, message, tb_text):
    import builtins
    cls = getattr(builtins, type_name, None) if isinstance(type_name, str) else None
    if not (isinstance(cls, type) and issubclass(cls, Exception)):
        return None
    try:
        exc = cls(message)
    except Exception:  # noqa: BLE001 - a constructor that wants other arguments
        return None
    if tb_text:
        exc.__notes__ = ["Worker traceback:\n" + tb_text.rstrip("\n")]
    return exc


def exception_type_name(exc: BaseException) -> str:
    """'ValueError' for builtins, 'package.module.Error' for the rest."""
    name = type(exc).__qualname__
    module = type(exc).__module__
    if module not in ("builtins", "__main__", None):
        name = f"{module}.{name}"
    return name


def _message_of(exc: BaseException) -> str:
    try:
        return str(exc)
    except Exception:  # noqa: BLE001 - a broken __str__ must not hide the failure
        return f"<{type(exc).__name__} with a failing __str__>"


class _ExceptionPickler(Pickler):
    """Pickles an exception with its traceback frames, __cause__, __context__ and
    __notes__, without touching the process-wide copyreg table (registering picklers
    there would change how every exception pickles in the user's process from then on).

    Each exception of the chain travels on its own terms: one that will not pickle, or
    would not rebuild, is replaced by a RemoteException carrying its type name, message
    and frames, and the rest of the chain still arrives as the real thing.
    """

    def __init__(self, file):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)

    def reducer_override(self, obj):
        if isinstance(obj, type) and issubclass(obj, BaseException):
            home = _true_home(obj)
            if home is not None:
                return _import_attr, home
        if isinstance(obj, TracebackType):
            return _rebuild_traceback, (_frames_of(obj),)
        if isinstance(obj, BaseException):
            return _reduce_exception(obj)
        return super().reducer_override(obj)


# -- tracebacks --------------------------------------------------------------------------
#
# A traceback travels as a flat list of frames (a 1000-frame RecursionError must not
# become a 1000-deep nest of pickled objects), and is rebuilt in the parent as a real
# traceback whose frames carry each function's name, file, first line, failing line and
# the columns of the failing expression. So debuggers, pytest, IPython and Python's own
# traceback module show the worker's frames as they would have shown them there: the
# right line marked, the right expression underlined.

def _frames_of(tb) -> list:
    frames = []
    while tb is not None:
        code = tb.tb_frame.f_code
        lineno = tb.tb_lineno
        if not isinstance(lineno, int) or lineno < 1:  # an instruction with no line
            lineno = max(code.co_firstlineno, 1)
        span = None
        try:
            positions = list(code.co_positions())[tb.tb_lasti // 2]
        except (AttributeError, IndexError, ValueError):
            positions = (None, None, None, None)
        _line, end_lineno, col, end_col = positions
        if col is not None and end_col is not None and end_lineno == lineno:
            span = (col, end_col)
        elif col is not None and end_col is not None and end_lineno and end_lineno > lineno:
            # A multi-line expression: 3.11 and 3.12 mark its first line, 3.13 all of
            # its lines; either way, from these positions.
            span = (col, end_col, end_lineno)
        hide = {}
        for where in (tb.tb_frame.f_globals, tb.tb_frame.f_locals):
            # pytest's marker for frames to leave out of its reports.
            flag = where.get("__tracebackhide__")
            if isinstance(flag, bool):
                hide["__tracebackhide__"] = flag
        frames.append((code.co_filename, code.co_name, code.co_firstlineno, lineno, span,
                       tb.tb_frame.f_globals.get("__name__"), hide))
        tb = tb.tb_next
    return frames


def _frame_code(filename, name, firstlineno, lineno, span):
    """A code object that fails at `lineno`, at the columns `span`, in a function called
    `name` that starts at `firstlineno` of `filename`.

    It evaluates an undefined name of exactly the failing expression's width, placed at
    its column; the NameError that raises is discarded, only its frame is kept. An
    expression over several lines (span is (col, end col, end line)) is a subscript of
    something that cannot be subscripted, as wide and as tall, which fails with a
    TypeError instead."""
    first = firstlineno if 0 < firstlineno <= lineno else lineno
    if span is not None and len(span) == 3 and span[2] > lineno and span[1] > 0:
        col, end_col, end_lineno = span
        # Parentheses, so that the expression may start at any column; none at column 0.
        opener, closer = (f"({' ' * (col - 1)}", ")") if col else ("", "")
        lines = ([f"{opener}len[0"] + [""] * (end_lineno - lineno - 1)
                 + [f"{' ' * (end_col - 1)}]{closer}"])
        source = "\n" * (lineno - first) + "\n".join(lines)
        code = compile(source, filename, "exec", dont_inherit=True)
        return code.replace(co_name=name, co_firstlineno=first)
    if span is not None and span[1] > span[0]:
        col, width = span[0], span[1] - span[0]
    else:
        col, width = 0, 1
    undefined = "_" * width  # no builtin is named only with underscores
    line = f"({' ' * (col - 1)}{undefined})" if col else undefined
    source = "\n" * (lineno - first) + line
    code = compile(source, filename, "exec", dont_inherit=True)
    if sys.version_info < (3, 10):
        # Before 3.10, lines are deltas from co_firstlineno, and the compiler starts a
        # module's code at its first statement: moving co_firstlineno to the `def` line
        # would move the failing line there too. Say again where it is.
        return code.replace(co_name=name, co_firstlineno=first,
                            co_lnotab=_lnotab_at(lineno - first))
    return code.replace(co_name=name, co_firstlineno=first)


def _lnotab_at(delta: int) -> bytes:
    """A co_lnotab that puts every instruction `delta` lines below co_firstlineno: one
    entry can move at most 127 lines, so a long way takes several."""
    out = bytearray()
    while delta > 127:
        out += bytes((0, 127))
        delta -= 127
    out += bytes((0, delta))
    return bytes(out)


def _rebuild_traceback(frames):
    top = last = None
    for filename, name, firstlineno, lineno, span, module, hide in frames:
        try:
            code = _frame_code(filename, name, firstlineno, lineno, span)
        except Exception:  # noqa: BLE001 - an odd name or file: keep at least the line
            tb = _tblib_frame(filename.replace("\0", "\\0"), name, lineno, module)
        else:
            try:
                exec(code, {"__name__": module, "__file__": filename}, dict(hide))  # noqa: S102
            except (NameError, TypeError):
                tb = sys.exc_info()[2].tb_next
            else:  # pragma: no cover - the code above always raises
                continue
        if tb is None:
            continue
        if top is None:
            top = tb
        else:
            last.tb_next = tb
        last = tb
    return top


def _tblib_frame(filename, name, lineno, module):
    """One frame rebuilt the way tblib does it, for what our precise rebuild cannot
    compile. tblib places each frame's code at the failing line, which is why it is not
    the main path: IPython would mark the wrong line and carets the wrong columns."""
    from tblib import Traceback
    try:
        return Traceback.from_dict({
            "tb_frame": {"f_code": {"co_filename": filename, "co_name": name},
                         "f_globals": {"__name__": module, "__file__": filename},
                         "f_locals": {}, "f_lineno": lineno},
            "tb_lineno": lineno, "tb_next": None,
        }).as_traceback()
    except Exception:  # noqa: BLE001
        return None


def _true_home(cls):
    """(module, name) to import `cls` from, for a class whose __module__ does not lead
    back to it: pytest, for one, declares its outcome exceptions (Skipped, Failed) to be
    in "builtins" so they print short. By value they would arrive as a look-alike class
    that `except pytest.skip.Exception` does not catch. None when pickle finds it."""
    module = sys.modules.get(cls.__module__)
    if module is not None and getattr(module, cls.__qualname__, None) is cls:
        return None
    if cls.__qualname__ != cls.__name__:
        return None
    for name, module in list(sys.modules.items()):
        if name == "__main__" or module is None:
            continue
        try:
            # vars(), not getattr(): a module-level __getattr__ may import things.
            if vars(module).get(cls.__name__) is cls:
                return name, cls.__name__
        except TypeError:
            continue
    return None


def _import_attr(module: str, name: str):
    import importlib
    return getattr(importlib.import_module(module), name)


def _reduce_exception(exc: BaseException):
    own = _own_parts(exc)
    if own is None:
        text = "".join(_tb.format_exception(type(exc), exc, exc.__traceback__, chain=False))
        own = (RemoteException, (exception_type_name(exc), _message_of(exc), text), None)
    return (_rebuild_exception,
            own + (exc.__cause__, exc.__traceback__, exc.__context__,
                   exc.__suppress_context__, getattr(exc, "__notes__", None)))


def _own_parts(exc: BaseException):
    """(callable, args, state) that rebuild `exc` without its chain, checked by doing
    it; None if that cannot be done."""
    try:
        reduced = exc.__reduce__()
        func, args = reduced[0], tuple(reduced[1])
        state = reduced[2] if len(reduced) > 2 else None
        buf = io.BytesIO()
        # Through the same pickler: args may hold exceptions too (an ExceptionGroup's).
        _ExceptionPickler(buf).dump((func, args, state))
        _rebuild_exception(*pickle.loads(buf.getvalue()), None, None, None, False, None)
    except Exception:  # noqa: BLE001 - anything wrong means: send a stand-in
        return None
    return func, args, state


def _rebuild_exception(func, args, state, cause, tb, context, suppress_context, notes):
    is_class = isinstance(func, type) and issubclass(func, BaseException)
    try:
        exc = func(*args)
    except Exception:  # noqa: BLE001
        # An __init__ whose signature does not match its args (a common way to write
        # exception classes): build it without __init__.
        if not is_class:
            raise
        exc = func.__new__(func, *args)
    if is_class and isinstance(exc, func):
        # args are what str() shows; an __init__ that decorates its message
        # ("prefix: " + msg) must not decorate it a second time.
        exc.args = args
    if isinstance(state, dict):
        for key, value in state.items():
            setattr(exc, key, value)
    elif state is not None:
        exc.__setstate__(state)
    exc.__cause__ = cause
    exc.__context__ = context
    exc.__suppress_context__ = suppress_context
    exc.__traceback__ = tb
    if notes is not None:
        exc.__notes__ = notes
    return exc
