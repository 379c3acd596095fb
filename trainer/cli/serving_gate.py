"""The serving gate: over-fit one sequence, export, serve it through Transformers, demand full blocks.

A drafter that trains well but accepts nothing once served (SpecForge #455: shifted labels or
features, blocks seeing later context) means training and serving disagree. A drafter over-fit on
ONE target continuation must accept every block whole when its export decodes the prompt with
`spec_generate`. The first checkpoint with perfect training accuracy is served, since a leak reaches
it early; and the training logits must equal the served export's on the same blocks, since a
drafter may memorise the sequence despite a leak.
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
CHECK_EVERY = 10  # steps between the checkpoints the gate may serve
LOGITS_TOLERANCE = 1e-3  # training vs serving logits, relative to their spread (fp32 agrees to ~1e-6)


@dataclasses.dataclass
class GateResult:
    block_size: int
    accepted: list[int]  # drafts accepted per round
    rounds: int  # rounds a clean drafter decodes the sequence in
    same_tokens: bool  # the served output equals the sequence it trained on
    train_acc: list[float]  # per block position, at the served checkpoint's step
    seconds: float
    export_dir: str
    step: int  # the training step of the served checkpoint
    logits_gap: float  # max |training - serving| logits over the sequence's blocks, relative to their spread

    @property
    def passed(self) -> bool:
        whole = all(n == self.block_size - 1 for n in self.accepted)
        agree = self.logits_gap <= LOGITS_TOLERANCE
        return self.learned and agree and self.same_tokens and len(self.accepted) == self.rounds and whole

    @property
    def learned(self) -> bool:
        """Training got every block position of the sequence right."""
        return bool(self.train_acc) and all(a == 1.0 for a in self.train_acc)

    @property
    def tau(self) -> float:
        return sum(n + 1 for n in self.accepted) / len(self.accepted) if self.accepted else float("nan")

    def line(self) -> str:
        acc = " ".join(f"{a:.2f}" for a in self.train_acc)
        if self.passed:
            return (
                f"serving gate: ok: training learned one sequence at step {self.step} (accuracy by position "
                f"{acc}), served through the export it accepted every block whole: tau {self.tau:.2f} = "
                f"block {self.block_size} over {len(self.accepted)} rounds ({self.seconds:.0f}s)"
            )
        if not self.learned:
            return (
                f"serving gate FAILED: training did not learn the one sequence in {self.step} steps "
                f"(accuracy by position {acc}); raise --steps, or look for a training bug"
            )
        if self.logits_gap > LOGITS_TOLERANCE:
            return (
                f"serving gate FAILED: training computes other logits than the served export on the same "
                f"blocks (relative gap {self.logits_gap:.3g} > {LOGITS_TOLERANCE:g}; served it accepted "
                f"{self.accepted} drafts per round): the training feature path or context mask sees "
                f"something serving does not"
            )
        what = "" if self.same_tokens else "; the served output is not the target's own continuation"
        return (
            f"serving gate FAILED: training learned one sequence at step {self.step} (accuracy by position "
            f"{acc}), but served through the export it accepted {self.accepted} drafts per round (tau "
            f"{self.tau:.2f}; a full block is {self.block_size}){what}: training and serving disagree "
            f"(labels, feature alignment, context mask or export)"
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
        "run.checkpoint_every": CHECK_EVERY,
        "run.keep_last": steps // CHECK_EVERY + 1,
        "run.log_every": steps,
        "run.report_to": [],
        "run.resume": None,
        "eval.every": 0,
    }
    return load_config(config, {**overrides, **forced})


def run_gate(
    work_dir: str, config: str = "tiny-cpu", overrides: dict | None = None, steps: int = GATE_STEPS
) -> GateResult:
    import io

    from trainer.cli.eval import load_models
    from trainer.infer.export import export_checkpoint
    from trainer.data.heldout import prompts_of
    from trainer.model import DrafterConfig
    from trainer.train.checkpoint import load_checkpoint
    from trainer.train.loop import build_dataset, train

    t0 = time.monotonic()
    cfg = gate_config(config, dict(overrides or {}), work_dir, steps)
    result = train(cfg, out=io.StringIO(), tty=False)
    step, train_acc = _first_perfect_step(cfg.metrics_path)
    state = load_checkpoint(_checkpoint_at(result.checkpoint, step))
    export_dir = export_checkpoint(state, os.path.join(work_dir, "export"), "fp32")
    dcfg = DrafterConfig.from_dict(state.drafter_config)
    target, drafter = load_models(dcfg, state.weights, state.config, None, cfg.run.target_devices[0])
    row = build_dataset(cfg, target)
    prompt = prompts_of(row)[0]
    sequence = row.input_ids[0][row.attention_mask[0]].tolist()
    continuation = sequence[len(prompt) :]
    stats = served_decode(export_dir, target.model, prompt, len(continuation))
    rounds = (len(continuation) - 1) // dcfg.block_size
    anchors = [len(prompt) + i * dcfg.block_size for i in range(rounds)]
    gap = logits_gap(export_dir, target, drafter, sequence, anchors)
    return GateResult(
        block_size=dcfg.block_size,
        accepted=list(stats.accepted),
        rounds=rounds,
        same_tokens=stats.output_ids[0, len(prompt) :].tolist() == continuation,
        train_acc=train_acc,
        seconds=time.monotonic() - t0,
        export_dir=str(export_dir),
        step=step,
        logits_gap=gap,
    )


def logits_gap(export_dir, target, drafter, sequence: list[int], anchors: list[int]) -> float:
    """max |training - served logits| / std(training logits) over the blocks at `anchors`: the trainer's
    features and mask against the export fed the target's hidden states before each anchor."""
    from trainer.masks import dense_mask

    device = target.device
    block = drafter.cfg.block_size
    ids = torch.tensor([sequence], dtype=torch.long, device=device)
    starts = torch.tensor([anchors], device=device)
    valid = torch.ones_like(starts, dtype=torch.bool)
    with torch.no_grad():
        features = target.features(ids, attention_mask=torch.ones_like(ids, dtype=torch.bool))
        mask = dense_mask(starts, valid, ids.shape[1], block, device)
        trained = drafter.logits(drafter(features, ids, starts, mask, "sdpa")).view(len(anchors), block, -1)
        draft = _load_export(export_dir).to(device=device, dtype=drafter.fc.weight.dtype).eval()
        hidden = target.model(input_ids=ids, output_hidden_states=True).hidden_states
        served_features = torch.cat([hidden[layer + 1] for layer in target.layer_ids], dim=-1)
        gaps = []
        for i, anchor in enumerate(anchors):
            tokens = torch.full((1, block), drafter.cfg.mask_token_id, dtype=torch.long, device=device)
            tokens[0, 0] = sequence[anchor]
            out = draft(
                target_hidden=served_features[:, :anchor],
                noise_embedding=target.embed_tokens(tokens),
                position_ids=torch.arange(anchor + block, device=device).unsqueeze(0),
            )
            served = drafter.logits(out)[0]
            gaps.append(float((served - trained[i]).abs().max() / trained[i].std()))
    return max(gaps)


def served_decode(export_dir, target_model, prompt: list[int], max_new_tokens: int):
    """Decode `prompt` the way a user of the export does: AutoModel + spec_generate, greedy."""
    weight = target_model.get_input_embeddings().weight
    device = weight.device
    draft = _load_export(export_dir, dtype=weight.dtype).to(device).eval()
    ids = torch.tensor([prompt], dtype=torch.long, device=device)
    return draft.spec_generate(
        target=target_model, input_ids=ids, max_new_tokens=max_new_tokens, temperature=0.0, return_stats=True
    )


def _load_export(export_dir, **kwargs):
    from transformers import AutoModel

    return AutoModel.from_pretrained(str(Path(export_dir).resolve()), trust_remote_code=True, **kwargs)


def _first_perfect_step(metrics_path: str) -> tuple[int, list[float]]:
    """The first checkpointed step whose training accuracy is perfect, else the last step (one
    sequence, every position: each step's per-position accuracy is exact)."""
    from trainer import metrics_format

    records = metrics_format.parse_lines(Path(metrics_path).read_text(encoding="utf-8"))
    by_step = {
        r["step"]: [float(a) for a in r["acc"]] for r in records if r.get("event") == "step" and r.get("acc")
    }
    perfect = (s for s in sorted(by_step) if s % CHECK_EVERY == 0 and all(a == 1.0 for a in by_step[s]))
    step = next(perfect, max(by_step))
    return step, by_step[step]


def _checkpoint_at(last_checkpoint, step: int) -> str:
    """The run's checkpoint of `step` (checkpoints/step-NNNNNNN beside the last one)."""
    from trainer.train.checkpoint import step_dir_name

    return str(Path(last_checkpoint).parent / step_dir_name(step))
