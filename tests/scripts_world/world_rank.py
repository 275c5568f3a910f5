"""What a World's rank runs in the process-tree tests (imported by reference from
world_parent.py): start the grandchildren a training job has and keep them in
mplaunch.rank_state(), record every pid, and *return*: the rank then sits idle in its
serve loop, which is what a World is between runs."""
import json
import os
import signal
import subprocess

import mplaunch
from tree_rank import SlowRange, write_atomic


def grow(outdir, dataloader=True):
    """Like tree_rank.hold, but returns; the grandchildren outlive the call."""
    rank = int(os.environ["RANK"])
    state = mplaunch.rank_state()
    state["plain"] = subprocess.Popen(["sleep", "120"])
    state["detached"] = subprocess.Popen(["sleep", "120"], start_new_session=True)
    if dataloader:
        from torch.utils.data import DataLoader
        state["batches"] = iter(DataLoader(SlowRange(), batch_size=None, num_workers=2))
        next(state["batches"])
    else:
        import multiprocessing
        import time
        child = multiprocessing.get_context("fork").Process(target=time.sleep, args=(120,))
        child.start()
        state["child"] = child
    me = os.getpid()

    def on_sigterm(signo, _frame):
        # How a World ends its ranks when it closes (a parent-death kill is SIGKILL):
        # the marker tells the tests which of the two happened.
        if os.getpid() == me:
            write_atomic(os.path.join(outdir, f"signal.{rank}"), f"{signo} {me}")
        os._exit(128 + signo)

    signal.signal(signal.SIGTERM, on_sigterm)
    import psutil
    record = {
        "rank": rank, "pid": os.getpid(), "ppid": os.getppid(),
        "plain": state["plain"].pid, "detached": state["detached"].pid,
        "descendants": [p.pid for p in psutil.Process().children(recursive=True)],
    }
    write_atomic(os.path.join(outdir, f"rank.{rank}.json"), json.dumps(record))
    return os.getpid()


def pid():
    return os.getpid()
