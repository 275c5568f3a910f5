"""A World's healing and the straggler report on a real GPU, with NCCL: what the CPU
tests check with gloo (a dead rank replaced, a collective's group released and built
again in the same process, the Flight Recorder's records read), where only a GPU can
say whether it holds. A lent GPU machine has one GPU, so these run one rank on it (NCCL
refuses two ranks on one device). Skipped where no GPU is visible (this machine, CI):
run by ``bash .whl/gpu-check.sh tests/test_gpu_runs.py`` on a GPU machine
(docs/gpus.rst, "Checked on a GPU")."""
import os
import subprocess
import sys

import pytest

import mplaunch


def _gpus_here():
    from mplaunch._engine.config import gpu_count
    return gpu_count()


pytestmark = pytest.mark.skipif(_gpus_here() < 1, reason="needs a CUDA GPU")


def _script(tmp_path, text):
    """Run `text` as its own Python process: CUDA in the launching process must not be
    this pytest process's (the other tests fork ranks)."""
    path = tmp_path / "script.py"
    path.write_text(text)
    proc = subprocess.run([sys.executable, str(path)], capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout + proc.stderr
    return proc.stdout


# -- a dead rank, replaced on its GPU ------------------------------------------------------

def free_and_reduce(hold_gib=0):
    import torch
    import torch.distributed as dist
    global held
    if hold_gib:
        held = torch.empty(hold_gib << 30, dtype=torch.uint8, device="cuda")
    t = torch.ones(4, device="cuda")
    dist.all_reduce(t)
    torch.cuda.synchronize()
    return os.getpid(), torch.cuda.mem_get_info()[0], t.sum().item()


def die():
    os._exit(3)


def test_a_dead_nccl_rank_is_replaced_and_its_gpu_memory_freed():
    with mplaunch.World(1, backend="nccl") as world:
        pid, free0, total = world.run(free_and_reduce)[0]
        assert total == 4.0
        _, free1, _ = world.run(free_and_reduce, (4,))[0]
        assert free0 - free1 >= 4 << 30
        with pytest.raises(mplaunch.WorkerError) as info:
            world.run(die)
        assert info.value.failures[0].rank == 0 and world.fresh_ranks == [0]
        pid2, free2, total = world.run(free_and_reduce)[0]
        assert pid2 != pid and total == 4.0
        # The dead rank's 4 GiB went with it (within 1 GiB: NCCL's own buffers).
        assert free2 >= free0 - (1 << 30), (free0, free1, free2)


_CLOSE = r"""
import os, time, torch, mplaunch

def hold():
    import torch
    global block
    block = torch.empty(8 << 30, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()

torch.cuda.init()
base = torch.cuda.mem_get_info()[0]
short = []
for _ in range(8):
    world = mplaunch.World(1, backend="nccl")
    world.run(hold)
    world.close()
    short.append((base - torch.cuda.mem_get_info()[0]) / 2**30)
print("short at close, GiB:", short)
assert max(short) < 0.5, short
print("OK")
"""


def test_a_worlds_gpu_memory_is_free_when_close_returns(tmp_path):
    # Without gpumem's wait, 2 of 8 such closes returned 20-45 ms before the driver had
    # given the reaped rank's 9 GiB back (H200, driver 580).
    _script(tmp_path, _CLOSE)


# -- a call released mid-way: NCCL's group aborted, then built again in the same rank ---------

def busy_gpu(seconds):
    """The main thread blocked in C (a stream synchronisation) for `seconds`: the
    interrupt cannot reach it, so the World releases the group (NCCL: aborts it) while
    the rank waits, and the KeyboardInterrupt comes when the kernel ends."""
    import time

    import torch
    import torch.distributed as dist
    dist.all_reduce(torch.ones(1, device="cuda"))
    torch.cuda.synchronize()
    start = time.monotonic()
    torch.cuda._sleep(int(1e8))
    torch.cuda.synchronize()
    rate = 1e8 / max(time.monotonic() - start, 1e-6)    # cycles a second, as clocked now
    torch.cuda._sleep(int(rate * seconds))
    torch.cuda.synchronize()
    return "not interrupted"


def test_a_nccl_call_released_mid_way_keeps_its_rank_and_builds_the_group_again():
    with mplaunch.World(1, backend="nccl") as world:
        pid, _, _ = world.run(free_and_reduce)[0]
        with pytest.raises((mplaunch.LaunchTimeout, mplaunch.WorkerError)) as info:
            world.run(busy_gpu, (2.0,), timeout=0.5)
        healed = str(getattr(info.value, "healed", "") or "")
        fresh = world.fresh_ranks
        pid2, _, total = world.run(free_and_reduce)[0]
        assert total == 4.0
        # Kept, its group built again after the abort (pytorch/pytorch#151159 reported
        # that a default group could not be made again after _abort_process_group).
        assert pid2 == pid and fresh == [], (pid, pid2, fresh, healed)
        assert "rebuilt" in healed or "made again" in healed or "group" in healed, healed


# -- NCCL's Flight Recorder -------------------------------------------------------------------

def nccl_records(n):
    import torch
    import torch.distributed as dist

    from mplaunch._rank import flight
    flight.call_begins()
    for _ in range(n):
        dist.all_reduce(torch.ones(8, device="cuda"))
    torch.cuda.synchronize()
    records, why = flight._read()
    return len(records), why, os.environ.get("TORCH_FR_BUFFER_SIZE"), \
        os.environ.get("TORCH_NCCL_TRACE_BUFFER_SIZE")


def test_the_ranks_read_nccls_flight_recorder():
    with mplaunch.World(1, backend="nccl") as world:
        count, why, size, nccl_size = world.run(nccl_records, (6,))[0]
    assert why is None and count >= 6, (count, why)
    assert (size, nccl_size) == ("256", None)


# -- refusals with the machine's real count ----------------------------------------------------

def test_more_nccl_ranks_than_gpus_is_refused_with_the_real_count():
    n = _gpus_here()
    with pytest.raises(ValueError, match=f"{n} GPU"):
        mplaunch.launch(free_and_reduce, nprocs=n + 1, backend="nccl")


_CUDA_VALUES = r"""
import mplaunch, torch

def back():
    import torch
    return torch.arange(3, device="cuda") * 2

try:
    mplaunch.launch(back, (torch.ones(2, device="cuda"),), nprocs=1)
except TypeError as err:
    assert "cuda tensor" in str(err) and "t.cpu()" in str(err), err
else:
    raise SystemExit("a CUDA argument was not refused")
out = mplaunch.launch(back, nprocs=1)[0]
print("result on", out.device, out.tolist())
assert out.tolist() == [0, 2, 4]
print("OK")
"""


def test_a_cuda_argument_is_refused_and_a_cuda_result_arrives(tmp_path):
    out = _script(tmp_path, _CUDA_VALUES)
    assert "result on cuda" in out
