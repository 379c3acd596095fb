"""The serving gate passes a clean pipeline and fails each of SpecForge #455's three bugs, planted here
with monkeypatch (production code has no hook for them)."""

from __future__ import annotations

import pytest
import torch

import trainer.masks
import trainer.train.loop
from trainer.cli.gate import gate_parser, run_gate_command
from trainer.data.target import TargetModel
from trainer.cli.serving_gate import run_gate

pytestmark = pytest.mark.timeout(300)


def plant_shifted_labels(monkeypatch):
    """Labels shifted by one: block position k learns token anchor+k+1 instead of anchor+k."""
    clean = trainer.train.loop.block_labels

    def shifted(input_ids, loss_mask, anchors, valid, block_size):
        return clean(input_ids, loss_mask, anchors + 1, valid, block_size)

    monkeypatch.setattr(trainer.train.loop, "block_labels", shifted)


def plant_padding_shift(monkeypatch):
    """The feature path off by one position, as a pad token prepended to the features would make it."""
    clean = TargetModel.features

    def shifted(self, input_ids, attention_mask=None):
        features = clean(self, input_ids, attention_mask)
        return torch.cat([torch.zeros_like(features[:, :1]), features[:, :-1]], dim=1)

    monkeypatch.setattr(TargetModel, "features", shifted)


def plant_leaky_context_mask(monkeypatch):
    """`<=` instead of `<`: each block also sees the context position of its own anchor."""
    clean = trainer.masks.make_mask_mod

    def leaky(anchors, valid, ctx_len, block_size):
        mask_mod = clean(anchors, valid, ctx_len, block_size)
        last = anchors.shape[1] - 1

        def leaky_mod(b, h, q_idx, kv_idx):
            block = torch.clamp(q_idx // block_size, max=last)
            at_anchor = (kv_idx < ctx_len) & (kv_idx == anchors[b, block]) & valid[b, block]
            return mask_mod(b, h, q_idx, kv_idx) | at_anchor

        return leaky_mod

    monkeypatch.setattr(trainer.masks, "make_mask_mod", leaky)


def test_the_gate_passes_the_clean_pipeline(tmp_path):
    result = run_gate(str(tmp_path), steps=300)
    assert result.passed, result.line()
    assert result.accepted == [result.block_size - 1] * result.rounds
    assert result.same_tokens and result.tau == result.block_size


@pytest.mark.parametrize(
    "plant", [plant_shifted_labels, plant_padding_shift, plant_leaky_context_mask], ids=lambda f: f.__name__
)
def test_the_gate_fails_each_specforge_455_bug(plant, monkeypatch, tmp_path):
    plant(monkeypatch)
    result = run_gate(str(tmp_path), steps=300)
    assert not result.passed
    assert result.line().startswith("serving gate FAILED") and "\n" not in result.line()
    # the planted bug trains fine: the failure is only visible once served
    if plant is not plant_padding_shift:
        assert min(result.train_acc) > 0.9, result.train_acc


def test_gate_command_exit_status_and_one_line(monkeypatch, tmp_path, capsys):
    plant_shifted_labels(monkeypatch)
    args = gate_parser().parse_args(["--work-dir", str(tmp_path), "--steps", "200"])
    assert run_gate_command(args) == 1
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and out[0].startswith("serving gate FAILED")


def test_gate_command_refuses_bad_steps(capsys):
    args = gate_parser().parse_args(["--steps", "0"])
    assert run_gate_command(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["dflash-train gate: error: --steps must be at least 1, got 0"]
