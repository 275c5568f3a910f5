"""Run by test_slurm_world inside an allocation (`salloc -N2 python kernel_driver.py`):
starts a real Jupyter kernel (ipykernel, this interpreter) as its child, so the kernel
is inside the allocation as one started from a Jupyter server there would be, and runs
a notebook's cells in it with nbclient: `%ranks start 2 --nodes 2` (2 ranks on each
node), then DDP across %%ranks cells, a cell failing in one rank, a cell stopped with
the stop button, and a cell after them that finds the ranks and their names kept.
Prints one JSON line per cell (its id, stdout, stderr and errors) and the job's steps
after chosen cells; ends once the kernel has shut down."""
import asyncio
import json
import os
import re
import shutil
import sys
import tempfile
import time

from jupyter_client.kernelspec import KernelSpecManager
from nbclient import NotebookClient
from nbformat.v4 import new_code_cell, new_notebook
from traitlets.config import Config

from allocation import say, steps, wait_for


CELLS = {
    "start": "%load_ext mplaunch\n%ranks start 2 --nodes 2 --master-addr 127.0.0.1",
    "model": """%%ranks
import os
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
torch.manual_seed(dist.get_rank())     # different on each rank: DDP broadcasts rank 0's
model = DDP(torch.nn.Linear(8, 2))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
initial = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()
print("model on", os.environ["SLURMD_NODENAME"], "rank", dist.get_rank(),
      "of", dist.get_world_size())
""",
    "step": """%%ranks
x = torch.randn(16, 8)                 # each rank its own batch
loss = model(x).pow(2).mean()
opt.zero_grad()
loss.backward()
opt.step()
print("stepped", dist.get_rank())
""",
    "check": """%%ranks
flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
dist.all_gather(gathered, flat)
same = all(torch.equal(g, gathered[0]) for g in gathered)
print("equal", same, "trained", not torch.equal(flat, initial),
      "node", os.environ["SLURMD_NODENAME"], "step", os.environ["SLURM_STEP_ID"])
""",
    "fails": """%%ranks
if dist.get_rank() == 3:
    raise ValueError("rank 3 on " + os.environ["SLURMD_NODENAME"] + " says no")
print("fine", dist.get_rank())
""",
    "interrupt": """%%ranks
import time
with open(os.path.join(os.environ["PIDDIR"], str(dist.get_rank())), "w") as f:
    f.write(str(os.getpid()))
time.sleep(120)
""",
    "after": """%%ranks
print("still", dist.get_rank(), os.getpid(), type(model).__name__)
""",
    "status": "%ranks",
    "stop": "%ranks stop",
}
STEPS_AFTER = ("start", "check", "after", "stop")
FAILING = ("fails", "interrupt")
INTERRUPT_TIMEOUT = 60.0


def plain(lines):
    return re.sub(r"\x1b\[[0-9;]*m", "", "\n".join(lines))


def stream(cell, name):
    return "".join(o["text"] for o in cell.outputs
                   if o["output_type"] == "stream" and o["name"] == name)


async def interrupt_when_started(client, piddir):
    """Every rank's pid, once all 4 wrote it; then the stop button (SIGINT to the
    kernel), also when they never did: the cell must end either way."""
    try:
        deadline = time.monotonic() + INTERRUPT_TIMEOUT
        while len(os.listdir(piddir)) < 4 and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        await asyncio.sleep(0.5)    # into the sleep
        pids = {}
        for name in os.listdir(piddir):
            with open(os.path.join(piddir, name)) as f:
                pids[name] = int(f.read() or 0)
        return pids
    finally:
        await client.km.interrupt_kernel()


def main():
    home = tempfile.mkdtemp(prefix="mpl-kd-")
    try:
        spec_dir = os.path.join(home, "jupyter", "kernels", "python3")
        os.makedirs(spec_dir)
        with open(os.path.join(spec_dir, "kernel.json"), "w") as f:
            json.dump({"argv": [sys.executable, "-m", "ipykernel_launcher", "-f",
                                "{connection_file}"],
                       "display_name": "Python 3 (mplaunch slurm tests)",
                       "language": "python", "interrupt_mode": "signal"}, f)
        os.environ["JUPYTER_PATH"] = os.path.join(home, "jupyter")
        os.environ["JUPYTER_RUNTIME_DIR"] = os.path.join(home, "rt")
        os.environ["IPYTHONDIR"] = os.path.join(home, "ipython")
        assert KernelSpecManager().get_kernel_spec("python3").argv[0] == sys.executable
        config = Config()
        config.KernelManager.transport = "ipc"   # no TCP ports picked in advance
        config.KernelManager.ip = os.path.join(home, "k")
        piddir = os.path.join(home, "pids")
        os.makedirs(piddir)
        os.environ["PIDDIR"] = piddir    # the kernel's, and so the ranks' on each node
        tag = {"tags": ["raises-exception"]}
        nb = new_notebook(cells=[new_code_cell(src, id=name,
                                               metadata=tag if name in FAILING else {})
                                 for name, src in CELLS.items()])
        client = NotebookClient(nb, timeout=150, startup_timeout=90,
                                kernel_name="python3", config=config,
                                resources={"metadata": {"path": os.getcwd()}})

        async def scenario():
            async with client.async_setup_kernel():
                for i, cell in enumerate(nb.cells):
                    if cell.id == "interrupt":
                        # the stop button, once every rank is in the cell
                        waiter = asyncio.ensure_future(interrupt_when_started(client,
                                                                              piddir))
                        try:
                            await client.async_execute_cell(cell, i)
                        finally:
                            if not waiter.done():
                                waiter.cancel()
                        say("interrupted", pids=waiter.result() if waiter.done()
                            and not waiter.cancelled() else None)
                    else:
                        await client.async_execute_cell(cell, i)
                    errors = [plain(o["traceback"]) for o in cell.outputs
                              if o["output_type"] == "error"]
                    say("cell", id=cell.id, stdout=stream(cell, "stdout"),
                        stderr=stream(cell, "stderr"), errors=errors)
                    if cell.id in STEPS_AFTER:
                        if cell.id == "stop":   # squeue hears of a step's end late
                            wait_for(lambda: not steps())
                        say("steps", after=cell.id, steps=steps())

        asyncio.run(scenario())
        say("kernel_done")
    finally:
        shutil.rmtree(home, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
