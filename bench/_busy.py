"""A busy machine's TCP table, made on purpose: what any machine that has run a test
suite or a training job holds (thousands of TIME_WAIT sockets), so that start-up is
measured, and guarded, where users run it rather than on a fresh machine.

A bounded loop of connect/close on 127.0.0.1: the connecting side closes first, so its
end waits in TIME_WAIT for the kernel's 60 s. Nothing leaves this machine."""
from __future__ import annotations

import socket
import time

__all__ = ["fill_time_wait", "time_wait_count"]


def fill_time_wait(n: int, seconds: float = 60.0) -> int:
    """Leave about `n` TIME_WAIT sockets on loopback (fewer if `seconds` run out); the
    number made."""
    made = 0
    end = time.monotonic() + seconds
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(128)
        addr = server.getsockname()
        while made < n and time.monotonic() < end:
            client = socket.create_connection(addr, timeout=5)
            accepted, _ = server.accept()
            client.close()      # the active close: this end waits in TIME_WAIT
            accepted.close()
            made += 1
    return made


def time_wait_count() -> int:
    """TIME_WAIT sockets in this network namespace (state 06 in /proc/net/tcp{,6})."""
    count = 0
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(path) as f:
                count += sum(1 for line in f if line.split()[3:4] == ["06"])
        except OSError:
            pass
    return count
