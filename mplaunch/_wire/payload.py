"""What crosses the process boundary in each direction: the function and its arguments
(cloudpickle, once, in the parent), and each rank's return value (large tensors through
shared memory). Exceptions have a module of their own (_wire.exceptions)."""
from __future__ import annotations

import contextlib
import ctypes
from collections import ChainMap
import io
import mmap
import os
import pickle
import sys
import types

import cloudpickle

from . import mainglobals, mainmod, reducers
from .pickler import Pickler, dumps as _dumps

__all__ = ["dumps_payload", "loads_payload", "dumps_result", "loads_result"]


def _pickling_problem(obj) -> str | None:
    try:
        _dumps(obj)
    except Exception as exc:  # noqa: BLE001 - any failure is the answer
        return f"{type(exc).__name__}: {exc}"
    return None


def dumps_payload(func, args, kwargs):
    """Pickle what every rank runs, once. On failure, name the piece that would not
    pickle, so the user knows what to change. Bytes, or where the arguments (or the
    globals the `__main__` part carries) hold large buffers (tensors, arrays), a
    _wire.buffers.Payload: those go out of band, into the file every rank maps
    (InputsTooLarge, a MemoryError, if they cannot fit).

    Two pickles, then the offset of the second: the function, its arguments and the
    sources of unsaved code, which name the classes and functions of `__main__` they
    reach; then those, by value (the rank makes them its `__main__` before it loads
    the first pickle, and the rank's own children load them too: see _wire.mainmod).
    This order writes each byte once: no copy of a large payload to put one first."""
    sink = reducers.sink()
    try:
        main = sys.modules.get("__main__")
        out = io.BytesIO()
        pickler = _InputsPickler(out, main, by_name=True, buffer_callback=sink)
        pickler.dump((func, tuple(args), dict(kwargs), _unsaved_sources(func)))
        head_at = out.tell()
        if pickler.found:
            names = tuple(n for n in mainmod.MAIN_NAMES if sys.modules.get(n) is main)
            attrs = {k: vars(main)[k] for k in ("__file__", "__package__")
                     if k in vars(main)}
            # The globals of `__main__`'s functions (a tensor a notebook cell made) go
            # out of band as the arguments do: one copy per machine, not one per rank.
            sink.main_part()
            with _by_value(main):
                _MainPartPickler(out, main, by_name=False, buffer_callback=sink).dump(
                    (names, attrs, pickler.found))
        else:
            pickle.dump(None, out, protocol=pickle.HIGHEST_PROTOCOL)
        out.write(head_at.to_bytes(8, "little"))
        pickled = out.getvalue()
    except reducers.CannotSend:
        raise
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
    return sink.payload(pickled)


def dumps_main_part(main, found: dict) -> bytes:
    """The `__main__` part of a payload alone: `found`'s objects by value, their
    functions' globals standing for the `__main__` of whoever loads them."""
    out = io.BytesIO()
    with _by_value(main):
        _PayloadPickler(out, main, by_name=False).dump(((), {}, found))
    return out.getvalue()


def loads_payload(data: bytes, main_path: str, buffers=()):
    """In a rank: make `__main__` from the payload's second pickle (its children will
    read that again from `main_path`), then return (func, args, kwargs). `buffers`: the
    out-of-band ones (_wire.buffers.read_payload)."""
    # The `__main__` part's buffers follow the first pickle's (its slots come last).
    main_at = getattr(buffers, "main_at", len(buffers))
    mainmod.become_main(memoryview(data)[mainmod.main_offset(data):-8], main_path,
                        buffers[main_at:])
    # stops at the first pickle's end
    func, args, kwargs, sources = pickle.loads(data, buffers=buffers[:main_at])
    import linecache
    for filename, lines in sources.items():
        linecache.cache.setdefault(filename, (sum(map(len, lines)), None, lines, filename))
    return func, args, kwargs


class _PayloadPickler(Pickler):
    """mplaunch's cloudpickle (code keeps its file: see _wire.pickler), and two things
    about `__main__`:

    - with `by_name`, a class or function found by name in `__main__` is written as a
      reference to the rank's `__main__` (and collected in `found`, to go by value in
      the payload's first pickle), so that the rank's objects and its `__main__`'s are
      the same: pickle finds them there;
    - the globals of functions defined in `__main__` become the `__main__` namespace
      of the process that unpickles them (see mainmod.MainGlobals), and the values
      they name go in there through the rank's ledger (_wire.mainglobals), which
      keeps the names a World's rank bound itself.
    """

    def __init__(self, file, main, by_name: bool, buffer_callback=None):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL,
                         buffer_callback=buffer_callback)
        self._main = main
        self._by_name = by_name and main is not None
        self.found: dict = {}
        self._main_globals = mainmod.MainGlobals()
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
            if id(g) not in self.globals_ref and g.get("__name__") in mainmod.MAIN_NAMES:
                self.globals_ref[id(g)] = self._main_globals
        elif not issubclass(t, type):
            return _cloudpickle_reduce(self, obj)
        if self._by_name:
            qualname = mainmod.main_qualname(obj, self._main)
            if qualname is not None:
                top = qualname.partition(".")[0]
                self.found[top] = vars(self._main)[top]
                return mainmod.main_attr, (qualname,)
        if t is types.FunctionType and \
                self.globals_ref.get(id(obj.__globals__)) is self._main_globals:
            return self._main_function(obj)
        return _cloudpickle_reduce(self, obj)

    def _main_function(self, func):
        """cloudpickle's reduction of a function whose globals are `__main__`'s, told
        which of the globals it names are the classes and functions `__main__` defines
        under that name (those follow the caller even over a rank's own name), and
        which it names that `__main__` lacks (a World's ranks drop the values of those
        they got from here)."""
        rv = _cloudpickle_reduce(self, func)
        try:
            named = rv[2][1]["__globals__"]
        except (TypeError, LookupError):
            return rv   # not the shape this cloudpickle is known to give
        main = self._main
        return mainglobals.function_reduce(
            rv, [k for k, v in named.items() if isinstance(v, (types.FunctionType, type))
                 and mainmod.main_qualname(v, main) == k],
            [k for k in _code_globals(func.__code__) if k not in named])


_cloudpickle_reduce = Pickler.reducer_override


def _code_globals(code):
    """The global names `code` reads, writes or deletes, nested code's too: those whose
    values cloudpickle sends where `__main__` has them (its own look-up, cached per code
    object; every release since 1.0 has it). Without it, no name is said missing: a
    name deleted here would keep its last value in a World's ranks."""
    find = getattr(sys.modules.get("cloudpickle.cloudpickle"), "_extract_code_globals",
                   None)
    return find(code) if find is not None else ()


class _InputsPickler(_PayloadPickler):
    """The payload's first pickle (the function and its arguments): tensors and arrays
    with gaps by their bytes, out of band (_wire.reducers, _wire.buffers)."""

    dispatch_table = ChainMap(reducers.REDUCERS, _PayloadPickler.dispatch_table)


class _MainPartPickler(_PayloadPickler):
    """The payload's `__main__` part: the classes and functions of `__main__` by value,
    with the globals they read, whose large buffers go out of band as the arguments'
    do. A CUDA tensor there is not refused (an argument is): it travels as torch
    pickles it, as it always did."""

    dispatch_table = ChainMap(reducers.GLOBAL_REDUCERS, _PayloadPickler.dispatch_table)


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


class ResultPickler(Pickler):
    """Pickles a rank's return value. Large CPU tensors, bytes, bytearrays and buffers
    that pickle out of band (numpy arrays) travel through shared memory (an anonymous
    memfd sent over the result socket) rather than as bytes in the stream: one copy in
    the worker, at most one in the parent (none for tensors and arrays, which map the
    memfd), and nothing that can leak in /dev/shm. A 1 GB bytes result once cost the
    parent three copies (the stream, the unpickled object, the buffer it was read into)."""

    def __init__(self, file, fds: list):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL,
                         buffer_callback=self._out_of_band)
        self._fds = fds
        self.buffers: list = []   # (fd index, nbytes) of each out-of-band buffer

    def _memfd(self, view: memoryview) -> int:
        fd = os.memfd_create("mplaunch-result", os.MFD_CLOEXEC)
        try:
            # write() fills the memfd's pages as it allocates them, about twice as fast
            # as faulting them in through a mapping and copying
            done, nbytes = 0, view.nbytes
            while done < nbytes:
                done += os.write(fd, view[done:done + (1 << 30)])
        except BaseException:
            os.close(fd)
            raise
        self._fds.append(fd)
        return len(self._fds) - 1

    def _out_of_band(self, buf: pickle.PickleBuffer) -> bool:
        view = buf.raw()
        if view.nbytes < _SHM_MIN_BYTES:
            return True     # in band
        self.buffers.append((self._memfd(view), view.nbytes))
        return False

    def persistent_id(self, obj):
        cls = type(obj)
        if cls is bytes or cls is bytearray:
            if len(obj) < _SHM_MIN_BYTES:
                return None
            return ("mplaunch." + cls.__name__, self._memfd(memoryview(obj)), len(obj))
        torch = sys.modules.get("torch")
        if torch is None or cls not in (torch.Tensor, torch.nn.Parameter):
            return None
        if not _shareable(torch, obj):
            return None
        t = obj.detach()
        if not t.is_contiguous():
            t = t.contiguous()
        nbytes = t.numel() * t.element_size()
        src = memoryview((ctypes.c_char * nbytes).from_address(t.data_ptr())).cast("B")
        try:
            index = self._memfd(src)
        finally:
            del src
        return ("mplaunch.tensor", index, nbytes, str(t.dtype).split(".")[-1],
                tuple(t.shape), bool(obj.requires_grad))


_SHM_MIN_BYTES = 1 << 16  # below this, pickled bytes are cheaper than an mmap


def _shareable(torch, t) -> bool:
    try:
        return (t.device.type == "cpu" and t.layout == torch.strided
                and not t.is_quantized and not t.is_conj() and not t.is_neg()
                and t.numel() * t.element_size() >= _SHM_MIN_BYTES)
    except Exception:  # noqa: BLE001 - anything unusual takes the plain pickle path
        return False


def _read_into(fd: int, nbytes: int, kind: str):
    """bytes or bytearray with a memfd's content, copied once (the reader loops over
    short reads into the object it returns)."""
    os.lseek(fd, 0, os.SEEK_SET)
    with io.BufferedReader(io.FileIO(fd, "rb", closefd=False)) as f:
        if kind == "bytes":
            data = f.read(nbytes)
        else:
            data = bytearray(nbytes)
            data = data if f.readinto(data) == nbytes else None
    if data is None or len(data) != nbytes:
        raise pickle.UnpicklingError("a result's shared memory was shorter than sent")
    return data


class _ResultUnpickler(pickle.Unpickler):
    def __init__(self, file, fds, buffers=()):
        super().__init__(file, buffers=buffers)
        self._fds = fds

    def persistent_load(self, pid):
        if pid[0] in ("mplaunch.bytes", "mplaunch.bytearray"):
            kind, index, nbytes = pid
            return _read_into(self._fds[index], nbytes, kind.rpartition(".")[2])
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
    """(bytes, fds) for a rank's return value: the pickle, then the list of its
    out-of-band buffers (fd index, size), then that list's offset (8 bytes)."""
    fds: list = []
    buf = io.BytesIO()
    try:
        pickler = ResultPickler(buf, fds)
        pickler.dump(obj)
        at = buf.tell()
        pickle.dump(pickler.buffers, buf, protocol=pickle.HIGHEST_PROTOCOL)
        buf.write(at.to_bytes(8, "little"))
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return buf.getvalue(), fds


def loads_result(data: bytes, fds: list):
    """Rebuild a rank's return value; closes the fds that came with it (an array or
    tensor keeps its mapping of the memory, which is freed with it)."""
    try:
        at = int.from_bytes(data[-8:], "little")
        buffers = [_mapped(fds[index], nbytes)
                   for index, nbytes in pickle.loads(memoryview(data)[at:-8])]
        return _ResultUnpickler(io.BytesIO(data), fds, buffers).load()
    finally:
        for fd in fds:
            os.close(fd)


def _mapped(fd: int, nbytes: int) -> pickle.PickleBuffer:
    return pickle.PickleBuffer(mmap.mmap(fd, nbytes))
