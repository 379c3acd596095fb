"""Every remote script quotes what it is given: a job whose paths and names hold shell syntax runs
none of it, through the real local transport (the same bash the ssh and pct targets run)."""
from __future__ import annotations

import dataclasses
from pathlib import Path

from dflash_ops.act import launch, steps

from dflash_ops import remote
from dflash_ops.observe.log_tail import tail_log
from dflash_ops.act.context import StepContext
from dflash_ops.observe import log_tail
from dflash_ops.transport.local import LocalTransport

STANDIN = str(Path(__file__).parent / "sim" / "standin-trainer")
HOSTILE = 'w $(touch PWNED) `touch PWNED2` "q" \'s\' ; $HOME'


def test_launch_wait_and_tail_log_run_nothing_from_hostile_paths(local_target, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    job = dataclasses.replace(local_target.job, workdir=str(tmp_path / HOSTILE), log_dir=str(tmp_path / HOSTILE / "logs"),
                              cache_dir=str(tmp_path / HOSTILE / "cache"), python=STANDIN,
                              session="s $(touch PWNED3) `x` 'q'", tmux_socket=f"h-{tmp_path.name}"[:40])
    target = dataclasses.replace(local_target, job=job)
    with LocalTransport("local") as t:
        launched = t.check(launch.launch_command(job, resume=True), stdin=remote.bundle(launch.LAUNCHER))
        log = launched.stdout.strip().splitlines()[-1]
        assert log == f"{job.log_dir}/train-0001.log"
        ctx = StepContext(target=target, transport=t, step="wait_first_step")
        outcome = steps.wait_first_step(ctx, job, steps.Launched(log=log), timeout_s=30, poll_s=0.2)
        assert outcome.message.startswith("step "), outcome.message
        shown = []
        tail_log(target, lines=2, emit=shown.append)
        assert shown
        t.run(f"tmux -L {job.tmux_socket} kill-server")
    ran = [str(p) for p in tmp_path.rglob("PWNED*")]
    assert not ran, f"shell syntax from a path ran: {ran}"


def test_preflight_purge_follow_and_put_run_nothing_from_hostile_paths(local_target, tmp_path, monkeypatch):
    import os
    import sys

    from dflash_ops.act import preflight
    from dflash_ops.transport.ssh import put_script

    monkeypatch.chdir(tmp_path)
    root = tmp_path / HOSTILE
    root.mkdir()
    python = root / "python $(touch PWNED4)"
    python.symlink_to(sys.executable)
    job = dataclasses.replace(local_target.job, workdir=str(root / "work"), log_dir=str(root / "logs"),
                              cache_dir=str(root / "cache"), python=str(python))
    target = dataclasses.replace(local_target, job=job)
    with LocalTransport("local") as t:
        checks = preflight._answers(t.check(preflight._shell_checks(job, need_release=False,
                                                                     import_torch=False)).stdout)
        assert checks["reach"] == "ok" and checks["release"] == "deployable" and checks["free_kib"].isdigit()
        assert "python_error" in checks or checks["torch"] == "installed", checks
        assert os.path.isdir(job.workdir)

        marked, unmarked = root / "cache m", root / "cache u"
        for d in (marked, unmarked):
            d.mkdir()
        (marked / ".dflash-ops-cache").write_text("x\n")
        ctx = StepContext(target=target, transport=t, step="purge_cache")
        outcome = steps.purge_cache(ctx, job, paths=[str(marked), str(unmarked), str(root / "gone")], if_unmarked="skip")
        assert not marked.exists() and unmarked.exists(), outcome.message

        log = root / "logs" / "train-0001.log"
        log.parent.mkdir()
        log.write_text("one\ntwo\n")
        current, size, chunk = log_tail._poll(t, target, str(log), 4)
        assert (current, size, chunk) == (str(log), 8, "two\n")

        data = b"hostile put\n"
        dest = root / "put 'x' $(touch PWNED5)" / "file"
        t.check(put_script(str(dest), 0o600, len(data)), stdin=data)
        assert dest.read_bytes() == data and oct(dest.stat().st_mode & 0o777) == "0o600"
    ran = [str(p) for p in tmp_path.rglob("PWNED*")]
    assert not ran, f"shell syntax from a path ran: {ran}"
