"""How tensors and strided numpy arrays reach the payload's out-of-band buffers
(_wire.buffers), and how a rank rebuilds them over its mapping of those bytes.

torch pickles a tensor in band (its storage through ``torch.save`` into bytes), and the
whole storage of a view; numpy pickles an array with gaps in band too. The payload's
pickler looks these types up here first (a dispatch table: per type, checked after
cloudpickle's reducer_override has declined), and each large one becomes its view's bytes
plus what rebuilds it: dtype, shape, strides, requires_grad, its Python attributes.

Rejected: a persistent_id for tensors, as the results use (_wire.payload.ResultPickler).
It needs an Unpickler subclass in the rank; here the rank calls plain ``pickle.loads``
with the buffers, and a tensor's bytes are an out-of-band buffer like numpy's.

The same reducers serve the payload's `__main__` part (the globals that the call's
functions of `__main__` read: a tensor a notebook cell made), but for a device tensor,
which an argument may not be and a global still may (GLOBAL_REDUCERS).

Views keep what a user sees of them: a dense view (contiguous, or permuted: ``x.T``,
channels_last) keeps its strides and sends its span; a view with gaps (``x[::2]``)
arrives contiguous, as ``.contiguous()`` would make it, its elements only, never the
storage around it. Views of one span are written once and share it again in the rank.
"""
from __future__ import annotations

import pickle
import sys

from .buffers import MIN_BYTES, Copy, Raw, Sink, plan

__all__ = ["REDUCERS", "CannotSend", "sink"]

REDUCERS: dict = {}   # type -> reducer: the first map of the payload pickler's dispatch
# The same for the payload's `__main__` part (the globals of `__main__`'s functions).
GLOBAL_REDUCERS: dict = {}


def sink() -> Sink:
    """A new Sink for a payload's pickler, the reducers of the modules loaded now
    installed (torch's and numpy's are looked up in sys.modules: never imported here)."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.Tensor not in REDUCERS:
        REDUCERS[torch.Tensor] = _reduce_tensor
        GLOBAL_REDUCERS[torch.Tensor] = _reduce_global_tensor
    np = sys.modules.get("numpy")
    if np is not None and np.ndarray not in REDUCERS:
        REDUCERS[np.ndarray] = _reduce_array
        GLOBAL_REDUCERS[np.ndarray] = _reduce_array
    return Sink()


class CannotSend(TypeError):
    """An argument mplaunch refuses to send: ``what`` it is and ``why``. Raised before
    anything starts."""

    def __init__(self, what: str, why: str):
        self.what, self.why = what, why
        super().__init__(f"mplaunch cannot send {what} to the ranks: {why}")

    def __reduce__(self):
        return type(self), (self.what, self.why)


# -- tensors ------------------------------------------------------------------------------

_CUDA_WHY = (
    "arguments are passed by value, through the host's shared memory, while "
    "torch.multiprocessing.spawn shares the one device storage with every rank (CUDA IPC: "
    "each rank sees the others' writes). Move it to the CPU before the call (t.cpu()) and "
    "to the rank's device in the function (t.to(f\"cuda:{os.environ['LOCAL_RANK']}\")), "
    "or load it there")


def _reduce_tensor(t):
    """A plain tensor (a Parameter's own reduce hands its data here too) as its view's
    bytes; torch's own reduce for a small one and for the kinds this does not know."""
    torch = sys.modules["torch"]
    device = t.device.type
    if device not in ("cpu", "meta"):
        raise CannotSend(f"a {device} tensor ({_describe(t)})", _CUDA_WHY)
    if (device != "cpu" or t.layout != torch.strided or t.is_quantized or t.is_conj()
            or t.is_neg() or t.is_nested):
        return t.__reduce_ex__(pickle.HIGHEST_PROTOCOL)
    numel, itemsize = t.numel(), t.element_size()
    if max(numel * itemsize, t.untyped_storage().nbytes()) < MIN_BYTES:
        return t.__reduce_ex__(pickle.HIGHEST_PROTOCOL)
    shape, stride = tuple(t.shape), tuple(t.stride())
    span = 1 + sum((n - 1) * s for n, s in zip(shape, stride)) if numel else 0
    gaps = span > numel
    if gaps:
        nbytes = numel * itemsize
        stride = _contiguous_strides(shape)
    else:
        # dense, or overlapping (expand): its span as it lies, strides kept
        nbytes = span * itemsize
    if nbytes < MIN_BYTES:
        # a small view of a large storage: its own bytes, in the stream
        data = bytearray(nbytes)
        if nbytes:
            _fill(t, memoryview(data), gaps)
    elif gaps:
        data = plan(Copy(nbytes, lambda view: _fill(t, view, True)))
    else:
        import ctypes
        raw = memoryview((ctypes.c_char * nbytes).from_address(t.data_ptr()))
        data = plan(Raw(raw, t), (t.data_ptr(), nbytes))
    return _tensor_from, (data, t.dtype, shape, stride, bool(t.requires_grad),
                          _obj_state(torch, t))


def _reduce_global_tensor(t):
    """A tensor that a global of `__main__` holds: as an argument, except a device
    tensor, which is not refused there (it never was: a notebook's model on the GPU,
    read by a function, arrives as torch pickles it)."""
    if t.device.type not in ("cpu", "meta"):
        return t.__reduce_ex__(pickle.HIGHEST_PROTOCOL)
    return _reduce_tensor(t)


def _contiguous_strides(shape) -> tuple:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


def _fill(t, view: memoryview, gaps: bool) -> None:
    """Copy `t`'s elements (gaps: in contiguous order; else its span as it lies) into
    `view`, which has exactly their size."""
    torch = sys.modules["torch"]
    dst = torch.frombuffer(view, dtype=torch.uint8).view(t.dtype)
    src = t.detach()
    if gaps:
        dst.view(src.shape).copy_(src)
    else:
        dst.copy_(src.as_strided((dst.numel(),), (1,)))


def _obj_state(torch, t):
    get = getattr(torch._utils, "_get_obj_state", None)
    return get(t) if get is not None else None


def _describe(t) -> str:
    from .lending import size_text
    return (f"{str(t.dtype).replace('torch.', '')} {tuple(t.shape)}, "
            f"{size_text(t.numel() * t.element_size())}, on {t.device}")


def _tensor_from(data, dtype, shape, stride, requires_grad, state):
    """In a rank: the tensor over `data` (its bytes, mapped copy-on-write)."""
    import torch
    nbytes = memoryview(data).nbytes
    if nbytes:
        base = torch.frombuffer(data, dtype=torch.uint8, count=nbytes).view(dtype)
    else:
        base = torch.empty(0, dtype=dtype)
    t = base.as_strided(shape, stride, 0)
    if requires_grad:
        t.requires_grad_(True)
    if state:
        torch._utils._set_obj_state(t, state)
    return t


# -- numpy arrays with gaps ---------------------------------------------------------------

def _reduce_array(a):
    """numpy's own reduce (its buffer out of band when contiguous), except for a large
    array with gaps, which numpy copies in band: its elements, made contiguous."""
    if (a.flags.c_contiguous or a.flags.f_contiguous or a.dtype.hasobject
            or a.nbytes < MIN_BYTES):
        return a.__reduce_ex__(pickle.HIGHEST_PROTOCOL)
    np = sys.modules["numpy"]

    def fill(view):
        np.copyto(np.frombuffer(view, dtype=a.dtype).reshape(a.shape), a)
    return _array_from, (plan(Copy(a.nbytes, fill)), a.dtype, a.shape)


def _array_from(data, dtype, shape):
    import numpy as np
    return np.frombuffer(data, dtype=dtype).reshape(shape)
