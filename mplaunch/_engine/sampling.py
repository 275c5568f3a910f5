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
from typing import Dict, Optional

from .timeouts import collect_records, collect_stacks

AFTER_S = 1.0
EVERY_S = 0.5


class LateSampler:
    """One thread for a World's life; each call is sampled from begin() until end().
    Per call that costs setting two events: no thread is started for it."""

    def __init__(self):
        self._lock = threading.Lock()
        self._call = threading.Event()    # set while a call runs
        self._ended = threading.Event()   # set when it ends (wakes the thread)
        self._group = None
        self._found: Dict[int, collections.Counter] = {}
        self._thread: Optional[threading.Thread] = None
        self._closed = False

    def begin(self, group) -> None:
        with self._lock:
            if self._closed:   # closed with the ranks; these are new ones
                self._closed, self._thread = False, None
            self._group, self._found = group, {}
            self._ended.clear()
            self._call.set()
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name="mplaunch-late-sampler")
                self._thread.start()

    def end(self) -> Dict[int, collections.Counter]:
        """{rank: {its readable stack while the others waited for it: times}}."""
        with self._lock:
            self._call.clear()
            self._ended.set()
            found, self._found, self._group = self._found, {}, None
        return found

    def close(self) -> None:
        thread = self._thread
        self._closed = True
        self.end()
        self._call.set()   # the thread sees _closed and returns
        if thread is not None:
            thread.join()
        self._call.clear()

    def _run(self) -> None:
        from .._wire.stacks import readable_stack
        while True:
            self._call.wait()
            if self._closed:
                return
            if self._ended.wait(AFTER_S):
                continue   # a short call: nothing sampled
            while not self._ended.is_set():
                group = self._group
                if group is None:
                    break
                try:
                    late = waited_for(collect_records(group))
                    dump = (collect_stacks(group, only={late}).get(late)
                            if late is not None else None)
                except Exception:  # noqa: BLE001 - ranks ending under it
                    dump = None
                with self._lock:
                    if dump and group is self._group:
                        # by place: its first line ("in no collective; ... has
                        # started 6") changes from sample to sample at one place
                        text = readable_stack(dump)
                        frames = (text.split("\n", 1)[-1] if text.startswith("in ")
                                  else text)
                        self._found.setdefault(late, collections.Counter())[frames] += 1
                if self._ended.wait(EVERY_S):
                    break


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
