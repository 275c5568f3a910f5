"""pytest reuse (``@pytest.mark.mplaunch(reuse=True)``, ``mplaunch_reuse = true``),
through real pytest sessions (pytester subprocesses).

The proof of reuse is the ranks' pids: tests that share a world record the same pids,
a test after a failure, a hang or a change of size records new ones. Each rank writes
``pid ppid create_time`` into a file named after the test; the outer test compares
them after the inner session has ended, and checks that every one of them is gone.
"""
from __future__ import annotations

import pytest
from procs import assert_gone
from test_plugin import IDENTITY, _inner_ini, _recorded_pids, _run, \
    _write_tests

HELPERS = IDENTITY + """
import psutil

def pids_of(name):
    return {int((OUT / f).read_text().split()[0])
            for f in os.listdir(OUT) if f.startswith(name + "-rank")}
"""


def _pids(out, name):
    return {int(f.read_text().split()[0]) for f in out.iterdir()
            if f.name.startswith(name + "-rank")}


def test_consecutive_tests_share_ranks_until_one_fails_or_the_size_changes(pytester):
    _inner_ini(pytester, mplaunch_reuse_heal="false")   # strict isolation (test_heal: not)
    out = _write_tests(pytester, "test_reuse", helpers=HELPERS, source="""
    reuse2 = pytest.mark.mplaunch(nprocs=2, reuse=True)

    @reuse2
    def test_a():
        t = torch.tensor([float(dist.get_rank() + 1)])
        dist.all_reduce(t)
        assert t.item() == 3.0
        record("a", identity() + " " + str(torch.rand(1).item()))
        # left behind for the next test, which must not see them
        os.environ["LEFT_BEHIND"] = "1"
        torch.manual_seed(1234)

    def test_plain_in_between():
        pass

    @reuse2
    def test_b():
        assert "LEFT_BEHIND" not in os.environ
        t = torch.ones(1) * dist.get_rank()
        dist.broadcast(t, src=1)
        assert t.item() == 1.0
        dist.barrier()
        record("b", identity() + " " + str(torch.rand(1).item()))

    @reuse2
    def test_c_fails():
        record("c", identity())
        assert dist.get_rank() == 0  # FAILS-IN-RANK-1

    @reuse2
    def test_d():
        record("d", identity())
        dist.barrier()

    @reuse2
    def test_e_skips():
        pytest.skip("skipped in every rank")

    @reuse2
    def test_f():
        record("f", identity())
        dist.barrier()

    @pytest.mark.mplaunch(nprocs=3, reuse=True)
    def test_g_three():
        assert dist.get_world_size() == 3
        record("g", identity())
        dist.barrier()

    @reuse2
    def test_h_two_again():
        # one world at a time: the three ranks of test_g are gone already
        assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"
                       for p in pids_of("g"))
        record("h", identity())
        dist.barrier()
    """)
    result = _run(pytester)
    result.assert_outcomes(passed=7, failed=1, skipped=1)
    result.stdout.fnmatch_lines(["*_ test_c_fails _*",
                                 "E*[[]mplaunch] raised in rank 1 of 2 (pid *)"])
    a, b, c, d, f, g, h = (_pids(out, n) for n in "abcdfgh")
    assert len(a) == 2 and a == b == c       # one world for a, b and c
    assert d.isdisjoint(c) and len(d) == 2   # fresh ranks after the failure
    assert f.isdisjoint(d) and len(f) == 2   # ... and after a skip in the ranks
    assert len(g) == 3 and g.isdisjoint(f)   # another size, another world
    assert len(h) == 2 and h.isdisjoint(f)
    # the random state of test_a's start was given back to test_b, seed or not
    rand = {(f.name[0], f.read_text().split()[3]) for f in out.iterdir()
            if f.name[0] in "ab"}
    assert len({value for _, value in rand}) == 1
    assert_gone(_recorded_pids(out))


def test_ini_default_opt_out_and_the_fixture(pytester):
    _inner_ini(pytester, mplaunch_reuse="true")
    out = _write_tests(pytester, "test_ini", helpers=HELPERS, source="""
    @pytest.mark.mplaunch(nprocs=2)
    def test_one():
        record("one", identity())

    @pytest.mark.mplaunch(nprocs=2, reuse=False)
    def test_opted_out():
        record("out", identity())

    @pytest.mark.mplaunch(nprocs=2)
    def test_two():
        record("two", identity())

    @pytest.mark.mplaunch(nprocs=2, backend=None)
    def test_no_backend():
        assert not dist.is_initialized()
        record("nob", identity())

    def rank():
        return int(os.environ["RANK"])

    def test_fixture_ignores_reuse(mplaunch):
        assert mplaunch(rank) == [0, 1]
    """)
    result = _run(pytester)
    result.assert_outcomes(passed=5)
    one, opted, two, nob = (_pids(out, n) for n in ("one", "out", "two", "nob"))
    assert len(one) == 2 and one == two      # the opt-out did not end the world
    assert opted.isdisjoint(one)
    assert len(nob) == 2 and nob.isdisjoint(one)  # backend is part of the world's key
    assert_gone(_recorded_pids(out))


def test_a_test_that_spoils_the_process_group_ends_the_world(pytester):
    _inner_ini(pytester)
    out = _write_tests(pytester, "test_spoil", helpers=HELPERS, source="""
    reuse2 = pytest.mark.mplaunch(nprocs=2, reuse=True, timeout=60)

    @reuse2
    def test_destroys_the_group():
        record("destroy", identity())
        dist.destroy_process_group()

    @reuse2
    def test_after_destroy():
        record("after_destroy", identity())
        t = torch.ones(1)
        dist.all_reduce(t)
        assert t.item() == 2.0

    @reuse2
    def test_unmatched_collective():
        record("unmatched", identity())
        if dist.get_rank() == 0:
            # rank 1 never joins: this broadcast would pair with the next test's
            # collective in a world that stayed up
            dist.broadcast(torch.ones(1), src=0, async_op=True)

    @reuse2
    def test_after_unmatched():
        record("after_unmatched", identity())
        t = torch.full((1,), float(dist.get_rank()))
        dist.all_reduce(t)
        assert t.item() == 1.0
    """)
    result = _run(pytester)
    result.assert_outcomes(passed=4)
    assert _pids(out, "after_destroy").isdisjoint(_pids(out, "destroy"))
    assert _pids(out, "after_unmatched").isdisjoint(_pids(out, "unmatched"))
    assert _pids(out, "unmatched") == _pids(out, "after_destroy")  # healthy: kept
    assert_gone(_recorded_pids(out))


def test_a_reused_test_sees_its_modules_globals_as_the_module_sets_them(pytester):
    """A test's module globals are the module's in every rank, whatever the test before
    it assigned there: as with fresh ranks, and without the warning a World gives for
    a name its ranks assigned (the test function travels with its module by value, not
    as a function of the ranks' `__main__`). filterwarnings = error would fail it."""
    _inner_ini(pytester)
    out = _write_tests(pytester, "test_globals", helpers=HELPERS, source="""
    state = None               # a placeholder the first test assigns
    seen = []                  # a list the first test appends to
    reuse2 = pytest.mark.mplaunch(nprocs=2, reuse=True)

    @reuse2
    def test_assigns():
        global state
        assert state is None and seen == []
        state = "from test_assigns"
        seen.append(dist.get_rank())
        record("assigns", identity())

    @reuse2
    def test_after():
        assert state is None and seen == []
        record("after", identity())
    """)
    result = _run(pytester)
    result.assert_outcomes(passed=2)
    assert len(_pids(out, "after")) == 2
    assert _pids(out, "after") == _pids(out, "assigns")   # one world for both
    assert_gone(_recorded_pids(out))


@pytest.mark.slow
def test_a_hung_reused_test_times_out_and_the_next_gets_fresh_ranks(pytester):
    _inner_ini(pytester, mplaunch_reuse="true", mplaunch_timeout="6",
               mplaunch_reuse_heal="false")
    out = _write_tests(pytester, "test_hang", helpers=HELPERS, source="""
    @pytest.mark.mplaunch(nprocs=2)
    def test_before():
        record("before", identity())

    @pytest.mark.mplaunch(nprocs=2)
    def test_hangs():
        record("hang", identity())
        if dist.get_rank() == 0:
            time.sleep(600)  # RANK-0-WAITS
        dist.barrier()  # RANK-1-WAITS

    @pytest.mark.mplaunch(nprocs=2, timeout=120)
    def test_after():
        record("after", identity())
        t = torch.ones(1)
        dist.all_reduce(t)
        assert t.item() == 2.0
    """)
    result = _run(pytester)
    result.assert_outcomes(passed=2, failed=1)
    text = result.stdout.str()
    assert "mplaunch.LaunchTimeout: launch timed out after 6 s" in text
    assert text.index("rank 0:") < text.index("time.sleep(600)  # RANK-0-WAITS") \
        < text.index("rank 1:") < text.index("dist.barrier()  # RANK-1-WAITS")
    assert _pids(out, "before") == _pids(out, "hang")
    assert _pids(out, "after").isdisjoint(_pids(out, "hang"))
    assert_gone(_recorded_pids(out))


@pytest.mark.slow
def test_each_xdist_worker_has_its_own_world(pytester):
    _inner_ini(pytester, mplaunch_reuse="true")
    out = _write_tests(pytester, "test_xd", helpers=HELPERS, source="""
    @pytest.mark.parametrize("i", range(6))
    @pytest.mark.mplaunch(nprocs=2)
    def test_all_reduce(i):
        t = torch.tensor([float(i)])
        dist.all_reduce(t)
        assert t.item() == 2.0 * i
        record(f"t{i}", identity() + " " + os.environ["PYTEST_XDIST_WORKER"])
    """)
    result = _run(pytester, "-n", "2")
    result.assert_outcomes(passed=6)
    pids_of_worker = {}
    for f in out.iterdir():
        pid, _ppid, _created, worker = f.read_text().split()
        pids_of_worker.setdefault(worker, set()).add(int(pid))
    assert sorted(pids_of_worker) == ["gw0", "gw1"]
    # every test of a worker ran in that worker's two ranks; no rank served both
    assert all(len(p) == 2 for p in pids_of_worker.values())
    assert pids_of_worker["gw0"].isdisjoint(pids_of_worker["gw1"])
    assert_gone(_recorded_pids(out))
