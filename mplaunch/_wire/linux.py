"""Thin wrappers over the Linux process primitives mplaunch depends on."""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import socket
import time
from typing import Dict, Optional, Tuple

# mplaunch's own plumbing: an interrupt is never raised in its frames (_rank.call_loop)
__mplaunch_plumbing__ = True

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
PR_GET_CHILD_SUBREAPER = 37

_libc = None


def _c():
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    return _libc


def _prctl(option: int, arg: int) -> bool:
    try:
        return _c().prctl(option, ctypes.c_ulong(arg), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def set_pdeathsig(signo: int = signal.SIGKILL) -> bool:
    """Ask the kernel to send `signo` when the thread that forked us exits."""
    return _prctl(PR_SET_PDEATHSIG, int(signo))


def set_child_subreaper() -> bool:
    """Orphaned descendants are re-parented to us instead of to pid 1, so we can reap
    and kill them."""
    return _prctl(PR_SET_CHILD_SUBREAPER, 1)


def get_child_subreaper() -> int:
    """This process's subreaper setting (0 or 1; 0 where it cannot be read)."""
    value = ctypes.c_int(0)
    try:
        _c().prctl(PR_GET_CHILD_SUBREAPER, ctypes.byref(value), 0, 0, 0)
    except (OSError, AttributeError):
        return 0
    return value.value


def restore_child_subreaper(value: int) -> bool:
    return _prctl(PR_SET_CHILD_SUBREAPER, 1 if value else 0)


def memfd_with(data: bytes, name: str = "mplaunch") -> int:
    """An anonymous in-memory file holding `data`, positioned at 0, close-on-exec."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def read_all_fd(fd: int) -> bytes:
    """The whole content of a regular file (memfd) from offset 0."""
    size = os.fstat(fd).st_size
    chunks = []
    offset = 0
    while offset < size:
        chunk = os.pread(fd, size - offset, offset)
        if not chunk:
            break
        chunks.append(chunk)
        offset += len(chunk)
    return b"".join(chunks)


def describe_status(status: int):
    """(exitcode, signal number or None) from a raw wait status, exitcode negative for a
    signal as multiprocessing reports it."""
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        return -sig, sig
    if os.WIFEXITED(status):
        return os.WEXITSTATUS(status), None
    return None, None


def close_quiet(*fds: int) -> int:
    """Close each fd; one that is closed already (or never was open) is not an error.
    Returns how many were closed."""
    closed = 0
    for fd in fds:
        try:
            os.close(fd)
            closed += 1
        except OSError:
            pass
    return closed


def killpg_quiet(pgid: int, signo: int) -> None:
    try:
        os.killpg(pgid, signo)
    except (ProcessLookupError, PermissionError):
        pass


def kill_quiet(pid: int, signo: int) -> None:
    try:
        os.kill(pid, signo)
    except (ProcessLookupError, PermissionError):
        pass


def children_of(pid: int):
    """Direct children of `pid` (Linux /proc; empty if unavailable)."""
    kids = []
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return kids
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                kids.extend(int(x) for x in f.read().split())
        except OSError:
            pass
    return kids


def descendants_of(pid: int):
    """Every descendant of `pid`, parents before their children."""
    out = []
    todo = children_of(pid)
    seen = set()
    while todo:
        p = todo.pop(0)
        if p in seen:
            continue
        seen.add(p)
        out.append(p)
        todo.extend(children_of(p))
    return out


def is_dead(pid: int) -> bool:
    """True once `pid` has exited: a zombie has, only its exit status is left."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rpartition(b")")[2].split()[0]
    except (OSError, IndexError):
        return True
    return state in (b"Z", b"X")


def wait_dead(pids, timeout: float) -> list:
    """Wait for processes already sent SIGKILL: the signal is only acted on when the
    kernel next schedules them. Returns those still running after `timeout`."""
    end = time.monotonic() + timeout
    pending = [p for p in pids if not is_dead(p)]
    while pending and time.monotonic() < end:
        time.sleep(0.001)
        pending = [p for p in pending if not is_dead(p)]
    return pending


def group_members(pgid: int):
    """Pids whose process group is `pgid` (Linux /proc)."""
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                fields = f.read().rpartition(b")")[2].split()
        except OSError:
            continue
        if len(fields) > 2 and int(fields[2]) == pgid:
            out.append(int(name))
    return out


def pgid_of(pid: int):
    try:
        return os.getpgid(pid)
    except (ProcessLookupError, PermissionError):
        return None



def entry_code(module: str, function: str) -> str:
    """`python -c` code that calls mplaunch.<module>.<function>() from this very copy of
    the package, whatever sys.path the new interpreter starts with."""
    # this file is mplaunch/_wire/linux.py: the package's parent is three levels up
    pkg_parent = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return (f"import sys; sys.path.insert(0, {pkg_parent!r}); "
            f"from mplaunch.{module} import {function}; {function}()")


def socket_fds(pid: int) -> Dict[int, int]:
    """{fd: socket inode} of a process (empty if it cannot be read)."""
    out: Dict[int, int] = {}
    base = f"/proc/{pid}/fd"
    try:
        names = os.listdir(base)
    except OSError:
        return out
    for name in names:
        try:
            target = os.readlink(f"{base}/{name}")
        except OSError:
            continue
        if target.startswith("socket:["):
            out[int(name)] = int(target[8:-1])
    return out


Endpoint = Tuple[str, int]
# (local endpoint, remote endpoint or None, whether it listens) of one TCP socket
SocketEnds = Tuple[Endpoint, Optional[Endpoint], bool]


def socket_ends(fd: int) -> Optional[SocketEnds]:
    """What this process's fd `fd` is, when it is a TCP socket: its local endpoint, its
    remote one (None when it has none: a listener, or a connection already reset), and
    whether it listens; None for anything else (a unix socket, a pipe, a closed fd).

    Asked of the socket itself (getsockname, getpeername, SO_ACCEPTCONN), never read
    from /proc/net/tcp: that table holds every TCP socket of the network namespace
    (thousands of TIME_WAIT ones on any machine that has run something), and a rank
    must pay for what it owns, not for what the machine holds."""
    try:
        dup = os.dup(fd)
    except OSError:
        return None
    try:
        s = socket.socket(fileno=dup)
    except OSError:
        os.close(dup)
        return None
    try:
        if s.family not in (socket.AF_INET, socket.AF_INET6) or \
                s.type != socket.SOCK_STREAM:
            return None
        local = _endpoint(s.getsockname())
        listening = bool(s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN))
        try:
            remote: Optional[Endpoint] = _endpoint(s.getpeername())
        except OSError:
            remote = None
        return local, remote, listening
    except (OSError, ValueError):
        return None
    finally:
        s.close()


def _endpoint(address) -> Endpoint:
    import ipaddress
    host = str(address[0]).split("%", 1)[0]
    return plain_ip(ipaddress.ip_address(host)), int(address[1])


def plain_ip(address) -> str:
    """The text of an ipaddress address, an IPv4-mapped IPv6 one as the IPv4 address it
    maps: a connection accepted by a dual-stack AF_INET6 listener names its IPv4 peer
    so, and the same peer seen from an AF_INET socket must compare equal."""
    mapped = getattr(address, "ipv4_mapped", None)
    return str(mapped if mapped is not None else address)


def unsent_bytes(sock) -> Optional[int]:
    """Bytes written to a TCP socket that its peer has not acknowledged yet (SIOCOUTQ);
    None where it cannot be read (a closed socket, another kind)."""
    import fcntl
    import struct
    import termios
    try:
        raw = fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0")
    except (OSError, ValueError, AttributeError):
        return None
    return struct.unpack("i", raw)[0]
