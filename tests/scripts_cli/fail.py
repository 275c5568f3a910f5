"""Rank 1 fails the way argv[1] says; the other ranks wait to be torn down."""
import os
import resource
import signal
import sys
import time


def fail(how):
    if how == "exit":
        sys.exit(int(sys.argv[2]))
    if how == "raise":
        raise ValueError("boom from rank 1")
    if how == "signal":
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no core file from SIGSEGV
        print("about to die", file=sys.stderr, flush=True)
        os.kill(os.getpid(), getattr(signal, sys.argv[2]))
        time.sleep(30)


if os.environ["RANK"] == "1":
    fail(sys.argv[1])
else:
    time.sleep(120)
