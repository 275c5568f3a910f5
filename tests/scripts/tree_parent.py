"""A launching process for the lifecycle and signal tests, run as its own interpreter so
that it can be SIGKILLed or signalled: `tree_parent.py START_METHOD OUTDIR`.

It launches 2 ranks of tree_rank.hold, which never return. If launch raises
MainProcessError it prints one line `RESULT <json>` (the error's fields, and which of
the pids the ranks recorded were still running when launch raised) and exits with 3."""
import json
import sys

import mplaunch
import tree_rank

EXIT_MAIN_PROCESS_ERROR = 3


def main():
    method, outdir = sys.argv[1], sys.argv[2]
    try:
        mplaunch.launch(tree_rank.hold, (outdir,), nprocs=2, start_method=method,
                        grace_period=3.0)
    except mplaunch.MainProcessError as exc:
        running = [p for p in tree_rank.recorded_pids(outdir) if tree_rank.is_running(p)]
        print("RESULT " + json.dumps({
            "type": type(exc).__name__, "signal_no": exc.signal_no,
            "signal_name": exc.signal_name, "nprocs": exc.nprocs,
            "running_after_raise": running,
        }), flush=True)
        sys.exit(EXIT_MAIN_PROCESS_ERROR)
    sys.exit("launch returned, but its ranks never return")


if __name__ == "__main__":
    main()
