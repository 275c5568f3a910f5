"""The pump of a World across nodes: one thread that copies between each remote rank's
fds (the ends a local rank's process would hold, kept here) and its node's connection,
in both directions, so that the RankGroup reads and writes remote ranks' fds as it does
local ones. Output is written without blocking (what a pipe cannot take waits here), so
one rank's unread output never stops the others' frames; what waits here is bounded by
the agents' output window (tunnel.OUTPUT_WINDOW), given back as it is written on."""
from __future__ import annotations

import logging
import os
import selectors
import socket
import threading
import time
from typing import Dict, List, Sequence

from .. import servers
from .payloads import NodePayloads
from ..._wire import linux, tunnel
from ..._wire.channel import FramedReader

log = logging.getLogger("mplaunch")
__mplaunch_plumbing__ = True


class _Proxy:
    """The launching side's ends of one remote rank's fds (RankState.open's child ends)."""
    __slots__ = ("token", "link", "res", "reader", "out", "err", "stack", "pending")

    def __init__(self, token: int, link, fds: Sequence[int]):
        self.token, self.link = token, link
        # dups: the group closes its copies of the child ends once start() returns
        res = socket.socket(fileno=os.dup(fds[1]))
        self.res = res
        self.reader = FramedReader(socket.socket(fileno=os.dup(res.fileno())))
        self.out, self.err = os.dup(fds[2]), os.dup(fds[3])
        self.stack = socket.socket(fileno=os.dup(fds[4]))
        for fd in (self.res.fileno(), self.reader.fileno(), self.out, self.err,
                   self.stack.fileno()):
            servers.own_fd(fd)
        os.set_blocking(self.out, False)
        os.set_blocking(self.err, False)
        self.pending: Dict[str, bytearray] = {"out": bytearray(), "err": bytearray()}

    def close(self) -> None:
        for fd in (self.out, self.err):
            if fd is not None:
                servers.close_fd(fd)
        self.out = self.err = None
        for s in (self.res, self.stack):
            if s is not None and s.fileno() != -1:
                servers.disown_fd(s.fileno())
                s.close()
        self.res = self.stack = None
        if self.reader is not None:
            if self.reader.sock.fileno() != -1:
                servers.disown_fd(self.reader.sock.fileno())
            self.reader.close()
            self.reader = None



class Pump:
    """Started once the hub's links are up; `hub.spawner` (if any) hears the reports."""

    def __init__(self, hub):
        self.hub = hub
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = os.pipe()
        self._stopping = False
        self.proxies: Dict[int, _Proxy] = {}
        self.payloads = NodePayloads()   # which payload each node holds
        self._plock = threading.Lock()
        self._changes: List = []
        self._thread = threading.Thread(target=self._pump, name="mplaunch-nodes",
                                        daemon=True)
        self._thread.start()

    def add_proxy(self, proxy: _Proxy) -> None:
        with self._plock:
            self.proxies[proxy.token] = proxy
            self._changes.append(("add", proxy))
        os.write(self._wake_w, b"x")

    def drop_proxy(self, token: int) -> None:
        with self._plock:
            proxy = self.proxies.pop(token, None)
            if proxy is not None:
                self._changes.append(("drop", proxy))
        os.write(self._wake_w, b"x")

    def _pump(self) -> None:
        sel = self._sel
        sel.register(self._wake_r, selectors.EVENT_READ, ("wake", None))
        for link in self.hub.links:
            sel.register(link.sock, selectors.EVENT_READ, ("link", link))
        while not self._stopping:
            try:
                events = sel.select()
            except (OSError, ValueError):
                return
            for key, mask in events:
                kind, obj = key.data
                try:
                    if kind == "wake":
                        self._on_wake()
                    elif kind == "link":
                        self._on_link(obj)
                    elif kind == "res":
                        self._on_res(obj)
                    elif kind == "stack":
                        self._on_stack(obj)
                    elif kind == "write":
                        self._flush(obj, mask)
                except Exception:   # noqa: BLE001 - the pump must not die
                    log.exception("mplaunch: error relaying a node's frames")

    def _on_wake(self) -> None:
        try:
            os.read(self._wake_r, 4096)
        except BlockingIOError:
            pass
        with self._plock:
            changes, self._changes = self._changes, []
        for what, proxy in changes:
            if what == "add":
                self._sel.register(proxy.reader.sock, selectors.EVENT_READ, ("res", proxy))
                self._sel.register(proxy.stack, selectors.EVENT_READ, ("stack", proxy))
            else:
                for obj in (proxy.reader.sock if proxy.reader else None, proxy.stack,
                            proxy.out, proxy.err):
                    if obj is not None:
                        try:
                            self._sel.unregister(obj)
                        except (KeyError, ValueError):
                            pass
                proxy.close()

    def _on_res(self, proxy: _Proxy) -> None:
        """The group wrote to a remote rank's channel (a call): send it on."""
        reader = proxy.reader
        if reader is None:
            return
        for data, fds in reader.read_available():
            # a call: its payload goes to the node once, for all its ranks
            try:
                self.payloads.send(proxy.link, tunnel.TO_RANK, proxy.token, fds,
                                   lambda keys, data=data: (data, keys))
            finally:
                linux.close_quiet(*fds)
        if reader.eof:
            self._sel.unregister(reader.sock)

    def _on_stack(self, proxy: _Proxy) -> None:
        try:
            chunk = proxy.stack.recv(1 << 16)
        except OSError:
            chunk = b""
        if chunk:
            proxy.link.send(tunnel.TO_STACK, proxy.token, chunk)
        else:
            self._sel.unregister(proxy.stack)

    def _on_link(self, link) -> None:
        # `reading`/`heard`: the agent is alive and talking, however long a frame takes
        # (a large result), which the liveness checks (_engine.nodes.hub) allow for.
        link.reading = True
        try:
            frame = tunnel.recv(link.sock)
        except OSError as exc:
            frame = None
            link.lost = link.lost or f"its connection failed ({exc})"
        finally:
            link.reading = False
            link.heard = time.monotonic()
        if frame is None:
            link.lost = link.lost or "its connection closed"
            self._sel.unregister(link.sock)
            self._lost(link)
            return
        kind, token, body = frame
        if kind == tunnel.SIGNALED:
            link.acked += 1
        elif kind in (tunnel.OUT, tunnel.ERR):
            self._output(token, "out" if kind == tunnel.OUT else "err", body)
        elif kind == tunnel.FROM_RANK:
            proxy = self.proxies.get(token)
            if proxy is not None and proxy.res is not None:
                # Non-blocking through the reader's dup; a result larger than the
                # socket's buffer is written whole (the group reads it).
                try:
                    tunnel.deliver(proxy.res, *body)
                except OSError:
                    pass
        elif kind == tunnel.FROM_STACK:
            proxy = self.proxies.get(token)
            if proxy is not None and proxy.stack is not None:
                try:
                    if body:
                        proxy.stack.sendall(body)
                    else:
                        proxy.stack.shutdown(socket.SHUT_WR)
                except OSError:
                    pass
        else:
            spawner = self.hub.spawner
            if spawner is not None:
                spawner.post((kind, token, body, link))

    def _output(self, token: int, which: str, chunk: bytes) -> None:
        proxy = self.proxies.get(token)
        if proxy is None or getattr(proxy, which) is None:
            return
        if not chunk:    # EOF: every writer on the node is gone
            self._close_output(proxy, which)
            return
        proxy.pending[which] += chunk
        self._flush((proxy, which), selectors.EVENT_WRITE)

    def _flush(self, target, _mask) -> None:
        proxy, which = target
        fd = getattr(proxy, which)
        buf = proxy.pending[which]
        written = 0
        while fd is not None and buf:
            try:
                n = os.write(fd, buf)
            except BlockingIOError:
                break
            except OSError:
                written += len(buf)
                buf.clear()     # the group closed its end
                break
            del buf[:n]
            written += n
        if written:
            # the agent may send that much more of this stream (tunnel.OUTPUT_WINDOW)
            proxy.link.send(tunnel.CREDIT, proxy.token, (which, written))
        if fd is None:
            return
        try:
            if buf:
                self._sel.register(fd, selectors.EVENT_WRITE, ("write", (proxy, which)))
            else:
                self._sel.unregister(fd)
        except (KeyError, ValueError):
            pass

    def _close_output(self, proxy: _Proxy, which: str) -> None:
        fd = getattr(proxy, which)
        if fd is None:
            return
        if proxy.pending[which]:
            try:
                os.set_blocking(fd, True)
                os.write(fd, bytes(proxy.pending[which]))
            except OSError:
                pass
            proxy.pending[which].clear()
        try:
            self._sel.unregister(fd)
        except (KeyError, ValueError):
            pass
        servers.close_fd(fd)
        setattr(proxy, which, None)

    def _lost(self, link) -> None:
        """A node's connection ended: its ranks' outputs end, and the group hears."""
        with self._plock:
            mine = [p for p in self.proxies.values() if p.link is link]
        for proxy in mine:
            self._close_output(proxy, "out")
            self._close_output(proxy, "err")
        spawner = self.hub.spawner
        if spawner is not None:
            spawner.post((None, 0, link.lost, link))

    # -- the end -----------------------------------------------------------------------
    def stop(self) -> None:
        self._stopping = True
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass
        if self._thread is not threading.current_thread():
            self._thread.join(5.0)
        with self._plock:
            proxies, self.proxies = list(self.proxies.values()), {}
            # dropped (or added) while the thread was ending: never handled there
            proxies += [proxy for _what, proxy in self._changes]
            self._changes = []
        for proxy in proxies:
            proxy.close()
        self.payloads.clear()
        linux.close_quiet(self._wake_r, self._wake_w)
        self._sel.close()
