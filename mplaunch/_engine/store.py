"""The rendezvous store, hosted by the launching process on a port it already holds.

Picking a "free" port with bind(0), closing it and handing the number to rank 0 is a
race: anything can take the port in between. Here the socket is bound once, here, and
handed to torch's TCPStore as its listening fd, so MASTER_PORT names a port that is
ours for the whole attempt. Ranks join it as clients (see _rank.rendezvous).
"""
from __future__ import annotations

import contextlib
import errno
import socket
from datetime import timedelta

from .._wire.linux import close_quiet


def bind(addr: str, port: int) -> socket.socket:
    """A listening TCP socket on `addr`:`port` (0: any free port), the first of the
    addresses `addr` resolves to that binds. Also the World's agent port
    (_engine.nodes.agents.listen)."""
    infos = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)
    last = None
    for family, kind, proto, _name, sockaddr in infos:
        sock = socket.socket(family, kind, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(sockaddr)
            sock.listen(1024)
            return sock
        except OSError as exc:
            sock.close()
            last = exc
    raise last or OSError(f"cannot resolve {addr!r}")


class Hosted:
    """The launch's store as this node sees it: `store` is a TCPStore (the server on
    node 0, a client elsewhere) the parent uses to watch the other nodes."""

    def __init__(self, addr: str, port: int, store):
        self.addr, self.port, self.store = addr, port, store

    @property
    def address(self) -> str:
        return f"{self.addr}:{self.port}"


@contextlib.contextmanager
def hosted(cfg, connect_timeout: float = 300.0):
    """The store for the whole launch (every attempt uses its own key prefix).

    On node 0 it is hosted here, on a socket bound before anything else; other nodes
    connect to it (waiting for node 0 to come up, so a late node still joins).
    """
    from torch.distributed import TCPStore
    world = cfg.nnodes * cfg.nprocs
    if cfg.node_rank != 0:
        try:
            store = TCPStore(cfg.master_addr, cfg.master_port, world, False,
                             timeout=timedelta(seconds=connect_timeout))
        except Exception as exc:  # noqa: BLE001 - torch raises several kinds
            raise OSError(errno.ECONNREFUSED,
                          f"node {cfg.node_rank} could not reach node 0's store at "
                          f"{cfg.master_addr}:{cfg.master_port} within "
                          f"{connect_timeout:g} s: {exc}. Start node 0 with the same "
                          "master_addr and master_port.") from None
        hosted_ = Hosted(cfg.master_addr, cfg.master_port, store)
        del store
        try:
            yield hosted_
        finally:
            hosted_.store = None  # a traceback may keep this frame (and so the store) alive
        return
    try:
        sock = bind(cfg.master_addr, cfg.master_port or 0)
    except OSError as exc:
        if cfg.master_port and exc.errno == errno.EADDRINUSE:
            raise OSError(
                errno.EADDRINUSE,
                f"master_port {cfg.master_port} on {cfg.master_addr} is already in use by "
                "another process. Pass master_port=None to let mplaunch bind a free port "
                "and hold it for the whole launch, or choose a port nothing else uses."
            ) from None
        raise OSError(exc.errno, f"mplaunch cannot listen on {cfg.master_addr}:"
                                 f"{cfg.master_port or 0}: {exc.strerror or exc}") from None
    port = sock.getsockname()[1]
    fd = sock.detach()  # the store owns the listening fd from here on, and closes it
    try:
        store = TCPStore(cfg.master_addr, port, world, True,
                         timeout=timedelta(seconds=connect_timeout),
                         wait_for_workers=False, master_listen_fd=fd)
    except BaseException:
        close_quiet(fd)
        raise
    hosted_ = Hosted(cfg.master_addr, port, store)
    del store
    try:
        yield hosted_
    finally:
        # Dropping the last reference stops the server and closes the port, even while
        # a traceback keeps the frames of this launch alive.
        hosted_.store = None
