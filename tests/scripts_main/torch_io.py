# A plain script, no `if __name__ == "__main__":` guard: torch.save of a module whose
# class is defined here, and DataLoader workers over a Dataset defined here.
# Usage: python torch_io.py START_METHOD CONTEXT[,CONTEXT...]   (or the same code with -c)
import io
import json
import os
import sys

import torch

import mplaunch

# Each run of the top level leaves a line: only the launching process may run it.
with open(os.environ["MAIN_RUNS_FILE"], "a") as f:
    f.write(f"{os.getpid()}\n")

SCALE = 10


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(2, 1)


class Squares(torch.utils.data.Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, i):
        return i * i * SCALE


def work(contexts):
    buf = io.BytesIO()
    torch.save(Net(), buf)
    buf.seek(0)
    out = {"torch_load": type(torch.load(buf, weights_only=False)).__name__}
    for ctx in contexts:
        loader = torch.utils.data.DataLoader(Squares(), batch_size=2, num_workers=1,
                                             multiprocessing_context=ctx)
        out[ctx] = [b.tolist() for b in loader]
    return out


results = mplaunch.launch(work, args=(sys.argv[2].split(","),), nprocs=1,
                          start_method=sys.argv[1])
print("RESULT " + json.dumps(results))
