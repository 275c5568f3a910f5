"""Prints the names of the launcher variables a rank sees (its environment less the
parent's), for comparing torchrun and the watcher."""
import json
import os

parent = set(json.loads(os.environ.pop("PARENT_ENV_NAMES")))
names = sorted(k for k in os.environ if k not in parent)
print("ENV", os.environ["RANK"], json.dumps(names), flush=True)
