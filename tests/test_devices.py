"""gpus= and cpus=: the mapping from the launching process's GPUs and CPUs to each rank's,
with made-up machines (environments, driver lists, sysfs trees). No GPU is needed: the
mapping is decided before any process starts, without CUDA."""
import pytest

from mplaunch._engine import devices as dv
from mplaunch._engine.devices import Gpu

pytestmark = pytest.mark.no_torch

FOUR = [Gpu(0, "GPU-aaaa", "0000:1a:00.0"), Gpu(1, "GPU-bbbb", "0000:3b:00.0"),
        Gpu(2, "GPU-cccc", "0000:88:00.0", mig=("MIG-c1", "MIG-c2")),
        Gpu(3, "GPU-dddd", "0000:af:00.0")]


def no_driver():
    return None


def four():
    return FOUR


# -- the visible list --------------------------------------------------------------------

def test_without_cuda_visible_devices_every_driver_gpu_is_visible_by_index():
    assert dv.visible_gpus({}, FOUR) == ["0", "1", "2", "3"]
    assert dv.visible_gpus({}, None) == []


def test_entries_are_kept_as_written_indices_uuids_and_mig_ids():
    env = {"CUDA_VISIBLE_DEVICES": "3, GPU-bbbb,MIG-c2"}
    assert dv.visible_gpus(env, FOUR) == ["3", "GPU-bbbb", "MIG-c2"]


def test_the_list_ends_at_the_first_entry_that_names_no_device_as_in_cuda():
    assert dv.visible_gpus({"CUDA_VISIBLE_DEVICES": "1,7,2"}, FOUR) == ["1"]
    assert dv.visible_gpus({"CUDA_VISIBLE_DEVICES": "-1"}, FOUR) == []
    assert dv.visible_gpus({"CUDA_VISIBLE_DEVICES": ""}, FOUR) == []
    # No driver list (no NVML, no /proc): the indices cannot be checked, and are kept.
    assert dv.visible_gpus({"CUDA_VISIBLE_DEVICES": "5,6"}, None) == ["5", "6"]


# -- gpus= -------------------------------------------------------------------------------

def test_per_rank_gives_each_rank_the_local_rank_th_entry_of_a_parent_subset():
    env = {"CUDA_VISIBLE_DEVICES": "2,3"}
    p = dv.place(2, "per-rank", None, None, env, [0], driver=four)
    assert p.gpus == ("2", "3")        # not "0" and "1": the old recipe's mistake


def test_per_rank_keeps_uuids_and_mig_ids():
    env = {"CUDA_VISIBLE_DEVICES": "GPU-dddd,MIG-c1"}
    assert dv.place(2, "per-rank", None, None, env, [0], driver=four).gpus == (
        "GPU-dddd", "MIG-c1")


def test_per_rank_without_cuda_visible_devices_uses_every_driver_gpu():
    assert dv.place(3, "per-rank", None, None, {}, [0], driver=four).gpus == ("0", "1", "2")


def test_a_list_picks_entries_of_the_visible_list_in_order():
    env = {"CUDA_VISIBLE_DEVICES": "GPU-aaaa,GPU-bbbb,GPU-cccc"}
    assert dv.place(2, [2, 0], None, None, env, [0], driver=four).gpus == (
        "GPU-cccc", "GPU-aaaa")


def test_more_ranks_than_gpus_is_refused_with_the_counts():
    env = {"CUDA_VISIBLE_DEVICES": "2,3"}
    with pytest.raises(ValueError, match=r"3 ranks, but this process sees 2 GPUs "
                                         r"\(CUDA_VISIBLE_DEVICES='2,3'\)"):
        dv.place(3, "per-rank", None, None, env, [0], driver=four)
    with pytest.raises(ValueError, match="position 2 is past the end"):
        dv.place(2, [2, 0], None, None, env, [0], driver=four)
    with pytest.raises(ValueError, match=r"backend='nccl'.*5 ranks, but this process "
                                         r"sees 4 GPUs \(as the driver lists them\)"):
        dv.place(5, None, None, "nccl", {}, [0], driver=four)
    with pytest.raises(ValueError, match="no GPU is visible .* to run the 2 ranks on CPU"):
        dv.place(2, None, None, "cpu:gloo,cuda:nccl", {}, [0], driver=no_driver)


def test_no_visible_gpu_names_gloo_not_a_smaller_nprocs():
    # "use nprocs=0 or fewer" sent readers to a value that is refused too.
    cases = [((2, None, None, "nccl"), "use backend='gloo'"),
             ((2, "per-rank", None, None), "use backend='gloo' and leave gpus out"),
             ((2, (1, 0), None, "nccl"), "use backend='gloo' and leave gpus out")]
    for args, advice in cases:
        for env, shown in (({}, "process; "),
                           ({"CUDA_VISIBLE_DEVICES": ""}, "(CUDA_VISIBLE_DEVICES='')")):
            with pytest.raises(ValueError) as info:
                dv.place(*args, env, [0], driver=no_driver)
            msg = str(info.value)
            assert "no GPU is visible to this process" in msg and shown in msg
            assert msg.endswith(advice) and "nprocs=0" not in msg


def test_without_nvml_or_proc_the_environment_is_the_count():
    env = {"CUDA_VISIBLE_DEVICES": "0,1"}
    assert dv.place(2, None, None, "nccl", env, [0], driver=no_driver).gpus is None
    assert dv.place(2, "per-rank", None, None, env, [0], driver=no_driver).gpus == ("0", "1")


def test_the_driver_is_not_asked_when_gpus_do_not_matter():
    def fail():
        raise AssertionError("driver read")
    assert dv.place(2, None, None, "gloo", {}, [0, 1], driver=fail) == dv.Placement()


def test_uses_cuda():
    assert dv.uses_cuda("nccl") and dv.uses_cuda("cpu:gloo,cuda:nccl")
    assert dv.uses_cuda("cuda:gloo")
    assert not dv.uses_cuda("gloo") and not dv.uses_cuda(None) and not dv.uses_cuda("mpi")


def test_proc_fallback_lists_gpus_by_bus_id(tmp_path):
    base = tmp_path / "driver" / "nvidia" / "gpus"
    for bus, uuid in (("0000:3b:00.0", "GPU-bbbb"), ("0000:1a:00.0", "GPU-aaaa")):
        (base / bus).mkdir(parents=True)
        (base / bus / "information").write_text(f"Model: X\nGPU UUID: \t {uuid}\n")
    assert dv._proc_gpus(str(tmp_path)) == [Gpu(0, "GPU-aaaa", "0000:1a:00.0"),
                                            Gpu(1, "GPU-bbbb", "0000:3b:00.0")]
    assert dv._proc_gpus(str(tmp_path / "nothing")) is None


def test_bus_ids_and_entries_name_the_driver_gpu():
    assert dv.normalize_bus_id("00000000:3B:00.0") == "0000:3b:00.0"
    assert dv.gpu_of("1", FOUR).uuid == "GPU-bbbb"
    assert dv.gpu_of("GPU-dd", FOUR).index == 3            # a prefix, as CUDA takes
    assert dv.gpu_of("MIG-c2", FOUR).index == 2
    assert dv.gpu_of("MIG-GPU-cccc/1/0", FOUR).index == 2  # the older MIG form
    assert dv.gpu_of("GPU-zzzz", FOUR) is None


def test_nvml_absent_reads_as_no_driver_list(monkeypatch):
    def no_library(*a, **k):
        raise OSError("libnvidia-ml.so.1: cannot open shared object file")
    monkeypatch.setattr(dv.ctypes, "CDLL", no_library)
    assert dv._nvml_gpus() is None


# -- cpus= -------------------------------------------------------------------------------

def sysfs(tmp_path, nodes, gpu_nodes=None):
    for n, cpulist in nodes.items():
        d = tmp_path / "devices" / "system" / "node" / f"node{n}"
        d.mkdir(parents=True)
        (d / "cpulist").write_text(cpulist + "\n")
    for bus, node in (gpu_nodes or {}).items():
        d = tmp_path / "bus" / "pci" / "devices" / bus
        d.mkdir(parents=True)
        (d / "numa_node").write_text(f"{node}\n")
    return str(tmp_path)


def test_cpulist_format_both_ways():
    assert dv.parse_cpulist("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    assert dv.parse_cpulist("") == []
    assert dv.format_cpus([11, 0, 1, 2, 3, 8, 10]) == "0-3,8,10-11"


def test_one_node_splits_the_allowed_cpus_into_disjoint_slices(tmp_path):
    root = sysfs(tmp_path, {0: "0-7"})
    p = dv.place(3, None, "per-rank", None, {}, [1, 2, 3, 4, 5, 6, 7], sysfs_root=root)
    assert p.cpus == ((1, 2, 3), (4, 5), (6, 7))


def test_several_nodes_keep_each_rank_within_one(tmp_path):
    root = sysfs(tmp_path, {0: "0-3", 1: "4-7"})
    p = dv.place(4, None, "per-rank", None, {}, range(8), sysfs_root=root)
    assert p.cpus == ((0, 1), (2, 3), (4, 5), (6, 7))
    # 3 ranks on 2 nodes of 4: no slice spans both nodes.
    p = dv.place(3, None, "per-rank", None, {}, range(8), sysfs_root=root)
    assert all(set(s) <= {0, 1, 2, 3} or set(s) <= {4, 5, 6, 7} for s in p.cpus)
    assert sorted(c for s in p.cpus for c in s) == list(range(8))


def test_only_the_allowed_cpus_of_each_node_are_given(tmp_path):
    root = sysfs(tmp_path, {0: "0-3", 1: "4-7", 2: ""})  # node 2: memory only
    p = dv.place(2, None, "per-rank", None, {}, [2, 3, 6, 7], sysfs_root=root)
    assert p.cpus == ((2, 3), (6, 7))


def test_a_rank_with_one_gpu_gets_cpus_of_its_gpus_node(tmp_path):
    root = sysfs(tmp_path, {0: "0-3", 1: "4-7"},
                 {"0000:1a:00.0": 0, "0000:3b:00.0": 1, "0000:88:00.0": 1})
    env = {"CUDA_VISIBLE_DEVICES": "GPU-bbbb,GPU-aaaa"}
    p = dv.place(2, "per-rank", "per-rank", None, env, range(8), sysfs_root=root,
                 driver=four)
    assert p.gpus == ("GPU-bbbb", "GPU-aaaa")
    assert p.cpus == ((4, 5, 6, 7), (0, 1, 2, 3))
    # Two ranks whose GPUs are both on node 1 share its CPUs.
    p = dv.place(2, [1, 2], "per-rank", None, {}, range(8), sysfs_root=root, driver=four)
    assert p.cpus == ((4, 5), (6, 7))


def test_a_cuda_backend_places_rank_i_near_visible_gpu_i(tmp_path):
    # No gpus=, but NCCL puts rank LOCAL_RANK on visible GPU LOCAL_RANK: its node's CPUs
    # (torchrun's --numa-binding binds by the same GPU).
    root = sysfs(tmp_path, {0: "0-3", 1: "4-7"}, {"0000:1a:00.0": 1, "0000:3b:00.0": 0})
    p = dv.place(2, None, "per-rank", "nccl", {}, range(8), sysfs_root=root, driver=four)
    assert p.gpus is None and p.cpus == ((4, 5, 6, 7), (0, 1, 2, 3))


def test_unknown_gpu_nodes_fall_back_to_nodes_in_proportion(tmp_path):
    root = sysfs(tmp_path, {0: "0-3", 1: "4-7"}, {"0000:1a:00.0": -1})
    p = dv.place(2, [0, 1], "per-rank", None, {}, range(8), sysfs_root=root, driver=four)
    assert p.cpus == ((0, 1, 2, 3), (4, 5, 6, 7))


def test_no_numa_information_splits_flat(tmp_path):
    p = dv.place(2, None, "per-rank", None, {}, [0, 1, 2], sysfs_root=str(tmp_path))
    assert p.cpus == ((0, 1), (2,))


def test_more_ranks_than_cpus_is_refused_with_the_counts(tmp_path):
    with pytest.raises(ValueError, match=r"3 ranks, but this process may run on 2 CPUs"):
        dv.place(3, None, "per-rank", None, {}, [0, 1], sysfs_root=str(tmp_path))


def test_counting_gpus_imports_no_torch_so_cuda_cannot_be_initialised():
    import subprocess
    import sys
    code = ("import sys, mplaunch\n"
            "from mplaunch._engine.config import gpu_count, auto_nprocs\n"
            "gpu_count(); auto_nprocs()\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_a_ranks_device_is_0_when_it_sees_one_gpu_else_local_rank():
    from mplaunch._rank.procgroup import local_device
    assert local_device({"LOCAL_RANK": "3", "CUDA_VISIBLE_DEVICES": "GPU-aaaa"}) == 0
    assert local_device({"LOCAL_RANK": "1", "CUDA_VISIBLE_DEVICES": "4,5"}) == 1
    assert local_device({"LOCAL_RANK": "2"}) == 2


class FakeNvml:
    """libnvidia-ml.so.1 as ctypes sees it, for two GPUs, the second with a MIG device:
    each call fills its byref arguments and returns NVML_SUCCESS (0)."""
    GPUS = [("GPU-1111", b"00000000:3B:00.0", []), ("GPU-2222", b"00000000:AF:00.0",
                                                     ["MIG-9999"])]

    def __init__(self):
        self.shut = False

    def nvmlInit_v2(self):
        return 0

    def nvmlShutdown(self):
        self.shut = True
        return 0

    def nvmlDeviceGetCount_v2(self, count):
        count._obj.value = len(self.GPUS)
        return 0

    def nvmlDeviceGetHandleByIndex_v2(self, index, handle):
        handle._obj.value = 100 + index.value
        return 0

    def nvmlDeviceGetUUID(self, handle, buf, size):
        h = handle.value
        uuid = self.GPUS[h - 100][0] if h < 200 else self.GPUS[(h - 200) // 10][2][0]
        buf.value = uuid.encode()
        return 0

    def nvmlDeviceGetPciInfo_v3(self, handle, pci):
        pci._obj.busId = self.GPUS[handle.value - 100][1]
        return 0

    def nvmlDeviceGetMaxMigDeviceCount(self, handle, most):
        most._obj.value = len(self.GPUS[handle.value - 100][2])
        return 0

    def nvmlDeviceGetMigDeviceHandleByIndex(self, handle, j, mig):
        mig._obj.value = 200 + (handle.value - 100) * 10 + j.value
        return 0


def test_nvml_lists_gpus_bus_ids_and_mig_devices(monkeypatch):
    fake = FakeNvml()
    monkeypatch.setattr(dv.ctypes, "CDLL", lambda name: fake)
    assert dv._nvml_gpus() == [Gpu(0, "GPU-1111", "0000:3b:00.0"),
                               Gpu(1, "GPU-2222", "0000:af:00.0", ("MIG-9999",))]
    assert fake.shut


# -- GPU memory given back before close() returns (gpumem) -------------------------------

def test_the_wait_for_gpu_memory_ends_when_each_gpu_is_back_or_at_its_bound():
    from mplaunch._engine import gpumem
    held = {0: (10 << 30, 8 << 30), 3: (4 << 30, 1 << 30)}   # used before, the ranks' part
    reads = iter([{0: 10 << 30, 3: 4 << 30}, {0: 2 << 30, 3: 4 << 30},
                  {0: 2 << 30, 3: (3 << 30) + (1 << 20)}])
    asked = []

    def used(indices):
        asked.append(sorted(indices))
        return next(reads)
    assert gpumem.wait_given_back(held, used=used, sleep=lambda s: None)
    assert asked == [[0, 3]] * 3          # read until both GPUs are back, then no more
    # Never back: False at the bound, not a hang.
    assert not gpumem.wait_given_back(held, timeout=0.05, used=lambda i: {0: 10 << 30})
    # Nothing held, or NVML unreadable: at once.
    assert gpumem.wait_given_back({}, used=lambda i: 1 / 0)
    assert gpumem.wait_given_back(held, used=lambda i: {})


def test_a_machine_without_nvml_reads_nothing_and_is_asked_once():
    import time

    from mplaunch._engine import gpumem
    if gpumem._library() is not None:
        pytest.skip("this machine has NVML: tests/test_gpu_runs.py checks it")
    t0 = time.perf_counter()
    for _ in range(1000):
        assert gpumem.snapshot([1, 2]) == {}
    assert time.perf_counter() - t0 < 0.5    # cached: no library lookup per close
