"""A plain training script, written as for torchrun, run by mplaunch's watcher command:

    python -m mplaunch --nprocs 2 examples/train_script.py --steps 5

Every rank runs this file as __main__ with its own RANK, WORLD_SIZE, MASTER_ADDR and
MASTER_PORT, so init_process_group("gloo") needs no arguments. With --fail-at-step N,
rank 1 exits with code 3 at step N, and the command exits with code 3 too.
"""
import argparse
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def main():
    ap = argparse.ArgumentParser(description="tiny DDP training on CPU")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--fail-at-step", type=int, default=-1,
                    help="rank 1 exits with code 3 at this step (default -1: never)")
    args = ap.parse_args()  # sys.argv[1:]: the arguments after the script's name

    if "RANK" not in os.environ:
        sys.exit("run me in ranks: python -m mplaunch --nprocs 2 " + " ".join(sys.argv))
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    g = torch.Generator().manual_seed(rank)  # each rank its own data
    for step in range(args.steps):
        if step == args.fail_at_step and rank == 1:
            print(f"rank {rank}: giving up at step {step}", file=sys.stderr, flush=True)
            sys.exit(3)
        x = torch.randn(16, 4, generator=g)
        loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(f"rank {rank}/{world} step {step} loss {loss.item():.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
