# No `if __name__ == "__main__":` guard, on purpose: a DataLoader worker started with
# forkserver or spawn must not run this file again (it would init_process_group again).
import os
import sys

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset

SCALE = 10


class Squares(Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, i):
        return torch.tensor(float(i * i * SCALE))


def total(loader):
    return float(sum(batch.sum() for batch in loader))


dist.init_process_group("gloo")
context = sys.argv[1]
loader = DataLoader(Squares(), batch_size=2, num_workers=2,
                    multiprocessing_context=context)
t = torch.tensor([total(loader)])
dist.all_reduce(t)
print(f"TOTAL rank {dist.get_rank()} {t.item()} pid {os.getpid()}", flush=True)
dist.destroy_process_group()
