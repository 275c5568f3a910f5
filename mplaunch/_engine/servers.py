"""The launching process's warm servers (one per preload set, started on first use and
kept for the life of this process), the launch channels to them, and the fds this
process must never hand to a fork of itself."""
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

from .._wire import linux
from .._wire.channel import recv_obj, send_obj
from .._wire.messages import Hello, OpenChannel

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
    linux.close_quiet(*_parent_only_fds)
    _parent_only_fds.clear()
    _servers.clear()


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
    linux.close_quiet(fd)


class ServerError(RuntimeError):
    pass


class ServerHandle:
    """A running server process and the lifeline to it."""

    def __init__(self, preload: tuple, start_timeout: float = 300.0):
        self.preload = preload
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        _parent_only_socks.add(ours)
        code = linux.entry_code("_server.server", "main")
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
        if not isinstance(msg, Hello):
            self.stop()
            raise ServerError("mplaunch's server exited while starting (its stderr above "
                              "says why)")
        self.preload_errors, self.threads = msg.preload_errors, msg.threads
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
                send_obj(self.lifeline, OpenChannel(), [theirs.fileno()])
        except OSError as exc:
            ours.close()
            raise ServerError(f"mplaunch's server is gone: {exc}") from exc
        finally:
            theirs.close()
        return ours

    def death(self, wait: float = 2.0) -> str:
        """How the server ended ("was killed by SIGKILL"), once its channel closed."""
        from .._wire.memory import in_kernel_log
        from ..errors import signal_name
        try:
            code = self.proc.wait(wait)
        except subprocess.TimeoutExpired:
            return "closed its channel"
        if code >= 0:
            return f"exited with code {code}"
        how = f"was killed by {signal_name(-code)}"
        if -code == 9 and in_kernel_log(self.pid):
            how += " (by the kernel's OOM killer, the kernel log says)"
        return how

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
        for pid in linux.children_of(server):
            if linux.pgid_of(pid) == server:
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
    """What a warm server imports before forking ranks (config.DEFAULT_PRELOAD)."""
    from .config import DEFAULT_PRELOAD
    return DEFAULT_PRELOAD
