"""Run by test_slurm_world inside an allocation (`salloc -N2 python world_frozen_node.py
MODE`): a World of 4 ranks over 2 nodes whose node 1 agent is frozen (SIGSTOP, as a
hung or unreachable node would be: its connection stays open, nothing answers). Then
MODE=run: a run with timeout=3 s; MODE=close: close(). Either must come back on its own
in bounded time. A rescue timer sends SIGCONT after RESCUE seconds so that the script
ends even when it does not; the JSON line says whether the rescue was needed."""
import json
import os
import signal
import sys
import threading
import time

import mplaunch

from allocation import alive, steps

RESCUE = {"run": 15.0, "close": 40.0}


def main(mode):
    w = mplaunch.World(nprocs=2, nnodes=2, backend="gloo", master_addr="127.0.0.1",
                       timeout=60, grace_period=2)
    w.run(os.getpid)
    pids = sorted(set(w.pids.values()) | {n["agent_pid"] for n in w.nodes})
    agent = w.nodes[1]["agent_pid"]
    rescued = []

    def rescue():
        rescued.append(round(time.monotonic() - t0, 1))
        os.kill(agent, signal.SIGCONT)

    os.kill(agent, signal.SIGSTOP)
    timer = threading.Timer(RESCUE[mode], rescue)
    timer.start()
    t0 = time.monotonic()
    error = None
    try:
        if mode == "run":
            w.run(time.sleep, (1,), timeout=3)
        else:
            w.close()
    except Exception as exc:   # noqa: BLE001 - reported to the test
        error = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
    seconds = round(time.monotonic() - t0, 1)
    timer.cancel()
    if not rescued:
        try:
            os.kill(agent, signal.SIGCONT)   # if it is still there: SLURM killed it
        except ProcessLookupError:
            pass
    if mode == "close":
        # what close() left: given a moment, no step and no process of the World
        deadline = time.monotonic() + 10
        while (steps() or any(map(alive, pids))) and time.monotonic() < deadline:
            time.sleep(0.2)
    after = {"steps": steps(), "alive": [p for p in pids if alive(p)]}
    w.close()
    print(json.dumps({"check": mode, "seconds": seconds, "rescued": rescued,
                      "error": error, **after}), flush=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
