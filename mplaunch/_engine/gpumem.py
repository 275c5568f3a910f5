"""GPU memory a World's ranks held, free again when its close() (or stop()) returns.

Found on the first GPU run (an H200, driver 580): a rank that held 9 GiB was reaped (its
pid gone from /proc and from NVML's list of compute processes) before the driver had
given its memory back, 20 to 45 ms later, in 2 of 8 closes, the quick ones (50 ms). Code
that closes a World and then takes the GPU (a notebook's next cell, a second World, a
test's check of free memory) could find it still taken. So, while the ranks still run,
``snapshot`` reads from NVML what each of this node's ranks holds on each GPU (a third
of a millisecond), and once they are gone, ``wait_given_back`` waits until each GPU's
used memory has fallen by that much (within MiB of it, a bound of a second: another
process may take memory meanwhile).

Read through NVML with ctypes, as devices does: CUDA is never initialised here. Where
NVML is missing (no NVIDIA driver: a CPU machine, CI) the first call finds out and every
later one returns at once. Ranks on other nodes are not this NVML's to see: a World
across nodes does not call this.
"""
from __future__ import annotations

import ctypes
import time
from typing import Callable, Dict, Iterable

SLACK = 64 << 20       # what the driver keeps of a process's memory for a while at most
TIMEOUT = 1.0


class _Proc(ctypes.Structure):
    # nvmlProcessInfo_t (the _v3 and _v2 calls' layout)
    _fields_ = [("pid", ctypes.c_uint), ("usedGpuMemory", ctypes.c_ulonglong),
                ("gpuInstanceId", ctypes.c_uint), ("computeInstanceId", ctypes.c_uint)]


class _Memory(ctypes.Structure):
    _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong),
                ("used", ctypes.c_ulonglong)]


_nvml = None           # the library, once loaded; False once found missing


def _library():
    global _nvml
    if _nvml is None:
        try:
            _nvml = ctypes.CDLL("libnvidia-ml.so.1")
            _nvml.nvmlDeviceGetComputeRunningProcesses_v3   # noqa: B018 - is it there
        except (OSError, AttributeError):
            _nvml = False
    return _nvml or None


def _read(pids: Iterable[int]) -> Dict[int, tuple]:
    """{GPU index: (its used bytes, what `pids` hold of them)} for the GPUs where any of
    `pids` holds memory."""
    nvml = _library()
    if nvml is None or nvml.nvmlInit_v2() != 0:
        return {}
    wanted = set(pids)
    out = {}
    try:
        count = ctypes.c_uint()
        if nvml.nvmlDeviceGetCount_v2(ctypes.byref(count)) != 0:
            return {}
        for index in range(count.value):
            handle = ctypes.c_void_p()
            if nvml.nvmlDeviceGetHandleByIndex_v2(ctypes.c_uint(index),
                                                  ctypes.byref(handle)) != 0:
                continue
            n = ctypes.c_uint(256)
            procs = (_Proc * 256)()
            if nvml.nvmlDeviceGetComputeRunningProcesses_v3(handle, ctypes.byref(n),
                                                            procs) != 0:
                continue
            ours = sum(procs[i].usedGpuMemory for i in range(n.value)
                       if procs[i].pid in wanted)
            memory = _Memory()
            if ours and nvml.nvmlDeviceGetMemoryInfo(handle, ctypes.byref(memory)) == 0:
                out[index] = (memory.used, ours)
    finally:
        nvml.nvmlShutdown()
    return out


def _used(indices) -> Dict[int, int]:
    nvml = _library()
    if nvml is None or nvml.nvmlInit_v2() != 0:
        return {}
    try:
        out = {}
        for index in indices:
            handle, memory = ctypes.c_void_p(), _Memory()
            if nvml.nvmlDeviceGetHandleByIndex_v2(ctypes.c_uint(index),
                                                  ctypes.byref(handle)) == 0 and \
                    nvml.nvmlDeviceGetMemoryInfo(handle, ctypes.byref(memory)) == 0:
                out[index] = memory.used
        return out
    finally:
        nvml.nvmlShutdown()


def snapshot(pids: Iterable[int]) -> Dict[int, tuple]:
    """What the running ranks `pids` hold, per GPU ({} where none, or no NVML)."""
    pids = [p for p in pids if p]
    if not pids or _library() is None:
        return {}
    try:
        return _read(pids)
    except OSError:
        return {}


def wait_given_back(held: Dict[int, tuple], timeout: float = TIMEOUT,
                    used: Callable[[Iterable[int]], Dict[int, int]] = _used,
                    sleep: Callable[[float], None] = time.sleep) -> bool:
    """Once the ranks of `held` (snapshot) are gone: wait until each GPU's used memory
    is back below what it was less what they held (SLACK allowed), at most `timeout`
    seconds. True when it is (or there was nothing to wait for)."""
    if not held:
        return True
    targets = {i: before - ours + SLACK for i, (before, ours) in held.items()}
    end = time.monotonic() + timeout
    while True:
        now = used(targets)
        if not now or all(now.get(i, 0) <= t for i, t in targets.items()):
            return True
        if time.monotonic() >= end:
            return False
        sleep(0.002)
