"""Run by test_slurm_world inside an allocation (`salloc -N2 python world_restart.py`):
a World of 4 ranks over 2 nodes whose ranks end while its nodes stay (its agents and
their step are kept for the next ranks): World.restart(), and the first run after a
failed one with heal=False; and the run after node 1's warm server (the ranks' parent
there) was killed. Each must start fresh ranks. Prints one
JSON line per case (a run that raised says so rather than ending the script)."""
import os
import signal
import sys
import time

import mplaunch

from allocation import say, steps


def where():
    return os.environ["SLURMD_NODENAME"], os.getpid()


def fail_in_rank_1():
    if os.environ["RANK"] == "1":
        raise ValueError("rank 1 says no")


def attempt(func):
    """(result, None) or (None, 'Type: first line of the message')."""
    try:
        return func(), None
    except Exception as exc:   # noqa: BLE001 - reported to the test
        return None, f"{type(exc).__name__}: {str(exc).splitlines()[0]}"


def main():
    with mplaunch.World(nprocs=2, nnodes=2, backend="gloo", master_addr="127.0.0.1",
                        timeout=60) as w:
        first = w.run(where)
        before_steps = steps()
        _, restart_error = attempt(w.restart)
        after, run_error = attempt(lambda: w.run(where))
        say("restart", first=first, steps_before=before_steps, restart_error=restart_error,
            after=after, run_error=run_error, steps=steps())

    with mplaunch.World(nprocs=2, nnodes=2, backend="gloo", master_addr="127.0.0.1",
                        timeout=60, heal=False) as w:
        first = w.run(where)
        before_steps = steps()
        _, failed = attempt(lambda: w.run(fail_in_rank_1))
        after, run_error = attempt(lambda: w.run(where))
        say("no_heal", first=first, steps_before=before_steps, failed=failed,
            after=after, run_error=run_error, steps=steps())

    # node 1's warm server (the ranks' parent there) killed: its ranks go with it
    with mplaunch.World(nprocs=2, nnodes=2, backend="gloo", master_addr="127.0.0.1",
                        timeout=60) as w:
        first = w.run(where)
        before_steps = steps()
        server = parent_of(w.pids[2])
        os.kill(server, signal.SIGKILL)
        time.sleep(1)   # its agent has heard of it (else a run may still get replies)
        _, failed = attempt(lambda: w.run(where))
        after, run_error = attempt(lambda: w.run(where))
        say("server_killed", first=first, steps_before=before_steps, failed=failed,
            after=after, run_error=run_error, steps=steps(), server=server,
            agent=w.nodes[1]["agent_pid"] if w.nodes else None)


def parent_of(pid):
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


if __name__ == "__main__":
    sys.exit(main())
