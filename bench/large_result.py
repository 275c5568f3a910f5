"""What a large return value costs the launching process: peak memory and time.

    python bench/large_result.py [--mib 1024] [--kinds bytes,numpy,tensor]

One rank returns a result of --mib MiB (bytes, a numpy array or a tensor), once through
mplaunch.launch and once through torch.multiprocessing.spawn sending it back on a
queue (what one writes without mplaunch). Each measure runs in a fresh interpreter:
the peak resident memory of the launching process is read from /proc (VmHWM, reset
just before the launch through /proc/self/clear_refs), so it counts the launch alone.
The rank building the value is included in both timings alike; the time is from the
call to its return, the peak is read after every page of the result was read once.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

MIB = 1 << 20


def make(kind, nbytes):
    if kind == "bytes":
        return b"\x07" * nbytes
    if kind == "numpy":
        import numpy as np
        return np.full(nbytes // 8, 3.0)
    import torch
    return torch.full((nbytes // 4,), 3.0)


def _tmp_rank(index, queue, ack, kind, nbytes):
    queue.put(make(kind, nbytes))
    ack.get()   # a tensor's shared memory is only received while its sender lives


def touch(value):
    """Read every page of the result, as using it would (a mapped result costs memory
    only once its pages are read)."""
    if isinstance(value, bytes):
        return value.count(b"\x07")
    return float(value.sum())


def _status(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def measure(launcher, kind, nbytes):
    """In a fresh interpreter: (seconds, peak RSS during the launch, RSS before)."""
    import numpy  # noqa: F401 - imported before the baseline, as the rank's result needs
    import torch  # noqa: F401
    import mplaunch
    if launcher == "mplaunch":
        mplaunch.launch(make, ("bytes", 1), nprocs=1)  # a warm server, as in real use
    before = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")   # resets VmHWM to the current RSS
    t0 = time.perf_counter()
    if launcher == "mplaunch":
        [value] = mplaunch.launch(make, (kind, nbytes), nprocs=1)
    else:
        import torch.multiprocessing as tmp
        queue = tmp.get_context("spawn").SimpleQueue()
        ack = tmp.get_context("spawn").SimpleQueue()
        ctx = tmp.spawn(_tmp_rank, args=(queue, ack, kind, nbytes), nprocs=1,
                        join=False)
        value = queue.get()
        ack.put(1)
        ctx.join()
    seconds = time.perf_counter() - t0
    touch(value)
    peak = _status("VmHWM")
    assert len(value) == nbytes // {"bytes": 1, "numpy": 8, "tensor": 4}[kind]
    return {"seconds": seconds, "peak": peak, "before": before}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--kinds", default="bytes,numpy,tensor")
    ap.add_argument("--one", nargs=2, help=argparse.SUPPRESS)
    ns = ap.parse_args()
    nbytes = ns.mib * MIB
    if ns.one:
        print(json.dumps(measure(ns.one[0], ns.one[1], nbytes)))
        return
    print(f"{'result':<22}{'launcher':<32}{'time':>9}{'peak RSS above before':>24}")
    for kind in ns.kinds.split(","):
        rows = {}
        for launcher in ("mplaunch", "torch.multiprocessing.spawn"):
            out = subprocess.run([sys.executable, __file__, "--mib", str(ns.mib),
                                  "--one", launcher, kind],
                                 capture_output=True, text=True, check=True)
            r = json.loads(out.stdout.strip().splitlines()[-1])
            rows[launcher] = r
            extra = (r["peak"] - r["before"]) / nbytes
            print(f"{f'{ns.mib} MiB {kind}':<22}{launcher:<32}{r['seconds']:>8.2f}s"
                  f"{(r['peak'] - r['before']) / MIB:>14.0f} MiB ({extra:.2f}x)")
        a, b = rows["mplaunch"], rows["torch.multiprocessing.spawn"]
        print(f"{'':<22}{'ratio spawn / mplaunch':<32}{b['seconds'] / a['seconds']:>8.1f}x"
              f"{(b['peak'] - b['before']) / max(1, a['peak'] - a['before']):>14.1f}x")


if __name__ == "__main__":
    main()
