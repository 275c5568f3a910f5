"""torchrun's flags, as a user moving from torchrun types them.

Each flag of torch 2.13's and 2.14's ``torchrun`` is either one of mplaunch's own options under
another name (an alias in the parser), mapped onto mplaunch's options here, accepted
and ignored with a note, or refused with one line that says what to use instead. None
is silently dropped: a flag that changed what torchrun did must not quietly change
nothing here. docs/watcher.rst ("Coming from torchrun") is the same table for readers.
"""
from __future__ import annotations

import argparse
from typing import List, Sequence

# Accepted, and change nothing: why, in the note the command prints.
IGNORED = {
    "--monitor-interval": "mplaunch waits on the ranks' exits and output, it does not poll",
    "--role": "all ranks have the one role",
    "--event-log-handler": "mplaunch records no events (--log-dir keeps each rank's "
                           "output and error.json)",
    "--local-addr": "the nodes find each other through --master-addr",
    "--run-path": "each rank always runs the script with runpy, in its own interpreter",
    # torch 2.14
    "--log-line-prefix-template": "every relayed line is prefixed [rank<N>]: (see "
                                  "--ranks-filter for whose lines reach the terminal)",
}

# Refused: what to do instead.
REFUSED = {
    "--no-python": "each rank runs Python; to run another program in N copies, start it "
                   "from a Python script with subprocess",
    "--logs-specs": "there are no log plugins; --log-dir DIR writes "
                    "DIR/attempt_<n>/<local rank>/stdout.log and stderr.log",
    "--duplicate-stdout-filters": "no lines are copied to another file by filter; grep "
                                  "the --log-dir files",
    "--duplicate-stderr-filters": "no lines are copied to another file by filter; grep "
                                  "the --log-dir files",
    "--virtual-local-rank": "LOCAL_RANK is the rank's index on its node; --gpus "
                            "per-rank gives each rank one GPU of its own, which it sees "
                            "as cuda:0",
    # torch 2.14
    "--print-completion": "mplaunch has no shell completion script of its own",
}

RDZV = ("--rdzv-backend", "--rdzv-endpoint", "--rdzv-id", "--rdzv-conf")

# Flags with no mplaunch option of their own, and whether they take a value.
_HIDDEN = {**{f: f not in ("--run-path",) for f in IGNORED},
           **{f: f not in ("--no-python", "--virtual-local-rank") for f in REFUSED},
           **{f: True for f in RDZV},
           "--standalone": False, "--redirects": True, "--tee": True,
           "--signals-to-handle": True, "--numa-binding": True}
_SHORT = {"--redirects": "-r", "--tee": "-t"}


class Refused(Exception):
    """A flag mplaunch will not take: the message says what to use instead."""


def dest(flag: str) -> str:
    return "torchrun_" + flag.lstrip("-").replace("-", "_")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags torchrun has and mplaunch has not, parsed (so that their values are not
    taken for the target) but left out of --help: the help lists mplaunch's own."""
    for flag, takes_value in _HIDDEN.items():
        names = [_SHORT[flag], flag] if flag in _SHORT else [flag]
        if takes_value:
            parser.add_argument(*names, dest=dest(flag), default=None,
                                help=argparse.SUPPRESS)
        else:
            parser.add_argument(*names, dest=dest(flag), action="store_true",
                                default=False, help=argparse.SUPPRESS)


def translate(ns: argparse.Namespace, forwarded: Sequence[str]) -> List[str]:
    """Map the torchrun flags given in `ns` onto mplaunch's options (in place). Returns
    the notes to print; raises Refused for a flag that has no meaning here. `forwarded`
    names the signals the command forwards to the ranks."""
    given = [f for f in _HIDDEN if getattr(ns, dest(f)) not in (None, False)]
    notes = []
    for flag in given:
        if flag in REFUSED:
            raise Refused(f"{flag} is not supported: {REFUSED[flag]}")
    if "--standalone" in given:
        _standalone(ns)
    rdzv = [f for f in RDZV if f in given]
    if rdzv:
        if ns.nnodes is not None and ns.nnodes > 1:
            raise Refused(f"{rdzv[0]}: mplaunch has no rendezvous backend; give every "
                          "node --nnodes N --node-rank I --master-addr HOST --master-port "
                          "PORT (node 0 hosts the store at HOST:PORT)")
        notes.append(f"{', '.join(rdzv)} ignored: one node needs no rendezvous (the "
                     "store is hosted here, on a free port)")
    if "--redirects" in given:
        _redirects(ns, getattr(ns, dest("--redirects")))
    if "--tee" in given:
        _tee(ns, getattr(ns, dest("--tee")))
    if "--numa-binding" in given:
        notes.append(_numa_binding(ns, getattr(ns, dest("--numa-binding"))))
    if "--signals-to-handle" in given:
        _signals(getattr(ns, dest("--signals-to-handle")), forwarded)
    for flag in given:
        if flag in IGNORED:
            notes.append(f"{flag} ignored: {IGNORED[flag]}")
    return notes


def _standalone(ns) -> None:
    # torchrun's --standalone: one node, a store on a free port. That is mplaunch's
    # default; nnodes=1 also keeps a SLURM step's layout from being picked up.
    if (ns.nnodes or 1) > 1 or (ns.node_rank or 0) > 0:
        raise Refused("--standalone is a single node: drop --nnodes/--node-rank, or "
                      "drop --standalone to run on several nodes")
    for name in ("master_addr", "master_port"):
        if getattr(ns, name) is not None:
            flag = "--" + name.replace("_", "-")
            raise Refused(f"--standalone picks a free port on this host: drop {flag}, or "
                          f"drop --standalone to use {flag}")
    ns.nnodes = 1


def _redirects(ns, value: str) -> None:
    value = value.strip()
    if value == "0":
        return
    if value != "3":
        raise Refused(f"--redirects {value}: mplaunch cannot redirect one stream or some "
                      "ranks' streams; it relays both streams of the ranks chosen with "
                      "--local-ranks-filter R,... and --log-dir DIR writes both streams "
                      "of every rank")
    if ns.log_dir is None:
        raise Refused("--redirects 3 sends the ranks' output to log files only: add "
                      "--log-dir DIR for the files (or use --no-relay to drop the output)")
    ns.relay = False


def _tee(ns, value: str) -> None:
    # Any tee (one stream, some ranks) is within what mplaunch does with --log-dir: both
    # streams of every rank to files, and the relay to this terminal as well.
    if value.strip() != "0" and ns.log_dir is None:
        raise Refused("--tee: mplaunch always relays the ranks' output here, and writes it "
                      "to per-rank log files with --log-dir DIR: add --log-dir DIR")


def _numa_binding(ns, mode: str) -> str:
    # Every mode binds each rank near its GPU; mplaunch's --cpus per-rank gives disjoint
    # slices within the NUMA node of the rank's GPU (where it knows it), which is
    # torchrun's "exclusive". The others share a node's (or socket's) CPUs among its
    # ranks, or cut by L3 cache; disjoint slices within the node are the closest.
    modes = ("node", "socket", "exclusive", "core-complex")
    if mode not in modes:
        raise Refused(f"--numa-binding {mode}: torchrun's modes are {', '.join(modes)}")
    if ns.cpus is None:
        ns.cpus = "per-rank"
    return (f"--numa-binding {mode} is --cpus per-rank: each rank gets CPUs of its own, "
            "within the NUMA node of its GPU where mplaunch knows the GPU (--gpus, or "
            "a CUDA --backend)" + ("" if mode == "exclusive" else
                                   f"; unlike {mode!r}, the ranks of a node do not "
                                   "share its CPUs"))


def _signals(value: str, forwarded: Sequence[str]) -> None:
    names = [n.strip().upper() for n in value.split(",") if n.strip()]
    names = [n if n.startswith("SIG") else "SIG" + n for n in names]
    extra = [n for n in names if n not in forwarded]
    if extra:
        raise Refused(f"--signals-to-handle: mplaunch forwards {', '.join(forwarded)} to "
                      f"the ranks, and cannot forward {', '.join(extra)}")
