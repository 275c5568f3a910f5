"""How a group's ranks come to be, are signalled and are reaped: the one seam between a
RankGroup and the start methods.

- :class:`ServerSpawner` (``forkserver`` and ``spawn``): the warm server forks each rank
  (or forks and execs a fresh interpreter); it reaps them, reports their exits, and is
  the subreaper that finds what they leave behind.
- :class:`ForkSpawner` (``fork``): the launching process forks each rank itself and reaps
  it through a pidfd. The server still holds a launch channel, so that the ranks die with
  the launching process, but it is not their parent.

A spawner reports to its group through four calls: ``started(token, pid)``,
``exited(pid, status, max_rss, note)``, ``start_failed(token, reason)`` and
``server_lost(pid, how)``.

Its ``lock`` makes it usable from another thread than the one driving the group (stacks
on demand, _engine.timeouts): channel sends are whole, and a forked rank is not reaped
while another thread signals it.
"""
from __future__ import annotations

import os
import selectors
import signal
import socket
import threading
from typing import Dict, Optional, Sequence, Set

from . import servers
from .config import LaunchConfig
from .._wire import linux
from .._wire.channel import RANK_FDS, recv_obj, send_obj
from .._wire.memory import OomWatch, reap
from .._wire.messages import (Exited, SignalGroups, SignalRanks, Started, StartFailed,
                              StartRank, Sweep, Swept, Unwatch, Watch)
from .._wire.spec import RankSpec


def for_config(cfg: LaunchConfig, events) -> "ServerSpawner":
    """The spawner of `cfg`'s start method, reporting to `events` (a RankGroup)."""
    if cfg.start_method == "fork":
        return ForkSpawner(cfg, events)
    return ServerSpawner(cfg, events)


class ServerSpawner:
    """Ranks started by the warm server, over a launch channel of their own."""

    def __init__(self, cfg: LaunchConfig, events):
        self.cfg = cfg
        self.events = events
        self.channel: Optional[socket.socket] = None
        self.server: Optional[servers.ServerHandle] = None
        self.lock = threading.RLock()
        self._sel: Optional[selectors.BaseSelector] = None

    def open(self, sel: selectors.BaseSelector) -> None:
        """Get a launch channel (waiting for a cold server) and watch it on `sel`."""
        cfg = self.cfg
        server = servers.get_server(cfg.server_preload).wait_ready()
        if cfg.start_method == "forkserver" and server.threads > 1:
            raise RuntimeError(
                f"mplaunch's forkserver has {server.threads} threads after importing "
                f"{list(cfg.preload)}: forking it is unsafe. Use start_method='spawn', or "
                "preload other modules.")
        self.server = server
        self.channel = server.open_channel()
        self.channel.setblocking(True)
        self._sel = sel
        sel.register(self.channel, selectors.EVENT_READ, self._on_channel)

    def start(self, token: int, spec: RankSpec, fds: Sequence[int]) -> None:
        """Ask for a rank; ``started`` follows (from pump() or the selector)."""
        with self.lock:
            send_obj(self.channel, StartRank(token, spec), fds)

    def pump(self) -> None:
        """Block for one report of the server and hand it to the group."""
        self._on_channel(self.channel)

    def signal_groups(self, signo: int, pids: Sequence[int], tokens=()) -> None:
        """`signo` to each rank and its whole process group (`tokens` name the same
        ranks, for a spawner that knows them by token)."""
        self._send(SignalGroups(signo, tuple(pids)))

    def signal_ranks(self, signo: int, pids: Sequence[int], tokens=()) -> None:
        """`signo` to these ranks' processes alone (not their groups)."""
        self._send(SignalRanks(signo, tuple(pids)))

    def clock_offset_ns(self, node: int) -> int:
        """How far node `node`'s wall clock is ahead of this process's: on this
        machine, not at all."""
        return 0

    def forget(self, tokens) -> None:
        """The group let these dead ranks go (RankGroup.renumber: a World across nodes,
        whose spawner is _engine.nodes.spawner's)."""

    def sweep(self, timeout: float = 5.0) -> None:
        """Have the server kill what is left below it (orphaned grandchildren) and wait
        until it has, passing on exits reported meanwhile."""
        ch = self.channel
        if ch is None or ch.fileno() == -1:
            return
        try:
            with self.lock:
                send_obj(ch, Sweep())
            ch.settimeout(timeout)
            while True:
                msg, fds = recv_obj(ch)
                for fd in fds:
                    os.close(fd)
                if msg is None or isinstance(msg, Swept):
                    return
                if isinstance(msg, Exited):
                    self.events.exited(msg.pid, msg.status, msg.max_rss, msg.note)
        except (socket.timeout, OSError):
            return
        finally:
            if ch.fileno() != -1:
                ch.settimeout(None)

    def close(self) -> None:
        if self.channel is not None:
            if self._sel is not None:
                # A selector that outlives the group (a node agent's) must not keep it.
                self._unregister(self.channel)
            self.channel.close()  # the server kills whatever of ours is still alive

    # -- internals -----------------------------------------------------------------------
    def _send(self, msg) -> None:
        try:
            with self.lock:
                send_obj(self.channel, msg)
        except OSError:
            pass  # the server is gone, and the ranks with it: its EOF says so

    def _on_channel(self, sock) -> None:
        try:
            msg, fds = recv_obj(sock)
        except OSError:
            msg, fds = None, []
        for fd in fds:
            os.close(fd)
        if msg is None:
            self._unregister(sock)
            self._lost()
        elif isinstance(msg, Started):
            self.events.started(msg.token, msg.pid)
        elif isinstance(msg, Exited):
            self.events.exited(msg.pid, msg.status, msg.max_rss, msg.note)
        elif isinstance(msg, StartFailed):
            self.events.start_failed(msg.token, msg.reason)

    def _lost(self) -> None:
        # Its ranks died with it (parent-death signal).
        server = self.server
        self.events.server_lost(server.pid if server is not None else None,
                                server.death() if server is not None else "ended")

    def _unregister(self, fileobj) -> None:
        try:
            self._sel.unregister(fileobj)
        except (KeyError, ValueError):
            pass


class ForkSpawner(ServerSpawner):
    """start_method="fork": each rank is a fork of the launching process."""

    def __init__(self, cfg: LaunchConfig, events):
        super().__init__(cfg, events)
        self._pidfds: Dict[int, int] = {}
        # No server is the ranks' subreaper, so their descendants are noted while they are
        # still below them (a grandchild in a session of its own is outside the rank's
        # process group), and signalled too.
        self._descendants: Set[int] = set()

    def open(self, sel: selectors.BaseSelector) -> None:
        # What the forked ranks run, imported once here rather than in each of them.
        from .._rank.worker import run_rank  # noqa: F401
        super().open(sel)

    def start(self, token: int, spec: RankSpec, fds: Sequence[int]) -> None:
        pid = fork_rank(spec, dict(zip(RANK_FDS, fds)))
        _forked_oom.started(pid)
        self._send(Watch(pid))  # the server kills it if we die
        pidfd = servers.own_fd(os.pidfd_open(pid))
        self._pidfds[pid] = pidfd
        self._sel.register(pidfd, selectors.EVENT_READ,
                           lambda _fd, pid=pid: self._reap(pid))
        self.events.started(token, pid)

    def pump(self) -> None:
        raise AssertionError("fork ranks have their pids at once")

    def signal_groups(self, signo: int, pids: Sequence[int], tokens=()) -> None:
        for pid in pids:
            # Our own children, not yet reaped: their pids are still theirs.
            self._descendants.update(linux.descendants_of(pid))
            linux.killpg_quiet(pid, signo)
            linux.kill_quiet(pid, signo)
        for pid in self._descendants:
            linux.kill_quiet(pid, signo)

    def signal_ranks(self, signo: int, pids: Sequence[int], tokens=()) -> None:
        with self.lock:  # not reaped meanwhile (the caller checked they are alive)
            for pid in pids:
                linux.kill_quiet(pid, signo)

    def sweep(self, timeout: float = 5.0) -> None:
        if self._descendants:
            for pid in self._descendants:
                linux.kill_quiet(pid, signal.SIGKILL)
            linux.wait_dead(list(self._descendants), timeout=2.0)
        super().sweep(timeout)

    def close(self) -> None:
        for pidfd in self._pidfds.values():
            servers.close_fd(pidfd)
        self._pidfds.clear()
        super().close()

    def _reap(self, pid: int) -> None:
        with self.lock:
            reaped = reap_forked(pid)
            if reaped is None:
                return
            pidfd = self._pidfds.pop(pid)
            self._unregister(pidfd)
            servers.close_fd(pidfd)
        self._send(Unwatch(pid))
        self.events.exited(pid, *reaped)

    def _lost(self) -> None:
        pass  # the ranks are ours, not the server's: they live on, and we reap them


# start_method="fork" has no server to be the subreaper of what its ranks start: a
# daemon (double fork + setsid) would be re-parented to pid 1 and outlive the launch. So
# each forked rank is a subreaper (it kills its adopted orphans when it exits), and
# while any forked rank lives this process is one too (for the orphans of a rank that
# was killed), restored after. Adopted orphans are killed and reaped by pid once the
# last forked rank is gone; the user's own children are never waited for.
_adoption = {"ranks": 0, "previous": 0, "before": frozenset()}
_adoption_lock = threading.Lock()


def _adoption_in_child() -> None:
    _adoption["ranks"] = 0     # the forked ranks are this process's parent's


os.register_at_fork(after_in_child=_adoption_in_child)


def _adopt_begin() -> None:
    with _adoption_lock:
        if _adoption["ranks"] == 0:
            _adoption["previous"] = linux.get_child_subreaper()
            _adoption["before"] = frozenset(linux.children_of(os.getpid()))
            linux.set_child_subreaper()
        _adoption["ranks"] += 1


def _adopt_end() -> None:
    with _adoption_lock:
        _adoption["ranks"] -= 1
        if _adoption["ranks"] > 0:
            return
        try:
            kill_adopted_orphans(_adoption["before"])
        finally:
            linux.restore_child_subreaper(_adoption["previous"])


def adopted_orphans(before) -> list:
    """Children of this process that a forked rank's descendants left to it: new since
    the first forked rank started, not a warm server, and neither in this process's
    group nor in a group or session led by one of its earlier children (a rank leads a
    group of its own, a daemon a session; what this process and its other children
    start is in their groups and sessions unless asked otherwise)."""
    me, group = os.getpid(), os.getpgid(0)
    warm = set(servers.server_pids())
    out = []
    for pid in linux.children_of(me):
        if pid in before or pid in warm:
            continue
        try:
            pgid, sid = os.getpgid(pid), os.getsid(pid)
        except OSError:
            continue
        if pgid != group and pgid not in before and sid not in before:
            out.append(pid)
    return out


def kill_adopted_orphans(before) -> int:
    orphans = adopted_orphans(before)
    for pid in orphans:
        linux.kill_quiet(pid, signal.SIGKILL)
    for pid in orphans:
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:
            pass
    return len(orphans)


def fork_rank(spec: RankSpec, fdmap: dict) -> int:
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
            linux.set_child_subreaper()
            from .._rank.worker import run_rank
            run_rank(spec, fdmap, parent, forked_from_launcher=True)
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


_forked_oom = OomWatch()


def reap_forked(pid: int):
    """(raw wait status, peak RSS in bytes or None, what the kernel says of its death or
    None) of a forked rank that has exited, after killing what is left of its process
    group (its pid cannot be reused before we reap it); None if still alive."""
    try:
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        _forked_oom.forget(pid)
        _adopt_end()
        return 0, None, None
    if info is None:
        return None
    try:
        members = linux.group_members(pid)
        linux.killpg_quiet(pid, signal.SIGKILL)
        linux.wait_dead(members, timeout=2.0)
        try:
            _, status, max_rss = reap(pid)
        except ChildProcessError:
            _forked_oom.forget(pid)
            return 0, None, None
        return status, max_rss, _forked_oom.exited(pid, status)
    finally:
        _adopt_end()
