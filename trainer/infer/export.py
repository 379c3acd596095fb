"""Export the drafter in the format inference engines load, checked first against their rules
(trainer.infer.engine_rules); `dflash-train export` also writes how to serve it (trainer.infer.serve_recipe).

An export directory holds config.json (a Qwen3 config with `architectures: ["DFlashDraftModel"]`,
`block_size`, `num_target_layers`, `dflash_config: {mask_token_id, target_layer_ids}`, an `auto_map`
and the drafter's own plain RoPE, since engines rotate the draft's q/k by the draft config),
model.safetensors (the drafter weights only: engines use the target's embedding and lm_head) and
the architecture as Transformers code (trainer/hf_modeling) for `trust_remote_code`.
tests/trainer/reference_drafter.py reads an export the way an engine does.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

from trainer.atomic import write_atomic
from trainer.files import follow_umask
from trainer.infer.engine_rules import check_engine_rules
from trainer.model import DFlashDrafter, DrafterConfig

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
ARCHITECTURE = "DFlashDraftModel"
MODELING_DIR = Path(__file__).resolve().parent.parent / "hf_modeling"
MODELING_FILES = ("configuration_dflash.py", "modeling_dflash.py")
AUTO_MAP = {
    "AutoConfig": "configuration_dflash.DFlashConfig",
    "AutoModel": "modeling_dflash.DFlashDraftModel",
}


def export_config(cfg: DrafterConfig, dtype: torch.dtype) -> dict:
    if cfg.num_target_layers is None:
        raise ValueError(
            "cannot export: DrafterConfig.num_target_layers is unset (inference engines read it). "
            "Fix: build the config with DrafterConfig.for_target(target, ...) or set it to the "
            "target's layer count"
        )
    # The drafter's own RoPE (trainer.model.rope_cos_sin: unscaled), not the target's scaling:
    # engines apply the draft config's RoPE to the draft's q/k (trainer.infer.engine_rules).
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    config = {
        "architectures": [ARCHITECTURE],
        "auto_map": dict(AUTO_MAP),
        "model_type": "qwen3",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "attention_bias": False,
        "rms_norm_eps": cfg.rms_norm_eps,
        # All spellings: older transformers read rope_theta + rope_scaling, newer rope_parameters.
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None,
        "rope_parameters": rope,
        "layer_types": ["full_attention"] * cfg.num_layers,
        "vocab_size": cfg.vocab_size,
        "tie_word_embeddings": False,
        "torch_dtype": str(dtype).replace("torch.", ""),
        "block_size": cfg.block_size,
        "num_target_layers": cfg.num_target_layers,
        "dflash_config": {"mask_token_id": cfg.mask_token_id, "target_layer_ids": list(cfg.target_layer_ids)},
    }
    if cfg.max_position_embeddings is not None:  # unknown for checkpoints older than this field
        config["max_position_embeddings"] = cfg.max_position_embeddings
    return config


def weight_names(cfg: DrafterConfig) -> set[str]:
    parts = ["input_layernorm", "post_attention_layernorm", "self_attn.q_norm", "self_attn.k_norm"]
    parts += [f"self_attn.{p}_proj" for p in "qkvo"] + [f"mlp.{p}_proj" for p in ("gate", "up", "down")]
    layers = {f"layers.{i}.{part}.weight" for i in range(cfg.num_layers) for part in parts}
    return {"fc.weight", "hidden_norm.weight", "norm.weight"} | layers


def export_drafter(drafter: DFlashDrafter, out_dir, dtype: torch.dtype | None = None) -> Path:
    """Write config.json + model.safetensors into out_dir (each file replaced atomically)."""
    return export_weights(drafter.state_dict(), drafter.cfg, out_dir, dtype)


def export_weights(weights: dict, cfg: DrafterConfig, out_dir, dtype: torch.dtype | None = None) -> Path:
    """Same as export_drafter from a drafter state_dict (e.g. a checkpoint): no target needed."""
    config_dtype = dtype or next(iter(weights.values())).dtype
    config = export_config(cfg, config_dtype)  # validates before anything is written
    check_engine_rules(config, {name: tuple(t.shape) for name, t in weights.items()}, cfg.rope_theta)
    if set(weights) != weight_names(cfg):
        raise ValueError(
            f"cannot export: weights do not match the drafter config: missing "
            f"{sorted(weight_names(cfg) - set(weights))}, unexpected "
            f"{sorted(set(weights) - weight_names(cfg))}. Fix: export the checkpoint together "
            f"with the drafter config it was trained with"
        )
    tensors = {name: t.detach().to("cpu", config_dtype).contiguous() for name, t in weights.items()}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    weights_tmp = out / (WEIGHTS_FILE + ".tmp")
    save_file(tensors, str(weights_tmp), metadata={"format": "pt"})
    follow_umask(weights_tmp)
    os.replace(weights_tmp, out / WEIGHTS_FILE)
    for name in MODELING_FILES:
        write_atomic(str(out / name), (MODELING_DIR / name).read_text(encoding="utf-8"))
    write_atomic(str(out / CONFIG_FILE), json.dumps(config, indent=2) + "\n")
    return out


def qwen3_dims(config: dict) -> dict:
    """The drafter's layer dims from a Qwen3 config's keys (a target's, or an export's)."""
    renamed = {"num_heads": "num_attention_heads", "num_kv_heads": "num_key_value_heads"}
    same = ("hidden_size", "intermediate_size", "head_dim", "vocab_size")
    return {key: config[key] for key in same} | {ours: config[theirs] for ours, theirs in renamed.items()}


def drafter_config_from_export(export_dir) -> DrafterConfig:
    config = json.loads((Path(export_dir) / CONFIG_FILE).read_text())
    dflash = config["dflash_config"]
    return DrafterConfig(
        **qwen3_dims(config),
        num_layers=config["num_hidden_layers"],
        rms_norm_eps=config["rms_norm_eps"],
        rope_theta=config.get("rope_parameters", {}).get("rope_theta", config.get("rope_theta")),
        block_size=config["block_size"],
        mask_token_id=dflash["mask_token_id"],
        target_layer_ids=dflash["target_layer_ids"],
        num_target_layers=config.get("num_target_layers"),
        max_position_embeddings=config.get("max_position_embeddings"),
        rope_scaling={k: v for k, v in config["rope_scaling"].items() if k != "rope_theta"}
        if config.get("rope_scaling")
        else None,
    )


def export_checkpoint(state, out_dir: str, dtype: str = "bf16"):
    """Rebuild the drafter from a checkpoint alone (no target needed) and export it in `dtype`."""
    dcfg = DrafterConfig.from_dict(state.drafter_config)
    # The engine rules first: weights the drafter cannot load (a mask_hidden) are refused in one line.
    shapes = {name: tuple(t.shape) for name, t in state.weights.items()}
    check_engine_rules(export_config(dcfg, torch.float32), shapes, dcfg.rope_theta)
    # The target's embedding/lm_head are not part of the export; shape-only stand-ins on the meta
    # device satisfy the constructor without loading the target or allocating vocab x hidden.
    embed = torch.nn.Embedding(dcfg.vocab_size, dcfg.hidden_size, device="meta")
    head = torch.nn.Linear(dcfg.hidden_size, dcfg.vocab_size, bias=False, device="meta")
    drafter = DFlashDrafter(dcfg, embed, head)
    drafter.load_state_dict(state.weights)
    return export_drafter(drafter, out_dir, dtype={"bf16": torch.bfloat16, "fp32": torch.float32}[dtype])
