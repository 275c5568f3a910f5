"""The pytest plugin's sizes and GPUs, on the parent's side: ``nprocs=[1, 2, 4]`` on the
marker runs a test once per size, and a test that wants more GPUs than the machine has
is skipped with the counts, never failed (a CI runner without GPUs, a laptop).

GPUs are counted as launch counts them (NVML or the driver's /proc, never CUDA), so the
pytest process can still fork its ranks.
"""
from __future__ import annotations

import functools
from typing import Optional

import pytest

def _marked_nprocs(markers) -> object:
    """The closest marker's nprocs (positional or keyword), else None."""
    for marker in markers:
        if marker.args:
            return marker.args[0]
        if "nprocs" in marker.kwargs:
            return marker.kwargs["nprocs"]
    return None


def parametrize_sizes(metafunc, markers, reuse_default: bool, argname: str) -> None:
    """``nprocs=[1, 2, 4]``: the test once per size, with ids such as ``[nprocs=2]``.
    Reuse tests are parametrized at session scope, so that pytest groups them by size
    and each size's world serves all of its tests in turn (the plugin keeps one world
    at a time)."""
    sizes = _marked_nprocs(markers)
    if not isinstance(sizes, (list, tuple)):
        return
    if not sizes or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1
                            for n in sizes):
        raise pytest.UsageError(f"{metafunc.definition.nodeid}: @pytest.mark.mplaunch "
                                f"nprocs must be an int >= 1 or a non-empty list of them, "
                                f"got {sizes!r}")
    reuse = next((m.kwargs["reuse"] for m in markers if "reuse" in m.kwargs),
                 reuse_default)
    # Not an argument of the test: a fixture of the plugin's, which the test's
    # fixture closure gains here (and the ranks never receive).
    metafunc.fixturenames.append(argname)
    metafunc.parametrize(argname, list(sizes), indirect=True, ids=lambda n: f"nprocs={n}",
                         scope="session" if reuse else "function")


def gpu_shortfall(opts: dict) -> Optional[str]:
    """Why this machine cannot run a test of these marker options (a CUDA backend, or
    gpus=, wanting more GPUs than it has), or None."""
    from ._engine.devices import PER_RANK, uses_cuda
    gpus = opts.get("gpus")
    if gpus is None and not uses_cuda(opts.get("backend")):
        return None
    nprocs = opts["nprocs"]
    if isinstance(gpus, (list, tuple)):
        need = max(gpus, default=-1) + 1
        why = f"gpus={list(gpus)}"
    else:
        need = nprocs
        why = ("gpus='per-rank'" if gpus == PER_RANK else
               f"backend={opts.get('backend')!r}")
    have = gpus_here()
    if not isinstance(need, int) or need <= have:
        return None   # a bad value: launch's own check names it
    return (f"mplaunch: {why} with {nprocs} ranks needs {need} GPUs; this machine has "
            f"{have}")


@functools.lru_cache(maxsize=None)
def gpus_here() -> int:
    from ._engine.config import gpu_count
    return gpu_count()
