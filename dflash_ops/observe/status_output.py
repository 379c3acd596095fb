"""What `status` and `health` print: dense text with what the target sent shown inert, or JSON."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence

from dflash_ops.observe.gpu import IDLE_USED_MIB, Gpu, GpuProcess
from dflash_ops.observe.job_status import JobStatus, Ranks
from dflash_ops.observe.status import EvalStatus, TargetStatus, TmuxSession, Training
from dflash_ops.observe.text_style import BOLD, LEVEL_COLORS, inert, paint


def status_text(statuses: Sequence[TargetStatus | JobStatus], color: bool = False) -> str:
    """Each status's table ends with its newline: one blank line between them, none after the last."""
    return "\n".join(
        job_text(s, color) if isinstance(s, JobStatus) else target_text(s, color) for s in statuses
    )


def status_json(
    statuses: Sequence[TargetStatus | JobStatus],
    indent: int | None = 2,
    relaunched: Mapping[str, str] | None = None,
) -> str:
    """One object per status (a list for several); `relaunched` adds `auto_relaunch` to each."""
    objects = [s.to_json() for s in statuses]
    if relaunched is not None:
        objects = [
            dict(o, auto_relaunch=relaunched.get(s.name)) for o, s in zip(objects, statuses, strict=True)
        ]
    return json.dumps(objects[0] if len(objects) == 1 else objects, indent=indent)


def target_text(st: TargetStatus, color: bool = False) -> str:
    """One line per GPU, then session, progress and the verdict; the target's text is shown inert."""
    head = st.target + (f" ({st.hostname})" if st.hostname else "")
    if st.probe_seconds is not None:
        head += f"  probe {st.probe_seconds:.2f} s"
    lines = [paint(inert(head), BOLD, color)]
    if st.gpu_error:
        lines.append(inert(f"GPUs: {st.gpu_error}"))
    elif st.probed:
        if not st.gpus:
            lines.append("GPUs: none")
        width = max((len(g.name) for g in st.gpus), default=0)
        lines += [gpu_line(g, width, color) for g in st.gpus]
    lines.append(inert(session_line(st.session)))
    if st.job_state:
        lines.append(inert(describe_job_state(st.job_state, st.log_missing)))
    if st.job_state_error:
        lines.append(inert(f"job state: unusable ({st.job_state_error})"))
    lines.append(inert(progress_line(st.training, st.eval, st.data_source)))
    level = st.verdict.level
    lines.append(paint(level, LEVEL_COLORS.get(level, "0"), color) + ": " + inert(st.verdict.summary))
    return "\n".join(lines) + "\n"


def job_text(job: JobStatus, color: bool = False) -> str:
    """The job's head line, each node's table (with its torchrun ranks), then the one verdict."""
    nproc = job.nproc_per_node
    out = [
        f"{job.job}: multinode job, {len(job.node_names)} nodes x {nproc} rank{'s' * (nproc != 1)} "
        f"(world size {job.world_size}), rendezvous {job.rdzv_endpoint}, runs {job.runs_dir}"
    ]
    for node in job.nodes:  # its table headed with its index, its ranks above its verdict
        lines = target_text(node.status, color).rstrip("\n").split("\n")
        lines[0] = f"node {node.index}: {lines[0]}"
        lines.insert(len(lines) - 1, ranks_line(node.ranks))
        out += lines
    level = job.verdict.level
    out.append(paint(f"{level}: {job.verdict.summary}", LEVEL_COLORS[level], color))
    return "\n".join(out) + "\n"


def ranks_line(ranks: Ranks) -> str:
    if ranks.torchrun_pid is None:
        return "ranks: torchrun not running"
    pids = ", ".join(map(str, ranks.alive)) or "none"
    alive = f"{len(ranks.alive)} of {ranks.expected}"
    return f"ranks: torchrun pid {ranks.torchrun_pid}, local ranks alive {alive} ({pids})"


def session_line(session: TmuxSession) -> str:
    """`session dflash (tmux -L dflash): running, pane pid 4100`, exited, not running or unknown."""
    if session.running is None:
        state = "unknown"
    elif session.running:
        state = "running" + (f", pane pid {session.pane_pid}" if session.pane_pid else "")
    elif session.exists:
        code = session.exit_status
        state = "exited" + (f" with status {code}" if code is not None else "")
    else:
        state = "not running"
    return f"session {session.name} (tmux -L {session.socket}): {state}"


def gpu_line(g: Gpu, name_width: int, color: bool) -> str:
    """`[0] NVIDIA H200 |  97 % |  70000 / 143771 MiB | target  | python3/4123(69000M)`"""
    used, total, util = g.memory_used_mib, g.memory_total_mib, g.utilization_pct
    util_text = "N/A" if util is None else f"{util:>3} %"
    mem = f"{'?' if used is None else used:>6} / {'?' if total is None else total:>6} MiB"
    pids = " ".join(_process_label(p) for p in g.processes)
    # small differences between used and per-process memory are the driver's own; name big ones
    if g.ghost_memory_mib > IDLE_USED_MIB:
        pids = (pids + " " if pids else "") + f"ghost({g.ghost_memory_mib}M)"
    index = paint(f"[{g.index}]", BOLD, color)
    role = g.role or "-"
    name, pids = inert(g.name), inert(pids)  # both as the target's driver named them
    return f"{index} {name:<{name_width}} | {util_text:>5} | {mem} | {role:<7} | {pids or '-'}"


def _process_label(p: GpuProcess) -> str:
    """`python3/1072(1278M)`, then `[owner]` and `[foreign]` when they apply."""
    text = f"{p.name or '?'}/{p.pid}"
    text += f"({p.used_memory_mib}M)" if p.used_memory_mib is not None else ""
    text += f"[{p.owner}]" if p.owner else ""
    return text + ("[foreign]" if p.foreign else "")


def describe_job_state(state: dict, log_missing: str | None = None) -> str:
    """`job: stopped by dflash-ops stop, run 0003, log …/train-0007.log` (what dflash-ops recorded)."""
    parts = [f"job: {state.get('state')}" + (f" by {state['by']}" if state.get("by") else "")]
    if isinstance(state.get("run"), int):
        parts.append(f"run {state['run']:04d}")
    if state.get("log"):
        parts.append(f"log {state['log']}" + (" (MISSING)" if log_missing else ""))
    return ", ".join(parts)


def progress_line(training: Training, evaluated: EvalStatus | None, data_source: str | None) -> str:
    """`step 120/1000  loss 2.3141  45.2 Ktok/s  tau 2.50 (90 s ago)  ETA 1:23  last metrics 12 s ago`"""
    t = training
    step = "-" if t.step is None else str(t.step) + (f"/{t.total_steps}" if t.total_steps else "")
    loss = "-" if t.loss is None else f"{t.loss:.4f}"
    speed = "-" if t.tokens_per_s is None else f"{t.tokens_per_s / 1000:.1f}"
    age = t.last_update_age_s
    freshness = "no metrics yet" if age is None else f"last metrics {format_age(age)} ago"
    source = f"  data {data_source}" if data_source else ""
    tau = ""
    if evaluated is not None and evaluated.tau is not None:
        tau = f"  tau {evaluated.tau:.2f} ({format_age(evaluated.age_s)} ago)"
    eta = format_eta(t.eta_s)
    return f"step {step}  loss {loss}  {speed} Ktok/s{tau}  ETA {eta}  {freshness}{source}"


def format_eta(seconds) -> str:
    """`22 s`, `12m05s` under an hour (where h:mm would show 0:00), else h:mm (hours may exceed 24)."""
    if seconds is None:
        return "-"
    if seconds < 59.5:
        return f"{max(0, round(seconds))} s"
    if seconds < 3599.5:
        whole = int(round(seconds))
        return f"{whole // 60}m{whole % 60:02d}s"
    minutes = int(round(seconds / 60))
    return f"{minutes // 60}:{minutes % 60:02d}"


def format_age(seconds) -> str:
    if seconds is None:
        return "-"
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"
