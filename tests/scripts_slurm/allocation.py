"""What the scripts run inside a test allocation share (not a script itself): the job's
id, one JSON line per check for test_slurm_world to parse, the job's steps as squeue
lists them, and whether a process (not ours to reap) is alive."""
import json
import os
import subprocess
import time

JOB = os.environ.get("SLURM_JOB_ID")


def say(check, **facts):
    print(json.dumps(dict(facts, check=check), sort_keys=True), flush=True)


def steps():
    """[[JOB.STEP, name], ...] of this job."""
    out = subprocess.run(["squeue", "-s", "-j", JOB, "-h", "-o", "%i %j"],
                         capture_output=True, text=True, timeout=30).stdout
    return [line.split(None, 1) for line in out.splitlines() if line.strip()]


def alive(pid):
    """Whether pid is a live process (not a zombie); these are not our children."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_for(pred, timeout=20.0):
    deadline = time.monotonic() + timeout
    while not pred() and time.monotonic() < deadline:
        time.sleep(0.1)
    return pred()
