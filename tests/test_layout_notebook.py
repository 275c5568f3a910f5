"""What a %%ranks cell's ranks have loaded, in a real kernel: mplaunch's rank side and
wire only (and the server they were forked from), never _engine or a front-end. The
same check for launch, World.run and the plugin is in test_layout.py."""
from __future__ import annotations

import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

from test_layout import RANK_SIDE  # noqa: E402
from test_notebook import kernel_config  # noqa: E402,F401 - the fixture

pytestmark = pytest.mark.notebook


def test_a_ranks_cells_ranks_load_nothing_of_the_launching_side(kernel_config, tmp_path):
    from test_notebook import _errors, _stream, run_cells
    sources = {
        "start": "%load_ext mplaunch\n%ranks start 2 --backend none",
        "cell": ("%%ranks\nimport sys\n"
                 f"side = {RANK_SIDE!r}\n"
                 "out = [m for m in sys.modules if m.startswith('mplaunch.') "
                 "and m.split('.')[1] not in side]\n"
                 "print('outside', out)"),
        "stop": "%ranks stop",
    }
    cells = run_cells(sources, kernel_config, tmp_path)
    for name, cell in cells.items():
        assert not _errors(cell), (name, cell.outputs)
    assert sorted(_stream(cells["cell"]).splitlines()) == ["[rank0]: outside []",
                                                           "[rank1]: outside []"]
