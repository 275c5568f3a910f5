"""Recovery by restart: DDP training on CPU that checkpoints every few steps.

A fault injected once (rank 1 crashes at --fail-at-step in the first attempt) tears the
whole group down; with max_restarts=1 mplaunch starts fresh processes, which resume from
the last checkpoint and finish with exactly the parameters of an uninterrupted run.

    python examples/restart_training.py --fail-at-step 12
"""
import argparse
import os
import tempfile

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import mplaunch


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def batch(step: int, rank: int):
    # Data is a pure function of (step, rank), so a resumed run sees the same batches.
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(32, 8, generator=g)
    return x, x.sum(1, keepdim=True).sin()


def train(ckpt_dir: str, steps: int, fail_at_step: int, every: int = 5):
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    attempt = int(os.environ["RESTART_COUNT"])  # 0 first, 1 after one restart, ...
    model = make_model()
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    path = os.path.join(ckpt_dir, "checkpoint.pt")
    start = 0
    if os.path.exists(path):
        state = torch.load(path)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = state["step"]
    for step in range(start, steps):
        x, y = batch(step, rank)
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if (step + 1) % every == 0:
            if rank == 0:
                tmp = path + ".tmp"
                torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                            "step": step + 1}, tmp)
                os.replace(tmp, path)  # a crash mid-save never leaves half a checkpoint
            dist.barrier()
        if attempt == 0 and step == fail_at_step and rank == 1:
            print(f"rank {rank}: crashing on purpose at step {step}", flush=True)
            os._exit(1)
    params = {k: v.clone() for k, v in model.state_dict().items()}
    dist.destroy_process_group()
    return {"attempt": attempt, "resumed_from": start, "params": params}


def run(nprocs=2, steps=20, fail_at_step=-1, max_restarts=1, ckpt_dir=None, log_dir=None):
    with tempfile.TemporaryDirectory() as tmp:
        return mplaunch.launch(train, args=(ckpt_dir or tmp, steps, fail_at_step),
                               nprocs=nprocs, max_restarts=max_restarts, log_dir=log_dir)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nprocs", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--fail-at-step", type=int, default=12)
    args = ap.parse_args()
    clean = run(args.nprocs, args.steps, fail_at_step=-1, max_restarts=0)[0]
    recovered = run(args.nprocs, args.steps, fail_at_step=args.fail_at_step)[0]
    same = all(torch.equal(clean["params"][k], recovered["params"][k]) for k in clean["params"])
    print(f"recovered run: attempt {recovered['attempt']}, resumed from step "
          f"{recovered['resumed_from']}; parameters bitwise identical to the "
          f"uninterrupted run: {same}")
    assert same
