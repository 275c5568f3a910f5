"""What crosses the process boundary: the function and its arguments (cloudpickle, once,
in the parent), and each rank's result or exception (tblib keeps tracebacks)."""
from __future__ import annotations

import io
import mmap
import os
import pickle
import sys
import traceback as _tb

import cloudpickle
from tblib import pickling_support

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
    pickle, so the user knows what to change."""
    try:
        return cloudpickle.dumps((func, tuple(args), dict(kwargs)),
                                 protocol=pickle.HIGHEST_PROTOCOL)
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


def loads_payload(data: bytes):
    return pickle.loads(data)


def pack_exception(exc: BaseException):
    """(pickled exception or None, type name, message, traceback text). The text always
    arrives, even when the exception itself will not pickle."""
    tb_text = "".join(_tb.format_exception(type(exc), exc, exc.__traceback__))
    type_name = type(exc).__qualname__
    module = type(exc).__module__
    if module not in ("builtins", "__main__", None):
        type_name = f"{module}.{type_name}"
    try:
        message = str(exc)
    except Exception:  # noqa: BLE001 - a broken __str__ must not hide the failure
        message = f"<{type(exc).__name__} with a failing __str__>"
    blob = None
    try:
        pickling_support.install(exc)
        blob = cloudpickle.dumps(exc, protocol=pickle.HIGHEST_PROTOCOL)
        # Prove it comes back in one piece here, where we can still fall back to text.
        pickle.loads(blob)
    except Exception:  # noqa: BLE001
        blob = None
    return blob, type_name, message, tb_text


def unpack_exception(blob, type_name, message, tb_text) -> BaseException:
    if blob is not None:
        try:
            pickling_support.install()
            return pickle.loads(blob)
        except Exception:  # noqa: BLE001 - e.g. the class is not importable here
            pass
    return RemoteException(type_name, message, tb_text)


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
            os.ftruncate(fd, nbytes)
            with mmap.mmap(fd, nbytes) as m:
                dst = torch.frombuffer(m, dtype=torch.uint8, count=nbytes)
                dst.copy_(t.reshape(-1).view(torch.uint8))
                del dst
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
