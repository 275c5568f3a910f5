"""The `mplaunch` command: run a script, a module or a function in N ranks, and watch them.

The command is the ranks' watcher: it stays in the foreground, relays their output, tears
every rank down on the first failure or on a signal, and exits with a code that says what
happened. Everything here runs in the watcher; the ranks run through launch().
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import signal
import sys
import threading
from typing import List, Optional, Sequence

from . import torchrun
from .targets import UsageError, prepare
from .report import (Shown, exit_code_of, flush_stdout, print_stacks, report_failure,
                     say)
from .._engine.config import auto_nprocs, gpu_count
from .._engine.env import cpu_count
from .._placement_flags import argparse_type, parse_cpus_flag, parse_gpus_flag

EXIT_USAGE = 2
EXIT_TIMEOUT = 124  # what timeout(1) uses

_HANDLED_SIGNALS = tuple(getattr(signal, n) for n in ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT")
                         if hasattr(signal, n))

_DESCRIPTION = """\
Run a Python script, module or function in N processes (ranks) for PyTorch distributed
work, and watch them: every rank is started and watched by this command (through a
server process of its own), so a failing rank is seen at once, the others are stopped,
and nothing outlives the command.

  mplaunch -n 4 train.py --lr 0.1        run train.py as __main__ in 4 ranks
  mplaunch -n 4 -m package.module ARGS   run a module, like python -m
  mplaunch -n 4 package.module:function  call a function in 4 ranks

Options go before the script; everything after it is the script's own command line,
even arguments that look like mplaunch options (a '--' before the script is allowed).
Each rank has RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR and
MASTER_PORT set, so torch.distributed.init_process_group() works with env://.
"""

_EPILOG = """\
scripts and modules:
  Each rank runs the script as __main__ with sys.argv = [script, ARGS...], as python
  would (with -m, sys.argv[0] is the module's file). For a script, sys.path[0] is the
  script's directory; for -m and package.module:function, the current directory.

functions (package.module:function):
  The function (or any callable attribute, e.g. module:Class.method) is imported here
  first, so a typo is reported before any process starts, then imported again in each
  rank and called with no arguments, like a console_scripts entry point: the remaining
  arguments are in each rank's sys.argv[1:] (sys.argv[0] is the target as written). If
  it returns an int, that is the rank's exit code; any other return value is ignored.

exit status:
  0        every rank succeeded
  N        the first rank to fail exited with code N (1 for an uncaught exception)
  128+S    the first rank to fail was killed by signal S (139 for SIGSEGV, 137 for SIGKILL)
  124      --timeout expired (each rank's stack is printed)
  128+S    this command received signal S (130 for SIGINT/Ctrl-C, 143 for SIGTERM):
           every rank was sent it and torn down
  2        bad command line, or a script, module or function that does not exist
  A failure is summarised on stderr, on lines starting with "mplaunch: ": which rank
  failed, how, and the last lines of its stderr (for an exception whose traceback was
  relayed just above, where it was raised instead).

coming from torchrun:
  Options may be spelled with underscores (--log_dir). torchrun's other flags are
  understood too: --standalone is mplaunch's default (one node, a free port);
  --rdzv-*, --monitor-interval, --role, --run-path, --local-addr and
  --event-log-handler are ignored with a note; --redirects 3 and --tee need --log-dir;
  --numa-binding is --cpus per-rank; the rest (--no-python, ...) are refused with
  what to use instead.
  mplaunch needs torch in this Python: it hosts the ranks' store with torch.distributed.
"""


def _on_signal(signo, _frame):
    # launch() has its own handlers while ranks run; this one covers the rest of the
    # command's life, when no rank exists. It must not raise: an exception thrown into
    # arbitrary code (an import's bare `except:`, say) can be swallowed, and the command
    # would go on to start ranks after all. Leaving at once is safe: mplaunch's server
    # sees its lifeline close and stops whatever it had started.
    try:
        sys.stdout.flush()
    except BaseException:  # noqa: BLE001 - possibly interrupted mid-write
        pass
    try:
        os.write(2, f"mplaunch: received {signal.Signals(signo).name}; exiting\n".encode())
    except OSError:
        pass
    os._exit(128 + signo)


def _on_usr1(_signo, _frame):
    # Where every rank is, printed without stopping anything. Collecting takes up to
    # two seconds and the lock of the group the main thread is driving: not in a handler.
    threading.Thread(target=print_stacks, name="mplaunch-stacks", daemon=True).start()


# -- the command line ------------------------------------------------------------------

def _int_at_least(minimum: int):
    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an int, got {text!r}")
        if n < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {n}")
        return n
    return parse


_positive_int = _int_at_least(1)
_non_negative_int = _int_at_least(0)


def _nprocs(text: str) -> int:
    # "auto" is mplaunch's; "cpu" and "gpu" are torchrun's --nproc-per-node values too.
    if text == "auto":
        return auto_nprocs()
    if text == "cpu":
        return cpu_count()
    if text == "gpu":
        n = gpu_count()
        if not n:
            raise argparse.ArgumentTypeError("'gpu' counts CUDA GPUs, and this machine "
                                             "shows none; give a number, or 'cpu'")
        return n
    if text == "xpu":
        raise argparse.ArgumentTypeError("mplaunch counts CUDA GPUs ('gpu') and CPUs "
                                         "('cpu'); for XPUs give a number")
    return _positive_int(text)


def _nnodes(text: str) -> int:
    # torchrun also takes MIN:MAX for an elastic job; a fixed N:N is the same as N.
    low, sep, high = text.partition(":")
    if sep and low.strip() == high.strip():
        text = low
    elif sep:
        raise argparse.ArgumentTypeError(
            f"mplaunch runs a fixed number of nodes (no elastic MIN:MAX range); give one "
            f"number, got {text!r}")
    return _positive_int(text)


def _seconds(text: str) -> float:
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}")
    if not x >= 0 or x == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    return x


def _int_list(text: str) -> List[int]:
    try:
        return [int(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of ints, got "
                                         f"{text!r}")


def _name_list(text: str) -> List[str]:
    return [p.strip() for p in text.split(",") if p.strip()]


def build_parser() -> argparse.ArgumentParser:
    from .. import __version__
    from .._engine.config import START_METHODS
    p = argparse.ArgumentParser(
        prog="mplaunch", usage="%(prog)s -n N [options] [-m] script|package.module:function "
                               "[ARGS ...]",
        description=_DESCRIPTION, epilog=_EPILOG, allow_abbrev=False,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-n", "--nprocs", "--nproc-per-node", type=_nprocs, required=True,
                   metavar="N", dest="nprocs",
                   help="ranks on this node: a number, 'auto' (one per GPU, else one "
                        "per CPU), 'gpu' or 'cpu'")
    p.add_argument("-m", "--module", action="store_true",
                   help="the target is a module to run as __main__, like python -m")
    p.add_argument("--start-method", choices=START_METHODS, default=None,
                   help="forkserver (default: ranks are forked from a warm server that "
                        "has imported torch), spawn (each rank a fresh interpreter) or "
                        "fork")
    p.add_argument("--prefix", default=None, metavar="TEMPLATE",
                   help="prefix of each relayed line; fields {rank}, {local_rank}, "
                        "{node_rank}, {host} (default '[rank{rank}]: '; '' for none)")
    p.add_argument("--no-relay", dest="relay", action="store_false",
                   help="do not relay the ranks' stdout and stderr here")
    p.add_argument("--ranks-filter", "--local-ranks-filter", type=_int_list, default=None,
                   metavar="R,R,...", dest="ranks_filter",
                   help="relay only these local ranks' output (all still go to --log-dir)")
    p.add_argument("--log-dir", default=None, metavar="DIR",
                   help="write DIR/attempt_<n>/<rank>/stdout.log, stderr.log, and "
                        "error.json for a failing rank")
    p.add_argument("--timeout", type=_seconds, default=None, metavar="SECONDS",
                   help="stop after this long, print every rank's stack, exit 124")
    p.add_argument("--pdb", action="store_true",
                   help="a rank's uncaught error opens pdb at its frame, in this "
                        "terminal, one rank at a time (as MPLAUNCH_POST_MORTEM=1)")
    p.add_argument("--max-restarts", type=_non_negative_int, default=0, metavar="N",
                   help="on a failure, start every rank again up to N times")
    p.add_argument("--grace-period", "--shutdown-timeout", type=_seconds, default=None,
                   metavar="SECONDS", dest="grace_period",
                   help="between SIGTERM and SIGKILL when stopping ranks (default 5)")
    p.add_argument("--preload", type=_name_list, default=None, metavar="MOD,MOD,...",
                   help="modules the warm server imports once (default torch; '' for "
                        "none)")
    p.add_argument("--nnodes", type=_nnodes, default=None, metavar="N",
                   help="number of nodes (default 1, or from SLURM inside srun)")
    p.add_argument("--node-rank", type=_non_negative_int, default=None, metavar="I",
                   help="this node's index, 0 to nnodes-1 (node 0 hosts the store)")
    p.add_argument("--master-addr", default=None, metavar="HOST",
                   help="address of node 0 (default 127.0.0.1)")
    p.add_argument("--master-port", type=_port, default=None, metavar="PORT",
                   help="port of the store on node 0 (default: a free port, held for the "
                        "whole launch; required with --nnodes > 1)")
    p.add_argument("--backend", default=None, metavar="BACKEND",
                   help="each rank calls init_process_group(BACKEND) before the target and "
                        "destroy_process_group after it: gloo, nccl (each rank on its own "
                        "GPU), cpu:gloo,cuda:nccl")
    p.add_argument("--gpus", type=argparse_type(parse_gpus_flag), default=None,
                   metavar="per-rank|I,J,...",
                   help="per-rank: each rank sees one GPU of this process's; I,J,...: "
                        "those positions of its visible list, one per rank")
    p.add_argument("--cpus", type=argparse_type(parse_cpus_flag), default=None, metavar="per-rank",
                   help="per-rank: disjoint slices of this process's CPUs, one per rank "
                        "(within a NUMA node; OMP_NUM_THREADS their size)")
    p.add_argument("--version", action="version", version=f"mplaunch {__version__}")
    p.add_argument("target", metavar="script|package.module:function",
                   help="what every rank runs, followed by its own arguments")
    torchrun.add_arguments(p)
    return p


def _port(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}")
    if not 1 <= n <= 65535:
        raise argparse.ArgumentTypeError(f"must be in 1-65535, got {n}")
    return n


def _normalize(tok: str) -> str:
    # torchrun takes --nproc_per_node and --nproc-per-node alike; so does mplaunch, for
    # every option, without listing each spelling twice in --help.
    if not tok.startswith("--"):
        return tok
    name, eq, value = tok.partition("=")
    return name.replace("_", "-") + eq + value


def _walk(parser: argparse.ArgumentParser, argv: Sequence[str]):
    """(mplaunch's options, target, the target's arguments, the option words that name
    no option). The target is the first argument that is neither an option nor an
    option's value; what follows it is passed on untouched, '--' and option-like words
    included (argparse would eat a '--'). mplaunch's own long options come back with any
    '_' in their name spelled '-'."""
    known = parser._option_string_actions
    argv = list(argv)
    options: List[str] = []
    unknown: List[str] = []
    i = 0
    while i < len(argv):
        tok = argv[i]
        if tok == "--":
            if i + 1 >= len(argv):
                return options, None, [], unknown
            return options, argv[i + 1], argv[i + 2:], unknown
        if tok.startswith("-") and tok != "-":
            tok = _normalize(tok)
            options.append(tok)
            name = tok.partition("=")[0] if tok.startswith("--") else tok
            action = known.get(name) or (known.get(tok[:2]) if not tok.startswith("--")
                                         else None)
            if action is None:
                unknown.append(tok)
            elif name == tok and tok in known and action.nargs != 0 and i + 1 < len(argv):
                options.append(argv[i + 1])  # its value, whatever it looks like
                i += 1
            i += 1  # a flag, an attached value (-n4, --x=1), or unknown: argparse says
            continue
        return options, tok, argv[i + 1:], unknown
    return options, None, [], unknown


def _did_you_mean(parser: argparse.ArgumentParser, option: str) -> str:
    import difflib
    name = option.partition("=")[0]
    longs = [s for s in parser._option_string_actions if s.startswith("--")]
    close = difflib.get_close_matches(name, longs, n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close else ""


def parse_args(argv: Sequence[str]):
    """(parser, namespace) for a command line; exits with status 2 on a bad one, as
    argparse does. The namespace's `notes` are what the command should print first."""
    parser = build_parser()
    options, target, rest, unknown = _walk(parser, argv)
    if unknown and not {"-h", "--help", "--version"} & set(options):
        parser.error(f"unrecognized arguments: {unknown[0]}"
                     f"{_did_you_mean(parser, unknown[0])}")
    if target is None:
        ns = parser.parse_args(options)  # --help, --version, or the missing-target error
    else:
        ns = parser.parse_args(options + ["--", target])
    ns.args = rest
    try:
        ns.notes = torchrun.translate(ns, [s.name for s in _HANDLED_SIGNALS])
    except torchrun.Refused as exc:
        parser.error(str(exc))
    return parser, ns


def _launch_kwargs(ns) -> dict:
    kw = {"relay": ns.relay, "max_restarts": ns.max_restarts}
    # Only what was given: launch's own defaults (and SLURM detection) decide the rest.
    for name in ("start_method", "prefix", "ranks_filter", "log_dir", "timeout",
                 "grace_period", "preload", "nnodes", "node_rank", "master_addr",
                 "master_port", "backend", "gpus", "cpus"):
        value = getattr(ns, name)
        if value is not None:
            kw[name] = value
    return kw


# -- main ------------------------------------------------------------------------------

def _torch_missing() -> Optional[str]:
    """Why this Python cannot launch, when torch is not installed in it. The launch
    itself needs torch even for a script that does not: the ranks' rendezvous store is
    torch.distributed's TCPStore, hosted by this command."""
    try:
        if importlib.util.find_spec("torch") is not None:
            return None
    except (ImportError, ValueError):
        pass
    return (f"torch is not installed in this Python ({sys.executable}); install it with "
            "pip install torch (mplaunch hosts the ranks' store with torch.distributed)")


def run(argv: Sequence[str]) -> int:
    parser, ns = parse_args(argv)
    for note in ns.notes:
        say(f"note: {note}")
    missing = _torch_missing()
    if missing:
        say(f"error: {missing}")
        return EXIT_USAGE
    try:
        func, script = prepare(ns)
    except UsageError as exc:
        say(f"error: {exc}")
        return EXIT_USAGE

    if ns.pdb:
        os.environ["MPLAUNCH_POST_MORTEM"] = "1"   # read when a rank fails (_engine.debugging)
    from .._launch import run as run_launch
    from ..errors import LaunchTimeout, MainProcessError, WorkerError
    try:
        run_launch(func, (), ns.nprocs, _launch_kwargs(ns), script)
    except LaunchTimeout as err:
        flush_stdout()
        say(str(err))
        return EXIT_TIMEOUT
    except WorkerError as err:
        flush_stdout()
        code = exit_code_of(err.failures[0])
        report_failure(err, code, Shown.for_command_line(ns))
        return code
    except MainProcessError as err:
        flush_stdout()
        say(str(err))
        return 128 + err.signal_no
    except (TypeError, ValueError) as exc:
        # launch validates its arguments before anything starts
        say(f"error: {exc}")
        return EXIT_USAGE
    except (OSError, RuntimeError) as exc:
        # the store's port is taken, node 0 cannot be reached, the server failed...
        flush_stdout()
        say(f"error: {exc}")
        return 1
    except ImportError as exc:
        # torch is there but does not import (a broken install, a missing library)
        flush_stdout()
        say(f"error: {type(exc).__name__}: {exc} (in this Python: {sys.executable})")
        return 1
    flush_stdout()
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of `python -m mplaunch` and of the `mplaunch` command."""
    argv = sys.argv[1:] if argv is None else list(argv)
    # launch() forwards these signals to the ranks while they run; outside that window
    # (importing torch, starting the server, between restarts) they must still end the
    # command with 128 + signo. Installed for good: this is the process's entry point
    # (run() is the same without any signal handling).
    if threading.current_thread() is threading.main_thread():
        for signo in _HANDLED_SIGNALS:
            signal.signal(signo, _on_signal)
        signal.signal(signal.SIGUSR1, _on_usr1)
    return run(argv)
