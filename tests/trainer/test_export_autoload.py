"""An export loads through Transformers' own loader (its modeling file, auto_map) and matches the trainer."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from tests.trainer.conftest import EXPORT_BLOCK as BLOCK
from trainer.infer.export import export_drafter
from trainer.masks import dense_mask
from trainer.model import DFlashDrafter, DrafterConfig
from trainer.data.target import load_target

pytestmark = pytest.mark.timeout(180)

# Runs in a fresh interpreter that cannot import this project: only the export directory counts.
LOADER = """
import sys
sys.modules["trainer"] = None  # the export must not need the trainer
import torch
from transformers import AutoConfig, AutoModel

export, inputs, out = sys.argv[1:4]
config = AutoConfig.from_pretrained(export, trust_remote_code=True)
model = AutoModel.from_pretrained(export, trust_remote_code=True, dtype=torch.float32).eval()
x = torch.load(inputs)
with torch.no_grad():
    hidden = model(target_hidden=x["context"], noise_embedding=x["block_embedding"])
torch.save({"logits": hidden @ x["lm_head"].T, "model_class": type(model).__name__,
            "config_class": type(config).__name__,
            "dtypes": sorted({str(p.dtype) for p in model.parameters()})}, out)
"""


def load_with_transformers(export_dir, inputs: dict, tmp_path) -> dict:
    isolated = tmp_path / "isolated"  # a copy elsewhere: nothing next to it to import from
    shutil.copytree(export_dir, isolated / "drafter")
    torch.save(inputs, isolated / "inputs.pt")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["HF_HOME"] = str(tmp_path / "hf-home")  # remote code is cached there, not in the user's home
    proc = subprocess.run([sys.executable, "-c", LOADER, str(isolated / "drafter"), str(isolated / "inputs.pt"),
                           str(isolated / "out.pt")], cwd=isolated, env=env, capture_output=True, text=True,
                          timeout=150)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(isolated / "out.pt")


def test_automodel_loads_the_export_and_matches_the_trainer_logits(drafter, target, tmp_path):
    export_dir = export_drafter(drafter, tmp_path / "export", dtype=torch.float32)
    g = torch.Generator().manual_seed(3)
    seq_len, anchor = 24, 13
    input_ids = torch.randint(0, 511, (1, seq_len), generator=g)
    context = target.features(input_ids)
    anchors, valid = torch.tensor([[anchor]]), torch.tensor([[True]])
    with torch.no_grad():
        hidden = drafter(context, input_ids, anchors, dense_mask(anchors, valid, seq_len, BLOCK, "cpu"), "sdpa")
        trainer_logits = drafter.logits(hidden)[0]
    # at inference the cache holds the features of positions 0..anchor-1; the block follows
    block_tokens = [int(input_ids[0, anchor])] + [drafter.cfg.mask_token_id] * (BLOCK - 1)
    result = load_with_transformers(export_dir, {
        "context": context[:, :anchor].contiguous(),
        "block_embedding": target.embed_tokens.weight.detach()[block_tokens].unsqueeze(0),
        "lm_head": target.lm_head.weight.detach(),
    }, tmp_path)
    assert result["model_class"] == "DFlashDraftModel" and result["config_class"] == "DFlashConfig"
    assert result["dtypes"] == ["torch.float32"]
    loaded_logits = result["logits"][0]
    assert loaded_logits.shape == trainer_logits.shape == (BLOCK, 512)
    assert trainer_logits.std() > 0.05  # a real signal, not near-constant logits
    assert (loaded_logits - trainer_logits).abs().max() <= 1e-5


def test_the_comparison_would_notice_a_wrong_weight(drafter, target, tmp_path):
    """Guard for the test above: the loaded model really uses the exported weights."""
    from safetensors.torch import load_file, save_file

    export_dir = export_drafter(drafter, tmp_path / "export", dtype=torch.float32)
    weights = load_file(str(export_dir / "model.safetensors"))
    weights["norm.weight"] = weights["norm.weight"] * 1.01
    save_file(weights, str(export_dir / "model.safetensors"))
    ids = torch.randint(0, 511, (1, 10), generator=torch.Generator().manual_seed(4))
    context = target.features(ids)
    tokens = [int(ids[0, 6])] + [drafter.cfg.mask_token_id] * (BLOCK - 1)
    inputs = {"context": context[:, :6].contiguous(),
              "block_embedding": target.embed_tokens.weight.detach()[tokens].unsqueeze(0),
              "lm_head": target.lm_head.weight.detach()}
    anchors, valid = torch.tensor([[6]]), torch.tensor([[True]])
    with torch.no_grad():
        mask = dense_mask(anchors, valid, 10, BLOCK, "cpu")
        expected = drafter.logits(drafter(context, ids, anchors, mask, "sdpa"))[0]
    got = load_with_transformers(export_dir, inputs, tmp_path)["logits"][0]
    assert (got - expected).abs().max() > 1e-3


def test_export_config_carries_what_loaders_read(drafter, tmp_path):
    export_dir = export_drafter(drafter, tmp_path / "export")
    config = json.loads((export_dir / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"]
    assert config["auto_map"] == {"AutoConfig": "configuration_dflash.DFlashConfig",
                                  "AutoModel": "modeling_dflash.DFlashDraftModel"}
    assert (export_dir / "modeling_dflash.py").is_file() and (export_dir / "configuration_dflash.py").is_file()
    assert "trainer" not in (export_dir / "modeling_dflash.py").read_text()  # architecture only
    assert config["max_position_embeddings"] == 4096  # the tiny target's, not a loader's 32768 default
    assert config["rope_scaling"] is None and config["rope_parameters"]["rope_type"] == "default"
    assert config["layer_types"] == ["full_attention", "full_attention"]
    assert config["dflash_config"] == {"mask_token_id": 511, "target_layer_ids": [1, 2, 3]}


def test_a_scaled_rope_target_is_copied_into_the_export(tmp_path):
    from transformers import Qwen3Config

    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024, "rope_theta": 5e5}
    target = load_target("tiny-random", "cpu", torch.float32, seed=0, tiny={"rope_parameters": yarn})
    cfg = DrafterConfig.for_target(target, num_layers=1, block_size=BLOCK)
    export_dir = export_drafter(DFlashDrafter(cfg, target.embed_tokens, target.lm_head), tmp_path / "export")
    config = json.loads((export_dir / "config.json").read_text())
    assert config["rope_scaling"]["rope_type"] == "yarn" and config["rope_scaling"]["factor"] == 4.0
    assert config["rope_theta"] == 5e5
    loaded = Qwen3Config.from_pretrained(export_dir)
    assert loaded.rope_parameters["rope_type"] == "yarn" and loaded.rope_parameters["rope_theta"] == 5e5
