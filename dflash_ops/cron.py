"""The crontab lines that run `dflash-ops health`, tagged so only our own lines are ever touched."""

from __future__ import annotations

import shlex
import subprocess

from dflash_ops.errors import DflashOpsError, InputError

TAG = "# dflash-ops-health:"
# `cron install --metrics DIR`: the metrics line, beside the health line
METRICS_TAG = "# dflash-ops-metrics:"
TAGS = (TAG, METRICS_TAG)
CRON_PERCENT = "\\%"  # how a crontab command line writes a literal %


def _crontab(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(["crontab", *args], input=stdin, capture_output=True, text=True, timeout=30)
    except FileNotFoundError:
        raise DflashOpsError("crontab not found: install cron (apt-get install cron)") from None


def read() -> list[str]:
    result = _crontab("-l")
    if result.returncode != 0:
        if "no crontab" in result.stderr:
            return []
        raise DflashOpsError(f"crontab -l failed: {result.stderr.strip()}")
    return result.stdout.splitlines()


def write(lines: list[str]) -> None:
    result = _crontab("-", stdin="\n".join(lines) + "\n")
    if result.returncode != 0:
        raise DflashOpsError(f"crontab - failed: {result.stderr.strip()}")


def ours(lines: list[str], target: str | None = None) -> list[str]:
    return [
        line
        for line in lines
        if any((line.endswith(tag + target) if target else tag in line) for tag in TAGS)
    ]


def health_line(schedule: str, argv: list[str], log: str, target: str, tag: str = TAG) -> str:
    fields = schedule.split()
    if len(fields) != 5:
        raise InputError(f"--schedule {schedule!r}: a cron schedule has 5 fields, e.g. '*/5 * * * *'")
    if "\n" in target or "#" in target:
        raise InputError(f"target name {target!r} cannot go in a crontab line")
    cmd = f"{shlex.join(argv)} >> {shlex.quote(log)} 2>&1"
    # cron runs with a minimal PATH and no terminal: absolute paths, output appended to a log.
    # cron ends the command at an unescaped `%` (the rest becomes stdin): `\%` is its plain `%`.
    return f"{schedule} {cmd.replace('%', CRON_PERCENT)} {tag}{target}"


def install(line: str, target: str, tag: str = TAG) -> list[str]:
    lines = [kept for kept in read() if not kept.endswith(tag + target)] + [line]
    write(lines)
    return ours(lines, target)


def remove(target: str | None) -> list[str]:
    lines = read()
    gone = ours(lines, target)
    if gone:
        write([kept for kept in lines if kept not in gone])
    return gone
