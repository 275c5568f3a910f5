"""DDP training on CPU (gloo) whose DataLoader has worker processes of its own.

Each rank reads a synthetic dataset through a DistributedSampler and a DataLoader with
two worker processes, so every rank has children: the launching process's
grandchildren. With --fail-at-step, rank 1 raises at that step; mplaunch stops rank 0,
and every DataLoader worker of both ranks is gone by the time launch() raises.

    python examples/ddp_dataloader.py                    # 2 ranks, 20 steps
    python examples/ddp_dataloader.py --fail-at-step 5   # rank 1 raises at step 5
"""
import argparse
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler

import mplaunch


class Synthetic(Dataset):
    """y = x . w + noise, generated once from a fixed seed: every rank sees the same
    dataset, and the sampler gives each rank its own share of it."""

    def __init__(self, n=512, dim=8):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, dim, generator=g)
        w = torch.randn(dim, 1, generator=g)
        self.y = self.x @ w + 0.01 * torch.randn(n, 1, generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def _record_worker(pid_dir):
    def init(worker_id):
        # Runs in the DataLoader worker process: a child of the rank.
        print(f"DataLoader worker {worker_id} has pid {os.getpid()}", flush=True)
        open(os.path.join(pid_dir, str(os.getpid())), "w").close()
    return init


def train(steps, fail_at_step, pid_dir):
    dist.init_process_group("gloo")  # env:// from the variables mplaunch sets
    rank, world = dist.get_rank(), dist.get_world_size()
    dataset = Synthetic()
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=16, sampler=sampler, num_workers=2,
                        persistent_workers=True, worker_init_fn=_record_worker(pid_dir))
    torch.manual_seed(0)  # the same initial weights on every rank
    model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),
                                    torch.nn.Linear(16, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    step, epoch, loss = 0, 0, None
    while step < steps:
        sampler.set_epoch(epoch)  # a different shuffle each epoch, the same on every rank
        for x, y in loader:
            if step == fail_at_step and rank == 1:
                raise RuntimeError(f"injected failure at step {step}")
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()  # DDP averages the gradients across ranks here
            opt.step()
            step += 1
            if step % 5 == 0 or step == steps:
                mean = loss.detach().clone()
                dist.all_reduce(mean)
                if rank == 0:
                    print(f"step {step:3d}  loss {mean.item() / world:.4f}", flush=True)
            if step == steps:
                break
        epoch += 1
    dist.destroy_process_group()
    return loss.item()


def _alive(pid):
    """Whether pid is a live process (a zombie is not: it only waits to be reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rpartition(")")[2].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nprocs", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--fail-at-step", type=int, default=-1,
                    help="rank 1 raises at this step (default -1: never)")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as pid_dir:
        try:
            losses = mplaunch.launch(train, args=(args.steps, args.fail_at_step, pid_dir),
                                     nprocs=args.nprocs, grace_period=2.0)
        except mplaunch.WorkerError as err:
            print(f"launch raised WorkerError: rank {err.rank} failed "
                  f"({err.exc_type}: {err.__cause__})", file=sys.stderr)
            # mplaunch killed every descendant of the ranks before raising; what is left
            # is at most a process the kernel has not finished removing.
            workers = [int(p) for p in os.listdir(pid_dir)]
            deadline = time.monotonic() + 10.0
            while any(_alive(p) for p in workers) and time.monotonic() < deadline:
                time.sleep(0.05)
            left = [p for p in workers if _alive(p)]
            print(f"DataLoader workers started: {len(workers)}; still alive: "
                  f"{left or 'none'}", file=sys.stderr)
            return 1
    print("final loss by rank:", [round(x, 4) for x in losses])
    return 0


if __name__ == "__main__":
    sys.exit(main())
