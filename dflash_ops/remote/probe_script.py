"""Gather, in one process on the target, everything `status` and `health` need; print ONE JSON object.

Stdlib only, Python >= 3.8 (whatever python the container has); its argument is built by
observe.probe.probe_script_for. Each section catches its own failures and each slow part is bounded
by `part_s`, so one broken or hung part never hides the others."""

from __future__ import annotations

import json
import os
import socket
import sys
import time

from dflash_ops.remote import facts, procs
from dflash_ops.remote.bounded import finish, out_of_time, start
from dflash_ops.remote.gpu_faults import finish_faults, start_faults
from dflash_ops.remote.gpu_read import finish_gpu_state, start_gpu_state
from trainer import metrics_format

PROBE_VERSION = 1
MAX_TAIL_BYTES = 512 * 1024  # bounds the transfer even if a log has enormous lines
MAX_EVAL_SCAN_BYTES = 16 * 1024 * 1024  # how far back past the tail the newest `eval` record is looked for
SCAN_CHUNK = 1024 * 1024
PART_S = 15.0  # default per-part limit: a wedged driver can hang nvidia-smi; the probe must still answer

# what the answer says of a session that is not ours to show: none, not running
NO_SESSION = {"exists": False, "running": False, "pane_pid": None, "exit_status": None}


def finish_tmux(started, sock, session, deadline, part_s):
    state = {"name": session, "socket": sock, **NO_SESSION, "error": None, "panes": []}
    rc, out, err = finish(started, deadline)
    if rc == 124:
        state.update(out_of_time("tmux", part_s))
        return state
    if rc == 127:
        state["error"] = "tmux is not installed"
        return state
    if rc != 0:  # no server on this socket, or no such session: not an error, just not running
        state["detail"] = err.strip()[:500]
        return state
    state["exists"] = True
    state["panes"] = procs.parse_panes(out)
    if state["panes"]:
        first = state["panes"][0]
        state["pane_pid"] = first["pid"]
        state["running"] = not first["dead"]
        state["exit_status"] = first["status"]
    return state


class OthersSession(Exception):
    """The job's session name is held by another job's live pane."""


def job_processes(panes, marker):
    """The job's living processes, parents first, and which carry the launcher's marker."""
    table = procs.process_table()
    wanted = marker.encode() if marker else b""
    others = procs.others_panes(panes, table, wanted)
    if others:  # the session's name is taken by another job (its pane carries that job's marker)
        raise OthersSession(others)
    tree = [
        {
            "pid": pid,
            "ppid": table[pid][1],
            "name": table[pid][3],
            "state": table[pid][0],
            "cmdline": procs.cmdline(pid),
        }
        for pid in procs.job_pids(panes, table, wanted)
    ]
    return tree, procs.marked(table, wanted)


def file_tail(path, lines):
    """Size, mtime and the last `lines` lines of a file; `first_line` when the tail misses the start."""
    st = os.stat(path)
    info = {"path": path, "size": st.st_size, "mtime": st.st_mtime, "lines": [], "first_line": None}
    if lines <= 0:
        return info
    with open(path, "rb") as f:
        end = st.st_size
        start, data = end, b""
        while start > 0 and data.count(b"\n") <= lines and end - start < MAX_TAIL_BYTES:
            step = min(65536, start, MAX_TAIL_BYTES - (end - start))
            start -= step
            f.seek(start)
            data = f.read(step) + data
        all_lines = data.decode("utf-8", "replace").splitlines()
        if start > 0 and all_lines:
            all_lines = all_lines[1:]  # the first piece is the end of a cut line
        info["lines"] = all_lines[-lines:]
        if start > 0 or len(all_lines) > lines:  # the tail misses the first line
            f.seek(0)
            info["first_line"] = f.readline(65536).decode("utf-8", "replace").rstrip("\r\n")
    return info


def newest_eval(path, size, context_steps, cap_bytes, deadline):
    """The current run's newest `eval` line and up to `context_steps` step records with `acc` before it,
    read backwards from `size`, at most `cap_bytes` and not past `deadline`."""
    scan = {"found": False, "bytes_read": 0, "cap_bytes": cap_bytes, "cap_hit": False, "out_of_time": False}
    found, steps = [], []
    with open(path, "rb") as f:
        end, cut = size, b""
        while end > 0 and not (found and len(steps) >= context_steps):
            if scan["bytes_read"] >= cap_bytes:
                scan["cap_hit"] = True
                break
            if time.monotonic() >= deadline:
                scan["out_of_time"] = True
                break
            size = min(SCAN_CHUNK, end, cap_bytes - scan["bytes_read"])
            end -= size
            f.seek(end)
            data = f.read(size) + cut
            scan["bytes_read"] += size
            cut = b""
            if end > 0:  # the chunk's first piece may be the end of a line that starts further back
                head, newline, data = data.partition(b"\n")
                cut = head + newline
            if not found and b'"eval"' not in data and b'"start"' not in data:
                continue  # the common case, decided without parsing
            for line in reversed(data.splitlines()):
                if not found and b'"eval"' not in line and b'"start"' not in line:
                    continue
                record = metrics_format.parse_line(line.decode("utf-8", "replace"))
                if record is None:
                    continue
                if record["event"] == "start":
                    end = 0
                    break
                if not found and record["event"] == "eval":
                    found.append(line.decode("utf-8", "replace"))
                elif found and record["event"] == "step" and isinstance(record.get("acc"), list):
                    steps.append(line.decode("utf-8", "replace"))
                    if len(steps) >= context_steps:
                        break
    scan["found"] = bool(found)
    return (steps[::-1] + found if found else []), scan


def with_newest_eval(tail, context_steps, cap_bytes, deadline):
    """The metrics tail, plus the newest eval from further back when the tail has none."""
    if tail["first_line"] is None or any(
        '"eval"' in line and (metrics_format.parse_line(line) or {}).get("event") == "eval"
        for line in tail["lines"]
    ):
        return tail  # the tail holds the whole file or the newest eval already
    try:
        tail["eval_lines"], tail["eval_scan"] = newest_eval(
            tail["path"], tail["size"], context_steps, cap_bytes, deadline
        )
    except OSError as e:  # rotated away meanwhile, say: the tail is still worth reporting
        tail["eval_lines"] = []
        tail["eval_scan"] = {"found": False, "error": "%s: %s" % (type(e).__name__, e)}
    return tail


def files_state(log_dir, lines, job_state=None, eval_search=None):
    """`lines`: log_lines and metrics_lines; `eval_search`: (context steps, cap bytes, deadline) or None."""
    state = {
        "log_dir": log_dir,
        "log_dir_exists": os.path.isdir(log_dir),
        "log": None,
        "metrics": None,
        "log_missing": None,
    }
    log_path = (job_state or {}).get("log")
    if log_path is not None and not procs.usable_path(log_path):
        return state  # the state names something that is no path: never another run's log instead
    if not log_path:
        name = facts.newest_log_name(os.listdir(log_dir)) if state["log_dir_exists"] else None
        if name is None:
            return state
        log_path = os.path.join(log_dir, name)
    if os.path.exists(log_path):
        state["log"] = file_tail(log_path, lines["log_lines"])
    else:
        state["log_missing"] = log_path  # deleted or rotated away under a live trainer, say
    metrics = metrics_format.metrics_path_for_log(log_path)
    if os.path.exists(metrics):
        state["metrics"] = file_tail(metrics, lines["metrics_lines"])
        if eval_search is not None:
            state["metrics"] = with_newest_eval(state["metrics"], *eval_search)
    return state


def visible_gpu_pids(gpu):
    """GPU process pids that exist here (inside LXC the driver may report host pids that do not)."""
    pids = [p.get("pid") for p in gpu.get("processes") or []]
    pids += [line.split(",")[0].strip() for line in (gpu.get("apps_csv") or "").splitlines()]
    return sorted({int(p) for p in pids if str(p).isdigit() and os.path.exists("/proc/%s" % p)})


def section(errors, name, fn, *args):
    try:
        return fn(*args)
    except Exception as e:  # a broken section is reported, never fatal
        errors.append("%s: %s: %s" % (name, type(e).__name__, e))
        return None


def main(argv):
    try:
        args = json.loads(argv[1])
        where = {name: str(args[name]) for name in ("log_dir", "session", "socket")}
        lines = {name: int(args[name]) for name in ("log_lines", "metrics_lines")}
    except (IndexError, ValueError, KeyError, TypeError) as e:
        sys.stderr.write(
            "dflash probe: needs one JSON argument with log_dir, session, socket, log_lines, "
            "metrics_lines (%s)\n" % e
        )
        return 2
    sys.stdout.write(json.dumps(probe(args, where, lines)) + "\n")
    return 0


def probe(args, where, lines):
    """Everything status and health need, gathered with the slow parts running side by side."""
    errors = []
    report = {
        "probe_version": PROBE_VERSION,
        "time": time.time(),
        "hostname": socket.gethostname(),
        "python": sys.version.split()[0],
        "errors": errors,
    }
    part_s = float(args.get("part_s") or PART_S)
    deadline = time.monotonic() + part_s
    gpu_source = args.get("gpu_source", "auto")
    where["session"], args["marker"] = procs.pick_identity(args)
    # one tmux call: listing the session's panes tells whether it exists and whether it lives
    tmux_started = section(errors, "tmux", start, procs.pane_command(where["socket"], where["session"]))
    gpu_started = faults_started = None
    if gpu_source != "none":  # "none": the Proxmox host is asked for the GPUs instead
        gpu_started = section(errors, "gpu", start_gpu_state, gpu_source, deadline, part_s)
        faults_started = section(errors, "gpu faults", start_faults, gpu_source, deadline)
    # the files are read while those commands run
    report["job_state"], report["job_state_error"] = section(
        errors, "job state", procs.read_job_state, args.get("state_file")
    ) or (None, "unreadable")
    eval_search = (int(args.get("eval_context_steps", 0)), MAX_EVAL_SCAN_BYTES, deadline)
    files = section(errors, "files", files_state, where["log_dir"], lines, report["job_state"], eval_search)
    finish_parts(report, errors, tmux_started, gpu_started, gpu_source, where, deadline, part_s)
    report["processes"], report["marked_pids"] = section(
        errors, "processes", ours_only, report["session"], args.get("marker")
    ) or ([], [])
    report.update(files or {})
    report["gpu_faults"] = (
        section(errors, "gpu faults", finish_faults, faults_started, deadline) if faults_started else None
    )
    report["out_of_time"] = [
        name for name in ("gpu", "session") if (report.get(name) or {}).get("out_of_time")
    ]
    return report


def ours_only(session, marker):
    """job_processes of the panes; a session another job holds reads as no session of ours."""
    panes = (session or {}).pop("panes", [])
    try:
        return job_processes(panes, marker)
    except OthersSession as taken:
        session.update(NO_SESSION)
        session["detail"] = "the session is another job's (pane pid %s)" % taken.args[0][0]
        return job_processes([], marker)


def finish_parts(report, errors, tmux_started, gpu_started, gpu_source, where, deadline, part_s):
    """The tmux and GPU answers, each within what is left of its time."""
    tmux = (tmux_started, where["socket"], where["session"], deadline, part_s)
    report["session"] = section(errors, "tmux", finish_tmux, *tmux) if tmux_started else None
    gpu = section(errors, "gpu", finish_gpu_state, gpu_started, deadline, part_s) if gpu_started else None
    report["gpu"] = gpu or {
        "source": None,
        "error": "not queried in the container" if gpu_source == "none" else "probe failed",
    }
    report["gpu_pids_visible"] = section(errors, "gpu", visible_gpu_pids, report["gpu"]) or []


if __name__ == "__main__":
    sys.exit(main(sys.argv))
