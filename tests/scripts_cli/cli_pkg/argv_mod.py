"""Run with `mplaunch -m cli_pkg.argv_mod`."""
import json
import os
import sys

if __name__ == "__main__":
    print("MOD " + json.dumps({"rank": int(os.environ["RANK"]), "argv": sys.argv,
                               "path0": sys.path[0]}))
