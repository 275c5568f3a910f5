"""Driving one call of a healing World: its ranks' errors, an interrupt or the deadline
end the call, not the ranks.

Why the steps are these. A rank's error is its answer, but its peers may be blocked in a
collective that waits for it, for the group's timeout (30 min); and a rank may just be
computing. So, once something went wrong (a rank raised, the launching process got
SIGINT, the deadline passed):

1. the ranks that have not answered get SETTLE seconds to answer on their own (after an
   error only: an interrupt or a deadline interrupts at once; a rank that died releases
   the others at once, step 3);
2. they are sent SIGINT (again every RESEND seconds: a rank drops it while inside
   mplaunch's own code), which raises KeyboardInterrupt in Python code;
3. RELEASE_AFTER seconds later, ranks still silent are taken to be blocked in C, in a
   collective: every rank is asked to shut its connections to the others (see
   _rank.heal), which makes gloo raise; the group must then be rebuilt;
4. past the grace period, a rank that has not answered is killed, and the World replaces
   it as it replaces a rank that died; if even that fails within another grace period,
   the group is torn down as without healing (the next run starts fresh ranks).

A rank that dies is an answer too. SIGTERM/SIGHUP/SIGQUIT, a second SIGINT, or stop()
tear down as today.
What happens once every rank has answered (compare the groups' sequence numbers,
rebuild, replace) is _engine.world_engine's.
"""
from __future__ import annotations

import signal
import time
from typing import Dict, List, Optional

from .attempt import Attempt
from .ending import Ending, EndKind
from .group import RankGroup
from .ranks import RankState
from .timeouts import timed_out
from .._wire.messages import LOST_PEER

SETTLE = 0.1          # a rank in Python code answers an interrupt within milliseconds
RESEND = 0.1
RELEASE_AFTER = 0.1


class CallDriver:
    """One call's driving. ``on_signal`` is the handler's callback."""

    def __init__(self, attempt: Attempt, release_signal: Optional[int]):
        self.attempt = attempt
        self.release_signal = release_signal
        self.signals: List[int] = []
        self.interrupted = False     # SIGINT reached the launching process (once)
        self.released = False        # the ranks' connections were shut down
        self.gave_up = False
        self._gave_up_at = 0.0
        self._handled = 0
        self._trouble_at: Optional[float] = None
        self._interrupt_at: Optional[float] = None
        self._sent_at = 0.0

    def on_signal(self, signo: int) -> None:
        self.signals.append(signo)
        self.attempt.waker.wake()

    def drive(self, timeout: Optional[float]) -> None:
        """Until every rank has answered, or the group is being torn down."""
        attempt, group = self.attempt, self.attempt.group
        grace = attempt.cfg.grace_period
        if timeout is None:
            timeout = attempt.cfg.timeout     # the world's
        elif timeout == float("inf"):
            timeout = None                    # none for this call, whatever the world's
        # On the group's debug clock: time a rank spends in a debugger does not count.
        deadline = None if timeout is None else group.debug.clock() + timeout
        while group.running and not group.stopping and not _all_answered(group):
            group.wait(self._wait(deadline, grace))
            if group.stopping or _all_answered(group):
                break
            now = time.monotonic()
            if self._take_signals():
                break
            if attempt.stop_asked:   # World.close() from another thread
                attempt.early = Ending(EndKind.STOPPED,
                                       stopped=[r.spec.rank for r in group.ranks if r.alive])
                group.stop(signal.SIGTERM, attempt.stop_grace)
                break
            if (deadline is not None and not attempt.timed_out
                    and group.debug.clock() >= deadline):
                attempt.early = timed_out(group, timeout)
                self._trouble(now, at_once=True)
            if group.failures:
                self._trouble(now, at_once=False)
            if not self.released and any(not r.alive for r in group.ranks):
                # A rank died: any collective with it is broken, no need to wait.
                self._release(group)
            self._escalate(time.monotonic(), grace)

    def _take_signals(self) -> bool:
        """Act on new signals; True once the group is being torn down."""
        while self._handled < len(self.signals):
            signo = self.signals[self._handled]
            self._handled += 1
            if signo == signal.SIGINT and not self.interrupted:
                self.interrupted = True
                self._trouble(time.monotonic(), at_once=True)
                continue
            # A second interrupt, or SIGTERM/SIGHUP/SIGQUIT: everything ends, as today.
            self.attempt.on_signal(signo)
            self.attempt.group.stop(signo)
            return True
        return False

    def _trouble(self, now: float, at_once: bool) -> None:
        if self._trouble_at is None:
            self._trouble_at = now
        when = now if at_once else self._trouble_at + SETTLE
        if self._interrupt_at is None or when < self._interrupt_at:
            self._interrupt_at = when

    def _escalate(self, now: float, grace: float) -> None:
        if self._interrupt_at is None or now < self._interrupt_at:
            return
        group = self.attempt.group
        silent = [r for r in group.ranks if not _answered(r) and r.signalable]
        if silent and now >= self._sent_at + RESEND:
            group.debug.interrupt()   # a rank in pdb continues, into the interrupt
            group.send_signal(signal.SIGINT, silent)
            self._sent_at = now
        if silent and not self.released and now >= self._interrupt_at + RELEASE_AFTER:
            self._release(group)
        if silent and not self.gave_up and now >= self._interrupt_at + grace:
            # Stuck where neither an interrupt nor the release reaches: replaced (the
            # World starts a fresh process for each rank that died).
            self.gave_up, self._gave_up_at = True, now
            group.send_signal(signal.SIGKILL, silent)
        elif silent and self.gave_up and now >= self._gave_up_at + grace:
            if self.interrupted:
                self.attempt.signal_received = signal.SIGINT
            group.stop(signal.SIGKILL)

    def _release(self, group) -> None:
        if self.release_signal is None:
            return
        self.released = True
        group.debug.interrupt()   # the errors the release raises open no post-mortem
        group.send_signal(self.release_signal, [r for r in group.ranks if r.signalable])

    def _wait(self, deadline: Optional[float], grace: float) -> Optional[float]:
        now = time.monotonic()
        times = []
        if deadline is not None and not self.attempt.timed_out:
            times.append(now + deadline - self.attempt.group.debug.clock())
        if self._trouble_at is not None or self._interrupt_at is not None:
            times.append(now + min(RESEND, RELEASE_AFTER, SETTLE) / 2)
        if not times:
            return None
        return max(0.0, min(times) - now)


def consequences_last(failures) -> None:
    """Reorder (by their timestamps, which decide the order reported) so that the
    failures a lost peer caused, and those of ranks the call's ending released, come
    after the others: reported after the failure that caused them even when they reached
    us first (a death is only known once the rank is reaped)."""
    causes = [f for f in failures if not _consequence(f)]
    if not causes or len(causes) == len(failures):
        return
    latest = max(f.timestamp or 0.0 for f in failures)
    for f in failures:
        if _consequence(f) or f.exc_type == "KeyboardInterrupt":
            f.timestamp = latest + 1e-3


def _consequence(f) -> bool:
    """What a collective raises in a rank when a peer left it (died, or was released),
    or what the release or interrupt raised in a rank (it says so: _rank.heal)."""
    return bool(f.released) or (f.exc_type == "RuntimeError"
                                and any(s in (f.message or "") for s in LOST_PEER))


def _answered(r: RankState) -> bool:
    """The rank answered this call: with a result, an error, or by dying."""
    return r.has_result or r.error is not None or not r.alive


def _all_answered(group: RankGroup) -> bool:
    return all(_answered(r) for r in group.ranks)


def what_was_kept(replaced: Dict[int, int], backend: Optional[str], released: bool,
                  stale: list, nodes: Optional[Dict[int, str]] = None) -> str:
    """What a healed World kept, for its error: `replaced` maps each rank that died and
    was replaced to its new pid, and across nodes `nodes` each such rank to its node as
    %ranks names it ("node 1 (n2)"); with a `backend` the group was rebuilt (a
    collective `released`, or the ranks disagreed), and `stale` lists, per rank, the
    names of the objects that still hold the old group."""
    said = []
    if replaced:
        # Across nodes a pid means nothing without its node.
        procs = (f"pids {replaced}" if not nodes else "; ".join(
            f"rank {r} on {nodes[r]}, pid {pid}" for r, pid in sorted(replaced.items())))
        said.append(f"rank(s) {sorted(replaced)} died and were replaced by fresh "
                    f"processes ({procs}) whose state is gone: send it again "
                    "(world.fresh_ranks names them)")
    if backend is not None:
        why = ("a rank died" if replaced else "a collective was left half-done" if released
               else "the ranks left it in different states")
        said.append(f"the process group was rebuilt ({why}){remake(stale)}. Objects "
                    "made with the old group (a DistributedDataParallel module, groups "
                    "from new_group) must be made again: ddp = "
                    "DistributedDataParallel(module) broadcasts rank 0's parameters")
    return "the world was kept: its ranks and their state; " + "; ".join(said)


def remake(stale: list) -> str:
    """What a rebuilt group's error or log line adds for `stale` (per rank, the names of
    the objects that still hold the old group: _rank.heal.rebuild), or ""."""
    holders = sorted({name for names in stale for name in names})
    return (f"; these hold the old group and must be made again: {', '.join(holders)}"
            if holders else "")


def disagree(states: list) -> bool:
    """The ranks' groups are not all at the same collective: the default group's count
    differs, or a subgroup's between its members (a collective of new_group's or
    new_subgroups' left half-done, whoever answered the interrupt in time)."""
    if len({s["seq"] for s in states}) > 1:
        return True
    counts: Dict[str, set] = {}
    for s in states:
        for name, seq in s.get("subgroups", {}).items():
            counts.setdefault(name, set()).add(seq)
    return any(len(seqs) > 1 for seqs in counts.values())


def forget_failures(attempt: Attempt) -> None:
    """The world goes on: the next call starts with nothing failed."""
    group = attempt.group
    group.failures = []
    for r in group.ranks:
        r.error = None
    attempt.early = None
    attempt.signal_received = None
