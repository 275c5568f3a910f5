"""The launching side of a World across nodes: its one SLURM step of node agents
(_engine.agent), the authenticated connection to each (_wire.auth, _wire.tunnel), and
RemoteSpawner, the spawner (_engine.spawners' seam) that starts, signals and reaps ranks
through them.

Every remote rank gets the fds a local one gets (result channel, output pipes, stack
socket): RemoteSpawner holds the rank's ends, and one thread here (the pump) copies
between them and the node's connection, so the RankGroup, the heal and the relay that
drive one node's ranks drive these, unchanged. Reports (started, exited, a lost node)
reach the group in its own thread, through a queue and a pipe on its selector.
"""
from __future__ import annotations

import dataclasses
import errno
import logging
import os
import queue
import selectors
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import Callable, Dict, List, Optional, Sequence

from . import servers
from .config import LaunchConfig
from .._wire import auth, linux, tunnel
from .._wire.channel import FramedReader, send_framed
from .._wire.spec import RankSpec

log = logging.getLogger("mplaunch")
__mplaunch_plumbing__ = True

JOIN_TIMEOUT = 120.0     # for every agent to connect and prove itself
AGENT_MODULE = "mplaunch._engine.agent"


class NodesError(RuntimeError):
    """The World's nodes could not be started or reached."""


# -- starting the step -------------------------------------------------------------------

def slurm_nodes_available(environ=os.environ) -> int:
    """How many nodes this SLURM allocation has (0 outside one)."""
    for name in ("SLURM_JOB_NUM_NODES", "SLURM_NNODES"):
        value = environ.get(name, "")
        if value.isdigit():
            return int(value)
    return 0


def check_allocation(nnodes: int, environ=os.environ) -> None:
    """Before anything starts: inside an allocation with enough nodes, srun found."""
    if "SLURM_JOB_ID" not in environ:
        raise RuntimeError(
            f"World(nnodes={nnodes}) starts one agent per node through SLURM, and this "
            "process is not inside a SLURM allocation (SLURM_JOB_ID is not set): run it "
            "in an salloc shell, a batch script, or a Jupyter server started inside the "
            "allocation")
    have = slurm_nodes_available(environ)
    if have and nnodes > have:
        raise ValueError(f"World(nnodes={nnodes}): this allocation (job "
                         f"{environ['SLURM_JOB_ID']}) has {have} node(s); ask for fewer, "
                         f"or allocate more (salloc -N {nnodes})")
    if shutil.which("srun") is None:
        raise RuntimeError(f"World(nnodes={nnodes}) needs SLURM's srun on PATH")


def srun_argv(nnodes: int, agent_argv: Sequence[str], environ=os.environ) -> List[str]:
    """The World's one step: one agent per node, sharing the allocation with the steps
    already running (``--overlap``: the kernel's own step may hold every CPU), not
    killed when one task fails (the launching process decides), unbuffered."""
    argv = ["srun", "--overlap", f"--nodes={nnodes}", f"--ntasks={nnodes}",
            "--ntasks-per-node=1", "--kill-on-bad-exit=0", "--wait=0", "-u",
            "--input=none", "--job-name=mplaunch-world"]
    cpus = environ.get("SLURM_CPUS_ON_NODE", "")
    if cpus.isdigit():
        # The ranks may use the node's CPUs, not the one CPU a task gets by default.
        argv.append(f"--cpus-per-task={cpus}")
    return argv + list(agent_argv)


def start_srun_step(agent_argv: Sequence[str], env: Dict[str, str], nnodes: int,
                    output) -> subprocess.Popen:
    """The default way of starting the agents: one srun step, in a session of its own
    (a Ctrl-C at the terminal is the launching process's to handle; a second one would
    make srun cancel the step)."""
    return subprocess.Popen(srun_argv(nnodes, agent_argv, env), env=env,
                            stdin=subprocess.DEVNULL, stdout=output, stderr=output,
                            start_new_session=True)


@dataclasses.dataclass
class NodeInfo:
    index: int
    name: str
    host: str
    pid: int
    environ: Dict[str, str]
    cpus: List[int]
    gpus: Optional[tuple] = None
    placed_cpus: Optional[tuple] = None


class _Proxy:
    """The launching side's ends of one remote rank's fds (RankState.open's child ends)."""
    __slots__ = ("token", "link", "res", "reader", "out", "err", "stack", "pending")

    def __init__(self, token: int, link: "Link", fds: Sequence[int]):
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


class Link:
    """The authenticated connection to one node's agent."""

    def __init__(self, sock: socket.socket, info: NodeInfo):
        self.sock = sock
        self.info = info
        self.lock = threading.Lock()      # whole frames from any thread
        self.lost: Optional[str] = None   # why the connection ended

    def send(self, kind: int, token: int = 0, body=b"") -> bool:
        if self.lost is not None:
            return False
        try:
            with self.lock:
                tunnel.send(self.sock, kind, token, body)
            return True
        except OSError as exc:
            self.lost = self.lost or f"its connection failed ({exc})"
            return False

    def describe(self) -> str:
        i = self.info
        return f"node {i.index} ({i.name})"


class Hub:
    """A World's nodes: the step of agents, one authenticated link to each, and the pump
    thread. Lives as long as the World (a heal or a replaced rank reuses it); closed,
    it ends the step and leaves nothing running on any node."""

    def __init__(self, nnodes: int, address: str, cfg: LaunchConfig, gpus, cpus,
                 starter: Optional[Callable] = None, join_timeout: float = JOIN_TIMEOUT):
        self.nnodes = nnodes
        self.address = address
        self.cfg = cfg
        self.placement_args = (gpus, cpus)
        self.starter = starter or start_srun_step
        self.join_timeout = join_timeout
        self.links: List[Link] = []
        self.step: Optional[subprocess.Popen] = None
        self._step_log = None
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = os.pipe()
        self._thread: Optional[threading.Thread] = None
        self._stopping = False
        self.proxies: Dict[int, _Proxy] = {}
        self._plock = threading.Lock()
        self._changes: List = []
        self.spawner: Optional["RemoteSpawner"] = None
        self.dropped = 0     # connections that failed to prove themselves

    @property
    def broken(self) -> bool:
        return any(link.lost is not None for link in self.links)

    @property
    def nodes(self) -> List[NodeInfo]:
        return [link.info for link in self.links]

    # -- start -------------------------------------------------------------------------
    def start(self) -> "Hub":
        secret = auth.new_secret()
        listener = _listen(self.address)
        try:
            port = listener.getsockname()[1]
            env = dict(os.environ)
            env[auth.SECRET_ENV] = secret
            env["MPLAUNCH_WORLD_ADDR"] = _join(self.address, port)
            env.pop("MPLAUNCH_NODE_INDEX", None)
            self._step_log = tempfile.TemporaryFile(prefix="mplaunch-agents-")
            self.step = self.starter([sys.executable, "-m", AGENT_MODULE], env,
                                     self.nnodes, self._step_log)
            self._accept(listener, secret)
        except BaseException:
            listener.close()
            self.close()
            raise
        listener.close()    # every agent is in: nobody else gets to connect
        self._configure()
        self._thread = threading.Thread(target=self._pump, name="mplaunch-nodes",
                                        daemon=True)
        self._thread.start()
        return self

    def _accept(self, listener: socket.socket, secret: str) -> None:
        end = time.monotonic() + self.join_timeout
        links: Dict[int, Link] = {}
        listener.settimeout(0.2)
        while len(links) < self.nnodes:
            if time.monotonic() > end:
                raise NodesError(f"{len(links)} of the World's {self.nnodes} node agents "
                                 f"joined within {self.join_timeout:g} s; "
                                 f"{self._step_said()}")
            if self.step.poll() is not None:
                raise NodesError(f"the World's step of node agents ended (exit status "
                                 f"{self.step.returncode}) before {self.nnodes} joined; "
                                 f"{self._step_said()}")
            try:
                sock, peer = listener.accept()
            except socket.timeout:
                continue
            try:
                auth.prove(sock, secret, server=True, timeout=10.0)
                sock.settimeout(30.0)
                frame = tunnel.recv(sock)
                if frame is None or frame[0] != tunnel.HELLO:
                    raise auth.AuthError("no hello")
                info = frame[2]
                node = NodeInfo(int(info["node"]), str(info["name"]), str(info["host"]),
                                int(info["pid"]), dict(info["environ"]), list(info["cpus"]))
            except (OSError, auth.AuthError, ValueError, KeyError, TypeError) as exc:
                self.dropped += 1
                log.warning("mplaunch dropped a connection from %s to the World's agent "
                            "port: %s", peer, exc)
                sock.close()
                continue
            if node.index in links or not 0 <= node.index < self.nnodes:
                sock.close()
                raise NodesError(f"two agents (or one out of range) said they are node "
                                 f"{node.index} of {self.nnodes}: is each node given one "
                                 f"task? {self._step_said()}")
            sock.settimeout(None)
            tunnel.keepalive(sock)
            links[node.index] = Link(sock, node)
        self.links = [links[i] for i in range(self.nnodes)]

    def _configure(self) -> None:
        """Send each agent the configuration; each starts its warm server and places its
        node's ranks (GPUs, CPUs: what that node has)."""
        cfg = dataclasses.replace(self.cfg, stdout=None, stderr=None)
        gpus, cpus = self.placement_args
        for link in self.links:
            link.send(tunnel.CONFIG, 0, (cfg, gpus, cpus))
        for link in self.links:
            link.sock.settimeout(300.0)
            try:
                frame = tunnel.recv(link.sock)
            except OSError as exc:
                frame = None
                link.lost = str(exc)
            finally:
                if link.sock.fileno() != -1:
                    link.sock.settimeout(None)
            if frame is None or frame[0] != tunnel.READY:
                raise NodesError(f"{link.describe()}'s agent ended while starting; "
                                 f"{self._step_said()}")
            ready = frame[2]
            if "error" in ready:
                raise NodesError(f"{link.describe()} cannot run this World: "
                                 f"{ready['error']}")
            link.info.gpus, link.info.placed_cpus = ready["gpus"], ready["cpus"]

    def _step_said(self) -> str:
        out = self._step_log
        if out is None:
            return "the step printed nothing"
        try:
            out.flush()
            out.seek(0)
            text = out.read()[-3000:].decode(errors="replace").strip()
        except (OSError, ValueError):
            text = ""
        cmd = shlex.join(srun_argv(self.nnodes, ["python", "-m", AGENT_MODULE]))
        return (f"the step ({cmd}) printed:\n{text}" if text
                else f"the step ({cmd}) printed nothing")

    # -- the pump: node connections <-> the ranks' fds ---------------------------------
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
        for link in self.links:
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
            proxy.link.send(tunnel.TO_RANK, proxy.token, (data, tunnel.fd_contents(fds)))
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

    def _on_link(self, link: Link) -> None:
        try:
            frame = tunnel.recv(link.sock)
        except OSError as exc:
            frame = None
            link.lost = link.lost or f"its connection failed ({exc})"
        if frame is None:
            link.lost = link.lost or "its connection closed"
            self._sel.unregister(link.sock)
            self._lost(link)
            return
        kind, token, body = frame
        if kind in (tunnel.OUT, tunnel.ERR):
            self._output(token, "out" if kind == tunnel.OUT else "err", body)
        elif kind == tunnel.FROM_RANK:
            proxy = self.proxies.get(token)
            data, blobs = body
            fds = tunnel.memfds(blobs)
            try:
                if proxy is not None and proxy.res is not None:
                    send_framed(proxy.res, data, fds)
            except OSError:
                pass
            finally:
                linux.close_quiet(*fds)
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
            spawner = self.spawner
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
        while fd is not None and buf:
            try:
                n = os.write(fd, buf)
            except BlockingIOError:
                break
            except OSError:
                buf.clear()     # the group closed its end
                break
            del buf[:n]
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

    def _lost(self, link: Link) -> None:
        """A node's connection ended: its ranks' outputs end, and the group hears."""
        with self._plock:
            mine = [p for p in self.proxies.values() if p.link is link]
        for proxy in mine:
            self._close_output(proxy, "out")
            self._close_output(proxy, "err")
        spawner = self.spawner
        if spawner is not None:
            spawner.post((None, 0, link.lost, link))

    # -- the end -----------------------------------------------------------------------
    def close(self, grace: float = 10.0) -> None:
        """End every agent (and so every rank) and the step; idempotent."""
        for link in self.links:
            link.send(tunnel.BYE)
        self._stopping = True
        if self._wake_w is not None:
            try:
                os.write(self._wake_w, b"x")
            except OSError:
                pass
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(5.0)
        self._thread = None
        for link in self.links:
            try:
                link.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            link.sock.close()
            link.lost = link.lost or "the World was closed"
        with self._plock:
            proxies, self.proxies = list(self.proxies.values()), {}
        for proxy in proxies:
            proxy.close()
        step, self.step = self.step, None
        if step is not None:
            _end_step(step, grace)
        if self._step_log is not None:
            self._step_log.close()
            self._step_log = None
        if self._wake_r is not None:
            linux.close_quiet(self._wake_r, self._wake_w)
            self._wake_r = self._wake_w = None
        self._sel.close()


def _end_step(step: subprocess.Popen, grace: float) -> None:
    """The agents end when their connection does, and the step with them; a step still
    there after `grace` is ended by SLURM (srun forwards SIGTERM to its tasks), then
    killed."""
    try:
        step.wait(grace)
        return
    except subprocess.TimeoutExpired:
        pass
    for signo, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        try:
            step.send_signal(signo)
            step.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue
        except ProcessLookupError:
            return
    log.warning("mplaunch: the World's srun step (pid %d) did not end", step.pid)


def _listen(address: str) -> socket.socket:
    infos = socket.getaddrinfo(address, 0, type=socket.SOCK_STREAM)
    last: Optional[OSError] = None
    for family, kind, proto, _name, sockaddr in infos:
        sock = socket.socket(family, kind, proto)
        try:
            sock.bind(sockaddr)
            sock.listen(64)
            servers.own_socket(sock)
            return sock
        except OSError as exc:
            sock.close()
            last = exc
    raise NodesError(f"cannot listen on {address!r} for the World's node agents: {last}; "
                     "give master_addr= an address of this machine that the nodes reach")


def _join(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class RemoteSpawner:
    """The spawner of a group whose ranks live on the hub's nodes (see spawners for the
    seam). Each rank's node is its spec's node_rank."""

    def __init__(self, cfg: LaunchConfig, events, hub: Hub):
        self.cfg = cfg
        self.events = events
        self.hub = hub
        self.lock = threading.RLock()
        self._queue: "queue.Queue" = queue.Queue()
        self._r = self._w = None
        self._sel = None
        self._tokens: Dict[int, _Proxy] = {}
        self._lost_seen: set = set()
        self._acks: set = set()

    def post(self, item) -> None:
        """From the pump thread."""
        self._queue.put(item)
        w = self._w
        if w is not None:
            try:
                os.write(w, b"x")
            except OSError:
                pass

    def open(self, sel: selectors.BaseSelector) -> None:
        self._r, self._w = os.pipe()
        os.set_blocking(self._r, False)
        for fd in (self._r, self._w):
            servers.own_fd(fd)
        self._sel = sel
        sel.register(self._r, selectors.EVENT_READ, self._on_events)
        self.hub.spawner = self
        for link in self.hub.links:
            link.send(tunnel.OPEN)
        for link in self.hub.links:
            if link.lost is not None:
                self.post((None, 0, link.lost, link))

    def start(self, token: int, spec: RankSpec, fds: Sequence[int]) -> None:
        link = self.hub.links[spec.node_rank]
        proxy = _Proxy(token, link, fds)
        old = self._tokens.pop(token, None)
        if old is not None:
            self.hub.drop_proxy(token)
        self._tokens[token] = proxy
        self.hub.add_proxy(proxy)
        payload = linux.read_all_fd(fds[0])
        if not link.send(tunnel.START, token, (spec, [payload])):
            self.post((tunnel.START_FAILED, token,
                       f"{link.describe()} is lost: {link.lost}", link))

    def pump(self) -> None:
        self._handle(self._queue.get())

    def _on_events(self, _fd) -> None:
        try:
            os.read(self._r, 4096)
        except BlockingIOError:
            pass
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            self._handle(item)

    def _handle(self, item) -> None:
        kind, token, body, link = item
        ev = self.events
        if ev is None:
            return
        if kind == tunnel.STARTED:
            ev.started(token, body)
        elif kind == tunnel.EXITED:
            status, max_rss, note = body
            ev.exited_token(token, status, max_rss, note)
        elif kind == tunnel.START_FAILED:
            ev.start_failed(token, body)
        elif kind == tunnel.SERVER_LOST:
            self._node_lost(link, body)
        elif kind is None:
            self._node_lost(link, f"mplaunch's agent there (pid {link.info.pid}) is "
                                  f"gone: {body}")
        elif kind in (tunnel.SWEPT, tunnel.CLOSED):
            self._acks.add((kind, link.info.index))

    def _node_lost(self, link: Link, why: str) -> None:
        if link.info.index in self._lost_seen:
            return
        self._lost_seen.add(link.info.index)
        tokens = [t for t, p in self._tokens.items() if p.link is link]
        self.events.node_lost(tokens, f"its node, {link.describe()}, was lost: {why}; "
                                      "every rank there is gone")

    def _tokens_by_link(self, tokens):
        by: Dict[int, List[int]] = {}
        for t in tokens:
            proxy = self._tokens.get(t)
            if proxy is not None:
                by.setdefault(proxy.link.info.index, []).append(t)
        return by

    def signal_groups(self, signo: int, pids, tokens=()) -> None:
        for node, ts in self._tokens_by_link(tokens).items():
            self.hub.links[node].send(tunnel.SIGNAL_GROUPS, 0, (signo, ts))

    def signal_ranks(self, signo: int, pids, tokens=()) -> None:
        for node, ts in self._tokens_by_link(tokens).items():
            self.hub.links[node].send(tunnel.SIGNAL_RANKS, 0, (signo, ts))

    def _round(self, kind: int, ack: int, timeout: float) -> None:
        self._acks = set()
        waiting = {link.info.index for link in self.hub.links if link.send(kind)}
        end = time.monotonic() + timeout
        while waiting and time.monotonic() < end:
            try:
                item = self._queue.get(timeout=max(0.01, end - time.monotonic()))
            except queue.Empty:
                break
            self._handle(item)
            waiting -= {i for k, i in self._acks if k == ack}
            waiting = {i for i in waiting if self.hub.links[i].lost is None}

    def sweep(self, timeout: float = 5.0) -> None:
        self._round(tunnel.SWEEP, tunnel.SWEPT, timeout)

    def close(self) -> None:
        self._round(tunnel.CLOSE_GROUP, tunnel.CLOSED, 15.0)
        for token in list(self._tokens):
            self.hub.drop_proxy(token)
        self._tokens = {}
        self.hub.spawner = None
        if self._sel is not None and self._r is not None:
            try:
                self._sel.unregister(self._r)
            except (KeyError, ValueError):
                pass
        for fd in (self._r, self._w):
            if fd is not None:
                servers.close_fd(fd)
        self._r = self._w = None
