"""Known failure signatures in the human log and progress in the metrics; each log line is claimed by
the first (most specific) signature, so an OOM is not also a generic CUDA error."""

from __future__ import annotations

import dataclasses
import math
import re
import statistics

from trainer import metrics_format

from dflash_ops.job import torchrun

TRACEBACK_HEADER = "Traceback (most recent call last):"


@dataclasses.dataclass(frozen=True)
class Signature:
    name: str
    title: str  # what a person calls it
    pattern: re.Pattern
    explanation: str  # what it means and what to do

    def failure(self, line: str, line_no: int) -> Failure:
        return Failure(self.name, self.title, self.explanation, line, line_no)


@dataclasses.dataclass(frozen=True)
class Failure:
    name: str
    title: str
    explanation: str
    line: str  # the log line that shows it (for a traceback: the exception line)
    line_no: int  # 1-based, within the text that was searched

    def describe(self) -> str:
        return f"{self.title}: {self.line.strip()[:200]}"


SIGNATURES: tuple[Signature, ...] = (
    Signature(
        "fx_tracing",
        "FX-tracing race",
        re.compile(re.escape(metrics_format.FX_TRACING_ERROR)),
        "a drafter thread called a compiled function while another thread was compiling "
        "(AOTAutograd's make_fx sets a process-global flag); serialize first steps and recompiles "
        "under the compile lock, and retest with a fresh inductor cache",
    ),
    Signature(
        "block_mask_race",
        "create_block_mask race",
        re.compile(r"KeyError: 'custom'"),
        "concurrent create_block_mask calls mutate a module-global dict in torch.fx.traceback; "
        "serialize create_block_mask across threads",
    ),
    Signature(
        "cuda_oom",
        "CUDA out of memory",
        re.compile(r"CUDA out of memory|torch\.(?:cuda\.)?OutOfMemoryError|CUDA error: out of memory"),
        "a GPU ran out of memory: check for leftover processes or ghost memory on the job's GPUs, "
        "then lower the batch or sequence length",
    ),
    Signature(
        "nccl",
        "NCCL error",
        re.compile(
            r"NCCL error|nccl(?:Internal|System|Invalid\w*|UnhandledCuda|Remote)Error"
            r"|Watchdog caught collective operation timeout|ProcessGroupNCCL.*(?:[Tt]imeout|[Ee]rror)"
        ),
        "communication between GPUs failed (a peer died or hung, or a collective timed out)",
    ),
    Signature(
        "cuda_error",
        "CUDA error",
        re.compile(
            r"CUDA error: |CUBLAS_STATUS_[A-Z_]+|cuDNN error|illegal memory access was encountered"
            r"|device-side assert triggered"
        ),
        "a CUDA kernel failed; rerun with CUDA_LAUNCH_BLOCKING=1 to find the operation",
    ),
    Signature(
        "compile_failed",
        "torch.compile failure",
        re.compile(r"BackendCompilerFailed|InductorError|LoweringException|torch\._inductor\.exc\.\w+"),
        "torch.compile (inductor/triton) failed to build a kernel; the traceback names the graph",
    ),
    Signature(
        "killed",
        "process killed",
        re.compile(r"^Killed\s*$|:\s*\d+\s+Killed(?:\s|$)"),
        "SIGKILL, usually the kernel OOM killer: check host RAM and `dmesg`",
    ),
    Signature(
        "native_crash",
        "native crash",
        re.compile(
            r"Segmentation fault|^Aborted(?: \(core dumped\))?\s*$|:\s*\d+\s+(?:Aborted|Bus error)(?:\s|$)"
            r"|terminate called after throwing"
        ),
        "the process died in native code (segfault/abort); the lines above it show the last operation",
    ),
)

TRACEBACK = Signature(
    "traceback",
    "Python exception",
    re.compile(re.escape(TRACEBACK_HEADER)),
    "the trainer raised an exception; the line shown is the exception",
)

RANK_DIED = Signature(
    "rank_died",
    "rank died",
    re.compile(r"$^"),  # found by torchrun.rank_failure
    "a rank of a torchrun job exited and torchrun ended the others; the line names "
    "the first rank that failed and how",
)


def _exception_line(lines: list[str], header_at: int) -> tuple[int, str]:
    """After a traceback header, the first unindented line is the exception."""
    for i in range(header_at + 1, len(lines)):
        line = lines[i]
        if line.strip() and not line[:1].isspace() and not line.startswith(TRACEBACK_HEADER):
            return i, line
    return header_at, lines[header_at]


def find_failures(text: str) -> list[Failure]:
    """Known failures in `text`, the latest of each; a KeyboardInterrupt is an operator's stop."""
    # tqdm-style progress rewrites a line with \r: only the last state is what a person sees.
    lines = [line.rsplit("\r", 1)[-1] for line in text.splitlines()]
    found: dict[str, Failure] = {}
    claimed: set[int] = set()
    for i, line in enumerate(lines):
        for sig in SIGNATURES:
            if sig.pattern.search(line):
                found[sig.name] = sig.failure(line, i + 1)
                claimed.add(i)
                break
    rank_died, explained = torchrun.rank_failure(lines)
    claimed.update(explained)
    latest_traceback = None
    for i, line in enumerate(lines):
        if TRACEBACK_HEADER in line:
            at, exception = _exception_line(lines, i)
            if at in claimed or exception.startswith("KeyboardInterrupt"):
                continue
            latest_traceback = TRACEBACK.failure(exception, at + 1)
    ordered = [found[sig.name] for sig in SIGNATURES if sig.name in found]
    if rank_died is not None:
        ordered.insert(0, RANK_DIED.failure(rank_died, max(explained, default=0) + 1))
    if latest_traceback is not None:
        ordered.append(latest_traceback)
    return ordered


# Trainer metrics `error` event kinds mapped onto the log signatures they correspond to.
_KIND_TO_SIGNATURE = {
    "fx_tracing": "fx_tracing",
    "cuda_oom": "cuda_oom",
    "block_mask": "block_mask_race",
    "nccl": "nccl",
}


def failures_from_records(records: list[dict]) -> list[Failure]:
    """`error` events the trainer wrote to its metrics file, as failures (latest per kind)."""
    by_name = {s.name: s for s in SIGNATURES}
    found: dict[str, Failure] = {}
    for record in records:
        if record.get("event") != "error":
            continue
        kind = str(record.get("kind", "exception"))
        sig = by_name.get(_KIND_TO_SIGNATURE.get(kind, ""), TRACEBACK)
        found[sig.name] = sig.failure(str(record.get("message", kind)), 0)
    return list(found.values())


@dataclasses.dataclass(frozen=True)
class TrainingProgress:
    step: int | None = None
    total_steps: int | None = None
    loss: float | None = None
    tokens_per_s: float | None = None  # median of recent step records (one slow interval is noise)
    eta_s: float | None = None
    last_step_time: float | None = None
    start_time: float | None = None
    done_reason: str | None = None

    @property
    def loss_is_finite(self) -> bool:
        return self.loss is None or math.isfinite(self.loss)


def step_records(records: list[dict]) -> list[dict]:
    return [r for r in records if r.get("event") == "step" and isinstance(r.get("step"), (int, float))]


def recent_tokens_per_s(records: list[dict], window: int = 5) -> float | None:
    values = [
        float(r["tokens_per_s"])
        for r in step_records(records)[-window:]
        if isinstance(r.get("tokens_per_s"), (int, float)) and math.isfinite(r["tokens_per_s"])
    ]
    return statistics.median(values) if values else None


def _record_number(value) -> float | None:
    """A metrics number as float, NaN and inf kept (a NaN loss is news); anything else is None."""
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _whole(value) -> int | None:
    number = _record_number(value)
    return int(number) if number is not None and math.isfinite(number) else None


def progress(records: list[dict]) -> TrainingProgress:
    """Summarize metrics records (oldest first). A new `start` begins a new run: older ones are ignored."""
    start = metrics_format.last_of(records, "start")
    if start is not None:
        records = records[records.index(start) :]
    last = metrics_format.last_of(records, "step") or {}
    done = metrics_format.last_of(records, "done")
    if done and last and (_record_number(done.get("time")) or 0) < (_record_number(last.get("time")) or 0):
        done = None  # a step came after it: the run went on
    # records come from a file on the target: a count that is not one reads as absent
    total = _whole(last.get("total_steps"))
    if total is None:
        total = _whole((start or {}).get("total_steps"))
    return TrainingProgress(
        step=_whole(last.get("step")),
        total_steps=total,
        loss=_record_number(last.get("loss")),
        tokens_per_s=recent_tokens_per_s(records),
        eta_s=_record_number(last.get("eta_s")),
        last_step_time=_record_number(last.get("time")),
        start_time=_record_number((start or {}).get("time")),
        done_reason=None if done is None else str(done.get("reason")),
    )
