"""What crosses the process boundary: the function and its arguments (cloudpickle, once,
in the parent), and each rank's result or exception (with its chain and traceback frames)."""
from __future__ import annotations

import contextlib
import ctypes
import io
import mmap
import os
import pickle
import sys
import traceback as _tb
import types
from types import TracebackType

import cloudpickle

from . import _rankmain
from .errors import RemoteException

__all__ = ["dumps_payload", "loads_payload", "pack_exception", "unpack_exception",
           "dumps_result", "loads_result"]


def _pickling_problem(obj) -> str | None:
    try:
        cloudpickle.dumps(obj)
    except Exception as exc:  # noqa: BLE001 - any failure is the answer
        return f"{type(exc).__name__}: {exc}"
    return None


def dumps_payload(func, args, kwargs) -> bytes:
    """Pickle what every rank runs, once. On failure, name the piece that would not
    pickle, so the user knows what to change.

    Two pickles, then the offset of the second: the function, its arguments and the
    sources of unsaved code, which name the classes and functions of `__main__` they
    reach; then those, by value (the rank makes them its `__main__` before it loads
    the first pickle, and the rank's own children load them too: see _rankmain).
    This order writes each byte once: no copy of a large payload to put one first."""
    try:
        main = sys.modules.get("__main__")
        out = io.BytesIO()
        pickler = _PayloadPickler(out, main, by_name=True)
        pickler.dump((func, tuple(args), dict(kwargs), _unsaved_sources(func)))
        head_at = out.tell()
        if pickler.found:
            names = tuple(n for n in _rankmain.MAIN_NAMES if sys.modules.get(n) is main)
            attrs = {k: vars(main)[k] for k in ("__file__", "__package__")
                     if k in vars(main)}
            with _by_value(main):
                _PayloadPickler(out, main, by_name=False).dump(
                    (names, attrs, pickler.found))
        else:
            pickle.dump(None, out, protocol=pickle.HIGHEST_PROTOCOL)
        out.write(head_at.to_bytes(8, "little"))
        return out.getvalue()
    except Exception as exc:  # noqa: BLE001
        culprit = None
        problem = _pickling_problem(func)
        if problem:
            culprit = f"the function {getattr(func, '__qualname__', func)!r}"
        else:
            for i, a in enumerate(args):
                problem = _pickling_problem(a)
                if problem:
                    culprit = f"args[{i}] (a {type(a).__name__})"
                    break
            else:
                for k, v in kwargs.items():
                    problem = _pickling_problem(v)
                    if problem:
                        culprit = f"kwargs[{k!r}] (a {type(v).__name__})"
                        break
        culprit = culprit or "the function and its arguments"
        raise TypeError(
            f"mplaunch could not pickle {culprit} to send it to the ranks: "
            f"{problem or f'{type(exc).__name__}: {exc}'}. Every rank gets its own copy "
            "of the function and arguments: pass things that can be pickled (create "
            "locks, open files, sockets and CUDA state inside the function instead)."
        ) from exc


def loads_payload(data: bytes, main_path: str):
    """In a rank: make `__main__` from the payload's second pickle (its children will
    read that again from `main_path`), then return (func, args, kwargs)."""
    _rankmain.become_main(memoryview(data)[_rankmain.main_offset(data):-8], main_path)
    func, args, kwargs, sources = pickle.loads(data)  # stops at the first pickle's end
    import linecache
    for filename, lines in sources.items():
        linecache.cache.setdefault(filename, (sum(map(len, lines)), None, lines, filename))
    return func, args, kwargs


class _PayloadPickler(cloudpickle.Pickler):
    """cloudpickle, and two things about `__main__`:

    - with `by_name`, a class or function found by name in `__main__` is written as a
      reference to the rank's `__main__` (and collected in `found`, to go by value in
      the payload's first pickle), so that the rank's objects and its `__main__`'s are
      the same: pickle finds them there;
    - the globals of functions defined in `__main__` become the `__main__` namespace
      of the process that unpickles them (see _rankmain.MainGlobals).
    """

    def __init__(self, file, main, by_name: bool):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self._main = main
        self._by_name = by_name and main is not None
        self.found: dict = {}
        self._main_globals = _rankmain.MainGlobals()
        if main is not None:
            # cloudpickle gives all functions with the same globals one dict on the
            # other side, created from what it finds here under the globals' id.
            self.globals_ref[id(vars(main))] = self._main_globals

    def reducer_override(self, obj):
        # Called for nearly every object of the payload: the common case (neither a
        # function nor a class) must cost one type check.
        t = type(obj)
        if t is types.FunctionType:
            g = obj.__globals__
            # `__mp_main__` functions' globals are a copy of that module's dict.
            if id(g) not in self.globals_ref and g.get("__name__") in _rankmain.MAIN_NAMES:
                self.globals_ref[id(g)] = self._main_globals
        elif not issubclass(t, type):
            return _cloudpickle_reduce(self, obj)
        if self._by_name:
            qualname = _rankmain.main_qualname(obj, self._main)
            if qualname is not None:
                top = qualname.partition(".")[0]
                self.found[top] = vars(self._main)[top]
                return _rankmain.main_attr, (qualname,)
        return _cloudpickle_reduce(self, obj)


_cloudpickle_reduce = cloudpickle.Pickler.reducer_override


@contextlib.contextmanager
def _by_value(main):
    """cloudpickle pickles what `__main__` defines by value, but not what an importable
    module defines: in a child of multiprocessing's spawn or forkserver, `__main__` is
    the module `__mp_main__`, importable there and nowhere else."""
    if (sys.modules.get("__mp_main__") is not main or not isinstance(main, types.ModuleType)
            or main.__name__ in cloudpickle.list_registry_pickle_by_value()):
        yield
        return
    cloudpickle.register_pickle_by_value(main)
    try:
        yield
    finally:
        cloudpickle.unregister_pickle_by_value(main)


def _unsaved_sources(func) -> dict:
    """{file name: lines} of the code `func` runs that exists in no file: what was
    typed into a notebook cell or IPython (which register it in linecache under a
    made-up name). The ranks install it, so their tracebacks show those lines too."""
    import linecache
    import types
    sources, seen = {}, set()
    todo = [getattr(func, "__func__", func)]
    while todo:
        obj = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, types.FunctionType):
            code = obj.__code__
            g = obj.__globals__
            # Helpers it calls that were defined in other cells.
            todo.extend(v for v in (g.get(n) for n in _all_names(code))
                        if isinstance(v, types.FunctionType) and v.__globals__ is g)
        elif isinstance(obj, types.CodeType):
            code = obj
        else:
            continue
        todo.extend(c for c in code.co_consts if isinstance(c, types.CodeType))
        entry = linecache.cache.get(code.co_filename)
        if entry is not None and len(entry) == 4 and entry[1] is None:
            sources[code.co_filename] = list(entry[2])
    return sources


def _all_names(code) -> set:
    names = set(code.co_names)
    for c in code.co_consts:
        if hasattr(c, "co_names"):
            names |= _all_names(c)
    return names


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
    if blob is not None:
        try:
            return pickle.loads(blob)
        except Exception:  # noqa: BLE001 - e.g. the class is not importable here
            pass
    return RemoteException(type_name, message, tb_text)


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


class _ExceptionPickler(cloudpickle.Pickler):
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


class ResultPickler(cloudpickle.Pickler):
    """Pickles a rank's return value. Large CPU tensors travel through shared memory (an
    anonymous memfd sent over the result socket) rather than as bytes in the stream:
    one copy in the worker, none in the parent, and nothing that can leak in /dev/shm."""

    def __init__(self, file, fds: list):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self._fds = fds

    def persistent_id(self, obj):
        torch = sys.modules.get("torch")
        if torch is None or type(obj) not in (torch.Tensor, torch.nn.Parameter):
            return None
        if not _shareable(torch, obj):
            return None
        t = obj.detach()
        if not t.is_contiguous():
            t = t.contiguous()
        nbytes = t.numel() * t.element_size()
        fd = os.memfd_create("mplaunch-tensor", os.MFD_CLOEXEC)
        try:
            # write() fills the memfd's pages as it allocates them, about twice as fast
            # as faulting them in through a mapping and copying
            src = memoryview((ctypes.c_char * nbytes).from_address(t.data_ptr())).cast("B")
            done = 0
            while done < nbytes:
                done += os.write(fd, src[done:done + (1 << 30)])
            del src
        except BaseException:
            os.close(fd)
            raise
        self._fds.append(fd)
        return ("mplaunch.tensor", len(self._fds) - 1, nbytes, str(t.dtype).split(".")[-1],
                tuple(t.shape), bool(obj.requires_grad))


_SHM_MIN_BYTES = 1 << 16  # below this, pickled bytes are cheaper than an mmap


def _shareable(torch, t) -> bool:
    try:
        return (t.device.type == "cpu" and t.layout == torch.strided
                and not t.is_quantized and not t.is_conj() and not t.is_neg()
                and t.numel() * t.element_size() >= _SHM_MIN_BYTES)
    except Exception:  # noqa: BLE001 - anything unusual takes the plain pickle path
        return False


class _ResultUnpickler(pickle.Unpickler):
    def __init__(self, file, fds):
        super().__init__(file)
        self._fds = fds

    def persistent_load(self, pid):
        kind, index, nbytes, dtype, shape, requires_grad = pid
        if kind != "mplaunch.tensor":
            raise pickle.UnpicklingError(f"unknown persistent id {kind!r}")
        import torch
        dtype = getattr(torch, dtype)
        if nbytes == 0:
            t = torch.empty(shape, dtype=dtype)
        else:
            # The mapping lives as long as the tensor; the memfd is freed with it.
            m = mmap.mmap(self._fds[index], nbytes)
            t = torch.frombuffer(m, dtype=torch.uint8, count=nbytes).view(dtype).reshape(shape)
        if requires_grad:
            t.requires_grad_(True)
        return t


def dumps_result(obj):
    """(bytes, fds) for a rank's return value."""
    fds: list = []
    buf = io.BytesIO()
    try:
        ResultPickler(buf, fds).dump(obj)
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return buf.getvalue(), fds


def loads_result(data: bytes, fds: list):
    """Rebuild a rank's return value; closes the fds that came with it."""
    try:
        return _ResultUnpickler(io.BytesIO(data), fds).load()
    finally:
        for fd in fds:
            os.close(fd)
