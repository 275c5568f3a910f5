"""The frameworks researchers run, for real, with the real packages (the test extra
installs them): PyTorch Lightning, Hugging Face accelerate and transformers, and
DeepSpeed where it is installed. Each as its users use it: a script under the watcher
(the process tree is watcher -> ranks), the same code inside launch and in a World that
keeps its model between calls. accelerate's own distributed test scripts that run on
CPU pass under the watcher as they do under torchrun. The %%ranks cases are in
test_frameworks_notebook.py."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time

import psutil
import pytest

import mplaunch

HERE = os.path.dirname(os.path.abspath(__file__))
FRAMEWORKS = os.path.join(HERE, "frameworks")
if FRAMEWORKS not in sys.path:
    sys.path.insert(0, FRAMEWORKS)

RUN_TIMEOUT = 170
LAUNCHER_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                 "MASTER_PORT", "GROUP_RANK", "ROLE_RANK", "TORCHELASTIC_RUN_ID",
                 "TORCHELASTIC_ERROR_FILE")


def _env(**extra):
    env = {k: v for k, v in os.environ.items()
           if k not in LAUNCHER_VARS and not k.startswith("SLURM_")}
    env.update(extra)
    return env


def watcher(script, *args, nprocs=2, env=None, cwd=FRAMEWORKS):
    return subprocess.run([sys.executable, "-m", "mplaunch", "--nproc-per-node",
                           str(nprocs), script, *args], env=env or _env(), cwd=cwd,
                          capture_output=True, text=True, timeout=RUN_TIMEOUT)


def torchrun(script, *args, nprocs=2, env=None):
    return subprocess.run([sys.executable, "-m", "torch.distributed.run",
                           "--nproc-per-node", str(nprocs), script, *args],
                          env=env or _env(), cwd=FRAMEWORKS, capture_output=True,
                          text=True, timeout=RUN_TIMEOUT)


def tagged(stdout, tag):
    """{rank: rest of line} of the lines ranks printed as 'TAG ...'."""
    out = {}
    for line in stdout.splitlines():
        head, _, rest = line.partition(": ")
        if head.startswith("[rank") and rest.startswith(tag + " "):
            out[int(head[5:-1])] = rest[len(tag) + 1:]
    return out


# -- PyTorch Lightning -------------------------------------------------------------------

def test_lightning_ddp_script_under_the_watcher():
    pytest.importorskip("pytorch_lightning")
    proc = watcher("lightning_job.py")
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = tagged(proc.stdout, "lightning")
    assert sorted(lines) == [0, 1], proc.stdout[-2000:]
    summaries = [lines[r].split() for r in (0, 1)]
    assert [s[:3] for s in summaries] == [["0", "2", "TorchElasticEnvironment"],
                                          ["1", "2", "TorchElasticEnvironment"]]
    assert summaries[0][3] == summaries[1][3]     # DDP kept the replicas equal


def test_a_lightning_rank_that_raises_mid_epoch_ends_both_at_once(tmp_path):
    pytest.importorskip("pytorch_lightning")
    t0 = time.monotonic()
    proc = watcher("lightning_job.py", env=_env(FAIL_RANK="1", FAIL_EPOCH="1",
                                                 PIDFILE_DIR=str(tmp_path)))
    elapsed = time.monotonic() - t0
    assert proc.returncode == 1, proc.stderr[-3000:]
    summary = [line for line in proc.stderr.splitlines() if line.startswith("mplaunch: ")]
    assert any("rank 1" in line and "ValueError: rank 1 fails mid-epoch" in line
               for line in summary), summary
    assert "lightning" not in proc.stdout          # nobody finished
    assert elapsed < 60, elapsed                     # not a collective's timeout
    pids = [int((tmp_path / f"rank{r}").read_text()) for r in (0, 1)]
    assert not [p for p in pids if psutil.pid_exists(p)], "a rank outlived the watcher"


def _lightning_fit():
    from lightning_job import fit
    return fit()[1]


def test_lightning_fit_inside_launch():
    pytest.importorskip("pytorch_lightning")
    out = mplaunch.launch(_lightning_fit, nprocs=2, timeout=RUN_TIMEOUT)
    assert [o[:3] for o in out] == [(0, 2, "TorchElasticEnvironment"),
                                    (1, 2, "TorchElasticEnvironment")]
    assert out[0][3] == out[1][3]


def test_lightning_fit_twice_in_a_world_keeps_the_model():
    pytest.importorskip("pytorch_lightning")
    from lightning_job import fit_kept
    with mplaunch.World(nprocs=2, timeout=RUN_TIMEOUT) as world:
        first = world.run(fit_kept)
        second = world.run(fit_kept)
    assert [f[0] for f in first] == [None, None]
    trained = first[0][1][3]
    assert [s[0] for s in second] == [trained, trained]   # the kept model went on
    assert second[0][1][3] == second[1][1][3] != trained


# -- accelerate --------------------------------------------------------------------------

def _accelerate_train():
    from accelerate_job import train
    return train()


def test_accelerate_inside_launch():
    pytest.importorskip("accelerate")
    out = mplaunch.launch(_accelerate_train, nprocs=2, timeout=RUN_TIMEOUT)
    assert [(o["process"], o["processes"], o["gathered"]) for o in out] == [
        (0, 2, [0, 1]), (1, 2, [0, 1])]
    assert out[0]["type"] == "DistributedType.MULTI_CPU"
    assert out[0]["bias"] == out[1]["bias"]


def test_accelerate_twice_in_a_world_keeps_what_it_prepared():
    pytest.importorskip("accelerate")
    from accelerate_job import train_kept
    with mplaunch.World(nprocs=2, timeout=RUN_TIMEOUT) as world:
        first = world.run(train_kept)
        second = world.run(train_kept)
    assert [o["gathered"] for o in first + second] == [[0, 1]] * 4
    assert first[0]["bias"] == first[1]["bias"] != second[0]["bias"] == second[1]["bias"]


def _accelerate_script(name):
    spec = importlib.util.find_spec("accelerate.test_utils.scripts." + name)
    assert spec is not None and spec.origin
    return spec.origin


# The scripts of accelerate/test_utils/scripts that run distributed on CPU, under torchrun
# too. With ACCELERATE_USE_CPU=1, as `accelerate launch --cpu` sets it: without it, on a
# machine with no GPU, Accelerator() is not distributed under either launcher (every
# process is "the main process", and test_script's processes race on one file). The
# others need GPUs (test_ddp_comm_hook, test_distributed_data_loop) or fail on CPU under
# torchrun alike (test_merge_weights: FSDP).
ACCELERATE_SCRIPTS = ["test_ops", "test_script", "test_sync", "test_cli"]


@pytest.mark.parametrize("name", ACCELERATE_SCRIPTS)
def test_accelerates_own_distributed_test_scripts_under_the_watcher(name, tmp_path):
    pytest.importorskip("accelerate")
    proc = watcher(_accelerate_script(name), cwd=tmp_path,   # they write files there
                   env=_env(ACCELERATE_USE_CPU="1"))
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-3000:])
    out = proc.stdout + proc.stderr
    assert "[rank0]: " in out and "[rank1]: " in out
    if name == "test_script":   # it says how it ran: distributed, as under torchrun
        for rank in (0, 1):
            assert f"[rank{rank}]: Distributed environment: DistributedType.MULTI_CPU" in out
            assert f"[rank{rank}]: Num processes: 2" in out


# -- transformers ------------------------------------------------------------------------

def test_transformers_trainer_under_the_watcher(tmp_path):
    pytest.importorskip("transformers")
    proc = watcher("transformers_job.py", str(tmp_path / "out"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    done = tagged(proc.stdout, "HF done")
    assert sorted(done) == [0, 1], proc.stdout[-2000:]
    for rank, text in done.items():
        assert f"'rank': {rank}, 'world': 2, 'steps': 4" in text
        assert "DISTRIBUTED" in text
    # Its tqdm bar (redrawn with \r) went to a pipe: each line is one rank's
    for line in (proc.stdout + proc.stderr).splitlines():
        owners = {seg.split(": ", 1)[0] for seg in line.split("\r") if seg}
        assert len(owners) <= 1, repr(line)


def _transformers_train(out):
    from transformers_job import train
    return train(out)


def test_transformers_trainer_inside_launch(tmp_path):
    pytest.importorskip("transformers")
    out = mplaunch.launch(_transformers_train, args=(str(tmp_path / "out"),), nprocs=2,
                          timeout=RUN_TIMEOUT)
    assert [(o["rank"], o["world"], o["steps"]) for o in out] == [(0, 2, 4), (1, 2, 4)]


# -- DeepSpeed ---------------------------------------------------------------------------

def _deepspeed_init():
    import deepspeed
    import torch
    import torch.distributed as dist
    deepspeed.init_distributed(dist_backend="gloo")
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return dist.get_rank(), dist.get_world_size(), t.item()


@pytest.mark.slow
def test_deepspeed_init_distributed_inside_launch():
    pytest.importorskip("deepspeed", reason="DeepSpeed is installed by .ci/run "
                        "(pip install --no-build-isolation deepspeed), not by the extra")
    out = mplaunch.launch(_deepspeed_init, nprocs=2, timeout=RUN_TIMEOUT)
    assert out == [(0, 2, 3.0), (1, 2, 3.0)]


# -- what torchrun sets ------------------------------------------------------------------

def test_a_rank_sees_what_torchrun_sets_less_what_is_left_out_on_purpose():
    """The launcher variables of a rank under torchrun and under the watcher. What the
    watcher leaves out is listed in docs/watcher.rst with the reason."""
    env = _env(PARENT_ENV_NAMES=json.dumps(sorted(_env()) + ["PARENT_ENV_NAMES"]))
    seen = {}
    for name, run in (("torchrun", torchrun), ("watcher", watcher)):
        proc = run("env_dump.py", env=env)
        assert proc.returncode == 0, proc.stderr[-2000:]
        ranks = {}
        for line in proc.stdout.splitlines():
            line = line.split("]: ", 1)[1] if line.startswith("[rank") else line
            if line.startswith("ENV "):
                _, rank, names = line.split(" ", 2)
                ranks[int(rank)] = names
        assert sorted(ranks) == [0, 1], proc.stdout
        seen[name] = set(json.loads(ranks[0]))
    left_out = {"TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_ERROR_FILE",
                "TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCHELASTIC_SIGNALS_TO_HANDLE",
                "NCCL_ASYNC_ERROR_HANDLING"}   # the last: its name before torch 2.2
    missing = seen["torchrun"] - seen["watcher"] - left_out
    assert not missing, f"torchrun sets {sorted(missing)}, the watcher does not"
    for name in ("TORCHELASTIC_RUN_ID", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME",
                 "LOCAL_WORLD_SIZE", "TORCHELASTIC_RESTART_COUNT"):
        assert name in seen["watcher"], name
