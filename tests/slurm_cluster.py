"""A throwaway SLURM cluster of two nodes (or more: ``nodes=``) on this one machine,
for tests.

Usage from a test module (pytest's default "prepend" import mode puts
``tests/`` on ``sys.path`` for test files that live there)::

    import pytest
    import slurm_cluster

    slurm = slurm_cluster.slurm   # bind the fixture so pytest finds it
    pytestmark = pytest.mark.slurm

    def test_two_nodes(slurm):
        r = slurm.run(["srun", "-N2", "-n2", "hostname"], timeout=60)
        assert r.returncode == 0, r.stderr

or without the fixture::

    with slurm_cluster.slurm_cluster(tmp_path) as cluster:
        cluster.run([...])

What gets started, all as children of the calling process and in the
foreground, so that we hold their pids directly and reap them ourselves:

* one ``munged`` with a fresh random key and its own socket, so that it never
  touches a system munged or ``/etc/munge``;
* one ``slurmctld``;
* two ``slurmd`` (``-N n1`` and ``-N n2``), both with ``NodeAddr=127.0.0.1``
  but different ports.

The configuration, key, logs and controller state live under the
``tmp_path`` given to :func:`slurm_cluster` (logs are kept for debugging).
The unix sockets (munge's, and the per-step sockets slurmstepd creates in the
spool directory) live in a short directory made with
:func:`tempfile.mkdtemp`, because pytest's ``tmp_path`` is often too long for
the 108-byte ``sun_path`` limit; that directory is removed on exit.

On exit every job is cancelled, slurmstepd and job tasks that are still
around are killed (found by pid as described in :func:`_cluster_processes`,
never by name), every daemon is stopped by pid (SIGTERM, then SIGKILL after a
grace period) and reaped, and we check that nothing of the cluster is left.

Needs the Debian/Ubuntu packages ``slurm-wlm`` and ``munge``
(``.ci/install-slurm.sh``).  Runs as root or as an ordinary user: SlurmUser
and SlurmdUser are the current user, and jobs run as that user.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shlex
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence, Tuple, Union

import pytest

__all__ = [
    "Allocation",
    "SlurmCluster",
    "SlurmClusterError",
    "slurm_cluster",
    "slurm",
    "require_slurm",
    "slurm_available",
    "missing_binaries",
    "SKIP_REASON",
]

SKIP_REASON = "slurm-wlm and munge not installed: run .ci/install-slurm.sh"

NODE_NAMES: Tuple[str, ...] = ("n1", "n2")   # the default; slurm_cluster(nodes=3) adds n3


def node_names(count: int) -> Tuple[str, ...]:
    return tuple(f"n{i}" for i in range(1, count + 1))
PARTITION = "debug"

# Daemons live in /usr/sbin, which is not on every user's PATH.
_SEARCH_PATH = os.pathsep.join(
    [os.environ.get("PATH", ""), "/usr/sbin", "/usr/local/sbin", "/sbin"]
)
_DAEMONS = ("munged", "slurmctld", "slurmd")
_CLIENTS = ("srun", "sbatch", "sinfo", "squeue", "scontrol", "scancel")

# Variables that srun/sbatch/salloc read as *input*.  If the test suite itself
# runs inside a SLURM allocation (a CI job on a cluster), inherited SLURM_JOB_ID
# and friends would make our srun try to join that outer job; drop them all.
_INHERITED_PREFIXES = ("SLURM_", "SBATCH_", "SALLOC_", "SRUN_", "SCONTROL_",
                       "SINFO_", "SQUEUE_")


# Set in SlurmCluster.env, so every srun/sbatch run with it and every job
# task carries it (but not the daemons); see _cluster_processes().
_MARKER_VAR = "MPLAUNCH_SLURM_CLUSTER"

# Startup is retried only when a daemon lost its port to another process.
_START_ATTEMPTS = 3


class SlurmClusterError(RuntimeError):
    """The cluster did not start, or did not stop cleanly.

    The message says what went wrong and ends with the tail of every daemon
    log; the full logs stay in ``<tmp_path>/log``.
    """


def _which(name: str) -> Optional[str]:
    return shutil.which(name, path=_SEARCH_PATH)


def missing_binaries() -> List[str]:
    """Names of the required programs that cannot be found."""
    return [b for b in _DAEMONS + _CLIENTS if _which(b) is None]


def slurm_available() -> bool:
    return not missing_binaries()


def _free_ports(n: int) -> List[int]:
    """Return ``n`` distinct free TCP ports on 127.0.0.1.

    All sockets are held open until every port is chosen so the kernel cannot
    hand out the same one twice.  There is an unavoidable window between
    closing them and the daemons binding; a clash shows up as a daemon dying
    at startup and is reported with its log.
    """
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _clean_env(base: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    env = dict(os.environ if base is None else base)
    for k in list(env):
        if k.startswith(_INHERITED_PREFIXES):
            del env[k]
    return env


def _proc_stat(pid: int) -> Optional[Tuple[str, str, int]]:
    """(command name, state, session id) of a process, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode(errors="replace")
    except OSError:
        return None
    # Format: pid (comm) state ppid pgrp session ...; comm may contain spaces
    # and parentheses, so split after the last ')'.
    rparen = stat.rfind(")")
    fields = stat[rparen + 2:].split()
    return stat[stat.find("(") + 1:rparen], fields[0], int(fields[3])


def _all_pids() -> List[int]:
    return [int(e) for e in os.listdir("/proc") if e.isdigit()]


def _socket_inodes_under(directory: Path) -> set:
    """Inodes of the unix sockets bound to a path under ``directory``."""
    prefix = str(directory) + os.sep
    inodes = set()
    try:
        with open("/proc/net/unix") as f:
            next(f)  # header
            for line in f:
                parts = line.split()
                # Num RefCount Protocol Flags Type St Inode [Path]
                if len(parts) >= 8 and parts[7].startswith(prefix):
                    inodes.add(parts[6])
    except OSError:
        pass
    return inodes


def _cluster_processes(sessions: Sequence[int], run_dir: Path, marker: str,
                       exclude: Sequence[int], by_env: bool = True) -> List[Tuple[int, str]]:
    """Live processes that belong to the cluster, found without matching names.

    A process belongs to the cluster if any of these holds:

    * it is in the session of one of our daemons (each is started with
      ``start_new_session=True``; slurmctld's slurmscriptd lives there);
    * it holds a unix socket bound under ``run_dir``: every slurmstepd listens
      on ``<SlurmdSpoolDir>/<node>_<job>.<step>``.  slurmstepd calls setsid()
      and is re-parented to init, and slurmd does not pass its environment on
      to it, so this is the reliable way to find one;
    * its environment contains ``marker`` (``_MARKER_VAR=<run_dir>``): srun
      started with :attr:`SlurmCluster.env` and the job tasks it launches
      (srun exports its environment to them by default).  Skipped when
      ``by_env`` is false, to look for slurmstepd only.
    """
    wanted_sids = set(sessions)
    skip = set(exclude) | {os.getpid()}
    inodes = _socket_inodes_under(run_dir)
    needle = b"\0" + marker.encode() + b"\0"
    found = []
    for pid in _all_pids():
        if pid in skip:
            continue
        st = _proc_stat(pid)
        if st is None or st[1] == "Z":   # gone, or a zombie someone else reaps
            continue
        comm, _, sid = st
        hit = sid in wanted_sids
        if not hit and inodes:
            with contextlib.suppress(OSError):
                for fd in os.listdir(f"/proc/{pid}/fd"):
                    with contextlib.suppress(OSError):
                        link = os.readlink(f"/proc/{pid}/fd/{fd}")
                        if link.startswith("socket:[") and link[8:-1] in inodes:
                            hit = True
                            break
        if not hit and by_env:
            with contextlib.suppress(OSError):
                with open(f"/proc/{pid}/environ", "rb") as f:
                    hit = needle in b"\0" + f.read() + b"\0"
        if hit:
            found.append((pid, comm))
    return found


@dataclass
class _Daemon:
    name: str            # "munged", "slurmctld", "slurmd-n1", ...
    proc: subprocess.Popen
    out_path: Path       # its stdout/stderr
    log_path: Path       # its own log file (may equal out_path)


@dataclass
class SlurmCluster:
    """A running cluster.  Use :meth:`run` to call srun/sbatch/... against it.

    Attributes:
        root: the ``tmp_path`` everything persistent lives under.
        conf: path of ``slurm.conf``.
        env: environment for client commands: ``os.environ`` without any
            inherited ``SLURM_*``/``SBATCH_*``/... variables, plus
            ``SLURM_CONF`` and :attr:`marker`.  Pass it (or a copy with
            additions) as ``env=`` to your own ``subprocess`` calls.
        nodes: node names, ``("n1", "n2")``.
        partition: the (default) partition name, ``"debug"``.
        cpus_per_node: CPUs declared per node (may exceed the real core
            count; ``SlurmdParameters=config_overrides`` allows that).
        ctld_port, node_ports: the TCP ports used.
        munge_socket: path of our munged's socket.
        log_dir: where ``slurmctld.log``, ``slurmd-n1.log``, ... are.
        run_dir: short temporary directory for sockets, spool and pid files
            (removed on exit).
        marker: ``"MPLAUNCH_SLURM_CLUSTER=<run_dir>"``; it is part of
            :attr:`env`, so srun and the job tasks carry it, which lets the
            teardown find anything left running.
    """

    root: Path
    conf: Path
    env: Dict[str, str]
    nodes: Tuple[str, ...]
    partition: str
    cpus_per_node: int
    ctld_port: int
    node_ports: Tuple[int, ...]
    munge_socket: Path
    log_dir: Path
    run_dir: Path
    marker: str
    _daemons: List[_Daemon] = field(default_factory=list, repr=False)

    # -- client helpers ---------------------------------------------------

    def run(
        self,
        args: Union[Sequence[str], str],
        timeout: float = 60.0,
        *,
        env: Optional[Dict[str, str]] = None,
        check: bool = False,
        **popen_kw,
    ) -> subprocess.CompletedProcess:
        """Run a command (e.g. ``["srun", "-N2", "-n2", ...]``) against the cluster.

        ``args`` may be a list or a string (split with :func:`shlex.split`;
        no shell).  ``env`` entries are *added* to :attr:`env`; to remove a
        variable, call :mod:`subprocess` yourself with a modified copy of
        :attr:`env`.  Other keyword arguments go to :class:`subprocess.Popen`.
        Output is captured as text unless ``stdout`` or ``stderr`` is given.
        With ``check=True`` a non-zero exit raises CalledProcessError.

        On timeout srun is sent SIGINT twice (srun's "abort the step" gesture,
        which cancels the tasks on the nodes), then SIGKILL if it is still
        there; it is always reaped, and :class:`subprocess.TimeoutExpired` is
        raised with whatever output was collected.
        """
        if isinstance(args, str):
            args = shlex.split(args)
        full_env = dict(self.env)
        if env:
            full_env.update(env)
        popen_kw.setdefault("stdin", subprocess.DEVNULL)
        if "stdout" not in popen_kw and "stderr" not in popen_kw:
            popen_kw["stdout"] = popen_kw["stderr"] = subprocess.PIPE
        popen_kw.setdefault("text", True)
        with subprocess.Popen(list(args), env=full_env, **popen_kw) as proc:
            try:
                out, err = proc.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                out, err = self._abort(proc)
                raise subprocess.TimeoutExpired(proc.args, timeout, out, err)
            except BaseException:
                self._abort(proc)
                raise
        cp = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
        if check:
            cp.check_returncode()
        return cp

    @staticmethod
    def _abort(proc: subprocess.Popen):
        out = err = None
        # Two SIGINTs within a second make srun kill the step and exit.
        for _ in range(2):
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGINT)
            time.sleep(0.2)
        try:
            out, err = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        return out, err

    def _quiet(self, args: Sequence[str], timeout: float = 10.0) -> subprocess.CompletedProcess:
        """Internal: run a client command, never raising on timeout."""
        try:
            return self.run(args, timeout=timeout)
        except subprocess.TimeoutExpired as e:
            return subprocess.CompletedProcess(args, -1, e.stdout or "", e.stderr or "")

    def node_states(self) -> Dict[str, str]:
        """``{node: state}`` as reported by ``sinfo`` (e.g. ``"idle"``)."""
        r = self._quiet(["sinfo", "-h", "-N", "-o", "%N %T"])
        states = {}
        if r.returncode == 0:
            for line in r.stdout.splitlines():
                parts = line.split()
                if len(parts) == 2:
                    states[parts[0]] = parts[1].lower()
        return states

    def job_ids(self) -> List[str]:
        """Ids of all jobs the controller still knows as pending/running/completing."""
        r = self._quiet(["squeue", "-h", "-o", "%A"])
        return r.stdout.split() if r.returncode == 0 else []

    def job_processes(self, step_wait: float = 10.0) -> List[Tuple[int, str]]:
        """``(pid, name)`` of every live slurmstepd, srun and job task of this
        cluster (see :func:`_cluster_processes`), not counting the daemons
        nor the calling process.  Empty once all jobs are over; a test can use
        it to prove that the code under test left nothing running on the
        "nodes".

        A job task or an srun is reported at once.  A slurmstepd alone is
        SLURM's, not the code under test's, and it may still be finishing its
        step (accounting, the step's epilog) for a moment after srun returned:
        it is waited for, up to ``step_wait`` seconds, before it counts.
        """
        own = list(self.pids.values())
        end = time.monotonic() + step_wait
        while True:
            found = _cluster_processes((), self.run_dir, self.marker, exclude=own)
            if not found or any(name != "slurmstepd" for _, name in found) \
                    or time.monotonic() >= end:
                return found
            time.sleep(0.05)

    def logs(self, tail: int = 60) -> str:
        """The last ``tail`` lines of every daemon log and stdout, for error messages."""
        chunks = []
        seen = set()
        for d in self._daemons:
            for p in (d.log_path, d.out_path):
                if p in seen:
                    continue
                seen.add(p)
                try:
                    lines = p.read_text(errors="replace").splitlines()
                except OSError:
                    continue
                status = "running" if d.proc.poll() is None else f"exited {d.proc.returncode}"
                chunks.append(f"----- {p.name} ({d.name}, pid {d.proc.pid}, {status}) -----")
                chunks.extend(lines[-tail:] if lines else ["<empty>"])
        return "\n".join(chunks)

    @property
    def pids(self) -> Dict[str, int]:
        """``{daemon name: pid}`` of the daemons this harness started."""
        return {d.name: d.proc.pid for d in self._daemons}

    def steps(self, job: str) -> List[Tuple[str, str]]:
        """``[(JOB.STEP, step name), ...]`` of job ``job`` as squeue lists them."""
        r = self._quiet(["squeue", "-s", "-j", job, "-h", "-o", "%i %j"])
        return [tuple(line.split(None, 1)) for line in r.stdout.splitlines()
                if line.strip()]

    @contextlib.contextmanager
    def allocation(self, nodes: int = 2, args: Sequence[str] = (),
                   timeout: float = 60.0) -> Iterator["Allocation"]:
        """An allocation held for the block, as ``salloc -N<nodes> <args>`` gives one
        to its command: yields an :class:`Allocation` whose ``env`` is exactly the
        environment salloc gave (SLURM_JOB_ID, SLURM_JOB_NUM_NODES, ... and
        :attr:`env`). A process that takes its ``slurm_env`` into its own environment
        (a test: ``monkeypatch.setenv``) is inside the allocation, as a shell of
        ``salloc`` is: its ``srun`` runs steps of the job.

        salloc's command writes its environment to a file and waits on its stdin;
        closing that stdin ends it, and salloc relinquishes the allocation. On a clean
        exit from the block, the job must have no step left (what the code under test
        started in it must have ended with it) and, once the controller forgot the
        job, no process of it may be left (:meth:`job_processes`): else
        AssertionError. On an error the allocation is relinquished all the same.
        """
        where = Path(tempfile.mkdtemp(prefix="salloc-", dir=self.root))
        env_path, out_path = where / "env", where / "salloc.out"
        holder = 'env -0 > "$1.part" && mv "$1.part" "$1" && exec cat > /dev/null'
        with open(out_path, "wb") as out:
            proc = subprocess.Popen(
                ["salloc", f"-N{nodes}", *args, "sh", "-c", holder, "sh", str(env_path)],
                env=self.env, stdin=subprocess.PIPE, stdout=out,
                stderr=subprocess.STDOUT, cwd=self.root)
        alloc = None
        try:
            deadline = time.monotonic() + timeout
            while not env_path.exists():
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise SlurmClusterError(
                        f"salloc -N{nodes} gave no allocation within {timeout:g} s "
                        f"(exit status {proc.poll()}): "
                        f"{out_path.read_text(errors='replace')}\n{self.logs()}")
                time.sleep(0.02)
            env = dict(item.split("=", 1) for item in
                       env_path.read_bytes().decode().split("\0") if "=" in item)
            alloc = Allocation(env["SLURM_JOB_ID"], env, proc.pid)
        except BaseException:
            self._relinquish(proc, alloc)
            raise
        try:
            yield alloc
        except BaseException:
            self._relinquish(proc, alloc)
            raise
        deadline = time.monotonic() + 20     # squeue hears of a step's end late
        steps = self.steps(alloc.job)
        while steps and time.monotonic() < deadline:
            time.sleep(0.2)
            steps = self.steps(alloc.job)
        self._relinquish(proc, alloc)
        jobs, procs = self._settled(alloc.job)
        assert not steps, f"steps of job {alloc.job} left when it ended: {steps}"
        assert not jobs and not procs, (f"job {alloc.job} still known ({jobs}) or its "
                                        f"processes left ({procs})")

    def _relinquish(self, proc: subprocess.Popen, alloc: Optional["Allocation"]) -> None:
        with contextlib.suppress(OSError):
            proc.stdin.close()        # its command ends, and salloc lets the job go
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            if alloc is not None:
                self._quiet(["scancel", alloc.job])
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def _settled(self, job: str, timeout: float = 20.0):
        """Once job ``job`` is over: ([ids squeue still shows for it], [processes of
        the cluster's jobs still alive]), after giving the controller time."""
        deadline = time.monotonic() + timeout
        while True:
            jobs = [j for j in self.job_ids() if j == job]
            procs = self.job_processes()
            if (not jobs and not procs) or time.monotonic() > deadline:
                return jobs, procs
            time.sleep(0.2)


@dataclass
class Allocation:
    """A held allocation (:meth:`SlurmCluster.allocation`): its job id, the environment
    salloc gave its command, and salloc's pid."""
    job: str
    env: Dict[str, str]
    salloc_pid: int

    @property
    def slurm_env(self) -> Dict[str, str]:
        """The variables that put a process inside the allocation: salloc's SLURM_*
        (SLURM_CONF among them) and the cluster's marker (see _cluster_processes)."""
        return {k: v for k, v in self.env.items()
                if k.startswith("SLURM_") or k == _MARKER_VAR}


# -- startup ---------------------------------------------------------------


def _write_conf(
    path: Path,
    *,
    user: str,
    ctld_port: int,
    node_ports: Sequence[int],
    names: Sequence[str],
    cpus: int,
    munge_socket: Path,
    state_dir: Path,
    run_dir: Path,
    log_dir: Path,
) -> None:
    node_lines = "\n".join(
        f"NodeName={name} NodeAddr=127.0.0.1 NodeHostname=localhost "
        f"Port={port} CPUs={cpus} RealMemory=4096 State=UNKNOWN"
        for name, port in zip(names, node_ports)
    )
    text = f"""\
# Generated by tests/slurm_cluster.py: a private cluster on 127.0.0.1.
ClusterName=mplaunch-test
# "localhost" is accepted by slurmctld as "this host" whatever the hostname is.
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmUser={user}
SlurmdUser={user}

AuthType=auth/munge
CredType=cred/munge
# Our own munged; used by auth/munge and cred/munge alike.
AuthInfo=socket={munge_socket}

StateSaveLocation={state_dir}
# %n is the node name given with slurmd -N, so the two slurmd do not collide.
SlurmdSpoolDir={run_dir}/spool-%n
SlurmctldPidFile={run_dir}/slurmctld.pid
SlurmdPidFile={run_dir}/slurmd-%n.pid
SlurmctldLogFile={log_dir}/slurmctld.log
SlurmdLogFile={log_dir}/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
TmpFS={run_dir}

# No cgroups and no systemd here: track tasks through /proc, bind nothing.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
MailProg=/bin/true

SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
# Accept the CPU count below even if it exceeds the real machine.
SlurmdParameters=config_overrides
ReturnToService=2

# Short timers so cancellation and teardown are quick.
KillWait=2
InactiveLimit=0
MinJobAge=2
MessageTimeout=10
SlurmdTimeout=60
SlurmctldTimeout=60

{node_lines}
PartitionName={PARTITION} Nodes={",".join(names)} Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
"""
    path.write_text(text)


def _spawn(
    name: str,
    argv: List[str],
    out_path: Path,
    log_path: Path,
    env: Dict[str, str],
    cwd: Path,
) -> _Daemon:
    # The file is dup'ed into the child; close our copy straight away so the
    # test process holds no extra fd for the life of the cluster.
    with open(out_path, "wb") as out:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=cwd,
            # Own session: Ctrl-C on the terminal does not hit the daemons
            # before our teardown runs, and _cluster_processes() can find
            # what they fork.
            start_new_session=True,
            close_fds=True,
        )
    return _Daemon(name, proc, out_path, log_path)


def _wait_until(pred, timeout: float, what: str, cluster: SlurmCluster,
                interval: float = 0.05) -> None:
    deadline = time.monotonic() + timeout
    while True:
        dead = [d for d in cluster._daemons if d.proc.poll() is not None]
        if dead:
            raise SlurmClusterError(
                f"{', '.join(d.name for d in dead)} exited during startup "
                f"while waiting for {what}\n{cluster.logs()}"
            )
        if pred():
            return
        if time.monotonic() > deadline:
            raise SlurmClusterError(
                f"timed out after {timeout:.0f}s waiting for {what}\n{cluster.logs()}"
            )
        time.sleep(interval)


def _munge_ready(sock_path: Path) -> bool:
    if not sock_path.exists():
        return False
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        try:
            s.connect(str(sock_path))
        except OSError:
            return False
    return True


def _start(cluster: SlurmCluster, key: Path, timeout: float) -> None:
    munged, slurmctld, slurmd = (_which(b) for b in _DAEMONS)
    log_dir, run_dir = cluster.log_dir, cluster.run_dir
    # The daemons do not get the marker: their own helpers (slurmctld's
    # slurmscriptd) must not look like leftovers of a job in _stop().
    daemon_env = {k: v for k, v in cluster.env.items() if k != _MARKER_VAR}

    # munged -F: stay in the foreground so the pid we hold is the daemon.
    cluster._daemons.append(_spawn(
        "munged",
        [munged, "-F", "--force",
         f"--socket={cluster.munge_socket}",
         f"--key-file={key}",
         f"--log-file={log_dir / 'munged.log'}",
         f"--pid-file={run_dir / 'munged.pid'}",
         f"--seed-file={run_dir / 'munged.seed'}",
         "--num-threads=2"],
        log_dir / "munged.out", log_dir / "munged.log", daemon_env, cluster.root,
    ))
    _wait_until(lambda: _munge_ready(cluster.munge_socket), timeout,
                "munged socket", cluster)

    # slurmctld -D: foreground; -i: ignore (nonexistent) saved state.
    cluster._daemons.append(_spawn(
        "slurmctld",
        [slurmctld, "-D", "-i", "-f", str(cluster.conf)],
        log_dir / "slurmctld.out", log_dir / "slurmctld.log", daemon_env, cluster.root,
    ))
    # Wait for the controller before starting slurmd: a slurmd that cannot
    # register at once retries only after a back-off, costing seconds.
    _wait_until(
        lambda: "is UP" in cluster._quiet(["scontrol", "ping"], timeout=5).stdout,
        timeout, "slurmctld to answer 'scontrol ping'", cluster, interval=0.1,
    )

    for name in cluster.nodes:
        cluster._daemons.append(_spawn(
            f"slurmd-{name}",
            [slurmd, "-D", "-N", name, "-f", str(cluster.conf)],
            log_dir / f"slurmd-{name}.out", log_dir / f"slurmd-{name}.log",
            daemon_env, cluster.root,
        ))

    def all_idle() -> bool:
        states = cluster.node_states()
        return all(states.get(n) == "idle" for n in cluster.nodes)

    _wait_until(all_idle, timeout, f"nodes {', '.join(cluster.nodes)} to be idle in sinfo",
                cluster, interval=0.1)


# -- teardown --------------------------------------------------------------


def _stop(cluster: SlurmCluster, grace: float = 10.0) -> None:
    """Cancel jobs, stop every daemon by pid, reap them, and check for leftovers.

    Raises SlurmClusterError if anything had to be killed forcibly or is
    still alive at the end.
    """
    problems = []
    ctld = next((d for d in cluster._daemons if d.name == "slurmctld"), None)
    daemon_pids = [d.proc.pid for d in cluster._daemons]

    def wait_strays(timeout: float, sessions: Sequence[int],
                    by_env: bool = True) -> List[Tuple[int, str]]:
        def strays():
            return _cluster_processes(sessions, cluster.run_dir, cluster.marker,
                                      exclude=daemon_pids, by_env=by_env)
        deadline = time.monotonic() + timeout
        left = strays()
        while left and time.monotonic() < deadline:
            time.sleep(0.1)
            left = strays()
        return left

    # 1. Jobs: cancel them through the controller, so that slurmstepd kills
    #    the tasks and cleans up properly (KillWait=2 keeps this short).
    if ctld is not None and ctld.proc.poll() is None:
        ids = cluster.job_ids()
        if ids:
            cluster._quiet(["scancel", *ids])
            deadline = time.monotonic() + grace + 5
            while cluster.job_ids() and time.monotonic() < deadline:
                time.sleep(0.1)

    # 2. Leftover slurmstepd / tasks / srun (see _cluster_processes): let the
    #    slurmstepds finish their cleanup, give srun a moment to exit, then
    #    SIGKILL whatever is left (tasks that escaped slurmstepd's process
    #    tree survive scancel).  The daemons' sessions are left out here:
    #    slurmctld's helper slurmscriptd lives there, and killing it makes
    #    slurmctld hang on SIGTERM.
    wait_strays(5.0, sessions=(), by_env=False)
    left = wait_strays(1.0, sessions=())
    if left:
        problems.append(f"had to SIGKILL leftover processes {left}")
        for pid, _ in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    # 3. Daemons: the slurmds together, then slurmctld, then munged last
    #    (the others talk to it while shutting down).  SIGTERM, wait, SIGKILL;
    #    wait() reaps them, so no zombie is left behind.
    groups: Dict[str, List[_Daemon]] = {}
    for d in cluster._daemons:
        groups.setdefault(d.name.split("-")[0], []).append(d)
    for kind in ("slurmd", "slurmctld", "munged"):
        group = groups.get(kind, [])
        for d in group:
            if d.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    d.proc.terminate()
        for d in group:
            try:
                d.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                problems.append(f"{d.name} (pid {d.proc.pid}) ignored SIGTERM; killed")
                d.proc.kill()
                d.proc.wait()

    # 4. Verify that nothing of the cluster is still alive, now including the
    #    daemons' sessions.
    left = wait_strays(5.0, sessions=daemon_pids)
    if left:
        for pid, _ in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        left = wait_strays(2.0, sessions=daemon_pids)
        if left:
            problems.append(f"processes still alive after SIGKILL: {left}")

    logs = cluster.logs() if problems else ""
    shutil.rmtree(cluster.run_dir, ignore_errors=True)
    if problems:
        raise SlurmClusterError("teardown: " + "; ".join(problems) + "\n" + logs)


# -- public entry points ---------------------------------------------------


@contextlib.contextmanager
def slurm_cluster(
    tmp_path: Union[str, os.PathLike],
    *,
    cpus_per_node: int = 2,
    startup_timeout: float = 30.0,
    nodes: int = len(NODE_NAMES),
) -> Iterator[SlurmCluster]:
    """Start the cluster under ``tmp_path``; yield a :class:`SlurmCluster`; tear down.

    Each node declares ``cpus_per_node`` CPUs whatever the real machine has,
    so placement is the same everywhere: with the default of 2, ``srun -N2
    -n4`` puts two tasks on each node and at most 4 tasks fit at once.

    Raises :class:`SlurmClusterError` (with the daemon logs) if the nodes are
    not idle within ``startup_timeout`` seconds, and ``FileNotFoundError`` if
    the binaries are missing (the :func:`slurm` fixture turns that into a
    skip).
    """
    missing = missing_binaries()
    if missing:
        raise FileNotFoundError(f"{SKIP_REASON} (missing: {', '.join(missing)})")

    root = Path(tmp_path).resolve()
    for attempt in range(1, _START_ATTEMPTS + 1):
        cluster, key = _prepare(root, cpus_per_node, node_names(nodes))
        try:
            _start(cluster, key, startup_timeout)
        except BaseException as exc:
            _stop(cluster)
            # The ports were free when we picked them, but another process
            # (any outgoing connection takes an ephemeral port) may have taken
            # one before the daemon bound it.  Rare; try again with new ports.
            if (isinstance(exc, SlurmClusterError) and "Address already in use" in str(exc)
                    and attempt < _START_ATTEMPTS):
                continue
            raise
        break
    try:
        yield cluster
    finally:
        _stop(cluster)  # also removes run_dir


def _prepare(root: Path, cpus_per_node: int,
             names: Tuple[str, ...] = NODE_NAMES) -> Tuple[SlurmCluster, Path]:
    """Fresh directories, munge key, ports and slurm.conf; nothing started."""
    root.mkdir(parents=True, exist_ok=True)
    log_dir = root / "log"
    state_dir = root / "state"
    for d in (log_dir, state_dir):
        shutil.rmtree(d, ignore_errors=True)  # from a failed earlier attempt
        d.mkdir(parents=True)
    # munged refuses group/world-accessible key and log locations.
    os.chmod(root, 0o700)
    os.chmod(log_dir, 0o700)
    key = root / "munge.key"
    key.write_bytes(os.urandom(1024))
    os.chmod(key, 0o600)

    try:
        user = pwd.getpwuid(os.getuid()).pw_name
    except KeyError:
        user = str(os.getuid())
    ctld_port, *node_ports = _free_ports(1 + len(names))

    # Short directory for unix sockets (sun_path is limited to 108 bytes).
    # munged wants it searchable by everyone (it warns otherwise); nothing
    # secret lives here.
    run_dir = Path(tempfile.mkdtemp(prefix="slurm-"))
    try:
        os.chmod(run_dir, 0o755)
        for name in names:
            (run_dir / f"spool-{name}").mkdir()
        munge_socket = run_dir / "munge.sock"
        conf = root / "slurm.conf"
        _write_conf(conf, user=user, ctld_port=ctld_port, node_ports=node_ports,
                    names=names, cpus=cpus_per_node, munge_socket=munge_socket,
                    state_dir=state_dir, run_dir=run_dir, log_dir=log_dir)
    except BaseException:
        shutil.rmtree(run_dir, ignore_errors=True)
        raise

    env = _clean_env()
    env["SLURM_CONF"] = str(conf)
    env[_MARKER_VAR] = str(run_dir)
    cluster = SlurmCluster(
        root=root, conf=conf, env=env, nodes=names, partition=PARTITION,
        cpus_per_node=cpus_per_node, ctld_port=ctld_port,
        node_ports=tuple(node_ports), munge_socket=munge_socket, log_dir=log_dir,
        run_dir=run_dir, marker=f"{_MARKER_VAR}={run_dir}",
    )
    return cluster, key


def require_slurm() -> None:
    """``pytest.skip`` the calling test if the cluster cannot run here; under CI
    (CI=true, where .ci/install-slurm.sh installed it) fail it instead: a SLURM that
    could not be set up there is a failed run, never a row of skips."""
    missing = missing_binaries()
    if missing:
        why = f"{SKIP_REASON} (missing: {', '.join(missing)})"
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI: {why}; .ci/install-slurm.sh should have installed them")
        pytest.skip(why)


@pytest.fixture
def slurm(tmp_path) -> Iterator[SlurmCluster]:
    """A fresh two-node cluster for one test (start and stop take well under
    a second each).  Skips the test if slurm-wlm/munge are missing.  Bind it
    at module level in a test module to use it (``from slurm_cluster import
    slurm``).
    """
    require_slurm()
    with slurm_cluster(tmp_path / "slurm") as cluster:
        yield cluster
