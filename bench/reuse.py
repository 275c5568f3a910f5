"""Small distributed tests with and without reuse, and on torch's own test bases.

The same small tests (2 ranks, gloo: an all_reduce, a broadcast and a barrier, each with
asserts, in turn) run in four pytest sessions, one after the other in this one run:

  reuse        ``@pytest.mark.mplaunch(nprocs=2, reuse=True)``: one World for all
  no_reuse     ``@pytest.mark.mplaunch(nprocs=2)``: fresh ranks and a fresh process group
               for every test
  mptc         torch's ``MultiProcessTestCase`` (spawned ranks per test, the test calls
               init_process_group on a FileStore), the pattern of torch's own suites
  continuous   torch's ``MultiProcContinuousTest`` (ranks spawned once per class, the
               group made once, tests sent over queues), backend_str "gloo"

A conftest hook times each test's whole protocol (setup, call, teardown, reporting).
Seconds per test = the sum over the tests of a session / their number: the first test
of a session pays for what is started once (the warm server importing torch, the World,
the continuous workers), so the startup is spread over the tests, as it is in a suite.
``mptc`` costs seconds per test, so it runs fewer tests (``--mptc-tests``) and its
figure per test stands for all of them. The session's wall time (pytest's own start,
collection and exit included) is reported beside.

    pip install expecttest   # torch.testing._internal needs it, torch does not ship it
    python bench/reuse.py [--tests 100] [--mptc-tests 10] [--json out.json]
                          [--modes reuse,no_reuse,mptc,continuous]

Nothing here is a test: the figures go into docs/performance.rst.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from plugin_overhead import CONFTEST  # noqa: E402  (the per-test timing hook)

# Three checks, used in turn; the same code in every mode.
CHECKS = textwrap.dedent("""
    import torch
    import torch.distributed as dist

    def check_all_reduce(i):
        t = torch.full((4,), float(dist.get_rank() + i))
        dist.all_reduce(t)
        assert t.tolist() == [float(2 * i + 1)] * 4

    def check_broadcast(i):
        t = torch.full((4,), float(i) if dist.get_rank() == 0 else -1.0)
        dist.broadcast(t, src=0)
        assert t.tolist() == [float(i)] * 4

    def check_barrier(i):
        dist.barrier()
        assert dist.get_world_size() == 2 and dist.get_rank() in (0, 1)

    CHECKS = [check_all_reduce, check_broadcast, check_barrier]
""")

MPLAUNCH = CHECKS + textwrap.dedent("""
    import pytest

    @pytest.mark.parametrize("i", range({n}))
    @pytest.mark.mplaunch(nprocs=2, reuse={reuse})
    def test_small(i):
        CHECKS[i % 3](i)
""")

MPTC = CHECKS + textwrap.dedent("""
    from torch.testing._internal.common_distributed import MultiProcessTestCase

    class TestSmall(MultiProcessTestCase):
        @property
        def world_size(self):
            return 2

        def setUp(self):
            super().setUp()
            self._spawn_processes()

    def _make(i):
        def test(self):
            store = dist.FileStore(self.file_name, self.world_size)
            dist.init_process_group("gloo", store=store, rank=self.rank,
                                    world_size=self.world_size)
            CHECKS[i % 3](i)   # the base class destroys the group afterwards
        return test

    for _i in range({n}):
        setattr(TestSmall, f"test_small_{{_i:03d}}", _make(_i))
""")

CONTINUOUS = CHECKS + textwrap.dedent("""
    from torch.testing._internal.common_distributed import MultiProcContinuousTest

    class TestSmall(MultiProcContinuousTest):
        world_size = 2

        @classmethod
        def backend_str(cls):
            return "gloo"

        @classmethod
        def device_type(cls):
            return "cpu"

    def _make(i):
        def test(self):
            CHECKS[i % 3](i)
        return test

    for _i in range({n}):
        setattr(TestSmall, f"test_small_{{_i:03d}}", _make(_i))
""")

MODES = {
    "reuse": ("mplaunch plugin, reuse=True", lambda n: MPLAUNCH.format(n=n, reuse=True)),
    "no_reuse": ("mplaunch plugin, no reuse", lambda n: MPLAUNCH.format(n=n, reuse=False)),
    "mptc": ("torch MultiProcessTestCase", lambda n: MPTC.format(n=n)),
    "continuous": ("torch MultiProcContinuousTest", lambda n: CONTINUOUS.format(n=n)),
}


def run_session(mode: str, n: int) -> dict:
    """One pytest session of `n` tests of this mode; per-test seconds and the wall."""
    with tempfile.TemporaryDirectory(prefix=f"mplaunch-reuse-bench-{mode}-") as d:
        with open(os.path.join(d, "conftest.py"), "w") as f:
            f.write(CONFTEST)
        with open(os.path.join(d, f"test_{mode}.py"), "w") as f:
            f.write(MODES[mode][1](n))
        out = os.path.join(d, "times.json")
        env = dict(os.environ, PLUGIN_BENCH_OUT=out)
        t0 = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o",
             "addopts=", f"test_{mode}.py"],
            cwd=d, env=env, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        if proc.returncode != 0:
            sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
            raise SystemExit(f"the {mode} session failed (exit code {proc.returncode})")
        with open(out) as f:
            times = list(json.load(f).values())
    if len(times) != n:
        raise SystemExit(f"the {mode} session ran {len(times)} tests, not {n}")
    rest = times[1:] or times
    return {"tests": n, "per_test_s": sum(times) / n, "first_s": times[0],
            "mean_after_first_s": statistics.fmean(rest),
            "median_after_first_s": statistics.median(rest), "session_wall_s": wall}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tests", type=int, default=100)
    ap.add_argument("--mptc-tests", type=int, default=10,
                    help="tests run on MultiProcessTestCase (seconds each)")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args(argv)
    import torch
    res = {"machine": f"{platform.machine()}, {os.cpu_count()} cpus, python "
                      f"{platform.python_version()}", "torch": torch.__version__,
           "load_average_before": os.getloadavg(), "modes": {}}
    for mode in [m for m in args.modes.split(",") if m]:
        n = args.mptc_tests if mode == "mptc" else args.tests
        torch_base = mode in ("mptc", "continuous")
        if torch_base and importlib.util.find_spec("expecttest") is None:
            # torch.testing._internal imports it; torch does not depend on it
            print(f"  {mode}: skipped, torch's test bases need expecttest "
                  "(pip install expecttest)", file=sys.stderr)
            continue
        print(f"  {mode}: {n} tests ...", file=sys.stderr, flush=True)
        res["modes"][mode] = run_session(mode, n)
    res["load_average_after"] = os.getloadavg()

    modes = res["modes"]
    print(f"\ntorch {res['torch']} / {res['machine']} / load average "
          f"{res['load_average_before'][0]:.1f} before, "
          f"{res['load_average_after'][0]:.1f} after")
    print(f"{'':32} {'tests':>5} {'per test':>10} {'first':>8} {'mean*':>9} "
          f"{'median*':>9} {'session':>9}")
    for mode, r in modes.items():
        print(f"{MODES[mode][0]:32} {r['tests']:>5} {r['per_test_s'] * 1e3:>8.1f}ms "
              f"{r['first_s']:>7.2f}s {r['mean_after_first_s'] * 1e3:>7.1f}ms "
              f"{r['median_after_first_s'] * 1e3:>7.1f}ms {r['session_wall_s']:>8.1f}s")
    print("(per test: all tests' time / their number, the first included; "
          "mean*, median*: of the tests after the first)")
    if "reuse" in modes:
        for mode in ("no_reuse", "mptc", "continuous"):
            if mode not in modes:
                continue
            ratios = {k: modes[mode][k] / modes["reuse"][k]
                      for k in ("per_test_s", "mean_after_first_s")}
            res.setdefault("ratios_vs_reuse", {})[mode] = ratios
            print(f"reuse is {ratios['per_test_s']:.1f}x faster per test than "
                  f"{MODES[mode][0]} ({ratios['mean_after_first_s']:.1f}x after the "
                  "first test)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
