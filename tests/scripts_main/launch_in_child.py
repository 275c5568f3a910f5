# mplaunch.launch called in a child of multiprocessing's spawn or forkserver, where this
# script's functions live in `__mp_main__`.
# Usage: python launch_in_child.py CONTEXT START_METHOD
import json
import multiprocessing
import os
import pickle
import sys

import mplaunch


class P:
    def __init__(self, x):
        self.x = x


def f(k):
    return pickle.loads(pickle.dumps(P(k + int(os.environ["RANK"])))).x


def job(start_method):
    return mplaunch.launch(f, args=(10,), nprocs=2, start_method=start_method)


if __name__ == "__main__":
    with multiprocessing.get_context(sys.argv[1]).Pool(1) as pool:
        print("RESULT " + json.dumps(pool.apply(job, (sys.argv[2],))))
