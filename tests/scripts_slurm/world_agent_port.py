"""Run by test_slurm_world inside an allocation (`salloc -N2 python world_agent_port.py
MODE`): a foreign client connects to the port the World's agents join at (read from the
srun step's environment, MPLAUNCH_WORLD_ADDR, while the World starts) and either sends
junk (MODE=junk) or connects and says nothing (MODE=silent); MODE=none: no
client, for the time a start takes. The World must start and
work all the same, about as fast as without it. Prints one JSON line."""
import json
import os
import socket
import sys
import threading
import time

import psutil

import mplaunch

mode = sys.argv[1]
found = {}


def agent_addr():
    """MPLAUNCH_WORLD_ADDR from the environment of our srun child, once it exists."""
    for child in psutil.Process().children():
        try:
            with open(f"/proc/{child.pid}/environ", "rb") as f:
                for item in f.read().split(b"\0"):
                    if item.startswith(b"MPLAUNCH_WORLD_ADDR="):
                        host, port = item.split(b"=", 1)[1].decode().rsplit(":", 1)
                        return host.strip("[]"), int(port)
        except OSError:
            pass
    return None


def intrude(stop):
    if mode == "none":
        return
    while not stop.is_set():
        addr = agent_addr()
        if addr is None:
            time.sleep(0.002)
            continue
        try:
            s = socket.create_connection(addr, timeout=5)
        except OSError as exc:
            found["refused"] = str(exc)
            return
        found["at"] = time.monotonic()
        if mode == "junk":
            try:
                s.sendall(os.urandom(256))
            except OSError:
                pass
        found["sock"] = s       # held open until the World is up
        return


def all_reduce():
    import torch
    import torch.distributed as dist
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return t.item()


stop = threading.Event()
thread = threading.Thread(target=intrude, args=(stop,), daemon=True)
thread.start()
t0 = time.monotonic()
with mplaunch.World(nprocs=2, nnodes=2, backend="gloo", master_addr="127.0.0.1",
                    timeout=60) as w:
    try:
        w.start()
        started = time.monotonic() - t0
        stop.set()
        thread.join()
        results = w.run(all_reduce)
    finally:
        if "sock" in found:
            found["sock"].close()
print(json.dumps({"check": mode, "connected": "at" in found,
                  "refused": found.get("refused"), "start_seconds": round(started, 2),
                  "results": results}), flush=True)
