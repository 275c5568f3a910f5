"""Appends a line to $COUNTED_IMPORT_LOG every time it is really imported."""
import os

with open(os.environ["COUNTED_IMPORT_LOG"], "a") as f:
    f.write(f"{os.getpid()}\n")

VALUE = 42
