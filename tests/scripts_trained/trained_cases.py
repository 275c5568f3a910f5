"""Objects of the calling process's `__main__` that a World's ranks change in place
(_wire.mainglobals): a model and an optimizer built here and stepped by a run
(``opt.step()``, no ``global`` statement). One case per run of this script: ``python
trained_cases.py CASE START_METHOD``. Prints one ``RESULT {json}`` line: what the ranks
saw at each step, and the warnings this process got.

Each case is what users write in a notebook; test_world_trained.py says what each must
give."""
import json
import sys
import warnings

import torch

import mplaunch

torch.manual_seed(0)
x = torch.randn(64, 4)
y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]])
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.05)


def train():
    # What a notebook's training cell does: the model and optimizer are globals, only
    # changed in place. The loss before the first step says where training starts.
    first = None
    for _ in range(5):
        opt.zero_grad()
        loss = (model(x) - y).pow(2).mean()
        loss.backward()
        opt.step()
        first = loss.item() if first is None else first
    return round(first, 4)


def linked():
    # Does the optimizer step the model the ranks' __main__ holds?
    return (opt.param_groups[0]["params"][0] is model.weight,
            opt.param_groups[0]["lr"])


class Trainer:
    def __init__(self, model, opt):
        self.model, self.opt = model, opt


def trainer_linked():
    return trainer.model is model and trainer.opt is opt and sched.optimizer is opt


def train_scheduled():
    loss = train()
    sched.step()
    return loss, opt.param_groups[0]["lr"]


def build():
    global model
    model = torch.nn.Linear(4, 1)


def weight():
    return round(model.weight.sum().item(), 4)


def run_case(world, case, result):
    global model, opt, trainer, sched
    if case == "trained":
        result["runs"] = [world.run(train) for _ in range(3)]
        # A new model here: the ranks take it, and say that what they trained is gone.
        model = torch.nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        result["rebound"] = [world.run(train) for _ in range(2)]
        # This process changes its model in place: the ranks take it again.
        with torch.no_grad():
            model.weight.zero_()
        result["changed here"] = world.run(train)
        result["linked"] = world.run(linked)
        result["caller"] = round(model.weight.sum().item(), 4)
    elif case == "linked":
        world.run(train)
        # A new optimizer only, over this process's (untrained) model: the ranks'
        # optimizer must step the ranks' model, so both are taken together.
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        result["new opt"] = world.run(train)
        result["linked"] = world.run(linked)
        # A scheduler and an object of this process's holding the model: the ranks
        # keep all of them together, linked.
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        trainer = Trainer(model, opt)
        result["scheduled"] = [world.run(train_scheduled) for _ in range(2)]
        result["trainer"] = [world.run(trainer_linked) for _ in range(2)]
    elif case == "kept":
        world.run(build)                       # `model` is the ranks' from now on
        result["first"] = world.run(weight)    # warned: their own 'model'
        result["same"] = world.run(weight)     # the same object here: said once
        model = torch.nn.Linear(4, 1)          # another model here: said again
        result["other"] = world.run(weight)
        result["other again"] = world.run(weight)
    else:
        raise SystemExit(f"unknown case {case!r}")


if __name__ == "__main__":
    case, method = sys.argv[1], sys.argv[2]
    result = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with mplaunch.World(2, start_method=method) as world:
            run_case(world, case, result)
    result["warnings"] = [f"{w.category.__name__}: {w.message}" for w in caught]
    print("RESULT " + json.dumps(result))
