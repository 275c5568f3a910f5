"""Where the late rank is while the others wait for it: sampled during a long call, for
the straggler report (_engine.stragglers).

The Flight Recorder says who came last to each collective, not what it was doing
meanwhile. So, once a call has run for AFTER_S, a thread of the launching process asks
every rank's collectives reporter, every EVERY_S, for its record alone (which
collective of which group its main thread is in, and every group's count: a fraction of
a millisecond in each rank, and no stop). Where every member of a group but one has
started its next collective, that rank is the one they wait for: its stack is taken
then (the reporter's dump, as stacks() does). The call's report shows
the place it was found at most often.
"""
from __future__ import annotations

import collections
import threading
import time
from typing import Dict, Optional

from .timeouts import collect_records, collect_stacks

AFTER_S = 1.0
EVERY_S = 0.5

# One thread for the whole process, started at the first call, samples every call that
# has run for AFTER_S (a World's, a launch's): a call costs a lock and a dict entry, no
# thread started or joined (a thread per launch sat on the path every launch takes).
# Its condition is notified when a call begins, so that it sleeps exactly until the
# next call's first sample is due.
_cond = threading.Condition()
_active: Dict[int, "LateSampler"] = {}   # id -> a sampler whose call runs
_thread: Optional[threading.Thread] = None


class LateSampler:
    """The samples of one World's (or launch's) calls: each call is sampled from
    begin() until end() by the process's sampling thread."""

    def __init__(self):
        self._group = None
        self._found: Dict[int, collections.Counter] = {}
        self._due = 0.0   # monotonic time of its next sample

    def begin(self, group) -> None:
        global _thread
        with _cond:
            self._group, self._found = group, {}
            self._due = time.monotonic() + AFTER_S
            _active[id(self)] = self
            if _thread is None or not _thread.is_alive():   # first call, or a fork's
                _thread = threading.Thread(target=_run, daemon=True,
                                           name="mplaunch-late-sampler")
                _thread.start()
            _cond.notify()

    def end(self) -> Dict[int, collections.Counter]:
        """{rank: {its readable stack while the others waited for it: times}}."""
        with _cond:
            _active.pop(id(self), None)
            found, self._found, self._group = self._found, {}, None
        return found

    def _sample(self, group) -> None:
        """One sample of `group`'s ranks (outside the lock: it asks the ranks)."""
        from .._wire.stacks import readable_stack
        try:
            late = waited_for(collect_records(group))
            dump = (collect_stacks(group, only={late}).get(late)
                    if late is not None else None)
        except Exception:  # noqa: BLE001 - ranks ending under it
            dump = None
        with _cond:
            if dump and group is self._group:
                # by place: its first line ("in no collective; ... has started 6")
                # changes from sample to sample at one place
                text = readable_stack(dump)
                frames = text.split("\n", 1)[-1] if text.startswith("in ") else text
                self._found.setdefault(late, collections.Counter())[frames] += 1


def _run() -> None:
    # No name here holds a call between samples: the calls due live only inside
    # _sample_each (a name left bound while the thread waited kept the last call's
    # group, and the memfds of its ranks' results, past that call's end)
    while True:
        _sample_each(_wait_for_due())


def _wait_for_due() -> list:
    """(sampler, its group) of every call whose next sample is due, once one is."""
    with _cond:
        while True:
            now = time.monotonic()
            due = [(s, s._group) for s in _active.values() if s._due <= now]
            if due:
                for sampler, _group in due:
                    sampler._due = now + EVERY_S
                return due
            _cond.wait(min((s._due for s in _active.values()), default=now + 3600) - now)


def _sample_each(due: list) -> None:
    for sampler, group in due:   # outside the lock: each sample asks the ranks
        sampler._sample(group)


def waited_for(records: Dict[int, Optional[dict]]) -> Optional[int]:
    """The one rank that the other members of some group have got ahead of now: they
    have all started that group's collective n, it has not; or None. (Under DDP the
    ranks wait for a bucket's all_reduce inside backward(), in C++, where no Python
    frame says which collective: the counts do.)"""
    members: Dict[str, Dict[int, int]] = {}
    for rank, record in records.items():
        for group, count in ((record or {}).get("groups") or {}).items():
            members.setdefault(group, {})[rank] = int(count)
    for group in sorted(members, key=lambda g: (g != "0", g)):
        counts = members[group]
        ahead = max(counts.values())
        behind = [r for r, n in counts.items() if n < ahead]
        if len(counts) > 2 and len(behind) == 1 or len(counts) == 2 and behind:
            return behind[0]
    return None
