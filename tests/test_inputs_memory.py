"""The free-memory check before large inputs are written (issue 37, item 6): every memory
cgroup up the hierarchy is asked, page cache the kernel can drop is not counted as used,
and a payload whose writing finds memory taken meanwhile (another large run at once)
stops with InputsTooLarge instead of filling the machine."""
from __future__ import annotations

import os

import pytest

from mplaunch._wire import buffers, lending

pytestmark = pytest.mark.no_torch
MiB = 1 << 20


def _cgroup(path, limit, current, inactive=None):
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "memory.max"), "w") as f:
        f.write(f"{limit}\n")
    with open(os.path.join(path, "memory.current"), "w") as f:
        f.write(f"{current}\n")
    if inactive is not None:
        with open(os.path.join(path, "memory.stat"), "w") as f:
            f.write(f"anon 1\ninactive_file {inactive}\nactive_file 5\n")


def test_a_parent_cgroups_limit_counts_and_dropable_cache_does_not(tmp_path, monkeypatch):
    root = str(tmp_path) + "/"
    parent = os.path.join(root, "pod")
    leaf = os.path.join(parent, "container")
    _cgroup(parent, 1000 * MiB, 900 * MiB, inactive=300 * MiB)   # 400 MiB left
    _cgroup(leaf, "max", 900 * MiB)                              # no limit of its own
    monkeypatch.setattr(lending, "_CGROUPS", root)
    monkeypatch.setattr(lending, "memory_cgroup", lambda pid: leaf)
    limit, source = lending.lendable()
    assert limit == 400 * MiB
    assert parent in source and "page cache" in source
    # The leaf's own limit counts too, where it leaves less.
    _cgroup(leaf, 950 * MiB, 800 * MiB)
    assert lending.lendable()[0] == 150 * MiB


def test_memory_taken_while_a_payload_is_written_stops_it(monkeypatch):
    data = bytearray(160 * MiB)
    payload = buffers.Payload(b"x" * 16, [buffers.Raw(memoryview(data))], [0])
    monkeypatch.setattr(lending, "_RECHECK", 32 * MiB)
    # Enough when asked before writing; 32 MiB into it, something else took the rest.
    monkeypatch.setattr(lending, "lendable", lambda: (64 * MiB, "a test's figure"))
    fds_before = set(os.listdir("/proc/self/fd"))
    with pytest.raises(buffers.InputsTooLarge) as info:
        payload.memfd()
    assert "while it was being written" in str(info.value)
    assert set(os.listdir("/proc/self/fd")) == fds_before   # its memfd is gone
