"""Every way user code and frameworks set up a process group works in every mplaunch
rank: init_process_group's rank=/world_size=/timeout=/device_id= (which torch turns into
an env:// query), env:// URLs with and without a query, tcp:// to mplaunch's store or to
an address of the user's own, file://, a store= of the user's own and their own
MASTER_PORT (as torch does: their own store). A rank or world size that contradicts the
rank's environment is refused at once, naming both.

The forms live in scripts/init_forms.py, which every front-end runs as is."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import time

import pytest

import mplaunch

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPTS = os.path.join(HERE, "scripts")
if SCRIPTS not in sys.path:
    sys.path.insert(0, SCRIPTS)

pytest.importorskip("torch")   # the forms are torch's (no_torch Pythons have none)
from init_forms import expected, run_forms  # noqa: E402

OURS = ["rank_world", "timeout", "keywords", "env_url", "env_query", "tcp_ours",
        "localhost", "bare"]
OWN = ["own_master_port", "tcp_own", "file", "store"]
# ours and the user's own interleaved: the key spaces of mplaunch's store must follow
ALL = ["rank_world", "own_master_port", "timeout", "tcp_own", "env_query", "file",
       "tcp_ours", "store", "keywords", "env_url", "localhost", "bare"]


def _free_ports(n):
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def places(tmp_path, tag=""):
    ports = _free_ports(3)
    return {"own_master_port": ports[0], "tcp_own": ports[1], "store": ports[2],
            "file": str(tmp_path / f"filestore{tag}")}


@pytest.mark.parametrize("start_method", ["forkserver", "spawn", "fork"])
def test_every_form_in_launch(start_method, tmp_path):
    out = mplaunch.launch(run_forms, args=(ALL, places(tmp_path)), nprocs=2,
                          start_method=start_method, timeout=150)
    assert out == [expected(ALL, 2)] * 2


def test_the_tutorial_form_in_start_and_spawn(tmp_path):
    with mplaunch.start(run_forms, args=(["rank_world", "tcp_ours"],), nprocs=3) as h:
        assert h.result(timeout=120) == [expected(["rank_world", "tcp_ours"], 3)] * 3
    assert mplaunch.spawn(lambda i, forms: run_forms(forms), args=(["rank_world"],),
                          nprocs=2) is None


def test_a_world_heals_whichever_form_its_ranks_used(tmp_path):
    with mplaunch.World(nprocs=2, timeout=150) as world:
        assert world.run(run_forms, (ALL, places(tmp_path, "a"))) == [expected(ALL, 2)] * 2

        def fails_in_a_group_of_its_own_making(rank_to_fail):
            import os

            import torch.distributed as dist
            dist.init_process_group("gloo", rank=int(os.environ["RANK"]),
                                    world_size=int(os.environ["WORLD_SIZE"]))
            if dist.get_rank() == rank_to_fail:
                raise RuntimeError("fails inside a group")
            import torch
            dist.all_reduce(torch.ones(1))   # the peer never comes: released by the heal

        with pytest.raises(mplaunch.WorkerError, match="fails inside a group"):
            world.run(fails_in_a_group_of_its_own_making, (1,))
        # the group the user made is kept, rebuilt by the heal: whole, and destroyable
        assert world.run(_reduce_then_destroy) == [3.0, 3.0]
        # and every form works again in the kept ranks
        assert world.run(run_forms, (ALL, places(tmp_path, "b"))) == [expected(ALL, 2)] * 2


def _reduce_then_destroy():
    import torch
    import torch.distributed as dist
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    dist.destroy_process_group()
    return t.item()


def _contradicts(key):
    import os

    import torch.distributed as dist
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if key == "world_size":
        dist.init_process_group("gloo", rank=rank, world_size=world + 2)
    elif key == "rank":
        dist.init_process_group("gloo", rank=(rank + 1) % world, world_size=world)
    else:
        dist.init_process_group("gloo", init_method=f"env://?world_size={world * 2}")


@pytest.mark.parametrize("key", ["world_size", "rank", "query"])
def test_a_contradicting_rank_or_world_size_is_refused_at_once(key):
    t0 = time.monotonic()
    with pytest.raises(mplaunch.WorkerError) as info:
        mplaunch.launch(_contradicts, args=(key,), nprocs=2, timeout=120)
    assert time.monotonic() - t0 < 60   # not the store's 30 min wait
    cause = info.value.__cause__
    assert isinstance(cause, ValueError), repr(cause)
    r = info.value.rank
    given, env = {"world_size": ("world_size=4", "WORLD_SIZE=2"),
                  "rank": (f"rank={(r + 1) % 2}", f"RANK={r}"),
                  "query": ("world_size=4", "WORLD_SIZE=2")}[key]
    text = str(cause)
    assert f"init_process_group({given}) contradicts" in text and env in text, text


def test_every_form_in_a_script_under_the_watcher(tmp_path):
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    proc = subprocess.run(
        [sys.executable, "-m", "mplaunch", "--nproc-per-node", "2",
         os.path.join(SCRIPTS, "init_forms.py"), json.dumps(places(tmp_path)), *ALL],
        env=env, capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = sorted(line.split(" ", 2)[2] for line in proc.stdout.splitlines()
                     if line.split(" ", 2)[1:2] == ["forms"])
    assert results == [json.dumps(expected(ALL, 2))] * 2, proc.stdout[-3000:]


def test_every_form_in_a_plugin_test(pytester, tmp_path):
    pytester.makepyfile(textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {SCRIPTS!r})
        import pytest
        from init_forms import expected, run_forms

        @pytest.mark.mplaunch(nprocs=2, backend=None)
        def test_forms():
            assert run_forms({ALL!r}, {places(tmp_path)!r}) == expected({ALL!r}, 2)

        @pytest.mark.mplaunch(nprocs=2, reuse=True, backend=None)
        def test_forms_reused():
            assert run_forms({OURS!r}) == expected({OURS!r}, 2)

        @pytest.mark.mplaunch(nprocs=2, reuse=True, backend=None)
        def test_forms_reused_again():
            assert run_forms({OURS!r}) == expected({OURS!r}, 2)
    """))
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", timeout=170)
    result.assert_outcomes(passed=3)


def _gpus_here():
    from mplaunch._engine.config import gpu_count
    return gpu_count()


@pytest.mark.skipif(_gpus_here() < 1, reason="needs a CUDA GPU")
def test_nccl_with_device_id_joins_the_store():
    """torch takes device_id= for accelerators only: NCCL, each rank on its own GPU
    (gpus="per-rank"), rank=/world_size= given as the frameworks give them."""
    n = min(2, _gpus_here())
    out = mplaunch.launch(run_forms, args=(["device_id"],), nprocs=n, gpus="per-rank",
                          timeout=150)
    assert out == [expected(["device_id"], n)] * n
