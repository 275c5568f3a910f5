"""Objects of the calling process that a World's ranks change in place (issue 38, item
5; _wire.mainglobals, docs/world.rst world-globals): a model and its optimizer built in
a notebook's cell and stepped by a run (``opt.step()``, no ``global``) went on training
in the ranks only within one run: every run sent this process's untrained copies again,
and the loss started over each time, with no word. The ranks now keep their copies while
this process's objects stay the same and unchanged, take this process's where it rebinds
or changes them (and say that what they trained is gone), and keep an object with the
objects it shares tensors with. A name the ranks' own code assigned is said again for
another object of this process's.

Each case runs tests/scripts_trained/trained_cases.py in a fresh interpreter, with a
real World, and then a real kernel: what is under test is that `__main__`.
"""
from __future__ import annotations

import os

import pytest

from test_notebook import _stream, kernel_config, run_clean_cells  # noqa: F401
from test_world_main import _run_script

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "scripts_trained", "trained_cases.py")

# Each runs a World through several calls or a kernel: 6-12 s on 2 cores.
pytestmark = pytest.mark.slow


def _case(tmp_path, case: str, method: str) -> dict:
    with open(SCRIPT) as f:
        source = f.read()
    return _run_script(tmp_path, source, case, method)


def _replaced(warned, name, reason):
    return [w for w in warned if w.startswith(
        f"UserWarning: mplaunch.World: the ranks had changed their {name!r} in place "
        f"since they got it (trained it, say), and took this process's {name!r} "
        f"instead: {reason}")]


def test_a_model_the_ranks_train_goes_on_training_from_run_to_run(tmp_path):
    result = _case(tmp_path, "trained", "forkserver")
    losses = [run[0] for run in result["runs"]]
    # Each run starts where the last one ended: it used to be the same loss 3 times.
    assert losses[0] > losses[1] > losses[2], result
    assert all(run[0] == run[1] for run in result["runs"]), result   # both ranks
    warned = result["warnings"]
    # A new model and optimizer here: the ranks take them (training starts again from
    # the new model) and say that what they trained is gone, at that run; the next run
    # goes on from there.
    rebound = [run[0] for run in result["rebound"]]
    assert rebound[0] > losses[2] and rebound[0] > rebound[1], result
    for name in ("model", "opt"):
        [said] = _replaced(warned, name, f"this process's {name!r} is not the object "
                                         f"it sent before. What they changed is gone.")
        assert f"build it in the ranks (global {name}; {name} = ...)" in said, said
    # This process changed its model in place: the ranks take it, and say so.
    assert result["changed here"][0] > rebound[1], result
    assert len(_replaced(warned, "model", "this process changed its 'model'")) == 1
    assert len(_replaced(warned, "opt", "this process changed its 'opt'")) == 1
    assert result["linked"] == [[True, 0.05]] * 2, result   # opt steps their model
    assert result["caller"] == 0.0, result                  # this process's: untouched
    assert len(warned) == 4, warned


def test_an_optimizer_and_what_it_steps_are_kept_or_taken_together(tmp_path):
    result = _case(tmp_path, "linked", "spawn")
    warned = result["warnings"]
    # A new optimizer here, over this process's (untrained) model: the ranks' optimizer
    # must step the model their __main__ holds, so they take this process's model too,
    # and say why.
    assert result["linked"] == [[True, 0.01]] * 2, result
    assert len(_replaced(warned, "model", "it shares tensors with this process's "
                                          "'opt', which the ranks took anew")) == 1
    # A scheduler over that optimizer: stepped in the ranks, kept with it from run to
    # run (its learning rate halves at each run, and the loss goes on down).
    (loss1, lr1), (loss2, lr2) = (run[0] for run in result["scheduled"])
    assert lr2 == lr1 / 2 and loss2 < loss1, result
    # An object of this process's that holds the model (sent anew at each run, with
    # copies of what it holds): the ranks take the copies it holds, so that the names
    # and the object agree, and say so.
    assert result["trainer"] == [[True, True]] * 2, result
    assert len(_replaced(warned, "model", "something else this run sent holds this "
                                          "process's 'model'")) == 1, warned


def test_a_name_the_ranks_assigned_is_said_again_for_another_object_here(tmp_path):
    result = _case(tmp_path, "kept", "fork")
    # The ranks' own model throughout: a name their code assigned is theirs.
    assert len({run[0] for key in ("first", "same", "other", "other again")
                for run in [result[key]]}) == 1, result
    kept = [w for w in result["warnings"] if w.startswith(
        "UserWarning: mplaunch.World: the ranks kept their own 'model' (their code "
        "assigned it), not this process's 'model'")]
    # Said for the model this process had first, then again for the other one it
    # made (it used to be said once in the World's life), not at each run.
    assert len(kept) == 2 and len(result["warnings"]) == 2, result["warnings"]


# -- a real kernel ----------------------------------------------------------------

KERNEL_CELLS = {
    "setup": (
        "import torch, mplaunch\n"
        "torch.manual_seed(0)\n"
        "x = torch.randn(64, 4)\n"
        "y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]])\n"
        "model = torch.nn.Linear(4, 1)\n"
        "opt = torch.optim.Adam(model.parameters(), lr=0.05)\n"
        "def train():\n"
        "    for _ in range(5):\n"
        "        opt.zero_grad()\n"
        "        loss = (model(x) - y).pow(2).mean()\n"
        "        loss.backward()\n"
        "        opt.step()\n"
        "    return round(loss.item(), 4)\n"
        "world = mplaunch.World(2)"),
    "train1": "print('loss', world.run(train)[0])",
    "train2": "print('loss', world.run(train)[0])",
    "train3": "print('loss', world.run(train)[0])",
    "rebind": ("model = torch.nn.Linear(4, 1)\n"
               "opt = torch.optim.Adam(model.parameters(), lr=0.05)\n"
               "print('loss', world.run(train)[0])"),
    "again": "print('loss', world.run(train)[0])\nworld.close()",
}


@pytest.mark.notebook
def test_a_kernels_model_trains_on_from_cell_to_cell(kernel_config, tmp_path):
    cells, _, _ = run_clean_cells(KERNEL_CELLS, kernel_config, tmp_path)
    loss = {name: float(_stream(cells[name]).split()[-1])
            for name in ("train1", "train2", "train3", "rebind", "again")}
    # Adam's state and the model stay in the ranks from cell to cell.
    assert loss["train1"] > loss["train2"] > loss["train3"], loss
    assert not any(_stream(cells[n], "stderr") for n in ("train2", "train3")), cells
    # A new model in a cell: the ranks take it, and the cell says so.
    assert loss["rebind"] > loss["train3"] and loss["again"] < loss["rebind"], loss
    err = _stream(cells["rebind"], "stderr")
    assert "the ranks had changed their 'model' in place" in err, err
    assert "the ranks had changed their 'opt' in place" in err, err
    assert not _stream(cells["again"], "stderr"), cells["again"]
