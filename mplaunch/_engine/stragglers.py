"""Who the others waited for: a run's collectives, lined up across ranks (issue 41).

Every rank records the collectives it starts (torch's Flight Recorder: the group, the
collective's sequence number in that group, its name and the wall-clock time it was
created, in ns). A collective cannot finish before its last rank starts it, so for each
collective, across the ranks that took part, the one that created it last kept the
others waiting, and for how long: its creation time less the one before it (the least
anyone waited for it). Summed over a call, per rank, that names the straggler.

This module only reads records: gathering them is the rank's (_rank.flight) and the
call's; drawing them is :meth:`StragglerReport.trace`.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

# (group name, sequence number in that group, collective's name, created at, ns)
Record = Tuple[str, int, str, int]

# A rank is named when it kept the others waiting (arrived last by MIN_LATE_S or more)
# at least MIN_TIMES times, for at least WAIT_SHARE of all the waiting any rank caused,
# at least OTHERS_RATIO times as long as any other rank, and for at least SPAN_SHARE of
# the span. Jitter of a few hundred microseconds decides who is "last" where nobody is
# slow: MIN_LATE_S keeps it out; a one-off stall (a page fault, a busy core) is one
# event, which MIN_TIMES and OTHERS_RATIO keep out. Oversubscribed cores make one rank
# a few ms late, again and again (4 ranks on 2 cores, nobody slowed: a rank kept the
# others waiting for 2% of the span in 1 run of 10, and for 18% in 1 of 40): a
# quarter of the span is a rank the user would want named (a 150 ms sleep in a 4-rank
# DDP step of 25 ms: 85% and more), and what that noise does not reach.
MIN_LATE_S = 0.005
MIN_TIMES = 3
WAIT_SHARE = 0.6
OTHERS_RATIO = 3.0
SPAN_SHARE = 1 / 3


@dataclass(frozen=True)
class RankLateness:
    rank: int
    collectives: int      # collectives it took part in (with at least one other rank)
    last: int             # of those, how many it started last, by MIN_LATE_S or more
    waited_for_s: float   # the others' wait for it, summed (last one less the one before)

    @property
    def mean_late_s(self) -> float:
        return self.waited_for_s / self.last if self.last else 0.0


@dataclass
class StragglerReport:
    """Per rank, how often it was the one the others waited for, and for how long."""
    ranks: List[RankLateness]
    named: Optional[int] = None      # the rank the others waited for, where one stands out
    span_s: float = 0.0              # first collective created -> last one created
    collectives: int = 0
    # (group, seq, name) -> {rank: created ns}: what the trace draws
    timeline: Dict[Tuple[str, int, str], Dict[int, int]] = field(default_factory=dict,
                                                                 repr=False)
    # rank -> {its stack, sampled while the others waited for it: times} (_engine.sampling)
    late_stacks: Dict[int, Dict[str, int]] = field(default_factory=dict, repr=False)

    @property
    def waited_share(self) -> float:
        """The named rank's kept-waiting time as a share of the span (0 where none)."""
        if self.named is None or self.span_s <= 0:
            return 0.0
        r = next(r for r in self.ranks if r.rank == self.named)
        return min(1.0, r.waited_for_s / self.span_s)

    def __str__(self) -> str:
        lines = []
        if self.named is not None:
            r = next(r for r in self.ranks if r.rank == self.named)
            lines.append(
                f"rank {r.rank} was the one the others waited for: last in {r.last} of "
                f"{r.collectives} collectives, {r.mean_late_s * 1e3:.0f} ms late on "
                f"average ({self.waited_share:.0%} of the time between the first "
                "collective and the last)")
        elif self.collectives:
            lines.append(f"no rank stands out over {self.collectives} collectives")
        else:
            lines.append("no collective was recorded")
        found = self.late_stacks.get(self.named) if self.named is not None else None
        if found:
            stack, times = max(found.items(), key=lambda kv: kv[1])
            lines.append(f"rank {self.named}, while the others waited for it ({times} of "
                         f"{sum(found.values())} samples):")
            lines.extend("  " + line for line in stack.splitlines())
        if self.collectives:
            lines.append("rank  collectives  last  mean late  waited for")
            for r in self.ranks:
                lines.append(f"{r.rank:>4}  {r.collectives:>11}  {r.last:>4}  "
                             f"{r.mean_late_s * 1e3:>6.1f} ms  {r.waited_for_s:>8.3f} s")
        return "\n".join(lines)

    def lateness(self) -> List[Tuple[Tuple[str, int, str], Dict[int, float]]]:
        """Per collective, in the order they began: each rank's lateness in seconds
        (its creation time less the first rank's)."""
        rows = sorted(self.timeline.items(), key=lambda kv: min(kv[1].values()))
        return [(key, {r: (ns - min(c.values())) / 1e9 for r, ns in c.items()})
                for key, c in rows]

    def _repr_pretty_(self, p, cycle: bool) -> None:
        """IPython (a cell's value, %ranks report): the table, as print() shows it."""
        p.text(str(self))

    def _repr_html_(self) -> str:
        """The table, and one strip per rank, a cell per collective, darker the later
        it came (a notebook draws it)."""
        import html
        rows = self.lateness()
        ranks = sorted({r.rank for r in self.ranks})
        worst = max((max(late.values()) for _, late in rows), default=0.0) or 1.0
        cell, gap = 6, 1
        width = max(1, len(rows)) * (cell + gap) + 60
        svg = [f'<svg width="{width}" height="{len(ranks) * (cell + 4) + 16}" '
               'xmlns="http://www.w3.org/2000/svg" font-size="9">']
        for y, rank in enumerate(ranks):
            top = y * (cell + 4)
            svg.append(f'<text x="0" y="{top + cell}">rank {rank}</text>')
            for x, ((group, seq, name), late) in enumerate(rows):
                if rank not in late:
                    continue
                shade = int(235 - 200 * min(1.0, late[rank] / worst))
                svg.append(f'<rect x="{60 + x * (cell + gap)}" y="{top}" width="{cell}" '
                           f'height="{cell}" fill="rgb(235,{shade},{shade})"><title>'
                           f'{html.escape(name)} #{seq} of group {html.escape(group)}: '
                           f'{late[rank] * 1e3:.1f} ms late</title></rect>')
        svg.append(f'<text x="60" y="{len(ranks) * (cell + 4) + 12}">collectives in the '
                   f'order they began; darkest: {worst * 1e3:.0f} ms late</text></svg>')
        return f"<pre>{html.escape(str(self))}</pre>" + "".join(svg)

    def trace(self, path: Optional[str] = None,
              profiles: Optional[Dict[int, str]] = None) -> dict:
        """A Chrome/Perfetto trace: one process per rank, one slice per collective
        from when the rank started it to when the last rank did (the wait), an
        instant where a rank arrived last. `profiles`: {rank: a Chrome trace that
        torch.profiler wrote in that rank (``export_chrome_trace``)}, merged in, each
        under its rank, on the same clock. Written to `path` when given."""
        events: List[dict] = []
        for rank, profile in (profiles or {}).items():
            events.extend(_profile_events(rank, profile))
        ranks = sorted({r.rank for r in self.ranks})
        for rank in ranks:
            events.append({"ph": "M", "name": "process_name", "pid": rank,
                           "args": {"name": f"rank {rank}"}})
            events.append({"ph": "M", "name": "process_sort_index", "pid": rank,
                           "args": {"sort_index": rank}})
        for (group, seq, name), created in self.timeline.items():
            end = max(created.values())
            order = sorted(created.values())
            late = (order[-1] - order[-2]) / 1e9 if len(order) > 1 else 0.0
            for rank, ns in created.items():
                args = {"group": group, "seq": seq, "ranks": len(created)}
                events.append({"ph": "X", "name": f"{name} #{seq}", "cat": group,
                               "pid": rank, "tid": 0, "ts": ns / 1e3,
                               "dur": max((end - ns) / 1e3, 1.0), "args": args})
                if ns == end and late >= MIN_LATE_S:
                    events.append({"ph": "i", "s": "t", "name": "arrived last",
                                   "pid": rank, "tid": 0, "ts": ns / 1e3,
                                   "args": {"late_ms": round(late * 1e3, 3)}})
        out = {"traceEvents": events, "displayTimeUnit": "ms"}
        if path is not None:
            with open(path, "w") as f:
                json.dump(out, f)
        return out


def _profile_events(rank: int, path: str) -> List[dict]:
    """torch.profiler's events of `rank`'s trace at `path`, moved under the rank's
    process and onto the wall clock (its ``baseTimeNanoseconds`` plus each ``ts``, as
    the collectives' times are)."""
    with open(path) as f:
        data = json.load(f)
    base_us = int(data.get("baseTimeNanoseconds", 0)) / 1e3
    out = []
    for e in data.get("traceEvents", []):
        if e.get("ph") == "M" or "ts" not in e:
            continue   # its own process names: the rank's name is ours
        e = dict(e, pid=rank, ts=float(e["ts"]) + base_us)
        e.setdefault("args", {})
        out.append(e)
    return out


def take_records(group) -> Tuple[Dict[int, List[Record]], Optional[str]]:
    """The records `group`'s ranks (_engine.group.RankGroup) sent ahead of their answers
    since the last look, by rank, their times moved onto this process's clock (each
    node's offset: its spawner's clock_offset_ns), and why the ranks could not read
    their recorder, if one could not (_rank.flight). Nothing where some ranks read
    their records and others did not: a rank reads them only where its own call
    lasted MIN_CALL_S, so a call of about that long is read in some ranks only (found
    by CI: a 1 s call read in rank 1 alone, whose report then held no collective),
    and the others' records alone would blame the wrong rank. A World's report()
    then reads them all again (_rank.flight.last_call)."""
    records: Dict[int, List[Record]] = {}
    off = None
    for r in group.ranks:
        shift = group.spawner.clock_offset_ns(r.spec.node_rank)
        for sent in r.collectives:
            off = off or sent.why_off
            records.setdefault(r.spec.rank, []).extend(
                (g, seq, op, ns - shift) for g, seq, op, ns in sent.records)
        r.collectives = []
    if len(records) < len(group.ranks):
        records = {}
    return records, off


def analyse(records: Dict[int, Iterable[Record]]) -> StragglerReport:
    """`records`: per rank, the collectives it created. Collectives seen by one rank
    only (a group of one, or a rank whose records were lost) count for nobody."""
    timeline: Dict[Tuple[str, int, str], Dict[int, int]] = {}
    for rank, recs in records.items():
        for group, seq, name, ns in recs:
            timeline.setdefault((group, seq, name), {})[rank] = ns
    timeline = {k: v for k, v in timeline.items() if len(v) > 1}
    took = {rank: 0 for rank in records}
    last = {rank: 0 for rank in records}
    waited = {rank: 0.0 for rank in records}
    first_ns, last_ns = None, None
    for created in timeline.values():
        order = sorted(created.items(), key=lambda kv: kv[1])
        (late_rank, late_ns), before_ns = order[-1], order[-2][1]
        for rank in created:
            took[rank] += 1
        gap = (late_ns - before_ns) / 1e9
        if gap >= MIN_LATE_S:
            last[late_rank] += 1
            waited[late_rank] += gap
        lo, hi = order[0][1], late_ns
        first_ns = lo if first_ns is None else min(first_ns, lo)
        last_ns = hi if last_ns is None else max(last_ns, hi)
    ranks = [RankLateness(r, took[r], last[r], waited[r]) for r in sorted(records)]
    span = (last_ns - first_ns) / 1e9 if timeline else 0.0
    named = _named(ranks)
    if named is not None and span > 0 and waited[named] < SPAN_SHARE * span:
        named = None
    return StragglerReport(ranks, named, span, len(timeline), timeline)


def off_line(why: str) -> str:
    """What is said, once, where the ranks cannot read their collectives."""
    return (f"no straggler report: the ranks cannot read torch's Flight Recorder "
            f"({why}); timeouts and stacks() still name a rank that is stuck")


def worth_saying(report: StragglerReport, told: set) -> Optional[str]:
    """The line to say on its own about `report` (its first line), once per rank in the
    caller's `told`; or None."""
    if report.named is None:
        return None
    key = ("straggler", report.named)
    if key in told:
        return None
    told.add(key)
    return str(report).splitlines()[0]


def _named(ranks: Sequence[RankLateness]) -> Optional[int]:
    """The rank that stands out, or None."""
    if len(ranks) < 2:
        return None
    top = max(ranks, key=lambda r: r.waited_for_s)
    total = sum(r.waited_for_s for r in ranks)
    others = max((r.waited_for_s for r in ranks if r is not top), default=0.0)
    if (top.last < MIN_TIMES or top.waited_for_s < WAIT_SHARE * total
            or top.waited_for_s < OTHERS_RATIO * others):
        return None
    return top.rank
