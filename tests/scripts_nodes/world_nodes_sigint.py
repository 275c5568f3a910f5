"""A launching process whose World spans two stand-in nodes (tests/local_step.py), for
the test that sends it SIGINT during a run: `world_nodes_sigint.py OUTDIR`.

It runs once, then a run in which every rank spins (each writes OUTDIR/in.<rank> once
inside), after writing OUTDIR/tree.json (the pids of the World's step and everything
below it). The test then sends SIGINT to this process; the run must raise
KeyboardInterrupt with the world kept. It prints `RESULT <json>`: the error, the ranks'
and agents' pids before and after, and two more runs (state, all_reduce); exits 0."""
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE)]

import psutil  # noqa: E402

import local_step  # noqa: E402
import mplaunch  # noqa: E402


def count_calls():
    state = mplaunch.rank_state()
    state["calls"] = state.get("calls", 0) + 1
    return state["calls"]


def spin(flag_dir):
    open(os.path.join(flag_dir, f"in.{os.environ['RANK']}"), "w").close()
    state = mplaunch.rank_state()
    while True:
        state["spins"] = state.get("spins", 0) + 1


def allreduce_sum():
    import torch
    import torch.distributed as dist
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return t.item()


def main():
    outdir = sys.argv[1]
    wrap = lambda i: ["env", f"SLURMD_NODENAME=node{i}"]  # noqa: E731
    with mplaunch.World(2, nnodes=2, backend="gloo", master_addr="127.0.0.1",
                        grace_period=10, _starter=local_step.starter(wrap=wrap)) as w:
        w.run(count_calls)
        pids = w.pids
        agents = [n["agent_pid"] for n in w.nodes]
        step = psutil.Process(agents[0]).ppid()
        tree = [step] + [p.pid for p in psutil.Process(step).children(recursive=True)]
        tmp = os.path.join(outdir, "tree.json.tmp")
        with open(tmp, "w") as f:
            json.dump(tree, f)
        os.rename(tmp, os.path.join(outdir, "tree.json"))
        result = {"pids_before": {str(r): p for r, p in pids.items()},
                  "agents_before": agents}
        try:
            w.run(spin, (outdir,))
            result["error"] = None
        except KeyboardInterrupt as exc:
            result.update(error="KeyboardInterrupt", message=str(exc))
        result["pids_after"] = {str(r): p for r, p in w.pids.items()}
        result["agents_after"] = [n["agent_pid"] for n in w.nodes]
        result["calls"] = w.run(count_calls)
        result["sum"] = w.run(allreduce_sum)
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
