"""What a launch holds while it is up, for as many attempts (launch's restarts) or calls
(a World's runs) as it lasts: the memfd with the pickled payload the ranks start from,
the store on its held port, the waker that signal handlers and other threads write to,
and the warm server. Run and World both open one; closing it releases all of it, in
the reverse order, whatever failed.
"""
from __future__ import annotations

import contextlib
from typing import List, Optional, Union

from . import servers, signals, store
from .config import LaunchConfig, rank_specs
from .._wire import buffers
from .._wire.buffers import Payload
from .._wire.spec import RankSpec


class Session:
    """Use as a context manager; ``payload_fd``, ``waker`` and ``hosted`` (the store,
    its port and address) are there inside it."""

    def __init__(self, cfg: LaunchConfig, payload: Union[bytes, Payload],
                 local_server: bool = True):
        self.cfg = cfg
        # A World across nodes starts no server here: each node's agent has its own.
        self.local_server = local_server
        self._payload = payload
        self.payload_fd: int = -1
        self.waker: Optional[signals.Waker] = None
        self.hosted = None
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> "Session":
        stack = self._stack
        try:
            # Not one of this process's own fds: a fork-mode rank starts from it.
            self.payload_fd = buffers.memfd_of(self._payload)
            stack.callback(servers.close_fd, self.payload_fd)
            self.waker = waker = signals.Waker()
            stack.callback(waker.close)
            for fd in (waker.r, waker.w):
                servers.own_fd(fd)
                stack.callback(servers.disown_fd, fd)
            # A cold server imports torch while the store comes up; wait_server() waits.
            if self.local_server:
                servers.get_server(self.cfg.server_preload)
            self.hosted = stack.enter_context(store.hosted(self.cfg))
        except BaseException:
            stack.close()
            raise
        return self

    def __exit__(self, *exc_info) -> None:
        self._stack.close()

    def wait_server(self) -> None:
        """Block until the server has imported its preloads: that time is not the
        ranks' to lose (a timeout starts after it)."""
        if self.local_server:
            servers.get_server(self.cfg.server_preload).wait_ready()

    def specs(self, number: int, serve: bool = False) -> List[RankSpec]:
        """This node's rank specs for attempt (or World generation) `number`."""
        hosted = self.hosted
        return rank_specs(self.cfg, number, hosted.port, hosted.address, serve=serve)
