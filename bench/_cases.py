"""Rank functions shared by every launcher in the benchmark suite.

Everything here is a top-level function of an importable module, so that
spawn / forkserver children can unpickle it by reference (``_cases.<name>``).
The module is imported as ``_cases`` with ``bench/`` on ``sys.path``; the
parent puts it there and multiprocessing's spawn preparation copies the
parent's ``sys.path`` into each child before anything is unpickled.

Contract for case functions: they take only their case arguments and read
their rank from the environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT``), exactly what ``init_process_group(init_method="env://")``
expects.  Launchers that do not set that environment themselves go through
:func:`run_rank`.

Keep module-level imports to the standard library: the trivial case must not
pay for importing torch in the child.
"""

import os
import time

MASTER_ADDR = "127.0.0.1"


def rank_env(rank, world_size, port):
    """Environment a rank needs for ``env://`` rendezvous on loopback."""
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
        "MASTER_ADDR": MASTER_ADDR,
        "MASTER_PORT": str(port),
        "OMP_NUM_THREADS": "1",
    }


def run_rank(rank, world_size, port, fn, args):
    """Set the rank's environment in this process, then call ``fn(*args)``.

    Used where the launcher cannot pass a per-rank environment (fork,
    forkserver, torch.multiprocessing): those children inherit one shared
    environment, so the rank-specific part has to be applied in the child.
    """
    os.environ.update(rank_env(rank, world_size, port))
    return fn(*args)


def tmp_entry(index, world_size, port, fn, args):
    """Adapter for torch.multiprocessing, which calls ``fn(index, *args)``."""
    return run_rank(index, world_size, port, fn, args)


# --- case functions -------------------------------------------------------


def trivial():
    """Case trivial2: no imports, no communication; measures launch overhead."""
    return int(os.environ["RANK"])


def gloo_allreduce():
    """Case gloo4: join a gloo group, one all_reduce, leave the group."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method="env://")
    try:
        t = torch.ones(4)
        dist.all_reduce(t)
        # A wrong sum means the ranks did not all join the same group.
        expected = float(dist.get_world_size())
        if not bool((t == expected).all()):
            raise RuntimeError(f"all_reduce gave {t.tolist()}, expected {expected}")
    finally:
        dist.destroy_process_group()
    return int(os.environ["RANK"])


def fail_after_init(stamp_path):
    """Case fail_teardown: rank 1 raises once the group exists; rank 0 blocks.

    Rank 1 writes ``time.time()`` to ``stamp_path`` just before raising, so
    the parent can measure from the raise to the launcher giving control
    back.  The write goes through a rename so the parent never reads a
    partial number.  Rank 0 waits in a barrier that rank 1 never enters; how
    (and how fast) it gets unblocked is what the launcher is judged on.
    """
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method="env://")
    if dist.get_rank() == 1:
        tmp = f"{stamp_path}.tmp"
        t_raise = time.time()
        with open(tmp, "w") as f:
            f.write(repr(t_raise))
        os.replace(tmp, stamp_path)
        raise RuntimeError("fail_teardown: deliberate failure on rank 1")
    dist.barrier()
    # Not reached in a correct run: the barrier cannot complete.
    dist.destroy_process_group()
    return 0


# name -> (rank function, number of ranks, whether the launch must fail)
CASES = {
    "gloo4": (gloo_allreduce, 4, False),
    "trivial2": (trivial, 2, False),
    "fail_teardown": (fail_after_init, 2, True),
}
