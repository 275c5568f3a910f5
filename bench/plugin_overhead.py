"""Per-test overhead of the mplaunch pytest plugin.

Runs one real pytest session (a subprocess) over a generated module with three groups of
tiny tests, in this order:

  plain        ``def test(): pass``                                      (the baseline)
  launch       ``@pytest.mark.mplaunch(nprocs=N, backend=None)``  an empty body in N ranks
  gloo         ``@pytest.mark.mplaunch(nprocs=N)``  init_process_group("gloo") + destroy

A conftest hook times each test's whole protocol (setup, call, teardown, reporting).
The first distributed test of the session waits for the warm server (torch being
imported) and is reported apart as "first"; the others are the steady state. Overhead
per test = median of a group minus the median of the plain group.

For reference, the same empty function is then launched directly with
``mplaunch.launch(nprocs=N)`` in this process (warm server, same preloads): the
difference between that and the "launch" group is what the plugin itself adds.

    python bench/plugin_overhead.py [--tests 30] [--nprocs 2] [--json out.json]
                                    [--no-pytest-preload]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time

CONFTEST = textwrap.dedent("""
    import json, os, time
    import pytest

    _times = {}

    if os.environ.get("PLUGIN_BENCH_NO_PRELOAD"):
        # what the ranks cost without pytest imported in the warm server
        import mplaunch.pytest_plugin
        mplaunch.pytest_plugin._PRELOAD = ()

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(item, nextitem):
        t0 = time.perf_counter()
        yield
        _times[item.name] = time.perf_counter() - t0

    def pytest_sessionfinish(session):
        with open(os.environ["PLUGIN_BENCH_OUT"], "w") as f:
            json.dump(_times, f)
""")

TESTS = textwrap.dedent("""
    import pytest

    @pytest.mark.parametrize("i", range({n}))
    def test_plain(i):
        pass

    @pytest.mark.parametrize("i", range({n} + 1))
    @pytest.mark.mplaunch(nprocs={nprocs}, backend=None)
    def test_launch(i):
        pass

    @pytest.mark.parametrize("i", range({n}))
    @pytest.mark.mplaunch(nprocs={nprocs})
    def test_gloo(i):
        pass
""")


def run_session(n: int, nprocs: int, preload_pytest: bool = True) -> tuple:
    with tempfile.TemporaryDirectory(prefix="mplaunch-plugin-bench-") as d:
        with open(os.path.join(d, "conftest.py"), "w") as f:
            f.write(CONFTEST)
        with open(os.path.join(d, "test_overhead.py"), "w") as f:
            f.write(TESTS.format(n=n, nprocs=nprocs))
        out = os.path.join(d, "times.json")
        env = dict(os.environ, PLUGIN_BENCH_OUT=out)
        if not preload_pytest:
            env["PLUGIN_BENCH_NO_PRELOAD"] = "1"
        t0 = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o",
             "addopts=", "test_overhead.py"],
            cwd=d, env=env, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        if proc.returncode != 0:
            sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
            raise SystemExit(f"the benchmark session failed (exit code {proc.returncode})")
        with open(out) as f:
            times = json.load(f)
    return times, wall


def summarize(times: dict) -> dict:
    groups: dict = {"plain": [], "launch": [], "gloo": []}
    first = None
    for name, seconds in times.items():
        kind = name.split("[")[0][len("test_"):]
        if name == "test_launch[0]":
            first = seconds  # waits for the warm server
            continue
        groups[kind].append(seconds)
    out = {"first_distributed_test_s": first}
    base = statistics.median(groups["plain"])
    for kind, samples in groups.items():
        med = statistics.median(samples)
        out[kind] = {"median_s": med, "mean_s": statistics.fmean(samples),
                     "min_s": min(samples), "max_s": max(samples), "n": len(samples),
                     "overhead_vs_plain_s": med - base}
    return out


def _noop():
    pass


def direct_launch(n: int, nprocs: int) -> float:
    """Median seconds of a warm mplaunch.launch of an empty function."""
    import mplaunch
    from mplaunch import pytest_plugin
    from mplaunch._engine import servers as _procs
    preload = pytest_plugin._preload_for(None)
    try:
        mplaunch.launch(_noop, nprocs=nprocs, preload=preload)  # warm the server
        samples = []
        for _ in range(n):
            t0 = time.perf_counter()
            mplaunch.launch(_noop, nprocs=nprocs, preload=preload)
            samples.append(time.perf_counter() - t0)
    finally:
        _procs.shutdown_servers()
    return statistics.median(samples)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tests", type=int, default=30, help="tests per group")
    ap.add_argument("--nprocs", type=int, default=2)
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--no-pytest-preload", action="store_true",
                    help="measure without pytest imported in the warm server")
    args = ap.parse_args(argv)
    times, wall = run_session(args.tests, args.nprocs, not args.no_pytest_preload)
    res = summarize(times)
    res.update(session_wall_s=wall, tests=args.tests, nprocs=args.nprocs,
               direct_launch_median_s=direct_launch(args.tests, args.nprocs),
               load_average=os.getloadavg())
    print(f"{args.tests} tests per group, nprocs={args.nprocs}, session wall "
          f"{wall:.1f} s (pytest start + torch import in the warm server included)")
    print(f"first distributed test (waits for the warm server): "
          f"{res['first_distributed_test_s'] * 1e3:.0f} ms")
    print(f"{'group':<8} {'median':>9} {'mean':>9} {'min':>9} {'max':>9} {'overhead':>10}")
    for kind in ("plain", "launch", "gloo"):
        g = res[kind]
        print(f"{kind:<8} {g['median_s'] * 1e3:>7.1f}ms {g['mean_s'] * 1e3:>7.1f}ms "
              f"{g['min_s'] * 1e3:>7.1f}ms {g['max_s'] * 1e3:>7.1f}ms "
              f"{g['overhead_vs_plain_s'] * 1e3:>8.1f}ms")
    direct = res["direct_launch_median_s"]
    added = res["launch"]["overhead_vs_plain_s"] - direct
    print(f"mplaunch.launch of an empty function, directly: {direct * 1e3:.1f}ms median; "
          f"the plugin adds {added * 1e3:.1f}ms to it. Load average "
          f"{res['load_average'][0]:.1f} on {os.cpu_count()} CPUs.")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
