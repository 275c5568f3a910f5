"""Large inputs cross once per machine (issue 31), proved in real ranks with the data users
pass (a TensorDataset, an array from np.load, a state dict) and the kernel's own memory
accounting (/proc/PID/smaps_rollup), never by looking at the pickle: every rank maps one
copy, a write stays in its rank, the caller's later changes reach nobody, views send
their own bytes, what cannot be sent is refused before anything starts, and what a rank
keeps lives as long as it keeps it."""
from __future__ import annotations

import gc
import os
import pickle
import sys
import time

import pytest

# Without torch (the other Pythons' no-torch runs: .ci/other-pythons.sh) this module has
# nothing to run, and must not fail to import.
np = pytest.importorskip("numpy")
torch = pytest.importorskip("torch")

import mplaunch  # noqa: E402
from mplaunch._wire import buffers, reducers  # noqa: E402
from mplaunch._wire.payload import dumps_payload  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

from smaps import MiB, rollup  # noqa: E402


def _touch(obj) -> float:
    """Read every byte of the tensors and arrays in `obj` (a sum per leaf)."""
    if isinstance(obj, torch.Tensor):
        return float(obj.double().sum()) if obj.dtype == torch.bfloat16 else float(obj.sum())
    if isinstance(obj, np.ndarray):
        return float(obj.sum())
    if isinstance(obj, dict):
        return sum(_touch(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_touch(v) for v in obj)
    if isinstance(obj, torch.utils.data.TensorDataset):
        return _touch(obj.tensors)
    raise TypeError(type(obj))


def payload_mappings(pid="self") -> list:
    """The fields of each mapping of an mplaunch payload in /proc/PID/smaps, in bytes:
    its "Anonymous" pages are the ones the process copied (written to)."""
    out, current = [], None
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            parts = line.split()
            if "-" in parts[0] and len(parts) >= 5:     # a mapping's header line
                current = {} if "mplaunch-payload" in line else None
                if current is not None:
                    out.append(current)
            elif current is not None and len(parts) == 3 and parts[2] == "kB":
                current[parts[0].rstrip(":")] = int(parts[1]) * 1024
    return out


def _maps_of_payloads(pid="self") -> int:
    with open(f"/proc/{pid}/maps") as f:
        return sum("mplaunch-payload" in line for line in f)


# -- rank functions (module level: the ranks import them by reference) -------------------

def keep(data):
    mplaunch.rank_state()["data"] = data
    return _touch(data)


DATA = None


def set_global(data):
    global DATA
    DATA = data


def sum_global():
    gc.collect()
    return (0 if DATA is None else _touch(DATA)), _maps_of_payloads()


def drop():
    mplaunch.rank_state().pop("data", None)
    gc.collect()
    return _maps_of_payloads()


def touched_under_barrier(data):
    """Touch everything, then measure this rank while every rank still maps its copy."""
    import torch.distributed as dist
    before = rollup()
    total = _touch(data)
    dist.barrier()
    after = rollup()
    mapped = payload_mappings()
    dist.barrier()      # nobody unmaps before all have measured
    grown = {k: after[k] - before[k] for k in ("USS", "Pss", "Anonymous")}
    # the payload's own mappings: pages this rank alone maps, and pages it copied
    grown["payload_private"] = sum(m["Private_Clean"] + m["Private_Dirty"] for m in mapped)
    grown["payload_copied"] = sum(m["Anonymous"] for m in mapped)
    grown["payload_rss"] = sum(m["Rss"] for m in mapped)
    return total, grown


# -- the memory, in real ranks ----------------------------------------------------------

def test_a_tensor_dataset_is_one_copy_on_the_machine_that_every_rank_maps():
    x = torch.randn(2 ** 22, 8)                      # 128 MiB
    y = torch.randint(0, 10, (2 ** 22,))             # 32 MiB
    dataset = torch.utils.data.TensorDataset(x, y)
    size = 160 * MiB
    payload = dumps_payload(keep, (dataset,), {})
    assert isinstance(payload, buffers.Payload) and len(payload.pickled) < 64 * 1024
    warm = torch.utils.data.TensorDataset(torch.randn(2 ** 14, 8), torch.randint(0, 10, (2 ** 14,)))
    with mplaunch.World(4) as world:
        world.run(keep, (warm,))      # what a first call imports and allocates, done
        before = {r: rollup(pid) for r, pid in world.pids.items()}
        totals = world.run(keep, (dataset,))
        after = {r: rollup(pid) for r, pid in world.pids.items()}
    assert totals == [pytest.approx(_touch(dataset))] * 4
    grown = {r: {k: after[r][k] - before[r][k] for k in ("USS", "Pss", "Pss_Shmem")}
             for r in before}
    for r, g in grown.items():
        # each rank holds a quarter of the one copy, and nothing of its own
        assert g["USS"] < 8 * MiB, (r, g)
        assert g["Pss_Shmem"] == pytest.approx(size / 4, rel=0.05), (r, g)
    assert sum(g["Pss"] for g in grown.values()) == pytest.approx(size, rel=0.1), grown


def test_an_array_from_np_load_and_a_state_dict_through_launch_under_a_barrier(tmp_path):
    np.save(tmp_path / "a.npy", np.random.rand(2 ** 23))       # 64 MiB
    array = np.load(tmp_path / "a.npy", mmap_mode=None)
    state = torch.nn.Sequential(torch.nn.Linear(2048, 4096), torch.nn.Linear(4096, 2048)).state_dict()
    size = array.nbytes + sum(t.numel() * t.element_size() for t in state.values())
    results = mplaunch.launch(touched_under_barrier, ({"array": array, "state": state},), 2,
                              backend="gloo")
    expected = _touch({"array": array, "state": state})
    for total, grown in results:
        assert total == pytest.approx(expected)
        assert grown["USS"] < 8 * MiB, grown
        assert grown["Anonymous"] < 8 * MiB, grown         # no private copy
    assert sum(g["Pss"] for _, g in results) == pytest.approx(size, rel=0.15)


@pytest.mark.parametrize("start_method", [
    "fork", "forkserver", pytest.param("spawn", marks=pytest.mark.slow)])
def test_every_start_method_maps_one_copy(start_method):
    t = torch.rand(2 ** 24)                           # 64 MiB
    results = mplaunch.launch(touched_under_barrier, (t,), 2, backend="gloo",
                              start_method=start_method)
    for total, grown in results:
        assert total == pytest.approx(float(t.sum()))
        # every rank maps the whole payload, copies none of it, and holds none of it alone
        assert grown["payload_rss"] >= 64 * MiB, grown
        assert grown["payload_copied"] < MiB and grown["payload_private"] < MiB, grown
        assert grown["Anonymous"] < 8 * MiB, grown
        if start_method != "fork":
            # A forked rank shares the caller's whole heap, and its garbage collector
            # writes the header of every object it walks there: its USS grows by pages it
            # copied that are not the input's (seen in CI: 16 MiB, none of it Anonymous
            # growth). The payload's own figures above are what this test is about.
            assert grown["USS"] < 8 * MiB, grown


def dataloader_workers(data):
    """A rank's DataLoader workers (forks of the rank) read the rank's inputs: each
    touches all of them and says what it holds alone."""
    class Whole(torch.utils.data.Dataset):
        def __len__(self):
            return 2

        def __getitem__(self, i):
            import gc
            # no collection in between: a full one walks the heap the worker shares
            # with its rank and copies its pages (test_every_start_method_maps_one_copy)
            gc.disable()
            try:
                before = rollup()
                total = _touch(data)
                (mapping,) = payload_mappings()
                return total, rollup()["USS"] - before["USS"], mapping["Anonymous"]
            finally:
                gc.enable()
    _touch(data)     # mapped by the rank too: pages it shares are no worker's own
    loader = torch.utils.data.DataLoader(Whole(), batch_size=None, num_workers=2,
                                         multiprocessing_context="fork")
    return list(loader)


def test_a_ranks_dataloader_workers_read_the_same_pages():
    t = torch.rand(2 ** 24)                           # 64 MiB
    (items,) = mplaunch.launch(dataloader_workers, (t,), 1)
    for total, uss, copied in items:
        assert total == pytest.approx(float(t.sum()))
        # a forked worker's own pages (its interpreter's, COW) but not the data's
        assert copied == 0 and uss < 16 * MiB


# -- by value -------------------------------------------------------------------------------

def write_after_the_caller_changed(t, go):
    import torch.distributed as dist
    while not os.path.exists(go):
        time.sleep(0.01)
    seen = float(t.sum())
    t[0] = 100.0 + dist.get_rank()
    dist.barrier()
    return seen, float(t[0])


def write_one_element(t):
    before = payload_mappings()[0]["Anonymous"]
    t[12345] = -1.0
    return before, payload_mappings()[0]["Anonymous"], float(t.sum())


def test_a_rank_copies_nothing_until_it_writes_and_then_the_page_it_wrote():
    t = torch.ones(2 ** 24)                           # 64 MiB
    ((before, after, total),) = mplaunch.launch(write_one_element, (t,), 1)
    assert (before, after) == (0, 4096) and total == 2 ** 24 - 2


def test_writes_stay_in_their_rank_and_the_callers_later_changes_reach_nobody(tmp_path):
    t = torch.ones(2 ** 22)                           # 16 MiB
    go = tmp_path / "go"
    handle = mplaunch.start(write_after_the_caller_changed, (t, str(go)), 2,
                            backend="gloo")
    t.fill_(7.0)                                      # after start() returned
    go.touch()
    results = handle.result(timeout=120)
    # each rank saw the value at call time, and only its own write
    assert results == [(float(2 ** 22), 100.0), (float(2 ** 22), 101.0)]
    assert float(t[0]) == 7.0                         # no rank's write reached here


# -- metadata, views, odd tensors -------------------------------------------------------------

def describe(objs):
    out = []
    for o in objs:
        if isinstance(o, torch.Tensor):
            out.append((type(o).__name__, o.dtype, tuple(o.shape), o.stride(),
                        o.requires_grad, o.untyped_storage().nbytes(),
                        o.is_contiguous(memory_format=torch.channels_last)
                        if o.dim() == 4 else None, dict(vars(o))))
        else:
            out.append((type(o).__name__, o.dtype, o.shape, o.flags.c_contiguous,
                        o.flags.f_contiguous, o.flags.writeable))
    return out, [o.detach().clone() if isinstance(o, torch.Tensor) else o.copy()
                 for o in objs]


def aliasing(a, b, c):
    return a is b, c.data_ptr() == a.data_ptr()


def test_tensor_and_array_metadata_arrive_as_the_user_expects():
    m = torch.randn(1024, 512)                        # 2 MiB
    big = torch.arange(2 ** 22, dtype=torch.float32)  # 16 MiB storage
    attrs = torch.randn(2 ** 15)
    attrs.note = "kept"
    param = torch.nn.Parameter(torch.randn(256, 256))
    arr = np.arange(2 ** 20, dtype=np.float64).reshape(1024, 1024)
    readonly = np.ones(2 ** 16)
    readonly.flags.writeable = False
    objs = [m.T, m[::2, 1::3], big[2 ** 20:2 ** 20 + 2 ** 16], big[5:5],
            torch.randn(8, 16, 64, 64).to(memory_format=torch.channels_last),
            m.to(torch.bfloat16), torch.randn(128, 128, requires_grad=True), param, attrs,
            torch.randn(1, 4096).expand(64, 4096),
            arr[:, ::2], np.asfortranarray(arr), readonly]
    (meta, values), = mplaunch.launch(describe, (objs,), 1)
    expected, _ = describe(objs)
    for i, (got, want) in enumerate(zip(meta, expected)):
        if i == 1:   # gaps: its elements only, contiguous
            assert got[:3] == want[:3] and got[3] == (171, 1), got
            assert got[5] == 512 * 171 * 4
        elif i in (2, 3):   # a view sends its own bytes, not the storage around it
            assert got[:5] == want[:5] and got[5] == (2 ** 18 if i == 2 else 0), got
        elif i == 10:       # numpy with gaps: contiguous too
            assert got[:3] == want[:3] and got[3] is True, got
        elif i == 9:        # an expanded tensor keeps its zero stride and its one row
            assert got[:5] == want[:5] and got[5] == 4096 * 4, got
        else:
            assert got[:5] == want[:5] and got[6:] == want[6:], (i, got, want)
    for got, want in zip(values, objs):
        if isinstance(want, torch.Tensor):
            assert torch.equal(got, want.detach())
        else:
            assert np.array_equal(got, want)
    # the same tensor twice is one tensor; views of one span share it again
    a = torch.randn(2 ** 16)
    assert mplaunch.launch(aliasing, (a, a, a.view(256, 256)), 1) == [(True, True)]


def test_a_view_of_a_large_storage_sends_its_own_bytes():
    big = torch.zeros(2 ** 26)                        # 256 MiB storage
    payload = dumps_payload(sum, (big[:2 ** 16],), {})   # a 256 KiB view
    assert isinstance(payload, buffers.Payload) and payload.nbytes < MiB
    assert isinstance(dumps_payload(sum, (big[:10],), {}), bytes)   # small: in the stream


def test_the_common_path_stays_bytes():
    assert isinstance(dumps_payload(sum, ((2.0,),), {}), bytes)
    assert isinstance(dumps_payload(sum, (torch.ones(100), np.ones(100)), {}), bytes)


# -- refused before anything starts --------------------------------------------------------

class _FakeCudaTensor:
    """What _reduce_tensor reads of a CUDA tensor (no GPU here)."""
    class device:
        type = "cuda"
        def __str__(self):  # noqa: E301
            return "cuda:0"
    device = device()
    dtype = torch.float32
    shape = (1024, 1024)

    def numel(self):
        return 1024 * 1024

    def element_size(self):
        return 4


def test_a_cuda_tensor_is_refused_with_what_to_do(monkeypatch):
    monkeypatch.setitem(reducers.REDUCERS, _FakeCudaTensor, reducers._reduce_tensor)
    with pytest.raises(reducers.CannotSend) as info:
        dumps_payload(sum, ({"w": _FakeCudaTensor()},), {})
    text = str(info.value)
    assert "a cuda tensor (float32 (1024, 1024), 4.0 MiB, on cuda:0)" in text
    assert "t.cpu()" in text and "LOCAL_RANK" in text and "CUDA IPC" in text
    again = pickle.loads(pickle.dumps(info.value))
    assert type(again) is reducers.CannotSend and str(again) == text


def test_inputs_larger_than_the_machine_can_lend_are_refused_before_anything_starts(
        monkeypatch):
    monkeypatch.setattr(buffers, "lendable", lambda: (32 * MiB, "a test's limit"))
    t = torch.zeros(2 ** 24)                          # 64 MiB
    with pytest.raises(MemoryError) as info:
        mplaunch.launch(sum, (t,), 2)
    err = info.value
    assert isinstance(err, buffers.InputsTooLarge)
    assert err.limit == 32 * MiB and err.nbytes > 64 * MiB - 1
    assert "64.0 MiB" in str(err) and "32.0 MiB" in str(err) and "a test's limit" in str(err)
    assert "nothing was started" in str(err)
    assert str(pickle.loads(pickle.dumps(err))) == str(err)


def test_the_limit_is_what_the_machine_has_now():
    limit, source = buffers.lendable()
    with open("/proc/meminfo") as f:
        available = next(int(line.split()[1]) * 1024 for line in f
                         if line.startswith("MemAvailable:"))
    assert 0 < limit <= available * 1.1 and source


# -- lifetime ------------------------------------------------------------------------------

def test_a_world_keeps_inputs_while_a_rank_refers_to_them_and_frees_them_after():
    shm = set(os.listdir("/dev/shm"))
    t = torch.rand(2 ** 24)                           # 64 MiB
    with mplaunch.World(2) as world:
        world.run(keep, (t,))
        pids = list(world.pids.values())
        assert [_maps_of_payloads(pid) for pid in pids] == [1, 1]
        assert all(rollup(pid)["Pss_Shmem"] >= 30 * MiB for pid in pids)
        assert world.run(drop) == [0, 0]              # dropped: unmapped, freed
        assert all(rollup(pid)["Pss_Shmem"] < 2 * MiB for pid in pids)
        world.run(keep, (t,))                         # kept until the World closes
    assert set(os.listdir("/dev/shm")) == shm


def test_a_module_global_set_by_a_run_keeps_the_inputs_for_the_next_runs():
    t = torch.rand(2 ** 22)
    with mplaunch.World(2) as world:
        world.run(set_global, (t,))
        assert world.run(sum_global) == [(pytest.approx(float(t.sum())), 1)] * 2
        world.run(set_global, (None,))
        assert world.run(sum_global) == [(0, 0)] * 2


def pushed(name):
    from mplaunch._rank import cells
    value = cells._main_namespace()[name]
    return _touch(value), len(payload_mappings())


def test_ranks_push_sends_notebook_variables_by_the_same_path():
    # what `%ranks push data` runs: World.run(cells.push, ({name: value},))
    from mplaunch._rank import cells
    data = {"x": torch.rand(2 ** 22), "a": np.random.rand(2 ** 20)}
    with mplaunch.World(2) as world:
        world.run(cells.push, ({"data": data},))
        assert world.run(pushed, ("data",)) == [(pytest.approx(_touch(data)), 1)] * 2


def spawned(i, t, out):
    with open(os.path.join(out, str(i)), "w") as f:
        f.write(repr((float(t.sum()), [m["Anonymous"] for m in payload_mappings()])))


def test_mplaunch_spawn_maps_its_args_too(tmp_path):
    t = torch.rand(2 ** 22)
    mplaunch.spawn(spawned, args=(t, str(tmp_path)), nprocs=2)
    for i in range(2):
        total, copied = eval((tmp_path / str(i)).read_text())
        assert total == pytest.approx(float(t.sum())) and copied == [0]


def test_world_run_sends_the_same_tensor_again_by_value():
    t = torch.ones(2 ** 22)
    with mplaunch.World(2) as world:
        assert world.run(keep, (t,)) == [float(2 ** 22)] * 2
        t[:10] = 3.0
        assert world.run(keep, (t,)) == [float(2 ** 22 + 20)] * 2


# -- across nodes ---------------------------------------------------------------------------

def test_across_nodes_each_node_receives_a_payload_once():
    import local_step  # noqa: F401 - registers scheduler="local", the tests' stand-in
    t = torch.rand(2 ** 23)                           # 32 MiB
    world = mplaunch.World(4, nnodes=2, master_addr="127.0.0.1", scheduler="local")
    with world:
        world.run(len, ((),))
        sent = [n["payloads"] for n in world.nodes]
        ranks, per_node = len(world.pids), world.nprocs   # nprocs: on each node
        assert ranks == 2 * per_node and per_node >= 2
        assert world.run(keep, (t,)) == [pytest.approx(float(t.sum()))] * ranks
        # one PAYLOAD frame per node, not per rank
        assert [n["payloads"] for n in world.nodes] == [s + 1 for s in sent], sent
        for pid in world.pids.values():
            assert rollup(pid)["Pss_Shmem"] == pytest.approx(32 * MiB / per_node, rel=0.1)
