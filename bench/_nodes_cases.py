"""A World across nodes, measured the same way on every scheduler: the cases, the report
and the command line of bench/nodes.py and bench/ray_world.py, written once.

A scheduler's part is a `Setup`: how its cluster is made (``session``: here, in this
process, or elsewhere, as SLURM's inside an allocation), how a World is made on it
(``scheduler=NAME`` and its options), and what only it is compared with (``starts``,
``calls``, ``heals``: srun's one-shot launchers, Ray Train, ...). The Setups:

    local  the tests' stand-in scheduler (tests/local_step.py): one agent per "node",
           both on this machine; no cluster to make (this file)
    slurm  the throwaway two-node SLURM cluster of the tests (bench/nodes.py)
    ray    a two-node ray.cluster_utils.Cluster (bench/ray_world.py)

For each scheduler named (``--scheduler a,b``), in that order, 4 ranks, 2 per node, gloo:

1. Start: from nothing (the cluster up) to the first ``all_reduce`` done: ``World(2,
   nnodes=2, scheduler=NAME)`` and its first ``run``, its second ``run`` (2.), and
   ``close()`` ("returned"), against the scheduler's own baselines, taking turns round
   by round; a one-node ``World(4)`` for scale (measured with the first scheduler only).
2. The second call: the same ``all_reduce`` again on the same World.
3. A trivial ``run`` on the 4 warm ranks (median, p90), against a one-node ``World(4)``.
4. Heals (``grace_period=5``), rank 3 (on the second node) failing: an exception; a rank
   that calls ``os._exit`` while the others wait in ``all_reduce``; a rank that raises
   while the others wait in ``all_reduce`` (a collective left half-done); ``timeout=1``
   of a Python function that sleeps, and of the builtin ``time.sleep`` itself; the
   second node's agent killed (SIGKILL) during a run. Each from the failure to ``run``
   raising and to the next ``run`` (an ``all_reduce`` on every rank) returning, and the
   failing call plus that next call; the same on a one-node ``World(4)``.

Every ratio is against the first scheduler's World, from this one run, on this machine.
At the end every process the run started must be gone: the bench is their subreaper,
waits for them, and reports and ends by pid whatever is left. Nothing here asserts a
timing; the figures go to docs/performance.rst.
"""
from __future__ import annotations

import argparse
import ctypes
import importlib
import json
import os
import platform
import re
import signal
import statistics
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for _p in (ROOT, HERE):
    if _p not in sys.path:
        sys.path.insert(0, _p)

PER_NODE, NNODES = 2, 2       # a World's nprocs counts one node's ranks, as launch's
NPROCS = PER_NODE * NNODES
FAILING = 3                   # a rank of the second node
GRACE = 5.0
ONE_NODE = "World(4) on one node (for scale)"


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def _med(xs):
    return statistics.median(xs) if xs else float("nan")


def _p90(xs):
    s = sorted(xs)
    return s[int(0.9 * (len(s) - 1))] if s else float("nan")


def _span(xs):
    return f"{min(xs):.2f}-{max(xs):.2f}" if xs else "-"


def _x(r):
    """A ratio, as the docs write them."""
    return "-" if r != r else f"{r:.0f}x" if r >= 100 else f"{r:.1f}x" if r >= 0.1 else f"{r:.2f}x"


def _ms(x):
    return "-" if x != x else (f"{x * 1e3:.1f} ms" if x < 1 else f"{x:.2f} s")


# -- in the ranks (by reference: bench/ is on every process's PYTHONPATH, see main) --------

def trivial():
    return 0


def allreduce():
    import torch
    import torch.distributed as dist
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


def _stamp(directory):
    with open(os.path.join(directory, "stamp.tmp"), "w") as f:
        f.write(repr(time.time()))
    os.replace(os.path.join(directory, "stamp.tmp"), os.path.join(directory, "stamp"))


def _stamped(directory):
    with open(os.path.join(directory, "stamp")) as f:
        return float(f.read())


def raise_alone(directory):
    import torch.distributed as dist
    if dist.get_rank() == FAILING:
        _stamp(directory)
        raise ValueError("rank 3 fails on its own")
    return 0


def exit_while_peers_wait(directory):
    import torch
    import torch.distributed as dist
    if dist.get_rank() == FAILING:
        _stamp(directory)
        os._exit(1)
    dist.all_reduce(torch.ones(1))


def raise_while_peers_wait(directory):
    import torch
    import torch.distributed as dist
    if dist.get_rank() == FAILING:
        _stamp(directory)
        raise ValueError("rank 3 fails before the collective")
    dist.all_reduce(torch.ones(1))


def sleep_long():
    time.sleep(30)


# -- a scheduler's part ------------------------------------------------------------------

class Setup:
    """How one scheduler's cluster is made and what only it is compared with."""
    name = "?"                 # World(scheduler=NAME)
    where = ""                 # its nodes, for the report's header
    options: dict = {}         # its World options

    @property
    def label(self):
        return f'World(2, nnodes=2, scheduler="{self.name}")'

    @staticmethod
    def add_arguments(ap):
        """Options of this scheduler's own (its baselines)."""

    def unavailable(self):
        """Why this scheduler cannot be measured here, or None."""

    def up(self):
        """Make the cluster (in this process). Returns what to report of it."""
        return {}

    def down(self):
        pass

    def session(self, args, scale):
        """Every figure of this scheduler: by default measured here, the cluster made
        around it."""
        fig = {"cluster": self.up()}
        try:
            fig.update(measure(self, args, scale))
        finally:
            self.down()
        return fig

    def world(self, **kw):
        import mplaunch
        return mplaunch.World(PER_NODE, nnodes=NNODES, scheduler=self.name, backend="gloo",
                              **dict(self.options, **kw))

    def starts(self, args, workdir):
        """name -> a function giving one start: {"first", "exit"[, "second",
        "second_first", "nodes"]} in seconds; taking turns with the World's."""
        return {}

    def calls(self, args):
        """name -> samples (seconds) of a trivial call on 4 warm workers."""
        return {}

    def heals(self, args):
        """name -> samples {"failing", "both", "what"}: a failing call and the next."""
        return {}

    def versions(self):
        return {}


class Local(Setup):
    """The tests' stand-in scheduler: a step process on this machine starting one agent
    per node, each named n1, n2 (tests/local_step.py registers scheduler="local")."""
    name = "local"
    where = ('nodes n1 and n2 of the tests\' stand-in scheduler (tests/local_step.py), '
             'both this machine (loopback)')

    def __init__(self):
        self.options = {"master_addr": "127.0.0.1", "local_wrap": _named_node}

    def up(self):
        sys.path.insert(0, os.path.join(ROOT, "tests"))
        import local_step  # noqa: F401 - registers scheduler="local"
        return {}


def _named_node(i):
    from mplaunch._wire import tunnel
    return ["env", f"{tunnel.NAME_ENV}=n{i + 1}"]


# Where each scheduler's Setup lives (imported only when named).
SETUPS = {"local": ("_nodes_cases", "Local"), "slurm": ("nodes", "Slurm"),
          "ray": ("ray_world", "Ray")}


def setup_class(name, own=None):
    if own and name in own:
        return own[name]
    module, cls = SETUPS[name]
    return getattr(importlib.import_module(module), cls)


# -- the World's measures ------------------------------------------------------------------

def _one_node(**kw):
    import mplaunch
    return mplaunch.World(NPROCS, backend="gloo", **kw)


def world_round(make):
    """World() + the first run(all_reduce), the second run, close()."""
    t0 = time.perf_counter()
    w = make()
    try:
        assert w.run(allreduce) == [float(NPROCS)] * NPROCS
        first = time.perf_counter() - t0
        nodes = [n["name"] for n in w.nodes]
        t1 = time.perf_counter()
        assert w.run(allreduce) == [float(NPROCS)] * NPROCS
        second = time.perf_counter() - t1
    finally:
        w.close()
    return {"first": first, "exit": time.perf_counter() - t0, "second": second,
            "nodes": nodes}


def world_calls(make, n):
    with make() as w:
        for _ in range(20):
            w.run(trivial)
        out = []
        for _ in range(n):
            t0 = time.perf_counter()
            w.run(trivial)
            out.append(time.perf_counter() - t0)
        return out


HEALS = {
    "exception": "rank 3 raises, the others return",
    "dead rank": "rank 3 calls os._exit while the others wait in all_reduce",
    "half-done": "rank 3 raises while the others wait in all_reduce (a collective left "
                 "half-done)",
    "timeout": "timeout=1, the ranks in a Python function that sleeps (from the deadline)",
    "timeout, builtin": "timeout=1 of run(time.sleep, (30,)): the builtin itself is the "
                        "function (from the deadline)",
    "agent killed": "the second node's agent killed (SIGKILL) during a run",
}
_STAMPED = {"exception": raise_alone, "dead rank": exit_while_peers_wait,
            "half-done": raise_while_peers_wait}


def _short(err):
    healed = getattr(err, "healed", None)
    return (f"{type(err).__name__}; healed: {healed}" if healed
            else f"{type(err).__name__}: {str(err).splitlines()[0][:200]}")


def _no_pids(text):
    """The message without its pids and attempt numbers (they differ run to run)."""
    text = re.sub(r"pids \{[^}]*\}", "pids ...", text)
    text = re.sub(r"\[attempt [0-9]+\]", "[attempt n]", text)
    return re.sub(r"pid [0-9]+", "pid ...", text)


def _next_run(w, failures, tries=3):
    """When the next all_reduce on every rank returned; a run that fails instead is
    recorded and retried (it is part of the time to a working world)."""
    import mplaunch
    for i in range(tries):
        try:
            assert w.run(allreduce) == [float(NPROCS)] * NPROCS
            return time.time()
        except mplaunch.WorkerError as exc:
            failures.append(str(exc).splitlines()[0][:300])
            log(f"    the next run failed ({i + 1} of {tries} tries): {failures[-1]}")
    raise RuntimeError(f"no working run after {tries} tries")


def heal_once(w, key, directory, failures):
    """One failing call of case `key`, then the next call: seconds from the failure to
    run raising (to_raise) and to the next run returning (to_next), from the failing
    call's start to it raising (failing) and to the next run returning (both)."""
    import mplaunch
    w.run(trivial)
    killed = []
    timeout = 120
    if key in _STAMPED:
        fn, args = _STAMPED[key], (directory,)
    elif key == "timeout":
        fn, args, timeout = sleep_long, (), 1
    elif key == "timeout, builtin":
        fn, args, timeout = time.sleep, (30,), 1
    else:                                   # the second node's agent killed
        fn, args = time.sleep, (30,)
        pid = w.nodes[1]["agent_pid"]

        def kill():
            time.sleep(0.5)
            killed.append(time.time())
            os.kill(pid, signal.SIGKILL)
        killer = threading.Thread(target=kill)
        killer.start()
    t_call = time.time()
    try:
        w.run(fn, args, timeout=timeout)
    except (mplaunch.WorkerError, mplaunch.MainProcessError, RuntimeError) as exc:
        raised = time.time()
        what = _short(exc)
    else:
        raise RuntimeError(f"{key}: the call did not fail")
    finally:
        if key == "agent killed":
            killer.join()
    t_fail = (_stamped(directory) if key in _STAMPED else killed[0] if killed
              else t_call + timeout)
    t_next = _next_run(w, failures)
    return {"to_raise": raised - t_fail, "to_next": t_next - t_fail,
            "failing": raised - t_call, "both": t_next - t_call, "what": what}


def world_heals(make, n, keys):
    out = {}
    with make(grace_period=GRACE) as w:
        assert w.run(allreduce) == [float(NPROCS)] * NPROCS
        for key in keys:
            rs, failures, error = [], [], None
            for _ in range(n):
                try:
                    with tempfile.TemporaryDirectory(
                            dir=os.environ.get("MPLAUNCH_BENCH_TMP")) as d:
                        rs.append(heal_once(w, key, d, failures))
                except Exception as exc:  # noqa: BLE001 - reported
                    error = f"BENCH CASE FAILED: {type(exc).__name__}: {exc}"
                    log(f"    {key}: {error}")
                    break
                log(f"    {key}: raise {rs[-1]['to_raise'] * 1e3:.0f} ms, next run "
                    f"{rs[-1]['to_next'] * 1e3:.0f} ms ({rs[-1]['what'][:120]})")
            out[key] = {"samples": rs, "next_run_failures": failures, "error": error,
                        "what": sorted({_no_pids(r["what"]) for r in rs})}
    return out


def _guarded(what, fn, *args):
    try:
        return fn(*args)
    except Exception as exc:  # noqa: BLE001 - reported, not hidden
        log(f"  {what}: FAILED {type(exc).__name__}: {exc}")
        return {"error": f"{type(exc).__name__}: {str(exc)[:1500]}"}


def take_turns(contenders, rounds):
    """Each contender once a round, in turns (the order reversed every other round), so
    that background load hits each alike; one that fails is not tried again."""
    out = {name: {"rounds": []} for name in contenders}
    names = list(contenders)
    for i in range(rounds):
        for name in (names if i % 2 == 0 else names[::-1]):
            if "error" in out[name]:
                continue
            r = _guarded(name, contenders[name])
            if "error" in r:
                out[name]["error"] = r["error"]
                continue
            out[name]["rounds"].append(r)
            log(f"  {name}: first {r['first']:.2f} s, returned {r['exit']:.2f} s"
                + (f", second {_ms(r['second'])}" if "second" in r else ""))
    return out


def measure(setup, args, scale):
    """Every figure of a World on `setup`'s scheduler, its baselines beside it, and (with
    `scale`) a one-node World's; in this process, the cluster up."""
    import torch  # noqa: F401 - what the user's driver has imported; not timed
    workdir = tempfile.mkdtemp(prefix="bench-nodes-", dir=os.environ.get("MPLAUNCH_BENCH_TMP"))
    os.environ.setdefault("MPLAUNCH_BENCH_TMP", workdir)
    fig = {"scheduler": setup.name, "label": setup.label, "where": setup.where,
           "versions": setup.versions()}
    log(f"[{setup.name}] 1, 2. from nothing to the first all_reduce, and the second call, "
        f"{args.rounds} rounds in turns:")
    contenders = {setup.label: lambda: world_round(setup.world)}
    contenders.update(setup.starts(args, workdir))
    if scale:
        contenders[ONE_NODE] = lambda: world_round(_one_node)
    fig["start"] = take_turns(contenders, args.rounds)
    worlds = {setup.label: setup.world}
    if scale:
        worlds[ONE_NODE] = _one_node

    def guarded(name, fn, *fargs):    # a World that never started is not tried again
        if not fig["start"][name]["rounds"]:
            return {"error": f"not measured: it did not start ({fig['start'][name]['error']})"}
        return _guarded(name, fn, *fargs)
    log(f"[{setup.name}] 3. a trivial run on 4 warm ranks:")
    fig["calls"] = {name: guarded(name, world_calls, make, args.calls)
                    for name, make in worlds.items()}
    fig["calls"].update(setup.calls(args))
    for name, r in fig["calls"].items():
        if isinstance(r, list):
            log(f"  {name}: median {_med(r) * 1e3:.2f} ms")
    log(f"[{setup.name}] 4. heals (grace_period={GRACE:g}):")
    fig["heals"] = {}
    for name, make in worlds.items():
        log(f"  {name}:")
        fig["heals"][name] = guarded(name, world_heals, make, args.heal_repeats,
                                     [k for k in HEALS if name != ONE_NODE or k != "agent killed"])
    fig["heal_baselines"] = setup.heals(args)
    return fig


# -- the report ------------------------------------------------------------------------------

def _start_rows(sessions):
    """(name, figures) of every start row: each scheduler's World, then their baselines,
    then the one-node World."""
    rows = [(s["label"], s["start"][s["label"]]) for s in sessions if "start" in s]
    rows += [(n, r) for s in sessions for n, r in s.get("start", {}).items()
             if n != s["label"] and n != ONE_NODE]
    rows += [(n, r) for s in sessions for n, r in s.get("start", {}).items() if n == ONE_NODE]
    return rows


def _firsts(name, r, key="first"):
    """The samples of `key`; a one-node World's first round started this process's warm
    server (cold): left out of the median where there are others."""
    xs = [x[key] for x in r["rounds"] if key in x]
    return xs[1:] if name == ONE_NODE and len(xs) > 1 else xs


def print_report(report):
    sessions = [s for s in report["sessions"] if "error" not in s]
    versions = "".join(f" / {k} {v}" for s in sessions for k, v in s["versions"].items())
    print(f"\nmplaunch {report['mplaunch']} / torch {report['torch']}{versions} / "
          f"{report['machine']} / load average {report['loadavg_before'][0]:.1f} before, "
          f"{report['loadavg_after'][0]:.1f} after")
    for s in report["sessions"]:
        up = s.get("cluster", {}).get("start_s")
        print(f"  {s['scheduler']}: {s.get('where', '')}"
              + (f" (cluster up in {up:.1f} s, not counted)" if up else "")
              + (f"  NOT MEASURED: {s['error']}" if "error" in s else ""))
    if not sessions:
        return
    base = sessions[0]
    b = base["start"][base["label"]]
    b_first, b_second = _med(_firsts("", b)), _med(_firsts("", b, "second"))
    rows = _start_rows(sessions)
    print(f"\n1. from nothing (cluster up) to the first all_reduce of {NPROCS} ranks, 2 per "
          "node (median, range in brackets; returned: close() / the launcher):")
    for name, r in rows:
        xs = _firsts(name, r)
        ex = _firsts(name, r, "exit")
        line = (f"  {name[:58]:58s} first {_med(xs):6.2f} s ({_span(xs)})  returned "
                f"{_med(ex):6.2f} s  n={len(xs)}  {_x(_med(xs) / b_first)}")
        if name == ONE_NODE and len(r["rounds"]) > 1:
            line += f"  (cold, the first in the process: {r['rounds'][0]['first']:.2f} s)"
        elif name == ONE_NODE:
            line += "  (cold: the first in the process, which starts its warm server)"
        if r.get("note"):
            line += f"  ({r['note']})"
        print(line + (f"  ERROR {r['error'][:600]}" if "error" in r else ""))
    print("\n2. the second call, the same all_reduce (median):")
    for name, r in rows:
        xs = _firsts(name, r, "second")
        if not xs:
            continue
        sf = [x["second_first"] for x in r["rounds"] if "second_first" in x]
        print(f"  {name[:58]:58s} {_ms(_med(xs)):>10s}  n={len(xs)}  "
              f"{_x(_med(xs) / b_second)}" + (f"  (its all_reduce done after "
                                               f"{_med(sf):.2f} s)" if sf else ""))
    calls = [(n, r) for s in sessions for n, r in s["calls"].items()]
    calls.sort(key=lambda nr: (nr[0] == ONE_NODE, nr[0] not in [s["label"] for s in sessions]))
    b_call = base["calls"].get(base["label"])
    b_call = _med(b_call) if isinstance(b_call, list) else float("nan")
    print(f"\n3. a trivial call on {NPROCS} warm ranks (median, p90 in brackets; after 20):")
    for name, r in calls:
        if isinstance(r, dict):
            print(f"  {name[:58]:58s} ERROR {r['error'][:600]}")
            continue
        print(f"  {name[:58]:58s} {_med(r) * 1e3:7.2f} ms ({_p90(r) * 1e3:.2f})  n={len(r)}  "
              f"{_x(_med(r) / b_call)}")
    hb = {n: r for s in sessions for n, r in s.get("heal_baselines", {}).items()}
    print(f"\n4. heals, rank 3 (second node) failing, grace_period={GRACE:g} (median): from "
          "the failure to run raising / to the next all_reduce returning; the failing call "
          "+ the next, the failing call alone in brackets:")
    worlds = [(s["label"], s["heals"][s["label"]]) for s in sessions]
    worlds += [(n, r) for s in sessions for n, r in s["heals"].items() if n == ONE_NODE]
    for key, title in HEALS.items():
        print(f"  {title}")
        for name, h in worlds:
            if "error" in h and isinstance(h.get("error"), str) and key not in h:
                print(f"    {name[:44]:44s} ERROR {h['error'][:300]}")
                continue
            x = h.get(key)
            if x is None:
                continue
            rs = x["samples"]
            both = _med([r["both"] for r in rs])
            against = "".join(f"; {bn.split(':')[0]}: {_x(_med([r['both'] for r in br]) / both)}"
                              for bn, br in hb.items() if br and name == base["label"])
            print(f"    {name[:44]:44s} {_ms(_med([r['to_raise'] for r in rs])):>9s} / "
                  f"{_ms(_med([r['to_next'] for r in rs])):>9s};  {_ms(both):>9s} "
                  f"({_ms(_med([r['failing'] for r in rs]))})  n={len(rs)}{against}")
            for w in x["what"]:
                print(f"        {w[:300]}")
            for f in x["next_run_failures"]:
                print(f"        THE NEXT RUN FAILED: {f}")
            if x["error"]:
                print(f"        {x['error'][:600]}")
    for name, rs in hb.items():
        if isinstance(rs, dict):
            print(f"  {name}\n    ERROR {rs['error'][:600]}")
            continue
        print(f"  {name}\n    {_ms(_med([r['both'] for r in rs])):>10s} "
              f"({_ms(_med([r['failing'] for r in rs]))})  n={len(rs)}; "
              f"{rs[-1]['what'] if rs else ''}")
    nodes = [f"{n}: {r['rounds'][0]['nodes']}" for n, r in rows
             if r["rounds"] and r["rounds"][0].get("nodes")]
    print("\nranks per node: " + "; ".join(nodes + [s["ranks_per_node"] for s in sessions
                                                    if s.get("ranks_per_node")]))
    print(f"left after the end: {report['left'] or 'no process'}")


# -- the processes of this run -------------------------------------------------------------

def become_subreaper():
    """Orphans among this run's descendants (a raylet's daemons, slurmstepd) come back to
    this process instead of init, so that the end can see and wait for every one."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(36, 1, 0, 0, 0) == 0      # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        return False


def _reap():
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def leftovers(timeout):
    """Processes below this one still alive after `timeout` seconds, zombies reaped."""
    import psutil
    end = time.monotonic() + timeout
    while True:
        _reap()
        left = []
        for p in psutil.Process().children(recursive=True):
            try:
                if p.status() != psutil.STATUS_ZOMBIE:
                    left.append((p.pid, " ".join(p.cmdline())[:120] or p.name()))
            except psutil.Error:
                continue
        if not left or time.monotonic() > end:
            return left
        time.sleep(0.2)


def end_leftovers(left):
    """What is still there is ours (below this process): ended by its pid."""
    for pid, _ in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    time.sleep(0.5)
    _reap()


# -- the command line ------------------------------------------------------------------------

def inner_argv(args, name, out, scale):
    """The command line of `--inner NAME` (a session measured in another process)."""
    argv = ["--inner", name, "--out", out, "--rounds", str(args.rounds), "--calls",
            str(args.calls), "--heal-repeats", str(args.heal_repeats)]
    return argv + (["--scale"] if scale else [])


def main(argv, doc, schedulers, full, quick, own=None):
    """`schedulers`: the default --scheduler; `full`, `quick`: the defaults of rounds,
    calls and heal_repeats; `own`: Setups of the calling script (name -> class)."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n".join(doc.splitlines()[1:]))
    ap.add_argument("--scheduler", default=schedulers,
                    help=f"whose World, comma-separated, the first the ratios' base "
                         f"({', '.join(SETUPS)}; default: {schedulers})")
    ap.add_argument("--quick", action="store_true", help="fewer samples")
    ap.add_argument("--json", help="also write every figure to this file")
    ap.add_argument("--rounds", type=int, help=f"start rounds (default {full[0]}, quick "
                                               f"{quick[0]})")
    ap.add_argument("--calls", type=int, help=f"trivial calls timed (default {full[1]}, "
                                              f"quick {quick[1]})")
    ap.add_argument("--heal-repeats", type=int, help=f"samples of each heal (default "
                                                     f"{full[2]}, quick {quick[2]})")
    classes = {}
    for name in SETUPS:
        try:
            classes[name] = setup_class(name, own)
        except ImportError as exc:
            log(f"scheduler {name}: its bench does not import: {exc}")
            continue
        classes[name].add_arguments(ap)
    ap.add_argument("--inner", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--scale", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    for i, name in enumerate(("rounds", "calls", "heal_repeats")):
        if getattr(args, name) is None:
            setattr(args, name, (quick if args.quick else full)[i])
    if args.inner:                     # one session, measured here (SLURM's allocation)
        fig = measure(classes[args.inner](), args, args.scale)
        with open(args.out, "w") as f:
            json.dump(fig, f)
        return 0
    names = [n for n in args.scheduler.split(",") if n]
    unknown = [n for n in names if n not in classes]
    if unknown or not names:
        ap.error(f"--scheduler: {unknown or names} (known: {', '.join(classes)})")

    t_all = time.perf_counter()
    subreaper = become_subreaper()
    # every process of the run (agents, ranks, raylets, srun's tasks) imports this bench's
    # modules: the ranks' functions live in this file
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (HERE, ROOT, os.environ.get("PYTHONPATH")) if p)
    import torch
    import mplaunch
    from mplaunch._engine import servers
    report = {"machine": f"{platform.machine()}, {os.cpu_count()} cpus, "
                         f"python {platform.python_version()}",
              "torch": torch.__version__, "mplaunch": mplaunch.__version__,
              "loadavg_before": os.getloadavg(), "subreaper": subreaper, "sessions": []}
    with tempfile.TemporaryDirectory(prefix="bench-nodes-") as tmp:
        os.environ["MPLAUNCH_BENCH_TMP"] = tmp
        try:
            for i, name in enumerate(names):
                setup = classes[name]()
                why = setup.unavailable()
                if why:
                    log(f"{name}: not measured: {why}")
                    report["sessions"].append({"scheduler": name, "error": why})
                    continue
                log(f"{name}: {setup.where}")
                scale = not any("error" not in s for s in report["sessions"])
                try:
                    fig = setup.session(args, scale)
                except Exception as exc:  # noqa: BLE001 - reported, the others go on
                    log(f"{name}: FAILED {type(exc).__name__}: {exc}")
                    fig = {"scheduler": name, "where": setup.where,
                           "error": f"{type(exc).__name__}: {str(exc)[:3000]}"}
                report["sessions"].append(fig)
        finally:
            servers.shutdown_servers()
            left = leftovers(30)
            if left:
                log(f"left after the end, ended by pid now: {left}")
                end_leftovers(left)
            report["left"] = left
    report["loadavg_after"] = os.getloadavg()
    report["bench_wall_s"] = time.perf_counter() - t_all
    print_report(report)
    print(f"\n(whole bench: {report['bench_wall_s']:.0f} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    # a failure: no World's figure at all (each row says why)
    return 0 if any(s.get("start", {}).get(s.get("label"), {}).get("rounds")
                    for s in report["sessions"]) else 1
