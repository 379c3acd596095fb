"""The serving gate: over-fit one sequence, export, serve it through Transformers, demand full blocks.

The field's most reported DFlash failure is a drafter that trains to high accuracy and accepts
nothing once served (SpecForge #455: labels shifted by one, a padding shift in the feature path,
blocks seeing later context). Each such bug is a disagreement between what training computes and
what serving computes, and an over-fit shows it at once: a fresh drafter trained a few hundred
steps on ONE sequence (the target's own greedy continuation of a random prompt) must, when its
export is loaded the way users load it (`AutoModel.from_pretrained(dir, trust_remote_code=True)`)
and decodes that prompt with `spec_generate`, accept every drafted token of every block. Anything
less means training and serving disagree, whatever the training accuracy says.

The sequence is prompt + 1 + rounds x block_size tokens: the first new token comes from the
prefill, then each of `rounds` blocks must be accepted whole (tau = block_size).
"""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path

import torch

GATE_ROUNDS = 6  # full blocks the served drafter must accept
GATE_PROMPT_LEN = 8
GATE_STEPS = 300
GATE_LR = 3e-3


@dataclasses.dataclass
class GateResult:
    block_size: int
    accepted: list[int]  # drafts accepted per round
    rounds: int  # rounds a clean drafter decodes the sequence in
    same_tokens: bool  # the served output equals the sequence it trained on
    train_acc: list[float]  # per block position, mean of the last training steps
    seconds: float
    export_dir: str

    @property
    def passed(self) -> bool:
        full = self.block_size - 1
        return (
            self.same_tokens and len(self.accepted) == self.rounds and all(n == full for n in self.accepted)
        )

    @property
    def tau(self) -> float:
        return sum(n + 1 for n in self.accepted) / len(self.accepted) if self.accepted else float("nan")

    def line(self) -> str:
        acc = " ".join(f"{a:.2f}" for a in self.train_acc)
        if self.passed:
            return (
                f"serving gate: ok: over-fit one sequence (training accuracy by position {acc}), served "
                f"through the export it accepted every block whole: tau {self.tau:.2f} = block "
                f"{self.block_size} over {len(self.accepted)} rounds ({self.seconds:.0f}s)"
            )
        what = "" if self.same_tokens else "; the served output is not the target's own continuation"
        return (
            f"serving gate FAILED: over-fit one sequence to training accuracy by position {acc}, but served "
            f"through the export it accepted {self.accepted} drafts per round (tau {self.tau:.2f}; a full "
            f"block is {self.block_size}){what}: training and serving disagree (labels, feature alignment, "
            f"context mask or export)"
        )


def gate_config(config: str, overrides: dict, work_dir: str, steps: int):
    """The run the gate trains: `config`'s target and drafter, one synthetic sequence, `steps` steps."""
    from trainer.config import load_config

    cfg = load_config(config, overrides)
    block = cfg.drafter.block_size
    seq_len = GATE_PROMPT_LEN + 1 + GATE_ROUNDS * block
    forced = {
        "data.source": "synthetic",
        "data.path": None,
        "data.eval_fraction": 0.0,
        "data.seq_len": seq_len,
        "data.synthetic.num_samples": 1,
        "data.synthetic.prompt_len": GATE_PROMPT_LEN,
        "train.batch_size": 1,
        "train.num_anchors": seq_len,  # every trained position, every step
        "train.epochs": steps,  # one sequence: an epoch is one step
        "train.max_steps": steps,
        "train.lr": GATE_LR,
        "train.warmup_frac": 0.05,
        "run.output_dir": os.path.join(work_dir, "run"),
        "run.metrics_file": None,
        "run.drafter_devices": cfg.run.drafter_devices[:1],
        "run.checkpoint_every": steps,
        "run.keep_last": 1,
        "run.log_every": steps,
        "run.report_to": [],
        "run.resume": None,
        "eval.every": 0,
    }
    return load_config(config, {**overrides, **forced})


def run_gate(
    work_dir: str, config: str = "tiny-cpu", overrides: dict | None = None, steps: int = GATE_STEPS, out=None
) -> GateResult:
    """Train, export, reload through Transformers and decode (see the module docstring)."""
    import io

    from trainer.cli.eval import load_drafter_source, load_models
    from trainer.cli.main import export_checkpoint
    from trainer.data.heldout import prompts_of
    from trainer.train.checkpoint import load_checkpoint
    from trainer.train.loop import build_dataset, train

    t0 = time.monotonic()
    cfg = gate_config(config, dict(overrides or {}), work_dir, steps)
    result = train(cfg, out=out if out is not None else io.StringIO(), tty=False)
    state = load_checkpoint(result.checkpoint)
    export_dir = export_checkpoint(state, os.path.join(work_dir, "export"), "fp32")
    dcfg, weights, run_config, _ = load_drafter_source(str(result.checkpoint))
    target, _ = load_models(dcfg, weights, run_config, None, cfg.run.target_devices[0])
    row = build_dataset(cfg, target)
    prompt = prompts_of(row)[0]
    sequence = row.input_ids[0][row.attention_mask[0]].tolist()
    continuation = sequence[len(prompt) :]
    stats = served_decode(export_dir, target.model, prompt, len(continuation))
    return GateResult(
        block_size=dcfg.block_size,
        accepted=list(stats.accepted),
        rounds=(len(continuation) - 1) // dcfg.block_size,
        same_tokens=stats.output_ids[0, len(prompt) :].tolist() == continuation,
        train_acc=_last_accuracy(cfg.metrics_path),
        seconds=time.monotonic() - t0,
        export_dir=str(export_dir),
    )


def served_decode(export_dir, target_model, prompt: list[int], max_new_tokens: int):
    """Decode `prompt` the way a user of the export does: AutoModel + spec_generate, greedy."""
    from transformers import AutoModel

    device = target_model.get_input_embeddings().weight.device
    dtype = target_model.get_input_embeddings().weight.dtype
    draft = AutoModel.from_pretrained(str(Path(export_dir).resolve()), trust_remote_code=True, dtype=dtype)
    draft.to(device).eval()
    ids = torch.tensor([prompt], dtype=torch.long, device=device)
    return draft.spec_generate(
        target=target_model, input_ids=ids, max_new_tokens=max_new_tokens, temperature=0.0, return_stats=True
    )


def _last_accuracy(metrics_path: str, window: int = 10) -> list[float]:
    """Per-position training accuracy, the mean of the last `window` step records."""
    from trainer import metrics_format

    with open(metrics_path, encoding="utf-8") as f:
        steps = [r for r in metrics_format.parse_lines(f.read()) if r.get("event") == "step" and r.get("acc")]
    steps = steps[-window:]
    if not steps:
        return []
    width = min(len(r["acc"]) for r in steps)
    return [sum(float(r["acc"][k]) for r in steps) / len(steps) for k in range(width)]
