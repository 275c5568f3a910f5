"""The healing figures on a GPU, with NCCL, beside the gloo ones of docs/performance.rst:
a dead rank replaced, a call released mid-way (NCCL's group aborted and built again),
GPU memory given back when a World closes, and a one-rank launch beside
torch.multiprocessing.spawn. One GPU is enough (one rank: NCCL refuses two on a device).

    python bench/gpu_figures.py [--rounds 3] [--json PATH]
"""
import argparse
import json
import os
import statistics
import time

import mplaunch


def reduce_once():
    import torch
    import torch.distributed as dist
    t = torch.ones(1 << 20, device="cuda")
    dist.all_reduce(t)
    torch.cuda.synchronize()
    return os.getpid(), t[0].item()


def die():
    os._exit(3)


def busy_gpu(seconds):
    import torch
    torch.cuda.synchronize()
    start = time.monotonic()
    torch.cuda._sleep(int(1e8))
    torch.cuda.synchronize()
    rate = 1e8 / max(time.monotonic() - start, 1e-6)
    torch.cuda._sleep(int(rate * seconds))
    torch.cuda.synchronize()


def rank_facts():
    import torch
    return {k: os.environ.get(k) for k in (
        "TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCH_NCCL_RETHROW_CUDA_ERRORS",
        "CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS", "NCCL_NVLS_ENABLE")} | {
        "cpus": len(os.sched_getaffinity(0)), "device": torch.cuda.get_device_name(0),
        "nccl": ".".join(map(str, torch.cuda.nccl.version()))}


def hold(gib):
    import torch
    global block
    block = torch.empty(gib << 30, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()


def _spawned(rank, port):
    import torch
    import torch.distributed as dist
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                            world_size=1, device_id=torch.device("cuda:0"))
    t = torch.ones(1 << 20, device="cuda")
    dist.all_reduce(t)
    torch.cuda.synchronize()
    dist.destroy_process_group()


def _gpu_processes():
    """What nvidia-smi says holds GPU memory, with each process's command line."""
    import subprocess

    import psutil
    seen = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory",
                           "--format=csv,noheader"], capture_output=True, text=True).stdout
    out = []
    for line in seen.strip().splitlines():
        pid = int(line.split(",")[0])
        try:
            p = psutil.Process(pid)
            out.append(f"{line} ppid={p.ppid()} {' '.join(p.cmdline())[:120]}")
        except psutil.Error:
            out.append(f"{line} (gone)")
    return out


def _free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json")
    a = ap.parse_args()
    out = {}

    # A one-rank NCCL launch, all_reduce included, beside torch.multiprocessing.spawn.
    import torch.multiprocessing as tmp
    ours, theirs = [], []
    for _ in range(a.rounds):
        t0 = time.perf_counter()
        mplaunch.launch(reduce_once, nprocs=1, backend="nccl")
        ours.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        tmp.spawn(_spawned, (_free_port(),), nprocs=1)
        theirs.append(time.perf_counter() - t0)
    out["launch_s"] = {"mplaunch": statistics.median(ours),
                       "torch.multiprocessing.spawn": statistics.median(theirs),
                       "ratio": statistics.median(ours) / statistics.median(theirs)}
    print("launch", out["launch_s"], flush=True)

    with mplaunch.World(1, backend="nccl", gpus="per-rank", cpus="per-rank") as world:
        t0 = time.perf_counter()
        world.run(reduce_once)
        out["world_first_call_s"] = time.perf_counter() - t0
        out["rank"] = world.run(rank_facts)[0]
        calls = []
        for _ in range(5):
            t0 = time.perf_counter()
            world.run(reduce_once)
            calls.append(time.perf_counter() - t0)
        out["world_call_s"] = statistics.median(calls)
        heals, releases, after_release = [], [], []
        for _ in range(a.rounds):
            pid = world.run(reduce_once)[0][0]
            try:
                world.run(die)
            except mplaunch.WorkerError:
                pass
            assert world.fresh_ranks == [0]
            t0 = time.perf_counter()
            pid2 = world.run(reduce_once)[0][0]
            heals.append(time.perf_counter() - t0)
            assert pid2 != pid
            t0 = time.perf_counter()
            try:
                world.run(busy_gpu, (1.5,), timeout=0.3)
            except (mplaunch.LaunchTimeout, mplaunch.WorkerError, KeyboardInterrupt) as e:
                out.setdefault("release_said", str(getattr(e, "healed", "") or e)[:400])
            releases.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            pid3 = world.run(reduce_once)[0][0]
            after_release.append(time.perf_counter() - t0)
            out.setdefault("release_kept_rank", []).append(pid3 == pid2)
        out["heal_next_call_s"] = statistics.median(heals)
        out["release_call_s"] = statistics.median(releases)
        out["after_release_call_s"] = statistics.median(after_release)
    print({k: v for k, v in out.items() if k != "launch_s"}, flush=True)

    # GPU memory given back when a World closes (the launching process reads the
    # device's free memory; CUDA is initialised here only now, after the launches).
    import torch
    torch.cuda.init()
    free0 = torch.cuda.mem_get_info()[0]
    with mplaunch.World(1, backend="nccl") as world:
        world.run(hold, (8,))
        during = torch.cuda.mem_get_info()[0]
        t0 = time.perf_counter()
    closed = time.perf_counter() - t0
    after = torch.cuda.mem_get_info()[0]
    holders = _gpu_processes()
    while torch.cuda.mem_get_info()[0] < during + (6 << 30) and \
            time.perf_counter() - t0 < 10:
        time.sleep(0.005)
    out["memory"] = {"held_gib": (free0 - during) / 2**30,
                     "given_back_gib": (after - during) / 2**30, "close_s": closed,
                     "back_after_s": time.perf_counter() - t0,
                     "holders_at_return": holders}
    print("memory", out["memory"], flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
