"""Run by test_slurm_world inside an allocation (`salloc -N2 python world_orphaned.py`):
a child process makes a World of 4 ranks over the 2 nodes and then ends without
closing it, once by exiting (atexit closes the World) and once by SIGKILL (nothing of
it runs any more). Either way, while the allocation goes on, the World's step and every
process of it must end: the agents end when their connection does. Prints one JSON line
per way."""
import json
import os
import signal
import subprocess
import sys
import time

from allocation import alive, steps


def child(how):
    import mplaunch
    w = mplaunch.World(nprocs=2, nnodes=2, backend="gloo", master_addr="127.0.0.1")
    w.run(os.getpid)
    pids = sorted(set(w.pids.values()) | {n["agent_pid"] for n in w.nodes})
    print(json.dumps({"pids": pids, "steps": steps()}), flush=True)
    if how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    # else: exit with the World open


def main():
    for how in ("exit", "kill"):
        proc = subprocess.run([sys.executable, __file__, how], capture_output=True,
                              text=True, timeout=120)
        up = json.loads(proc.stdout.splitlines()[0])
        t0 = time.monotonic()
        while time.monotonic() - t0 < 30 and (steps() or any(map(alive, up["pids"]))):
            time.sleep(0.1)
        print(json.dumps({"check": how, "returncode": proc.returncode,
                          "steps_up": up["steps"], "steps": steps(),
                          "alive": [p for p in up["pids"] if alive(p)],
                          "seconds": round(time.monotonic() - t0, 1),
                          "stderr": proc.stderr[-2000:]}), flush=True)


if __name__ == "__main__":
    if len(sys.argv) > 1:
        child(sys.argv[1])
    else:
        main()
