"""Every way user code and frameworks set up torch's process group, tried one after the
other in one rank: init, an all_reduce that proves the group is whole, destroy.

Imported by the tests (a rank loads run_forms by reference), run as a script by the
watcher's tests (``python -m mplaunch --nproc-per-node 2 init_forms.py FORM ...``), and
imported in a notebook cell.

Forms that need a place of the user's own (their own MASTER_PORT, a tcp:// address, a
FileStore, a store= they built) take it from ``places``: {form: port or path}, chosen by
the launching side so that ranks agree on it.
"""
import contextlib
import datetime
import json
import os
import sys

import torch
import torch.distributed as dist


@contextlib.contextmanager
def _env(**values):
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _init(form, rank, world, places):
    addr, port = os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]
    if form == "bare":
        dist.init_process_group("gloo")
    elif form == "rank_world":          # the PyTorch DDP tutorial, Lightning, accelerate
        dist.init_process_group("gloo", rank=rank, world_size=world)
    elif form == "timeout":
        dist.init_process_group("gloo", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=120))
    elif form == "keywords":            # backend= by keyword, world_size alone
        dist.init_process_group(backend="gloo", world_size=world)
    elif form == "env_url":
        dist.init_process_group("gloo", init_method="env://")
    elif form == "env_query":
        dist.init_process_group("gloo", init_method=f"env://?rank={rank}&world_size={world}")
    elif form == "tcp_ours":            # tcp:// built from what mplaunch set
        dist.init_process_group("gloo", init_method=f"tcp://{addr}:{port}",
                                rank=rank, world_size=world)
    elif form == "localhost":           # MASTER_ADDR rewritten, mplaunch's port kept
        with _env(MASTER_ADDR="localhost"):
            dist.init_process_group("gloo", rank=rank, world_size=world)
    elif form == "device_id":           # torch accepts device_id= for accelerators only
        index = int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count()
        torch.cuda.set_device(index)
        dist.init_process_group("nccl", rank=rank, world_size=world,
                                device_id=torch.device("cuda", index))
    elif form == "own_master_port":     # the tutorial's setup(): a store of their own
        with _env(MASTER_ADDR="localhost", MASTER_PORT=str(places[form])):
            dist.init_process_group("gloo", rank=rank, world_size=world)
    elif form == "tcp_own":
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{places[form]}",
                                rank=rank, world_size=world)
    elif form == "file":
        dist.init_process_group("gloo", init_method=f"file://{places[form]}",
                                rank=rank, world_size=world)
    elif form == "store":
        store = dist.TCPStore("127.0.0.1", int(places[form]), world, rank == 0,
                              timeout=datetime.timedelta(seconds=120))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    else:
        raise ValueError(f"unknown form {form!r}")


def run_forms(forms, places=None):
    """[(form, the all_reduce's sum)] for each form, in this rank."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    out = []
    for form in forms:
        _init(form, rank, world, places or {})
        t = torch.tensor([float(rank + 1)])
        if dist.get_backend() == "nccl":
            t = t.cuda()
        dist.all_reduce(t)
        assert (dist.get_rank(), dist.get_world_size()) == (rank, world)
        out.append((form, t.item()))
        dist.barrier()
        dist.destroy_process_group()
    return out


def expected(forms, world):
    return [(form, float(world * (world + 1) // 2)) for form in forms]


if __name__ == "__main__":
    # argv: a JSON object of places, then the forms
    result = run_forms(sys.argv[2:], json.loads(sys.argv[1]))
    print("forms", json.dumps(result), flush=True)
