"""train.precision: bf16-mixed keeps fp32 master weights (norm weights move), tracks fp32, resumes exactly."""
from __future__ import annotations

import io
import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from benchmarks.baselines import eager_flex_attention
from trainer import metrics_format, precision
from trainer.config import ConfigError, load_config
from trainer.train.loop import train
from tests.trainer.conftest import assert_same_replica

pytestmark = pytest.mark.timeout(180)

SMALL = {
    "data.seq_len": 32, "data.synthetic.num_samples": 16, "train.epochs": 30, "train.batch_size": 2, "train.num_anchors": 6,
    "run.torch_threads": 1, "run.log_every": 1000,
}


def tiny_run(out_dir, mode: str, steps: int = 40, **extra):
    """The bundled tiny run, `steps` steps long (the schedule follows), in precision `mode`."""
    overrides = {"output_dir": str(out_dir), "max_steps": steps, "train.precision": mode,
                 "run.checkpoint_every": 1000, "run.log_every": 1000}
    overrides.update(extra)
    cfg = load_config("tiny-cpu", overrides)
    out = io.StringIO()
    result = train(cfg, out=out)
    with open(cfg.metrics_path, encoding="utf-8") as f:
        losses = [r["loss"] for r in metrics_format.parse_lines(f.read()) if r["event"] == "step"]
    return result, losses, out.getvalue()


def norm_weights(model) -> dict:
    return {n: p.detach() for n, p in model.named_parameters() if n.endswith("norm.weight")}


def norms_stuck_at_one(model) -> list[str]:
    """Names of the RMSNorm weights with any element still exactly 1.0 (their initial value)."""
    return [n for n, w in norm_weights(model).items() if bool((w == 1.0).any())]


def test_bf16_mixed_moves_every_norm_weight_and_ends_near_the_fp32_loss(tmp_path, monkeypatch):
    fp32, fp32_losses, _ = tiny_run(tmp_path / "fp32", "fp32", **SMALL)
    compute_dtypes = set()
    place = precision.place

    def place_and_watch(model, device, mode):  # records the dtype a matmul of each replica ran in
        placed = place(model, device, mode)
        placed.layers[0].mlp.down_proj.register_forward_hook(
            lambda _module, _inputs, output: compute_dtypes.add(output.dtype))
        return placed

    monkeypatch.setattr(precision, "place", place_and_watch)
    mixed, mixed_losses, _ = tiny_run(tmp_path / "mixed", "bf16-mixed", **SMALL)
    mixed_cfg_model = mixed.replicas[0].model

    assert compute_dtypes == {torch.bfloat16}  # the matmuls really ran in bf16
    assert all(p.dtype == torch.float32 for p in mixed_cfg_model.parameters())  # fp32 masters
    for state in mixed.replicas[0].optimizer.state_dict()["state"].values():
        assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.float32
    assert len(norm_weights(mixed_cfg_model)) == 6
    # both drafter threads got the same fp32-averaged gradients: their masters stay identical
    assert len(mixed.replicas) == 2
    for a, b in zip(mixed.replicas[0].model.parameters(), mixed.replicas[1].model.parameters()):
        assert torch.equal(a, b)
    assert norms_stuck_at_one(mixed_cfg_model) == []
    # ends within 5 % of the fp32 run (mean of the last 5 steps: same data and anchors in both)
    end_fp32, end_mixed = sum(fp32_losses[-5:]) / 5, sum(mixed_losses[-5:]) / 5
    assert abs(end_mixed - end_fp32) <= 0.05 * end_fp32, (end_fp32, end_mixed)
    assert end_fp32 < fp32_losses[0] - 0.5  # and both runs learned something


def test_the_norm_check_fails_with_bf16_master_weights(tmp_path, monkeypatch):
    """The same 40 steps with bf16 parameters updated in place: every norm weight stays 1.0."""
    def pure_bf16(model, device, mode):
        return model.to(device=device, dtype=torch.bfloat16)

    monkeypatch.setattr(precision, "place", pure_bf16)
    result, _, _ = tiny_run(tmp_path, "bf16-mixed", **SMALL)
    model = result.replicas[0].model
    assert model.fc.weight.dtype == torch.bfloat16
    assert sorted(norms_stuck_at_one(model)) == sorted(norm_weights(model))


def test_bf16_mixed_resume_is_exact(tmp_path):
    straight, losses, _ = tiny_run(tmp_path / "a", "bf16-mixed", steps=6,
                                   **SMALL, **{"run.checkpoint_every": 3, "run.keep_last": 5})
    mid = tmp_path / "a" / "checkpoints" / "step-0000003"
    weights = load_file(str(mid / "drafter.safetensors"))
    assert {t.dtype for t in weights.values()} == {torch.float32}  # checkpoints hold the masters
    resumed, resumed_losses, _ = tiny_run(tmp_path / "b", "bf16-mixed", steps=6, resume=str(mid), **SMALL)
    assert_same_replica(straight.replicas[0], resumed.replicas[0], moment="exp_avg")
    assert resumed_losses == losses[3:]


def test_an_old_bf16_checkpoint_resumes_upcast_with_one_log_line(tmp_path):
    tiny_run(tmp_path / "a", "bf16-mixed", steps=2, **SMALL, **{"run.checkpoint_every": 2})
    ckpt = tmp_path / "a" / "checkpoints" / "step-0000002"
    # what an older GPU run wrote: bf16 weights and bf16 Adam moments
    weights = {k: v.to(torch.bfloat16) for k, v in load_file(str(ckpt / "drafter.safetensors")).items()}
    save_file(weights, str(ckpt / "drafter.safetensors"))
    state = torch.load(ckpt / "trainer_state.pt", weights_only=True)
    for moments in state["optimizer"]["state"].values():
        for key in ("exp_avg", "exp_avg_sq"):
            moments[key] = moments[key].to(torch.bfloat16)
    torch.save(state, ckpt / "trainer_state.pt")
    drafter_config = json.loads((ckpt / "drafter_config.json").read_text())
    for newer in ("max_position_embeddings", "rope_scaling"):  # fields it did not have yet
        drafter_config.pop(newer)
    (ckpt / "drafter_config.json").write_text(json.dumps(drafter_config))

    result, losses, log = tiny_run(tmp_path / "b", "bf16-mixed", steps=4, resume=str(ckpt), **SMALL)
    assert len(losses) == 2
    lines = [line for line in log.splitlines() if "upcast" in line]
    assert len(lines) == 1 and str(ckpt) in lines[0] and "bfloat16" in lines[0], log
    replica = result.replicas[0]
    assert all(p.dtype == torch.float32 for p in replica.model.parameters())
    for moments in replica.optimizer.state_dict()["state"].values():
        assert moments["exp_avg"].dtype == torch.float32


def test_precision_default_follows_the_drafter_devices_and_bad_values_are_named(tmp_path):
    assert load_config("tiny-cpu", {}).train.precision == "fp32"
    assert load_config("tiny-cpu", {"drafter_devices": "cuda:0", "attention": "sdpa"}).train.precision == "bf16-mixed"
    assert load_config("tiny-cpu", {"train.precision": "bf16-mixed"}).train.precision == "bf16-mixed"
    with pytest.raises(ConfigError, match=r"`train.precision` must be one of fp32, bf16-mixed, got 'fp16'"):
        load_config("tiny-cpu", {"train.precision": "fp16"})
    assert not os.path.exists(tmp_path / "runs")


def test_attention_inputs_share_the_autocast_dtype():
    q = torch.randn(1, 2, 4, 8)
    v = torch.randn(1, 2, 4, 8, dtype=torch.bfloat16)
    assert {t.dtype for t in precision.attention_inputs(q, q, v)} == {torch.float32, torch.bfloat16}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert {t.dtype for t in precision.attention_inputs(q, q, v)} == {torch.bfloat16}


def test_flex_attention_gets_bf16_inputs_under_autocast_and_agrees_with_sdpa():
    from trainer.masks import build_block_mask, dense_mask, sample_anchors
    from trainer.model import DFlashDrafter, DrafterConfig
    from trainer.data.target import load_target

    target = load_target("tiny-random", "cpu", torch.float32, seed=0)
    torch.manual_seed(0)
    drafter = precision.place(DFlashDrafter(DrafterConfig.for_target(target, num_layers=1, block_size=4),
                                            target.embed_tokens, target.lm_head), "cpu", "bf16-mixed")
    ids = torch.randint(0, 511, (1, 32), generator=torch.Generator().manual_seed(1))
    features = target.features(ids).to(precision.compute_dtype("bf16-mixed"))
    anchors, valid = sample_anchors(torch.ones(1, 32, dtype=torch.bool), 4, 4, torch.Generator().manual_seed(0))
    # eager flex_attention, forward only: CPU has no flex backward (compiled flex runs on the GPU)
    with torch.no_grad(), precision.autocast("cpu", "bf16-mixed"):
        flex = drafter(features, ids, anchors, build_block_mask(anchors, valid, 32, 4, "cpu"),
                       eager_flex_attention)
        sdpa = drafter(features, ids, anchors, dense_mask(anchors, valid, 32, 4, "cpu"), "sdpa")
    assert (flex - sdpa).abs().max() <= 0.02 * sdpa.abs().max()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_bf16_mixed_on_cuda_with_compiled_flex_moves_every_norm_weight(tmp_path):
    result, losses, log = tiny_run(tmp_path, "bf16-mixed", steps=40, attention="flex", target_devices="cuda:0",
                                   drafter_devices="cuda:0", **{"train.lr": 6e-4})
    model = result.replicas[0].model
    assert "precision bf16-mixed" in log
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert norms_stuck_at_one(model) == []
    assert losses[-1] < losses[0]
