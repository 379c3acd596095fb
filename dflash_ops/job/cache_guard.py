"""What the compile-cache dir may never hold or sit inside (purge deletes it): checked as written in the
inventory, and again after resolving symlinks on the target."""

from __future__ import annotations

import posixpath

from dflash_ops.job import jobpaths


def owned_paths(workdir: str, log_dir: str, python: str = "") -> list[tuple[str, str, bool]]:
    """(path, what, the cache may not lie inside it either) for each of the job's own places."""
    owned = [(workdir, "workdir", False), (log_dir, "log_dir", True)]
    owned += [(path, what, True) for path, what in jobpaths.owned_by_the_job(workdir)]
    if python.startswith("/"):
        prefix = posixpath.dirname(posixpath.dirname(posixpath.normpath(python)))  # <prefix>/bin/python
        owned += [
            (prefix, "python prefix", False),
            (posixpath.join(prefix, "bin"), "python's bin", True),
            (posixpath.join(prefix, "lib"), "python's lib", True),
        ]
    return owned


def problem(cache: str, owned: list[tuple[str, str, bool]]) -> str | None:
    """Why `cache` may not be purged (e.g. `lies inside the runs (checkpoints) (/w/runs)`), or None."""
    cache = posixpath.normpath(cache)
    if cache.count("/") < 2:
        return "is too close to '/' to be purged safely"
    for other, label, not_inside in owned:
        other = posixpath.normpath(other)
        if other == cache or other.startswith(cache + "/"):
            return f"contains the {label} ({other})"
        if not_inside and cache.startswith(other + "/"):
            return f"lies inside the {label} ({other})"
    return None
