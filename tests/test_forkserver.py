"""The fast path is the safe path: ranks fork from a clean, single-threaded server that
has imported torch (and what the user preloads) once, never touched CUDA, and never
outlives the launching process."""
import logging
import os
import sys
import threading

import pytest

import mplaunch
from mplaunch._engine import servers as _procs

PRELOAD_DIR = os.path.join(os.path.dirname(__file__), "scripts_preload")


def rank_state():
    import torch
    return {
        "threads": threading.active_count(),
        "cuda_initialized": torch.cuda.is_initialized(),
        "torch_preloaded": "torch" in sys.modules,
        "ppid": os.getppid(),
    }


def test_ranks_fork_from_a_clean_single_threaded_server():
    out = mplaunch.launch(rank_state, nprocs=2)
    server = _procs.get_server(_procs.default_preload())
    assert server.threads == 1  # the server's own count at fork time
    assert {o["ppid"] for o in out} == {server.pid}
    for o in out:
        assert o["threads"] == 1
        assert o["cuda_initialized"] is False
    with open(f"/proc/{server.pid}/maps") as f:
        maps = f.read()
    assert "libtorch" in maps          # torch is really preloaded
    assert "libcuda.so" not in maps    # and no CUDA driver was ever loaded


def read_preloaded():
    mod = sys.modules.get("counted_import")
    return None if mod is None else mod.VALUE


def test_a_preloaded_module_is_imported_once(tmp_path, monkeypatch):
    log = tmp_path / "imports.log"
    monkeypatch.setenv("COUNTED_IMPORT_LOG", str(log))
    monkeypatch.syspath_prepend(PRELOAD_DIR)
    preload = ("torch", "counted_import")
    try:
        for _ in range(3):
            assert mplaunch.launch(read_preloaded, nprocs=2, preload=preload) == [42, 42]
        lines = log.read_text().split()
        assert len(lines) == 1, lines  # imported in the server, never in a rank
        assert int(lines[0]) == _procs.get_server(preload).pid
    finally:
        server = _procs._servers.pop(preload, None)
        if server is not None:
            server.stop()


def test_a_preload_that_fails_to_import_is_reported_not_fatal(caplog):
    preload = ("no_such_module_for_mplaunch",)
    try:
        with caplog.at_level(logging.WARNING, logger="mplaunch"):
            assert mplaunch.launch(int, ("5",), 1, preload=preload) == [5]
        assert "no_such_module_for_mplaunch" in caplog.text
    finally:
        server = _procs._servers.pop(preload, None)
        if server is not None:
            server.stop()


def test_warm_server_is_reused_across_launches():
    mplaunch.launch(int, ("1",), 1)
    pids = _procs.server_pids()
    for _ in range(5):
        mplaunch.launch(int, ("1",), 2)
    assert _procs.server_pids() == pids


def test_a_dead_server_is_replaced():
    mplaunch.launch(int, ("1",), 1)
    server = _procs.get_server(_procs.default_preload())
    os.kill(server.pid, 9)
    server.proc.wait()
    assert mplaunch.launch(int, ("3",), 2) == [3, 3]
    assert _procs.get_server(_procs.default_preload()).pid != server.pid
