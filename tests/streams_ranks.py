"""Rank functions for tests/test_streams.py's terminal tests, importable by name from
the launching script (which is not a test module)."""
import os
import sys
import time


def _rank():
    return int(os.environ["RANK"])


def ask_name():
    if _rank() == 0:
        name = input("name? ")
        print("got", repr(name))
        return name, sys.stdin.isatty()
    return sys.stdin.read(), sys.stdin.isatty()


def stop_at_breakpoint():
    x = 41 + _rank()
    breakpoint()  # in every rank, as in code every rank runs
    return x


def who_reads():
    if sys.stdin.isatty():
        return input("line? ")
    assert sys.stdin.read() == ""
    return None


def describe_streams():
    return {"stdin": sys.stdin.isatty(), "stdout": sys.stdout.isatty(),
            "stderr": sys.stderr.isatty(), "fd1": os.isatty(1),
            "columns": os.environ.get("COLUMNS"), "lines": os.environ.get("LINES"),
            **{k: os.environ.get(k) for k in ("FORCE_COLOR", "NO_COLOR", "TERM")}}


def two_bars():
    from tqdm import tqdm
    # disable=None: tqdm draws only on a terminal, as it asks sys.stderr.isatty().
    bar = tqdm(range(30), desc=f"rank{_rank()}", disable=None, mininterval=0, miniters=1)
    drawn = not bar.disable
    for _ in bar:
        time.sleep(0.01)
    print("after the bar")
    return drawn


def two_bars_drawn_anyway():
    from tqdm import tqdm
    for _ in tqdm(range(30), desc=f"rank{_rank()}", mininterval=0, miniters=1, ncols=70):
        time.sleep(0.01)
    print("after the bar")
    return _rank()
