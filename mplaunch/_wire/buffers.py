"""A payload's large buffers: pickled out of band, written once into the payload's memfd
after its pickles, page-aligned, and mapped copy-on-write by every rank of the machine.

What goes out of band: every buffer of 64 KiB or more that pickles out of band under
protocol 5 (numpy arrays, and anything else that hands pickle a PickleBuffer), and CPU
tensors, which torch pickles in band (``torch.save`` into bytes): a reducer of this module
hands pickle the bytes of the tensor's view instead. In the caller, pickling copies
nothing (the sink keeps references), and `Payload.memfd` writes each buffer once, from the
caller's memory into the file. In a rank, `read_payload` reads the pickles and maps the
buffers ``MAP_PRIVATE`` from the file: every rank (and every fork of a rank: DataLoader
workers) reads the same pages, and a write copies the page it touches into the writer
alone. The file is sealed once written, so nobody can change what the ranks read.

Rejected:

- what torch.multiprocessing does (``share_memory_()``, one fd per storage): the ranks
  share one storage with the caller and see each other's writes, and the caller's tensor
  stays moved into shared memory. mplaunch passes arguments by value.
- one pickled stream that every rank reads and unpickles whole (mplaunch before): a copy
  of the data per rank, plus the stream's.
- a file in /dev/shm: it outlives a process killed before it unlinks it. A memfd is freed
  with its last fd and mapping.
- a memfd per buffer: an fd per tensor through every hop (server, agents, SCM_RIGHTS'
  253 fds per message), and a state dict holds hundreds.

The file: the pickles as `_wire.payload.dumps_payload` writes them (without their last 8
bytes), then each buffer at a page boundary, then a table (where each out-of-band slot's
bytes lie, and which slots are the `__main__` part's), then 24 bytes: the table's offset,
MAGIC, and the `__main__` part's offset (the last 8 bytes, where _wire.mainmod looks for
it). A payload without large buffers is written exactly as before, and a rank tells the
two apart by MAGIC.

Both pickles put their buffers here: the arguments' and the `__main__` part's (the
globals of the caller's functions: a tensor a notebook cell made and a function reads).
The `__main__` part's slots come last, in stream order as the others; the rank loads
that part first, and its spawn and forkserver children load it again from the rank's
fd (_wire.mainmod.fill_child_main): where it has buffers, the rank keeps the whole file
there (`read_payload`), until its next call's payload arrives.
"""
from __future__ import annotations

import errno
import fcntl
import mmap
import os
import pickle
import threading
from typing import List, Optional, Sequence, Tuple

from . import linux
from .lending import Budget, InputsTooLarge, lendable, size_text

__all__ = ["MIN_BYTES", "Sink", "Payload", "InputsTooLarge", "memfd_of", "read_payload",
           "Buffers", "main_buffers", "lendable", "plan", "seal", "Raw", "Copy"]

MIN_BYTES = 1 << 16           # below this, in the stream: cheaper than a page and a slot
_PAGE = mmap.PAGESIZE
MAGIC = b"mplbufs\x01"        # a pickle ends with b".": a payload without buffers never has it
_TAIL = 24
_CHUNK = 32 << 20             # one write of a large buffer; several go in parallel
_SMALL = 1 << 20              # a payload file a rank reads whole
_SEALS = (getattr(fcntl, "F_SEAL_WRITE", 8) | getattr(fcntl, "F_SEAL_SHRINK", 2)
          | getattr(fcntl, "F_SEAL_GROW", 4) | getattr(fcntl, "F_SEAL_SEAL", 1))


def _align(n: int) -> int:
    return -(-n // _PAGE) * _PAGE


# -- the caller's side: what to write -----------------------------------------------------

class Raw:
    """Bytes that are contiguous in the caller's memory: written as they are."""
    __slots__ = ("view", "nbytes", "keep")

    def __init__(self, view: memoryview, keep=None):
        self.view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
        self.nbytes = self.view.nbytes
        self.keep = keep      # what owns the memory, alive until it is written

    def jobs(self, fd: int, at: int):
        for start in range(0, self.nbytes, _CHUNK):
            yield _pwrite_all, (fd, self.view[start:start + _CHUNK], at + start)


class Copy:
    """A strided view with gaps: copied into the file through a shared mapping (`fill`
    gets the destination's writable memoryview), so the caller makes no contiguous
    copy of its own first."""
    __slots__ = ("nbytes", "fill")

    def __init__(self, nbytes: int, fill):
        self.nbytes, self.fill = nbytes, fill

    def jobs(self, fd: int, at: int):
        yield _fill_mapped, (fd, at, self.nbytes, self.fill)


class _Plan(bytearray):
    """The exporter a reducer of this module hands pickle for bytes it writes itself:
    empty (an out-of-band buffer is never read by the pickler), carrying its source."""
    __slots__ = ("source", "key")


def plan(source, key=None) -> pickle.PickleBuffer:
    """What a reducer hands pickle for bytes this module is to write from `source` (a
    Raw or a Copy); `key` names the bytes, so that the same ones are written once."""
    p = _Plan()
    p.source, p.key = source, key
    return pickle.PickleBuffer(p)


class Sink:
    """The buffer_callback of a payload's pickler: each buffer of MIN_BYTES or more goes
    out of band (False) and is kept, by reference, for `Payload.memfd` to write."""

    def __init__(self):
        self.sources: list = []
        self.slots: List[int] = []      # per out-of-band buffer, in stream order: a source
        self._keyed: dict = {}
        self.main_from: Optional[int] = None   # the first slot of the `__main__` part

    def main_part(self) -> None:
        """The buffers from now on are the `__main__` part's (a pickle of its own, that
        the rank loads first and its children load again)."""
        self.main_from = len(self.slots)

    def __call__(self, buf: pickle.PickleBuffer) -> bool:
        obj = memoryview(buf).obj
        if isinstance(obj, _Plan):
            source, key = obj.source, obj.key
        else:
            try:
                raw = buf.raw()
            except BufferError:      # not contiguous: pickle writes it in band
                return True
            if raw.nbytes < MIN_BYTES:
                return True
            source, key = Raw(raw, obj), _address_key(obj, raw.nbytes)
        index = self._keyed.get(key) if key is not None else None
        if index is None:
            # The same bytes twice (two views of one span): written once, and the two
            # objects share them in the rank as they did here.
            index = len(self.sources)
            self.sources.append(source)
            if key is not None:
                self._keyed[key] = index
        self.slots.append(index)
        return False

    def payload(self, pickled: bytes):
        """`pickled` (the payload's bytes) alone when nothing went out of band, else a
        Payload; InputsTooLarge if its buffers do not fit."""
        if not self.slots:
            return pickled
        main_from = self.main_from if self.main_from is not None else len(self.slots)
        payload = Payload(pickled, self.sources, self.slots, main_from)
        limit, source = lendable()
        if payload.nbytes > limit:
            raise InputsTooLarge(payload.nbytes, limit, source)
        return payload


def _address_key(obj, nbytes: int):
    """(address, size) of a numpy array's data, to write the same bytes once."""
    face = getattr(obj, "__array_interface__", None)
    if isinstance(face, dict) and isinstance(face.get("data"), tuple):
        return face["data"][0], nbytes
    return None


class Payload:
    """A payload with buffers out of band: the pickles, and where each buffer's bytes are
    in the caller's memory until `memfd` writes the file the ranks read."""

    def __init__(self, pickled: bytes, sources: Sequence, slots: Sequence[int],
                 main_from: Optional[int] = None):
        self.pickled = pickled
        self._sources: Optional[Sequence] = sources
        head = len(pickled) - 8
        at = self.region = _align(head)
        self._offsets = []
        for s in sources:
            self._offsets.append(at)
            at = _align(at + s.nbytes)
        self.region_end = self._offsets[-1] + sources[-1].nbytes
        main_from = len(slots) if main_from is None else main_from
        table = pickle.dumps((head, self.region, self.region_end,
                              [(self._offsets[i], sources[i].nbytes) for i in slots],
                              main_from),
                             protocol=pickle.HIGHEST_PROTOCOL)
        self._tail = (table + self.region_end.to_bytes(8, "little") + MAGIC
                      + pickled[-8:])
        self.nbytes = self.region_end + len(self._tail)
        self.buffers = len(slots)

    def memfd(self) -> int:
        """The sealed memfd of this payload, written now (once: the caller's memory is
        let go of); positioned at 0, close-on-exec."""
        sources, self._sources = self._sources, None
        if sources is None:
            raise RuntimeError("this payload was written already")
        fd = os.memfd_create("mplaunch-payload", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, self.nbytes)   # holes until written: no memory yet
            _pwrite_all(fd, memoryview(self.pickled)[:-8], 0)
            budget = Budget(self.nbytes)
            _run([job for s, at in zip(sources, self._offsets) for job in s.jobs(fd, at)],
                 budget)
            _pwrite_all(fd, memoryview(self._tail), self.region_end)
            seal(fd)
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.ENOSPC, errno.ENOMEM):   # memory got short meanwhile
                limit, source = lendable()
                raise InputsTooLarge(self.nbytes, limit, source) from exc
            raise
        except BaseException:
            os.close(fd)
            raise
        return fd

    def __repr__(self) -> str:
        return (f"<mplaunch payload: {len(self.pickled)} bytes of pickles, "
                f"{self.buffers} buffers out of band, {size_text(self.nbytes)}>")


def seal(fd: int) -> None:
    """Nobody changes a written payload file any more (a kernel without seals: the
    ranks' mappings are private anyway)."""
    try:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
    except (OSError, AttributeError):
        pass


def memfd_of(payload) -> int:
    """A memfd holding `payload` (bytes, or a Payload), for the ranks to start from."""
    if isinstance(payload, Payload):
        return payload.memfd()
    return linux.memfd_with(payload, "mplaunch-payload")


def _pwrite_all(fd: int, view: memoryview, at: int) -> None:
    done = 0
    while done < view.nbytes:
        done += os.pwrite(fd, view[done:], at + done)


def _fill_mapped(fd: int, at: int, nbytes: int, fill) -> None:
    m = mmap.mmap(fd, nbytes, offset=at)   # shared: writes land in the file
    try:
        view = memoryview(m)
        try:
            fill(view)
        finally:
            view.release()
    finally:
        m.close()


def _job_size(job) -> int:
    func, args = job
    return args[1].nbytes if func is _pwrite_all else args[2]


def _run(jobs: list, budget: "Optional[Budget]" = None) -> None:
    """Run the writes, on a few threads when there are several: the kernel allocates and
    fills the file's pages as fast as memory lets, each thread its own."""
    if budget is not None:
        jobs = [(_counted, (budget, job)) for job in jobs]
    n = min(len(jobs), 4, len(os.sched_getaffinity(0)))
    if n <= 1:
        for func, args in jobs:
            func(*args)
        return
    todo = iter(jobs)
    lock = threading.Lock()
    errors: list = []

    def work():
        while not errors:
            with lock:
                job = next(todo, None)
            if job is None:
                return
            try:
                job[0](*job[1])
            except BaseException as exc:  # noqa: BLE001 - raised in the caller below
                errors.append(exc)
    threads = [threading.Thread(target=work, name="mplaunch-write") for _ in range(n - 1)]
    for t in threads:
        t.start()
    try:
        work()
    except BaseException as exc:   # an interrupt: the other threads stop too
        errors.append(exc)
        raise
    finally:
        for t in threads:
            t.join()
    if errors:
        raise errors[0]


def _counted(budget: Budget, job) -> None:
    budget.wrote(_job_size(job))
    job[0](*job[1])


class Buffers(list):
    """A payload's out-of-band buffers in stream order; those from `main_at` on are the
    `__main__` part's (loaded first, by _wire.mainmod)."""
    __slots__ = ("main_at",)


def read_payload(fd: int):
    """In a rank: (the payload's pickles as dumps_payload wrote them, the buffers for
    pickle.loads: a `Buffers`). The buffers are memoryviews of one private mapping of
    the file: they keep it (and the file) alive as long as anything made from them
    lives. The fd is then replaced, in place, by a memfd of the pickles alone: the
    rank's children read its `__main__` there, and the buffers are not held by it;
    except where the `__main__` part has buffers of its own, which those children map
    from this file too: it stays whole at `fd` until the next payload is read."""
    _let_go_of_kept()
    size = os.fstat(fd).st_size
    # A small file is read whole, as before there were buffers (one call: the common
    # path costs nothing more); of a large one, the tail first.
    whole_file = _pread_all(fd, size, 0) if size <= _SMALL else None
    tail = whole_file[-_TAIL:] if whole_file is not None else os.pread(fd, _TAIL, size - _TAIL)
    if size < _TAIL + 2 or tail[8:16] != MAGIC:
        return whole_file if whole_file is not None else _pread_all(fd, size, 0), ()
    table_at = int.from_bytes(tail[:8], "little")
    table = (whole_file[table_at:size - _TAIL] if whole_file is not None
             else _pread_all(fd, size - _TAIL - table_at, table_at))
    head, region, region_end, slots, main_from = _table(table)
    data = (whole_file[:head] if whole_file is not None else _pread_all(fd, head, 0)) \
        + tail[16:]
    del whole_file
    found = Buffers(_mapped_slots(fd, region, region_end, slots))
    found.main_at = main_from
    if main_from < len(slots):
        _keep_whole(fd)
        return data, found
    small = linux.memfd_with(data, "mplaunch-payload")
    try:
        os.dup2(small, fd, inheritable=os.get_inheritable(fd))
    finally:
        os.close(small)
    return data, found


def main_buffers(fd: int) -> list:
    """The out-of-band buffers of the `__main__` part of the payload file at `fd` (a
    rank's, which a child of it opened), mapped copy-on-write: the pages the rank maps.
    Empty for a file without buffers."""
    size = os.fstat(fd).st_size
    if size < _TAIL + 2:
        return []
    tail = _pread_all(fd, _TAIL, size - _TAIL)
    if tail[8:16] != MAGIC:
        return []
    table_at = int.from_bytes(tail[:8], "little")
    _, region, region_end, slots, main_from = _table(
        _pread_all(fd, size - _TAIL - table_at, table_at))
    if main_from >= len(slots):
        return []
    return _mapped_slots(fd, region, region_end, slots)[main_from:]


def _table(data: bytes):
    """(head, region, region_end, slots, main_from): a table without main_from is of a
    payload whose `__main__` part had no buffers."""
    head, region, region_end, slots, *rest = pickle.loads(data)
    return head, region, region_end, slots, (rest[0] if rest else len(slots))


def _mapped_slots(fd: int, region: int, region_end: int, slots) -> list:
    mapping = mmap.mmap(fd, region_end - region, access=mmap.ACCESS_COPY, offset=region)
    whole = memoryview(mapping)
    found = [whole[at - region:at - region + n] for at, n in slots]
    whole.release()
    return found


# The payload fd a rank keeps whole for its children ((fd, device, inode)), until its
# next payload arrives: then that fd becomes an empty memfd, in place (its number is the
# caller's to close), and the file is held only by what still maps it. Its children have
# read it by then (they load `__main__` when they start), and the rank's `__main__`
# names the new payload from its next load on.
_kept: Optional[Tuple[int, int, int]] = None


def _keep_whole(fd: int) -> None:
    global _kept
    st = os.fstat(fd)
    _kept = (fd, st.st_dev, st.st_ino)


def _let_go_of_kept() -> None:
    global _kept
    kept, _kept = _kept, None
    if kept is None:
        return
    fd, dev, ino = kept
    try:
        st = os.fstat(fd)
    except OSError:
        return    # closed already
    if (st.st_dev, st.st_ino) != (dev, ino):
        return    # the number is another file's now
    empty = linux.memfd_with(b"", "mplaunch-payload")
    try:
        os.dup2(empty, fd, inheritable=os.get_inheritable(fd))
    finally:
        os.close(empty)


def _pread_all(fd: int, n: int, at: int) -> bytes:
    chunks, done = [], 0
    while done < n:
        chunk = os.pread(fd, n - done, at + done)
        if not chunk:
            raise pickle.UnpicklingError("a payload's file is shorter than it says")
        chunks.append(chunk)
        done += len(chunk)
    return b"".join(chunks)
