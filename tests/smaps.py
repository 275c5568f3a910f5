"""What a process holds in memory, from /proc (the tests of inputs shared copy-on-write,
and the scripts they run)."""
from __future__ import annotations

MiB = 1 << 20


def rollup(pid="self") -> dict:
    """/proc/PID/smaps_rollup in bytes; "USS" is what the process alone holds."""
    out = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            parts = line.split()
            if len(parts) == 3 and parts[2] == "kB":
                out[parts[0].rstrip(":")] = int(parts[1]) * 1024
    out["USS"] = out["Private_Clean"] + out["Private_Dirty"]
    return out
