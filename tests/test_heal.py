"""Ranks that heal: the process group can be destroyed and built again in user code, and
a World keeps its ranks and their state through what can be brought back (issue 19)."""
from __future__ import annotations

import os
import signal
import sys
import time

import pytest

import mplaunch

METHODS = ["forkserver", "spawn", "fork"]


# -- in the ranks -------------------------------------------------------------------------

def _model():
    import torch
    torch.manual_seed(0)
    return torch.nn.Linear(8, 8)


def wrap_model():
    """Build a DDP model and keep it (the World's first cell)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    st = mplaunch.rank_state()
    st["m"] = _model()
    st["ddp"] = DDP(st["m"])
    return True


def recover(times):
    """The recovery sequence of the issue, `times` times, with no barrier anywhere:
    destroy, init, drop the old DDP, wrap again, one training step."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    st = mplaunch.rank_state()
    if "m" not in st:
        wrap_model()
    m, ddp = st.pop("m"), st.pop("ddp")
    steps = []
    for _ in range(times):
        dist.destroy_process_group()
        dist.init_process_group("gloo")
        del ddp
        ddp = DDP(m)
        group = dist.distributed_c10d._get_default_group()
        before = group._get_sequence_number_for_group()
        ddp(torch.randn(4, 8)).sum().backward()
        steps.append(group._get_sequence_number_for_group() - before)
    st["m"], st["ddp"] = m, ddp
    return steps


# -- item 7: destroy/init in user code ----------------------------------------------------

@pytest.mark.parametrize("method", METHODS)
def test_recovery_sequence_twenty_times_under_launch(method):
    steps = mplaunch.launch(recover, (20,), nprocs=2, start_method=method, timeout=120)
    # Every backward issued the same collectives: the old wrappers' hooks did not pile up
    # (they would also fail on their destroyed group).
    assert steps[0] == steps[1] and len(set(steps[0])) == 1 and len(steps[0]) == 20


@pytest.mark.parametrize("method", METHODS)
def test_recovery_sequence_twenty_times_in_a_world_with_a_kept_model(method):
    with mplaunch.World(2, start_method=method, timeout=120) as world:
        assert world.run(wrap_model) == [True, True]
        steps = world.run(recover, (20,))
        assert steps[0] == steps[1] and len(set(steps[0])) == 1
        assert world.run(recover, (2,))[0] == steps[0][:2]   # and again, in the same ranks


# -- items 1-3, 5, 6: a World that heals -----------------------------------------------------

def count_calls():
    st = mplaunch.rank_state()
    st["calls"] = st.get("calls", 0) + 1
    return st["calls"]


def typo_in_rank_one():
    count_calls()
    if os.environ["RANK"] == "1":
        undefined_name  # noqa: F821 - the typo of the issue
    return "fine"


def group_id():
    import torch.distributed as dist
    return id(dist.group.WORLD)


def allreduce_sum():
    import torch
    import torch.distributed as dist
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return t.item()


def raise_while_peer_waits_in_allreduce():
    import torch
    import torch.distributed as dist
    if dist.get_rank() == 1:
        raise ValueError("rank one fails before the collective")
    dist.all_reduce(torch.ones(1))   # waits for rank 1: forever, unless released
    return "unreachable"


def train_step():
    """One DDP step with the kept model; the weights' checksum (equal in every rank)."""
    import torch
    st = mplaunch.rank_state()
    st["ddp"](torch.ones(4, 8)).sum().backward()
    with torch.no_grad():
        for p in st["m"].parameters():
            p -= 0.1 * p.grad
            p.grad = None
    return round(float(sum(p.detach().sum() for p in st["m"].parameters())), 4)


def rewrap():
    from torch.nn.parallel import DistributedDataParallel as DDP
    st = mplaunch.rank_state()
    del st["ddp"]
    st["ddp"] = DDP(st["m"])


def sleep_in_rank_one(flag_dir):
    open(os.path.join(flag_dir, f"in.{os.environ['RANK']}"), "w").close()
    if os.environ["RANK"] == "1":
        time.sleep(600)
    return "done"


def busy_loop_everywhere(flag_dir):
    open(os.path.join(flag_dir, f"in.{os.environ['RANK']}"), "w").close()
    st = mplaunch.rank_state()
    while True:
        st["spins"] = st.get("spins", 0) + 1


def _wait_for(paths, timeout=60):
    end = time.monotonic() + timeout
    while not all(os.path.exists(p) for p in paths):
        assert time.monotonic() < end, f"never appeared: {paths}"
        time.sleep(0.02)


@pytest.mark.parametrize("method", METHODS)
def test_an_exception_with_no_collective_half_done_keeps_ranks_state_and_group(method):
    with mplaunch.World(2, backend="gloo", start_method=method) as world:
        assert world.run(count_calls) == [1, 1]
        pids, groups = world.pids, world.run(group_id)
        with pytest.raises(mplaunch.WorkerError) as info:
            world.run(typo_in_rank_one)
        err = info.value
        assert err.rank == 1 and type(err.__cause__) is NameError
        assert "world was kept" in str(err) and "process group" in err.healed
        assert world.pids == pids                     # the same processes
        assert world.run(count_calls) == [3, 3]       # their state
        assert world.run(group_id) == groups          # and their process group
        assert world.run(allreduce_sum) == [3.0, 3.0]


@pytest.mark.parametrize("method", METHODS)
def test_a_collective_left_half_done_is_released_and_the_group_rebuilt(method):
    with mplaunch.World(2, backend="gloo", start_method=method) as world:
        assert world.run(wrap_model) == [True, True]
        pids = world.pids
        with pytest.raises(mplaunch.WorkerError) as info:
            world.run(raise_while_peer_waits_in_allreduce, timeout=300)
        err = info.value
        assert err.rank == 1 and type(err.__cause__) is ValueError
        assert not isinstance(err, mplaunch.LaunchTimeout)   # released, not timed out
        assert "rebuilt" in err.healed and "rank_state()['ddp']" in err.healed
        assert world.pids == pids
        assert world.run(allreduce_sum) == [3.0, 3.0]    # the new group works
        world.run(rewrap)                                # as the error says
        a, b = world.run(train_step)
        assert a == b


@pytest.mark.parametrize("method", METHODS)
def test_a_half_done_collective_is_released_with_openmp_threads_in_the_ranks(method):
    # OMP_NUM_THREADS=2: the rank's torch.set_num_threads starts OpenMP threads before
    # its first call; the release signal must be blocked in them too, or it kills the
    # rank (a Ray worker's environment sets OMP_NUM_THREADS to its CPUs).
    with mplaunch.World(2, backend="gloo", start_method=method,
                        env={"OMP_NUM_THREADS": "2"}) as world:
        assert world.run(omp_threads) == [2, 2]
        pids = world.pids
        with pytest.raises(mplaunch.WorkerError) as info:
            world.run(raise_while_peer_waits_in_allreduce, timeout=300)
        assert info.value.rank == 1 and "rebuilt" in info.value.healed, str(info.value)
        assert world.pids == pids                        # released, not killed
        assert world.run(allreduce_sum) == [3.0, 3.0]


def omp_threads():
    import torch
    return torch.get_num_threads()


def test_heal_false_tears_down_as_before():
    with mplaunch.World(2, heal=False, grace_period=1) as world:
        world.run(count_calls)
        pids = world.pids
        with pytest.raises(mplaunch.WorkerError) as info:
            world.run(typo_in_rank_one)
        assert info.value.healed is None
        assert world.pids == {}
        assert world.run(count_calls) == [1, 1]
        assert not set(world.pids.values()) & set(pids.values())


def test_a_timeout_shows_the_stacks_then_interrupts_and_keeps_the_world(tmp_path):
    with mplaunch.World(2, grace_period=5) as world:
        world.run(count_calls)
        pids = world.pids
        with pytest.raises(mplaunch.LaunchTimeout) as info:
            world.run(sleep_in_rank_one, (str(tmp_path),), timeout=2)
        err = info.value
        assert "sleep_in_rank_one" in err.stacks[1] and "world was kept" in str(err)
        assert world.pids == pids
        assert world.run(count_calls) == [2, 2]


def test_sigint_interrupts_every_rank_keeps_the_world_and_raises_keyboard_interrupt(
        tmp_path):
    import threading

    def interrupt():
        _wait_for([tmp_path / "in.0", tmp_path / "in.1"])
        os.kill(os.getpid(), signal.SIGINT)

    with mplaunch.World(2, grace_period=5) as world:
        world.run(count_calls)
        pids = world.pids
        t = threading.Thread(target=interrupt)
        t.start()
        try:
            with pytest.raises(KeyboardInterrupt) as info:
                world.run(busy_loop_everywhere, (str(tmp_path),))
        finally:
            t.join()
        assert "interrupted" in str(info.value) and "kept" in str(info.value)
        assert world.pids == pids
        assert world.run(count_calls) == [2, 2]


def test_an_error_survives_pickling_with_what_the_world_kept():
    import pickle
    with mplaunch.World(2) as world:
        with pytest.raises(mplaunch.WorkerError) as info:
            world.run(typo_in_rank_one)
    again = pickle.loads(pickle.dumps(info.value))
    assert again.healed == info.value.healed and str(again) == str(info.value)


# -- item 4: a rank that dies is replaced ------------------------------------------------------

def die_in_rank_one_while_peer_waits(how):
    import torch
    import torch.distributed as dist
    if dist.get_rank() == 1:
        if how == "exit":
            os._exit(3)
        os.kill(os.getpid(), signal.SIGKILL)
    dist.all_reduce(torch.ones(1))
    return "unreachable"


def deaf_and_stuck_in_rank_one():
    if os.environ["RANK"] == "1":
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        time.sleep(600)
    return "done"


@pytest.mark.parametrize("method,how", [("forkserver", "exit"), ("spawn", "kill"),
                                        ("fork", "kill")])
def test_a_dead_rank_is_replaced_and_the_survivors_keep_their_state(method, how):
    with mplaunch.World(2, backend="gloo", start_method=method) as world:
        assert world.fresh_ranks == []
        world.run(wrap_model)
        assert world.run(count_calls) == [1, 1]
        pids = world.pids
        with pytest.raises(mplaunch.WorkerError) as info:
            world.run(die_in_rank_one_while_peer_waits, (how,), timeout=300)
        err = info.value
        assert err.rank == 1 and (err.exitcode == 3 if how == "exit"
                                  else err.signal == "SIGKILL")
        assert "replaced" in err.healed and "rebuilt" in err.healed
        assert world.fresh_ranks == [1]
        assert world.pids[0] == pids[0] and world.pids[1] != pids[1]
        assert world.run(count_calls) == [2, 1]      # rank 1 starts from nothing
        assert world.fresh_ranks == []
        assert world.run(allreduce_sum) == [3.0, 3.0]
        world.run(wrap_model)                        # re-sent to every rank
        a, b = world.run(train_step)
        assert a == b


def test_a_rank_no_interrupt_reaches_is_replaced_after_the_timeout():
    with mplaunch.World(2, grace_period=1) as world:
        pids = world.start().pids
        # the ranks import this module now, not within the 2 s the stuck call has
        assert world.run(count_calls) == [1, 1]
        with pytest.raises(mplaunch.LaunchTimeout) as info:
            world.run(deaf_and_stuck_in_rank_one, timeout=2)
        assert "deaf_and_stuck_in_rank_one" in info.value.stacks[1]
        assert world.fresh_ranks == [1] and world.pids[0] == pids[0]
        assert world.run(count_calls) == [2, 1]      # rank 1 starts from nothing


# -- item 8: pytest reuse keeps a world that healed ----------------------------------------

@pytest.mark.slow
def test_pytest_reuse_keeps_a_world_that_healed_after_a_failure_and_a_hang(pytester):
    from procs import assert_gone
    from test_plugin import IDENTITY, _inner_ini, _recorded_pids, \
        _run, _write_tests
    _inner_ini(pytester, mplaunch_reuse="true", mplaunch_timeout="8")
    out = _write_tests(pytester, "test_healing", helpers=IDENTITY, source="""
    @pytest.mark.mplaunch(nprocs=2)
    def test_a():
        record("a", identity())

    @pytest.mark.mplaunch(nprocs=2)
    def test_b_fails_while_its_peer_waits():
        record("b", identity())
        assert dist.get_rank() == 0
        dist.barrier()

    @pytest.mark.mplaunch(nprocs=2)
    def test_c():
        record("c", identity())
        t = torch.ones(1)
        dist.all_reduce(t)
        assert t.item() == 2.0

    @pytest.mark.mplaunch(nprocs=2)
    def test_d_hangs():
        if dist.get_rank() == 0:
            time.sleep(600)
        dist.barrier()

    @pytest.mark.mplaunch(nprocs=2)
    def test_e():
        record("e", identity())
        dist.barrier()
    """)
    result = _run(pytester)
    result.assert_outcomes(passed=3, failed=2)

    def pids(name):
        return {int(f.read_text().split()[0]) for f in out.iterdir()
                if f.name.startswith(name + "-rank")}
    assert len(pids("a")) == 2 and pids("a") == pids("b") == pids("c") == pids("e")
    assert_gone(_recorded_pids(out))


# -- the notebook: a typo, an interrupted training cell and a dead rank, in a real kernel ----

from test_notebook import kernel_config  # noqa: E402,F401 - the fixture

_BUILD = """%%ranks
import os, time
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
rank = dist.get_rank()
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
ddp = DDP(model)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
steps = 0

def train(n):
    global steps
    for _ in range(n):
        opt.zero_grad()
        ddp(torch.ones(8, 4)).sum().backward()
        opt.step()
        steps += 1

def agree():
    w = torch.cat([p.detach().flatten() for p in model.parameters()])
    ws = [torch.zeros_like(w) for _ in range(dist.get_world_size())]
    dist.all_gather(ws, w)
    return all(torch.equal(ws[0], x) for x in ws)
"""


@pytest.mark.notebook
@pytest.mark.timeout(480)   # nine cells; one that hangs fails by name after CELL_TIMEOUT
def test_a_notebook_keeps_its_ddp_model_through_a_typo_an_interrupt_and_a_dead_rank(
        kernel_config, tmp_path):
    from test_notebook import _errors, _plain, _stream, run_cells
    pidfile = tmp_path / "pids"
    sources = {
        "start": "%load_ext mplaunch\n%ranks start 2",
        "build": _BUILD,
        "typo": "%%ranks\ntrian(3)",
        "after-typo": "%%ranks\ntrain(3)\nprint('steps', steps)",
        "interrupt": ("%%ranks\n"
                      f"fd = os.open({str(pidfile)!r}, os.O_WRONLY | os.O_APPEND | "
                      "os.O_CREAT)\n"
                      "os.write(fd, f'{os.getpid()}\\n'.encode()); os.close(fd)\n"
                      "while True:\n"
                      "    train(1)"),
        "after-interrupt": ("%%ranks\n"
                            "ddp = DDP(model)   # as the error says\n"
                            "train(1)\n"
                            "print('steps above 3', steps > 3, 'agree', agree())"),
        "die": ("%%ranks\n"
                "if rank == 1:\n"
                "    os._exit(1)\n"
                "train(1)"),
        "status": "%ranks",
        "after-death": ("%%ranks\n"
                        "if 'model' not in globals():   # the fresh rank 1\n"
                        + "\n".join("    " + line for line in
                                    _BUILD.splitlines()[1:]) + "\n"
                        "else:\n"
                        "    ddp = DDP(model)   # rank 0's weights, broadcast\n"
                        "train(1)\n"
                        "print('rank', rank, 'steps', steps, 'agree', agree())"),
        "stop": "%ranks stop",
    }
    failing = ("typo", "interrupt", "die")
    cells = run_cells(sources, kernel_config, tmp_path, failing, ("interrupt", pidfile))
    for name, cell in cells.items():
        if name not in failing:
            assert not _errors(cell), (name, cell.outputs)
    assert {name: _errors(cells[name])[0]["ename"] for name in failing} == {
        "typo": "NameError", "interrupt": "KeyboardInterrupt", "die": "WorkerError"}
    assert sorted(_stream(cells["after-typo"]).splitlines()) == [
        "[rank0]: steps 3", "[rank1]: steps 3"]
    assert sorted(_stream(cells["after-interrupt"]).splitlines()) == [
        "[rank0]: steps above 3 True agree True", "[rank1]: steps above 3 True agree True"]
    # What the world kept is said once, in the %ranks note under the error.
    died = _plain(_errors(cells["die"])[0]["traceback"])
    assert "replaced" in died and "[1]" in died, died
    assert "fresh since the last cell" in _stream(cells["status"])
    out = sorted(_stream(cells["after-death"]).splitlines())
    assert len(out) == 2 and out[0].startswith("[rank0]: rank 0 steps ") \
        and out[0].endswith("agree True"), out
    assert int(out[0].split()[4]) > 4, out            # rank 0 kept its training
    assert out[1] == "[rank1]: rank 1 steps 1 agree True", out   # rank 1 is fresh


def test_a_second_sigint_while_the_first_is_handled_tears_down_as_before(tmp_path):
    import threading

    def interrupt_twice():
        _wait_for([tmp_path / "in.0", tmp_path / "in.1"])
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.5)          # rank 1 ignores the first: the heal is still going on
        os.kill(os.getpid(), signal.SIGINT)

    with mplaunch.World(2, grace_period=3) as world:
        world.run(count_calls)
        pids = world.pids
        t = threading.Thread(target=interrupt_twice)
        t.start()
        try:
            with pytest.raises(mplaunch.MainProcessError) as info:
                world.run(deaf_sleep_everywhere, (str(tmp_path),))
        finally:
            t.join()
        assert info.value.signal_name == "SIGINT"
        assert world.pids == {} and world.fresh_ranks == [0, 1]
        assert world.run(count_calls) == [1, 1]
        assert not set(world.pids.values()) & set(pids.values())


def deaf_sleep_everywhere(flag_dir):
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    open(os.path.join(flag_dir, f"in.{os.environ['RANK']}"), "w").close()
    time.sleep(600)


@pytest.mark.parametrize("signame", ["SIGTERM", "SIGHUP", "SIGQUIT"])
def test_sigterm_sighup_sigquit_still_end_a_healing_world(tmp_path, signame):
    import threading
    signo = getattr(signal, signame)

    def send():
        _wait_for([tmp_path / "in.0", tmp_path / "in.1"])
        os.kill(os.getpid(), signo)

    with mplaunch.World(2, grace_period=3) as world:
        world.run(count_calls)
        t = threading.Thread(target=send)
        t.start()
        try:
            with pytest.raises(mplaunch.MainProcessError) as info:
                world.run(busy_loop_everywhere, (str(tmp_path),))
        finally:
            t.join()
        assert info.value.signal_name == signame and world.pids == {}


def test_heal_must_be_a_bool_before_anything_starts():
    with pytest.raises(TypeError, match="heal must be True"):
        mplaunch.World(2, heal="yes")
