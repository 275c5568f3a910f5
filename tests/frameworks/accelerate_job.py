"""Hugging Face accelerate as its users write it: Accelerator(), prepare(), a training
loop with accelerator.backward(), and gather(). Call train() in ranks (launch, World,
%%ranks); train_kept() keeps the prepared objects in the rank between a World's calls."""
import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader, TensorDataset


def _objects(accelerator):
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(32, 4, generator=g), torch.randn(32, 1, generator=g))
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return accelerator.prepare(model, optimizer, DataLoader(data, batch_size=4))


def _epoch(accelerator, model, optimizer, loader):
    for x, y in loader:
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
    ranks = accelerator.gather(torch.tensor([accelerator.process_index]))
    weight = accelerator.unwrap_model(model).bias.detach()
    return {"process": accelerator.process_index, "processes": accelerator.num_processes,
            "type": str(accelerator.distributed_type), "gathered": ranks.tolist(),
            "bias": round(float(weight), 6)}


def train():
    accelerator = Accelerator(cpu=True)
    return _epoch(accelerator, *_objects(accelerator))


def train_kept():
    """One epoch more of the model this rank kept (prepared on the first call)."""
    import mplaunch
    state = mplaunch.rank_state()
    if "accelerate" not in state:
        accelerator = Accelerator(cpu=True)
        state["accelerate"] = (accelerator, *_objects(accelerator))
    return _epoch(*state["accelerate"])
