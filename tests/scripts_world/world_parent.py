"""A process that holds a World or a Handle, for the tests that signal it, SIGKILL it or
let it exit: `world_parent.py MODE OUTDIR [START_METHOD]`.

Modes (ranks write OUTDIR/rank.<r>.json once their grandchildren are up):
  run             world.run(tree_rank.hold): ranks busy in a run that never returns
  idle            world.run(world_rank.grow) returns; the world then sits idle
  handle          mplaunch.start(tree_rank.hold), the main thread sleeping
  wait, result    the same, the main thread in handle.wait() / handle.result()
  exit-idle       as idle, then, once OUTDIR/exit exists, the script ends without
                  closing the world
  exit-handle     the same with a handle left running
The busy modes print `RESULT <json>` if the call raises MainProcessError (its fields,
which recorded pids still ran when it raised, and, for a World, the pids of the fresh
ranks the next run got) and exit with 3. Light ranks: no torch, no DataLoader, unless
the mode ends with "+dl"."""
import json
import os
import signal
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(os.path.dirname(HERE), "scripts")]

import mplaunch  # noqa: E402
import tree_rank  # noqa: E402
import world_rank  # noqa: E402

EXIT_MAIN_PROCESS_ERROR = 3


def _wait_for_records(outdir, nprocs=2):
    while not all(os.path.exists(os.path.join(outdir, f"rank.{r}.json"))
                  for r in range(nprocs)):
        time.sleep(0.02)


def _exit_when_told(outdir):
    while not os.path.exists(os.path.join(outdir, "exit")):
        time.sleep(0.02)


def _report(exc, outdir, **extra):
    pids = tree_rank.recorded_pids(outdir)
    at_raise = [p for p in pids if tree_rank.is_running(p)]
    print("RESULT " + json.dumps({
        "type": type(exc).__name__, "signal_no": getattr(exc, "signal_no", None),
        "running_at_raise": at_raise, **extra}), flush=True)
    sys.exit(EXIT_MAIN_PROCESS_ERROR)


def main():
    mode, outdir = sys.argv[1], sys.argv[2]
    method = sys.argv[3] if len(sys.argv) > 3 else "forkserver"
    dataloader = mode.endswith("+dl")
    mode = mode.replace("+dl", "")
    opts = dict(start_method=method, grace_period=3.0,
                preload=None if dataloader else ())
    if mode in ("run", "idle", "exit-idle"):
        world = mplaunch.World(2, heal=False, **opts)
        if mode == "run":
            try:
                world.run(tree_rank.hold, (outdir, dataloader))
            except mplaunch.MainProcessError as exc:
                gone = world.pids
                _report(exc, outdir, pids_after=gone,
                        next_run=world.run(world_rank.pid))
            sys.exit("world.run returned, but tree_rank.hold never returns")
        world.run(world_rank.grow, (outdir, dataloader))
        print("READY", flush=True)
        if mode == "exit-idle":
            _exit_when_told(outdir)
            return  # the world is left open: interpreter exit must close it
        time.sleep(600)
        return
    handle = mplaunch.start(tree_rank.hold, (outdir, dataloader), 2, **opts)
    _wait_for_records(outdir)
    if mode in ("wait", "result"):
        _ready_once_forwarding()
    else:
        print("READY", flush=True)
    if mode == "exit-handle":
        _exit_when_told(outdir)
        return  # the handle is left running: interpreter exit must stop it
    try:
        if mode == "wait":
            assert handle.wait() is True
            handle.result()
        elif mode == "result":
            handle.result()
        else:
            time.sleep(600)
    except mplaunch.MainProcessError as exc:
        _report(exc, outdir, done=handle.done())
    sys.exit("the handle's ranks never return")


def _ready_once_forwarding():
    """READY once handle.wait() forwards SIGINT: printed before it, a SIGINT sent at
    once could reach Python's own handler first, in the moment before wait() runs."""
    def watch():
        while signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            time.sleep(0.01)
        print("READY", flush=True)
    threading.Thread(target=watch, daemon=True).start()


if __name__ == "__main__":
    main()
