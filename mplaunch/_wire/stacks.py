"""Where a rank was, read back from text: its faulthandler dump (where it waits, for a
timeout's message and stacks on demand) and its traceback (where it failed, for a
failure's one line).

Several ranks' stacks are shown grouped: ranks at the same place share one block, so
64 ranks at one line read as one stack, and the rank that is elsewhere stands out. A
rank with torch.distributed initialised also sends, next to its dump, the sequence
number of its default group's last collective (``COLLECTIVE_MARK`` records, written by
_rank.collectives); with the collective its dump shows it in, that says which
ranks are behind.
"""
from __future__ import annotations

import linecache
import os
import re
import sysconfig
from typing import Dict, List, Optional, Sequence, Tuple

_FRAME = re.compile(r'^\s+File "(?P<file>.*)", line (?P<line>\d+) in (?P<func>.*)$')
_THREAD = re.compile(r"^(Current thread|Thread) (0x[0-9a-f]+)")
# A frame line of a traceback printed by Python (SyntaxError's "File ..., line N" has no
# function and names no frame).
_TB_FRAME = re.compile(r'^  File "(?P<file>.*)", line (?P<line>\d+), in (?P<func>.*)$')
_TB_HEAD = "Traceback (most recent call last):"

INNERMOST = 4
# mplaunch's own package (this file is in its _wire folder): frames there are not the user's.
_OWN_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
NO_STACK = "no stack arrived (it did not answer in time)"

# A rank's answer about its collectives, inside its stack text: MARK + json + END. NUL
# never appears in a faulthandler dump, so the record is found wherever it landed.
COLLECTIVE_MARK = "\x00mplaunch-collectives "
COLLECTIVE_END = "\x00"
_RECORD = re.compile(re.escape(COLLECTIVE_MARK) + "(?P<json>[^\x00]*)" + COLLECTIVE_END)
REPORTER = COLLECTIVE_MARK + '{"reporter": true}' + COLLECTIVE_END
_C10D = os.sep + os.path.join("torch", "distributed", "distributed_c10d.py")


# Threads of mplaunch's own in a rank, by the function they run, for those that wait
# inside the standard library (signal.sigwait) rather than in mplaunch's code.
_OWN_THREADS = ("_release_loop",)


def split_record(text: str) -> Tuple[str, Optional[dict]]:
    """(the dump without collective records, the last record or None)."""
    import json
    record = None
    for m in _RECORD.finditer(text):
        try:
            found = json.loads(m["json"])
        except ValueError:
            continue
        if "reporter" not in found:  # its announcement says only that it runs
            record = found
    return _RECORD.sub("", text), record


def _raw_threads(text: str):
    """[(header, frames)], the main thread's header "Current thread ...": in a dump
    written by a rank's collectives reporter, the current thread is the reporter's, and
    its record names the main one."""
    text, record = split_record(text)
    main = record.get("main") if record else None
    threads = []
    for line in text.splitlines():
        m = _THREAD.match(line)
        if m:
            header = line.rstrip(":").replace(" (most recent call first)", "")
            if main is not None:
                header = ("Current thread " if m.group(2) == main else "Thread ") + m.group(2)
            threads.append((header, []))
            continue
        f = _FRAME.match(line)
        if f and threads:
            threads[-1][1].append((f["file"], int(f["line"]), f["func"]))
    return threads


def _users_frames(frames):
    """Without mplaunch's own frames (the server's loop, the worker's bootstrap: below
    every rank's stack, they say nothing about where it waits), nor the `python -c`
    code that started the process, which is outside them. A user's function defined
    in `python -c` code runs inside them, so its frames ("<string>") stay."""
    own = [i for i, f in enumerate(frames) if f[0].startswith(_OWN_DIR)]
    innermost_own = own[0] if own else len(frames)
    return [f for i, f in enumerate(frames) if not f[0].startswith(_OWN_DIR)
            and not (f[0] == "<string>" and i > innermost_own)]


def parse_dump(text: str) -> List[Tuple[str, List[Tuple[str, int, str]]]]:
    """[(thread header, [(file, line, func), ...innermost first])]; threads that ran
    only mplaunch's code (a rank's collectives reporter) are left out."""
    threads = []
    for header, frames in _raw_threads(text):
        main = header.startswith("Current")
        if not main and frames and frames[0][0].startswith(_OWN_DIR):
            continue  # a thread of mplaunch's own, waiting in its code
        if not main and any(f[0].startswith(_OWN_DIR) and f[2] in _OWN_THREADS
                            for f in frames):
            continue  # one waiting in the library (a healing World's release thread)
        threads.append((header, _users_frames(frames)))
    return threads


def collective_of(text: str) -> Optional[str]:
    """The torch.distributed function the main thread of this dump is in
    ("all_reduce"), or None."""
    threads = _raw_threads(text)
    main = [t for t in threads if t[0].startswith("Current")] or threads[-1:]
    for _header, frames in main:
        for file, _line, func in frames:
            if file.endswith(_C10D):
                return func
    return None


def format_frames(frames, limit: int = INNERMOST) -> List[str]:
    """Innermost `limit` frames in traceback order (outermost first), each with its
    source line: a C call (a collective, time.sleep) has no frame of its own, so the
    line that called it is what tells the reader where the rank waits."""
    out = []
    shown = list(reversed(frames[:limit]))
    if len(frames) > limit:
        out.append(f"  ... {len(frames) - limit} outer frame(s)")
    for file, line, func in shown:
        out.append(f'  File "{file}", line {line}, in {func}')
        src = linecache.getline(file, line).strip()
        if src:
            out.append(f"    {src}")
    return out


def collective_line(dump: str) -> Optional[str]:
    """What this rank's dump says about collectives: the one it is in and the default
    group's sequence number, when torch.distributed is initialised in it (its
    reporter answered, or a torch.distributed function is on its stack); else None."""
    record = split_record(dump)[1]
    name = collective_of(dump)
    if record is None and name is None:
        return None
    if record is not None and not record.get("initialized", True):
        return None
    seq = record.get("seq") if record else None
    inside = _inside(record)
    if name is not None and inside is not None and inside[0] != DEFAULT_GROUP:
        group, started = inside
        return f"in torch.distributed.{name}: collective {started} of {_label(group)}"
    if name is not None:
        number = (f"collective {seq} of its default group" if seq is not None
                  else "collective number unknown (" + (
                      record.get("why") if record and record.get("why") else
                      "the rank did not report it") + ")")
        return f"in torch.distributed.{name}: {number}"
    if seq is not None:
        return f"in no collective; its default group has started {seq}"
    return None


DEFAULT_GROUP = "0"   # the default group's name in torch's Flight Recorder


def _label(group: str) -> str:
    return "its default group" if group == DEFAULT_GROUP else f"group {group}"


def _inside(record: Optional[dict]) -> Optional[Tuple[str, int]]:
    """(the group whose collective the rank's main thread is in, its number), where
    the rank said (_rank.collectives), else None."""
    current = (record or {}).get("current")
    if not current:
        return None
    return str(current[0]), int(current[1])


def sequence_of(dump: str, group: str = DEFAULT_GROUP) -> Tuple[Optional[int], bool]:
    """(`group`'s sequence number or None, whether the rank is inside a collective of
    it): from every group's counts where the rank sent them, else the default group's
    number and whether a torch.distributed function is on its stack."""
    record = split_record(dump)[1]
    groups = (record or {}).get("groups")
    if groups:
        if group not in groups:
            return None, False
        inside = _inside(record)
        if inside is not None and inside[0] == group and collective_of(dump) is not None:
            return inside[1], True
        return int(groups[group]), False
    if group != DEFAULT_GROUP:
        return None, False
    seq = record.get("seq") if record else None
    return (seq if isinstance(seq, int) else None), collective_of(dump) is not None


def _groups_of(stacks: Dict[int, str]) -> List[str]:
    """Every group some rank sent counts of, the default one first."""
    names = set()
    for dump in stacks.values():
        names.update(((split_record(dump)[1] or {}).get("groups") or {}).keys())
    names.discard(DEFAULT_GROUP)
    return [DEFAULT_GROUP] + sorted(names, key=lambda n: (len(n), n))


def readable_stack(dump: str) -> str:
    """One rank's faulthandler dump as the timeout's message shows it: the collective
    it is in, then the innermost frames of each thread, main thread first, with source
    lines, without mplaunch's own frames. Text that is not a dump is kept as it is."""
    threads = parse_dump(dump)
    if not threads:
        return split_record(dump)[0].strip("\n") or NO_STACK
    lines = []
    collective = collective_line(dump)
    if collective:
        lines.append(collective)
    # The main thread is listed last by faulthandler; show it first.
    ordered = sorted(threads, key=lambda t: 0 if t[0].startswith("Current") else 1)
    for header, frames in ordered:
        shown = format_frames(frames) or ["(only mplaunch's own frames: between calls, "
                                          "or starting)"]
        if len(threads) > 1:
            # Without its address, which differs from rank to rank at the same place.
            lines.append("main thread:" if header.startswith("Current") else "thread:")
            lines.extend("  " + line for line in shown)
        else:
            lines.extend(shown)
    return "\n".join(lines)


def rank_list(ranks: Sequence[int]) -> str:
    """'rank 3', 'ranks 0, 2, 3', 'ranks 0-31, 33' (runs of three or more as ranges)."""
    ranks = sorted(ranks)
    parts, i = [], 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        if j - i >= 2:
            parts.append(f"{ranks[i]}-{ranks[j]}")
        else:
            parts.extend(str(r) for r in ranks[i:j + 1])
        i = j + 1
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(parts)


def group_stacks(readable: Dict[int, str]) -> List[Tuple[List[int], str]]:
    """[(ranks, text)] with identical texts together, the biggest group first (then by
    lowest rank)."""
    groups: Dict[str, List[int]] = {}
    for rank in sorted(readable):
        groups.setdefault(readable[rank], []).append(rank)
    return sorted(((ranks, text) for text, ranks in groups.items()),
                  key=lambda g: (-len(g[0]), g[0][0]))


def behind(stacks: Dict[int, str], group: str = DEFAULT_GROUP) -> Optional[str]:
    """'rank 1 is at collective 41; ranks 0, 2, 3 wait in 42': where the members of
    `group` (default: the default group) disagree on its collective sequence number,
    or None."""
    where: Dict[Tuple[int, bool], List[int]] = {}
    for rank, dump in stacks.items():
        seq, inside = sequence_of(dump, group)
        if seq is not None:
            where.setdefault((seq, inside), []).append(rank)
    if len({seq for seq, _ in where}) < 2:
        return None
    parts = []
    for (seq, inside), ranks in sorted(where.items()):
        who = rank_list(ranks)
        if inside:
            parts.append(f"{who} wait{'s' if len(ranks) == 1 else ''} in {seq}")
        else:
            parts.append(f"{who} {'is' if len(ranks) == 1 else 'are'} at collective {seq}")
    return "; ".join(parts)


def summarize_stacks(stacks: Dict[int, str]) -> str:
    """Every rank's readable stack, identical ones once under the list of their ranks,
    the biggest group first; led by which ranks are behind in their collectives.
    `stacks` maps rank to its raw dump."""
    lines = []
    for group in _groups_of(stacks):
        lagging = behind(stacks, group)
        if lagging and group == DEFAULT_GROUP:
            lines.append(f"collectives: {lagging}")
        elif lagging:
            members = [r for r, d in stacks.items() if sequence_of(d, group)[0] is not None]
            lines.append(f"collectives of group {group} ({rank_list(members)}): {lagging}")
    readable = {rank: readable_stack(dump) for rank, dump in stacks.items()}
    for ranks, text in group_stacks(readable):
        if text == NO_STACK:
            lines.append(f"{rank_list(ranks)}: {NO_STACK}")
            continue
        lines.append(f"{rank_list(ranks)}:")
        lines.extend("  " + line for line in text.splitlines())
    return "\n".join(lines)


class RankStacks(dict):
    """{rank: where it is} as a timeout's message shows each rank; ``str()`` (and
    ``print``) shows them grouped. ``raw`` holds each rank's full dump."""

    def __init__(self, raw: Dict[int, str]):
        super().__init__({rank: readable_stack(raw[rank]) for rank in sorted(raw)})
        self.raw = dict(raw)

    def __str__(self) -> str:
        return summarize_stacks(self.raw) if self.raw else "no rank is running"

    def __reduce__(self):
        return (RankStacks, (self.raw,))


def _library_dirs() -> Tuple[str, ...]:
    dirs = {_OWN_DIR}
    paths = sysconfig.get_paths()
    for key in ("stdlib", "platstdlib", "purelib", "platlib"):
        if paths.get(key):
            dirs.add(os.path.realpath(paths[key]) + os.sep)
            dirs.add(os.path.abspath(paths[key]) + os.sep)
    return tuple(dirs)


def failure_site(tb_text: Optional[str]) -> Optional[Tuple[str, int, str]]:
    """(file, line, function) where a rank's traceback text says it failed: the
    innermost frame of the user's own code in the last traceback of the chain (the one of
    the exception it raised), not a frame inside Python's library, torch or mplaunch,
    since the line that called into those is the one to look at. The innermost frame of
    all when every frame is a library's. None when the text names no frame."""
    if not tb_text:
        return None
    block = tb_text.rsplit(_TB_HEAD, 1)[-1] if _TB_HEAD in tb_text else ""
    frames = []
    for line in block.splitlines():
        m = _TB_FRAME.match(line)
        if m:
            frames.append((m["file"], int(m["line"]), m["func"]))
    if not frames:
        return None
    library = _library_dirs()
    for file, line, func in reversed(frames):
        if not (file.startswith(library) or file.startswith("<frozen ")):
            return file, line, func
    return frames[-1]


def short_path(path: str) -> str:
    """`path` relative to the current directory when it lies below it."""
    try:
        cwd = os.getcwd() + os.sep
    except OSError:
        return path
    return path[len(cwd):] if path.startswith(cwd) else path
