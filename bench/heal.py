"""What healing costs and saves (issue 19), side by side in one run.

    python bench/heal.py              # under a minute on 2 cores
    python bench/heal.py --quick      # fewer repeats
    python bench/heal.py --json out.json

1. Release: rank 1 raises while rank 0 waits in ``all_reduce`` for it (2 ranks, gloo).
   Time from rank 1's exception to ``world.run`` raising, with healing (the peer is
   interrupted and released, the group rebuilt, the ranks kept) and without (the ranks
   are torn down), plus, without, what the next run pays to get a world back (fresh
   ranks and their group). ``torch.multiprocessing.spawn`` of the same function, for
   scale: it ends every process.
2. Replace: rank 1 of 4 calls ``os._exit`` while the others wait in ``all_reduce``. Time
   from its exit to ``world.run`` raising with a fresh rank 1 in a rebuilt group, against
   tearing down and starting 4 fresh ranks.
3. 100 reused pytest tests of which 10 fail (2 ranks, gloo), in a pytest session each,
   with healing (``mplaunch_reuse_heal = true``) and without (every failure costs a new
   world).
4. The DDP recovery sequence (destroy, init, re-wrap) 10 times in a row: the backward
   pass's time after each re-wrap (hooks of old wrappers must not pile up).

Nothing here asserts a timing; the figures go to docs/performance.rst.
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

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import torch  # noqa: E402,F401  (as a user's script would)
import mplaunch  # noqa: E402
from bench_heal_ranks import (die_while_peers_wait, raise_while_peer_waits,  # noqa: E402
                              rewrap_and_time, spawn_raise_while_peer_waits, stamp_file)


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def _med(xs):
    return statistics.median(xs) if xs else float("nan")


def release(n):
    healed, torn, refill, spawn = [], [], [], []
    with mplaunch.World(2, backend="gloo") as world:
        world.run(lambda: None)
        for _ in range(n):
            try:
                world.run(raise_while_peer_waits, timeout=300)
            except mplaunch.WorkerError as err:
                healed.append(time.time() - err.failures[0].timestamp)
    with mplaunch.World(2, backend="gloo", heal=False) as world:
        for _ in range(n):
            world.run(lambda: None)
            try:
                world.run(raise_while_peer_waits, timeout=300)
            except mplaunch.WorkerError as err:
                torn.append(time.time() - err.failures[0].timestamp)
            t0 = time.perf_counter()
            world.run(lambda: None)       # fresh ranks and their group
            refill.append(time.perf_counter() - t0)
    import torch.multiprocessing as mp
    for _ in range(max(2, n // 3)):
        with tempfile.TemporaryDirectory() as d:
            try:
                mp.spawn(spawn_raise_while_peer_waits, (d,), nprocs=2, join=True)
            except Exception:  # noqa: BLE001 - ProcessRaisedException
                spawn.append(time.time() - stamp_file(d))
    return {"healed_s": _med(healed), "torn_down_s": _med(torn),
            "torn_down_then_next_run_s": _med(torn) + _med(refill),
            "mp_spawn_s": _med(spawn), "n": n}


def replace(n):
    out = {}
    for heal in (True, False):
        times = []
        with mplaunch.World(4, backend="gloo", heal=heal) as world:
            for _ in range(n):
                world.run(lambda: None)
                with tempfile.TemporaryDirectory() as d:
                    try:
                        world.run(die_while_peers_wait, (d,), timeout=300)
                    except mplaunch.WorkerError:
                        pass
                    if heal:
                        done = time.time()
                    else:
                        world.run(lambda: None)   # a world back: fresh ranks and group
                        done = time.time()
                    times.append(done - stamp_file(d))
        out["healed_s" if heal else "torn_down_and_restarted_s"] = _med(times)
    out["n"] = n
    return out


_TESTS = """
import pytest, torch, torch.distributed as dist

@pytest.mark.parametrize("i", range(100))
def test_one(i):
    t = torch.ones(1)
    dist.all_reduce(t)
    if i % 10 == 9:
        assert dist.get_rank() == 0   # fails in rank 1
"""


def suite():
    out = {}
    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, "test_many.py"), "w") as f:
            f.write(_TESTS)
        for heal in ("true", "false"):
            with open(os.path.join(d, "pytest.ini"), "w") as f:
                f.write(textwrap.dedent(f"""\
                    [pytest]
                    addopts = -p no:cacheprovider
                    mplaunch_reuse = true
                    mplaunch_reuse_heal = {heal}
                    """))
            with open(os.path.join(d, "conftest.py"), "w") as f:
                f.write("import pytest\n"
                        "def pytest_collection_modifyitems(items):\n"
                        "    for item in items:\n"
                        "        item.add_marker(pytest.mark.mplaunch(nprocs=2))\n")
            t0 = time.perf_counter()
            proc = subprocess.run([sys.executable, "-m", "pytest", "-q", d], cwd=d,
                                  capture_output=True, text=True)
            wall = time.perf_counter() - t0
            last = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
            out[f"heal_{heal}_s"] = wall
            out[f"heal_{heal}_outcome"] = last
    return out


def rewraps(n=10):
    with mplaunch.World(2, backend="gloo") as world:
        per = world.run(rewrap_and_time, (n,))
    first, last = per[0][0], per[0][-1]
    return {"backward_after_1st_wrap_ms": first * 1e3,
            "backward_after_10th_wrap_ms": last * 1e3, "all_ms": [x * 1e3 for x in per[0]]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    p.add_argument("--json")
    a = p.parse_args(argv)
    n = 3 if a.quick else 10
    res = {}
    log("1. release a collective left half-done ...")
    res["release"] = release(n)
    log("2. replace a dead rank of 4 ...")
    res["replace"] = replace(max(2, n // 2))
    log("3. 100 reused tests, 10 failing ...")
    res["suite"] = suite()
    log("4. backward after re-wraps ...")
    res["rewrap"] = rewraps()
    r = res["release"]
    print(f"1. exception -> run raises, peer stuck in all_reduce (2 ranks, median of "
          f"{r['n']}):\n   heal: {r['healed_s'] * 1e3:.0f} ms   no heal: "
          f"{r['torn_down_s'] * 1e3:.0f} ms (+ next run on fresh ranks: "
          f"{r['torn_down_then_next_run_s'] * 1e3:.0f} ms)   mp.spawn: "
          f"{r['mp_spawn_s'] * 1e3:.0f} ms")
    r = res["replace"]
    print(f"2. rank 1 of 4 exits -> a working world again (median of {r['n']}):\n"
          f"   heal (replace + rebuild): {r['healed_s'] * 1e3:.0f} ms   no heal "
          f"(teardown + 4 fresh ranks): {r['torn_down_and_restarted_s'] * 1e3:.0f} ms")
    r = res["suite"]
    print(f"3. 100 reused tests, 10 failing: heal {r['heal_true_s']:.1f} s "
          f"({r['heal_true_outcome']})   no heal {r['heal_false_s']:.1f} s "
          f"({r['heal_false_outcome']})")
    r = res["rewrap"]
    print(f"4. backward after re-wrap 1: {r['backward_after_1st_wrap_ms']:.2f} ms, after "
          f"re-wrap 10: {r['backward_after_10th_wrap_ms']:.2f} ms; all: "
          + ", ".join(f"{x:.2f}" for x in r["all_ms"]))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
