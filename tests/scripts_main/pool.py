# A plain script, no `if __name__ == "__main__":` guard, whose class and function the
# rank pickles by reference, itself and through multiprocessing.Pool workers.
# Usage: python pool.py START_METHOD CONTEXT[,CONTEXT...]   (or the same code with -c)
import json
import multiprocessing
import os
import pickle
import sys

import mplaunch

# Each run of the top level leaves a line: only the launching process may run it.
with open(os.environ["MAIN_RUNS_FILE"], "a") as f:
    f.write(f"{os.getpid()}\n")

OFFSET = 100


class P:
    def __init__(self, x):
        self.x = x


def square(x):
    return x * x + OFFSET


def work(contexts):
    out = {"pickle": pickle.loads(pickle.dumps(P(3))).x,
           "file": os.path.basename(globals().get("__file__", "-"))}
    for ctx in contexts:
        with multiprocessing.get_context(ctx).Pool(2) as pool:
            out[ctx] = pool.map(square, [1, 2, 3])
    return out, P(int(os.environ["RANK"]))


results = mplaunch.launch(work, args=(sys.argv[2].split(","),), nprocs=2,
                          start_method=sys.argv[1])
print("RESULT " + json.dumps({"ranks": [r[0] for r in results],
                              "same_class": [type(r[1]) is P for r in results]}))
