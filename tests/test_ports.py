"""No port races: the parent hosts the store on a port it holds; user stores still work."""
import os
import socket
import subprocess
import sys
import textwrap

import pytest

import mplaunch

PARALLEL = textwrap.dedent("""
    import sys
    import mplaunch

    def all_reduce():
        import os, torch, torch.distributed as dist
        dist.init_process_group("gloo")
        t = torch.tensor([1.0])
        dist.all_reduce(t)
        dist.destroy_process_group()
        return (t.item(), os.environ["MASTER_PORT"])

    out = mplaunch.launch(all_reduce, nprocs=2)
    assert [v for v, _ in out] == [2.0, 2.0], out
    print("PORT", out[0][1])
""")


@pytest.mark.slow
def test_eight_launches_at_once_in_separate_processes_never_collide(tmp_path):
    script = tmp_path / "one.py"
    script.write_text(PARALLEL)
    procs = [subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(8)]
    ports = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=170)
            assert p.returncode == 0, err[-3000:]
            ports.append(out.split("PORT ")[1].strip())
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    assert len(set(ports)) == 8


def own_stores(port):
    """A rank that builds its own stores: tcp:// rendezvous on a user port, and a raw
    TCPStore server and client. Must not be turned into clients of mplaunch's store."""
    from datetime import timedelta

    import torch.distributed as dist
    from torch.distributed import TCPStore
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=timedelta(seconds=60))
    if rank == 0:
        store = TCPStore("127.0.0.1", 0, 2, True, timeout=timedelta(seconds=30),
                         wait_for_workers=False)
        ports = [store.port]
    else:
        ports = [None]
    dist.broadcast_object_list(ports, src=0)
    if rank == 1:
        store = TCPStore("127.0.0.1", ports[0], 2, False, timeout=timedelta(seconds=30))
        store.set("hello", "from rank 1")
    dist.barrier()
    got = store.get("hello").decode()
    dist.barrier()
    dist.destroy_process_group()
    return got


def test_user_created_stores_inside_ranks_still_work():
    with socket.socket() as s:  # the test's own port for tcp://; mplaunch picks none
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert mplaunch.launch(own_stores, (port,), 2, timeout=120) == ["from rank 1"] * 2


def env_rendezvous_port():
    import torch.distributed as dist
    dist.init_process_group("gloo")
    port = os.environ["MASTER_PORT"]
    dist.barrier()  # gloo: leaving right after init can break a peer's pending connect
    dist.destroy_process_group()
    return port


def test_master_port_given_by_the_user_is_used():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert mplaunch.launch(env_rendezvous_port, nprocs=2, master_port=port) == [str(port)] * 2
