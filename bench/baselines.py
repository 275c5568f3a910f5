"""Baseline launchers for the mplaunch benchmark suite.

Each launcher runs ``fn(*args)`` in ``nprocs`` ranks with the ``env://``
rendezvous environment set per rank, blocks until all ranks are done, and
raises if any rank failed.  The launchers are what users would write by hand
without mplaunch:

  tmp_spawn        torch.multiprocessing.spawn(..., join=True)
  tmp_forkserver   torch.multiprocessing.start_processes(start_method="forkserver")
  elastic_spawn    torch.distributed.elastic.multiprocessing.start_processes
                   (spawn), polled at torchrun's monitor interval, then close()
  fork             multiprocessing fork context, one Process per rank, from a
                   parent that has already imported torch

Interface (what bench/run.py builds on):

  LAUNCHERS: dict name -> launch(fn, nprocs, args=()) -> None
  run_once(launch, case, timeout=...) -> float seconds
  time_case(launch, case, repeats, timeout=...) -> {"median": s, "cold": s, "samples": [...]}
  run_baselines(launchers=None, cases=None, repeats=5, ...) ->
      {launcher: {case: {"median": s, "cold": s, "samples": [...]}}}
      (a case that could not be measured holds {"error": str, "samples": [...]})
  format_table(results, cases=None) -> str
  shutdown_helpers() stops the forkserver / resource tracker this process started.

"cold" is the first sample, "median" the median of the others (warm runs).
run_once raises TimeoutError past its timeout and ProcessLeak when a process
started during the launch is still alive afterwards (it is killed by pid).

Any launch callable with the same signature (e.g. an mplaunch adapter) can be
passed to run_once / time_case and is measured the same way.

CLI:  python bench/baselines.py [--repeats N] [--cases gloo4,trivial2,fail_teardown]
                                [--launchers ...] [--json out.json]
"""

import argparse
import contextlib
import gc
import json
import multiprocessing
import multiprocessing.connection
import multiprocessing.util
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
# Children unpickle case functions as ``_cases.<fn>``; spawn and forkserver
# children get the parent's sys.path, so putting bench/ there is enough.
if BENCH_DIR not in sys.path:
    sys.path.insert(0, BENCH_DIR)

import psutil  # noqa: E402

# The fork baseline is defined as forking from a parent that already imported
# torch (that is how it is used in practice), and elastic needs
# torch.distributed anyway, so both are imported here, before any timing.
import torch  # noqa: E402,F401
import torch.distributed  # noqa: E402,F401
import torch.multiprocessing as tmp  # noqa: E402
from torch.distributed.elastic.multiprocessing import (  # noqa: E402
    DefaultLogsSpecs,
    Std,
)
from torch.distributed.elastic.multiprocessing import (  # noqa: E402
    start_processes as elastic_start_processes,
)

import _cases  # noqa: E402

CASE_NAMES = tuple(_cases.CASES)

# torchrun's default --monitor-interval (torch/distributed/run.py) is 0.1 s;
# a hand-written elastic loop would poll at the same rate.
ELASTIC_MONITOR_INTERVAL = 0.1

# How long a still-running rank gets after SIGTERM before SIGKILL (fork baseline).
TERM_GRACE = 5.0

# Per-run safety net: past this, the run's processes are killed.
DEFAULT_TIMEOUT = 180.0


class LaunchFailed(RuntimeError):
    """A rank exited non-zero (raised by the launchers that do not have
    their own exception type)."""


class ProcessLeak(RuntimeError):
    pass


def free_port():
    """Return a TCP port that was free a moment ago.

    Bind-to-0-then-close is racy: another process may take the port between
    this call and the rank 0 store binding it.  That race is one of the
    problems mplaunch fixes; for the baselines it is what users do.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((_cases.MASTER_ADDR, 0))
        return s.getsockname()[1]


# --- launchers --------------------------------------------------------------


@contextlib.contextmanager
def _private_tempdir():
    """Point this process's tempfile at a fresh directory for one launch and
    remove it afterwards.

    torch.multiprocessing creates a pytorch-errorfile-*.pickle per rank in
    the temp dir and never deletes the ones failed ranks wrote (elastic's
    default log dir would land here too).  Only ``tempfile.tempdir`` of this
    process changes, not $TMPDIR, so children keep their usual temp dir.
    Used only by the torch launchers, never around a foreign launcher, so
    nothing else can cache a path inside the directory we delete;
    multiprocessing's own cached temp dir is created outside it first.
    Not thread-safe (tempfile.tempdir is process-global).
    """
    multiprocessing.util.get_temp_dir()
    saved = tempfile.tempdir
    run_dir = tempfile.mkdtemp(prefix="bench-launch-")
    tempfile.tempdir = run_dir
    try:
        yield run_dir
    finally:
        tempfile.tempdir = saved
        shutil.rmtree(run_dir, ignore_errors=True)


def launch_tmp_spawn(fn, nprocs, args=()):
    port = free_port()
    # spawn passes the process index first; tmp_entry turns it into the rank env.
    with _private_tempdir():
        tmp.spawn(
            _cases.tmp_entry,
            args=(nprocs, port, fn, tuple(args)),
            nprocs=nprocs,
            join=True,
        )


def launch_tmp_forkserver(fn, nprocs, args=()):
    port = free_port()
    # The forkserver keeps the environment it was started with, so the rank
    # env must be applied in the child (tmp_entry), not via os.environ here.
    with _private_tempdir():
        tmp.start_processes(
            _cases.tmp_entry,
            args=(nprocs, port, fn, tuple(args)),
            nprocs=nprocs,
            join=True,
            start_method="forkserver",
        )


def launch_elastic_spawn(fn, nprocs, args=()):
    port = free_port()
    envs = {r: _cases.rank_env(r, nprocs, port) for r in range(nprocs)}
    # DefaultLogsSpecs nests <run_id>_*/attempt_0/<rank>/ (error.json) under
    # log_dir; the torch.mp layer underneath adds its error files to tempdir.
    with _private_tempdir() as log_dir:
        pc = elastic_start_processes(
            name="bench",
            entrypoint=fn,
            args={r: tuple(args) for r in range(nprocs)},
            envs=envs,
            logs_specs=DefaultLogsSpecs(
                log_dir=log_dir, redirects=Std.NONE, tee=Std.NONE
            ),
            start_method="spawn",
        )
        try:
            # wait() polls _poll(); on the first failure _poll already
            # terminates the others, and close() makes sure all are joined.
            result = pc.wait(timeout=-1, period=ELASTIC_MONITOR_INTERVAL)
        finally:
            pc.close()
    if result is None or result.is_failed():
        failures = {} if result is None else result.failures
        raise LaunchFailed(
            "elastic: ranks failed: "
            + ", ".join(f"{r} (exitcode {f.exitcode})" for r, f in failures.items())
        )


def launch_fork(fn, nprocs, args=()):
    port = free_port()
    ctx = multiprocessing.get_context("fork")
    procs = []
    try:
        for rank in range(nprocs):
            p = ctx.Process(
                target=_cases.run_rank, args=(rank, nprocs, port, fn, tuple(args))
            )
            p.start()
            procs.append(p)

        pending = {p.sentinel: p for p in procs}
        failed = None
        while pending and failed is None:
            for sentinel in multiprocessing.connection.wait(list(pending)):
                p = pending.pop(sentinel)
                p.join()
                if p.exitcode != 0:
                    failed = p
                    break
        if failed is not None:
            # First failure: the others may be blocked in a collective forever.
            rest = list(pending.values())
            for p in rest:
                p.terminate()
            deadline = time.monotonic() + TERM_GRACE
            for p in rest:
                p.join(max(0.0, deadline - time.monotonic()))
            raise LaunchFailed(
                f"fork: rank {procs.index(failed)} exited with {failed.exitcode}"
            )
    finally:
        # Normal paths have joined everything already; this covers errors
        # (including KeyboardInterrupt) so no rank outlives the launch.
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join()


LAUNCHERS = {
    "tmp_spawn": launch_tmp_spawn,
    "tmp_forkserver": launch_tmp_forkserver,
    "elastic_spawn": launch_elastic_spawn,
    "fork": launch_fork,
}


# --- process hygiene ----------------------------------------------------------


def _helper_pids():
    """Pids of multiprocessing's long-lived helpers, which outlive a launch
    by design (they stop with this process or via shutdown_helpers())."""
    from multiprocessing import forkserver, resource_tracker

    pids = set()
    fs = getattr(forkserver, "_forkserver", None)
    if fs is not None and getattr(fs, "_forkserver_pid", None):
        pids.add(fs._forkserver_pid)
    rt = getattr(resource_tracker, "_resource_tracker", None)
    if rt is not None and getattr(rt, "_pid", None):
        pids.add(rt._pid)
    # mplaunch's warm servers persist across launches by design, like the forkserver.
    procs = sys.modules.get("mplaunch._engine.servers")
    if procs is not None:
        pids.update(procs.server_pids())
        pids.update(procs.idle_pool_pids())
    return pids


def _descendants():
    """Live (non-zombie) descendants, keyed by (pid, create_time) so a
    recycled pid is not mistaken for an old process."""
    out = {}
    for p in psutil.Process().children(recursive=True):
        try:
            if p.status() != psutil.STATUS_ZOMBIE:
                out[(p.pid, p.create_time())] = p
        except psutil.NoSuchProcess:
            pass
    return out


def _kill(procs):
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=5)


class _RunGuard:
    """Watchdog plus leak check around one launch.

    Only processes that appeared during the launch (excluding the
    multiprocessing helpers) are ever killed, and only by pid.
    """

    def __init__(self, timeout):
        self.timeout = timeout
        self.timed_out = False
        self.leaked = 0

    def _new_procs(self):
        helpers = _helper_pids()
        return [
            p
            for key, p in _descendants().items()
            if key not in self._before and p.pid not in helpers
        ]

    def _expire(self):
        self.timed_out = True
        _kill(self._new_procs())

    def __enter__(self):
        self._before = set(_descendants())
        self._timer = threading.Timer(self.timeout, self._expire)
        self._timer.daemon = True
        self._timer.start()
        return self

    def __exit__(self, exc_type, exc, tb):
        self._timer.cancel()
        left = self._new_procs()
        if left:
            # Give exiting processes a moment before calling it a leak, and ask again
            # which are helpers: one may have been started while we were looking.
            _, left = psutil.wait_procs(left, timeout=2)
            helpers = _helper_pids()
            left = [p for p in left if p.pid not in helpers]
        if left:
            self.leaked = len(left)
            _kill(left)
        return False


@contextlib.contextmanager
def _child_environment():
    """Environment every child inherits: one OpenMP thread (2-core box, and
    it must be set before torch loads in the child) and bench/ importable
    for anything that starts a fresh interpreter without spawn's sys.path."""
    saved = {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "PYTHONPATH")}
    os.environ["OMP_NUM_THREADS"] = "1"
    pp = [BENCH_DIR] + [x for x in (saved["PYTHONPATH"] or "").split(os.pathsep) if x]
    os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(pp))
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def shutdown_helpers():
    """Stop the forkserver and resource tracker if this process started them.

    Called between launchers so each launcher's cold run pays for its own
    helpers, and at the end so the suite leaves nothing running.
    """
    from multiprocessing import forkserver, resource_tracker

    # Drop unreachable queues/events first: their finalizers talk to the
    # resource tracker and would restart it after we stop it.
    gc.collect()
    fs = getattr(forkserver, "_forkserver", None)
    if fs is not None and getattr(fs, "_forkserver_pid", None):
        fs._stop()
    rt = getattr(resource_tracker, "_resource_tracker", None)
    if rt is not None and getattr(rt, "_pid", None):
        rt._stop()


def warm_page_cache():
    """Import torch.distributed once in a throwaway interpreter, so that the
    first launcher measured does not also pay for reading torch from disk
    ("cold" then means cold for the launcher, not for the file cache)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    subprocess.run(
        [sys.executable, "-c", "import torch.distributed"], env=env, check=True
    )


# --- timing driver ------------------------------------------------------------


def run_once(launch, case, timeout=DEFAULT_TIMEOUT):
    """Time one launch of ``case`` with ``launch``; return seconds.

    gloo4 / trivial2: from the call to its return.
    fail_teardown: from rank 1's time.time() just before it raises to the
    launch call raising in the parent (both on the same wall clock).
    """
    fn, nprocs, must_fail = _cases.CASES[case]
    with _child_environment(), _RunGuard(timeout) as guard:
        if not must_fail:
            t0 = time.perf_counter()
            launch(fn, nprocs, ())
            elapsed = time.perf_counter() - t0
        else:
            stamp_dir = tempfile.mkdtemp(prefix="bench-fail-")
            stamp = os.path.join(stamp_dir, "raised_at")
            try:
                try:
                    launch(fn, nprocs, (stamp,))
                except Exception:
                    t_end = time.time()
                else:
                    raise RuntimeError(f"{case}: launch returned, expected a failure")
                if guard.timed_out:
                    raise TimeoutError(f"{case}: killed after {timeout}s")
                try:
                    with open(stamp) as f:
                        t_raise = float(f.read())
                except FileNotFoundError:
                    raise RuntimeError(
                        f"{case}: launch failed before rank 1 reached its raise"
                    ) from None
                elapsed = t_end - t_raise
            finally:
                shutil.rmtree(stamp_dir, ignore_errors=True)
    if guard.timed_out:
        raise TimeoutError(f"{case}: killed after {timeout}s")
    if guard.leaked:
        raise ProcessLeak(f"{case}: {guard.leaked} process(es) outlived the launch")
    return elapsed


def summarize(samples):
    """cold = first sample; median = median of the rest (warm runs), or the
    single sample when there is only one."""
    warm = samples[1:] or samples
    return {
        "median": statistics.median(warm),
        "cold": samples[0],
        "samples": list(samples),
    }


def time_case(launch, case, repeats, timeout=DEFAULT_TIMEOUT):
    samples = [run_once(launch, case, timeout) for _ in range(repeats)]
    return summarize(samples)


def run_baselines(
    launchers=None,
    cases=None,
    repeats=5,
    timeout=DEFAULT_TIMEOUT,
    warm_cache=True,
    log=None,
):
    """Measure every (launcher, case); return the nested result dict.

    ``launchers``: names from LAUNCHERS or a {name: callable} dict.
    A failing case is recorded as {"error": ..., "samples": [...]} and the
    suite carries on.  Cases run in the given order per launcher, so put
    gloo4 first for its "cold" figure to include the launcher's own
    one-time setup (forkserver start, resource tracker).
    """
    if launchers is None:
        launchers = LAUNCHERS
    elif not isinstance(launchers, dict):
        launchers = {name: LAUNCHERS[name] for name in launchers}
    cases = list(cases or CASE_NAMES)
    for case in cases:
        if case not in _cases.CASES:
            raise ValueError(f"unknown case {case!r}; known: {', '.join(CASE_NAMES)}")
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))

    if warm_cache:
        warm_page_cache()
    results = {}
    try:
        for name, launch in launchers.items():
            shutdown_helpers()
            results[name] = {}
            for case in cases:
                samples = []
                try:
                    for i in range(repeats):
                        samples.append(run_once(launch, case, timeout))
                        log(f"{name:>15} {case:<14} run {i + 1}/{repeats}: {samples[-1]:.3f}s")
                    results[name][case] = summarize(samples)
                except Exception as e:  # record and move on to the next case
                    log(f"{name:>15} {case:<14} FAILED: {type(e).__name__}: {e}")
                    results[name][case] = {
                        "error": f"{type(e).__name__}: {e}",
                        "samples": samples,
                    }
    finally:
        shutdown_helpers()
    return results


def format_table(results, cases=None):
    cases = list(cases or CASE_NAMES)
    cols = []
    for case in cases:
        if case == "gloo4":
            cols.append(("gloo4 cold", case, "cold"))
        cols.append((f"{case} median", case, "median"))

    def cell(r, case, key):
        entry = r.get(case)
        if entry is None:
            return "-"
        if "error" in entry:
            return "ERROR"
        return f"{entry[key]:.3f}"

    width = max([len("launcher")] + [len(n) for n in results])
    header = f"{'launcher':<{width}}  " + "  ".join(f"{c[0]:>20}" for c in cols)
    lines = [header, "-" * len(header)]
    for name, r in results.items():
        lines.append(
            f"{name:<{width}}  " + "  ".join(f"{cell(r, c[1], c[2]):>20}" for c in cols)
        )
    lines.append("(seconds; median = median of warm runs, i.e. excluding the first)")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--cases", default=",".join(CASE_NAMES))
    ap.add_argument("--launchers", default=",".join(LAUNCHERS))
    ap.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT,
                    help="per-run limit in seconds; the run's processes are killed past it")
    ap.add_argument("--no-warm-cache", action="store_true",
                    help="skip importing torch once before measuring")
    ap.add_argument("--json", metavar="PATH", help="also write the results here")
    opts = ap.parse_args(argv)
    if opts.repeats < 1:
        ap.error("--repeats must be >= 1")
    cases = [c for c in opts.cases.split(",") if c]
    names = [n for n in opts.launchers.split(",") if n]
    unknown = [n for n in names if n not in LAUNCHERS]
    if unknown:
        ap.error(f"unknown launcher(s) {unknown}; known: {', '.join(LAUNCHERS)}")

    results = run_baselines(
        names, cases, opts.repeats, opts.timeout, warm_cache=not opts.no_warm_cache
    )
    print(format_table(results, cases))
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(results, f, indent=2)
    failed = any("error" in e for r in results.values() for e in r.values())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
