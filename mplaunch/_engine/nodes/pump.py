"""The pump of a World across nodes: one thread that copies between each remote rank's
fds (the ends a local rank's process would hold, kept here) and its node's link, in
both directions, so that the RankGroup reads and writes remote ranks' fds as it does
local ones. It reads every link and hands each record to the Hub (Hub.received), which
routes it: a rank's bytes come back here (output, stack bytes, a message from its
channel), the rest go to the link or the group. Output is written without blocking (what
a pipe cannot take waits here), so one rank's unread output never stops the others'
records; what waits here is bounded by the agents' output window
(tunnel.OUTPUT_WINDOW), given back (Credit) as it is written on.

The pump owns the rank proxies and nothing else: the links, the payloads and the group
are the Hub's, which the pump reaches through its methods only. Rejected: a pump that
dispatched the records itself and called the spawner (before), which made the pump,
the Hub and the spawner each reach into the others' state.
"""
from __future__ import annotations

import logging
import os
import selectors
import socket
import threading
import time
from typing import Dict, List, Sequence

from .. import servers
from ..._wire import linux, tunnel
from ..._wire.channel import FramedReader
from ..._wire.link import BEAT_S, SILENT_S, Credit, Output, RankMessage, StackBytes

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
    """Started (start) once the hub's links are up and it routes what they say
    (Hub.start); stopped by Hub.close."""

    def __init__(self, hub):
        self.hub = hub
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = os.pipe()
        self._stopping = False
        self._proxies: Dict[int, _Proxy] = {}
        self._plock = threading.Lock()
        self._changes: List = []
        self._thread = threading.Thread(target=self._pump, name="mplaunch-nodes",
                                        daemon=True)

    def start(self) -> None:
        self._thread.start()

    # -- from the group's thread -------------------------------------------------------
    def add_proxy(self, token: int, link, fds: Sequence[int]) -> None:
        """Rank `token` on `link`'s node gets the child ends `fds` (RANK_FDS order); a
        proxy the token had (a replaced rank's) is dropped."""
        proxy = _Proxy(token, link, fds)
        with self._plock:
            old = self._proxies.pop(token, None)
            if old is not None:
                self._changes.append(("drop", old))
            self._proxies[token] = proxy
            self._changes.append(("add", proxy))
        os.write(self._wake_w, b"x")

    def add_link(self, link) -> None:
        """A replacement node's link (Hub.install): read from now on."""
        with self._plock:
            self._changes.append(("link", link))
        os.write(self._wake_w, b"x")

    def drop_proxy(self, token: int) -> None:
        with self._plock:
            proxy = self._proxies.pop(token, None)
            if proxy is not None:
                self._changes.append(("drop", proxy))
        os.write(self._wake_w, b"x")

    # -- the thread ----------------------------------------------------------------------
    def _pump(self) -> None:
        sel = self._sel
        sel.register(self._wake_r, selectors.EVENT_READ, ("wake", None))
        for link in self.hub.links:
            sel.register(link.sock, selectors.EVENT_READ, ("link", link))
        checked = time.monotonic()
        while not self._stopping:
            try:
                events = sel.select(BEAT_S)
            except (OSError, ValueError):
                return
            # Once a beat, not at every record (a call's path: that cost 0.15 ms a call);
            # judged only while this thread keeps up (not after it was held up itself:
            # a large frame, this process stopped), and not for a link with data waiting.
            now = time.monotonic()
            if now - checked >= BEAT_S:
                self._check_silent(now, {id(k.data[1]) for k, _ in events},
                                   held_up=now - checked > 2.5 * BEAT_S)
                checked = now
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
                    log.exception("mplaunch: error relaying a node's records")

    def _on_wake(self) -> None:
        try:
            os.read(self._wake_r, 4096)
        except BlockingIOError:
            pass
        with self._plock:
            changes, self._changes = self._changes, []
        for what, proxy in changes:
            if what == "link":
                self._sel.register(proxy.sock, selectors.EVENT_READ, ("link", proxy))
            elif what == "add":
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
            try:
                self.hub.call_rank(proxy.link, proxy.token, data, fds)
            finally:
                linux.close_quiet(*fds)
        if reader.eof:
            self._sel.unregister(reader.sock)

    def _on_stack(self, proxy: _Proxy) -> None:
        if proxy.stack is None:
            return   # dropped (closed) by a change handled in the same select
        try:
            chunk = proxy.stack.recv(1 << 16)
        except OSError:
            chunk = b""
        if chunk:
            proxy.link.send(StackBytes(proxy.token, chunk))
        else:
            self._sel.unregister(proxy.stack)

    def _on_link(self, link) -> None:
        # `reading`/`heard`: the agent is alive and talking, however long a record takes
        # (a large result), which the liveness checks (_engine.nodes.spawner) allow for.
        link.reading = True
        try:
            record = tunnel.recv(link.sock)
        except OSError as exc:
            record = None
            link.lost = link.lost or f"its connection failed ({exc})"
        finally:
            link.reading = False
            link.heard = time.monotonic()
        if record is None:
            link.lost = link.lost or "its connection closed"
            self._sel.unregister(link.sock)
            self._lost(link)
            return
        self.hub.received(link, record)

    # -- a rank's bytes (Hub.received routes them here) --------------------------------
    def from_rank(self, _link, msg: RankMessage) -> None:
        """What a remote rank's channel said, written whole to the proxy's end, which the
        group reads (non-blocking through the reader's dup; a result larger than the
        socket's buffer is written whole)."""
        try:
            proxy = self._proxies.get(msg.token)
            if proxy is not None and proxy.res is not None:
                try:
                    tunnel.deliver_fds(proxy.res, msg.data, msg.fds)
                except OSError:
                    pass
        finally:
            linux.close_quiet(*msg.fds)

    def from_stack(self, _link, msg: StackBytes) -> None:
        proxy = self._proxies.get(msg.token)
        if proxy is not None and proxy.stack is not None:
            try:
                if msg.data:
                    proxy.stack.sendall(msg.data)
                else:
                    proxy.stack.shutdown(socket.SHUT_WR)
            except OSError:
                pass

    def output(self, _link, msg: Output) -> None:
        proxy = self._proxies.get(msg.token)
        which = msg.stream
        if proxy is None or getattr(proxy, which, None) is None:
            return
        if not msg.data:    # EOF: every writer on the node is gone
            self._close_output(proxy, which)
            return
        proxy.pending[which] += msg.data
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
            proxy.link.send(Credit(proxy.token, which, written))
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

    def _check_silent(self, now: float, waiting: set, held_up: bool) -> None:
        """A node whose agent beats (_wire.link.Beat) and has sent nothing for SILENT_S,
        nor is sending now, nor being sent to, is lost: frozen (SIGSTOP, a hung kernel)
        or cut off, which TCP does not see for minutes. After this thread was held up,
        every link starts a fresh window. An agent that is taking in a large frame of
        ours (its loop reads it whole, and beats after) is not silent either: the bytes
        we sent and it has not taken keep falling (a frozen one's stay)."""
        for link in list(self.hub.links):
            unsent = linux.unsent_bytes(link.sock)
            moving = bool(unsent or link.unsent) and unsent != link.unsent
            link.unsent = unsent
            if held_up or moving or id(link) in waiting:
                link.heard = max(link.heard, now - BEAT_S)
            elif (link.beating and link.lost is None and not link.reading
                    and now - link.heard > SILENT_S):
                self.hub.lose(link, f"its agent sent nothing for {now - link.heard:.0f} s "
                                    f"(is the node frozen, or cut off?)")

    def _lost(self, link) -> None:
        """A node's connection ended: its ranks' outputs end, and the group hears."""
        with self._plock:
            mine = [p for p in self._proxies.values() if p.link is link]
        for proxy in mine:
            self._close_output(proxy, "out")
            self._close_output(proxy, "err")
        self.hub.lose(link, link.lost)

    # -- the end -----------------------------------------------------------------------
    def stop(self) -> None:
        self._stopping = True
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass
        thread = self._thread
        if thread.ident is not None and thread is not threading.current_thread():
            thread.join(5.0)
        with self._plock:
            proxies, self._proxies = list(self._proxies.values()), {}
            # dropped (or added) while the thread was ending: never handled there
            proxies += [proxy for what, proxy in self._changes if what != "link"]
            self._changes = []
        for proxy in proxies:
            proxy.close()
        linux.close_quiet(self._wake_r, self._wake_w)
        self._sel.close()
