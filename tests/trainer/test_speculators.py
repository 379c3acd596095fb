"""A third-party reader of the format: vLLM's `speculators` library converts z-lab DFlash checkpoints for
vLLM; it converts ours too, with every drafter weight as we wrote it and the verifier's embedding and head.

Opt-in: speculators pins older transformers and pulls datasets/openai, so it is not installed by .ci/run.
Run with it on sys.path, e.g. `pip install --target SITE --no-deps speculators loguru pydantic-settings
openai datasets dill multiprocess pandas pyarrow hs-connectors` then `PYTHONPATH=SITE pytest this file`.
"""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("speculators.convert.dflash", reason="speculators is not installed (opt-in)")

from safetensors.torch import load_file  # noqa: E402
from speculators.convert.dflash import DFlashConverter  # noqa: E402
from speculators.models.dflash import DFlashDraftModel  # noqa: E402

from tests.trainer.conftest import EXPORT_BLOCK  # noqa: E402
from trainer.infer.export import export_drafter  # noqa: E402


def test_speculators_converts_our_export_and_keeps_every_weight(target, drafter, tmp_path):
    target.model.save_pretrained(tmp_path / "target")
    export_drafter(drafter, tmp_path / "export")
    DFlashConverter().convert(tmp_path / "export", tmp_path / "converted", base_model=str(tmp_path / "target"))

    converted = DFlashDraftModel.from_pretrained(str(tmp_path / "converted"))
    theirs = converted.state_dict()
    ours = load_file(tmp_path / "export" / "model.safetensors")
    assert ours and all(torch.equal(theirs[name], tensor) for name, tensor in ours.items())
    assert torch.equal(theirs["embed_tokens.weight"], target.embed_tokens.weight)
    assert torch.equal(theirs["lm_head.weight"], target.lm_head.weight)

    config = json.loads((tmp_path / "converted" / "config.json").read_text())
    exported = json.loads((tmp_path / "export" / "config.json").read_text())
    assert config["block_size"] == EXPORT_BLOCK
    assert config["mask_token_id"] == exported["dflash_config"]["mask_token_id"]
    # speculators counts hidden states from the embedding output: z-lab's layer id + 1
    layers = target.num_layers
    assert config["aux_hidden_state_layer_ids"] == [
        i + 1 for i in exported["dflash_config"]["target_layer_ids"] if i + 1 != layers]
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == EXPORT_BLOCK - 1
