"""One rank's process as the launching process sees it: its pid and exit, what it sent
back, and the pipes and relays that carry its output."""
from __future__ import annotations

import os
import selectors
import socket
import time
from typing import Iterable, List, Optional

from . import servers
from .._wire.channel import FramedReader
from .config import LaunchConfig
from .._wire.spec import RankSpec
from .output import StreamRelay, read_pipe, set_pipe_size
from .terminal import for_rank


class RankState:
    """One rank of a RankGroup."""
    __slots__ = ("spec", "pid", "reader", "out_fd", "err_fd", "stack_fd", "out", "err",
                 "status", "result", "has_result", "error", "max_rss", "exit_note",
                 "reporter", "exited_at", "log_name", "kept_globals", "collectives",
                 "calls", "answers", "_child_ends", "token")

    def __init__(self, spec: RankSpec):
        self.spec = spec
        self.pid: Optional[int] = None     # None until it starts (or if it never did)
        self.status: Optional[int] = None  # raw wait status once exited
        self.has_result = False
        self.result = None
        self.error = None       # the Raised message the rank sent (_wire.messages)
        # The __main__ names it kept over the caller's values (KeptGlobals), not yet
        # taken by the front-end (a World's: _engine.world_engine)
        self.kept_globals: tuple = ()
        # this call's collectives (_wire.messages.Collectives), before its answer
        self.collectives: list = []
        # Calls it was given (its first payload is one) and answers it sent: a rank
        # answers each call once, in order, so an answer that arrives while it still
        # owes one for a later call belongs to a call the launching process gave up on
        # and is dropped, never taken for the current call's (RankGroup._on_message).
        self.calls = 1
        self.answers = 0
        # What its spawner knows it by: its place in the group when the group started
        # (kept by its replacement, and when the World goes on renumbered)
        self.token: Optional[int] = None
        self.reader: Optional[FramedReader] = None
        self.out: Optional[StreamRelay] = None
        self.err: Optional[StreamRelay] = None
        self.out_fd = self.err_fd = self.stack_fd = None
        self.max_rss: Optional[int] = None   # bytes, from the reaping wait4
        self.exit_note: Optional[str] = None  # what the reaper knows of its death (OOM)
        self.reporter = False   # a collectives reporter runs in it (_rank.collectives)
        self.exited_at: Optional[float] = None
        # Its log_dir folder: its local rank (as torchrun), or its rank where one group
        # holds several nodes' ranks (a World across nodes), whose local ranks repeat.
        self.log_name = str(spec.local_rank)
        self._child_ends: List = []

    @property
    def local_rank(self) -> int:
        return self.spec.local_rank

    @property
    def alive(self) -> bool:
        return self.status is None

    @property
    def signalable(self) -> bool:
        return self.alive and self.pid is not None

    def open(self, cfg: LaunchConfig, attempt: int, payload_fd: int) -> List[int]:
        """Make the rank's result socket, output pipes, stack socket and relays; return the
        fds the rank is started with, in _wire.channel.RANK_FDS order."""
        res_parent, res_child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        # A socket, not a pipe: the rank's collectives reporter reads requests from it.
        stack_ours, stack_theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        stack_r, stack_w = stack_ours.detach(), stack_theirs.detach()
        for fd in (out_r, err_r, stack_r):
            servers.own_fd(fd)
            os.set_blocking(fd, False)
        set_pipe_size(out_r)
        set_pipe_size(err_r)  # logging and tqdm write to stderr, often as much as to stdout
        self.reader = FramedReader(servers.own_socket(res_parent))
        self.out_fd, self.err_fd, self.stack_fd = out_r, err_r, stack_r
        self.out = self._relay(cfg, attempt, "stdout")
        self.err = self._relay(cfg, attempt, "stderr")
        self._child_ends = [res_child, out_w, err_w, stack_w]
        # The terminal's part: stdin for the rank that reads it, and what it is told.
        extra_fds, self.spec = for_rank(cfg, self.spec, self.out, self.err)
        return [payload_fd, res_child.fileno(), out_w, err_w, stack_w, *extra_fds]

    def close_child_ends(self) -> None:
        """Once the rank has its copies (or could not be started)."""
        if self._child_ends:
            res_child, *fds = self._child_ends
            res_child.close()
            for fd in fds:
                os.close(fd)
        self._child_ends = []

    def _relay(self, cfg: LaunchConfig, attempt: int, stream: str) -> StreamRelay:
        sink = None
        if cfg.relay and (cfg.ranks_filter is None or self.local_rank in cfg.ranks_filter):
            sink = cfg.stdout if stream == "stdout" else cfg.stderr
        logfile = None
        if cfg.log_dir is not None:
            d = os.path.join(cfg.log_dir, f"attempt_{attempt}", self.log_name)
            os.makedirs(d, exist_ok=True)
            logfile = open(os.path.join(d, f"{stream}.log"), "wb", buffering=0)
        return StreamRelay(sink, self.spec.prefix(cfg.prefix), logfile,
                           keep_tail=(stream == "stderr"))

    def close(self) -> None:
        for fd in (self.out_fd, self.err_fd, self.stack_fd):
            if fd is not None:
                servers.close_fd(fd)
        self.out_fd = self.err_fd = self.stack_fd = None
        for closable in (self.reader, self.out, self.err):
            if closable is not None:
                closable.close()


def drain_outputs(ranks: Iterable[RankState], wait: float) -> None:
    """Relay everything the ranks wrote. Their pipes reach EOF once every writer is dead;
    a writer that could not be killed (fork mode orphans) only gets `wait` seconds."""
    pending = {}
    for r in ranks:
        for fd, relay in ((r.out_fd, r.out), (r.err_fd, r.err)):
            if fd is not None and relay is not None:
                pending[fd] = relay
    end = time.monotonic() + wait
    sel = selectors.DefaultSelector()
    for fd in pending:
        sel.register(fd, selectors.EVENT_READ)
    try:
        while pending and time.monotonic() < end:
            for key, _ in sel.select(max(0.0, end - time.monotonic())):
                chunk = read_pipe(key.fd)
                if chunk is None:
                    continue
                if chunk == b"":
                    sel.unregister(key.fd)
                    del pending[key.fd]
                else:
                    pending[key.fd].feed(chunk)
    finally:
        sel.close()
