"""The pytest plugin, exercised through real pytest sessions (pytester subprocesses).

Each inner session has its own ini (strict markers, warnings as errors), so it proves
the marker is registered and that the plugin warns about nothing. Ranks write what they
saw into files under the pytester directory; the outer test reads them after the inner
session has ended.
"""
from __future__ import annotations

import textwrap

import pytest

from mplaunch import _pytest_run as pytest_plugin
from procs import assert_gone
from mplaunch.errors import RankFailure, WorkerError

INNER_TIMEOUT = 150  # the whole inner session; the outer test has 180 s


def _inner_ini(pytester, **ini):
    lines = ["[pytest]",
             "addopts = --strict-markers -p no:cacheprovider",
             "filterwarnings = error"]
    lines += [f"{k} = {v}" for k, v in ini.items()]
    pytester.makeini("\n".join(lines) + "\n")


def _write_tests(pytester, name, source, helpers=""):
    out = pytester.path / "out"
    out.mkdir(exist_ok=True)
    header = textwrap.dedent(f"""
        import os
        import pathlib
        import time

        import pytest
        import torch
        import torch.distributed as dist

        OUT = pathlib.Path({str(out)!r})

        def record(name, text=""):
            (OUT / f"{{name}}-rank{{os.environ.get('RANK', 'parent')}}").write_text(text)
    """)
    pytester.makepyfile(**{name: header + helpers + textwrap.dedent(source)})
    return out


def _line_of(pytester, name, needle):
    lines = (pytester.path / f"{name}.py").read_text().splitlines()
    return next(i for i, line in enumerate(lines, 1) if needle in line)


def _run(pytester, *args):
    return pytester.runpytest_subprocess("-rA", *args, timeout=INNER_TIMEOUT)


def _recorded_pids(out):
    """pid -> create time of every process that wrote 'pid ppid create_time' files."""
    procs = {}
    for f in out.iterdir():
        parts = f.read_text().split()
        if len(parts) >= 3:
            pid, ppid, created = int(parts[0]), int(parts[1]), float(parts[2])
            procs[pid] = created
            procs.setdefault(ppid, None)
    return procs


IDENTITY = """
def identity():
    import psutil
    me = psutil.Process()
    return f"{os.getpid()} {os.getppid()} {me.create_time()}"
"""


def test_runs_the_body_in_every_rank_with_a_process_group(pytester):
    _inner_ini(pytester, mplaunch_nprocs="3")
    out = _write_tests(pytester, "test_world", helpers=IDENTITY, source="""
    @pytest.mark.mplaunch  # nprocs from the ini
    def test_all_reduce():
        assert dist.is_initialized() and dist.get_backend() == "gloo"
        assert dist.get_world_size() == 3
        t = torch.tensor([float(dist.get_rank())])
        dist.all_reduce(t)
        assert t.item() == 3.0
        record("all_reduce", identity())

    @pytest.mark.mplaunch(2, backend=None)
    def test_no_backend():
        assert not dist.is_initialized()
        assert os.environ["WORLD_SIZE"] == "2"
        record("no_backend")

    @pytest.mark.mplaunch(nprocs=2)
    def test_destroyed_afterwards():
        rank = dist.get_rank()
        destroy = dist.destroy_process_group
        def spy(*args, **kwargs):
            destroy(*args, **kwargs)
            record("destroyed", str(dist.is_initialized()))
        dist.destroy_process_group = spy

    class TestGroup:
        pytestmark = pytest.mark.mplaunch(nprocs=2)

        def test_from_class_marker(self):
            assert dist.get_world_size() == 2
            record("class")

        @pytest.mark.mplaunch(nprocs=1)
        def test_closest_marker_wins(self):
            assert dist.get_world_size() == 1
            record("closest")

    def test_plain_tests_run_here():
        assert "RANK" not in os.environ
        record("plain", str(os.getpid()))
    """)
    result = _run(pytester)
    result.assert_outcomes(passed=6)
    names = sorted(p.name for p in out.iterdir())
    assert names == sorted(
        ["all_reduce-rank0", "all_reduce-rank1", "all_reduce-rank2",
         "no_backend-rank0", "no_backend-rank1",
         "destroyed-rank0", "destroyed-rank1",
         "class-rank0", "class-rank1", "closest-rank0", "plain-rankparent"])
    assert {(out / f"destroyed-rank{r}").read_text() for r in (0, 1)} == {"False"}
    session_pid = int((out / "plain-rankparent").read_text().split()[0])
    ranks = [(out / f"all_reduce-rank{r}").read_text().split() for r in range(3)]
    assert len({pid for pid, _, _ in ranks}) == 3
    assert session_pid not in {int(pid) for pid, _, _ in ranks}
    # every rank was forked by the session's warm server, not by the session itself
    assert len({ppid for _, ppid, _ in ranks}) == 1
    assert int(ranks[0][1]) != session_pid
    assert_gone(_recorded_pids(out))


def test_a_failing_rank_shows_its_assertion_introspection(pytester):
    _inner_ini(pytester)
    _write_tests(pytester, "test_fails", """
    def one():
        return 1

    @pytest.mark.mplaunch(nprocs=2)
    def test_compare_in_rank_one():
        if dist.get_rank() == 1:
            assert one() == 2  # FAILS-HERE
        dist.barrier()  # rank 0 waits here until it is stopped

    @pytest.mark.mplaunch(nprocs=2, backend=None)
    def test_list_diff():
        assert [1, 2, 3 + int(os.environ["RANK"])] == [1, 2, 3]

    @pytest.mark.mplaunch(nprocs=2, backend=None)
    def test_chained():
        if os.environ["RANK"] == "0":
            try:
                {}["missing"]
            except KeyError as exc:
                raise ValueError("wrapped") from exc
        time.sleep(60)

    @pytest.mark.mplaunch(nprocs=2, backend=None)
    def test_crash():
        if os.environ["RANK"] == "1":
            os._exit(3)
        time.sleep(60)
    """)
    result = _run(pytester)
    result.assert_outcomes(failed=4)
    line = _line_of(pytester, "test_fails", "FAILS-HERE")
    result.stdout.fnmatch_lines([
        "*_ test_compare_in_rank_one _*",
        ">*assert one() == 2*",
        "E*assert 1 == 2",
        "E*+  where 1 = one()",
        "E*[[]mplaunch] raised in rank 1 of 2 (pid *)",
        f"test_fails.py:{line}: AssertionError",
    ])
    # pytest's own detailed comparison, made in the rank
    result.stdout.fnmatch_lines([
        "*_ test_list_diff _*",
        "E*assert [[]1, 2, 4] == [[]1, 2, 3]",
        "E*At index 2 diff: 4 != 3",
        "E*[[]mplaunch] raised in rank 1 of 2 (pid *)",
    ])
    # the rank's exception chain, as it was raised there
    result.stdout.fnmatch_lines([
        "*_ test_chained _*",
        "E*KeyError: 'missing'",
        "The above exception was the direct cause of the following exception:",
        "*raise ValueError(\"wrapped\") from exc",
        "E*ValueError: wrapped",
        "E*[[]mplaunch] raised in rank 0 of 2 (pid *)",
    ])
    result.stdout.fnmatch_lines([
        "*_ test_crash _*",
        "E*mplaunch.WorkerError: rank 1 (pid *) exited with code 3",
    ])
    # the rank's own stderr, prefixed, is in the report too
    result.stdout.fnmatch_lines(["*Captured stderr call*", "[[]rank1]: Traceback*"])


def test_skip_xfail_and_fail_inside_ranks(pytester):
    _inner_ini(pytester)
    _write_tests(pytester, "test_outcomes", """
    @pytest.mark.mplaunch(nprocs=2)
    def test_skip_everywhere():
        pytest.skip("no accelerator here")  # SKIP-LINE

    @pytest.mark.mplaunch(nprocs=2, backend=None)
    def test_skip_in_one_rank():
        if os.environ["RANK"] == "1":
            pytest.skip("only rank 1 skips")

    @pytest.mark.mplaunch(nprocs=2)
    def test_xfail_in_one_rank():
        if dist.get_rank() == 0:
            pytest.xfail("known bug")
        dist.barrier()  # rank 1 waits here until it is stopped

    @pytest.mark.xfail(raises=ZeroDivisionError, strict=True)
    @pytest.mark.mplaunch(nprocs=2, backend=None)
    def test_xfail_marker_sees_the_ranks_exception_type():
        1 / int(os.environ["RANK"])

    @pytest.mark.mplaunch(nprocs=2, backend=None)
    def test_fail_in_a_rank():
        if os.environ["RANK"] == "1":
            pytest.fail("explicit failure")
        time.sleep(60)
    """)
    result = _run(pytester)
    result.assert_outcomes(passed=0, skipped=2, xfailed=2, failed=1)
    line = _line_of(pytester, "test_outcomes", "SKIP-LINE")
    result.stdout.fnmatch_lines(
        [f"SKIPPED [[]1] test_outcomes.py:{line}: no accelerator here"])
    result.stdout.fnmatch_lines(["SKIPPED [[]1] test_outcomes.py:*: only rank 1 skips"])
    result.stdout.fnmatch_lines(["XFAIL test_outcomes.py::test_xfail_in_one_rank - known bug"])
    result.stdout.fnmatch_lines(["E*Failed: explicit failure",
                                 "E*[[]mplaunch] raised in rank 1 of 2 (pid *)"])


def test_parameters_and_fixture_values_reach_the_ranks(pytester):
    _inner_ini(pytester, mplaunch_nprocs="3")  # the markers below override it
    out = _write_tests(pytester, "test_args", """
    import threading

    class Box:
        def __init__(self, value):
            self.value = value

    @pytest.fixture
    def box():
        return Box(41)

    @pytest.fixture
    def lock():
        return threading.Lock()

    @pytest.mark.parametrize("n, word", [(1, "a"), (2, "b")])
    @pytest.mark.mplaunch(nprocs=2, backend=None)
    def test_params(n, word, box, tmp_path):
        assert isinstance(box, Box) and box.value == 41
        assert tmp_path.is_dir()  # the parent made it; the ranks share the filesystem
        record(f"{word}{n}")

    @pytest.mark.mplaunch(nprocs=2, backend=None)
    def test_unpicklable_fixture(lock):
        pass

    def rank_of():
        return int(os.environ["RANK"])

    def test_launch_fixture(mplaunch):
        assert mplaunch(rank_of) == [0, 1, 2]  # nprocs from the ini
        assert mplaunch(rank_of, nprocs=2) == [0, 1]
    """)
    result = _run(pytester)
    result.assert_outcomes(passed=3, failed=1)
    assert sorted(p.name for p in out.iterdir()) == [
        "a1-rank0", "a1-rank1", "b2-rank0", "b2-rank1"]
    result.stdout.fnmatch_lines([
        "*_ test_unpicklable_fixture _*",
        "E*TypeError: mplaunch cannot send argument 'lock' (lock) to the ranks: *"])


@pytest.mark.slow
def test_a_hung_test_times_out_alone_and_leaves_nothing(pytester):
    _inner_ini(pytester, mplaunch_timeout="6")
    out = _write_tests(pytester, "test_hang", helpers=IDENTITY, source="""
    import mplaunch as mpl

    @pytest.mark.mplaunch(nprocs=2)  # timeout from the ini
    def test_hangs():
        record("hang", identity())
        if dist.get_rank() == 0:
            time.sleep(600)  # RANK-0-WAITS
        dist.barrier()  # RANK-1-WAITS

    def sleeper():
        record("fixture", identity())
        time.sleep(600)

    def test_fixture_has_the_ini_timeout(mplaunch):
        with pytest.raises(mpl.LaunchTimeout) as info:
            mplaunch(sleeper, nprocs=1)
        assert info.value.timeout == 6.0
        assert "time.sleep(600)" in str(info.value)

    @pytest.mark.mplaunch(nprocs=2, timeout=120)
    def test_next_test_runs():
        record("next", identity())
        t = torch.ones(1)
        dist.all_reduce(t)
        assert t.item() == 2.0
    """)
    result = _run(pytester)
    result.assert_outcomes(failed=1, passed=2)
    text = result.stdout.str()
    assert ("mplaunch.LaunchTimeout: launch timed out after 6 s; 2 rank(s) still running"
            in text)
    # each rank's stack, rank by rank, with the line it waits on
    i0 = text.index("rank 0:")
    assert i0 < text.index("time.sleep(600)  # RANK-0-WAITS") < text.index("rank 1:") \
        < text.index("dist.barrier()  # RANK-1-WAITS")
    assert f"test_hang.py:{_line_of(pytester, 'test_hang', 'timeout from the ini')}: " \
           "LaunchTimeout" in text
    procs = _recorded_pids(out)
    assert len([f for f in out.iterdir() if f.name.startswith("hang-")]) == 2
    assert len(procs) >= 4  # the ranks and their server
    assert_gone(procs)


@pytest.mark.slow
def test_xdist_workers_each_have_their_own_server(pytester):
    _inner_ini(pytester)
    out = _write_tests(pytester, "test_xd", helpers=IDENTITY, source="""
    @pytest.mark.parametrize("i", range(4))
    @pytest.mark.mplaunch(nprocs=2)
    def test_all_reduce(i):
        t = torch.tensor([float(i)])
        dist.all_reduce(t)
        assert t.item() == 2.0 * i
        record(f"t{i}", identity() + " " + os.environ["PYTEST_XDIST_WORKER"] + " "
               + os.environ["MASTER_PORT"])
    """)
    result = _run(pytester, "-n", "2")
    result.assert_outcomes(passed=4)
    rows = [f.read_text().split() for f in out.iterdir()]
    assert len(rows) == 8
    servers_of = {}
    for _pid, ppid, _created, worker, _port in rows:
        servers_of.setdefault(worker, set()).add(ppid)
    assert sorted(servers_of) == ["gw0", "gw1"]
    # one warm server per xdist worker, reused by all of its tests, shared with no one
    assert all(len(s) == 1 for s in servers_of.values())
    assert servers_of["gw0"] != servers_of["gw1"]
    ports = {}
    for f in out.iterdir():
        ports.setdefault(f.name.split("-")[0], set()).add(f.read_text().split()[4])
    assert all(len(p) == 1 for p in ports.values())  # both ranks of a test: one store
    assert_gone(_recorded_pids(out))


# -- the outcome rule, on records -------------------------------------------------------

def _failure(rank, exc_type, message, ts):
    return RankFailure(rank, pid=100 + rank, exitcode=1, exc_type=exc_type,
                       message=message, traceback=f"Traceback: {message}\n", timestamp=ts)


OUTCOME = f"{pytest_plugin._RankOutcome.__module__}._RankOutcome"


def test_the_first_failing_rank_decides_the_outcome():
    # rank 1 skipped; rank 0's collective then broke because rank 1 had left
    err = WorkerError([_failure(1, OUTCOME, "skip: no GPU", 1.0),
                       _failure(0, "RuntimeError", "Connection reset by peer", 2.0)])
    err.__cause__ = pytest_plugin._RankOutcome("skip", "no GPU")
    out = pytest_plugin._outcome_for(err, 2, item=None)
    assert isinstance(out, pytest.skip.Exception) and out.msg == "no GPU"


def test_a_failure_names_its_rank_and_those_that_failed_after_it():
    err = WorkerError([_failure(1, "ValueError", "bad", 1.0),
                       _failure(0, "RuntimeError", "Connection reset by peer", 2.0)])
    err.__cause__ = ValueError("bad")
    out = pytest_plugin._outcome_for(err, 2, item=None)
    assert out is err.__cause__
    assert out.__notes__ == ["[mplaunch] raised in rank 1 of 2 (pid 101); then: rank 0 "
                             "(pid 100) raised RuntimeError: Connection reset by peer"]


def test_the_marker_is_registered_and_the_fixture_is_launch(pytester):
    pytester.makepyfile("""
        import functools
        import mplaunch as mpl

        def test_fixture(mplaunch):
            assert isinstance(mplaunch, functools.partial)
            assert mplaunch.func is mpl.launch
            assert mplaunch.keywords["nprocs"] == 2 and mplaunch.keywords["timeout"] is None
    """)
    result = pytester.runpytest_subprocess("--markers", "-p", "no:cacheprovider")
    result.stdout.fnmatch_lines(["@pytest.mark.mplaunch(nprocs=2, timeout=None, *"])
    result = pytester.runpytest_subprocess("--strict-markers", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)
