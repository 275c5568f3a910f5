"""A PyTorch Lightning job as its users write it: a LightningModule, a DataLoader and
Trainer(strategy="ddp") on CPU. Run as a script (the watcher), or import fit() and call it
in ranks (launch, World, %%ranks). FAIL_RANK/FAIL_EPOCH make one rank raise mid-epoch;
PIDFILE_DIR makes every rank write its pid first."""
import os

import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, TensorDataset


class Model(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        if (os.environ.get("FAIL_RANK") == str(self.global_rank)
                and self.current_epoch == int(os.environ.get("FAIL_EPOCH", "1"))
                and batch_idx == 1):
            raise ValueError(f"rank {self.global_rank} fails mid-epoch")
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def data():
    g = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(64, 4, generator=g),
                                    torch.randn(64, 1, generator=g)), batch_size=8)


def trainer(epochs=2):
    return pl.Trainer(accelerator="cpu", devices=int(os.environ["LOCAL_WORLD_SIZE"]),
                      strategy="ddp", max_epochs=epochs, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False)


def fit(model=None, epochs=2):
    """(the model, a summary): trains `model` (a new one if None) for `epochs` more."""
    model = model if model is not None else Model()
    t = trainer(epochs)
    t.fit(model, data())
    env = type(t.strategy.cluster_environment).__name__
    return model, (t.global_rank, t.world_size, env, round(float(model.layer.bias.detach()), 6))


def fit_kept(epochs=1):
    """In a World: train the model this rank kept (a new one on the first call)."""
    import mplaunch
    state = mplaunch.rank_state()
    before = state.get("model")
    bias_before = None if before is None else round(float(before.layer.bias.detach()), 6)
    state["model"], summary = fit(before, epochs)
    return bias_before, summary


if __name__ == "__main__":
    if os.environ.get("PIDFILE_DIR"):
        with open(os.path.join(os.environ["PIDFILE_DIR"], f"rank{os.environ['RANK']}"), "w") as f:
            f.write(str(os.getpid()))
    model, summary = fit()
    print("lightning", *summary, flush=True)
