"""The ledger of a World's `__main__` names (_wire.mainglobals), one case per run of
this script: ``python ledger_cases.py CASE START_METHOD``. Prints one ``RESULT {json}``
line: what the ranks saw at each step, and the warnings this process got.

Each case is what users write; test_world_ledger.py says what each must give."""
import functools
import json
import sys
import warnings

import torch

import mplaunch

model = torch.nn.Linear(2, 1)   # this process's model: never trained here
flag = 5                         # a small int: the same object in every process
mine = 0                         # a placeholder the ranks assign
helper_value = "helper"


def logged(fn):
    # A decorator of the caller's own, with functools.wraps.
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return fn(*args, **kwargs)
    return wrapper


@torch.no_grad()
def move_no_grad():
    global model
    model = model.double()       # Module.double returns self: the same object
    model.weight.fill_(1.0)


@logged
def move_logged():
    global model
    model = model.to(torch.float64)
    model.weight.data.fill_(2.0)


def move_passed():
    global model
    model = model.train().double()
    model.weight.data.fill_(3.0)


def apply(fn):
    return fn()


def move_cpu_float():
    global model
    model = model.cpu().float()
    model.weight.data.fill_(4.0)


def model_state():
    return [str(model.weight.dtype), model.weight.flatten()[0].item()]


def step():
    # A learning-rate schedule this process runs on its own `lr`; the ranks never
    # call it, but the attribute `opt.step` below has its name.
    global lr
    lr = lr / 2


def schedule_name():
    return step.__name__


def train_once():
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=lr)
    opt.step()
    return opt.param_groups[0]["lr"]


def read_flag():
    return flag


def set_flag():
    globals()["flag"] = 5


def set_mine():
    global mine
    mine = 7


def read_mine():
    return mine


def helper():
    return helper_value


def use_helper():
    return helper()


def run_case(world, case, result):
    global lr, flag, mine, helper
    if case == "decorated":
        world.run(move_no_grad)
        result["no_grad"] = world.run(model_state)
        world.restart()
        world.run(move_logged)
        result["wraps"] = world.run(model_state)
        world.restart()
        world.run(apply, args=(move_passed,))
        result["passed"] = world.run(model_state)
        world.restart()
        world.run(apply, kwargs={"fn": move_cpu_float})
        result["passed kwarg"] = world.run(model_state)
        result["caller"] = model_state()
    elif case == "attribute":
        # The ranks get `step` before this process has an `lr`, which it then sets,
        # and changes between runs.
        world.run(schedule_name)
        lr = 0.1
        seen = [world.run(train_once)]
        lr = 0.01
        seen.append(world.run(train_once))
        lr = 0.001
        seen.append(world.run(train_once))
        result["lr"] = seen
    elif case == "deleted":
        result["before"] = world.run(read_flag)
        world.run(set_mine)
        result["helper"] = world.run(use_helper)
        del flag, mine, helper
        for name, func in (("flag", read_flag), ("helper", use_helper)):
            try:
                result[f"{name} deleted"] = world.run(func)
            except mplaunch.WorkerError as exc:
                result[f"{name} deleted"] = type(exc.__cause__).__name__
        result["mine"] = world.run(read_mine)   # the ranks' own: theirs to keep
        try:
            result["launch"] = mplaunch.launch(read_flag, nprocs=2,
                                               start_method=sys.argv[2])
        except mplaunch.WorkerError as exc:
            result["launch"] = type(exc.__cause__).__name__
    elif case == "globals":
        result["before"] = world.run(read_flag)
        world.run(set_flag)             # binds the very int this process sent
        flag = 6
        result["flag"] = world.run(read_flag)
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
