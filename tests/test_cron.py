"""The crontab line `cron install` writes, run the way cron runs it."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from dflash_ops import cron

REPO = Path(__file__).resolve().parent.parent


def as_cron_runs_it(line: str) -> tuple[str, str]:
    """(command for /bin/sh -c, stdin) from a crontab line, by cron's rule (crontab(5)): the first
    unescaped `%` ends the command, later ones become newlines of its stdin; `\\%` is a plain `%`."""
    command = line.split(None, 5)[5]
    out, escaped = [], False
    for i, ch in enumerate(command):
        if escaped:
            if ch == "%":
                out[-1] = "%"  # the backslash goes, the percent stays
            else:
                out.append(ch)
            escaped = False
            continue
        if ch == "%":
            return "".join(out), command[i + 1:].replace("%", "\n")
        escaped = ch == "\\"
        out.append(ch)
    return "".join(out), ""


def test_percent_in_log_and_inventory_paths_survives_cron(tmp_path):
    odd = tmp_path / "h%d 50%"
    odd.mkdir()
    inventory = odd / "inv%s.yaml"
    inventory.write_text("targets: {}\n")
    log = odd / "health%d.log"
    argv = [sys.executable, "-m", "dflash_ops", "--inventory", str(inventory), "health", "--target", "local"]
    line = cron.health_line("*/5 * * * *", argv, str(log), "local")
    command, stdin = as_cron_runs_it(line)
    assert stdin == "", f"cron would cut the command at a %: {command!r}"
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "PYTHONPATH": str(REPO), "SHELL": "/bin/sh"}
    subprocess.run(["/bin/sh", "-c", command], env=env, cwd=str(tmp_path), timeout=60)
    assert log.read_text().startswith("DFLASH "), os.listdir(odd)
