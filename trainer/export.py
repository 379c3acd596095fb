"""Export the drafter in the format inference engines load, and an inference-side reference.

An export directory holds:
- config.json: a Qwen3 config (dims, rope, eps, vocab, the target's max_position_embeddings and
  rope scaling, layer_types) with `architectures: ["DFlashDraftModel"]`, `block_size`,
  `num_target_layers`, `dflash_config: {mask_token_id, target_layer_ids}` and an `auto_map`;
- model.safetensors: the drafter weights only (fc, hidden_norm, norm, layers.*), no embedding and
  no lm_head: engines use the target's;
- modeling_dflash.py + configuration_dflash.py (from trainer/hf_modeling): the architecture as
  Transformers code, so `AutoModel.from_pretrained(dir, trust_remote_code=True)` builds it.

`ReferenceDrafter` is deliberately written apart from trainer.model (plain tensors and loops, no
nn.Module, float64): it computes a block's logits the way an inference engine does after a verify
step: the cache holds the target features of every position before the anchor, the block is
[anchor, MASK...] at the next positions, and nothing is masked. If trainer logits for a training
block equal these, the export, the positions and the training mask all match inference.
"""
from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from trainer.files import follow_umask
from trainer.model import DFlashDrafter, DrafterConfig

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
ARCHITECTURE = "DFlashDraftModel"
MODELING_DIR = Path(__file__).resolve().parent / "hf_modeling"
MODELING_FILES = ("configuration_dflash.py", "modeling_dflash.py")
AUTO_MAP = {"AutoConfig": "configuration_dflash.DFlashConfig", "AutoModel": "modeling_dflash.DFlashDraftModel"}


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def export_config(cfg: DrafterConfig, dtype: torch.dtype) -> dict:
    if cfg.num_target_layers is None:
        raise ValueError(
            "cannot export: DrafterConfig.num_target_layers is unset (inference engines read it). "
            "Fix: build the config with DrafterConfig.for_target(target, ...) or set it to the "
            "target's layer count")
    rope = dict(cfg.rope_scaling or {"rope_type": "default"}, rope_theta=cfg.rope_theta)
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
        "rope_scaling": rope if cfg.rope_scaling else None,
        "rope_parameters": rope,
        "layer_types": ["full_attention"] * cfg.num_layers,
        "vocab_size": cfg.vocab_size,
        "tie_word_embeddings": False,
        "torch_dtype": _dtype_name(dtype),
        "block_size": cfg.block_size,
        "num_target_layers": cfg.num_target_layers,
        "dflash_config": {
            "mask_token_id": cfg.mask_token_id,
            "target_layer_ids": list(cfg.target_layer_ids),
        },
    }
    if cfg.max_position_embeddings is not None:  # unknown for checkpoints older than this field
        config["max_position_embeddings"] = cfg.max_position_embeddings
    return config


def weight_names(cfg: DrafterConfig) -> set[str]:
    """The safetensors names of an exported drafter."""
    names = {"fc.weight", "hidden_norm.weight", "norm.weight"}
    for i in range(cfg.num_layers):
        names |= {f"layers.{i}.{part}.weight" for part in (
            "input_layernorm", "post_attention_layernorm",
            "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
            "self_attn.q_norm", "self_attn.k_norm",
            "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}
    return names


def export_drafter(drafter: DFlashDrafter, out_dir, dtype: torch.dtype | None = None) -> Path:
    """Write config.json + model.safetensors into out_dir (each file replaced atomically)."""
    return export_weights(drafter.state_dict(), drafter.cfg, out_dir, dtype)


def export_weights(weights: dict, cfg: DrafterConfig, out_dir,
                   dtype: torch.dtype | None = None) -> Path:
    """Same as export_drafter from a drafter state_dict (e.g. a checkpoint): no target needed."""
    config_dtype = dtype or next(iter(weights.values())).dtype
    config = export_config(cfg, config_dtype)  # validates before anything is written
    if set(weights) != weight_names(cfg):
        raise ValueError(
            f"cannot export: weights do not match the drafter config: missing "
            f"{sorted(weight_names(cfg) - set(weights))}, unexpected "
            f"{sorted(set(weights) - weight_names(cfg))}. Fix: export the checkpoint together "
            f"with the drafter config it was trained with")
    tensors = {name: t.detach().to("cpu", config_dtype).contiguous() for name, t in weights.items()}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    weights_tmp = out / (WEIGHTS_FILE + ".tmp")
    save_file(tensors, str(weights_tmp), metadata={"format": "pt"})
    follow_umask(weights_tmp)
    os.replace(weights_tmp, out / WEIGHTS_FILE)
    for name in MODELING_FILES:
        shutil.copyfile(MODELING_DIR / name, out / (name + ".tmp"))
        os.replace(out / (name + ".tmp"), out / name)
    config_tmp = out / (CONFIG_FILE + ".tmp")
    config_tmp.write_text(json.dumps(config, indent=2) + "\n")
    os.replace(config_tmp, out / CONFIG_FILE)
    return out


def drafter_config_from_export(export_dir) -> DrafterConfig:
    config = json.loads((Path(export_dir) / CONFIG_FILE).read_text())
    dflash = config["dflash_config"]
    return DrafterConfig(
        hidden_size=config["hidden_size"],
        intermediate_size=config["intermediate_size"],
        num_layers=config["num_hidden_layers"],
        num_heads=config["num_attention_heads"],
        num_kv_heads=config["num_key_value_heads"],
        head_dim=config["head_dim"],
        vocab_size=config["vocab_size"],
        rms_norm_eps=config["rms_norm_eps"],
        rope_theta=config.get("rope_parameters", {}).get("rope_theta", config.get("rope_theta")),
        block_size=config["block_size"],
        mask_token_id=dflash["mask_token_id"],
        target_layer_ids=dflash["target_layer_ids"],
        num_target_layers=config.get("num_target_layers"),
        max_position_embeddings=config.get("max_position_embeddings"),
        rope_scaling={k: v for k, v in config["rope_scaling"].items() if k != "rope_theta"}
        if config.get("rope_scaling") else None,
    )


class ReferenceDrafter:
    """Inference-side DFlash drafter over an export directory, in float64, one block at a time."""

    def __init__(self, export_dir, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor):
        export_dir = Path(export_dir)
        self.config = json.loads((export_dir / CONFIG_FILE).read_text())
        if self.config.get("architectures") != [ARCHITECTURE]:
            raise ValueError(f"{export_dir}: architectures is {self.config.get('architectures')}, "
                             f"expected [{ARCHITECTURE!r}]")
        self.w = {k: v.double() for k, v in load_file(str(export_dir / WEIGHTS_FILE)).items()}
        c = self.config
        self.num_layers = c["num_hidden_layers"]
        self.n_q, self.n_kv, self.d = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        self.eps = c["rms_norm_eps"]
        self.theta = c["rope_parameters"]["rope_theta"] if "rope_parameters" in c else c["rope_theta"]
        self.block_size = c["block_size"]
        self.mask_token_id = c["dflash_config"]["mask_token_id"]
        self.embed = embed_weight.detach().double().cpu()
        self.lm_head = lm_head_weight.detach().double().cpu()
        self._check_names()

    def _check_names(self):
        expected = {"fc.weight", "hidden_norm.weight", "norm.weight"}
        for i in range(self.num_layers):
            p = f"layers.{i}."
            expected |= {p + "input_layernorm.weight", p + "post_attention_layernorm.weight"}
            expected |= {p + f"self_attn.{n}.weight" for n in ("q_proj", "k_proj", "v_proj", "o_proj",
                                                               "q_norm", "k_norm")}
            expected |= {p + f"mlp.{n}.weight" for n in ("gate_proj", "up_proj", "down_proj")}
        if set(self.w) != expected:
            raise ValueError(f"export weights differ from the DFlash layout: missing "
                             f"{sorted(expected - set(self.w))}, unexpected {sorted(set(self.w) - expected)}")

    def _rms(self, x, name):
        return self.w[name] * (x / torch.sqrt((x * x).mean(dim=-1, keepdim=True) + self.eps))

    def _rotate(self, x, positions):
        # x [heads, L, d]; pairs (i, i + d/2) rotate by position * theta^(-2i/d)
        half = self.d // 2
        freq = torch.tensor([self.theta ** (-2.0 * i / self.d) for i in range(half)], dtype=torch.float64)
        angle = torch.tensor(positions, dtype=torch.float64)[:, None] * freq[None, :]
        cos, sin = torch.cos(angle), torch.sin(angle)
        a, b = x[..., :half], x[..., half:]
        return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)

    def _attention(self, i, block, ctx, positions_q, positions_kv):
        p = f"layers.{i}.self_attn."
        both = torch.cat([ctx, block], dim=0)
        q = (block @ self.w[p + "q_proj.weight"].T).view(-1, self.n_q, self.d).transpose(0, 1)
        k = (both @ self.w[p + "k_proj.weight"].T).view(-1, self.n_kv, self.d).transpose(0, 1)
        v = (both @ self.w[p + "v_proj.weight"].T).view(-1, self.n_kv, self.d).transpose(0, 1)
        q = self._rotate(self._rms(q, p + "q_norm.weight"), positions_q)
        k = self._rotate(self._rms(k, p + "k_norm.weight"), positions_kv)
        heads = []
        group = self.n_q // self.n_kv
        for h in range(self.n_q):
            scores = q[h] @ k[h // group].T / math.sqrt(self.d)  # no mask: inference sees it all
            heads.append(torch.softmax(scores, dim=-1) @ v[h // group])
        out = torch.cat(heads, dim=-1)
        return out @ self.w[p + "o_proj.weight"].T

    def block_logits(self, context_features: torch.Tensor, anchor_token: int) -> torch.Tensor:
        """[block_size, V] logits for the block after a cache of len(context_features) positions.

        context_features: [T, K*H] target features of positions 0..T-1; the anchor sits at T.
        """
        ctx_len = context_features.shape[0]
        ctx = self._rms(context_features.double().cpu() @ self.w["fc.weight"].T, "hidden_norm.weight")
        tokens = [int(anchor_token)] + [self.mask_token_id] * (self.block_size - 1)
        x = self.embed[tokens]
        positions_q = list(range(ctx_len, ctx_len + self.block_size))
        positions_kv = list(range(ctx_len)) + positions_q
        for i in range(self.num_layers):
            p = f"layers.{i}."
            x = x + self._attention(i, self._rms(x, p + "input_layernorm.weight"), ctx,
                                    positions_q, positions_kv)
            h = self._rms(x, p + "post_attention_layernorm.weight")
            gate = h @ self.w[p + "mlp.gate_proj.weight"].T
            up = h @ self.w[p + "mlp.up_proj.weight"].T
            x = x + (gate * torch.sigmoid(gate) * up) @ self.w[p + "mlp.down_proj.weight"].T
        return self._rms(x, "norm.weight") @ self.lm_head.T
