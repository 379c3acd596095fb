"""Which processes on the target are the job's: the one owner of that rule (stdlib only). A root of
the job's tree needs proof: a LIVE pane's pid (a dead pane's pid may be anyone's since) whose process
carries the marker or started with the session, or any process carrying the marker."""

import json
import os
import time

from dflash_ops.remote import facts

# tmux's answer, one line per pane. The separator is printable: outside a UTF-8 locale (cron, a
# bare ssh session) tmux prints a tab as "_". Split on it, not on runs of blanks, so that an empty
# exit status does not shift the fields.
PANE_SEPARATOR = ":"
PANE_FORMAT = PANE_SEPARATOR.join(
    ("#{pane_pid}", "#{pane_dead}", "#{pane_dead_status}", "#{session_created}")
)
MAX_PANES = 64  # a job's session has one pane; more lines than this are not a tmux answer
# The pane's first process is forked while tmux creates the session: a process that started more
# than this after the session's creation did not (a foreign process on a reused pid)
PANE_START_SLACK_S = 10.0
# /proc/PID/stat start times are in clock ticks since boot; /proc/stat's btime is whole seconds
BOOT_SLACK_S = 2.0
MAX_ENVIRON_BYTES = 1 << 20


def read(path, limit=65536):
    try:
        with open(path, "rb") as f:
            return f.read(limit)
    except OSError:
        return None


def tmux_word(word):
    """`word` as one tmux argument: tmux ends a command at a word ending in ";"."""
    return word[:-1] + "\\;" if word.endswith(";") else word


def pane_command(sock, session):
    """argv listing the session's panes; "=NAME:" because tmux 3.3 prefix-matches `-t =NAME` here."""
    return ["tmux", "-L", sock, "list-panes", "-s", "-t", "=" + session + ":", "-F", PANE_FORMAT]


def parse_panes(out):
    """[{"pid", "dead", "status", "created"}] from tmux's answer; unreadable lines are skipped."""
    found = []
    for line in (out or "").splitlines()[:MAX_PANES]:
        parts = line.split(PANE_SEPARATOR)
        if len(parts) < 2 or not _digits(parts[0]) or parts[1] not in ("0", "1"):
            continue
        dead = parts[1] == "1"
        status = parts[2].strip() if len(parts) > 2 else ""
        created = parts[3].strip() if len(parts) > 3 else ""
        found.append(
            {
                "pid": int(parts[0]),
                "dead": dead,
                "status": int(status) if dead and _digits(status.removeprefix("-"), 6) else None,
                "created": int(created) if _digits(created) else None,
            }
        )
    return found


def _digits(text, most=12):
    return isinstance(text, str) and 0 < len(text) <= most and text.isdigit()


def stat_fields(pid):
    """(state, ppid, start ticks, name) from /proc/PID/stat, split after the LAST ')' (names hold spaces)."""
    raw = read("/proc/%d/stat" % pid, 4096)
    if not raw:
        return None
    text = raw.decode("utf-8", "replace")
    open_paren, close_paren = text.find("("), text.rfind(")")
    rest = text[close_paren + 2 :].split()
    if open_paren < 0 or len(rest) < 20 or not rest[1].isdigit() or not rest[19].isdigit():
        return None
    return rest[0], int(rest[1]), int(rest[19]), text[open_paren + 1 : close_paren]


def process_table():
    """pid -> (state, ppid, start ticks, name) of every process visible here."""
    found = {int(entry): stat_fields(int(entry)) for entry in os.listdir("/proc") if entry.isdigit()}
    return {pid: fields for pid, fields in found.items() if fields is not None}


def living(table, pid):
    # a zombie has exited; it only waits for its parent to reap it
    return pid in table and table[pid][0] not in ("Z", "X")


def boot_time():
    for line in (read("/proc/stat", 1 << 16) or b"").decode("ascii", "replace").splitlines():
        if line.startswith("btime "):
            value = line.split()[1]
            return int(value) if value.isdigit() else None
    return None


def started_at(table, pid, boot):
    if boot is None or pid not in table:
        return None
    return boot + table[pid][2] / float(os.sysconf("SC_CLK_TCK"))


def _environ(pid):
    env = read("/proc/%d/environ" % pid, MAX_ENVIRON_BYTES)
    return env.split(b"\0") if env else []


def has_marker(pid, marker):
    return bool(marker) and marker in _environ(pid)


def has_other_marker(pid, marker):
    """The process carries the marker's NAME with another VALUE: it is another job's."""
    name = marker.split(b"=", 1)[0] + b"="
    return bool(marker) and any(entry.startswith(name) and entry != marker for entry in _environ(pid))


def others_panes(panes, table, marker):
    """The pids of live panes that carry another job's marker (see has_other_marker)."""
    return [
        p["pid"]
        for p in panes
        if not p["dead"] and living(table, p["pid"]) and has_other_marker(p["pid"], marker)
    ]


def marked(table, marker):
    return sorted(pid for pid in table if living(table, pid) and has_marker(pid, marker))


def owned_pane_roots(panes, table, marker):
    """The pids of live panes proven to be the job's (see the module's rule)."""
    boot, now = boot_time(), time.time()
    roots = []
    for pane in panes:
        pid = pane["pid"]
        if pane["dead"] or not living(table, pid):
            continue
        if has_marker(pid, marker):
            roots.append(pid)
            continue
        if has_other_marker(pid, marker):
            continue
        start, created = started_at(table, pid, boot), pane["created"]
        if (
            start is not None
            and created is not None
            and created - BOOT_SLACK_S <= start <= min(now, created + PANE_START_SLACK_S) + BOOT_SLACK_S
        ):
            roots.append(pid)
    return roots


def descendants(roots, table):
    children = {}
    for pid in sorted(table):
        children.setdefault(table[pid][1], []).append(pid)
    found, seen, todo = [], set(), [r for r in roots if living(table, r)]
    while todo:
        pid = todo.pop(0)
        if pid in seen:
            continue
        seen.add(pid)
        found.append(pid)
        todo.extend(c for c in children.get(pid, []) if living(table, c))
    return found


def job_pids(panes, table, marker):
    """Every living process of the job: the trees under its proven pane roots and its marked ones."""
    roots = owned_pane_roots(panes, table, marker) + marked(table, marker)
    return descendants(roots, table)


def comm(pid):
    return (read("/proc/%d/comm" % pid, 256) or b"").decode("utf-8", "replace").strip()


def cmdline(pid, limit=2000):
    raw = read("/proc/%d/cmdline" % pid, limit)
    return raw.replace(b"\0", b" ").decode("utf-8", "replace").strip() if raw else ""


def read_job_state(path):
    """(the job state or None, what is wrong with the file or None); a bad one is reported, never guessed."""
    if not path or not os.path.lexists(path):
        return None, None
    if not os.path.isfile(path):
        return None, facts.STATE_NOT_A_FILE
    with open(path, "rb") as f:
        raw = f.read(facts.STATE_MAX_BYTES + 1)
    if len(raw) > facts.STATE_MAX_BYTES:
        return None, "larger than %d bytes" % facts.STATE_MAX_BYTES
    try:
        data = json.loads(raw.decode("utf-8", "replace") or "null")
    except (ValueError, RecursionError) as e:
        return None, "not JSON (%s)" % type(e).__name__
    if not isinstance(data, dict):
        return None, "not a JSON object"
    if data.get("log") is not None and not usable_path(data["log"]):
        return data, "field log is not a path: %s" % json.dumps(data["log"])[:80]
    return data, None


def usable_path(value):
    return isinstance(value, str) and 0 < len(value) <= 4096 and "\0" not in value


def job_state_or_none(path):
    """The job state's data, or None where there is none to read."""
    try:
        return read_job_state(path)[0]
    except OSError:
        return None


def pick_identity(args):
    """(session, marker) to look for: the job's own, or an earlier version's when it wrote the state."""
    own = (args["session"], args.get("marker") or "")
    legacy = (args.get("legacy_session"), args.get("legacy_marker"))
    if not all(legacy) or not args.get("state_file"):
        return own
    state = job_state_or_none(args["state_file"])
    written_by_earlier = isinstance(state, dict) and "state" in state and facts.STATE_JOB_KEY not in state
    return legacy if written_by_earlier else own
