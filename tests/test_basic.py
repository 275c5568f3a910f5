import os

import pytest

import mplaunch


def add_rank(x):
    return x + int(os.environ["RANK"])


@pytest.mark.parametrize("method", ["forkserver", "spawn", "fork"])
def test_returns_values_by_rank(method):
    assert mplaunch.launch(add_rank, (10,), 3, start_method=method) == [10, 11, 12]


@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_lambda_closure_nested(method):
    base = 5

    def nested(y):
        return base + y + int(os.environ["LOCAL_RANK"])

    assert mplaunch.launch(nested, (1,), 2, start_method=method) == [6, 7]
    assert mplaunch.launch(lambda: os.environ["WORLD_SIZE"], nprocs=2,
                           start_method=method) == ["2", "2"]


def env_of_rank():
    keys = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
            "MASTER_PORT", "FOO", "PER_RANK", "OMP_NUM_THREADS"]
    return {k: os.environ.get(k) for k in keys}


def test_rank_environment():
    out = mplaunch.launch(env_of_rank, nprocs=2, env=lambda r: {"PER_RANK": f"v{r}", "FOO": "x"})
    assert [o["RANK"] for o in out] == ["0", "1"]
    assert [o["LOCAL_RANK"] for o in out] == ["0", "1"]
    assert {o["WORLD_SIZE"] for o in out} == {"2"}
    assert {o["LOCAL_WORLD_SIZE"] for o in out} == {"2"}
    assert {o["MASTER_ADDR"] for o in out} == {"127.0.0.1"}
    assert len({o["MASTER_PORT"] for o in out}) == 1
    assert [o["PER_RANK"] for o in out] == ["v0", "v1"]
    assert out[0]["OMP_NUM_THREADS"] is not None
    assert "PER_RANK" not in os.environ and "RANK" not in os.environ


def gloo_all_reduce():
    import torch
    import torch.distributed as dist
    dist.init_process_group("gloo")
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    dist.destroy_process_group()
    return t.item()


@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_gloo_all_reduce_four_ranks(method):
    assert mplaunch.launch(gloo_all_reduce, nprocs=4, start_method=method) == [10.0] * 4


def raise_in_rank_one():
    if os.environ["RANK"] == "1":
        try:
            raise KeyError("inner")
        except KeyError as e:
            raise ValueError("boom") from e
    import time
    time.sleep(30)


def test_worker_error_with_cause():
    with pytest.raises(mplaunch.WorkerError) as info:
        mplaunch.launch(raise_in_rank_one, nprocs=2, grace_period=1)
    err = info.value
    assert err.rank == 1 and err.worker_id == 1
    assert isinstance(err.__cause__, ValueError)
    assert str(err.__cause__) == "boom"
    assert isinstance(err.__cause__.__cause__, KeyError)
    assert "raise_in_rank_one" in err.traceback
    assert [f.rank for f in err.failures] == [1]


def tensors_of_rank():
    import torch
    r = int(os.environ["RANK"])
    big = torch.arange(300_000, dtype=torch.float64) + r           # through a memfd
    return {"big": big, "strided": big.view(1000, 300)[:, ::7],      # non-contiguous
            "small": torch.tensor([r]), "grad": torch.ones(20000, requires_grad=True),
            "param": torch.nn.Parameter(torch.zeros(30000)), "empty": torch.empty(0, 3),
            "half": torch.ones(70000, dtype=torch.bfloat16)}


def test_tensors_come_back_intact():
    import torch
    out = mplaunch.launch(tensors_of_rank, nprocs=2)
    for r, d in enumerate(out):
        assert torch.equal(d["big"], torch.arange(300_000, dtype=torch.float64) + r)
        assert torch.equal(d["strided"], d["big"].view(1000, 300)[:, ::7])
        assert d["small"].item() == r
        assert d["grad"].requires_grad and d["grad"].sum().item() == 20000
        assert isinstance(d["param"], torch.nn.Parameter) or d["param"].requires_grad
        assert d["empty"].shape == (0, 3)
        assert d["half"].dtype == torch.bfloat16 and d["half"].float().sum().item() == 70000
        d["big"].add_(1)  # the parent owns a writable copy
