"""Run by test_slurm_world inside an allocation (`salloc -N2 python
world_agent_killed.py`): a World of 4 ranks over 2 nodes whose node 1 agent is killed.
The next run raises a WorkerError naming node 1; the World's step ends with every
process of it on both nodes; the run after that starts a new World in a new step. Then
that step is cancelled from outside (scancel JOB.STEP): the same again.
Prints one JSON line per check, as world_nodes.py does."""
import os
import signal
import subprocess
import sys
import time

import mplaunch

from allocation import alive, say, steps, wait_for


def whoami():
    return {"rank": int(os.environ["RANK"]), "node": os.environ.get("SLURMD_NODENAME"),
            "step": os.environ.get("SLURM_STEP_ID"), "pid": os.getpid()}


def all_reduce():
    import torch
    import torch.distributed as dist
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return t.item()


def main():
    w = mplaunch.World(nprocs=2, nnodes=2, backend="gloo", master_addr="127.0.0.1",
                       timeout=60)
    first = w.run(whoami)
    nodes = [{k: n[k] for k in ("node", "name", "agent_pid")} for n in w.nodes]
    world_pids = sorted(set(w.pids.values()) | {n["agent_pid"] for n in nodes})
    say("up", ranks=first, nodes=nodes, steps=steps())

    victim = nodes[1]["agent_pid"]
    os.kill(victim, signal.SIGKILL)
    t0 = time.monotonic()
    try:
        w.run(all_reduce)
        say("lost", raised=None)
    except mplaunch.WorkerError as err:
        say("lost", raised=type(err).__name__, message=str(err), rank=err.rank,
            healed=err.healed, seconds=round(time.monotonic() - t0, 2),
            pids={str(k): v for k, v in w.pids.items()})
    step_gone = wait_for(lambda: not steps())
    gone = wait_for(lambda: not any(alive(p) for p in world_pids))
    say("ended", step_gone=step_gone, steps=steps(), world_pids=world_pids,
        alive=[p for p in world_pids if alive(p)], all_gone=gone)

    again = w.run(whoami)
    nodes2 = [{k: n[k] for k in ("node", "name", "agent_pid")} for n in w.nodes]
    say("again", ranks=again, nodes=nodes2, all_reduce=w.run(all_reduce), steps=steps(),
        fresh=w.fresh_ranks)
    new_pids = sorted(set(w.pids.values()) | {n["agent_pid"] for n in nodes2})

    # the step cancelled from outside (scancel JOB.STEP): SLURM kills both agents
    [[step, _]] = steps()
    cancel = subprocess.run(["scancel", step], capture_output=True, text=True, timeout=30)
    step_gone = wait_for(lambda: not steps())
    try:
        w.run(all_reduce)
        say("scancel", raised=None)
    except mplaunch.WorkerError as err:
        gone = wait_for(lambda: not any(alive(p) for p in new_pids))
        third = w.run(whoami)
        say("scancel", step=step, scancel_rc=cancel.returncode, step_gone=step_gone,
            raised=type(err).__name__, message=str(err), all_gone=gone, ranks=third,
            steps=steps(), all_reduce=w.run(all_reduce))
    new_pids += sorted(set(w.pids.values()) | {n["agent_pid"] for n in w.nodes})
    w.close()
    say("closed", step_gone=wait_for(lambda: not steps()), pids=world_pids + new_pids)


if __name__ == "__main__":
    sys.exit(main())
