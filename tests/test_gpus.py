"""backend=, gpus= and cpus= with real ranks: the process group each rank sets up and
tears down, the environment and CPU affinity each rank is given, and the refusals that
come before any process starts. No GPU here: the CUDA paths are checked as far as the
launching process goes (counts, refusals); docs/gpus.rst lists what needs a GPU."""
import os

import psutil
import pytest

import mplaunch
from mplaunch._engine import group as _group, servers as _procs, spawners as _spawners

METHODS = ["forkserver", "spawn", "fork"]


def watch_the_group(marks):
    """In a rank: record, in files under `marks`, that the group was up when the
    function ran and that destroy_process_group was called after it."""
    import torch.distributed as dist
    rank = os.environ["RANK"]
    original = dist.destroy_process_group

    def destroy(*a, **k):
        with open(os.path.join(marks, f"destroyed{rank}"), "w") as f:
            f.write(str(dist.is_initialized()))
        return original(*a, **k)

    dist.destroy_process_group = destroy
    return dist.is_initialized(), dist.get_world_size(), dist.get_backend()


def group_then_fail(marks):
    watch_the_group(marks)
    if os.environ["RANK"] == "1":
        raise ValueError("rank 1 fails")
    return "ok"


def placement():
    return (sorted(os.sched_getaffinity(0)), os.environ.get("OMP_NUM_THREADS"),
            os.environ.get("CUDA_VISIBLE_DEVICES"))


@pytest.mark.parametrize("method", METHODS)
def test_backend_group_is_up_in_the_function_and_destroyed_after_it(tmp_path, method):
    logs = tmp_path / "logs"
    out = mplaunch.launch(watch_the_group, (str(tmp_path),), 2, backend="gloo",
                          start_method=method, log_dir=str(logs))
    assert out == [(True, 2, "gloo")] * 2
    for rank in (0, 1):
        assert (tmp_path / f"destroyed{rank}").read_text() == "True"
        # Nothing on stderr: no warning about a group left undestroyed, or any other.
        assert (logs / "attempt_0" / str(rank) / "stderr.log").read_text() == ""


def test_a_failed_ranks_group_is_destroyed_after_its_error_is_reported(tmp_path):
    with pytest.raises(mplaunch.WorkerError) as info:
        mplaunch.launch(group_then_fail, (str(tmp_path),), 2, backend="gloo")
    err = info.value
    # The failure reported is the rank's own, not a peer's broken collective.
    assert err.failures[0].rank == 1 and isinstance(err.__cause__, ValueError)
    assert (tmp_path / "destroyed1").read_text() == "True"


def test_start_takes_backend(tmp_path):
    handle = mplaunch.start(watch_the_group, (str(tmp_path),), 2, backend="gloo")
    assert handle.result() == [(True, 2, "gloo")] * 2
    assert (tmp_path / "destroyed0").exists() and (tmp_path / "destroyed1").exists()


def test_no_backend_leaves_torch_distributed_alone():
    def initialized():
        import torch.distributed as dist
        return dist.is_initialized()
    assert mplaunch.launch(initialized, nprocs=2) == [False, False]


# -- cpus= -------------------------------------------------------------------------------

@pytest.mark.parametrize("method", METHODS)
def test_cpus_per_rank_binds_each_rank_to_its_own_slice(method):
    allowed = sorted(os.sched_getaffinity(0))
    n = min(2, len(allowed))
    out = mplaunch.launch(placement, nprocs=n, cpus="per-rank", start_method=method)
    slices = [set(cpus) for cpus, _, _ in out]
    assert all(slices) and set().union(*slices) == set(allowed)
    assert sum(map(len, slices)) == len(allowed)          # disjoint
    assert [threads for _, threads, _ in out] == [str(len(s)) for s in slices]


def test_cpus_per_rank_keeps_the_users_omp_num_threads():
    out = mplaunch.launch(placement, nprocs=1, cpus="per-rank",
                          env={"OMP_NUM_THREADS": "3"})
    assert out[0][1] == "3"


def test_cpus_per_rank_in_a_world(tmp_path):
    with mplaunch.World(1, cpus="per-rank") as world:
        assert world.run(placement)[0][0] == sorted(os.sched_getaffinity(0))


# -- gpus= -------------------------------------------------------------------------------

def test_gpus_per_rank_gives_each_rank_one_entry_of_a_parent_subset(monkeypatch):
    # No GPU here, but the mapping is environment only: with the parent's list set to
    # a subset, each rank gets its own entry as written, never its rank number.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-5a1b,MIG-77")
    out = mplaunch.launch(placement, nprocs=2, gpus="per-rank")
    assert [gpu for _, _, gpu in out] == ["GPU-5a1b", "MIG-77"]
    # A list picks positions in that list, and sets nprocs.
    out = mplaunch.launch(placement, gpus=[1, 0])
    assert [gpu for _, _, gpu in out] == ["MIG-77", "GPU-5a1b"]


# -- refusals, before any process starts -------------------------------------------------

@pytest.fixture
def no_driver(monkeypatch):
    """GPUs as CUDA_VISIBLE_DEVICES alone says, whatever this machine's driver lists
    (on a GPU machine its real GPUs would decide: found on the first GPU run)."""
    from mplaunch._engine import devices
    monkeypatch.setattr(devices, "driver_gpus", lambda *a, **k: None)


@pytest.fixture
def nothing_starts(monkeypatch):
    """Calls that must raise before a server or rank exists."""
    def started(*a, **k):
        raise AssertionError("a server or rank was started")
    servers = set(_procs.server_pids()) | set(_procs.idle_pool_pids())
    monkeypatch.setattr(_procs, "get_server", started)
    monkeypatch.setattr(_group.RankGroup, "__init__", started)
    monkeypatch.setattr(_spawners, "fork_rank", started)
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    yield
    # (A warm server left by earlier tests may replenish its idle pool meanwhile.)
    servers |= set(_procs.server_pids()) | set(_procs.idle_pool_pids())
    new = [p for p in psutil.Process().children(recursive=True)
           if p.pid not in before and p.pid not in servers]
    # A pool child forked between the two looks above is a server's too (get_server and
    # RankGroup raise here: no server could have been asked for a rank).
    servers |= set(_procs.server_pids())
    new = [p for p in new if _parent_of(p) not in servers]
    assert not new, f"processes started: {new}"


def _parent_of(proc):
    try:
        return proc.ppid()
    except psutil.NoSuchProcess:
        return None


def test_nccl_with_more_ranks_than_gpus_is_refused_with_the_counts(nothing_starts,
                                                                   no_driver, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    for call in (lambda: mplaunch.launch(print, nprocs=2, backend="nccl"),
                 lambda: mplaunch.start(print, nprocs=2, backend="cpu:gloo,cuda:nccl"),
                 lambda: mplaunch.World(2, backend="nccl")):
        with pytest.raises(ValueError, match=r"2 ranks, but this process sees 1 GPU "
                                             r"\(CUDA_VISIBLE_DEVICES='3'\)"):
            call()


def test_gpus_with_more_ranks_than_gpus_is_refused(nothing_starts, no_driver,
                                                    monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    with pytest.raises(ValueError, match=r"gpus='per-rank'.*3 ranks, but this process "
                                         r"sees 2 GPUs"):
        mplaunch.launch(print, nprocs=3, gpus="per-rank")
    with pytest.raises(ValueError, match="names 2 GPUs, one per rank, but nprocs=3"):
        mplaunch.launch(print, nprocs=3, gpus=[1, 0])
    with pytest.raises(ValueError, match="position 2 is past the end"):
        mplaunch.World(gpus=[2])


def test_bad_gpus_cpus_and_backend_values_name_the_argument(nothing_starts):
    with pytest.raises(ValueError, match="gpus must be None"):
        mplaunch.launch(print, gpus="all")
    with pytest.raises(ValueError, match="names a GPU twice"):
        mplaunch.launch(print, gpus=[0, 0])
    with pytest.raises(ValueError, match="cpus must be None"):
        mplaunch.launch(print, cpus=4)
    with pytest.raises(TypeError, match="backend must be a str"):
        mplaunch.launch(print, backend=1)
    with pytest.raises(ValueError, match="gpus= and env= both set"):
        mplaunch.launch(print, gpus=[0], env={"CUDA_VISIBLE_DEVICES": "1"})
    with pytest.raises(ValueError, match=r"cpus='per-rank'.*ranks, but this process may "
                                         r"run on"):
        mplaunch.launch(print, nprocs=len(os.sched_getaffinity(0)) + 1, cpus="per-rank")


def test_nprocs_left_out_is_one_rank_or_one_per_listed_gpu(no_driver, monkeypatch):
    assert mplaunch.launch(os.getpid).__len__() == 1
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2")
    assert mplaunch.launch(placement, gpus=[2, 0, 1]).__len__() == 3


def test_the_command_takes_backend_and_cpus(tmp_path):
    import subprocess
    import sys
    script = tmp_path / "where.py"
    script.write_text("import os, torch.distributed as dist\n"
                      "print('group', dist.is_initialized(), dist.get_world_size(),\n"
                      "      'cpus', sorted(os.sched_getaffinity(0)))\n")
    proc = subprocess.run([sys.executable, "-m", "mplaunch", "-n", "2", "--backend", "gloo",
                           "--numa-binding", "exclusive", str(script)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "--numa-binding exclusive is --cpus per-rank" in proc.stderr
    lines = sorted(line for line in proc.stdout.splitlines() if "group" in line)
    assert len(lines) == 2 and all("group True 2 cpus" in line for line in lines), lines
    cpus = [line.split("cpus ")[1] for line in lines]
    assert cpus[0] != cpus[1]


def test_a_world_keeps_its_group_between_runs_and_a_destroyed_one_stays_so():
    def seq_then(destroy):
        import torch.distributed as dist
        up = dist.is_initialized()
        if destroy:
            dist.barrier()
            dist.destroy_process_group()
        return up
    with mplaunch.World(2, backend="gloo") as world:
        assert world.run(seq_then, (False,)) == [True, True]
        assert world.run(seq_then, (True,)) == [True, True]
        assert world.run(seq_then, (False,)) == [False, False]


# -- on a GPU machine (skipped here: no GPU; counted through NVML, never CUDA) ------------

def _gpus_here():
    from mplaunch._engine.config import gpu_count
    return gpu_count()


needs_gpus = pytest.mark.skipif(_gpus_here() < 1, reason="needs a CUDA GPU")

_CUDA_IN_LAUNCHER = r"""
import sys, mplaunch, torch
torch.cuda.init()                      # CUDA initialised in the launching process
assert torch.cuda.is_initialized()

def where():
    import torch
    return torch.cuda.is_available() and torch.ones(1, device="cuda").item()

for method in ("forkserver", "spawn"):
    assert mplaunch.launch(where, nprocs=1, start_method=method) == [1.0], method
try:
    mplaunch.launch(where, nprocs=1, start_method="fork")
except RuntimeError as err:
    assert "CUDA is already initialised" in str(err)
else:
    sys.exit("fork was not refused")
print("OK")
"""


@needs_gpus
def test_cuda_in_the_launcher_leaves_forkserver_and_spawn_working_and_refuses_fork(
        tmp_path):
    import subprocess
    import sys
    script = tmp_path / "cuda_launcher.py"
    script.write_text(_CUDA_IN_LAUNCHER)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr


def nccl_all_reduce():
    import torch
    import torch.distributed as dist
    t = torch.ones(1, device="cuda") * (dist.get_rank() + 1)
    dist.all_reduce(t)
    return (t.item(), torch.cuda.current_device(), torch.cuda.device_count(),
            os.environ.get("CUDA_VISIBLE_DEVICES"))


@needs_gpus
def test_a_world_with_nccl_runs_a_collective_on_its_gpu(tmp_path):
    logs = tmp_path / "logs"
    with mplaunch.World(1, backend="nccl", log_dir=str(logs)) as world:
        total, device, _, _ = world.run(nccl_all_reduce)[0]
    assert (total, device) == (1.0, 0)


@needs_gpus
def test_gpus_per_rank_with_nccl(tmp_path):
    n = min(2, _gpus_here())
    logs = tmp_path / "logs"
    out = mplaunch.launch(nccl_all_reduce, nprocs=n, gpus="per-rank", backend="nccl",
                          log_dir=str(logs))
    assert [o[0] for o in out] == [n * (n + 1) / 2] * n
    assert [o[1:3] for o in out] == [(0, 1)] * n            # one GPU each, as cuda:0
    assert len({o[3] for o in out}) == n
    for rank in range(n):
        stderr = (logs / "attempt_0" / str(rank) / "stderr.log").read_text()
        assert "NOT been destroyed" not in stderr and "Warning" not in stderr, stderr


_MEMORY = r"""
import mplaunch

def hold():
    import torch
    global block
    block = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")   # 1 GiB, kept
    return torch.cuda.memory_allocated()

with mplaunch.World(1, backend="nccl") as world:
    assert world.run(hold)[0] >= 1 << 30
    import torch
    during = torch.cuda.mem_get_info()[0]
after = torch.cuda.mem_get_info()[0]
print(during, after)
assert after - during >= 1 << 30, (during, after)
print("OK")
"""


@needs_gpus
def test_gpu_memory_is_released_when_a_world_closes(tmp_path):
    import subprocess
    import sys
    script = tmp_path / "memory.py"
    script.write_text(_MEMORY)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr
