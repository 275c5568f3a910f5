"""What each rank runs in the process-tree tests (imported by reference from
tree_parent.py): start grandchildren of every kind a training job has, record every pid,
then keep busy until a signal or the death of the launching process ends it."""
import json
import os
import signal
import subprocess
import time


class SlowRange:
    """A map-style dataset slow enough that its DataLoader never runs dry."""

    def __len__(self):
        return 10**6

    def __getitem__(self, i):
        time.sleep(0.05)
        return i


def write_atomic(path, text):
    # Readers poll for the file: it must never be seen half-written.
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def hold(outdir, dataloader=True):
    """With dataloader=False a plain multiprocessing child stands in for the DataLoader
    workers, and the rank never imports torch."""
    rank = int(os.environ["RANK"])
    me = os.getpid()
    plain = subprocess.Popen(["sleep", "120"])
    detached = subprocess.Popen(["sleep", "120"], start_new_session=True)
    if dataloader:
        from torch.utils.data import DataLoader
        batches = iter(DataLoader(SlowRange(), batch_size=None, num_workers=2))
        next(batches)
    else:
        import multiprocessing
        child = multiprocessing.get_context("fork").Process(target=time.sleep, args=(120,))
        child.start()
        batches = None

    def on_signal(signo, _frame):
        # Anything the rank forks from now on inherits this handler; only the rank
        # itself may claim to have received the forwarded signal.
        if os.getpid() == me:
            write_atomic(os.path.join(outdir, f"signal.{rank}"), f"{signo} {me}")
        os._exit(128 + signo)

    for signo in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signo, on_signal)

    import psutil
    record = {
        "rank": rank, "pid": me, "ppid": os.getppid(), "pgid": os.getpgid(0),
        "plain": plain.pid, "detached": detached.pid,
        "descendants": [p.pid for p in psutil.Process().children(recursive=True)],
    }
    write_atomic(os.path.join(outdir, f"rank.{rank}.json"), json.dumps(record))
    while True:
        if batches is not None:
            next(batches)
        else:
            time.sleep(0.05)


def recorded_pids(outdir):
    """Every pid the ranks recorded: the ranks and all of their descendants."""
    pids = []
    for name in sorted(os.listdir(outdir)):
        if name.startswith("rank.") and name.endswith(".json"):
            with open(os.path.join(outdir, name)) as f:
                rec = json.load(f)
            pids += [rec["pid"], *rec["descendants"]]
    return pids


def is_running(pid):
    """True while `pid` exists and is not a zombie (a zombie has already died)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")
