"""Run by test_slurm_world inside an allocation (`salloc -N2 python world_nodes.py`):
one World of 2 ranks on each of the allocation's 2 nodes, through its runs and heals. Prints
one JSON line per check ({"check": name, ...}) for the test to parse; the pids it saw
(ranks and agents, all of them) are printed last, for the test to prove them gone."""
import os
import signal
import socket
import sys
import time

import mplaunch

from allocation import JOB, say, steps

seen_pids = set()


def remember(w):
    seen_pids.update(w.pids.values())
    seen_pids.update(n["agent_pid"] for n in w.nodes)


# -- what the ranks run ----------------------------------------------------------------
def whoami():
    keys = ("RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK", "WORLD_SIZE",
            "LOCAL_WORLD_SIZE", "SLURMD_NODENAME", "SLURM_PROCID", "SLURM_LOCALID",
            "SLURM_NODEID", "SLURM_NTASKS", "SLURM_JOB_ID", "SLURM_STEP_ID",
            "SLURM_JOB_NAME", "MASTER_ADDR", "MASTER_PORT", "SLURM_TASK_PID")
    with open("/proc/self/environ", "rb") as f:
        initial = f.read()
    return dict({k: os.environ.get(k) for k in keys}, pid=os.getpid(),
                # the World's secret and address are the agents' alone
                secret=[k for k in ("MPLAUNCH_WORLD_SECRET", "MPLAUNCH_WORLD_ADDR")
                        if k in os.environ or k.encode() in initial])


def all_reduce():
    import torch
    import torch.distributed as dist
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return t.item()


def keep(value):
    global KEPT
    KEPT = value
    return os.getpid()


def kept():
    return KEPT


def raise_in_rank_2():
    import torch.distributed as dist
    if dist.get_rank() == 2:
        raise ValueError("rank 2 says no")
    return "ok"


def die_in_rank_3():
    import torch.distributed as dist
    if dist.get_rank() == 3:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.5)
    return "ok"


def hang_in_rank_1():
    import torch.distributed as dist
    if dist.get_rank() == 1:
        time.sleep(600)
    return "ok"


def main():
    try:
        mplaunch.World(nprocs=2, nnodes=3, backend="gloo", master_addr="127.0.0.1")
        say("too_many", raised=None)
    except ValueError as err:
        say("too_many", raised=type(err).__name__, message=str(err), steps=steps())

    w = mplaunch.World(nprocs=2, nnodes=2, backend="gloo", master_addr="127.0.0.1",
                       timeout=60)
    t0 = time.monotonic()
    ranks = w.run(whoami)
    remember(w)
    say("start", seconds=round(time.monotonic() - t0, 2), ranks=ranks,
        nodes=[{k: n[k] for k in ("node", "name", "agent_pid")} for n in w.nodes],
        pids={str(k): v for k, v in w.pids.items()}, steps=steps(),
        job_id=JOB, nprocs=w.nprocs, nnodes=w.nnodes, size=w.size, repr=repr(w))

    say("all_reduce", results=w.run(all_reduce))

    # a foreign client at the store's port: junk, then a half-open connection
    port = int(ranks[0]["MASTER_PORT"])
    junk = []
    for payload in (b"GET / HTTP/1.0\r\n\r\n", os.urandom(4096), b"\xff" * 64):
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        try:
            s.sendall(payload)
        except OSError:
            pass
        junk.append(s)
    time.sleep(0.5)
    after_junk = w.run(all_reduce)
    for s in junk:
        s.close()
    say("junk", results=after_junk, again=w.run(all_reduce), pids={
        str(k): v for k, v in w.pids.items()})

    # heal 1: an exception in rank 2 (on node 1); the ranks and their state stay
    before = dict(w.pids)
    w.run(keep, ("state",))
    try:
        w.run(raise_in_rank_2)
        say("exception", raised=None)
    except mplaunch.WorkerError as err:
        say("exception", raised=type(err).__name__, rank=err.rank,
            cause=repr(err.__cause__), healed=err.healed, same_pids=w.pids == before,
            kept=w.run(kept), after=w.run(all_reduce))

    # heal 2: rank 3 dies (SIGKILL), on node 1 (n2): replaced there, in the same step
    before = dict(w.pids)
    try:
        w.run(die_in_rank_3)
        say("dead", raised=None)
    except mplaunch.WorkerError as err:
        message = str(err)
        fresh = w.fresh_ranks
        after = w.run(whoami)
        remember(w)
        say("dead", raised=type(err).__name__, rank=err.rank, signal=err.signal,
            healed=err.healed, message=message, fresh=fresh,
            before={str(k): v for k, v in before.items()},
            pids={str(k): v for k, v in w.pids.items()}, ranks=after,
            kept=[None if i == 3 else "state" for i in range(4)] == [
                None if i == 3 else v for i, v in enumerate(
                    w.run(lambda: globals().get("KEPT")))],
            all_reduce=w.run(all_reduce), steps=steps(),
            nodes=[{k: n[k] for k in ("node", "name", "agent_pid")} for n in w.nodes])

    # heal 3: a timeout (rank 1 hangs); the ranks stay
    before = dict(w.pids)
    t0 = time.monotonic()
    try:
        w.run(hang_in_rank_1, timeout=3)
        say("timeout", raised=None)
    except mplaunch.WorkerError as err:
        say("timeout", raised=type(err).__name__, seconds=round(time.monotonic() - t0, 1),
            healed=err.healed, same_pids=w.pids == before, after=w.run(all_reduce),
            steps=steps())
    remember(w)

    # a second World in the same allocation, meanwhile: a step of its own
    with mplaunch.World(nprocs=1, nnodes=2, backend="gloo", master_addr="127.0.0.1",
                        timeout=60) as w2:
        second = w2.run(whoami)
        seen_pids.update(w2.pids.values())
        seen_pids.update(n["agent_pid"] for n in w2.nodes)
        both = steps()
        results = (w.run(all_reduce), w2.run(all_reduce))
    say("two_worlds", ranks=second, steps=both, results=results, after=steps())

    w.close()
    # the step ends with the World: give squeue a moment to hear of it
    deadline = time.monotonic() + 20
    left = steps()
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = steps()
    say("closed", steps=left, pids=sorted(seen_pids))


if __name__ == "__main__":
    sys.exit(main())
