"""Prints the names of the launcher variables a rank sees (its environment less the
parent's), for comparing torchrun and the watcher."""
import json
import os

parent = set(json.loads(os.environ.pop("PARENT_ENV_NAMES")))
names = sorted(k for k in os.environ if k not in parent)
# One write of the whole line: under torchrun both ranks share one stdout pipe, and
# print's pieces (unbuffered) interleave with the other rank's. A pipe keeps a write of
# up to PIPE_BUF (4096) bytes whole.
os.write(1, f"ENV {os.environ['RANK']} {json.dumps(names)}\n".encode())
