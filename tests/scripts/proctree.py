"""The test side of tree_parent.py: start it, wait for its ranks to report, snapshot its
process tree, tell when processes are gone, and never leave one behind."""
import contextlib
import json
import os
import subprocess
import sys
import time

import psutil

SCRIPTS = os.path.dirname(os.path.abspath(__file__))


class DetachedEscaped(AssertionError):
    """Only grandchildren in a session of their own survived: what start_method="fork"
    cannot catch yet (no server is their ancestor; see FORK_DETACHED)."""


FORK_DETACHED = ("documented limitation of start_method='fork': when the launching "
                 "process is SIGKILLed, a rank's grandchild in a new session "
                 "(start_new_session=True, setsid, a daemon) is outside the rank's process "
                 "group and below no mplaunch server, so nothing can find it")


def is_gone(p):
    """Dead, whether reaped yet or not (an orphaned zombie waits for init, not for us)."""
    try:
        return not p.is_running() or p.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def wait_gone(procs, timeout, since=None):
    """(seconds since `since` when the last one went, survivors): polls until every
    process is gone or `timeout` seconds after `since` (default: now) have passed."""
    start = time.monotonic() if since is None else since
    while True:
        alive = [p for p in procs if not is_gone(p)]
        elapsed = time.monotonic() - start
        if not alive or elapsed > timeout:
            return elapsed, alive
        time.sleep(0.005)


def describe(procs):
    lines = []
    for p in procs:
        try:
            lines.append(f"pid {p.pid} ppid {p.ppid()} {p.status()} "
                         f"{' '.join(p.cmdline())[:160]}")
        except psutil.Error:
            lines.append(f"pid {p.pid} (gone)")
    return "\n".join(lines) or "(none)"


class TreeParent:
    """One tree_parent.py process and, once its ranks reported, everything below it."""

    def __init__(self, outdir, method, light=False):
        self.outdir = str(outdir)
        self.log_path = os.path.join(self.outdir, "parent.log")
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, os.path.join(SCRIPTS, "tree_parent.py"), method,
                 self.outdir, *(["light"] if light else [])],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        self.tree = []

    def log(self):
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def wait_ranks(self, nprocs=2, timeout=120.0):
        """Each rank's record, once every rank has written it; then the snapshot of the
        parent's whole process tree (servers, ranks and their descendants)."""
        paths = [os.path.join(self.outdir, f"rank.{r}.json") for r in range(nprocs)]
        deadline = time.monotonic() + timeout
        while not all(os.path.exists(p) for p in paths):
            if self.proc.poll() is not None:
                raise AssertionError(f"tree_parent.py exited with {self.proc.returncode} "
                                     f"before its ranks reported:\n{self.log()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"ranks did not report in {timeout} s:\n{self.log()}")
            time.sleep(0.02)
        records = []
        for p in paths:
            with open(p) as f:
                records.append(json.load(f))
        self.tree = psutil.Process(self.proc.pid).children(recursive=True)
        return records

    def servers(self):
        """mplaunch's server processes: the parent's direct children running its code
        (a rank forked from a server shares its command line, but not its parent)."""
        out = []
        for p in self.tree:
            with contextlib.suppress(psutil.Error):
                if p.ppid() == self.proc.pid and "mplaunch._server.server" in " ".join(p.cmdline()):
                    out.append(p)
        return out

    def result(self):
        for line in self.log().splitlines():
            if line.startswith("RESULT "):
                return json.loads(line[len("RESULT "):])
        raise AssertionError(f"tree_parent.py printed no RESULT line:\n{self.log()}")

    def close(self):
        """Kill, by pid, whatever a failed test left running, then reap the parent."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for p in self.tree:
            if not is_gone(p):
                with contextlib.suppress(psutil.Error):
                    p.kill()


@contextlib.contextmanager
def tree_parent(outdir, method, light=False):
    tp = TreeParent(outdir, method, light)
    try:
        yield tp
    finally:
        tp.close()
