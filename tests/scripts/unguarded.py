# Deliberately no `if __name__ == "__main__":` guard: mplaunch must never re-run a
# script's top level in its ranks. `unguarded.py START_METHOD COUNTFILE`
import json
import os
import sys

import mplaunch

method, countfile = sys.argv[1], sys.argv[2]
with open(countfile, "a") as f:
    f.write(f"{os.getpid()}\n")

offset = 100


def make_adder(k):
    def add(x):
        return x + k + offset + int(os.environ["RANK"])
    return add


doubled = mplaunch.launch(lambda: 2 * int(os.environ["RANK"]), nprocs=2, start_method=method)
added = mplaunch.launch(make_adder(7), (1,), 2, start_method=method)
print("RESULT " + json.dumps({"lambda": doubled, "closure": added}), flush=True)
