"""`python -m mplaunch` and the `mplaunch` command; see `mplaunch --help`."""
import sys

from ._cli.main import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
