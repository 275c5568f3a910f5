"""What a World's failed call says about its ranks (issue 38, items 3 and 4): the end of
a rank's stderr quoted in the error is what the failing call wrote, not an earlier
call's, with a progress bar's frames as its last one; and the ranks that mplaunch
itself released from a collective, or interrupted, say so in one line each (where they
were), not with a traceback of gloo's lost connection and a KeyboardInterrupt raised in
mplaunch's own code, and the error does not count them as ranks that raised."""
from __future__ import annotations

import os
import re
import signal
import sys
import threading
import time

import pytest

import mplaunch
from mplaunch._engine.tails import collapse_redraws, summarize_tail
from mplaunch._wire.stacks import short_path

HERE = short_path(os.path.abspath(__file__))   # as a location names it


# -- in the ranks -------------------------------------------------------------------------

def draw_a_bar(label):
    """A tqdm-like bar: 16 frames redrawn after \\r, ended by a newline."""
    for i in range(16):
        sys.stderr.write(f"\r{label}: {i * 100 // 15:3d}%|" + "#" * i)
        sys.stderr.flush()
    sys.stderr.write("\n")
    return True


def typo_in_rank_one():
    if os.environ["RANK"] == "1":
        undefined_name  # noqa: F821 - the typo of the issue
    return "fine"


def warn_then_raise_in_rank_one():
    if os.environ["RANK"] == "1":
        print("loading shard 7 of 8", file=sys.stderr, flush=True)
        raise ValueError("shard 7 is empty")
    return "fine"


def die_in_rank_one(words):
    if os.environ["RANK"] == "1":
        if words:
            sys.stderr.write(words)
            sys.stderr.flush()
        os._exit(3)
    return "fine"


def draw_then_die_in_rank_one():
    if os.environ["RANK"] == "1":
        draw_a_bar("eval")
        os._exit(3)
    return "fine"


def raise_while_peers_wait_in_allreduce():
    import torch
    import torch.distributed as dist
    # Every rank is here before rank 1 fails: the others are in the collective when
    # mplaunch interrupts them (SETTLE, 0.1 s, after the failure), not still on
    # their way (a rank slowed that long by a loaded machine is interrupted there)
    dist.barrier()
    if dist.get_rank() == 1:
        raise ValueError("rank one fails before the collective")
    dist.all_reduce(torch.ones(1))   # the line the others are released from
    return "unreachable"


def die_while_peers_wait_in_allreduce():
    import torch
    import torch.distributed as dist
    # Every rank is here before rank 1 fails: the others are in the collective when
    # mplaunch interrupts them (SETTLE, 0.1 s, after the failure), not still on
    # their way (a rank slowed that long by a loaded machine is interrupted there)
    dist.barrier()
    if dist.get_rank() == 1:
        os._exit(3)
    dist.all_reduce(torch.ones(1))   # the line the others are released from
    return "unreachable"


def allreduce_sum():
    import torch
    import torch.distributed as dist
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return t.item()


def spin(flag_dir):
    open(os.path.join(flag_dir, f"in.{os.environ['RANK']}"), "w").close()
    n = 0
    while True:
        n += 1   # the line the ranks are interrupted at


def own_keyboard_interrupt_in_rank_one():
    if os.environ["RANK"] == "1":
        raise KeyboardInterrupt("the rank's own")
    return "fine"


def _line_of(func, text):
    """The line number of `text` in `func`'s source."""
    import inspect
    lines, first = inspect.getsourcelines(func)
    return first + next(i for i, line in enumerate(lines) if text in line)


def _relayed(text, rank):
    return [line[len(f"[rank{rank}]: "):] for line in text.splitlines()
            if line.startswith(f"[rank{rank}]: ")]


def _tail_of(err):
    """The "last lines of rank N's stderr" part of the message, or None."""
    text = str(err)
    head = f"--- last lines of rank {err.rank}'s stderr ---\n"
    if head not in text:
        return None
    return text.split(head, 1)[1].split("\n[mplaunch.World]")[0]


# -- item 3: the tail is the failing call's ----------------------------------------------

def test_a_rank_that_dies_silently_does_not_quote_an_earlier_calls_error():
    with mplaunch.World(2) as world:
        with pytest.raises(mplaunch.WorkerError) as first:
            world.run(typo_in_rank_one)
        assert type(first.value.__cause__) is NameError
        with pytest.raises(mplaunch.WorkerError) as info:
            world.run(die_in_rank_one, ("",))
        err = info.value
        assert err.rank == 1 and err.exitcode == 3, str(err)
        assert "NameError" not in str(err) and "undefined_name" not in str(err), str(err)
        assert err.stderr_tail is None and _tail_of(err) is None, str(err)


def test_a_rank_that_dies_quotes_what_this_call_wrote_and_nothing_before():
    with mplaunch.World(2) as world:
        world.run(draw_a_bar, ("train",))
        with pytest.raises(mplaunch.WorkerError):
            world.run(typo_in_rank_one)
        with pytest.raises(mplaunch.WorkerError) as info:
            world.run(die_in_rank_one, ("giving up: the shard is gone\n",))
        err = info.value
        assert _tail_of(err) == "giving up: the shard is gone", str(err)


def test_an_error_after_three_training_cells_quotes_only_its_own_call(capfd):
    with mplaunch.World(2) as world:
        for _ in range(3):
            assert world.run(draw_a_bar, ("train",)) == [True, True]
        capfd.readouterr()
        with pytest.raises(mplaunch.WorkerError) as info:
            world.run(warn_then_raise_in_rank_one)
        err = info.value
        assert err.rank == 1 and type(err.__cause__) is ValueError
        # the traceback is the error's cause; what the call wrote before it is the tail
        assert _tail_of(err) == "loading shard 7 of 8", str(err)
        assert "train" not in str(err), str(err)
        relayed = _relayed(capfd.readouterr().err, 1)
        assert relayed[0] == "loading shard 7 of 8" and relayed[-1].startswith("ValueError")


def test_a_progress_bar_in_the_tail_is_its_last_frame():
    with mplaunch.World(2) as world:
        with pytest.raises(mplaunch.WorkerError) as info:
            world.run(draw_then_die_in_rank_one)
        err = info.value
        assert err.exitcode == 3
        assert _tail_of(err) == "eval: 100%|" + "#" * 15, str(err)


def test_a_launch_tail_collapses_progress_frames_too():
    with pytest.raises(mplaunch.WorkerError) as info:
        mplaunch.launch(draw_then_die_in_rank_one, nprocs=2, grace_period=1)
    assert _tail_of(info.value) == "eval: 100%|" + "#" * 15, str(info.value)


def test_redraws_collapse_to_the_last_frame_that_shows_anything():
    text = ("step 1\n 10%|#\r 50%|#####\r100%|##########\n"
            "a bar cleared\r             \r\n"   # tqdm(leave=False)
            "windows line\r\n"
            " 40%|####\rTraceback (most recent call last):\n")
    assert collapse_redraws(text) == ("step 1\n100%|##########\nwindows line\n"
                                      "Traceback (most recent call last):\n")
    frames = "".join(f"\r{i:3d}%" for i in range(100)) + "\n"
    assert summarize_tail("one\n" + frames * 3 + "NameError: x\n") == (
        "one\n" + " 99%\n" * 3 + "NameError: x")


# -- item 4: ranks mplaunch released -------------------------------------------------------

def _assert_released_lines(err_text, ranks, how, line):
    where = f"at {HERE}:{line} in "
    for rank in ranks:
        relayed = _relayed(err_text, rank)
        assert len(relayed) == 1, (rank, err_text)
        assert relayed[0].startswith(f"[mplaunch] rank {rank}: {how} {where}"), relayed
    assert "KeyboardInterrupt" not in err_text and "GLHF" not in err_text, err_text
    assert "call_loop.py" not in err_text, err_text


@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_ranks_released_from_a_half_done_collective_say_so_in_one_line(method, capfd):
    line = _line_of(raise_while_peers_wait_in_allreduce, "the line the others")
    with mplaunch.World(4, backend="gloo", start_method=method) as world:
        # Every rank has this module imported (a rank still importing it when rank 1
        # fails is interrupted there, not released from the collective).
        assert world.run(allreduce_sum) == [10.0] * 4
        capfd.readouterr()
        with pytest.raises(mplaunch.WorkerError) as info:
            world.run(raise_while_peers_wait_in_allreduce, timeout=300)
        err = info.value
        out, relayed = capfd.readouterr()
        # the culprit's traceback, whole
        culprit = _relayed(relayed, 1)
        assert culprit[0] == "Traceback (most recent call last):", culprit
        assert culprit[-1] == "ValueError: rank one fails before the collective"
        assert relayed.count("Traceback (most recent call last)") == 1, relayed
        how = "released from torch.distributed.all_reduce"
        _assert_released_lines(relayed, (0, 2, 3), how, line)
        # the error: the culprit, then one line for the released ranks
        text = str(err)
        assert err.rank == 1 and type(err.__cause__) is ValueError, text
        lines = text.splitlines()
        assert lines[0].startswith("rank 1 (pid ") and "ValueError" in lines[0], text
        assert lines[1] == (f"mplaunch ended the call in 3 other rank(s): ranks 0, 2, 3 "
                            f"{how} at {HERE}:{line} in "
                            "raise_while_peers_wait_in_allreduce"), text
        assert "raised KeyboardInterrupt" not in text and "failed after it" not in text
        assert [f.released for f in err.failures[1:]] == [how] * 3
        assert "rebuilt" in err.healed
        assert world.run(allreduce_sum) == [10.0] * 4    # and the world goes on


def test_ranks_released_when_a_peer_died_say_so_in_one_line(capfd):
    line = _line_of(die_while_peers_wait_in_allreduce, "the line the others")
    with mplaunch.World(4, backend="gloo") as world:
        assert world.run(allreduce_sum) == [10.0] * 4   # this module imported everywhere
        capfd.readouterr()
        with pytest.raises(mplaunch.WorkerError) as info:
            world.run(die_while_peers_wait_in_allreduce, timeout=300)
        err = info.value
        relayed = capfd.readouterr().err
        assert "Traceback" not in relayed and "Connection" not in relayed, relayed
        _assert_released_lines(relayed, (0, 2, 3), "released from "
                               "torch.distributed.all_reduce", line)
        text = str(err)
        assert text.splitlines()[0].endswith("exited with code 3 while its World was up")
        assert "mplaunch ended the call in 3 other rank(s): ranks 0, 2, 3 released " \
               f"from torch.distributed.all_reduce at {HERE}:{line}" in text, text
        assert "RuntimeError" not in text and "GLHF" not in text, text
        assert world.run(allreduce_sum) == [10.0] * 4


def test_an_interrupt_says_where_each_rank_was_in_one_line(tmp_path, capfd):
    line = _line_of(spin, "the line the ranks are interrupted at")

    def interrupt():
        end = time.monotonic() + 60
        while not all((tmp_path / f"in.{r}").exists() for r in range(4)):
            assert time.monotonic() < end
            time.sleep(0.02)
        time.sleep(0.2)
        os.kill(os.getpid(), signal.SIGINT)

    with mplaunch.World(4) as world:
        capfd.readouterr()
        t = threading.Thread(target=interrupt)
        t.start()
        try:
            with pytest.raises(KeyboardInterrupt) as info:
                world.run(spin, (str(tmp_path),))
        finally:
            t.join()
        assert "interrupted" in str(info.value) and "kept" in str(info.value)
        relayed = capfd.readouterr().err
        assert "Traceback" not in relayed, relayed
        for rank in range(4):
            said = _relayed(relayed, rank)
            assert len(said) == 1 and re.fullmatch(
                rf"\[mplaunch\] rank {rank}: interrupted at {re.escape(HERE)}:"
                rf"({line}|{line - 1}) in spin", said[0]), said
        assert world.run(os.getpid) == [world.pids[r] for r in range(4)]


def test_a_ranks_own_keyboard_interrupt_keeps_its_traceback(capfd):
    with mplaunch.World(2) as world:
        capfd.readouterr()
        with pytest.raises(mplaunch.WorkerError) as info:
            world.run(own_keyboard_interrupt_in_rank_one)
        relayed = _relayed(capfd.readouterr().err, 1)
        assert relayed[0] == "Traceback (most recent call last):" and \
            relayed[-1] == "KeyboardInterrupt: the rank's own", relayed
        assert "raised KeyboardInterrupt: the rank's own" in str(info.value)
        assert info.value.first.released is None
