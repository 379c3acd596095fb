"""Which Gated DeltaNet path a hybrid target runs, as the trainer's start log and metrics say it."""

from __future__ import annotations

import io
import sys

import pytest
import torch

from trainer import gdn_kernels, metrics_format
from trainer.config import load_config
from trainer.data.target import tiny_target
from trainer.train.loop import train

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def hybrid():
    return tiny_target("cpu", torch.float32, 0, None, "tiny-random-hybrid")


def test_a_cpu_box_without_the_kernels_reports_the_pytorch_fallback(hybrid):
    assert gdn_kernels.gated_deltanet_path(hybrid) == {"delta rule": "torch", "conv": "torch"}
    line = gdn_kernels.describe(gdn_kernels.gated_deltanet_path(hybrid))
    assert "PyTorch fallback" in line and "dflash-ops[kernels]" in line


def test_a_dense_target_has_no_gated_deltanet_path():
    dense = tiny_target("cpu", torch.float32, 0, None, "tiny-random")
    assert gdn_kernels.gated_deltanet_path(dense) is None and gdn_kernels.describe(None) is None


def test_the_implementation_transformers_picked_is_what_is_reported(hybrid, monkeypatch):
    # transformers' fallback decorator keeps its pick in the wrapper's closure; fake an fla pick
    def kernel(*args, **kwargs):
        return None

    kernel.__module__ = "fla.ops.gated_delta_rule.chunk"

    def decorate(implementation):
        def wrapped(*args, **kwargs):
            return implementation(*args, **kwargs)

        return wrapped

    home = sys.modules[type(hybrid.model.layers[0].linear_attn).__module__]
    monkeypatch.setattr(home, "torch_chunk_gated_delta_rule", decorate(kernel))
    path = gdn_kernels.gated_deltanet_path(hybrid)
    assert path == {"delta rule": "fla", "conv": "torch"}
    assert gdn_kernels.describe(path).startswith(
        "Gated DeltaNet: delta rule fla kernels (flash-linear-attention"
    )


def test_training_a_hybrid_target_on_synthetic_data_says_its_path_in_the_log_and_the_metrics(tmp_path):
    cfg = load_config(
        "tiny-cpu",
        {
            "output_dir": str(tmp_path),
            "target.spec": "tiny-random-hybrid",
            "target.layer_ids": [1, 3, 5],
            "data.seq_len": 32,
            "data.synthetic.num_samples": 8,
            "train.batch_size": 2,
            "train.num_anchors": 4,
            "max_steps": 2,
            "eval.every": 0,
            "run.drafter_devices": ["cpu"],
        },
    )
    out = io.StringIO()
    result = train(cfg, out=out)
    assert result.reason == "max_steps" and result.steps_done == 2
    assert "Gated DeltaNet: delta rule PyTorch fallback" in out.getvalue()
    with open(cfg.metrics_path, encoding="utf-8") as f:
        records = metrics_format.parse_lines(f.read())
    start = metrics_format.last_of(records, "start")
    assert start["gated_deltanet"] == {"delta rule": "torch", "conv": "torch"}
    assert [r["step"] for r in records if r["event"] == "step"] == [1, 2]
