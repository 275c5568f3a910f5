"""Test "hosts" with addresses of their own: Linux network namespaces on one machine.

The nodes of tests/slurm_cluster.py are all 127.0.0.1, so nothing there proves that a
World works when every node has its own address. Here each host is a network namespace
with one interface and one address, all joined by a bridge in the root namespace, which
has an address on the same subnet::

    root namespace   10.X.Y.1/24 on bridge <tag>b
      |-- veth <tag>v0  <->  mplnet0  10.X.Y.2/24  in namespace mplnetns-<pid>-<k>-0
      |-- veth <tag>v1  <->  mplnet0  10.X.Y.3/24  in namespace mplnetns-<pid>-<k>-1
      ...

Every address reaches every other, both ways, and loopback is up in each namespace.
Only the network differs: processes in a namespace see the same filesystem, pids and
hostname as the test. ``ip netns exec`` execs the command itself (the pid we hold is
the command's), in a mount namespace of its own where /sys is the namespace's; it would
bind-mount files from /etc/netns/NAME over /etc, but we make none.

Usage from a test module (like slurm_cluster, the fixture is bound at module level)::

    import netns
    netns_hosts = netns.netns_hosts          # two hosts by default

    def test_something(netns_hosts):
        a, b = netns_hosts                   # Host objects
        netns_hosts.root_addr                # the root namespace's address
        p = a.popen([sys.executable, "server.py", a.addr], stdout=subprocess.PIPE)
        r = b.run([sys.executable, "-c", "..."], timeout=10)   # like subprocess.run

    @pytest.mark.parametrize("netns_hosts", [3], indirect=True)
    def test_three(netns_hosts): ...

or without the fixture ``with netns.network(3) as net: ...``.

torch.distributed with gloo across the namespaces needs two things in the ranks'
environment (:data:`TORCH_ENV`, which :meth:`Host.popen` does not add by itself):

* ``GLOO_SOCKET_IFNAME=mplnet0``. Without it gloo binds to the address the hostname
  resolves to if it can bind it, else to 127.0.0.1. Here the hostname resolves to
  127.0.0.1 (/etc/hosts), which every namespace has on its own loopback, so each rank
  advertises 127.0.0.1 to the others: a peer's connect is refused (rank 0, at once) or
  times out (rank 1, after some 25 s whatever init_process_group's timeout);
  tests/test_netns.py shows the listener on 127.0.0.1. Every
  namespace names its interface ``mplnet0`` so one value serves every rank; a rank in the
  root namespace would need the bridge's name, :attr:`Network.root_ifname`.
* ``TORCHELASTIC_USE_AGENT_STORE=True`` when the store lives elsewhere (here: in the root
  namespace) and the ranks rendezvous with ``init_method="tcp://ROOT:PORT"`` (or env://).
  Left alone, torch's rank 0 starts a store server on PORT itself: in its own namespace
  that bind succeeds (a port space of its own), so rank 0 runs a second, unused store
  without anyone noticing; on one shared network it would fail with EADDRINUSE.
  (Ranks launched by mplaunch need not: its rendezvous hook already makes every rank a
  client of the store named in MPLAUNCH_STORE.)

torch's store warns "The hostname of the client socket cannot be retrieved. err=-3"
for each client: there is no DNS for 10.X.Y addresses. Harmless.

At exit every process still running in one of the namespaces (found by the namespace's
inode in /proc/PID/ns/net, never by name) is killed, the ones we started are reaped, the
veths, namespaces and bridge are deleted, and :class:`NetnsError` is raised if any
namespace, link or process of ours is left.

Needs root and iproute2's ``ip``; the fixture skips the test otherwise, or when the
kernel refuses ``ip netns add`` or a bridge or veth (a container without CAP_NET_ADMIN).
"""
from __future__ import annotations

import contextlib
import fcntl
import itertools
import os
import re
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Optional, Sequence, Set

import pytest

__all__ = ["Host", "Network", "NetnsError", "NetnsUnavailable", "network", "netns_hosts",
           "unavailable_reason", "IFNAME", "TORCH_ENV"]

IFNAME = "mplnet0"   # the interface inside every namespace
# TORCHELASTIC_RESTART_COUNT: torch 2.1's tcp:// rendezvous reads it whenever
# TORCHELASTIC_USE_AGENT_STORE is set (a KeyError without it).
TORCH_ENV = {"GLOO_SOCKET_IFNAME": IFNAME, "TORCHELASTIC_USE_AGENT_STORE": "True",
             "TORCHELASTIC_RESTART_COUNT": "0"}

_counter = itertools.count()
_LOCK = os.path.join("/run/lock" if os.path.isdir("/run/lock") else "/tmp",
                     "mplaunch-netns.lock")


class NetnsError(RuntimeError):
    """Setting the network up or tearing it down went wrong, or something was left."""


class NetnsUnavailable(NetnsError):
    """This machine cannot make namespaces (not root, no ``ip``, or the kernel refuses)."""


def unavailable_reason() -> Optional[str]:
    """Why namespaces cannot be made here without trying, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if _ip_path() is None:
        return "iproute2's `ip` is not installed"
    return None


def _ip_path() -> Optional[str]:
    # ip lives in /usr/sbin or /sbin, which not every PATH has
    return shutil.which("ip", path=os.pathsep.join(
        [os.environ.get("PATH", ""), "/usr/sbin", "/sbin"]))


def _ip(*args: str, unavailable: bool = False) -> str:
    """Run ``ip ARGS``; its stdout. A failure raises NetnsError, or NetnsUnavailable when
    ``unavailable`` (a step that only fails where the kernel or container forbids it)."""
    r = subprocess.run([_ip_path() or "ip", *args], stdin=subprocess.DEVNULL,
                       capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        cls = NetnsUnavailable if unavailable else NetnsError
        raise cls(f"`ip {' '.join(args)}` failed ({r.returncode}): {r.stderr.strip()}")
    return r.stdout


def _netns_inode(pid: int) -> Optional[int]:
    try:
        return os.stat(f"/proc/{pid}/ns/net").st_ino
    except OSError:   # gone, or a zombie
        return None


def _pids_in(inodes: Set[int]) -> List[int]:
    """Live processes in any of the network namespaces with these inodes."""
    me = os.getpid()
    return [int(e) for e in os.listdir("/proc")
            if e.isdigit() and int(e) != me and _netns_inode(int(e)) in inodes]


@dataclass
class Host:
    """One namespace: ``addr`` is its address, ``name`` the namespace's name."""

    name: str
    addr: str
    inode: int                     # of the namespace (as in /proc/PID/ns/net)
    _net: "Network" = field(repr=False)

    def argv(self, argv: Sequence[str]) -> List[str]:
        """``argv`` prefixed to run in this namespace, for a caller that starts and
        reaps the process itself (the network still kills it at exit, by pid)."""
        return [_ip_path() or "ip", "netns", "exec", self.name, *argv]

    def popen(self, argv: Sequence[str], env: Optional[Dict[str, str]] = None,
              **kw) -> subprocess.Popen:
        """subprocess.Popen of ``argv`` in this namespace; stdin is /dev/null unless given.
        The network kills and reaps it at exit if it is still running; pipes it opened
        are closed then too."""
        kw.setdefault("stdin", subprocess.DEVNULL)
        proc = subprocess.Popen(self.argv(argv), env=env, **kw)
        self._net._procs.append(proc)
        return proc

    def run(self, argv: Sequence[str], timeout: float = 30.0, *, check: bool = False,
            env: Optional[Dict[str, str]] = None, **kw) -> subprocess.CompletedProcess:
        """Like subprocess.run in this namespace; output captured as text unless stdout
        or stderr is given. On timeout the command is killed, reaped, and
        TimeoutExpired raised."""
        if "stdout" not in kw and "stderr" not in kw:
            kw["stdout"] = kw["stderr"] = subprocess.PIPE
        kw.setdefault("text", True)
        with self.popen(argv, env=env, **kw) as proc:
            try:
                out, err = proc.communicate(timeout=timeout)
            except BaseException:
                proc.kill()
                proc.communicate()
                raise
        cp = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
        if check:
            cp.check_returncode()
        return cp


@dataclass
class Network:
    """The root address and the hosts; iterate or index it for the hosts."""

    root_addr: str
    root_ifname: str               # the bridge: GLOO_SOCKET_IFNAME for a root rank
    prefix: str                    # of our namespaces' names
    tag: str                       # of our links' names (<tag>b, <tag>v0, ...)
    hosts: List[Host] = field(default_factory=list)
    _procs: List[subprocess.Popen] = field(default_factory=list, repr=False)

    def __iter__(self) -> Iterator[Host]:
        return iter(self.hosts)

    def __len__(self) -> int:
        return len(self.hosts)

    def __getitem__(self, i: int) -> Host:
        return self.hosts[i]

    def leftovers(self) -> List[str]:
        """What of ours still exists: namespaces, links, processes in the namespaces,
        processes we started and have not reaped. Processes are looked for only in the
        namespaces still named in /run/netns: once one is deleted its inode number may
        go to a namespace of someone else (the kernel reuses them)."""
        left = [f"namespace {n}" for n in _ip("netns", "list").split()
                if n.startswith(self.prefix)]
        links = re.findall(r"^\d+: ([^:@]+)", _ip("-o", "link", "show"), re.M)
        left += [f"link {n}" for n in links if n.startswith(self.tag)]
        named = {h.inode for h in self.hosts if os.path.exists(f"/run/netns/{h.name}")}
        left += [f"process {pid} in a namespace" for pid in _pids_in(named)]
        left += [f"process {p.pid} not reaped" for p in self._procs if p.returncode is None]
        return left


def _free_subnet(seed: int) -> str:
    """``10.X.Y`` for a /24 that no address or route here uses, starting from ``seed``
    (so parallel runs start apart). X stays in 100..199, clear of the resolver's 10.255."""
    used = _ip("-4", "-o", "addr", "show") + _ip("-4", "route", "show", "table", "all")
    for i in range(100 * 256):
        n = (seed + i) % (100 * 256)
        net = f"10.{100 + n // 256}.{n % 256}"
        if f" {net}." not in used and f"\n{net}." not in "\n" + used:
            return net
    raise NetnsError("no free 10.X.Y.0/24 subnet")


@contextlib.contextmanager
def network(n: int = 2, *, grace: float = 3.0) -> Iterator[Network]:
    """Make ``n`` namespaces joined to the root one; yield a :class:`Network`; tear down
    (see the module's docstring). Raises NetnsUnavailable where namespaces cannot be
    made, NetnsError on any other failure or when something is left at exit."""
    if not 1 <= n <= 250:
        raise ValueError(f"1 to 250 hosts, not {n}")
    reason = unavailable_reason()
    if reason:
        raise NetnsUnavailable(reason)
    pid, k = os.getpid(), next(_counter)
    tag = f"mn{pid:x}c{k:x}"
    if len(tag) + 1 + len(str(n - 1)) + 1 > 15:   # IFNAMSIZ is 16 with the NUL
        raise NetnsError(f"link names would be too long: {tag}v{n - 1}")
    net = Network(root_addr="", root_ifname=f"{tag}b", prefix=f"mplnetns-{pid}-{k}-",
                  tag=tag)
    try:
        _build(net, n, seed=pid * 31 + k)
    except BaseException:
        with contextlib.suppress(NetnsError):
            _teardown(net, grace)
        raise
    try:
        yield net
    finally:
        _teardown(net, grace)


def _build(net: Network, n: int, seed: int) -> None:
    bridge = net.root_ifname
    _ip("link", "add", bridge, "type", "bridge", unavailable=True)
    # Choosing a subnet and taking it is one step for parallel runs (xdist workers).
    with open(_LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        subnet = _free_subnet(seed)
        net.root_addr = f"{subnet}.1"
        _ip("addr", "add", f"{net.root_addr}/24", "dev", bridge)
    _ip("link", "set", bridge, "up")
    for i in range(n):
        name, veth, addr = f"{net.prefix}{i}", f"{net.tag}v{i}", f"{subnet}.{i + 2}"
        _ip("netns", "add", name, unavailable=True)
        net.hosts.append(Host(name, addr, os.stat(f"/run/netns/{name}").st_ino, net))
        # The peer is born inside the namespace, so every namespace can call it IFNAME.
        _ip("link", "add", veth, "type", "veth", "peer", "name", IFNAME, "netns", name,
            unavailable=True)
        _ip("link", "set", veth, "master", bridge, "up")
        _ip("-n", name, "addr", "add", f"{addr}/24", "dev", IFNAME)
        _ip("-n", name, "link", "set", IFNAME, "up")
        _ip("-n", name, "link", "set", "lo", "up")


def _teardown(net: Network, grace: float) -> None:
    """Kill what runs in the namespaces, reap what we started, delete the links and the
    namespaces; raise NetnsError naming whatever is left."""
    inodes = {h.inode for h in net.hosts}
    # What we started, and anything they started that is still in a namespace: SIGTERM,
    # a grace period, then SIGKILL, all by pid.
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        pids = {p.pid for p in net._procs if p.poll() is None} | set(_pids_in(inodes))
        for p in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, sig)
        deadline = time.monotonic() + wait
        while (any(p.poll() is None for p in net._procs) or _pids_in(inodes)) \
                and time.monotonic() < deadline:
            time.sleep(0.02)
    for p in net._procs:
        for f in (p.stdin, p.stdout, p.stderr):
            if f is not None:
                f.close()
    # Looked for while /run/netns still pins the namespaces (see Network.leftovers)
    survivors = [f"process {pid} in a namespace" for pid in _pids_in(inodes)]
    failed = []
    # Deleting a veth deletes its peer in the namespace; the bridge goes last.
    for i, h in enumerate(net.hosts):
        for args in (("link", "del", f"{net.tag}v{i}"), ("netns", "del", h.name)):
            try:
                _ip(*args)
            except NetnsError as e:
                failed.append(str(e))
    with contextlib.suppress(NetnsError):   # it may never have been made
        _ip("link", "del", net.root_ifname)
    left = list(dict.fromkeys(survivors + net.leftovers()))
    if left:
        raise NetnsError("left after teardown: " + ", ".join(left)
                         + "".join(f"; {e}" for e in failed))

@pytest.fixture
def netns_hosts(request) -> Iterator[Network]:
    """A :class:`Network` of 2 hosts, or ``request.param`` hosts with
    ``@pytest.mark.parametrize("netns_hosts", [3], indirect=True)``. Skips the test where
    namespaces cannot be made."""
    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    with contextlib.ExitStack() as stack:
        try:
            net = stack.enter_context(network(getattr(request, "param", 2)))
        except NetnsUnavailable as e:
            pytest.skip(f"cannot make network namespaces here: {e}")
        yield net
