"""Which GPUs and CPUs each rank gets (``gpus=``, ``cpus=``), decided in the launching
process before any process starts.

The launching process must stay able to fork (start_method="fork", and a forkserver
started later), so nothing here initialises CUDA: GPUs are counted and identified through
NVML (libnvidia-ml.so.1, loaded with ctypes, as ``nvidia-smi`` does), else the driver's
/proc/driver/nvidia/gpus, and a rank's GPU is given to it as ``CUDA_VISIBLE_DEVICES``.
Everything below the readers is a pure function of its arguments (an environment, a
list of GPUs, a sysfs root), so that it is tested with made-up machines.
"""
from __future__ import annotations

import ctypes
import glob
import os
from dataclasses import dataclass
from typing import Dict, FrozenSet, List, Mapping, Optional, Sequence, Tuple

from .._wire.spec import uses_cuda

PER_RANK = "per-rank"


@dataclass(frozen=True)
class Gpu:
    """A GPU as the driver lists it (NVML's order: by PCI bus id)."""
    index: int
    uuid: str = ""                 # "GPU-..."
    bus_id: str = ""               # sysfs form, "0000:3b:00.0"; "" when unknown
    mig: Tuple[str, ...] = ()      # the "MIG-..." UUIDs of its MIG devices


# -- reading the machine ---------------------------------------------------------------

def driver_gpus(proc_root: str = "/proc") -> Optional[List[Gpu]]:
    """The driver's GPUs, from NVML, else from /proc; None when neither answers (no
    NVIDIA driver here)."""
    gpus = _nvml_gpus()
    return gpus if gpus is not None else _proc_gpus(proc_root)


class _PciInfo(ctypes.Structure):
    _fields_ = [("busIdLegacy", ctypes.c_char * 16), ("domain", ctypes.c_uint),
                ("bus", ctypes.c_uint), ("device", ctypes.c_uint),
                ("pciDeviceId", ctypes.c_uint), ("pciSubSystemId", ctypes.c_uint),
                ("busId", ctypes.c_char * 32)]


def _nvml_gpus() -> Optional[List[Gpu]]:
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return None
    if nvml.nvmlInit_v2() != 0:
        return None
    try:
        count = ctypes.c_uint()
        if nvml.nvmlDeviceGetCount_v2(ctypes.byref(count)) != 0:
            return None
        return [_nvml_gpu(nvml, i) for i in range(count.value)]
    except (AttributeError, OSError):   # an NVML too old for one of these calls
        return None
    finally:
        nvml.nvmlShutdown()


def _nvml_gpu(nvml, index: int) -> Gpu:
    handle = ctypes.c_void_p()
    if nvml.nvmlDeviceGetHandleByIndex_v2(ctypes.c_uint(index), ctypes.byref(handle)):
        return Gpu(index)
    uuid = _nvml_uuid(nvml, handle)
    pci = _PciInfo()
    bus_id = ""
    if nvml.nvmlDeviceGetPciInfo_v3(handle, ctypes.byref(pci)) == 0:
        bus_id = normalize_bus_id(pci.busId.decode(errors="replace"))
    migs = []
    most = ctypes.c_uint()
    if nvml.nvmlDeviceGetMaxMigDeviceCount(handle, ctypes.byref(most)) == 0:
        for j in range(most.value):
            mig = ctypes.c_void_p()
            if nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, ctypes.c_uint(j),
                                                        ctypes.byref(mig)) == 0:
                migs.append(_nvml_uuid(nvml, mig))
    return Gpu(index, uuid, bus_id, tuple(m for m in migs if m))


def _nvml_uuid(nvml, handle) -> str:
    buf = ctypes.create_string_buffer(96)
    if nvml.nvmlDeviceGetUUID(handle, buf, ctypes.c_uint(96)) != 0:
        return ""
    return buf.value.decode(errors="replace")


def _proc_gpus(proc_root: str) -> Optional[List[Gpu]]:
    base = os.path.join(proc_root, "driver", "nvidia", "gpus")
    try:
        bus_ids = sorted(os.listdir(base))
    except OSError:
        return None
    gpus = []
    for i, bus_id in enumerate(bus_ids):
        uuid = ""
        try:
            with open(os.path.join(base, bus_id, "information")) as f:
                for line in f:
                    key, _, value = line.partition(":")
                    if key.strip() == "GPU UUID":
                        uuid = value.strip()
        except OSError:
            pass
        gpus.append(Gpu(i, uuid, normalize_bus_id(bus_id)))
    return gpus


def normalize_bus_id(bus_id: str) -> str:
    """NVML's "00000000:3B:00.0" as sysfs spells it, "0000:3b:00.0"."""
    domain, sep, rest = bus_id.strip().partition(":")
    if not sep:
        return bus_id.strip().lower()
    try:
        return f"{int(domain, 16):04x}:{rest.lower()}"
    except ValueError:
        return bus_id.strip().lower()


def numa_nodes(sysfs_root: str = "/sys") -> Dict[int, FrozenSet[int]]:
    """{node: its CPUs} from sysfs; {} where the kernel shows no NUMA nodes."""
    nodes = {}
    for path in glob.glob(os.path.join(sysfs_root, "devices", "system", "node",
                                       "node[0-9]*", "cpulist")):
        name = os.path.basename(os.path.dirname(path))
        try:
            with open(path) as f:
                nodes[int(name[4:])] = frozenset(parse_cpulist(f.read()))
        except (OSError, ValueError):
            continue
    return nodes


def gpu_numa_node(gpu: Optional[Gpu], sysfs_root: str = "/sys") -> Optional[int]:
    """The NUMA node the GPU's PCI device hangs off; None when unknown (-1 in sysfs
    means the firmware did not say)."""
    if gpu is None or not gpu.bus_id:
        return None
    try:
        with open(os.path.join(sysfs_root, "bus", "pci", "devices", gpu.bus_id,
                               "numa_node")) as f:
            node = int(f.read().strip())
    except (OSError, ValueError):
        return None
    return node if node >= 0 else None


def parse_cpulist(text: str) -> List[int]:
    """"0-3,8,10-11" (the kernel's list format) as [0, 1, 2, 3, 8, 10, 11]."""
    cpus: List[int] = []
    for part in text.strip().split(","):
        part = part.strip()
        if not part:
            continue
        low, sep, high = part.partition("-")
        cpus.extend(range(int(low), int(high) + 1) if sep else [int(low)])
    return cpus


# -- GPUs ------------------------------------------------------------------------------

def visible_gpus(environ: Mapping[str, str], driver: Optional[Sequence[Gpu]]) -> List[str]:
    """The GPUs a process with this environment sees, as CUDA_VISIBLE_DEVICES entries
    kept as written (indices, GPU-... UUIDs, MIG-... ids); without the variable, every
    GPU the driver lists, by index. As CUDA does, the list ends at the first entry that
    names no device."""
    value = environ.get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return [str(g.index) for g in driver or ()]
    entries = []
    for entry in value.split(","):
        entry = entry.strip()
        if entry.startswith(("GPU-", "MIG-")):
            entries.append(entry)
            continue
        try:
            index = int(entry)
        except ValueError:
            break
        if index < 0 or (driver is not None and index >= len(driver)):
            break
        entries.append(entry)
    return entries


def describe_visible(environ: Mapping[str, str], visible: Sequence[str]) -> str:
    """"2 GPUs (CUDA_VISIBLE_DEVICES=2,3)", for messages."""
    n = len(visible)
    where = (f"CUDA_VISIBLE_DEVICES={environ['CUDA_VISIBLE_DEVICES']!r}"
             if "CUDA_VISIBLE_DEVICES" in environ else "as the driver lists them")
    return f"{n} GPU{'s' if n != 1 else ''} ({where})"


def no_gpu_message(what: str, nprocs: int, environ: Mapping[str, str], instead: str) -> str:
    """The refusal for GPU placement where no GPU is visible at all: "use nprocs=0 or
    fewer" would send the reader to a value that is refused too, so name the CPU way."""
    why = (f" (CUDA_VISIBLE_DEVICES={environ['CUDA_VISIBLE_DEVICES']!r})"
           if "CUDA_VISIBLE_DEVICES" in environ else "")
    return (f"{what}, but no GPU is visible to this process{why}; to run the {nprocs} "
            f"rank{'s' if nprocs != 1 else ''} on CPU, {instead}")


_LEAVE_GPUS_OUT = "use backend='gloo' and leave gpus out"


def rank_gpus(gpus, nprocs: int, visible: Sequence[str], seen: str,
              environ: Mapping[str, str]) -> Optional[List[str]]:
    """Each local rank's CUDA_VISIBLE_DEVICES under ``gpus=`` (None: leave it as it is).
    `seen` describes `visible` for the messages. Raises ValueError when the ranks
    outnumber the GPUs."""
    if gpus is None:
        return None
    if gpus == PER_RANK:
        if not visible:
            raise ValueError(no_gpu_message("gpus='per-rank' gives each rank a GPU of its "
                                            "own", nprocs, environ, _LEAVE_GPUS_OUT))
        if nprocs > len(visible):
            raise ValueError(f"gpus='per-rank' gives each rank a GPU of its own: {nprocs} "
                             f"ranks, but this process sees {seen}; use nprocs="
                             f"{len(visible)} or fewer, or gpus=None to share them")
        return list(visible[:nprocs])
    if len(gpus) != nprocs:
        raise ValueError(f"gpus={list(gpus)} names {len(gpus)} GPUs, one per rank, but "
                         f"nprocs={nprocs}; leave nprocs out (it defaults to len(gpus))")
    if not visible:
        raise ValueError(no_gpu_message(f"gpus={list(gpus)} puts each rank on a GPU",
                                        nprocs, environ, _LEAVE_GPUS_OUT))
    past = [i for i in gpus if i >= len(visible)]
    if past:
        raise ValueError(f"gpus={list(gpus)}: {nprocs} ranks, but this process sees "
                         f"{seen}, so position {past[0]} is past the end; the entries "
                         f"are positions 0-{len(visible) - 1} in the visible list")
    return [visible[i] for i in gpus]


def gpu_of(entry: str, driver: Optional[Sequence[Gpu]]) -> Optional[Gpu]:
    """The driver's GPU a CUDA_VISIBLE_DEVICES entry names (a MIG device: the GPU it is
    part of). An index is taken in the driver's order, which is CUDA's when
    CUDA_DEVICE_ORDER=PCI_BUS_ID or the GPUs are alike."""
    for gpu in driver or ():
        if entry.isdigit() and gpu.index == int(entry):
            return gpu
        if gpu.uuid and entry.startswith("GPU-") and gpu.uuid.startswith(entry):
            return gpu
        if entry.startswith("MIG-") and (entry in gpu.mig or (
                gpu.uuid and entry[4:].split("/")[0] == gpu.uuid)):
            return gpu
    return None


# -- CPUs ------------------------------------------------------------------------------

def cpu_slices(allowed: Sequence[int], nodes: Mapping[int, FrozenSet[int]], nprocs: int,
               rank_nodes: Optional[Sequence[Optional[int]]] = None
               ) -> List[Tuple[int, ...]]:
    """`allowed` split into `nprocs` disjoint slices, one per rank: each within one NUMA
    node when there are several (a rank's own node in `rank_nodes`, its GPU's, where
    known for every rank and that node has a CPU for each of its ranks; else nodes in
    proportion to their CPUs). Raises ValueError for fewer CPUs than ranks."""
    cpus = sorted(set(allowed))
    if nprocs > len(cpus):
        raise ValueError(f"cpus='per-rank' gives each rank CPUs of its own: {nprocs} ranks, "
                         f"but this process may run on {len(cpus)} CPUs "
                         f"(os.sched_getaffinity); use nprocs={len(cpus)} or fewer, or "
                         f"cpus=None")
    by_node = {n: sorted(set(c) & set(cpus)) for n, c in sorted(nodes.items())}
    by_node = {n: c for n, c in by_node.items() if c}
    if len(by_node) <= 1 or sum(map(len, by_node.values())) != len(cpus):
        return _split(cpus, nprocs)   # one node, or a sysfs that does not add up
    order = _ranks_by_own_node(by_node, rank_nodes, nprocs)
    if order is None:
        order = _ranks_in_proportion(by_node, nprocs)
    slices: List[Tuple[int, ...]] = [()] * nprocs
    for node, ranks in order.items():
        for rank, part in zip(ranks, _split(by_node[node], len(ranks))):
            slices[rank] = part
    return slices


def _ranks_by_own_node(by_node, rank_nodes, nprocs) -> Optional[Dict[int, List[int]]]:
    if rank_nodes is None or len(rank_nodes) != nprocs:
        return None
    order: Dict[int, List[int]] = {}
    for rank, node in enumerate(rank_nodes):
        if node not in by_node:
            return None
        order.setdefault(node, []).append(rank)
    if any(len(ranks) > len(by_node[n]) for n, ranks in order.items()):
        return None
    return order


def _ranks_in_proportion(by_node, nprocs) -> Dict[int, List[int]]:
    total = sum(map(len, by_node.values()))
    shares = {n: nprocs * len(c) / total for n, c in by_node.items()}
    counts = {n: int(s) for n, s in shares.items()}
    # Largest remainders first; floor(share) + 1 never exceeds a node's CPUs.
    for n in sorted(shares, key=lambda n: (counts[n] - shares[n], n))[:nprocs - sum(
            counts.values())]:
        counts[n] += 1
    order, rank = {}, 0
    for n in by_node:
        order[n] = list(range(rank, rank + counts[n]))
        rank += counts[n]
    return order


def _split(cpus: Sequence[int], k: int) -> List[Tuple[int, ...]]:
    """Contiguous slices of sizes differing by at most one, the larger first."""
    size, extra = divmod(len(cpus), k)
    out, start = [], 0
    for i in range(k):
        end = start + size + (1 if i < extra else 0)
        out.append(tuple(cpus[start:end]))
        start = end
    return out


def format_cpus(cpus: Sequence[int]) -> str:
    """[0, 1, 2, 3, 8] as "0-3,8" (the kernel's list format)."""
    parts, run = [], []
    for c in sorted(cpus):
        if run and c == run[-1] + 1:
            run.append(c)
            continue
        if run:
            parts.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [c]
    if run:
        parts.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(parts)


# -- one launch's placement ------------------------------------------------------------

@dataclass(frozen=True)
class Placement:
    """Each local rank's CUDA_VISIBLE_DEVICES and CPUs (None: left as inherited)."""
    gpus: Optional[Tuple[str, ...]] = None
    cpus: Optional[Tuple[Tuple[int, ...], ...]] = None


def place(nprocs: int, gpus, cpus, backend: Optional[str], environ: Mapping[str, str],
          allowed: Sequence[int], sysfs_root: str = "/sys",
          driver=None) -> Placement:
    """The placement of one node's ranks; `driver` is called (once) only when GPUs
    matter (default: driver_gpus, looked up when called). Raises ValueError, with the counts, for more ranks than GPUs (gpus= given,
    or a CUDA backend) or than CPUs (cpus="per-rank")."""
    listed: Optional[Sequence[Gpu]] = None
    per_rank: Optional[List[str]] = None
    own: Optional[Sequence[str]] = None   # each rank's GPU, where mplaunch knows it
    if gpus is not None or uses_cuda(backend):
        listed = (driver or driver_gpus)()
        visible = visible_gpus(environ, listed)
        seen = describe_visible(environ, visible)
        per_rank = rank_gpus(gpus, nprocs, visible, seen, environ)
        if per_rank is None and not visible:
            raise ValueError(no_gpu_message(f"backend={backend!r} puts each rank on a GPU of "
                                            f"its own", nprocs, environ,
                                            "use backend='gloo'"))
        if per_rank is None and nprocs > len(visible):
            raise ValueError(f"backend={backend!r} puts each rank on a GPU of its own: "
                             f"{nprocs} ranks, but this process sees {seen}; use nprocs="
                             f"{len(visible)} or fewer, or a CPU backend such as 'gloo'")
        # A CUDA backend puts rank LOCAL_RANK on visible device LOCAL_RANK.
        own = per_rank if per_rank is not None else visible[:nprocs]
    slices = None
    if cpus is not None:
        rank_nodes = None
        if own is not None:
            rank_nodes = [gpu_numa_node(gpu_of(e, listed), sysfs_root) for e in own]
        slices = tuple(cpu_slices(allowed, numa_nodes(sysfs_root), nprocs, rank_nodes))
    return Placement(tuple(per_rank) if per_rank is not None else None, slices)

