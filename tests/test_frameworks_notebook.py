"""The frameworks in a notebook, in a real Jupyter kernel: Lightning's Trainer.fit and
accelerate's Accelerator in %%ranks cells, twice, the model kept between the cells (what
Lightning's own ddp_notebook strategy cannot do after a failure: see docs/notebooks.rst).
The classes and loops are defined in the cells, as a notebook's user writes them."""
from __future__ import annotations

import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
FRAMEWORKS = os.path.join(HERE, "frameworks")
if HERE not in sys.path:
    sys.path.insert(0, HERE)

from test_notebook import kernel_config  # noqa: E402,F401 - the fixture

pytestmark = pytest.mark.notebook

_LIGHTNING = f"""%%ranks
import sys
sys.path.insert(0, {FRAMEWORKS!r})
import torch
import pytorch_lightning as pl
from lightning_job import data

class Net(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

net = Net()

def fit(epochs=1):
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=epochs,
                         logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(net, data())
    return round(float(net.layer.bias.detach()), 6)

first = fit()
print("pl first", trainer_rank := torch.distributed.get_rank(), first)
"""

_ACCELERATE = """%%ranks
from accelerate import Accelerator
from torch.utils.data import DataLoader, TensorDataset
accelerator = Accelerator(cpu=True)
g = torch.Generator().manual_seed(0)
loader = DataLoader(TensorDataset(torch.randn(32, 4, generator=g),
                                  torch.randn(32, 1, generator=g)), batch_size=4)
amodel = torch.nn.Linear(4, 1)
aopt = torch.optim.SGD(amodel.parameters(), lr=0.1)
amodel, aopt, loader = accelerator.prepare(amodel, aopt, loader)

def epoch():
    for x, y in loader:
        aopt.zero_grad()
        accelerator.backward(torch.nn.functional.mse_loss(amodel(x), y))
        aopt.step()
    return accelerator.gather(torch.tensor([accelerator.process_index])).tolist()

print("acc first", accelerator.process_index, epoch())
"""


def test_lightning_and_accelerate_in_ranks_cells_keep_their_models(kernel_config, tmp_path):
    pytest.importorskip("pytorch_lightning")
    pytest.importorskip("accelerate")
    from test_notebook import _errors, _stream, run_cells
    sources = {
        "start": "%load_ext mplaunch\n%ranks start 2",
        "lightning": _LIGHTNING,
        "lightning-again": "%%ranks\nsecond = fit()\nprint('pl kept', second != first)",
        "accelerate": _ACCELERATE,
        "accelerate-again": ("%%ranks\nbefore = float(amodel.module.bias) if hasattr(amodel, "
                             "'module') else float(amodel.bias)\n"
                             "print('acc kept', epoch(), before != float(accelerator."
                             "unwrap_model(amodel).bias))"),
        "stop": "%ranks stop",
    }
    cells = run_cells(sources, kernel_config, tmp_path)
    for name, cell in cells.items():
        assert not _errors(cell), (name, cell.outputs)
    lines = lambda name: sorted(line for line in _stream(cells[name]).splitlines()  # noqa: E731
                                if line.split(": ", 1)[-1].split(" ")[0] in ("pl", "acc"))
    first = lines("lightning")
    assert len(first) == 2 and first[0].startswith("[rank0]: pl first 0 "), first
    assert first[0].split()[-1] == first[1].split()[-1]    # the replicas agree
    assert lines("lightning-again") == ["[rank0]: pl kept True", "[rank1]: pl kept True"]
    assert lines("accelerate") == ["[rank0]: acc first 0 [0, 1]",
                                   "[rank1]: acc first 1 [0, 1]"]
    assert lines("accelerate-again") == ["[rank0]: acc kept [0, 1] True",
                                         "[rank1]: acc kept [0, 1] True"]


def test_every_form_of_init_process_group_in_ranks_cells(kernel_config, tmp_path):
    """%%ranks with no group of mplaunch's (--backend none): the user's cells set it up
    in each of the forms of test_init_forms; then a group made as the DDP tutorial makes
    it stays up across cells."""
    from test_init_forms import ALL, expected, places
    from test_notebook import _errors, _stream, run_cells
    scripts = os.path.join(HERE, "scripts")
    sources = {
        "start": "%load_ext mplaunch\n%ranks start 2 --backend none",
        "forms": (f"%%ranks\nimport sys\nsys.path.insert(0, {scripts!r})\n"
                  "from init_forms import run_forms\n"
                  f"print('forms', run_forms({ALL!r}, {places(tmp_path)!r}) == "
                  f"{expected(ALL, 2)!r})"),
        "tutorial": ("%%ranks\nimport os, torch, torch.distributed as dist\n"
                     "dist.init_process_group('gloo', rank=int(os.environ['RANK']), "
                     "world_size=int(os.environ['WORLD_SIZE']))"),
        "later": ("%%ranks\nt = torch.ones(1)\ndist.all_reduce(t)\n"
                  "print('later', t.item())"),
        "stop": "%ranks stop",
    }
    cells = run_cells(sources, kernel_config, tmp_path)
    for name, cell in cells.items():
        assert not _errors(cell), (name, cell.outputs)
    assert sorted(_stream(cells["forms"]).splitlines()) == ["[rank0]: forms True",
                                                            "[rank1]: forms True"]
    assert sorted(_stream(cells["later"]).splitlines()) == ["[rank0]: later 2.0",
                                                            "[rank1]: later 2.0"]
