"""Every test proves it left nothing behind: no child process, no zombie, no fd, no
semaphore. mplaunch's warm servers (with their idle pre-forked children) are the one
thing allowed to outlive a test: that is their purpose."""
from __future__ import annotations

import os
import sys
import time

import psutil
import pytest

from mplaunch._engine import servers as _procs

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

try:
    import torch  # noqa: F401
except ImportError:
    # .ci/run tests every Python that setup.cfg claims, most without a torch wheel: there
    # only the tests marked no_torch run; the rest skip (see pytest_collection_modifyitems).
    HAS_TORCH = False
else:
    HAS_TORCH = True


def pytest_collection_modifyitems(config, items):
    if HAS_TORCH:
        return
    skip = pytest.mark.skip(reason="needs torch, which is not installed (only tests "
                                   "marked no_torch run without it)")
    for item in items:
        if item.get_closest_marker("no_torch") is None:
            item.add_marker(skip)


def _warm_process_wide_state():
    """torch's libuv TCPStore opens one pipe pair on first use and keeps it for the life
    of the process (its event loop's wakeup pipe): once per process, not per launch.
    Create it before any test takes its fd snapshot, so that only real leaks show."""
    import socket

    from torch.distributed import TCPStore
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    port = s.getsockname()[1]
    store = TCPStore("127.0.0.1", port, 1, True, wait_for_workers=False,
                     master_listen_fd=s.detach())
    del store


if HAS_TORCH:
    _warm_process_wide_state()


def _children():
    me = psutil.Process()
    try:
        return me.children(recursive=True)
    except psutil.Error:
        return []


def _fds():
    fds = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            fds.add((int(name), os.readlink(f"/proc/self/fd/{name}")))
        except OSError:
            pass
    return fds


# /dev/shm is shared by the whole machine: a semaphore that appears there during a test
# is ours unless other test runs share the machine (parallel xdist workers, or
# developers' runs side by side, who set MPLAUNCH_TEST_SHARED_MACHINE=1).
_CHECK_SEMS = not (os.environ.get("PYTEST_XDIST_WORKER")
                   or os.environ.get("MPLAUNCH_TEST_SHARED_MACHINE"))


def _sems():
    if not _CHECK_SEMS:
        return set()
    try:
        return {n for n in os.listdir("/dev/shm") if n.startswith("sem.")}
    except OSError:
        return set()


def _allowed_fds():
    """fds that legitimately persist: the lifelines of warm servers."""
    out = set()
    for sock in list(_procs._parent_only_socks):
        try:
            out.add(sock.fileno())
        except OSError:
            pass
    return out


def leftovers(before_pids=frozenset(), timeout=3.0):
    """Processes below this one that are not warm servers, after giving exiting ones a
    moment. Warm servers themselves must have no children."""
    deadline = time.monotonic() + timeout
    while True:
        # idle pre-forked children of a server are part of it
        servers = set(_procs.server_pids()) | set(_procs.idle_pool_pids())
        bad = []
        for p in _children():
            if p.pid in before_pids:
                continue
            if p.pid in servers:
                continue
            bad.append(p)
        if not bad or time.monotonic() > deadline:
            return bad
        time.sleep(0.05)


def describe(procs):
    lines = []
    for p in procs:
        try:
            lines.append(f"pid {p.pid} ppid {p.ppid()} {p.status()} {' '.join(p.cmdline())[:150]}")
        except psutil.Error:
            lines.append(f"pid {p.pid} (gone)")
    return "\n".join(lines)


@pytest.fixture(autouse=True)
def no_leaks(request):
    if request.node.get_closest_marker("no_leak_check"):
        yield
        return
    before_pids = {p.pid for p in _children()}
    before_fds = _fds()
    before_sems = _sems()
    yield
    bad = leftovers(before_pids)
    if bad:
        text = describe(bad)
        for p in bad:  # end what the test started, by pid, so the next test is clean
            try:
                p.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(bad, timeout=5)
        pytest.fail(f"test left processes behind:\n{text}", pytrace=False)
    deadline = time.monotonic() + 2.0
    while True:
        allowed = _allowed_fds()
        new_fds = {(fd, target) for fd, target in _fds() - before_fds if fd not in allowed}
        new_sems = _sems() - before_sems
        if (not new_fds and not new_sems) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert not new_fds, f"test leaked file descriptors: {sorted(new_fds)}"
    assert not new_sems, f"test leaked semaphores: {sorted(new_sems)}"


def pytest_sessionfinish(session, exitstatus):
    servers = _procs.server_pids()
    _procs.shutdown_servers()
    for pid in servers:
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, \
            f"warm server {pid} did not stop"
