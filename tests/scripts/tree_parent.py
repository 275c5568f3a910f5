"""A launching process for the lifecycle and signal tests, run as its own interpreter so
that it can be SIGKILLed or signalled: `tree_parent.py START_METHOD OUTDIR [light]`.

It launches 2 ranks of tree_rank.hold, which never return ("light": without a
DataLoader, and with no torch in the server or the ranks, which starts much faster). If launch raises
MainProcessError it prints one line `RESULT <json>` (the error's fields, which of the
pids the ranks recorded were still running when launch raised, and which still were a
moment later) and exits with 3."""
import json
import sys
import time

import mplaunch
import tree_rank

EXIT_MAIN_PROCESS_ERROR = 3


def main():
    method, outdir = sys.argv[1], sys.argv[2]
    light = sys.argv[3:] == ["light"]
    try:
        mplaunch.launch(tree_rank.hold, (outdir, not light), nprocs=2,
                        start_method=method, grace_period=3.0,
                        preload=() if light else None)
    except mplaunch.MainProcessError as exc:
        pids = tree_rank.recorded_pids(outdir)
        at_raise = [p for p in pids if tree_rank.is_running(p)]
        # A process sent SIGKILL is not dead until the kernel next schedules it; on a
        # busy machine that takes a moment, so "gone" also gets a short deadline.
        deadline = time.monotonic() + 2.0
        later = at_raise
        while later and time.monotonic() < deadline:
            time.sleep(0.01)
            later = [p for p in later if tree_rank.is_running(p)]
        print("RESULT " + json.dumps({
            "type": type(exc).__name__, "signal_no": exc.signal_no,
            "signal_name": exc.signal_name, "nprocs": exc.nprocs,
            "running_at_raise": at_raise, "running_after_deadline": later,
        }), flush=True)
        sys.exit(EXIT_MAIN_PROCESS_ERROR)
    sys.exit("launch returned, but its ranks never return")


if __name__ == "__main__":
    main()
