"""Run ON THE TARGET: the job's processes (remote/procs.py's rule), ended with "action": "kill";
other GPU processes are reported as unidentified, never signalled. Prints one JSON object."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time

from dflash_ops.remote import facts, procs


def panes(socket, session):
    """The session's panes; a dead pane without a status yet is asked again for up to a second."""
    found = []
    for _ in range(10):
        try:
            out = subprocess.run(
                procs.pane_command(socket, session), capture_output=True, text=True, timeout=10
            ).stdout
        except (OSError, subprocess.TimeoutExpired):
            return []
        found = procs.parse_panes(out)
        if not any(p["dead"] and p["status"] is None for p in found):
            break
        time.sleep(0.1)
    return found


def gpu_apps(gpus):
    """[(pid, gpu_index, used_mib)] on the given GPU indices; [] without a driver."""
    if not gpus:
        return []
    try:
        idx, apps = (
            subprocess.run(argv, capture_output=True, text=True, timeout=20)
            for argv in (
                facts.gpu_query_argv(fields=facts.GPU_FIELDS[:2]),  # index, uuid
                facts.apps_query_argv(fields=facts.APP_FIELDS[:3]),  # pid, gpu_uuid, used_memory
            )
        )
    except (OSError, subprocess.TimeoutExpired):
        return []
    if idx.returncode or apps.returncode:
        return []
    gpu_rows = ([p.strip() for p in line.split(",")] for line in idx.stdout.splitlines())
    index_of = {row[1]: int(row[0]) for row in gpu_rows if len(row) == 2 and row[0].isdigit()}
    app_rows = ([p.strip() for p in line.split(",")] for line in apps.stdout.splitlines())
    return [
        (int(parts[0]), index_of[parts[1]], int(parts[2]) if parts[2].isdigit() else None)
        for parts in app_rows
        if len(parts) == 3 and parts[0].isdigit() and index_of.get(parts[1]) in gpus
    ]


def same_process(table, pid):
    """`pid` still runs the process listed in `table` (not a zombie, not a newcomer that reused it)."""
    now = procs.stat_fields(pid)
    return now is not None and now[0] not in ("Z", "X") and now[2] == table[pid][2]


def main():
    args = json.loads(sys.argv[1])
    session, marker_entry = procs.pick_identity(args)
    marker = marker_entry.encode()
    me = {os.getpid(), os.getppid()}
    session_panes = panes(args["socket"], session) if args.get("include_session", True) else []
    table = {pid: fields for pid, fields in procs.process_table().items() if pid not in me}
    # a dead pane's pid is never a root: tmux has reaped it, and it may be anyone's since
    roots = procs.owned_pane_roots(session_panes, table, marker)
    job = sorted(procs.job_pids(session_panes, table, marker))
    report = {
        "session": session,
        # the session's name is taken by another job's live pane: never ours to kill
        "others_session": bool(procs.others_panes(session_panes, table, marker)),
        "job": [{"pid": p, "cmd": procs.cmdline(p)} for p in job],
        "unidentified": unidentified_gpu_apps(args, job),
        "exited_panes": [{"pid": p["pid"], "status": p["status"]} for p in session_panes if p["dead"]],
        "terminated": [],
        "killed": [],
        "survivors": [],
    }
    if args.get("action") == "kill" and job:
        end_job(report, table, job, roots, float(args.get("grace_s", 10)))
    print(json.dumps(report))


def unidentified_gpu_apps(args, job):
    """GPU processes not the job's, as [{pid, gpu, used_memory_mib, owner, visible, cmd, name}];
    `apps` come from the Proxmox host when given (owners other than us), else are asked here."""
    apps = args.get("gpu_apps")
    if apps is None:
        apps = [(pid, gpu, used, "", "") for pid, gpu, used in gpu_apps(set(args.get("gpus", [])))]
    unidentified = []
    for pid, gpu, used, owner, *name in apps:
        if owner or pid not in job:
            visible = not owner and os.path.exists("/proc/%d" % pid)
            unidentified.append(
                {
                    "pid": pid,
                    "gpu": gpu,
                    "used_memory_mib": used,
                    "owner": owner,
                    "visible": visible,
                    "cmd": "" if owner else procs.cmdline(pid),
                    "name": (name[0] if name else "") or (procs.comm(pid) if visible else ""),
                }
            )
    return unidentified


def end_job(report, table, job, roots, grace_s):
    """SIGTERM, up to `grace_s`, then SIGKILL; only to a process still the one listed in `table`."""
    # Signal the pane's shell last: when it dies tmux closes the pty and the trainer gets
    # SIGHUP, which would cut its graceful shutdown (final checkpoint) short.
    first = [p for p in job if p not in roots] or job
    for pid in first:
        if same_process(table, pid):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGTERM)
    deadline = time.time() + grace_s
    while time.time() < deadline and any(same_process(table, p) for p in job):
        time.sleep(0.2)
    report["terminated"] = [p for p in job if not same_process(table, p)]
    for pid in job:
        if same_process(table, pid):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
                report["killed"].append(pid)
    time.sleep(0.3)
    report["survivors"] = [p for p in job if same_process(table, p)]


main()
