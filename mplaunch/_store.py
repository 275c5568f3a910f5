"""The rendezvous store, hosted by the launching process on a port it already holds.

Picking a "free" port with bind(0), closing it and handing the number to rank 0 is a
race: anything can take the port in between. Here the socket is bound once, here, and
handed to torch's TCPStore as its listening fd, so MASTER_PORT names a port that is
ours for the whole attempt. Ranks join it as clients (see _worker's env:// hook).
"""
from __future__ import annotations

import contextlib
import errno
import os
import socket
from datetime import timedelta


def _bind(addr: str, port: int) -> socket.socket:
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


@contextlib.contextmanager
def hosted(cfg):
    """Yields ("host:port" the ranks should treat as mplaunch's store, port).

    On node 0 the store is hosted here; on other nodes nothing is hosted and the
    ranks connect to node 0's store.
    """
    if cfg.node_rank != 0:
        yield (f"{cfg.master_addr}:{cfg.master_port}", cfg.master_port)
        return
    try:
        sock = _bind(cfg.master_addr, cfg.master_port or 0)
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
    from torch.distributed import TCPStore
    world = cfg.nnodes * cfg.nprocs
    fd = sock.detach()  # the store owns the listening fd from here on, and closes it
    try:
        store = TCPStore(cfg.master_addr, port, world, True,
                         timeout=timedelta(seconds=300), wait_for_workers=False,
                         master_listen_fd=fd)
    except BaseException:
        try:
            os.close(fd)
        except OSError:
            pass
        raise
    try:
        yield (f"{cfg.master_addr}:{port}", port)
    finally:
        del store  # stops the server and closes the port
