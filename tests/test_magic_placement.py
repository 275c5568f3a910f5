"""%ranks start --gpus/--cpus, %%ranks --cpus, and %ranks showing each rank's device and
CPUs, in a real Jupyter kernel (the machinery is test_notebook's)."""
from __future__ import annotations

import os

import pytest

pytest.importorskip("nbclient")

from test_notebook import (_errors, _plain, _stream, kernel_config,  # noqa: E402,F401
                           run_cells)

from mplaunch._engine.devices import format_cpus  # noqa: E402


@pytest.mark.notebook
def test_ranks_placed_per_rank_and_shown(kernel_config, tmp_path):
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2:
        pytest.skip("needs 2 CPUs to give 2 ranks one each")
    half = (len(allowed) + 1) // 2
    slices = [allowed[:half], allowed[half:]]
    sources = {
        "start": "%load_ext mplaunch\n%ranks start 2 --cpus per-rank --backend none",
        "where": ("%%ranks\n"
                  "import os\n"
                  "print('cpus', sorted(os.sched_getaffinity(0)),\n"
                  "      'threads', os.environ['OMP_NUM_THREADS'])"),
        "status": "%ranks",
        "gpus": ("import os\n"
                 "os.environ['CUDA_VISIBLE_DEVICES'] = 'GPU-aa,GPU-bb'\n"
                 "%ranks start --gpus 1,0 --cpus none\n"
                 "%ranks"),
        "cell_flag": ("%%ranks --gpus per-rank\nimport os\n"
                      "print('visible', os.environ['CUDA_VISIBLE_DEVICES'])"),
        "bad": "%ranks start --cpus 3",
        "stop": "%ranks stop",
    }
    cells = run_cells(sources, kernel_config, tmp_path, failing=("bad",))
    for name, cell in cells.items():
        if name != "bad":
            assert not _errors(cell), (name, cell.outputs)
    where = _stream(cells["where"])
    for rank, cpus in enumerate(slices):
        assert f"[rank{rank}]: cpus {cpus} threads {len(cpus)}" in where, where
    status = _stream(cells["status"])
    assert f"rank 0 (pid " in status and f"CPUs {format_cpus(slices[0])}" in status, status
    assert f"CPUs {format_cpus(slices[1])}" in status, status
    gpus = _stream(cells["gpus"])
    assert "GPU GPU-bb (its CUDA_VISIBLE_DEVICES)" in gpus, gpus
    assert "(shared)" in gpus, gpus
    flag = _stream(cells["cell_flag"])
    assert "[rank0]: visible GPU-aa" in flag and "[rank1]: visible GPU-bb" in flag, flag
    bad = cells["bad"]
    shown = _stream(bad, "stderr") + "".join(_plain(e["traceback"]) for e in _errors(bad))
    assert "--cpus takes per-rank or none" in shown, bad.outputs
