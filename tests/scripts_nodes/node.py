"""One node of a two-node launch on loopback: python node.py NODE_RANK PORT MODE"""
import json
import os
import sys
import time

import mplaunch


def all_reduce(mode):
    import torch
    import torch.distributed as dist
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if mode == "fail" and rank == 3:
        raise RuntimeError("rank 3 fails on purpose")
    if mode == "sleep":
        open(os.path.join(os.environ["READY_DIR"], f"ready-{rank}"), "w").close()
        time.sleep(300)
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    if mode == "fail":
        time.sleep(60)  # the failure elsewhere must end this
    dist.destroy_process_group()
    return [t.item(), int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]),
            int(os.environ["GROUP_RANK"]), int(os.environ["WORLD_SIZE"])]


if __name__ == "__main__":
    node_rank, port, mode = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    try:
        out = mplaunch.launch(all_reduce, (mode,), nprocs=2, nnodes=2, node_rank=node_rank,
                              master_addr="127.0.0.1", master_port=port, grace_period=2,
                              timeout=120)
        print(json.dumps({"ok": out}))
    except mplaunch.MainProcessError as err:
        print(json.dumps({"main_process_error": err.signal_name}))
    except mplaunch.WorkerError as err:
        print(json.dumps({"error": str(err).splitlines()[0], "rank": err.rank,
                          "cause": type(err.__cause__).__name__,
                          "cause_msg": str(err.__cause__)}))
