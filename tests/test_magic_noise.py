"""What a failed %%ranks cell or %ranks pull shows in a real Jupyter kernel: each thing
said once, and what to do about it.

- A dead rank: what the healed world kept is said once, not twice.
- A typo in a cell: one traceback (the cell's error), not one relayed per rank above it,
  and which ranks raised the same.
- A NameError for one of the notebook's variables: that it is the notebook's, and how
  to send it (``%ranks push x``).
- ``%ranks pull`` of a DistributedDataParallel module: the rank raised nothing; the
  kernel could not rebuild it outside a process group; pull ``model.module`` or its
  ``state_dict()``.

The kernel machinery (kernelspec, process tree, output helpers) is test_notebook's.
"""
from __future__ import annotations

import re

import pytest

pytest.importorskip("nbclient")

from test_notebook import (_errors, _plain, _stream, kernel_config,  # noqa: E402,F401
                           run_cells)

# Each test drives a kernel of its own: 7-11 s on 2 cores, run with the slow set.
pytestmark = [pytest.mark.notebook, pytest.mark.slow]


def _error(cell) -> tuple:
    """(ename, the error as the cell shows it, without colours) of a failed cell."""
    [error] = _errors(cell)
    return error["ename"], _plain(error["traceback"])


def test_dead_rank_says_once_what_the_world_kept(kernel_config, tmp_path):
    cells = run_cells({
        "start": "%load_ext mplaunch\n%ranks start 2",
        "die": ("%%ranks\n"
                "import os\n"
                "if os.environ['RANK'] == '1':\n"
                "    os._exit(3)\n"
                "print('alive')"),
        "after": "%%ranks\nprint('up again')",
        "stop": "%ranks stop",
    }, kernel_config, tmp_path, failing=("die",))
    ename, shown = _error(cells["die"])
    assert ename == "WorkerError", shown
    assert "rank 1 (pid " in shown and "exited with code 3" in shown, shown
    # (mplaunch's own frame is shown too, its comment saying "the world was kept.")
    assert shown.count("the world was kept: its ranks") == 1, shown
    assert re.search(r"^%ranks: the world was kept: its ranks and their state; rank\(s\) "
                     r"\[1\] died and were replaced by fresh processes", shown, re.M), shown
    assert shown.count("died and were replaced by fresh processes") == 1, shown
    out = sorted(_stream(cells["after"]).splitlines())
    assert out == ["[rank0]: up again", "[rank1]: up again"], out


def test_typo_shows_one_traceback_and_which_ranks_raised_the_same(kernel_config,
                                                                  tmp_path):
    cells = run_cells({
        "start": "%load_ext mplaunch\n%ranks start 3",
        "typo": ("%%ranks\n"
                 "import os\n"
                 "rank = int(os.environ['RANK'])\n"
                 "print('before the typo')\n"
                 "prnt('oops')"),
        "differ": ("%%ranks\n"
                   "if rank == 2:\n"
                   "    raise ValueError('rank two is different')\n"
                   "raise KeyError('same')"),
        "stop": "%ranks stop",
    }, kernel_config, tmp_path, failing=("typo", "differ"))

    typo = cells["typo"]
    ename, shown = _error(typo)
    assert ename == "NameError", shown
    # The cell's error, once: no rank's traceback relayed above it.
    assert shown.count("NameError: name 'prnt' is not defined") == 1, shown
    err = _stream(typo, "stderr")
    assert "Traceback" not in err and "NameError" not in err, err
    assert sorted(_stream(typo).splitlines()) == [
        f"[rank{r}]: before the typo" for r in range(3)], typo.outputs
    # Which ranks raised the same.
    match = re.search(r"^%%ranks: rank (\d) \(pid \d+\) raised this; ranks (\d), (\d) "
                      r"raised the same; the world was kept: ", shown, re.M)
    assert match, shown
    first, *same = map(int, match.groups())
    assert same == sorted(same) and sorted([first, *same]) == [0, 1, 2], shown

    # Ranks that raised something else are said, alike ones together.
    ename, shown = _error(cells["differ"])
    err = _stream(cells["differ"], "stderr")
    assert "Traceback" not in err, err
    if ename == "KeyError":
        assert re.search(r"; rank (0|1) raised the same; 1 more rank\(s\) failed "
                         r"otherwise: rank 2 \(pid \d+[^)]*\) raised ValueError: rank "
                         r"two is different \(at the cell's line 3 in <module>\); the "
                         r"world was kept", shown), shown
    else:
        assert ename == "ValueError", shown
        assert re.search(r"raised this; 2 more rank\(s\) failed otherwise: rank (0|1) "
                         r"\(pid \d+[^)]*\) raised KeyError: 'same' \(at the cell's "
                         r"line 4 in <module>\), and rank (0|1) the same; the world was "
                         r"kept", shown), shown


def test_name_error_for_a_notebook_variable_says_how_to_send_it(kernel_config,
                                                                tmp_path):
    cells = run_cells({
        "start": "%load_ext mplaunch\n%ranks start 2",
        "kernel": "import json\nx = [1.5, 2.5]",
        "use": "%%ranks\nfloat(sum(x))",
        "module": "%%ranks\njson.dumps(1)",
        "nowhere": "%%ranks\nnot_anywhere + 1",
        "push": "%ranks push x",
        "again": "%%ranks\nfloat(sum(x))",
        "stop": "%ranks stop",
    }, kernel_config, tmp_path, failing=("use", "module", "nowhere"))
    ename, shown = _error(cells["use"])
    assert ename == "NameError", shown
    assert re.search(r"^%%ranks: 'x' is a variable of the notebook, not of the ranks "
                     r"\(a %%ranks cell sees only the ranks' own names\)\. To send it to "
                     r"every rank: %ranks push x$", shown, re.M), shown
    ename, shown = _error(cells["module"])
    assert ename == "NameError", shown
    assert re.search(r"^%%ranks: 'json' is a module imported in the notebook; the ranks "
                     r"have their own imports: import json in a %%ranks cell$",
                     shown, re.M), shown
    ename, shown = _error(cells["nowhere"])
    assert ename == "NameError" and "not_anywhere" in shown, shown
    assert "of the notebook" not in shown and "%ranks push" not in shown, shown
    out = sorted(_stream(cells["again"]).splitlines())
    assert out == ["[rank0]: 4.0", "[rank1]: 4.0"], out


def test_pull_of_a_ddp_module_says_the_kernel_cannot_rebuild_it(kernel_config,
                                                                 tmp_path):
    cells = run_cells({
        "start": "%load_ext mplaunch\n%ranks start 2",
        "build": ("%%ranks\n"
                  "import torch\n"
                  "from torch.nn.parallel import DistributedDataParallel as DDP\n"
                  "torch.manual_seed(0)\n"
                  "model = DDP(torch.nn.Linear(2, 1))"),
        "pull": "models = %ranks pull model",
        "inner": "%%ranks\nnet = model.module",
        "pull-inner": ("nets = %ranks pull net\n"
                       "print(type(nets[0]).__name__, len(nets),\n"
                       "      bool((nets[0].weight == nets[1].weight).all()))"),
        "stop": "%ranks stop",
    }, kernel_config, tmp_path, failing=("pull",))
    # A UsageError: IPython shows it as one line on stderr.
    shown = _stream(cells["pull"], "stderr")
    assert "raised ValueError" not in shown, shown
    assert re.fullmatch(r"UsageError: %ranks pull: rank 0 raised nothing, but the kernel "
                        r"could not rebuild its 'model', a DistributedDataParallel \("
                        r"[^\n]*process group[^\n]*\)\. A DistributedDataParallel can "
                        r"be rebuilt only inside a process group, and the kernel is in "
                        r"none: pull the module it wraps, or its weights\. In a %%ranks "
                        r"cell: net = model\.module \(or weights = model\.module\."
                        r"state_dict\(\)\), then %ranks pull net\n", shown), shown
    # The ranks still hold it, and what the error suggests works.
    assert _stream(cells["pull-inner"]) == "Linear 2 True\n", cells["pull-inner"].outputs
