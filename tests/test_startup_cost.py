"""A rank's start-up costs what the rank owns, never what the machine holds: with the TCP
table full of TIME_WAIT sockets (as after any test suite), no rank reads
/proc/net/tcp{,6} while its process group is made, used, released and made again. A
guard against the class of regression that once made every init read the whole table
(0.6 s per rank on a busy machine); it counts what is read, never how long it took."""
from __future__ import annotations

import os
import sys

import pytest

import mplaunch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "bench"))
import _busy  # noqa: E402

BUSY = 3000


@pytest.fixture(scope="module")
def busy_table():
    made = _busy.fill_time_wait(BUSY)
    assert made == BUSY and _busy.time_wait_count() >= BUSY
    return made


def _record_proc_net_opens(seen: list) -> None:
    """From now on, every file this process opens under /proc/net goes into `seen`."""
    def hook(event, args):
        if event == "open" and isinstance(args[0], (str, bytes)) and \
                "/proc/net" in os.fsdecode(args[0]):
            seen.append(os.fsdecode(args[0]))
    sys.addaudithook(hook)


def watch_opens():
    """In a World's rank: record the files opened under /proc/net, once."""
    seen = mplaunch.rank_state().setdefault("proc_net", [])
    if not seen:
        _record_proc_net_opens(seen)
        seen.append(None)      # armed
    return True


def opened():
    return [p for p in mplaunch.rank_state()["proc_net"] if p is not None]


def init_allreduce_destroy(watch):
    import torch
    import torch.distributed as dist
    seen: list = []
    if watch:
        _record_proc_net_opens(seen)
    dist.init_process_group("gloo")
    t = torch.ones(1)
    dist.all_reduce(t)
    dist.destroy_process_group()
    return t.item(), seen


def test_a_launch_on_a_busy_machine_reads_no_tcp_table(busy_table):
    out = mplaunch.launch(init_allreduce_destroy, (True,), 4)
    assert out == [(4.0, [])] * 4


def user_group():
    import torch.distributed as dist
    dist.init_process_group("gloo")
    from mplaunch._rank import endpoints
    known = endpoints.known()
    return len(known.sockets), len(known.own)


def raise_in_one_while_the_other_waits():
    import torch
    import torch.distributed as dist
    if dist.get_rank() == 1:
        raise ValueError("rank one leaves its peer in the all_reduce")
    dist.all_reduce(torch.ones(1))
    return "unreachable"


def allreduce():
    import torch
    import torch.distributed as dist
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


def test_a_world_on_a_busy_machine_makes_releases_and_remakes_its_group_reading_no_tcp_table(
        busy_table):
    with mplaunch.World(2, grace_period=20) as world:
        world.run(watch_opens)
        noted = world.run(user_group)
        # the group's connection and its listener, out of the thousands in the table
        assert all(1 <= conns <= 8 and 1 <= listeners <= 4 for conns, listeners in noted)
        pids = world.pids
        with pytest.raises(mplaunch.WorkerError) as info:
            world.run(raise_in_one_while_the_other_waits, timeout=120)
        assert "rebuilt" in info.value.healed and world.pids == pids   # released
        assert world.run(allreduce) == [2.0, 2.0]
        assert world.run(opened) == [[], []]


def test_a_launch_notes_no_socket_at_all(busy_table):
    # Only a World's ranks can be released: a launch's ranks pay nothing for it.
    def noted():
        import torch.distributed as dist
        dist.init_process_group("gloo")
        from mplaunch._rank import endpoints
        known = endpoints.known()
        dist.destroy_process_group()
        return known
    assert mplaunch.launch(noted, nprocs=2) == [None, None]
