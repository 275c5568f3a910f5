"""The pytest marker's sizes (``nprocs=[1, 2, 4]``) and GPU skips, through real pytest
sessions (pytester subprocesses)."""
from __future__ import annotations

from procs import assert_gone
from test_plugin import IDENTITY, _inner_ini, _recorded_pids, _run, \
    _write_tests


def test_a_list_of_sizes_runs_the_test_once_per_size(pytester):
    _inner_ini(pytester)
    out = _write_tests(pytester, "test_sizes", helpers=IDENTITY, source="""
    @pytest.mark.mplaunch(nprocs=[1, 2, 3])
    def test_x():
        n = dist.get_world_size()
        assert int(os.environ["WORLD_SIZE"]) == n
        record(f"x{n}", identity())

    @pytest.mark.mplaunch([2, 1], backend=None)
    @pytest.mark.parametrize("p", ["a", "b"])
    def test_y(p):
        record(f"y{p}{os.environ['WORLD_SIZE']}", identity())

    @pytest.mark.mplaunch(nprocs=[2])
    def test_fails_in_size_two():
        assert dist.get_rank() == 0
    """)
    result = _run(pytester, "-v")
    result.assert_outcomes(passed=7, failed=1)
    result.stdout.fnmatch_lines(["*test_x?nprocs=1? PASSED*", "*test_x?nprocs=2? PASSED*",
                                 "*test_x?nprocs=3? PASSED*",
                                 "*test_y?nprocs=2-a? PASSED*",
                                 "*test_fails_in_size_two?nprocs=2? FAILED*"])
    names = {f.name for f in out.iterdir()}
    assert {"x1-rank0", "x2-rank1", "x3-rank2", "ya1-rank0", "yb2-rank1"} <= names
    assert "x1-rank1" not in names
    assert_gone(_recorded_pids(out))


def test_a_size_that_needs_more_gpus_than_the_machine_has_is_skipped(pytester):
    _inner_ini(pytester)
    pytester.makeconftest("""
        import os
        os.environ["CUDA_VISIBLE_DEVICES"] = "0,1"   # a machine with 2 GPUs
    """)
    _write_tests(pytester, "test_gpu_sizes", source="""
    @pytest.mark.mplaunch(nprocs=[2, 4], backend="nccl")
    def test_nccl():
        pass

    @pytest.mark.mplaunch(nprocs=3, gpus="per-rank", backend=None)
    def test_per_rank():
        pass

    @pytest.mark.mplaunch(backend=None, gpus=[0, 5])
    def test_list():
        pass
    """)
    result = _run(pytester, "--co", "-q")
    result.stdout.fnmatch_lines(["*test_nccl?nprocs=2?", "*test_nccl?nprocs=4?"])
    result = _run(pytester)
    # nprocs=2 has its GPUs: it runs (and fails here, where torch has no NCCL), never
    # skipped; nprocs=4 is skipped, with the counts.
    result.stdout.fnmatch_lines([
        "*SKIPPED*test_gpu_sizes.py:*backend='nccl' with 4 ranks needs 4 GPUs; this "
        "machine has 2*",
        "*SKIPPED*gpus='per-rank' with 3 ranks needs 3 GPUs; this machine has 2*",
        "*SKIPPED*gpus=[[]0, 5[]] with 2 ranks needs 6 GPUs; this machine has 2*"])
    result.assert_outcomes(skipped=3, failed=1)


def test_reuse_keeps_one_world_per_size(pytester):
    _inner_ini(pytester)
    out = _write_tests(pytester, "test_reuse_sizes", helpers=IDENTITY, source="""
    sizes = pytest.mark.mplaunch(nprocs=[1, 2], reuse=True)

    @sizes
    def test_a():
        record(f"a{dist.get_world_size()}", identity())

    @sizes
    def test_b():
        record(f"b{dist.get_world_size()}", identity())
    """)
    result = _run(pytester, "-v")
    result.assert_outcomes(passed=4)

    def pid(name):
        return (out / name).read_text().split()[0]
    # Grouped by size: both tests of a size ran in the same ranks.
    assert pid("a1-rank0") == pid("b1-rank0")
    assert pid("a2-rank0") == pid("b2-rank0") and pid("a2-rank1") == pid("b2-rank1")
    assert pid("a1-rank0") != pid("a2-rank0")
    assert_gone(_recorded_pids(out))


def test_nodes_or_a_scheduler_without_reuse_is_a_usage_error_naming_what_was_given(
        pytester):
    # A World across nodes (SLURM's or Ray's) is kept for the next tests: a test that
    # asks for one without reuse=True is told so, before anything starts.
    _inner_ini(pytester)
    for marker, what in (('nnodes=2', "nnodes=2"), ('scheduler="ray"', "scheduler='ray'")):
        pytester.makepyfile(test_nodes=f"""
            import pytest

            @pytest.mark.mplaunch(2, {marker})
            def test_x():
                pass
            """)
        result = _run(pytester)
        assert result.ret == 4, result.stdout.str() + result.stderr.str()
        result.stderr.fnmatch_lines([f"*test_x: {what} runs the test in a World across "
                                     "the nodes of this SLURM allocation*reuse=True too*"])
        assert "INTERNALERROR" not in result.stdout.str() + result.stderr.str()
