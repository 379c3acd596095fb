"""tail-log follows the job's CURRENT log across a relaunch (like tail -F) and refuses a --log that
is not a regular file."""
from __future__ import annotations

import contextlib
import threading
import time
from pathlib import Path

import pytest

from dflash_ops.observe.log_tail import tail_log
from dflash_ops.errors import InputError


def wait_for(predicate, seconds=5.0):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not predicate():
        time.sleep(0.05)
    return predicate()


@contextlib.contextmanager
def following(target):
    """`tail-log -f` of `target` in a thread; yields the lines shown so far (a list that grows)."""
    shown, stop = [], threading.Event()
    follower = threading.Thread(target=tail_log, kwargs=dict(
        target=target, lines=5, follow=True, emit=shown.append, poll_s=0.1, should_stop=stop.is_set))
    follower.start()
    try:
        yield shown
    finally:
        stop.set()
        follower.join(10)


def test_follow_moves_to_the_new_log_after_a_relaunch(local_target):
    logs = Path(local_target.job.log_dir)
    logs.mkdir(parents=True)
    first = logs / "train-0001.log"
    first.write_text("run 1 line 1\n")
    with following(local_target) as shown:
        assert wait_for(lambda: shown == ["run 1 line 1"]), shown
        with first.open("a") as f:
            f.write("run 1 last words\n")
        assert wait_for(lambda: "run 1 last words" in shown), shown
        (logs / "train-0002.log").write_text("run 2 line 1\nrun 2 line 2\n")  # the relaunch's new log
        assert wait_for(lambda: "run 2 line 2" in shown), shown
        assert shown[-3:] == [f"==> following {logs / 'train-0002.log'} (a newer log) <==", "run 2 line 1",
                              "run 2 line 2"]


@pytest.mark.parametrize("kind", ["directory", "device", "missing"])
def test_log_that_is_not_a_regular_file_is_refused(local_target, tmp_path, kind):
    path = {"directory": str(tmp_path), "device": "/dev/null", "missing": str(tmp_path / "nope.log")}[kind]
    with pytest.raises(InputError) as info:
        tail_log(local_target, lines=5, log=path, emit=lambda line: None)
    message = str(info.value)
    assert message.startswith(f"--log {path}: ") and "\n" not in message, message


def test_follow_goes_by_the_job_state_not_the_newest_file_name(local_target):
    """The log the job state names is the job's log: a stray higher-numbered file is not followed,
    and a relaunch that names its new log in the state is."""
    from dflash_ops.job import jobpaths, jobstate

    logs = Path(local_target.job.log_dir)
    logs.mkdir(parents=True)
    state_file = Path(jobpaths.state_file(local_target.job))

    def name_in_state(log: Path, run: int) -> None:
        state_file.write_bytes(jobstate.encode(jobstate.JobState(jobstate.RUNNING, run=run, log=str(log))))

    first = logs / "train-0001.log"
    first.write_text("run 1 line 1\n")
    name_in_state(first, 1)
    with following(local_target) as shown:
        assert wait_for(lambda: shown == ["run 1 line 1"]), shown
        (logs / "train-0009.log").write_text("a copy someone left here\n")
        with first.open("a") as f:
            f.write("run 1 line 2\n")
        assert wait_for(lambda: "run 1 line 2" in shown), shown
        time.sleep(0.5)
        assert "a copy someone left here" not in shown, shown
        relaunched = logs / "train-0002.log"
        relaunched.write_text("run 2 line 1\n")
        name_in_state(relaunched, 2)
        assert wait_for(lambda: "run 2 line 1" in shown), shown
        assert shown[-2:] == [f"==> following {relaunched} (a newer log) <==", "run 2 line 1"]
