"""Deploy the bundled trainer: versioned release directory, checksum, atomic `current` switch.

Layout on the target: <workdir>/releases/<id>/trainer/…, <workdir>/releases/history (one id per
deploy, newest last) and <workdir>/current -> releases/<id>. Same bundle twice = same id, so a
repeated deploy only re-points `current`.
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import io
import pathlib
import posixpath
import re
import shlex
import tarfile
import time

from . import __version__, jobpaths
from .errors import InputError
from .model import Job

KEEP_RELEASES = 5
PREVIOUS = "previous"  # the rollback target meaning "the release deployed before the current one"


@dataclasses.dataclass(frozen=True)
class Bundle:
    data: bytes
    sha256: str

    @property
    def release_id(self) -> str:
        return f"{__version__}-{self.sha256[:12]}"


def trainer_source_dir() -> pathlib.Path:
    import trainer

    return pathlib.Path(trainer.__file__).resolve().parent


def build_bundle(source: pathlib.Path | None = None) -> Bundle:
    """A reproducible tar.gz of the trainer package: sorted names, fixed mtimes and owners."""
    source = source or trainer_source_dir()
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
    q = shlex.quote
    releases = jobpaths.releases_dir(job)
    release = posixpath.join(releases, bundle.release_id)
    return f"""set -eu
cd {q(releases)}
echo {q(bundle.sha256 + "  " + posixpath.basename(tarball))} | sha256sum -c --quiet - >&2 || {{ echo {q("checksum mismatch for " + tarball)} >&2; exit 3; }}
if [ ! -f {q(release)}/.complete ]; then
  rm -rf {q(release)}.tmp && mkdir -p {q(release)}.tmp
  tar -xzf {q(tarball)} -C {q(release)}.tmp
  echo {q(bundle.sha256)} > {q(release)}.tmp/.complete
  rm -rf {q(release)} && mv {q(release)}.tmp {q(release)}
fi
rm -f {q(tarball)}
{switch_script(job, bundle.release_id, keep)}
"""


def _point_current(job: Job, release_word: str) -> str:
    """Point `current` at a release atomically (symlink + rename) and record it in history.
    `release_word` is a shell word: a quoted id or a variable such as "$prev"."""
    q = shlex.quote
    current = q(jobpaths.current_release(job))
    return f"""ln -sfn releases/{release_word} {current}.tmp
mv -Tf {current}.tmp {current}
echo {release_word} >> {q(jobpaths.releases_dir(job))}/history
echo "current -> "{release_word}
"""


def switch_script(job: Job, release_id: str, keep: int = KEEP_RELEASES) -> str:
    """Make `release_id` current, then prune releases beyond the newest `keep` in history."""
    q = shlex.quote
    releases = jobpaths.releases_dir(job)
    return (
        _point_current(job, q(release_id))
        + f"""# keep the newest {keep} releases named in history (the current one is the newest)
keep=$(tac {q(releases)}/history | awk '!seen[$0]++' | head -n {max(1, int(keep))})
for d in {q(releases)}/*/; do
  d=${{d%/}}; id=${{d##*/}}
  printf '%s\\n' "$keep" | grep -qxF -- "$id" || rm -rf -- "$d"
done
"""
    )


_RELEASE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,127}\Z")


def check_release_id(release: str) -> str:
    """A release id as `deploy --list` shows it (never a path: it names a directory in releases/)."""
    if not _RELEASE_ID.match(release) or ".." in release:
        raise InputError(
            f"--rollback {release!r}: not a release id; `dflash-ops deploy --list` shows the kept ones"
        )
    return release


def rollback_script(job: Job, release: str | None = None) -> str:
    """Switch `current` to `release`, or by default to the release deployed before the current one."""
    q = shlex.quote
    releases = jobpaths.releases_dir(job)
    if release:
        check_release_id(release)
        return f"""set -eu
[ -f {q(releases)}/{q(release)}/.complete ] || {{ echo {q(f"release {release} is not kept on the target; `dflash-ops deploy --list` shows the kept ones")} >&2; exit 3; }}
{_point_current(job, q(release))}"""
    return f"""set -eu
cur=$(readlink {q(jobpaths.current_release(job))} 2>/dev/null || true); cur=${{cur##*/}}
prev=$(tac {q(releases)}/history 2>/dev/null | awk '!seen[$0]++' | grep -vxF -- "$cur" | while read -r id; do [ -f {q(releases)}/"$id"/.complete ] && {{ echo "$id"; break; }}; done)
[ -n "$prev" ] || {{ echo "no earlier release to roll back to (current: ${{cur:-none}})" >&2; exit 3; }}
{_point_current(job, '"$prev"')}"""


def list_script(job: Job) -> str:
    """Prints `<id> <deployed-epoch> <current 0|1>` per kept release, most recently deployed first."""
    q = shlex.quote
    releases = jobpaths.releases_dir(job)
    return f"""set -eu
cur=$(readlink {q(jobpaths.current_release(job))} 2>/dev/null || true); cur=${{cur##*/}}
[ -f {q(releases)}/history ] || exit 0
tac {q(releases)}/history | awk '!seen[$0]++' | while read -r id; do
  [ -f {q(releases)}/"$id"/.complete ] || continue
  printf '%s %s %s\n' "$id" "$(stat -c %Y -- {q(releases)}/"$id"/.complete)" "$([ "$id" = "$cur" ] && echo 1 || echo 0)"
done
"""


@dataclasses.dataclass(frozen=True)
class Release:
    id: str
    deployed: float  # unix time the release was unpacked
    current: bool


def parse_list(stdout: str) -> list[Release]:
    releases = []
    for line in stdout.splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[1].isdigit():
            releases.append(Release(parts[0], float(parts[1]), parts[2] == "1"))
    return releases


def format_list(releases: list[Release]) -> list[str]:
    if not releases:
        return ["no releases deployed yet (dflash-ops deploy)"]
    return [
        f"{'*' if r.current else ' '} {r.id}  {time.strftime('%Y-%m-%d %H:%M', time.localtime(r.deployed))}"
        + ("  (current)" if r.current else "")
        for r in releases
    ]
