"""mplaunch.World: ranks that stay up between calls, for notebooks and test suites.

The front-end: it validates, takes one call at a time, and presents. The engine is
_engine.world_engine.Serving (what Run is to launch()): it starts the ranks, drives each
call to its replies with the loop launch() uses, and heals a failed call where it can
(_engine.heal drives the call, _rank.heal is the ranks' side). One run() goes down to
it once, with the modules this process reloaded since the last run (_engine.modwatch),
and comes back once, with a Reply: the results or the error to raise, and the notes
that mplaunch._world_notes turns into warnings. Rejected: a front-end that drove the
engine itself, one call to reload the ranks' modules and one to run (before): what a
run is belongs to the engine, and the ranks follow the reloads with the call.
"""
from __future__ import annotations

import atexit
import logging
import threading
from typing import Any, Callable, List, Mapping, Optional, Sequence, Set, TypeVar

from ._engine.config import LaunchConfig, check_call, seconds, validate
from ._engine.modwatch import ModuleWatch
from ._engine.nodes import going_on
from ._engine.nodes.plan import plan_nodes
from ._engine.world_engine import RankCalls, Serving
from ._rank import heal, procgroup
from ._rank.debugging import is_post_mortem, world_post_mortem
from ._wire.payload import dumps_payload
from ._engine.stragglers import analyse, off_line
from ._rank.call_loop import own_call
from ._rank.flight import last_call
from ._world_notes import answer, first_raised, stragglers

T = TypeVar("T")
log = logging.getLogger("mplaunch")
# mplaunch's own calls in the ranks, sent by reference to the rank's side
_CALLS = RankCalls(setup=procgroup.setup, group_state=heal.group_state, rebuild=heal.rebuild,
                   renumber=heal.renumber)

# Strong references: a World nobody refers to any more is still open (its ranks, pipes and
# store are up) and must be closed at exit. With weak ones, a world made in a function
# that returned was dropped unclosed: its fds stayed open and its ranks ended by EOF.
_open: "Set[World]" = set()


class World:
    """``nprocs`` ranks started once and kept up: ``run(func)`` calls ``func`` in every
    rank and returns the list of results, as :func:`mplaunch.launch` would, but the
    processes, their module globals, :func:`mplaunch.rank_state` and (with
    ``backend=``) the process group stay for the next ``run``.

    ``nnodes=M`` spans M nodes of this SLURM allocation (see :ref:`world-across-nodes`)
    with ``nprocs`` ranks on each, as ``launch(nprocs=, nnodes=)`` counts them:
    ``World(4, nnodes=2)`` has 8 ranks. ``size`` is the World's number of ranks,
    ``nprocs`` the number on each node. ``scheduler="ray"`` places the nodes on the Ray
    cluster this process is connected to instead (see :ref:`world-on-ray`);
    ``scheduler="slurm"`` names the SLURM allocation. A lost node costs only that node:
    a healing World replaces it and keeps the other nodes' ranks; ``spare_nodes=S``
    checks before anything starts that the allocation (or cluster) has S nodes more than
    the World uses, which a lost node's replacement goes to first.

    Takes the keyword arguments of :func:`mplaunch.launch` (``timeout`` applies to each
    run), ``gpus=`` and ``cpus=`` included. The ranks start at the first ``run`` (or
    ``start()``); with ``backend`` each has called
    ``torch.distributed.init_process_group(backend)`` before it (on CUDA, on its own
    GPU: see :doc:`gpus`). A failing run raises as ``launch`` does; with ``heal=True``
    (the default) the world heals where it can: a rank's exception, a collective left
    half-done, an interrupt, a timeout or a dead rank keep the ranks and their state
    (the process group is rebuilt and a dead rank replaced if need be, and the error
    says so); what cannot be healed is torn down and the next ``run`` starts fresh
    ranks, as always with ``heal=False``. ``restart()`` starts fresh ranks on purpose.
    ``close()`` (or leaving the ``with`` block) ends every process; a world left open is
    closed at interpreter exit.
    """

    __module__ = "mplaunch"
    # What the warning about a name the ranks kept says to do to send this process's
    # value instead; a subclass says it in its own words (the %%ranks magic's world).
    _send_hint = "To send this process's value, pass it to run() as an argument."

    def __init__(self, nprocs: Any = None, backend: Optional[str] = None,
                 heal: bool = True, nnodes: Any = None, **options: Any):
        if "kwargs" in options:
            raise TypeError("World takes no kwargs=; pass them to run()")
        if not isinstance(heal, bool):
            raise TypeError(f"heal must be True (keep the ranks through a failed run) or "
                            f"False (tear them down), got {heal!r}")
        self.heal = heal
        if options.get("spare_nodes") and not heal:
            raise ValueError("spare_nodes= keeps nodes for a lost node's replacement, "
                             "which only a healing World makes: leave heal=True, or "
                             "spare_nodes out")
        self._made_with = (backend, dict(options))   # for restart(nnodes=)
        self.cfg: LaunchConfig
        nodes = None
        if options.get("scheduler", 0) is None:
            del options["scheduler"]       # today's choice: SLURM when nnodes > 1
        scheduler = options.get("scheduler")
        if scheduler is not None or (nnodes is not None and nnodes != 1):
            self.cfg, nodes = plan_nodes(procgroup.setup, nprocs,
                                         1 if nnodes is None else nnodes, backend, options)
        else:
            if "spare_nodes" in options:
                raise ValueError("spare_nodes= is for a World across nodes "
                                 "(World(nprocs, nnodes=N, spare_nodes=S))")
            self.cfg = validate(procgroup.setup, (backend,), nprocs,
                                dict(options, backend=backend))
            if self.cfg.nnodes > 1:
                raise ValueError("this process is one task of a multi-task srun step, "
                                 "where launch() runs one node's ranks; for one World "
                                 "across the nodes of an allocation, make it from one "
                                 "process with World(nprocs, nnodes=N)")
        if self.cfg.max_restarts:
            raise ValueError("a World does not restart on its own: after a failed run the "
                             "next run() starts fresh ranks; leave max_restarts at 0")
        self.backend = backend
        self._engine = Serving(self.cfg, backend, heal, _CALLS, nodes)
        self._closed = False
        # One call at a time: a call's replies are read from the ranks' sockets in the
        # order they come, and two callers would take each other's (and register the
        # same fds twice with the selector). A second thread's run() waits its turn.
        self._lock = threading.RLock()
        self._modules = ModuleWatch()
        self._told: Set[tuple] = set()   # the notes said already (_world_notes)
        self._failed: Optional[int] = None   # the last run's first failing rank
        self._report = None   # the last run's straggler report, where it was read
        self._runs = 0        # the user's runs, and which one _report is of
        self._report_of = -1
        self._asked = ({}, None)   # report()'s own read of a short run: records, off
        _open.add(self)

    # -- public ----------------------------------------------------------------------
    @property
    def pids(self):
        """{rank: pid} of the running ranks ({} before the first run)."""
        return self._engine.pids

    @property
    def fresh_ranks(self) -> List[int]:
        """The ranks that are fresh processes since the last run, their state gone:
        every rank after the world was torn down, the replaced ones after a run that
        healed a dead rank; [] once a run has begun. Send them their state again."""
        return list(self._engine.fresh)

    @property
    def nprocs(self) -> int:
        """How many ranks each node runs (one node: all of them); see ``size``."""
        return self.cfg.nprocs

    @property
    def size(self) -> int:
        """How many ranks the World has, on all its nodes: ``nprocs * nnodes``, the
        ranks' ``WORLD_SIZE`` and the length of what ``run`` returns."""
        return self.cfg.world_size

    @property
    def nnodes(self) -> int:
        """How many nodes the World spans (1 unless made with ``nnodes=``)."""
        return self.cfg.nnodes

    @property
    def nodes(self) -> List[dict]:
        """Across nodes: each node's index, name and agent pid, its ranks' GPUs and CPUs
        as its agent placed them (None: not placed), the CPUs the agent may use, its
        CUDA_VISIBLE_DEVICES, and ``"payloads"``: how many payloads (a run's function
        and arguments, sent to a node once for all its ranks) were sent to it so far
        ([] before the first run; one node: []), and ``"lost"``: why the node was lost
        (None while it is not; see :ref:`a lost node <lost-node>`)."""
        return [{"node": i.index, "name": i.name, "agent_pid": i.pid, "gpus": i.gpus,
                 "cpus": i.placed_cpus, "allowed": i.cpus,
                 "environ": {k: v for k, v in i.environ.items()
                             if k == "CUDA_VISIBLE_DEVICES"},
                 "payloads": getattr(i, "payloads", 0), "lost": lost}
                for i, lost in self._engine.nodes_info]

    def report(self):
        """Who the others waited for in the last run: per rank, how often it started a
        collective last and how late, over every process group (a StragglerReport:
        print it, or ``.trace(path)`` for a Perfetto timeline). A run of a second or
        more was read as it ended; a shorter one is read now, from what torch's
        Flight Recorder still holds of it."""
        if self._runs == 0:
            raise RuntimeError("this World has not run anything yet: report() is about "
                               "its last run")
        self._not_waiting("report()")
        if self._report_of != self._runs:
            self.run(last_call, timeout=float("inf"))   # its records come as a call's
            records, off = self._asked
            if off is not None:
                raise RuntimeError(off_line(off))
            self._report = analyse(records)
            self._report_of = self._runs
        return self._report

    def _not_waiting(self, what: str) -> None:
        """`what` runs in the ranks: not while they wait for restart(nnodes=M) (a run
        would end them)."""
        if self._engine.waiting:
            left = sum(lost is None for _, lost in self._engine.nodes_info)
            raise RuntimeError(
                f"{what} asks the ranks, and a node of this World was lost with no "
                f"replacement: the ranks kept on the other nodes wait for "
                f"world.restart(nnodes={left}), which goes on with them (then {what} "
                f"works); a run or restart() ends them and starts fresh ranks")

    def stacks(self):
        """{rank: where it is now}, asked without stopping anything, from any thread
        (while another runs ``run``): as :meth:`mplaunch.Handle.stacks`."""
        return self._engine.stacks()

    def start(self) -> "World":
        """Start the ranks now (else the first run() does)."""
        with self._lock:
            if self._closed:
                raise RuntimeError("this World is closed; make a new one")
            if not self._engine.up:
                # Fresh ranks import this process's modules as they are now (or, forked,
                # have them): what changes from here on is theirs to follow, a reload
                # before the first run too.
                self._modules.reloaded()
            self._engine.start()
        return self

    def run(self, func: Callable[..., T], args: Sequence[Any] = (),
            kwargs: Optional[Mapping[str, Any]] = None,
            timeout: Optional[float] = None) -> List[T]:
        """Call ``func(*args, **kwargs)`` in every rank; the results by rank. Raises
        :class:`~mplaunch.WorkerError` or :class:`~mplaunch.LaunchTimeout` as
        ``launch`` does, after healing the world (``err.healed`` says what it kept) or
        tearing it down; an interrupt (SIGINT) raises :class:`KeyboardInterrupt` in the
        ranks and here, the world kept (:class:`~mplaunch.MainProcessError` with
        ``heal=False``, or for SIGTERM, SIGHUP, SIGQUIT or a second SIGINT).

        ``func``'s globals from ``__main__`` take this process's values, but not over a
        name the ranks' own code assigned (a warning names it, once per object here;
        pass the value as an argument instead), nor over a torch object they changed
        in place while this process's stayed the same; modules this process reloaded
        since the last run are reloaded in the ranks first. See :ref:`world-globals`."""
        check_call(func, args, kwargs)
        # None: the world's own timeout; inf: none, for this call (the loop's deadline
        # is then never reached, and its waits are sliced).
        if timeout != float("inf"):
            timeout = seconds("timeout", timeout, optional=True)
        payload = dumps_payload(func, args, kwargs or {})
        with self._lock:
            # What this process reloaded since the last run goes down with the call;
            # fresh ranks (start) import the modules as they are now.
            reloads = self._modules.reloaded() if self._engine.up else ()
            self.start()
            reply = self._engine.call(payload, timeout, reloads)
            if reply.error is not None and reloads:
                self._modules.again(reloads)   # some ranks may not have followed them
            values, error = answer(reply, self._told, self.size, self._send_hint)
            mine = is_post_mortem(func) or own_call(func)   # not the user's run
            if func is last_call:
                self._asked = reply.collectives, reply.flight_off
            if not mine:
                self._runs += 1
                self._report = stragglers(reply.collectives, self._told,
                                          reply.flight_off, reply.late)
                self._report_of = self._runs if self._report is not None else -1
                self._failed = first_raised(error)
        if error is not None:
            raise error   # here: the user's frames, then this call's line (from_here)
        return values

    def debug(self, rank: Optional[int] = None) -> None:
        """pdb at the frame that raised the last run's error in `rank` (default: the
        first rank whose own error it was), with its locals, as IPython's ``%debug``:
        through the notebook's input box, or this process's terminal. The other ranks
        wait; the World is as it was afterwards. See :ref:`debugging`."""
        self._not_waiting("debug()")
        rank = self._failed if rank is None else rank
        if rank is None:
            raise RuntimeError("no run of this World raised an error in a rank since "
                               "it started: there is nothing to debug (breakpoint() "
                               "in the function stops a rank while it runs)")
        if not isinstance(rank, int) or isinstance(rank, bool) \
                or not 0 <= rank < self.size:
            raise ValueError(f"rank must be a rank of this World (0..{self.size - 1}), "
                             f"got {rank!r}")
        opened = self.run(world_post_mortem, (rank,), timeout=float("inf"))[rank]
        if opened is None:
            raise RuntimeError(f"rank {rank} holds no error to debug: its last run did "
                               "not raise, or it was started fresh since")
        if opened is False:
            raise RuntimeError("nobody can answer pdb's prompt here: debug() needs a "
                               "notebook whose frontend takes input, or a terminal")

    def restart(self, nnodes: Optional[int] = None,
                nprocs: Optional[int] = None) -> "World":
        """End the ranks and start fresh ones. Across nodes, ``nnodes=M`` re-forms the
        World on M nodes, with ``nprocs`` ranks on each (default: as many as each node
        had). Where a node was lost and could not be replaced, and M is the number of
        nodes left, the World goes on with the ranks that are up: their processes and
        state are kept, and they are renumbered 0..M*nprocs-1 in their order (the
        failed call's error says so; see :ref:`a lost node <lost-node>`). Otherwise it
        starts fresh ranks on M nodes in a new step."""
        with self._lock:
            if nnodes is not None or nprocs is not None:
                cfg, plan = self._plan(nnodes if nnodes is not None else self.nnodes,
                                       nprocs)
                lost = going_on.leaving(self._engine, cfg.nnodes, cfg.nprocs)
                if lost is not None:
                    # The last run's error and report name the old numbers.
                    self._failed, self._report_of = None, -1
                    try:
                        log.warning("%s", going_on.go_on(self._engine, cfg, plan, lost))
                    finally:
                        self.cfg = self._engine.cfg   # the new one, once it began
                    return self
                self._engine.stop()
                self._engine.reform(cfg, plan)
                self.cfg = cfg
            else:
                self._engine.stop()
            return self.start()

    def _plan(self, nnodes: int, nprocs: Optional[int]):
        if self._engine.nodes is None:
            raise ValueError("restart(nnodes=, nprocs=) re-forms a World across nodes; "
                             "make a new World to change a one-node World's size")
        backend, options = self._made_with
        per_node = nprocs if nprocs is not None else self.nprocs
        return plan_nodes(procgroup.setup, per_node, nnodes, backend, options)

    def close(self) -> None:
        """End every rank and release the store's port. Idempotent; from another thread
        it ends the call in progress there (which raises) instead of waiting for it."""
        self._closed = True
        _open.discard(self)
        if not self._lock.acquire(blocking=False):
            self._engine.request_stop()  # the running call tears down and raises
            self._lock.acquire()
        try:
            try:
                self._engine.stop()
            finally:
                self._engine.close_nodes()
        finally:
            self._lock.release()

    def __enter__(self) -> "World":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def __repr__(self) -> str:
        state = ("closed" if self._closed else f"up, pids {self.pids}" if self._engine.up
                 else "not started")
        nodes = (f" nnodes={self.nnodes} ({self.size} ranks)" if self.nnodes > 1
                 else "")
        return (f"<mplaunch.World nprocs={self.nprocs}{nodes} backend={self.backend!r} "
                f"{state}>")


@atexit.register
def _close_open_worlds() -> None:
    for world in list(_open):
        world.close()
