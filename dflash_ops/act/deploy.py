"""Deploy the bundled trainer: <workdir>/releases/<id>/, its history, and an atomic `current` switch.
The same bundle gives the same id, so a repeated deploy only re-points `current`."""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import io
import pathlib
import posixpath
import re
import tarfile
import time

from dflash_ops import __version__
from dflash_ops.job import jobpaths
from dflash_ops.errors import InputError
from dflash_ops.job.model import Job, Target
from dflash_ops.remote import shell_command
from dflash_ops.transport.factory import connect

KEEP_RELEASES = 5


@dataclasses.dataclass(frozen=True)
class Bundle:
    data: bytes
    sha256: str

    @property
    def release_id(self) -> str:
        return f"{__version__}-{self.sha256[:12]}"


def build_bundle(source: pathlib.Path | None = None) -> Bundle:
    """A reproducible tar.gz of the trainer package: sorted names, fixed mtimes and owners."""
    import trainer

    source = source or pathlib.Path(trainer.__file__).resolve().parent
    files = sorted(
        p
        for p in source.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts and p.suffix not in (".pyc", ".pyo")
    )
    buf = io.BytesIO()
    # gzip header mtime=0 keeps the bytes identical across builds
    with gzip.GzipFile(fileobj=buf, mode="wb", mtime=0) as gz:
        with tarfile.open(fileobj=gz, mode="w") as tar:
            for path in files:
                info = tarfile.TarInfo("trainer/" + path.relative_to(source).as_posix())
                data = path.read_bytes()
                info.size, info.mtime, info.mode = len(data), 0, 0o644
                info.uid = info.gid = 0
                info.uname = info.gname = ""
                tar.addfile(info, io.BytesIO(data))
    data = buf.getvalue()
    return Bundle(data, hashlib.sha256(data).hexdigest())


def install_script(job: Job, bundle: Bundle, tarball: str, keep: int = KEEP_RELEASES) -> str:
    """Verify the pushed tarball, unpack into its release dir, switch `current`, prune old ones."""
    install = shell_command(
        "deploy_install.sh", jobpaths.releases_dir(job), bundle.release_id, bundle.sha256, tarball
    )
    return f"{install} && {switch_script(job, bundle.release_id, max(1, int(keep)))}"


def switch_script(job: Job, release_id: str, keep: int = KEEP_RELEASES) -> str:
    """Make `release_id` ("" for the previous one) current, then keep only the newest `keep` (0: all)."""
    releases, current = jobpaths.releases_dir(job), jobpaths.current_release(job)
    # `current` links relative to its own directory, so the workdir can move
    link_dir = posixpath.relpath(releases, posixpath.dirname(current))
    return shell_command("deploy_switch.sh", releases, current, link_dir, release_id, str(int(keep)))


_RELEASE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,127}\Z")


def check_release_id(release: str, given_as: str = "release") -> str:
    """A release id as `deploy --list` shows it, never a path; `given_as` names where the user wrote it."""
    if not _RELEASE_ID.match(release) or ".." in release:
        raise InputError(
            f"{given_as} {release!r}: not a release id; `dflash-ops deploy --list` shows the kept ones"
        )
    return release


def rollback_script(job: Job, release: str | None = None) -> str:
    """Switch `current` to `release` (default: the previous one), never to an incomplete deploy."""
    return switch_script(job, check_release_id(release) if release else "", keep=0)


# deploy_install.sh / deploy_switch.sh exit with this when they refuse (one line on stderr says why)
REFUSED = 3


def list_script(job: Job) -> str:
    """Prints `<id> <deployed-epoch> <current 0|1>` per kept release, most recently deployed first."""
    return shell_command("deploy_list.sh", jobpaths.releases_dir(job), jobpaths.current_release(job))


@dataclasses.dataclass(frozen=True)
class Release:
    id: str
    deployed: float  # unix time the release was unpacked
    current: bool


def parse_list(stdout: str) -> list[Release]:
    rows = (line.split() for line in stdout.splitlines())
    return [
        Release(parts[0], float(parts[1]), parts[2] == "1")
        for parts in rows
        if len(parts) == 3 and parts[1].isdigit() and len(parts[1]) <= 11  # unix seconds
    ]


def format_list(releases: list[Release]) -> list[str]:
    if not releases:
        return ["no releases deployed yet (dflash-ops deploy)"]
    return [
        f"{'*' if r.current else ' '} {r.id}  {time.strftime('%Y-%m-%d %H:%M', time.localtime(r.deployed))}"
        + ("  (current)" if r.current else "")
        for r in releases
    ]


def list_releases(target: Target) -> list[Release]:
    with connect(target) as transport:
        return parse_list(transport.check(list_script(target.job), timeout=30, step="list releases").stdout)


def require_kept_release(target: Target, release: str | None) -> None:
    """Refuse (exit 2) before anything switches when the release to roll back to is not kept."""
    releases = list_releases(target)
    kept = f"(kept: {', '.join(r.id for r in releases) or 'none'})"
    if release is None and all(r.current for r in releases):
        raise InputError(
            f"--rollback: no earlier release to roll back to on {target.name} {kept}; nothing was changed"
        )
    if release is not None and release not in [r.id for r in releases]:
        raise InputError(
            f"--rollback {release}: no such release kept on {target.name} {kept}; "
            "`dflash-ops deploy --list` shows them"
        )
