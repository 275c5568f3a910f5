"""Prints what a rank sees of its command line, as one JSON line."""
import json
import os
import sys

print("ARGV " + json.dumps({
    "rank": int(os.environ["RANK"]),
    "world": int(os.environ["WORLD_SIZE"]),
    "argv": sys.argv,
    "name": __name__,
    "path0": sys.path[0],
    "cwd_in_path": os.getcwd() in sys.path,
    "watcher_dir_in_path": os.environ.get("CLI_TEST_WATCHER_DIR") in sys.path,
}))
