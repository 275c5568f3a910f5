"""A World across two nodes, per scheduler; on SLURM, beside srun's one-shot launchers.

    python bench/nodes.py                      # SLURM, about 2-3 minutes on 2 cores
    python bench/nodes.py --quick              # fewer repeats
    python bench/nodes.py --scheduler local    # the tests' stand-in scheduler, no SLURM
    python bench/nodes.py --scheduler slurm,ray,local   # side by side, SLURM the base
    python bench/nodes.py --json out.json

The cases and the report are bench/_nodes_cases.py's, the same for every scheduler (its
docstring says what is measured); this file is SLURM's part. With ``--scheduler slurm``
(the default where slurm-wlm and munge are installed, else ``local``) it starts the
two-node cluster of ``tests/slurm_cluster.py`` (nodes n1 and n2, both this machine,
loopback) and measures inside ``salloc -N2``, where the World's baselines are the
one-shot batch ways: ``srun -N2 -n2 python -m mplaunch --nprocs 2 script.py`` (a watcher
per node) and ``srun -N2 -n2 python -m torch.distributed.run --nnodes 2
--nproc-per-node 2 --rdzv-backend c10d script.py``; for those, "first" is when rank 0 has
its ``all_reduce`` result (it writes the time to a file), "returned" when srun returns.

Optionally (``--ipyparallel``), ipyparallel's Slurm engines: an ``ipp.Cluster`` with
``engines="slurm"`` (sbatch of 4 engines) until 4 engines have joined a gloo group and
done an ``all_reduce``; ipyparallel must be importable (``pip install ipyparallel``), or
installed apart with ``pip install --target DIR ipyparallel`` and given as
``--ipyparallel DIR``. It runs once, after the rest, outside the allocation.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import _nodes_cases as cases

NODES_PY = os.path.abspath(__file__)

# What the one-shot launchers run on each rank.
SCRIPT = """\
import os, sys, time
import torch
import torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
assert t.item() == dist.get_world_size() == 4, t
if dist.get_rank() == 0:
    with open(sys.argv[1] + ".tmp", "w") as f:
        f.write(repr(time.time()))
    os.replace(sys.argv[1] + ".tmp", sys.argv[1])
dist.destroy_process_group()
"""

SRUN = ["srun", "-N2", "-n2", "--ntasks-per-node=1"]


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _one_shot(argv, workdir):
    stamp = os.path.join(workdir, "stamp")
    if os.path.exists(stamp):
        os.unlink(stamp)
    t0 = time.time()
    proc = subprocess.run(argv + [os.path.join(workdir, "script.py"), stamp], cwd=workdir,
                          stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=180)
    done = time.time() - t0
    if proc.returncode != 0 or not os.path.exists(stamp):
        raise RuntimeError(f"{argv[:8]} failed (rc {proc.returncode}):\n{proc.stdout[-3000:]}")
    return {"first": cases._stamped(workdir) - t0, "exit": done}


def _slurm_cluster():
    sys.path.insert(0, os.path.join(cases.ROOT, "tests"))
    import slurm_cluster
    return slurm_cluster


class Slurm(cases.Setup):
    name = "slurm"
    where = ("nodes n1 and n2 of the test SLURM cluster (tests/slurm_cluster.py), both "
             "this machine (loopback), in an allocation of it (salloc -N2)")
    options = {"master_addr": "127.0.0.1"}

    @staticmethod
    def add_arguments(ap):
        ap.add_argument("--ipyparallel", nargs="?", const="", metavar="DIR",
                        help="with slurm: also time ipyparallel's Slurm engines (needs "
                             "ipyparallel importable, or installed with pip install "
                             "--target DIR)")

    def unavailable(self):
        if not _slurm_cluster().slurm_available():
            return "slurm-wlm or munge is not installed (.ci/install-slurm.sh)"

    def session(self, args, scale):
        """Measured by `nodes.py --inner slurm` inside the allocation."""
        tmp = os.environ["MPLAUNCH_BENCH_TMP"]
        out = os.path.join(tmp, "slurm.json")
        t0 = time.perf_counter()
        with _slurm_cluster().slurm_cluster(os.path.join(tmp, "slurm")) as cluster:
            up = time.perf_counter() - t0
            r = cluster.run(["salloc", "-N2", sys.executable, NODES_PY,
                             *cases.inner_argv(args, self.name, out, scale)],
                            timeout=900, env={"PYTHONPATH": os.environ["PYTHONPATH"]},
                            cwd=tmp, stdout=subprocess.PIPE, stderr=None)
            if r.returncode != 0 or not os.path.exists(out):
                raise RuntimeError(f"the run in the allocation failed (rc {r.returncode}): "
                                   f"{(r.stdout or '')[-2000:]}")
            with open(out) as f:
                fig = json.load(f)
            fig["cluster"] = {"start_s": up}
            if args.ipyparallel is not None:
                cases.log("ipyparallel's Slurm engines:")
                row = ipyparallel_case(cluster, tmp, args.ipyparallel)
                cases.log(f"  {row}")
                fig["start"]["ipyparallel Cluster(engines=slurm), 4 engines; once"] = row
        return fig

    def starts(self, args, workdir):
        with open(os.path.join(workdir, "script.py"), "w") as f:
            f.write(SCRIPT)

        def torchrun():
            port = _free_port()
            return _one_shot(SRUN + [sys.executable, "-m", "torch.distributed.run",
                                     "--nnodes", "2", "--nproc-per-node", "2",
                                     "--rdzv-backend", "c10d",
                                     "--rdzv-endpoint", f"127.0.0.1:{port}",
                                     "--rdzv-id", str(port)], workdir)
        return {
            "srun + python -m mplaunch --nprocs 2 (a watcher per node)":
                lambda: _one_shot(SRUN + [sys.executable, "-m", "mplaunch", "--nprocs", "2",
                                          "--master-addr", "127.0.0.1"], workdir),
            "srun + torchrun --nnodes 2 --nproc-per-node 2 (c10d)": torchrun,
        }

    def versions(self):
        return {"slurm_job": os.environ.get("SLURM_JOB_ID")}


# -- ipyparallel (outside the allocation: its engines come as an sbatch job) -------------

IPP = """\
import json, os, sys, time
t0 = time.time()
import ipyparallel as ipp
port = int(sys.argv[1])
cluster = ipp.Cluster(engines="slurm", n=4, controller_ip="127.0.0.1",
                      profile_dir=sys.argv[2], log_level=40)
rc = cluster.start_and_connect_sync(activate=False)
rc.wait_for_engines(4, timeout=120)
started = time.time() - t0
view = rc[:]
view.scatter("rank", list(range(4)), flatten=True, block=True)
def first(port):
    import os, torch, torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=4)
    t = torch.ones(1); dist.all_reduce(t)
    return (t.item(), os.environ.get("SLURMD_NODENAME"))
res = view.apply_sync(first, port)
first_s = time.time() - t0
cluster.stop_cluster_sync()
print(json.dumps({"engines_s": started, "first": first_s, "exit": time.time() - t0,
                  "result": res}))
"""


def ipyparallel_case(cluster, tmp, extra_path):
    """A start row of its own: {"rounds": [one], "note"} or {"rounds": [], "error"}."""
    code = os.path.join(tmp, "ipp_case.py")
    with open(code, "w") as f:
        f.write(IPP)
    prof = os.path.join(tmp, "ipp-profile")
    os.makedirs(prof, exist_ok=True)
    path = [p for p in (extra_path, os.environ.get("PYTHONPATH")) if p]
    r = cluster.run([sys.executable, code, str(_free_port()), prof], timeout=200, cwd=tmp,
                    env={"PYTHONPATH": os.pathsep.join(path)})
    lines = [line for line in r.stdout.splitlines() if line.startswith("{")]
    if r.returncode or not lines:
        return {"rounds": [], "error": f"rc {r.returncode}: {(r.stdout + r.stderr)[-2000:]}"}
    out = json.loads(lines[-1])
    return {"rounds": [out], "note": f"engines up after {out['engines_s']:.2f} s"}


def main(argv=None):
    default = "slurm" if _slurm_cluster().slurm_available() else "local"
    return cases.main(argv, __doc__, default, full=(3, 50, 3), quick=(2, 20, 2),
                      own={"slurm": Slurm})


if __name__ == "__main__":
    sys.exit(main())
