"""Recovery by restart (max_restarts) and what each attempt sees."""
import os
import signal
import sys
import threading

import pytest

import mplaunch

torch = pytest.importorskip("torch")

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
import restart_training  # noqa: E402


def test_restart_resumes_from_checkpoint_bitwise_identical(tmp_path):
    clean = restart_training.run(2, 20, fail_at_step=-1, max_restarts=0)[0]
    logs = tmp_path / "logs"
    recovered = restart_training.run(2, 20, fail_at_step=12, max_restarts=1,
                                     log_dir=str(logs))[0]
    assert clean["attempt"] == 0 and clean["resumed_from"] == 0
    assert recovered["attempt"] == 1 and recovered["resumed_from"] == 10
    for name, value in clean["params"].items():
        assert torch.equal(value, recovered["params"][name]), name
    # each attempt writes its output under its own directory
    assert (logs / "attempt_0" / "1" / "stdout.log").read_text().startswith(
        "rank 1: crashing on purpose at step 12")
    assert (logs / "attempt_1" / "0" / "stdout.log").exists()


def restart_counts(counter_dir):
    rank = os.environ["RANK"]
    attempt = os.environ["RESTART_COUNT"]
    assert os.environ["TORCHELASTIC_RESTART_COUNT"] == attempt
    open(os.path.join(counter_dir, f"{attempt}-{rank}"), "w").close()
    if rank == "1":
        import time
        while not os.path.exists(os.path.join(counter_dir, f"{attempt}-0")):
            time.sleep(0.01)  # fail only once rank 0 has been counted too
        raise RuntimeError(f"attempt {attempt} fails")


def test_last_error_lists_every_earlier_attempt(tmp_path):
    with pytest.raises(mplaunch.WorkerError) as info:
        mplaunch.launch(restart_counts, (str(tmp_path),), 2, max_restarts=2, grace_period=1)
    err = info.value
    assert str(err.__cause__) == "attempt 2 fails"
    assert err.first.attempt == 2
    assert [a[0].attempt for a in err.previous_attempts] == [0, 1]
    assert "earlier attempt 0" in str(err) and "earlier attempt 1" in str(err)
    assert sorted(os.listdir(tmp_path)) == ["0-0", "0-1", "1-0", "1-1", "2-0", "2-1"]


def count_and_wait(counter_dir):
    import time
    open(os.path.join(counter_dir, f"{os.environ['RESTART_COUNT']}-{os.environ['RANK']}"),
         "w").close()
    time.sleep(60)


def test_a_signal_to_the_parent_never_restarts(tmp_path):
    def interrupt_when_started():
        import time
        while len(os.listdir(tmp_path)) < 2:
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGINT)

    t = threading.Thread(target=interrupt_when_started)
    t.start()
    try:
        with pytest.raises(mplaunch.MainProcessError) as info:
            mplaunch.launch(count_and_wait, (str(tmp_path),), 2, max_restarts=3,
                            grace_period=1)
    finally:
        t.join()
    assert info.value.signal_no == signal.SIGINT
    assert sorted(os.listdir(tmp_path)) == ["0-0", "0-1"]
