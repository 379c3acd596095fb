"""The rules an inference engine applies when it loads a DFlash export, checked before anything is written.

Each rule is one that vLLM's DFlash drafter (vllm/model_executor/models/qwen3_dflash.py) enforces or
silently acts on: breaking it gives a load error or, worse, a drafter that serves with tau near 1.
vLLM sizes `fc` as hidden size x tapped layers; refuses a `mask_hidden` weight; runs a
`sliding_attention` or `causal` layer causally (the drafter's block attends both ways); rotates
the draft's q/k by its config's RoPE (a mismatch "collapses acceptance" silently); and reads
mask_token_id and target_layer_ids from dflash_config.
"""

from __future__ import annotations

import math

from trainer.block_size import block_size_problem
from trainer.config import ConfigError

MASK_HIDDEN = "mask_hidden"
CAUSAL_LAYER_TYPE = "sliding_attention"


class ExportRefused(ConfigError):
    """An export an inference engine would reject or serve wrongly (exit 2, nothing written)."""


def _layer_ids_problem(config: dict) -> str | None:
    ids = (config.get("dflash_config") or {}).get("target_layer_ids")
    layers = config.get("num_target_layers")
    if not isinstance(ids, list) or not ids:
        return "dflash_config.target_layer_ids is missing or empty: engines read which target layers to tap"
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        return f"dflash_config.target_layer_ids {ids} must be whole numbers"
    if len(set(ids)) != len(ids):
        return f"dflash_config.target_layer_ids {ids} repeats a layer"
    if not isinstance(layers, int) or layers < 1:
        return "num_target_layers is missing: the layer ids cannot be checked against the target"
    outside = [i for i in ids if not 0 <= i < layers]
    if outside:
        return (
            f"dflash_config.target_layer_ids {outside} are outside the target's layers 0..{layers - 1} "
            f"(num_target_layers {layers})"
        )
    return None


def _mask_token_problem(config: dict) -> str | None:
    mask = (config.get("dflash_config") or {}).get("mask_token_id")
    vocab = config.get("vocab_size")
    if not isinstance(mask, int) or isinstance(mask, bool):
        return "dflash_config.mask_token_id is missing: engines embed the masked block slots with it"
    if not isinstance(vocab, int) or not 0 <= mask < vocab:
        return f"dflash_config.mask_token_id {mask} is outside the vocabulary [0, {vocab})"
    return None


def _fc_problem(config: dict, shapes: dict[str, tuple[int, ...]]) -> str | None:
    fc = shapes.get("fc.weight")
    ids = (config.get("dflash_config") or {}).get("target_layer_ids") or []
    hidden = config.get("hidden_size")
    if fc is None or len(fc) != 2:
        return "the weights have no 2-d fc.weight"
    want = (hidden or 0) * len(ids)
    if fc[1] != want:
        return (
            f"fc.weight takes {fc[1]} inputs but engines feed it hidden_size {hidden} x "
            f"{len(ids)} target layers = {want}"
        )
    return None


def _mask_hidden_problem(shapes: dict[str, tuple[int, ...]]) -> str | None:
    named = sorted(name for name in shapes if MASK_HIDDEN in name)
    return f"weight {named[0]} is a {MASK_HIDDEN} weight, which vLLM refuses to load" if named else None


def _causal_problem(config: dict) -> str | None:
    causal = [i for i, kind in enumerate(config.get("layer_types") or []) if kind == CAUSAL_LAYER_TYPE]
    why = "the drafter was trained with its block attending both ways"
    if causal:
        return f"layer_types marks layer(s) {causal} {CAUSAL_LAYER_TYPE!r}, which vLLM runs causally; {why}"
    if config.get("is_causal") or (config.get("dflash_config") or {}).get("causal"):
        return f"the config asks for causal attention; {why}"
    return None


def _rope_problem(config: dict, trained_rope_theta: float) -> str | None:
    params = config.get("rope_parameters") or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default" or config.get("rope_scaling"):
        return (
            f"RoPE type {rope_type!r} (rope_scaling {config.get('rope_scaling')}) would be applied to the "
            "drafter, which was trained with plain RoPE"
        )
    for where in (params, config):
        factor = where.get("partial_rotary_factor")
        if factor is not None and factor != 1:
            return f"partial_rotary_factor {factor}: the drafter was trained rotating the whole head_dim"
        if where.get("mrope_section") is not None:
            return "mrope_section set: the drafter was trained with 1-d RoPE"
    if config.get("is_neox_style") is False:
        return "is_neox_style false: the drafter was trained with neox-style (rotate_half) RoPE"
    theta = params.get("rope_theta", config.get("rope_theta"))
    if not isinstance(theta, (int, float)) or not math.isclose(theta, trained_rope_theta, rel_tol=1e-9):
        return f"rope_theta {theta} differs from the {trained_rope_theta:g} the drafter was trained with"
    return None


def engine_rule_problem(
    config: dict, shapes: dict[str, tuple[int, ...]], trained_rope_theta: float
) -> str | None:
    """The first engine rule the export (config.json as a dict, weight name -> shape) breaks, or None."""
    block = config.get("block_size")
    block_problem = "is missing" if not isinstance(block, int) else block_size_problem(block)
    if block_problem:
        return f"block_size {block_problem}"
    problems = (
        _layer_ids_problem(config),
        _mask_token_problem(config),
        _fc_problem(config, shapes),
        _mask_hidden_problem(shapes),
        _causal_problem(config),
        _rope_problem(config, trained_rope_theta),
    )
    return next((problem for problem in problems if problem), None)


def check_engine_rules(config: dict, shapes: dict[str, tuple[int, ...]], trained_rope_theta: float) -> None:
    """Raise ExportRefused (one line: the rule and the fix) when the export breaks an engine rule."""
    problem = engine_rule_problem(config, shapes, trained_rope_theta)
    if problem:
        raise ExportRefused(
            f"cannot export: {problem}. Fix: export the checkpoint as the trainer wrote it "
            "(dflash-train export), without editing its drafter config or weights"
        )
