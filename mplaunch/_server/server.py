"""The server: a clean interpreter that starts ranks and outlives none of them.

One server runs per launching process and preload set, in its own session (a Ctrl-C in
the terminal reaches only the launching process, which forwards it). It is

- a forkserver: it imports the preload modules (torch, say) once, single-threaded and
  without CUDA, and forks every rank from that state, so a rank starts in milliseconds;
- an exec server: for start_method="spawn" it forks and execs a fresh interpreter;
- the subreaper of everything below it: a rank's orphaned descendants come back to it,
  and it kills them;
- the lifeline: it holds one channel from the launching process and one per launch.
  When the launching process dies (even by SIGKILL) the first channel reaches EOF, and
  the server kills every rank's process group and every descendant, then exits. When a
  launch's channel closes, that launch's ranks go the same way.

It never runs user code itself: only the forked children do.
"""
from __future__ import annotations

import os
import selectors
import signal
import socket
import sys
import time
import traceback

from .._wire import linux
from .._wire.channel import RANK_FDS, recv_obj, send_obj
from .._wire.memory import OomWatch, reap
from .._wire.messages import (BecomeRank, ExecRank, Exited, Hello, OpenChannel,
                              SignalGroups, SignalRanks, Started, StartFailed, StartRank,
                              Sweep, Swept, Unwatch, Watch)


POOL_MAX = 16  # idle pre-forked children kept at most


class _Launch:
    def __init__(self, sock):
        self.sock = sock
        self.started = 0
        self.ranks: set = set()     # pids of ranks we forked for this launch
        self.watched: set = set()   # pids of ranks the parent forked itself (fork mode)


class Server:
    def __init__(self, lifeline: socket.socket):
        self.lifeline = lifeline
        self.sel = selectors.DefaultSelector()
        self.launches: dict = {}     # fileno -> _Launch
        # Pre-forked, idle children ("zygotes"): a launch hands a rank's spec to one of
        # them, so neither the fork nor the child's first copy-on-write faults are on
        # the launch's critical path. Refilled while the server is otherwise idle.
        self.pool: list = []         # [(pid, socket)]
        self.pool_target = 0
        self.zygotes: set = set()
        self.rank_owner: dict = {}   # pid -> _Launch (None once its launch closed)
        self.pid = os.getpid()
        self.oom = OomWatch()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)

    # -- main loop -----------------------------------------------------------------
    def serve(self) -> None:
        signal.set_wakeup_fd(self._wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        self.sel.register(self.lifeline, selectors.EVENT_READ, self._on_lifeline)
        self.sel.register(self._wake_r, selectors.EVENT_READ, self._on_sigchld)
        while True:
            # Only between launches: a fork (and the new child's first faults) takes
            # time and a core from ranks that are running.
            refill = len(self.pool) < self.pool_target and not self.rank_owner
            events = self.sel.select(0 if refill else None)
            for key, _ in events:
                key.data(key.fileobj)
            if refill and not events:
                self._fork_zygote()

    def _on_lifeline(self, sock) -> None:
        try:
            msg, fds = recv_obj(sock)
        except OSError:  # ECONNRESET: the launching process died with our hello unread
            msg, fds = None, []
        if msg is None:
            self._die()
        if isinstance(msg, OpenChannel):
            ch = socket.socket(fileno=fds[0])
            launch = _Launch(ch)
            self.launches[ch.fileno()] = launch
            self.sel.register(ch, selectors.EVENT_READ, self._on_channel)

    def _on_channel(self, sock) -> None:
        launch = self.launches[sock.fileno()]
        try:
            msg, fds = recv_obj(sock, maxfds=8)
        except OSError:
            msg, fds = None, []
        if msg is None:
            self._close_launch(launch)
            return
        if isinstance(msg, StartRank):
            self._start(launch, msg.token, msg.spec, fds)
        elif isinstance(msg, SignalGroups):
            for pid in launch.ranks | launch.watched:
                if msg.pids is None or pid in msg.pids:
                    linux.killpg_quiet(pid, msg.signo)
                    linux.kill_quiet(pid, msg.signo)
        elif isinstance(msg, SignalRanks):
            for pid in launch.ranks & set(msg.pids):
                linux.kill_quiet(pid, msg.signo)
        elif isinstance(msg, Watch):
            launch.watched.add(msg.pid)
        elif isinstance(msg, Unwatch):
            launch.watched.discard(msg.pid)
        elif isinstance(msg, Sweep):
            self._reply(launch, Swept(self._kill_orphans()))

    def _reply(self, launch, msg) -> None:
        try:
            send_obj(launch.sock, msg)
        except OSError:
            pass

    # -- starting ranks ------------------------------------------------------------
    def _start(self, launch, token, spec, fds) -> None:
        fdmap = dict(zip(RANK_FDS, fds))
        launch.started += 1
        self.pool_target = max(self.pool_target, min(launch.started, POOL_MAX))
        if not spec.fresh_interpreter:
            while self.pool:
                pid, zsock = self.pool.pop()
                try:
                    send_obj(zsock, BecomeRank(spec), fds)
                except OSError:
                    continue  # that zygote died; try the next
                finally:
                    zsock.close()
                self._became_rank(launch, token, pid, fds)
                return
        try:
            pid = os.fork()
        except OSError as exc:
            for fd in fds:
                os.close(fd)
            self._reply(launch, StartFailed(token, f"fork failed: {exc}"))
            return
        if pid == 0:
            self._in_child(spec, fdmap)
        self._became_rank(launch, token, pid, fds)

    def _became_rank(self, launch, token, pid, fds) -> None:
        self.zygotes.discard(pid)
        try:
            os.setpgid(pid, pid)
        except OSError:
            pass  # the child did it first, or already exec'd
        for fd in fds:
            os.close(fd)
        launch.ranks.add(pid)
        self.rank_owner[pid] = launch
        self.oom.started(pid)
        self._reply(launch, Started(token, pid))

    def _fork_zygote(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            pid = os.fork()
        except OSError:
            ours.close()
            theirs.close()
            self.pool_target = len(self.pool)  # out of processes: stop trying
            return
        if pid == 0:
            ours.close()
            self._zygote(theirs)
        theirs.close()
        self.pool.append((pid, ours))
        self.zygotes.add(pid)

    def _leave_server(self, keep=()) -> None:
        """In a freshly forked child: drop the server's signal handling and fds."""
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        linux.close_quiet(*(fd for fd in [self.lifeline.fileno(), self._wake_r, self._wake_w,
                                         *(l.sock.fileno() for l in self.launches.values()),
                                         *(z.fileno() for _, z in self.pool)]
                            if fd not in keep))

    def _zygote(self, sock) -> None:
        """An idle pre-forked child: wait for a rank to become, or for EOF."""
        try:
            self._leave_server(keep={sock.fileno()})
            linux.set_pdeathsig(signal.SIGKILL)
            if os.getppid() != self.pid:
                os._exit(0)
            from .._rank.worker import run_rank
            msg, fds = recv_obj(sock, maxfds=8)
            if msg is None:
                os._exit(0)
            sock.close()
            run_rank(msg.spec, dict(zip(RANK_FDS, fds)), self.pid)
        except BaseException:  # noqa: BLE001
            traceback.print_exc()
        os._exit(1)

    def _in_child(self, spec, fdmap) -> None:
        """In the freshly forked child: drop the server's state, then become the rank."""
        try:
            self._leave_server(keep=set(fdmap.values()))
            if spec.fresh_interpreter:
                self._exec_rank(spec, fdmap)
            from .._rank.worker import run_rank
            run_rank(spec, fdmap, self.pid)
        except BaseException:  # noqa: BLE001
            traceback.print_exc()
        os._exit(1)

    def _exec_rank(self, spec, fdmap) -> None:
        import pickle
        os.setpgid(0, 0)
        linux.set_pdeathsig(signal.SIGKILL)  # survives exec of a non-setuid binary
        for fd in fdmap.values():
            os.set_inheritable(fd, True)
        blob = pickle.dumps(ExecRank(spec, fdmap, self.pid))
        spec_fd = linux.memfd_with(blob, "mplaunch-spec")
        os.set_inheritable(spec_fd, True)
        code = linux.entry_code("_rank.worker", "exec_main")
        os.execve(sys.executable, [sys.executable, "-c", code, str(spec_fd)], dict(spec.env))

    # -- children ------------------------------------------------------------------
    def _on_sigchld(self, fd) -> None:
        try:
            while os.read(fd, 4096):
                pass
        except (BlockingIOError, InterruptedError):
            pass
        while True:
            try:
                info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:
                return
            if info is None:
                return
            pid = info.si_pid
            if pid in self.rank_owner:
                # The rank is a zombie, so its pid (and group id) cannot be reused yet:
                # killing its group now is safe, and leaves none of its children behind.
                linux.killpg_quiet(pid, signal.SIGKILL)
            try:
                _, status, max_rss = reap(pid)
            except ChildProcessError:
                continue
            note = self.oom.exited(pid, status)
            if pid in self.zygotes:
                self.zygotes.discard(pid)
                for entry in [e for e in self.pool if e[0] == pid]:
                    self.pool.remove(entry)
                    entry[1].close()
                continue
            launch = self.rank_owner.pop(pid, None)
            if launch is not None:
                launch.ranks.discard(pid)
                if launch.sock.fileno() != -1:
                    self._reply(launch, Exited(pid, status, max_rss, note))

    def _kill_orphans(self) -> int:
        """Kill every process below us that is neither a live rank nor in a live rank's
        process group: those are what dead ranks left behind."""
        live = set(self.rank_owner)
        victims = []
        for pid in linux.children_of(self.pid):
            if pid in live or pid in self.zygotes or linux.pgid_of(pid) in live:
                continue
            victims.append(pid)
            victims.extend(linux.descendants_of(pid))
        for pid in victims:
            linux.kill_quiet(pid, signal.SIGKILL)
        # The launch returns when we answer: what it started must be dead by then, not
        # merely signalled.
        linux.wait_dead(victims, timeout=2.0)
        return len(victims)

    def _close_launch(self, launch) -> None:
        for pid in launch.ranks | launch.watched:
            linux.killpg_quiet(pid, signal.SIGKILL)
            linux.kill_quiet(pid, signal.SIGKILL)
        for pid in launch.ranks:
            self.rank_owner[pid] = None  # reaped later, reported to no one
        self.sel.unregister(launch.sock)
        del self.launches[launch.sock.fileno()]
        launch.sock.close()

    def _die(self) -> None:
        """The launching process is gone (or asked us to stop): leave nothing behind."""
        for launch in list(self.launches.values()):
            self._close_launch(launch)
        # A rank that was just sent SIGKILL hands its orphans (a grandchild in a session
        # of its own) to us only as it exits, which may be after one look below us has
        # missed them; and once we are gone they would go to init. So: kill what is
        # below us, reap, and look again, until no child is left.
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline:
            for pid in linux.descendants_of(self.pid):
                linux.kill_quiet(pid, signal.SIGKILL)
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break  # nothing is below us any more
            if pid == 0:
                time.sleep(0.002)
        os._exit(0)


def main() -> None:
    lifeline_fd = int(sys.argv[1])
    preload = [m for m in sys.argv[2].split(",") if m] if len(sys.argv) > 2 else []
    if len(sys.argv) > 3:
        # The launching process's import path, so preloads and by-reference functions
        # resolve as they do there; our own package stays importable first.
        import json
        sys.path[:] = sys.path[:1] + json.loads(sys.argv[3])
    os.set_inheritable(lifeline_fd, False)
    lifeline = socket.socket(fileno=lifeline_fd)
    linux.set_child_subreaper()
    # A launching process's thread may block signals (a Ray worker's threads block
    # SIGINT) and its children inherit the mask: the ranks must get their signals.
    signal.pthread_sigmask(signal.SIG_SETMASK, set())
    for name in ("SIGINT", "SIGHUP", "SIGTERM", "SIGQUIT"):
        # The launching process decides when ranks stop; the server only dies with it.
        if name != "SIGTERM":
            signal.signal(getattr(signal, name), signal.SIG_IGN)
    failed = {}
    import importlib
    for name in preload:
        try:
            importlib.import_module(name)
        except BaseException as exc:  # noqa: BLE001 - reported, not fatal
            failed[name] = f"{type(exc).__name__}: {exc}"
    # What every rank runs (cloudpickle included), imported once here: a forked rank
    # finds it loaded instead of importing it after each fork.
    from .._rank import worker  # noqa: F401
    import gc
    # Everything imported so far (torch: hundreds of thousands of objects) moves to the
    # permanent generation: a collection in a rank would otherwise write to every
    # object's header and copy most of the server's heap, page by page, into the rank.
    gc.collect()
    gc.freeze()
    import threading
    # The threads alive now are inherited (as dead copies) by every forked rank; the
    # launching side refuses to fork from a server that has any.
    try:
        send_obj(lifeline, Hello(os.getpid(), failed, threading.active_count()))
    except OSError:
        os._exit(0)  # the launching process is already gone; nothing was started
    Server(lifeline).serve()


if __name__ == "__main__":
    main()
