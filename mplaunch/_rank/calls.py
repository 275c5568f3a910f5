"""Small wrappers that a front-end sends to the ranks by reference, so that unpickling
one in a rank loads nothing of the launching side."""
from __future__ import annotations

import os


def with_local_rank(fn, *args):
    """``fn(LOCAL_RANK, *args)``: the calling convention of torch.multiprocessing.spawn,
    whose process index is the rank's index on its node."""
    return fn(int(os.environ["LOCAL_RANK"]), *args)
