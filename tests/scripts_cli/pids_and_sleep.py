"""Each rank starts a grandchild, records both pids in argv[1]/<rank>, and sleeps."""
import os
import subprocess
import sys
import time

child = subprocess.Popen(["sleep", "600"])
path = os.path.join(sys.argv[1], os.environ["RANK"])
with open(path + ".tmp", "w") as f:
    f.write(f"{os.getpid()} {child.pid}\n")
os.replace(path + ".tmp", path)
print("ready", flush=True)
time.sleep(600)
