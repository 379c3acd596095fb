"""Stdlib-only script run ON THE TARGET: find the job's processes and, if asked, end them.

The job's processes are (a) the process tree under its tmux panes and (b) any process carrying
the launcher's marker in its environment (leftovers that escaped the tree). GPU compute processes
on the job's GPUs that are neither are reported as unidentified and never signalled.
With "action": "kill" it ends them (SIGTERM, SIGKILL after grace_s); any other action only lists.
Usage: python3 - '<json args>' < (remote.bundle('jobprocs.py')); prints one JSON object.
"""

import json
import os
import signal
import subprocess
import sys
import time

try:  # imported from the package (tests)
    from dflash_ops.remote import facts
except ImportError:  # on the target: remote.bundle() defined it ahead of this script
    import facts  # type: ignore[no-redef]


def read(path, mode="r"):
    try:
        with open(path, mode) as f:
            return f.read()
    except OSError:
        return None


def all_pids():
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def parent_of(pid):
    stat = read("/proc/%d/stat" % pid)
    if not stat:
        return None
    # the command name may hold spaces and parentheses: split after the LAST ')'
    return int(stat.rsplit(")", 1)[1].split()[1])


def cmdline(pid):
    raw = read("/proc/%d/cmdline" % pid, "rb")
    return raw.replace(b"\0", b" ").decode("utf-8", "replace").strip() if raw else ""


def comm(pid):
    return (read("/proc/%d/comm" % pid) or "").strip()


def has_marker(pid, marker):
    env = read("/proc/%d/environ" % pid, "rb")
    return bool(env) and marker in env.split(b"\0")


def descendants(roots, pids):
    children = {}
    for pid in pids:
        children.setdefault(parent_of(pid), []).append(pid)
    found, todo = set(), list(roots)
    while todo:
        pid = todo.pop()
        if pid in found:
            continue
        found.add(pid)
        todo.extend(children.get(pid, []))
    return found


def panes(socket, session):
    """[(pane pid, dead, exit status)] of the session's panes; [] when there is no session.

    tmux marks a pane dead when its pty closes and learns the exit status only when it reaps the
    child a moment later: a dead pane without a status is asked again, for up to a second."""
    for _ in range(10):
        found = _list_panes(socket, session)
        if not any(dead and status is None for _, dead, status in found):
            break
        time.sleep(0.1)
    return found


def _list_panes(socket, session):
    try:
        out = subprocess.run(
            [
                "tmux",
                "-L",
                socket,
                "list-panes",
                "-s",
                "-t",
                "=" + session + ":",
                "-F",
                "#{pane_pid} #{pane_dead} #{pane_dead_status}",
            ],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    found = []
    for line in out.splitlines():
        parts = line.split()
        if parts and parts[0].isdigit():
            dead = len(parts) > 1 and parts[1] == "1"
            status = int(parts[2]) if dead and len(parts) > 2 and parts[2].lstrip("-").isdigit() else None
            found.append((int(parts[0]), dead, status))
    return found


def gpu_apps(gpus):
    """[(pid, gpu_index, used_mib)] on the given GPU indices; [] without a driver."""
    if not gpus:
        return []
    try:
        idx = subprocess.run(
            facts.gpu_query_argv(fields=facts.GPU_FIELDS[:2]),  # index, uuid
            capture_output=True,
            text=True,
            timeout=20,
        )
        apps = subprocess.run(
            facts.apps_query_argv(fields=facts.APP_FIELDS[:3]),  # pid, gpu_uuid, used_memory
            capture_output=True,
            text=True,
            timeout=20,
        )
    except (OSError, subprocess.TimeoutExpired):
        return []
    if idx.returncode or apps.returncode:
        return []
    index_of = {}
    for line in idx.stdout.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0].isdigit():
            index_of[parts[1]] = int(parts[0])
    found = []
    for line in apps.stdout.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 3 and parts[0].isdigit() and index_of.get(parts[1]) in gpus:
            used = int(parts[2]) if parts[2].isdigit() else None
            found.append((int(parts[0]), index_of[parts[1]], used))
    return found


def alive(pid):
    stat = read("/proc/%d/stat" % pid)
    # a zombie has exited; it only waits for its parent to reap it
    return bool(stat) and stat.rsplit(")", 1)[1].split()[0] != "Z"


def main():
    args = json.loads(sys.argv[1])
    marker = ("%s=%s" % (args["marker_env"], args["marker"])).encode()
    me = {os.getpid(), os.getppid()}
    pids = [p for p in all_pids() if p not in me]
    session_panes = panes(args["socket"], args["session"]) if args.get("include_session", True) else []
    pane_list = [pid for pid, _dead, _status in session_panes]
    tree = descendants(pane_list, pids)
    marked = {p for p in pids if has_marker(p, marker)}
    # only living processes are the job's: a dead pane's shell (a zombie) has nothing left to end
    job = sorted(p for p in (tree | marked) - me if alive(p))
    # [pid, gpu, MiB, owner, name]: from the Proxmox host (pids already mapped into this container;
    # owner names another container or the host, whose pids mean nothing here), else asked here.
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
                    "cmd": "" if owner else cmdline(pid),
                    "name": (name[0] if name else "") or (comm(pid) if visible else ""),
                }
            )
    report = {
        "job": [{"pid": p, "cmd": cmdline(p)} for p in job],
        "unidentified": unidentified,
        "exited_panes": [{"pid": pid, "status": status} for pid, dead, status in session_panes if dead],
        "terminated": [],
        "killed": [],
        "survivors": [],
    }
    if args.get("action") == "kill" and job:
        # Signal the pane's shell last: when it dies tmux closes the pty and the trainer gets
        # SIGHUP, which would cut its graceful shutdown (final checkpoint) short.
        first = [p for p in job if p not in pane_list] or job
        for pid in first:
            try:
                os.kill(pid, signal.SIGTERM)
            except OSError:
                pass
        deadline = time.time() + float(args.get("grace_s", 10))
        while time.time() < deadline and any(alive(p) for p in job):
            time.sleep(0.2)
        report["terminated"] = [p for p in job if not alive(p)]
        for pid in job:
            if alive(pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                    report["killed"].append(pid)
                except OSError:
                    pass
        time.sleep(0.3)
        report["survivors"] = [p for p in job if alive(p)]
    print(json.dumps(report))


main()
