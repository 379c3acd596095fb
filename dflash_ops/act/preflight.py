"""Checks run before anything is stopped, so a relaunch that cannot succeed leaves the running job alone."""

from __future__ import annotations

from dflash_ops.job import jobpaths, jobstate
from dflash_ops.errors import DflashOpsError
from dflash_ops.job.model import Job
from dflash_ops.act.context import StepContext, StepOutcome
from dflash_ops.remote import shell_command
from dflash_ops.act.processes import (
    _fail,
    _gpu_snapshot,
    describe_foreign,
    job_processes,
    refuse_while_job_lives,
    resolve_cache,
    surely_foreign,
)

# The full import proves torch's libraries load; finding the package is enough for a quick check.
IMPORT_TORCH = "import torch; print(torch.__version__)"
FIND_TORCH = (
    "import importlib.util, sys; s = importlib.util.find_spec('torch'); "
    "sys.exit('No module named torch') if s is None else print('installed')"
)
# The Gated DeltaNet kernel packages the job's python has, from their metadata (nothing imported).
GDN_CHECK = (
    "import importlib.metadata as m\n"
    "def v(name, short):\n"
    "    try:\n"
    "        return short + ' ' + m.version(name)\n"
    "    except Exception:\n"
    "        return short + ' none' if short != 'fla' else 'none'\n"
    "print(v('flash-linear-attention', 'fla') + ', ' + v('causal-conv1d', 'causal-conv1d'))"
)


def _shell_checks(job, need_release: bool, import_torch: bool) -> str:
    """One round trip (remote/preflight.sh); prints `name=value` lines (the checks are read in Python)."""
    release = [jobpaths.current_release(job) + "/trainer/__init__.py"] if need_release else []
    torch_check = IMPORT_TORCH if import_torch else FIND_TORCH
    return shell_command(
        "preflight.sh", job.workdir, job.python, torch_check, jobpaths.state_file(job), GDN_CHECK, *release
    )


def _answers(stdout: str) -> dict[str, str]:
    pairs = (line.partition("=") for line in stdout.splitlines())
    return {key: value.strip() for key, sep, value in pairs if sep and key.isidentifier()}


_UNTOUCHED = "; nothing was stopped"


def preflight(
    ctx: StepContext,
    job: Job,
    *,
    deploy: bool,
    min_free_gib: float,
    allow_shared_gpus: bool,
    import_torch: bool,
) -> StepOutcome:
    """Check that the launch can work before anything is stopped (`deploy`: no release needed yet)."""
    script = _shell_checks(job, need_release=not deploy, import_torch=import_torch)
    try:
        result = ctx.run(script, timeout=150, check=False)
    except DflashOpsError as exc:  # ssh, pct or the container did not answer
        raise _fail(ctx, f"check 'reachable': {str(exc).splitlines()[0]}{_UNTOUCHED}") from None
    if ctx.dry_run:
        return StepOutcome(
            "would check python+torch, the release, free disk, the GPU query and foreign GPU processes"
        )
    found = _answers(result.stdout)
    if found.get("reach") != "ok":
        answer = (result.stderr or result.stdout).strip()[-300:]
        raise _fail(ctx, f"check 'reachable': the target did not answer ({answer}){_UNTOUCHED}")
    free_gib = _check_answers(ctx, job, found, min_free_gib)
    _, why = resolve_cache(ctx, job, job.cache_dir)  # purged and marked by this relaunch: never the job's own
    if why is not None:
        raise _fail(ctx, f"check 'cache': {why}{_UNTOUCHED}")
    said = [f"torch {found.get('torch', '?')}", f"{free_gib:.0f} GiB free"]
    if "gdn_kernels" in found:
        said.append(gdn_kernels_phrase(found["gdn_kernels"]))
    if job.gpus:
        said.append(_check_gpus(ctx, job, allow_shared_gpus))
    return StepOutcome("; ".join(said))


def gdn_kernels_phrase(answer: str) -> str:
    """What preflight.sh found of the Gated DeltaNet kernels, and the path a hybrid target takes."""
    if answer.startswith("fla "):
        return f"Gated DeltaNet kernels: {answer} (a hybrid target runs fla kernels)"
    return (
        f"Gated DeltaNet kernels: {answer} (a hybrid target runs the slow PyTorch fallback; "
        "pip install 'dflash-ops[kernels]')"
    )


def _check_answers(ctx: StepContext, job: Job, found: dict[str, str], min_free_gib: float) -> float:
    """The checks remote/preflight.sh answered: python, release, job state, disk; the free GiB."""
    if "python_error" in found:
        raise _fail(
            ctx,
            f"check 'python': {job.python} cannot import torch ({found['python_error']}); "
            "fix job.python or install torch there" + _UNTOUCHED,
        )
    if found.get("release") == "missing":
        raise _fail(
            ctx,
            f"check 'release': no trainer release at {jobpaths.current_release(job)}; "
            "deploy one (drop --no-deploy)" + _UNTOUCHED,
        )
    if found.get("release") == "unwritable":
        raise _fail(ctx, f"check 'release': cannot write {job.workdir} to deploy the trainer" + _UNTOUCHED)
    if found.get("state") == "not-a-file":
        raise _fail(
            ctx,
            f"check 'job state': {jobpaths.state_file(job)} is not a regular file, so the launch "
            f"could not record its state; {jobstate.NOT_A_FILE_FIX}" + _UNTOUCHED,
        )
    free_kib = found.get("free_kib") or ""
    free_gib = int(free_kib) / 2**20 if free_kib.isdigit() else 0.0
    if free_gib < min_free_gib:
        raise _fail(
            ctx,
            f"check 'disk': {free_gib:.1f} GiB free under {job.workdir}, checkpoints need "
            f"{min_free_gib:g} GiB" + _UNTOUCHED,
        )
    return free_gib


def _check_gpus(ctx: StepContext, job: Job, allow_shared_gpus: bool) -> str:
    """The job's GPUs exist and no foreign process uses them (unless allowed); what was found."""
    gpus = list(job.gpus)
    try:
        snapshot = _gpu_snapshot(ctx)
    except Exception as exc:  # the GPU query itself failed: name it, stop nothing
        raise _fail(ctx, f"check 'GPU query': {str(exc).split(': ', 1)[-1]}" + _UNTOUCHED) from None
    missing = [i for i in gpus if snapshot.by_index(i) is None]
    if missing:
        raise _fail(
            ctx,
            f"check 'GPU query': job GPUs {','.join(map(str, missing))} do not exist on the "
            "target; fix target_gpus/drafter_gpus" + _UNTOUCHED,
        )
    foreign = surely_foreign(job_processes(ctx, job, gpus, 0.0, True, "list")["unidentified"])
    if foreign and not allow_shared_gpus:
        raise _fail(
            ctx,
            f"check 'foreign GPU processes': {describe_foreign(foreign)}; they are not this "
            "job's and are never signalled: end them, or pass --allow-shared-gpus" + _UNTOUCHED,
        )
    shared = f", shared with {describe_foreign(foreign)}" if foreign else ""
    return f"GPUs {','.join(map(str, gpus))} answer{shared}"


def require_job_stopped(ctx: StepContext, job: Job) -> StepOutcome:
    """Fail while any process of the job lives (its tmux tree or the launcher's marker)."""
    refuse_while_job_lives(ctx, job, "stop it first (dflash-ops stop), or pass --force")
    return StepOutcome("would check that the job is not running" if ctx.dry_run else "the job is not running")
