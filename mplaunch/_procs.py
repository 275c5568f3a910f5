"""The launching process's side of the process model: warm servers, launch channels, and
starting ranks (through a server, or by forking this process for start_method="fork")."""
from __future__ import annotations

import atexit
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import weakref

from . import _sys
from ._channel import recv_obj, send_obj

log = logging.getLogger("mplaunch")

_lock = threading.RLock()
_servers: dict = {}  # preload tuple -> ServerHandle

# Sockets and fds that belong to this process alone. A fork of this process (a rank in
# fork mode, a DataLoader worker of the user's) closes them at once: a copy held
# elsewhere would keep a server's lifeline open after we die, or keep a pipe from EOF.
_parent_only_socks: "weakref.WeakSet[socket.socket]" = weakref.WeakSet()
_parent_only_fds: set = set()


def _close_parent_only_fds_in_child() -> None:
    for sock in list(_parent_only_socks):
        try:
            sock.close()
        except OSError:
            pass
    for fd in list(_parent_only_fds):
        try:
            os.close(fd)
        except OSError:
            pass
    _parent_only_fds.clear()
    _servers.clear()
    _adoption["ranks"] = 0     # the forked ranks are this process's parent's


os.register_at_fork(after_in_child=_close_parent_only_fds_in_child)


def own_fd(fd: int) -> int:
    _parent_only_fds.add(fd)
    return fd


def own_socket(sock: socket.socket) -> socket.socket:
    _parent_only_socks.add(sock)
    return sock


def disown_fd(fd: int) -> None:
    _parent_only_fds.discard(fd)


def close_fd(fd: int) -> None:
    _parent_only_fds.discard(fd)
    try:
        os.close(fd)
    except OSError:
        pass


class ServerError(RuntimeError):
    pass


class ServerHandle:
    """A running server process and the lifeline to it."""

    def __init__(self, preload: tuple, start_timeout: float = 300.0):
        self.preload = preload
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        _parent_only_socks.add(ours)
        code = _sys.entry_code("_server", "main")
        try:
            # The server lives in "/": a warm server must not hold the caller's working
            # directory (which may be deleted, and torch cannot even be imported in a
            # deleted one) nor keep its file system busy. Each rank changes to its own.
            self.proc = subprocess.Popen(
                [sys.executable, "-c", code, str(theirs.fileno()), ",".join(preload),
                 json.dumps(_absolute_path(sys.path))],
                pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL,
                start_new_session=True, cwd="/")
        finally:
            theirs.close()
        self.lifeline = ours
        self.pid = self.proc.pid
        self.start_timeout = start_timeout
        self._ready = False
        self._send_lock = threading.Lock()

    def wait_ready(self) -> "ServerHandle":
        """Block until the server has imported its preloads and said hello."""
        with self._send_lock:
            if not self._ready:
                self._hello()
                self._ready = True
        return self

    def _hello(self) -> None:
        ours = self.lifeline
        ours.settimeout(self.start_timeout)
        try:
            msg, _ = recv_obj(ours)
        except (socket.timeout, OSError) as exc:
            self.stop()
            raise ServerError(f"mplaunch's server did not start: {exc}") from exc
        finally:
            ours.settimeout(None)
        if msg is None or msg[0] != "hello":
            self.stop()
            raise ServerError("mplaunch's server exited while starting (its stderr above "
                              "says why)")
        _, _pid, self.preload_errors, self.threads = msg
        for name, err in self.preload_errors.items():
            log.warning("mplaunch could not preload %r in its server: %s", name, err)

    def alive(self) -> bool:
        return self.proc.poll() is None and self.lifeline.fileno() != -1

    def open_channel(self) -> socket.socket:
        self.wait_ready()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        _parent_only_socks.add(ours)
        try:
            with self._send_lock:
                send_obj(self.lifeline, ("channel",), [theirs.fileno()])
        except OSError as exc:
            ours.close()
            raise ServerError(f"mplaunch's server is gone: {exc}") from exc
        finally:
            theirs.close()
        return ours

    def stop(self, timeout: float = 5.0) -> None:
        try:
            self.lifeline.close()  # EOF: the server kills what is left and exits
        except OSError:
            pass
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _absolute_path(path: list) -> list:
    """sys.path with "" (the working directory) and relative entries made absolute, for
    an interpreter that starts elsewhere."""
    try:
        cwd = os.getcwd()
    except OSError:
        return [p for p in path if os.path.isabs(p)]
    return [os.path.join(cwd, p) if not os.path.isabs(p) else p for p in path]


def get_server(preload: tuple) -> ServerHandle:
    """The warm server for `preload`, started if needed. It may still be importing its
    preloads: open_channel() waits for it, so callers can do other work meanwhile."""
    with _lock:
        server = _servers.get(preload)
        if server is not None and server.alive():
            return server
        if server is not None:
            server.stop()
        server = ServerHandle(preload)
        _servers[preload] = server
        return server


def server_pids() -> list:
    """Pids of the warm servers this process holds (for tests and diagnostics)."""
    with _lock:
        return [s.pid for s in _servers.values() if s.alive()]


def idle_pool_pids() -> list:
    """Pids of the servers' idle pre-forked children: a server's children still in its
    own process group (a child that becomes a rank leads a group of its own)."""
    out = []
    for server in server_pids():
        for pid in _sys.children_of(server):
            if _sys.pgid_of(pid) == server:
                out.append(pid)
    return out


def shutdown_servers() -> None:
    """Stop every warm server this process started, and wait for each."""
    with _lock:
        servers = list(_servers.values())
        _servers.clear()
    for server in servers:
        server.stop()


atexit.register(shutdown_servers)


def default_preload() -> tuple:
    """What a warm server imports before forking ranks: torch (importing it in every
    rank is what makes spawn slow, and mplaunch's ranks nearly always use it)."""
    return ("torch", "torch.distributed")


def cuda_initialized() -> bool:
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    try:
        return bool(torch.cuda.is_initialized())
    except Exception:  # noqa: BLE001
        return False


# start_method="fork" has no server to be the subreaper of what its ranks start: a
# daemon (double fork + setsid) would be re-parented to pid 1 and outlive the launch. So
# each forked rank is a subreaper (it kills its adopted orphans when it exits), and
# while any forked rank lives this process is one too (for the orphans of a rank that
# was killed), restored after. Adopted orphans are killed and reaped by pid once the
# last forked rank is gone; the user's own children are never waited for.
_adoption = {"ranks": 0, "previous": 0, "before": frozenset()}


def _adopt_begin() -> None:
    with _lock:
        if _adoption["ranks"] == 0:
            _adoption["previous"] = _sys.get_child_subreaper()
            _adoption["before"] = frozenset(_sys.children_of(os.getpid()))
            _sys.set_child_subreaper()
        _adoption["ranks"] += 1


def _adopt_end() -> None:
    with _lock:
        _adoption["ranks"] -= 1
        if _adoption["ranks"] > 0:
            return
        try:
            kill_adopted_orphans(_adoption["before"])
        finally:
            _sys.restore_child_subreaper(_adoption["previous"])


def adopted_orphans(before) -> list:
    """Children of this process that a forked rank's descendants left to it: new since
    the first forked rank started, not a warm server, and not in this process's group
    (a rank leads a group of its own, a daemon a session; what this process starts
    itself is in its group unless asked otherwise)."""
    me, group = os.getpid(), os.getpgid(0)
    servers = {s.pid for s in _servers.values()}
    return [pid for pid in _sys.children_of(me)
            if pid not in before and pid not in servers and _sys.pgid_of(pid) != group]


def kill_adopted_orphans(before) -> int:
    orphans = adopted_orphans(before)
    for pid in orphans:
        _sys.kill_quiet(pid, 9)
    for pid in orphans:
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:
            pass
    return len(orphans)


def fork_rank(spec, fdmap: dict) -> int:
    """start_method="fork": the rank is a fork of this process. Returns its pid."""
    parent = os.getpid()
    _adopt_begin()
    try:
        pid = os.fork()
    except BaseException:
        _adopt_end()
        raise
    if pid == 0:
        try:
            _sys.set_child_subreaper()
            from ._worker import run_rank
            run_rank(spec, fdmap, parent)
        finally:
            os._exit(1)
    if fdmap.get("stdin") is None:
        # (A rank that reads the terminal makes itself a session leader instead, which
        # it cannot do once it leads a group.)
        try:
            os.setpgid(pid, pid)
        except OSError:
            pass
    return pid


def reap_forked(pid: int):
    """Raw wait status of a forked rank that has exited, after killing what is left of
    its process group (its pid cannot be reused before we reap it); None if still alive."""
    try:
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        _adopt_end()
        return 0
    if info is None:
        return None
    try:
        members = _sys.group_members(pid)
        _sys.killpg_quiet(pid, 9)
        _sys.wait_dead(members, timeout=2.0)
        try:
            _, status = os.waitpid(pid, 0)
        except ChildProcessError:
            return 0
        return status
    finally:
        _adopt_end()
