"""Serving: a World's engine, what Run is to launch(). Ranks started once that serve
calls (_rank.call_loop) instead of running one function and exiting; each call driven to
its replies by the loop launch() uses, so failures, timeouts, signals, output and
teardown behave as for launch().

A call that fails heals where it can (``heal=True``): CallDriver (_engine.heal) ends the
call, not the ranks; then the ranks are brought back to a state they all agree on (a
dead rank replaced on the spot, the process group rebuilt if a collective was left
half-done) and the error raised says what was kept. What cannot be healed is torn down,
and the next call starts fresh ranks. One call goes down from the front-end and comes
back up once, as a Reply: the results or the error to raise, and the ranks' notes.

The modules the calling process reloaded since the last call (_engine.modwatch) go down
with it: in a frame of their own just before the call's, which the rank reads with it and
follows (_rank.reloads) before it loads the call's payload, whose function may be pickled
by reference to a reloaded module; a module it could not reload is a note ahead of its
answer, as the `__main__` names it kept are. Rejected: the reloads as a call of their own
(before): two trips down and two answers up for one run, a front-end that drove the
engine twice, and a rank between the two that had reloaded but not run. The frame is sent
only where there is a change: a run with none sends what it always sent.

The rank-side functions a heal calls (the set-up, the group's state, the rebuild) live
in _rank and are given by the front-end (RankCalls): this layer does not import the
rank's side, and the ranks unpickle them by reference without loading this one.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import pickle
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union

from . import gpumem, servers, signals
from .attempt import Attempt
from .nodes import going_on, hub as remote, spawner as nodespawner
from .nodes.mend import moved
from .nodes.plan import NodesPlan
from .config import LaunchConfig, node_user_envs, rank_specs, with_streams
from .heal import (CallDriver, consequences_last, disagree, forget_failures,
                   what_was_kept)
from .sampling import LateSampler
from .stragglers import take_records
from .modwatch import UNFOLLOWED
from .outcome import error_for, results_or_raise
from .session import Session
from .timeouts import collect_stacks, hush
from .._wire import buffers
from .._wire.buffers import Payload
from .._wire.messages import CALL_TAG, RELEASE_SIGNAL
from .._wire.payload import dumps_payload
from .._wire.stacks import RankStacks
from ..errors import MainProcessError

log = logging.getLogger("mplaunch")


@dataclass(frozen=True)
class RankCalls:
    """mplaunch's own calls in a World's ranks (functions of _rank, sent by reference):
    ``setup(backend)`` first, ``group_state()`` after a failed call, ``rebuild(backend,
    n)`` to make the process group again in key space n, ``renumber(changes)`` where
    the World goes on without a lost node."""
    setup: Callable
    group_state: Callable
    rebuild: Callable
    renumber: Callable


@dataclass
class Reply:
    """What one call came back with, for the front-end to present: every rank's value,
    or the error to raise; the modules of the calling process's reloads that some ranks
    could not follow ({name: {why: ranks}}); and what the ranks did with its `__main__`
    values that it should be told of ({a KeptGlobals entry: ranks}, _wire.mainglobals).
    The notes are there also where the call failed or tore the ranks down."""
    values: Optional[list] = None
    error: Optional[BaseException] = None
    unfollowed: Dict[str, Dict[str, List[int]]] = field(default_factory=dict)
    kept: Dict[tuple, List[int]] = field(default_factory=dict)
    # per rank, the collectives it started in the call (_rank.flight), or why none were
    # read (the same reason in every rank: one is kept)
    collectives: Dict[int, list] = field(default_factory=dict)
    flight_off: Optional[str] = None
    late: Dict[int, Any] = field(default_factory=dict)   # _engine.sampling.LateSampler


class Serving:
    """The ranks of one World and the calls they serve. Not thread-safe: the front-end
    runs one call at a time (``request_stop`` and ``stacks`` excepted)."""

    def __init__(self, cfg: LaunchConfig, backend: Optional[str], heal: bool,
                 calls: RankCalls, nodes: Optional[NodesPlan] = None):
        self.cfg = cfg
        self.nodes = nodes
        self.hub = None               # a World across nodes: its agents (_engine.nodes.hub)
        self._session = None          # the running ranks' Session (its store: their specs)
        self.backend = backend
        self.heal = heal
        self.calls = calls
        self.attempt: Optional[Attempt] = None
        self.fresh: List[int] = []    # the ranks that are fresh processes since the last call
        self._stack: Optional[contextlib.ExitStack] = None
        self._generation = 0          # how many times ranks were started
        self._called = None           # the group of the last call (its notes: _take_notes)
        self._sampler = LateSampler()  # the late rank's stack, in calls of 1 s or more
        self.waiting = False          # kept without a lost node, for restart(nnodes=M)

    @property
    def up(self) -> bool:
        return self.attempt is not None

    @property
    def pids(self) -> Dict[int, int]:
        attempt = self.attempt
        return attempt.group.pids if attempt is not None else {}

    def stacks(self) -> RankStacks:
        """From any thread: where each rank is now."""
        attempt = self.attempt
        return RankStacks(collect_stacks(attempt.group) if attempt is not None else {})

    def request_stop(self) -> None:
        """From another thread: the call in progress tears down and raises."""
        attempt = self.attempt
        if attempt is not None:
            attempt.request_stop()

    # -- the ranks -------------------------------------------------------------------
    def start(self) -> None:
        """Start the ranks; returns once each has run the set-up (init_process_group)."""
        if self.attempt is not None:
            return
        cfg = with_streams(self.cfg)
        stack = contextlib.ExitStack()
        try:
            make_spawner = None
            if self.nodes is not None:
                make_spawner = functools.partial(nodespawner.RemoteSpawner,
                                                 hub=self._nodes_hub())
            # The first "call" is the set-up: the ranks start from it.
            session = stack.enter_context(
                Session(cfg, dumps_payload(self.calls.setup, (self.backend,), {}),
                        local_server=self.nodes is None))
            session.wait_server()
            specs = (session.specs(self._generation, serve=True) if self.nodes is None
                     else self._node_specs(session))
            self._session = session
            attempt = Attempt(cfg, self._generation, specs, session.payload_fd,
                              session.waker, make_spawner=make_spawner)
            self._generation += 1
            stack.callback(attempt.group.close)
            attempt.group.start()
        except BaseException:
            stack.close()
            raise
        self.attempt, self._stack = attempt, stack
        self._wait_replies(None)   # every rank has run its set-up

    def stop(self) -> None:
        """End every rank (SIGTERM, then SIGKILL after the grace period) and the session.
        Idempotent; the next call starts fresh ranks."""
        attempt, stack = self.attempt, self._stack
        self.attempt = self._stack = None
        self.waiting = False
        if attempt is None:
            return
        self._sampler.end()   # (a call the stop cut short)
        self.fresh = list(range(self.cfg.world_size))
        # What the ranks hold on this machine's GPUs, freed before this returns (gpumem).
        held = gpumem.snapshot(attempt.group.pids.values()) if self.hub is None else {}
        try:
            attempt.group.stop()
            attempt.drive()
        finally:
            stack.close()            # the group, then the session
            if self.hub is not None and self.hub.broken:
                self.close_nodes()   # a node is lost: the next call starts a new step
        gpumem.wait_given_back(held)

    # -- a World across nodes ----------------------------------------------------------
    def _nodes_hub(self):
        hub = self.hub
        if hub is not None and not hub.broken:
            try:   # a node lost since the last group (restart()): its replacement first
                hub.install_lost()
            except remote.NodesError:
                pass   # broken now: a new step below
        if hub is not None and hub.broken:
            self.close_nodes()
            hub = None
        if hub is None:
            plan = self.nodes
            hub = remote.Hub(plan.nnodes, plan.address, self.cfg, plan.gpus, plan.cpus,
                             plan.scheduler, mend=self.heal).start()
            self.hub = hub
        return hub

    def _node_specs(self, session: Session, generation: Optional[int] = None) -> list:
        """Every node's rank specs: each with its node's environment, name and
        placement (what its agent reported)."""
        hosted = session.hosted
        specs = []
        for info in self.hub.nodes:
            cfg = dataclasses.replace(
                self.cfg, node_rank=info.index, gpus=info.gpus, cpus=info.placed_cpus,
                user_envs=node_user_envs(self.nodes.env, info.index, self.cfg.nprocs))
            specs += rank_specs(cfg, self._generation if generation is None else
                                generation, hosted.port, hosted.address,
                                serve=True, host=info.name,
                                base=self.nodes.scheduler.node_environ(info.environ))
        return specs

    @property
    def nodes_info(self) -> list:
        return [(lk.info, lk.lost) for lk in hub.links] if (hub := self.hub) else []

    def close_nodes(self) -> None:
        """End the nodes' agents and their step (a World's close())."""
        hub, self.hub = self.hub, None
        if hub is not None:
            hub.close()

    def reform(self, cfg: LaunchConfig, nodes: NodesPlan) -> None:
        """Across nodes, after stop(): serve with `cfg` on `nodes` from the next start,
        in a new step (World.restart(nnodes=)), every rank a fresh process."""
        if self.attempt is not None:
            raise RuntimeError("reform() re-forms stopped ranks; call stop() first")
        self.close_nodes()
        self.cfg, self.nodes = cfg, nodes
        self.fresh = list(range(cfg.world_size))

    # -- a call ----------------------------------------------------------------------
    def call(self, payload: Union[bytes, Payload], timeout: Optional[float],
             reloads: Sequence[Tuple[str, str]] = ()) -> Reply:
        """One call, down once and up once: every rank changes the modules of `reloads`
        ((name, how): _engine.modwatch) as the calling process did, then runs `payload`.
        Raises nothing the call ended with: the Reply holds every rank's result, or what
        launch() would raise (healed first where it can be, ``err.healed`` saying what
        was kept), and the ranks' notes."""
        reply = Reply()
        try:
            reply.values = self._call(payload, timeout, reloads)
        except BaseException as exc:  # noqa: BLE001 - the front-end raises it
            reply.error = exc
        group, self._called = self._called, None
        hush(group)
        _take_notes(group, reply)
        reply.late = self._sampler.end()
        return reply

    def _call(self, payload: Union[bytes, Payload], timeout: Optional[float],
              reloads: Sequence[Tuple[str, str]]) -> list:
        if self.waiting:
            self.stop()   # not going on without the lost node: fresh ranks, a new step
        self.start()
        self.fresh = []
        attempt = self.attempt
        self._called = attempt.group
        self._sampler.begin(attempt.group)
        ahead = (CALL_TAG + pickle.dumps(tuple(reloads), pickle.HIGHEST_PROTOCOL)
                 if reloads else b"")

        def send() -> None:
            self._send(payload, ahead)
        if not self.heal:
            return self._wait_replies(timeout, send=send)
        group = attempt.group
        driver = CallDriver(attempt, RELEASE_SIGNAL)
        group.heal = True
        try:
            self._driven(driver.on_signal, lambda: driver.drive(timeout), send)
        finally:
            group.heal = False
        if group.stopping or not group.running:
            return self._torn_down()
        group.relay_written()
        if not (group.failures or attempt.timed_out or driver.interrupted):
            return [r.result for r in group.ranks]
        consequences_last(group.failures)
        error = (KeyboardInterrupt() if driver.interrupted and not attempt.timed_out
                 else error_for(attempt, attempt.ending))
        forget_failures(attempt)
        kept = self._settle(driver.released)
        if isinstance(error, KeyboardInterrupt):
            error.args = (f"mplaunch.World: the ranks were interrupted; {kept}",)
        else:
            error.healed = kept
        raise error

    def _send(self, payload: Union[bytes, Payload], ahead: bytes = b"") -> None:
        group = self.attempt.group
        group.relay_to(sys.stdout, sys.stderr)
        with _payload_fd(payload) as fd:
            try:
                group.call(fd, ahead=ahead)
            except OSError:
                pass  # a rank is gone: the loop finds out which, and why

    def _driven(self, on_signal, drive: Callable[[], None],
                send: Optional[Callable[[], None]] = None) -> None:
        """`send` a call, then `drive` it to its answers, signals to this process going
        to `on_signal` from before anything is sent: an interrupt is the driver's
        whenever it comes (before, a Ctrl-C between send and drive left the ranks in
        the call, and every later call read the answers of the one before). Whatever
        escapes once something was sent tears the ranks down; an interrupt before that
        leaves them as they were."""
        sent = send is None
        try:
            with signals.forwarding(on_signal, warn=False, wake_fd=self.attempt.waker.w):
                if send is not None:
                    sent = True   # from here on the ranks may hold the call
                    send()
                drive()
        except BaseException:
            if sent:
                self.stop()
            raise

    def _wait_replies(self, timeout: Optional[float], quiet: bool = False,
                      send: Optional[Callable[[], None]] = None) -> list:
        attempt = self.attempt
        assert attempt is not None
        group = attempt.group
        self._driven(attempt.on_signal, lambda: attempt.drive(
            until=lambda: group.replied and not group.stopping, timeout=timeout), send)
        if group.running and not group.stopping:
            group.relay_written()
            return [r.result for r in group.ranks]
        return self._torn_down(quiet)

    def _torn_down(self, quiet: bool = False) -> list:
        attempt = self.attempt
        self.stop()
        if not quiet:
            log.warning("mplaunch.World: the failed call tore the world's %d ranks down; "
                        "the next call starts fresh ranks", self.cfg.world_size)
        return results_or_raise(attempt)

    # -- healing ---------------------------------------------------------------------
    def _settle(self, released: bool) -> str:
        """Bring the ranks back to a state all agree on, after a failed call every rank
        answered (or died): replace the dead ones, rebuild the process group if the
        ranks disagree about it; what the world kept, said for the error."""
        group = self.attempt.group
        dead = [i for i, r in enumerate(group.ranks) if not r.alive]
        live = [r for r in group.ranks if r.alive]
        try:
            states = self._control(self.calls.group_state, (), live)
            inited = [s for s in states if s["initialized"]]
            if not (dead or released or (inited and len(inited) != len(states))
                    or disagree(inited)):
                return ("the world was kept: its ranks, their state and their process "
                        "group are as the failed run left them")
            backends = {s["backend"] for s in inited}
            backend = backends.pop() if len(backends) == 1 else self.backend
            n = max(s["incarnation"] for s in states)
            stale = self._rebuild(backend, n, dead, live)
        except (KeyboardInterrupt, MainProcessError):
            raise
        except BaseException as exc:  # noqa: BLE001 - whatever it was, it cannot be healed
            if (kept := going_on.kept(self, exc)) is not None:   # a lost node, no spare
                return kept
            self.stop()
            return (f"the world could not be healed ({type(exc).__name__}: {exc}) and was "
                    "torn down; the next run starts fresh ranks")
        self.fresh = [group.ranks[i].spec.rank for i in dead]
        pids = {group.ranks[i].spec.rank: group.ranks[i].pid for i in dead}
        nodes = None if self.nodes is None else {
            s.rank: f"node {s.node_rank} ({s.hostname})"
            for s in (group.ranks[i].spec for i in dead)}
        return what_was_kept(pids, backend, released, stale, nodes)

    def _rebuild(self, backend, n: int, dead: List[int], live) -> list:
        """Start a fresh process for each dead rank and build the group again in every
        rank (key space `n`); each live rank's names of stale objects."""
        group = self.attempt.group
        payload = dumps_payload(self.calls.rebuild, (backend, n), {})
        specs = moved(self.hub, group, dead,
                       lambda: self._node_specs(self._session, self.attempt.number))

        def send():
            with _payload_fd(payload) as fd:
                # The fresh ranks first: a fork (start_method="fork") of this process
                # while its store serves the others' rendezvous could inherit a lock.
                for i in dead:
                    group.replace(i, fd, specs.get(i))
                group.call(fd, live)
        return self._wait_replies(max(30.0, self.cfg.grace_period), quiet=True,
                                  send=send)

    def _control(self, func, args, ranks) -> list:
        """A call of mplaunch's own in these ranks; torn down and raised if it fails."""
        attempt = self.attempt
        group = attempt.group
        payload = dumps_payload(func, args, {})

        def send():
            with _payload_fd(payload) as fd:
                group.call(fd, ranks)
        self._driven(attempt.on_signal, lambda: attempt.drive(
            until=lambda: all(r.has_result for r in ranks) or group.stopping), send)
        if group.stopping or not all(r.has_result for r in ranks):
            self.stop()
            results_or_raise(attempt)    # raises what stopped it
            raise RuntimeError("a rank did not answer mplaunch's own call")
        return [r.result for r in ranks]


def _take_notes(group, reply: Reply) -> None:
    """Into `reply`, by rank: the notes `group`'s ranks sent ahead of their answers to
    the calls since the last look (KeptGlobals entries, (kind, name, token, why)): a
    module a rank could not reload (modwatch.UNFOLLOWED), or what it did with the
    calling process's `__main__` values (_wire.mainglobals)."""
    for r in group.ranks if group is not None else ():
        for note in r.kept_globals:
            kind, name, _, why = note
            if kind == UNFOLLOWED:
                reply.unfollowed.setdefault(name, {}).setdefault(why, []).append(
                    r.spec.rank)
            else:
                reply.kept.setdefault(note, []).append(r.spec.rank)
        r.kept_globals = ()
    if group is not None:
        reply.collectives, reply.flight_off = take_records(group)


@contextlib.contextmanager
def _payload_fd(payload: Union[bytes, Payload]) -> Iterator[int]:
    """A memfd holding `payload` for the ranks; closed once they have their copies."""
    fd = buffers.memfd_of(payload)
    try:
        yield fd
    finally:
        servers.close_fd(fd)
