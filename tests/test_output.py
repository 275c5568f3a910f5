"""The ranks' stdout and stderr: captured at the fd level, relayed whole-line with a
prefix, copied to log files, summarized in errors, written as torch elastic error files.

The relay writes to the sys.stdout / sys.stderr objects that were current when launch()
was called, so pytest's capsys sees exactly what a user's terminal or notebook cell
would.
"""
import ctypes
import io
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

import mplaunch
from mplaunch._engine.output import StreamRelay
from mplaunch._engine.tails import summarize_tail

PREFIX_RE = re.compile(r"^\[rank(\d+)\]: ")


def _rank():
    return int(os.environ["RANK"])


# -- what is captured -------------------------------------------------------------------

def write_every_way():
    r = _rank()
    print(f"print {r}")
    print(f"print-err {r}", file=sys.stderr)
    os.write(1, f"os.write {r}\n".encode())
    os.write(2, f"os.write-err {r}\n".encode())
    libc = ctypes.CDLL(None)
    libc.write(1, f"libc.write {r}\n".encode(), len(f"libc.write {r}\n"))
    libc.dprintf(2, b"dprintf-err %d\n", r)
    subprocess.run([sys.executable, "-c",
                    f"import sys; print('child {r}'); print('child-err {r}', file=sys.stderr)"],
                   check=True)
    subprocess.run(["sh", "-c", f"echo shell {r}"], check=True)
    return r


@pytest.mark.parametrize("method", ["forkserver", "spawn", "fork"])
def test_every_kind_of_write_is_relayed_with_its_prefix(capsys, method):
    assert mplaunch.launch(write_every_way, nprocs=2, start_method=method) == [0, 1]
    out, err = capsys.readouterr()
    for r in (0, 1):
        for what in ("print", "os.write", "libc.write", "child", "shell"):
            assert f"[rank{r}]: {what} {r}\n" in out, (what, out)
        for what in ("print-err", "os.write-err", "dprintf-err", "child-err"):
            assert f"[rank{r}]: {what} {r}\n" in err, (what, err)
    for text in (out, err):
        assert all(PREFIX_RE.match(line) for line in text.splitlines()), text


def printf_fully_buffered():
    global _keep_buffer
    libc = ctypes.CDLL(None)
    stdout = ctypes.c_void_p.in_dll(libc, "stdout")
    # As C stdio is when the rank's stdout is a pipe and PYTHONUNBUFFERED was not set
    # when the interpreter started: the text sits in this buffer until it is flushed.
    _keep_buffer = ctypes.create_string_buffer(8192)
    libc.setvbuf(stdout, _keep_buffer, 0, 8192)  # _IOFBF
    libc.printf(b"printf %d never flushed by the rank\n", 7)
    return 0


def test_c_stdio_buffer_is_flushed_when_the_rank_returns(capsys):
    mplaunch.launch(printf_fully_buffered)
    assert "[rank0]: printf 7 never flushed by the rank\n" in capsys.readouterr().out


# -- nothing lost, nothing late ---------------------------------------------------------

def write_then_sigkill(n):
    if _rank() == 1:
        for i in range(n):
            print(f"line {i}")
        os.write(1, b"blob:" + b"b" * 300_000 + b"\n")
        print("to stderr before dying", file=sys.stderr)
        os.write(1, b"last words without newline")
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)


def test_everything_before_a_sigkill_is_relayed(capsys):
    n = 3000
    with pytest.raises(mplaunch.WorkerError) as info:
        mplaunch.launch(write_then_sigkill, (n,), nprocs=2, grace_period=1)
    assert info.value.rank == 1 and info.value.signal == "SIGKILL"
    out, err = capsys.readouterr()
    lines = [line for line in out.splitlines() if line.startswith("[rank1]: ")]
    expected = [f"[rank1]: line {i}" for i in range(n)]
    assert lines[:n] == expected
    assert lines[n] == "[rank1]: blob:" + "b" * 300_000
    assert lines[n + 1:] == ["[rank1]: last words without newline"]
    assert out.endswith("[rank1]: last words without newline\n")
    assert "[rank1]: to stderr before dying\n" in err
    assert "to stderr before dying" in info.value.stderr_tail


def leave_a_writer_behind():
    rfd, wfd = os.pipe()
    # A descendant that keeps the rank's stdout open and would go on writing.
    subprocess.Popen(["sh", "-c", f"echo early; echo go >&{wfd}; sleep 60; echo late"],
                     pass_fds=(wfd,))
    os.close(wfd)
    os.read(rfd, 3)  # "early" is in the pipe
    os.close(rfd)
    return "done"


def test_rank_returns_while_its_child_still_holds_stdout(capsys):
    # The launch ends the orphan (the leak check proves it) instead of waiting for its
    # end of the pipe, and what it wrote before is relayed.
    t0 = time.monotonic()
    assert mplaunch.launch(leave_a_writer_behind) == ["done"]
    assert time.monotonic() - t0 < 30
    out, _ = capsys.readouterr()
    assert out == "[rank0]: early\n"


def final_line_without_newline():
    sys.stdout.write("out without newline")
    sys.stderr.write("err without newline")
    return 1


def test_final_line_without_newline(capsys):
    mplaunch.launch(final_line_without_newline, nprocs=2)
    out, err = capsys.readouterr()
    assert sorted(out.splitlines(keepends=True)) == [
        "[rank0]: out without newline\n", "[rank1]: out without newline\n"]
    assert sorted(err.splitlines(keepends=True)) == [
        "[rank0]: err without newline\n", "[rank1]: err without newline\n"]


# -- lines stay whole -------------------------------------------------------------------

def _long_line(r, i, width):
    head = f"{r}:{i:06d}:"
    return head + chr(ord("a") + r) * (width - len(head))


def flood_long_lines(count, width, seed):
    r = _rank()
    data = "".join(_long_line(r, i, width) + "\n" for i in range(count)).encode()
    rng = random.Random(seed + r)
    pos = 0
    while pos < len(data):
        # Arbitrary write sizes, so the pipe's reads end in the middle of lines.
        n = rng.randint(1, 3 * width)
        pos += os.write(1, data[pos:pos + n])
    return len(data)


def test_two_ranks_flooding_long_lines_never_tear_a_line(capsys):
    count, width = 1500, 4000
    mplaunch.launch(flood_long_lines, (count, width, 1234), nprocs=2)
    out, _ = capsys.readouterr()
    seen = {0: [], 1: []}
    for line in out.split("\n")[:-1]:
        m = PREFIX_RE.match(line)
        assert m, f"line without its prefix: {line[:80]!r}"
        r = int(m.group(1))
        seen[r].append(line[m.end():])
    for r in (0, 1):
        assert seen[r] == [_long_line(r, i, width) for i in range(count)]


def test_a_line_split_anywhere_comes_out_whole_and_decoded():
    text = "héllo wörld ✓ 日本語 🎉\n".encode()
    for cut1 in range(1, len(text)):
        for cut2 in range(cut1, len(text)):
            sink = io.StringIO()
            relay = StreamRelay(sink, "[rank3]: ")
            for part in (text[:cut1], text[cut1:cut2], text[cut2:]):
                relay.feed(part)
            relay.close()
            assert sink.getvalue() == "[rank3]: héllo wörld ✓ 日本語 🎉\n"


@pytest.mark.parametrize("prefix", ["[rank0]: ", ""])
@pytest.mark.parametrize("seed", range(20))
def test_any_chunking_gives_the_same_lines(prefix, seed):
    rng = random.Random(seed)
    alphabet = ["a", "b", "é", "✓", "\n", "\n", "\r", " "]
    text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 400))) + "\n"
    data = text.encode()
    sink = io.StringIO()
    relay = StreamRelay(sink, prefix)
    pos = 0
    while pos < len(data):
        n = rng.randint(1, 12)
        relay.feed(data[pos:pos + n])
        pos += n
    relay.close()
    expected = []
    for line in text.split("\n")[:-1]:
        segs = [seg for seg in line.split("\r") if seg]
        expected.append(prefix + (segs[-1] if segs else ""))
    out_lines = sink.getvalue().split("\n")
    assert out_lines[-1] == ""
    # Each line as it finally reads, after the in-place redraws that preceded it.
    assert [line.split("\r")[-1] for line in out_lines[:-1]] == expected
    assert all(seg.startswith(prefix) for line in out_lines[:-1] for seg in line.split("\r"))
    assert "\ufffd" not in sink.getvalue()  # not even in a redraw


def write_unicode_bytewise():
    data = "ünïcödé ✓ 日本語\n".encode() * 3
    for i in range(len(data)):
        os.write(1, data[i:i + 1])
        time.sleep(0.001)
    return 0


def test_unicode_written_byte_by_byte(capsys):
    mplaunch.launch(write_unicode_bytewise)
    assert capsys.readouterr().out == "[rank0]: ünïcödé ✓ 日本語\n" * 3


def test_endless_line_is_relayed_in_pieces_that_each_decode():
    sink = io.StringIO()
    relay = StreamRelay(sink, "> ")
    chunk = "é".encode() * 50_000 + b"x"  # odd length: pieces cannot all align
    for _ in range(30):
        relay.feed(chunk)
    relay.close()
    lines = sink.getvalue().split("\n")
    assert lines[-1] == "" and len(lines) > 2
    assert "\ufffd" not in sink.getvalue()
    assert all(line.startswith("> ") for line in lines[:-1])
    assert "".join(line[2:] for line in lines[:-1]) == ("é" * 50_000 + "x") * 30


def test_bytes_and_text_sinks_keep_order_with_the_parents_own_writes():
    raw = io.BytesIO()
    sink = io.TextIOWrapper(raw, encoding="utf-8")  # block-buffered, like a redirect
    sink.write("parent first\n")
    relay = StreamRelay(sink, "[rank0]: ")
    relay.feed(b"ascii line\n")
    relay.feed("non-ascii ✓\n".encode())
    sink.write("parent last\n")
    relay.close()
    sink.flush()
    assert raw.getvalue().decode() == (
        "parent first\n[rank0]: ascii line\n[rank0]: non-ascii ✓\nparent last\n")


class _SlowRaw(io.RawIOBase):
    """A raw file that takes at most 1000 bytes per write, as a pipe may."""

    def __init__(self):
        self.data = bytearray()

    def writable(self):
        return True

    def write(self, b):
        n = min(len(b), 1000)
        self.data += bytes(b[:n])
        return n


def test_line_buffered_and_unbuffered_sinks_show_each_line_at_once():
    lines = b"".join(b"%05d %s\n" % (i, b"x" * 90) for i in range(200))
    unbuffered = _SlowRaw()  # python -u: the text layer writes through to the raw file
    line_buffered = _SlowRaw()  # a terminal
    for raw, sink in (
            (unbuffered, io.TextIOWrapper(unbuffered, encoding="utf-8", write_through=True)),
            (line_buffered, io.TextIOWrapper(io.BufferedWriter(line_buffered),
                                             encoding="utf-8", line_buffering=True))):
        relay = StreamRelay(sink, "[rank0]: ")
        relay.feed(lines)
        relay.feed(b"one more\n")
        # Before close(): nothing may wait in a buffer.
        assert bytes(raw.data) == b"".join(
            b"[rank0]: " + line + b"\n" for line in (lines + b"one more\n").splitlines())


def test_sink_that_cannot_encode_gets_escapes_not_silence():
    raw = io.BytesIO()
    sink = io.TextIOWrapper(raw, encoding="ascii")
    relay = StreamRelay(sink, "[rank0]: ")
    relay.feed("naïve ✓\nplain\n".encode())
    relay.close()
    sink.flush()
    assert raw.getvalue() == b"[rank0]: na\\xefve \\u2713\n[rank0]: plain\n"


# -- progress bars ----------------------------------------------------------------------

def tqdm_bar(n):
    from tqdm import tqdm
    print("before the bar", file=sys.stderr)
    for i in tqdm(range(n), file=sys.stderr, mininterval=0, miniters=1, ascii=True,
                  ncols=70, desc="work"):
        # halfway, long enough that a relay held off the CPU for the first half still
        # reads it apart from the second: one read keeps its last redraw only
        time.sleep(0.3 if i == n // 2 else 0.002)
    print("after the bar", file=sys.stderr)
    return 0


def test_tqdm_bar_is_drawn_in_place_and_ends_as_one_line(capsys):
    pytest.importorskip("tqdm")
    n = 40
    mplaunch.launch(tqdm_bar, (n,))
    err = capsys.readouterr().err
    lines = err.split("\n")
    assert lines[-1] == ""
    lines = lines[:-1]
    # One line for the bar, not one per update; the redraws before it are \r-separated.
    assert lines[0] == "[rank0]: before the bar"
    assert lines[-1] == "[rank0]: after the bar"
    assert len(lines) == 3, lines
    redraws = lines[1].split("\r")
    assert all(seg.startswith("[rank0]: work:") for seg in redraws), redraws
    assert f"{n}/{n}" in redraws[-1] and "100%" in redraws[-1]
    assert len(redraws) >= 2


def test_progress_redraws_collapse_within_one_read():
    sink = io.StringIO()
    relay = StreamRelay(sink, "[r]: ")
    relay.feed(b"\r 10%\r 20%\r 30%")
    relay.feed(b"\r 40%")
    relay.feed(b"\r100%\n")
    relay.feed(b"crlf\r\n")  # an ordinary line, even when the \n comes later
    relay.feed(b"split crlf\r")
    relay.feed(b"\nlast\n")
    relay.close()
    assert sink.getvalue() == ("[r]:  30%\r[r]:  40%\r[r]: 100%\n[r]: crlf\n"
                               "[r]: split crlf\r[r]: split crlf\n[r]: last\n")


def test_progress_bar_of_a_rank_that_dies_mid_bar_is_still_shown():
    sink = io.StringIO()
    relay = StreamRelay(sink, "[r]: ")
    relay.feed(b"\r 10%")
    relay.feed(b"\r 20%\r")
    relay.close()
    assert sink.getvalue().split("\r")[-1] == "[r]:  20%\n"


def test_a_bar_after_a_worlds_call_ended_is_drawn_where_the_next_call_relays():
    # A World's relay leaves its screen when a call ends; the next call's bar found none
    # and stopped the run with an AttributeError in the monitor loop.
    first, second = io.StringIO(), io.StringIO()
    relay = StreamRelay(first, "[r]: ")
    relay.feed(b"call 1\n")
    relay.end_line()
    relay.retarget(second)
    relay.feed(b"\r 10%\r 20%")
    relay.feed(b"\r 30%\n")
    relay.close()
    assert first.getvalue() == "[r]: call 1\n"
    assert second.getvalue() == "[r]:  20%\r[r]:  30%\n"


def draw_a_bar():
    for i in range(3):
        sys.stdout.write(f"\rstep {i}")
        sys.stdout.flush()
    sys.stdout.write("\n")


def test_a_world_started_before_its_runs_relays_their_bars(capsys):
    with mplaunch.World(nprocs=2) as world:
        world.start()
        assert world.run(draw_a_bar) == [None, None]
        assert world.run(draw_a_bar) == [None, None]
    out = capsys.readouterr().out
    for rank in (0, 1):
        assert out.count(f"[rank{rank}]: step 2\n") == 2, out


# -- options ----------------------------------------------------------------------------

def say_hello():
    r = _rank()
    print(f"hello from {r}")
    print(f"warn from {r}", file=sys.stderr)
    return r


def test_ranks_filter_shows_some_ranks_and_log_dir_keeps_all(capsys, tmp_path):
    mplaunch.launch(say_hello, nprocs=2, ranks_filter=[1], log_dir=str(tmp_path))
    out, err = capsys.readouterr()
    assert out == "[rank1]: hello from 1\n"
    assert err == "[rank1]: warn from 1\n"
    for r in (0, 1):
        d = tmp_path / "attempt_0" / str(r)
        assert (d / "stdout.log").read_text() == f"hello from {r}\n"
        assert (d / "stderr.log").read_text() == f"warn from {r}\n"
        assert not (d / "error.json").exists()


def test_relay_false_relays_nothing_but_keeps_the_stderr_tail(capsys):
    assert mplaunch.launch(say_hello, nprocs=2, relay=False) == [0, 1]
    with pytest.raises(mplaunch.WorkerError) as info:
        mplaunch.launch(fail_on_rank_one, nprocs=2, relay=False, grace_period=1)
    assert capsys.readouterr() == ("", "")
    assert "rank 1 was here" in info.value.stderr_tail


def test_prefix_template_and_no_prefix(capsys):
    host = socket.gethostname()
    mplaunch.launch(say_hello, nprocs=2, prefix="{host}|{local_rank}|{rank}> ")
    out, _ = capsys.readouterr()
    assert sorted(out.splitlines()) == [f"{host}|0|0> hello from 0",
                                        f"{host}|1|1> hello from 1"]
    mplaunch.launch(say_hello, nprocs=2, prefix=None)
    out, err = capsys.readouterr()
    assert sorted(out.splitlines()) == ["hello from 0", "hello from 1"]
    assert sorted(err.splitlines()) == ["warn from 0", "warn from 1"]


def test_prefix_fields_of_a_second_node():
    # local_rank and rank differ only beyond node 0; the relay's prefix is the
    # template filled with each rank's prefix.
    from mplaunch._engine.config import rank_specs, validate
    cfg = validate(say_hello, (), 2, dict(master_addr="127.0.0.1", master_port=29500,
                                          preload=(), nnodes=2, node_rank=1,
                                          prefix="{rank}/{local_rank}/{node_rank}@{host}: "))
    specs = rank_specs(cfg, 0, 29500, None)
    host = socket.gethostname()
    assert [s.prefix(cfg.prefix) for s in specs] == [
        f"2/0/1@{host}: ", f"3/1/1@{host}: "]


# -- errors: the stderr tail and error files ------------------------------------------

def fail_on_rank_one():
    if _rank() == 1:
        print("rank 1 was here", file=sys.stderr)
        raise ValueError("boom on rank 1")
    time.sleep(60)


def _check_torch_reads(path, pid, exitcode, expect_in_callstack):
    from torch.distributed.elastic.multiprocessing.errors import (ChildFailedError,
                                                                  ProcessFailure)
    pf = ProcessFailure(local_rank=1, pid=pid, exitcode=exitcode, error_file=str(path))
    assert isinstance(pf.message, dict)
    assert abs(pf.timestamp - time.time()) < 600
    text = ChildFailedError("fn", {1: pf}).format_msg()
    assert expect_in_callstack in text
    return pf


def test_error_files_in_log_dir_in_torch_elastic_format(tmp_path):
    with pytest.raises(mplaunch.WorkerError) as info:
        mplaunch.launch(fail_on_rank_one, nprocs=2, log_dir=str(tmp_path), grace_period=1)
    err = info.value
    path = tmp_path / "attempt_0" / "1" / "error.json"
    data = json.loads(path.read_text())
    assert set(data) == {"message"}
    msg = data["message"]
    assert msg["message"].endswith("ValueError: boom on rank 1")
    assert set(msg["extraInfo"]) == {"py_callstack", "timestamp"}
    assert msg["extraInfo"]["py_callstack"] == err.traceback
    assert "Traceback (most recent call last)" in err.traceback
    assert msg["extraInfo"]["timestamp"] == str(int(msg["extraInfo"]["timestamp"]))
    assert msg["errorCode"] == 1
    _check_torch_reads(path, err.pid, 1, "boom on rank 1")
    # The rank that was torn down did not fail on its own: no error file.
    assert not (tmp_path / "attempt_0" / "0" / "error.json").exists()
    assert (tmp_path / "attempt_0" / "1" / "stderr.log").read_text().startswith(
        "rank 1 was here\n")


def fail_first_attempt():
    if os.environ["RESTART_COUNT"] == "0" and _rank() == 1:
        raise RuntimeError("first attempt fails")
    print(f"attempt {os.environ['RESTART_COUNT']}")
    return 0


def test_log_dir_has_one_directory_per_attempt(tmp_path):
    mplaunch.launch(fail_first_attempt, nprocs=2, log_dir=str(tmp_path), max_restarts=1,
                    grace_period=1)
    assert (tmp_path / "attempt_0" / "1" / "error.json").exists()
    for r in (0, 1):
        assert (tmp_path / "attempt_1" / str(r) / "stdout.log").read_text() == "attempt 1\n"
        assert not (tmp_path / "attempt_1" / str(r) / "error.json").exists()


def test_torchelastic_error_file_is_honoured(tmp_path, monkeypatch):
    target = tmp_path / "from_env" / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(target))
    with pytest.raises(mplaunch.WorkerError) as info:
        mplaunch.launch(fail_on_rank_one, nprocs=2, grace_period=1)
    data = json.loads(target.read_text())
    assert data["message"]["message"].endswith("ValueError: boom on rank 1")
    _check_torch_reads(target, info.value.pid, 1, "boom on rank 1")


def test_unwritable_error_file_warns_and_keeps_the_worker_error(tmp_path, monkeypatch):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(blocker / "error.json"))
    with pytest.warns(RuntimeWarning, match="could not write the error file"):
        with pytest.raises(mplaunch.WorkerError):
            mplaunch.launch(fail_on_rank_one, nprocs=2, grace_period=1)


def crash_with_threads(nthreads):
    import threading
    ready = threading.Barrier(nthreads + 1)
    stop = threading.Event()

    def nested(depth):
        if depth:
            return nested(depth - 1)
        ready.wait()
        stop.wait()

    for _ in range(nthreads):
        threading.Thread(target=nested, args=(4,), daemon=True).start()
    ready.wait()
    for i in range(5):
        print(f"before the crash {i}", file=sys.stderr)
    crash_here()


def crash_here():
    ctypes.string_at(0)


def test_segfault_tail_shows_the_lines_before_and_the_crashing_frames(tmp_path):
    with pytest.raises(mplaunch.WorkerError) as info:
        mplaunch.launch(crash_with_threads, (40,), log_dir=str(tmp_path))
    err = info.value
    assert err.signal == "SIGSEGV"
    full = (tmp_path / "attempt_0" / "0" / "stderr.log").read_text()
    assert full.count("\nThread 0x") >= 40  # the dump really was long
    tail = err.stderr_tail
    lines = tail.splitlines()
    assert len(lines) <= 60
    assert [line for line in lines if line.startswith("before the crash")] == [
        f"before the crash {i}" for i in range(5)]
    assert "Fatal Python error: Segmentation fault" in tail
    assert "40 other thread(s)" in tail
    assert "_rank/worker.py" not in tail  # mplaunch's own frames say nothing
    current = lines.index(next(line for line in lines if line.startswith("Current thread")))
    frames = "\n".join(lines[current:current + 6])
    assert "in string_at" in frames and "in crash_here" in frames
    assert "in crash_with_threads" in frames
    assert str(err).rstrip().endswith(tail.rstrip())
    assert "crash_here" in str(err) and "before the crash 4" in str(err)
    data = json.loads((tmp_path / "attempt_0" / "0" / "error.json").read_text())
    assert "crash_here" in data["message"]["extraInfo"]["py_callstack"]
    _check_torch_reads(tmp_path / "attempt_0" / "0" / "error.json", err.pid, -11,
                       "Fatal Python error")


def test_tail_summary_keeps_a_cxx_message_before_its_long_stack():
    text = "\n".join(
        ["step 1", "terminate called after throwing an instance of 'c10::Error'",
         "  what():  tensor sizes do not match"]
        + [f"frame #{i}: 0x7f00 in libtorch.so" for i in range(60)]
        + ["", "Fatal Python error: Aborted", "",
           "Current thread 0x00007f0000000001 (most recent call first):",
           '  File "train.py", line 9 in step', '  File "train.py", line 20 in main',
           "", "Extension modules: " + ", ".join(f"mod{i}" for i in range(300))
           + " (total: 300)"])
    out = summarize_tail(text).splitlines()
    assert "  what():  tensor sizes do not match" in out
    assert "frame #59: 0x7f00 in libtorch.so" in out
    assert '  File "train.py", line 9 in step' in out
    assert out[-1].startswith("Extension modules: mod0, ") and len(out[-1]) < 300
    assert out[-1].endswith("... (total: 300)")
    assert len(out) <= 45


def test_tail_without_a_crash_is_the_last_lines():
    text = "".join(f"line {i}\n" for i in range(100)) + "\n\n"
    assert summarize_tail(text).splitlines() == [f"line {i}" for i in range(60, 100)]
    assert summarize_tail("") == ""
