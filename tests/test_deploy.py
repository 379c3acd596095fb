"""Deploy: versioned releases, checksum, atomic `current`, pruning, rollback — through a real transport."""
from __future__ import annotations

import os
import posixpath
import shlex

import pytest

from dflash_ops.act import deploy
from dflash_ops.job import jobpaths
from dflash_ops.errors import InputError, RemoteCommandError
from dflash_ops.job.model import Job
from dflash_ops.transport.local import LocalTransport


def bundle_of(tmp_path, name, text):
    src = tmp_path / name
    src.mkdir()
    (src / "train.py").write_text(text)
    return deploy.build_bundle(src)


def install(transport, job, bundle, keep=5, data=None):
    tarball = posixpath.join(jobpaths.releases_dir(job), bundle.release_id + ".tar.gz")
    transport.check("mkdir -p " + shlex.quote(jobpaths.releases_dir(job)))
    transport.put(data if data is not None else bundle.data, tarball)
    return transport.check(deploy.install_script(job, bundle, tarball, keep), step="deploy")


def current_text(job):
    return open(os.path.join(job.workdir, "current", "trainer", "train.py")).read()


def test_deploy_switch_prune_and_rollback(tmp_path):
    job = Job(workdir=str(tmp_path / "work it's"), python="python3", config="tiny-cpu")
    one, two, three = (bundle_of(tmp_path, n, f"print({n!r})\n") for n in ("one", "two", "three"))
    assert deploy.build_bundle(tmp_path / "one").sha256 == one.sha256  # reproducible bytes
    with LocalTransport("local") as t:
        install(t, job, one)
        install(t, job, two)
        assert current_text(job) == "print('two')\n"
        install(t, job, two)  # same bundle again: only re-points current
        assert current_text(job) == "print('two')\n"

        assert "current -> " + one.release_id in t.check(deploy.rollback_script(job)).stdout
        assert current_text(job) == "print('one')\n"

        install(t, job, three, keep=2)  # history newest-first: three, one -> two is pruned
        releases = sorted(p for p in os.listdir(jobpaths.releases_dir(job)) if p != "history")
        assert releases == sorted([one.release_id, three.release_id])


def test_corrupt_upload_is_refused_and_current_unchanged(tmp_path):
    job = Job(workdir=str(tmp_path / "w"), python="python3", config="tiny-cpu")
    good, bad = bundle_of(tmp_path, "good", "ok\n"), bundle_of(tmp_path, "bad", "new\n")
    with LocalTransport("local") as t:
        install(t, job, good)
        with pytest.raises(RemoteCommandError, match="checksum mismatch"):
            install(t, job, bad, data=bad.data[:-10] + b"0123456789")
        assert current_text(job) == "ok\n"


def test_rollback_without_an_earlier_release_says_so(tmp_path):
    job = Job(workdir=str(tmp_path / "w"), python="python3", config="tiny-cpu")
    with LocalTransport("local") as t:
        install(t, job, bundle_of(tmp_path, "only", "x\n"))
        result = t.run(deploy.rollback_script(job))
        assert result.exit_code == 3 and "no earlier release" in result.stderr


HOSTILE_DIR = 'w $(touch PWNED) `touch PWNED2` "q" \'s\' ; $HOME'


def test_checksum_mismatch_message_runs_nothing_from_a_hostile_workdir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    job = Job(workdir=str(tmp_path / HOSTILE_DIR), python="python3", config="tiny-cpu")
    bad = bundle_of(tmp_path, "bad", "new\n")
    with LocalTransport("local") as t:
        with pytest.raises(RemoteCommandError, match="checksum mismatch") as info:
            install(t, job, bad, data=bad.data[:-10] + b"0123456789")
    ran = [str(p) for p in tmp_path.rglob("PWNED*")]
    assert not ran, f"a workdir's $(...) ran on the target: {ran}"
    assert HOSTILE_DIR in str(info.value)  # the path is shown as it is


def test_list_and_rollback_to_any_kept_release(tmp_path):
    job = Job(workdir=str(tmp_path / HOSTILE_DIR), python="python3", config="tiny-cpu")
    one, two, three = (bundle_of(tmp_path, n, f"print({n!r})\n") for n in ("one", "two", "three"))
    with LocalTransport("local") as t:
        assert deploy.parse_list(t.check(deploy.list_script(job)).stdout) == []
        for bundle in (one, two, three):
            install(t, job, bundle)
        listed = deploy.parse_list(t.check(deploy.list_script(job)).stdout)
        assert [(r.id, r.current) for r in listed] == [(three.release_id, True), (two.release_id, False),
                                                       (one.release_id, False)]
        t.check(deploy.rollback_script(job, one.release_id))  # two steps back, not only the previous
        assert current_text(job) == "print('one')\n"
        t.check(deploy.rollback_script(job, three.release_id))
        assert current_text(job) == "print('three')\n"
        missing = t.run(deploy.rollback_script(job, "0.1.0-000000000000"))
        assert missing.exit_code == 3 and "not kept" in missing.stderr and "deploy --list" in missing.stderr
        assert current_text(job) == "print('three')\n"
    assert not list(tmp_path.rglob("PWNED*"))
    for bad in ("../one", "a/b", "", "-x"):
        with pytest.raises(InputError):
            deploy.check_release_id(bad)


def test_rollback_refuses_a_release_whose_deploy_did_not_complete(tmp_path):
    # An interrupted deploy leaves a release dir without its .complete marker: rolling back to it
    # says so in one line naming it, exits non-zero, and leaves `current` where it was.
    job = Job(workdir=str(tmp_path / HOSTILE_DIR), python="python3", config="tiny-cpu")
    one, two = (bundle_of(tmp_path, n, f"print({n!r})\n") for n in ("one", "two"))
    with LocalTransport("local") as t:
        install(t, job, one)
        install(t, job, two)
        os.remove(os.path.join(jobpaths.releases_dir(job), one.release_id, ".complete"))
        for script in (deploy.rollback_script(job), deploy.rollback_script(job, one.release_id)):
            result = t.run(script)
            assert result.exit_code != 0, result
            lines = result.stderr.strip().splitlines()
            assert len(lines) == 1 and one.release_id in lines[0] and "incomplete" in lines[0], result.stderr
            assert current_text(job) == "print('two')\n"
    assert not list(tmp_path.rglob("PWNED*"))


def test_rollback_past_pruned_releases_says_there_is_none(tmp_path):
    job = Job(workdir=str(tmp_path / "w"), python="python3", config="tiny-cpu")
    with LocalTransport("local") as t:
        install(t, job, bundle_of(tmp_path, "one", "1\n"), keep=1)
        install(t, job, bundle_of(tmp_path, "two", "2\n"), keep=1)  # prunes one
        result = t.run(deploy.rollback_script(job))
        assert result.exit_code == 3 and "no earlier release" in result.stderr, result
        assert current_text(job) == "2\n"
