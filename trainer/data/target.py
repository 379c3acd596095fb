"""The frozen target model: hidden states of the chosen layers, its embedding and its lm_head.

Feature convention (what inference engines feed the drafter): for each target layer id l, HF
`output_hidden_states[l + 1]` (index 0 is the embedding output), concatenated in the order given.
Only the layers up to the last chosen one are run: a hook stops the forward right after it.
"""

from __future__ import annotations

import contextlib
import os
import threading
from dataclasses import dataclass
from typing import Any, Protocol, cast

import torch
from safetensors import SafetensorError
from torch import nn

from trainer.config import ConfigError, in_one_line
from trainer.fused_projections import fuse_projections
from trainer.target_family import check_supported, text_config

# The tiny-random target: small enough for CPU tests and the tiny run, same architecture as Qwen3.
TINY_DEFAULTS: dict[str, Any] = {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
}
# tiny-random-hybrid: a Qwen3.5-style hybrid (Gated DeltaNet layers, full attention every 4th layer).
TINY_HYBRID_DEFAULTS: dict[str, Any] = {
    **TINY_DEFAULTS,
    "num_hidden_layers": 8,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
}
TINY_SPECS = ("tiny-random", "tiny-random-hybrid")


def is_tiny(spec: str) -> bool:
    """A generated (seeded random) target rather than a model directory."""
    return spec in TINY_SPECS


class _EnoughLayers(Exception):
    """Raised from a layer hook once the last needed layer has run: skip the rest of the model."""


# An HF causal LM (a transformers PreTrainedModel), duck-typed: transformers' annotations type its
# accessors as nn.Module and wrap methods such as .to() in functools.wraps, which mypy misreads.
HFModel = Any


def default_layer_ids(num_layers: int, k: int = 5) -> list[int]:
    """k layer ids spread evenly from 1 to num_layers-3 (the paper's choice), deduplicated."""
    if num_layers < 4:
        raise ConfigError(
            f"target.layer_ids: a target with {num_layers} layers is too shallow for the default "
            f"spread 1..num_layers-3. Fix: set target.layer_ids explicitly, e.g. [0]"
        )
    first, last = 1, num_layers - 3
    ids = [round(first + i * (last - first) / (k - 1)) for i in range(k)]
    return sorted(set(ids))


def check_layer_ids(layer_ids: list[int], num_layers: int) -> None:
    bad = [i for i in layer_ids if not 0 <= i < num_layers]
    if not layer_ids or bad:
        raise ConfigError(
            f"target.layer_ids: {layer_ids} must be a non-empty list of layer indices in "
            f"[0, {num_layers - 1}] (the target has {num_layers} layers). "
            f"Fix: pick ids from that range or leave it null for the default spread"
        )


class Decoder(Protocol):
    """What _decoder_of checks a target's decoder for (Llama/Qwen family layout)."""

    layers: nn.ModuleList
    norm: nn.Module

    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...


def _decoder_of(model: nn.Module) -> Decoder:
    """The module holding `.layers` and `.norm` (Llama/Qwen family layout)."""
    get_decoder = getattr(model, "get_decoder", None)  # HF's accessor, not in nn.Module's type
    decoder = get_decoder() if get_decoder is not None else getattr(model, "model", None)
    if decoder is None or not hasattr(decoder, "layers") or not hasattr(decoder, "norm"):
        raise ConfigError(
            f"target.spec: {type(model).__name__} does not expose decoder `.layers` and `.norm`. "
            f"Fix: use a Llama/Qwen-style causal LM"
        )
    return cast(Decoder, decoder)


def default_mask_token_id(tokenizer, vocab_size: int) -> int:
    """The tokenizer's mask token, else its pad token, else the last embedding row."""
    if tokenizer is not None:
        for token_id in (getattr(tokenizer, "mask_token_id", None), getattr(tokenizer, "pad_token_id", None)):
            if token_id is not None and 0 <= token_id < vocab_size:
                return int(token_id)
    return vocab_size - 1


@dataclass(eq=False)
class TargetModel:
    model: nn.Module  # the HF causal LM (full; synthetic data generates with it)
    layer_ids: list[int]
    tokenizer: object | None
    device: str
    mask_token_id: int

    def __post_init__(self) -> None:
        hf: HFModel = self.model  # for its HF accessors: config, input and output embeddings
        hf.eval().requires_grad_(False)
        self.config = text_config(hf.config)
        self._decoder = _decoder_of(hf)
        self.num_layers = len(self._decoder.layers)
        self.embed_tokens: nn.Embedding = hf.get_input_embeddings()
        self.lm_head: nn.Linear = hf.get_output_embeddings()
        self.vocab_size, self.hidden_size = self.embed_tokens.weight.shape
        self.dtype = self.embed_tokens.weight.dtype
        check_layer_ids(self.layer_ids, self.num_layers)
        # Layer hooks are per module: one features() call at a time per target.
        self._lock = threading.Lock()

    @torch.no_grad()
    def features(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None):
        """[B, T, K*H] hidden states of `layer_ids`; no_grad, not inference_mode: they feed autograd."""
        wanted = sorted(set(self.layer_ids))
        last = wanted[-1]
        captured: dict[int, torch.Tensor] = {}
        caller = threading.get_ident()

        def make_hook(layer_id: int):
            def hook(_module, _args, output):
                if threading.get_ident() != caller:
                    return  # another thread's forward (e.g. generation) passing through
                captured[layer_id] = output[0] if isinstance(output, tuple) else output
                if layer_id == last:
                    raise _EnoughLayers

            return hook

        with self._lock:
            handles = [self._decoder.layers[i].register_forward_hook(make_hook(i)) for i in wanted]
            try:
                with contextlib.suppress(_EnoughLayers):
                    self._decoder(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
            finally:
                for handle in handles:
                    handle.remove()
        if last == self.num_layers - 1:  # HF reports the final layer's hidden state after the final norm
            captured[last] = self._decoder.norm(captured[last])
        return torch.cat([captured[i] for i in self.layer_ids], dim=-1)


def _tiny_classes(spec: str):
    if spec == "tiny-random-hybrid":
        from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

        return Qwen3_5TextConfig, Qwen3_5ForCausalLM, TINY_HYBRID_DEFAULTS
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return Qwen3Config, Qwen3ForCausalLM, TINY_DEFAULTS


def tiny_target(device: str, dtype, seed: int, tiny: dict | None, spec: str = "tiny-random") -> HFModel:
    """A seeded random target: Qwen3 (`tiny-random`) or a Qwen3.5 hybrid (`tiny-random-hybrid`)."""
    config_class, model_class, defaults = _tiny_classes(spec)
    unknown = set(tiny or {}) - set(config_class().to_dict())
    if unknown:
        raise ConfigError(
            f"target.tiny: unknown {config_class.__name__} key(s) {sorted(unknown)}. "
            f"Fix: use {config_class.__name__} fields such as {', '.join(sorted(defaults))}"
        )
    config = config_class(**{**defaults, **(tiny or {})})
    config._attn_implementation = "sdpa"
    # built where it runs, in its dtype (no fp32 host copy at real size), seeded apart from the caller's RNG
    rng_devices = [torch.device(device)] if torch.device(device).type == "cuda" else []
    with torch.random.fork_rng(devices=rng_devices), torch.device(device), _default_dtype(dtype):
        torch.manual_seed(seed)
        model: HFModel = model_class(config)
    return model.to(device=device, dtype=dtype)


@contextlib.contextmanager
def _default_dtype(dtype):
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


# what a damaged model directory raises as transformers or safetensors read it (a file missing or cut
# short, JSON of another shape: an index without its weight_map, a list)
MODEL_DIR_ERRORS = (OSError, ValueError, KeyError, TypeError, SafetensorError)


def model_dir_error(path: str, what: str, exc: Exception, fix: str) -> ConfigError:
    """One line for a model directory that could not be read: what, its first line of why, the fix."""
    return ConfigError(f"target.spec: cannot {what} {path!r}: {in_one_line(exc).rstrip('.')}. Fix: {fix}")


def hf_config(path: str):
    """The model directory's config, checked to be a supported architecture."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
    except MODEL_DIR_ERRORS as exc:
        raise model_dir_error(path, "read the model config in", exc, "check its config.json") from exc
    check_supported(config)
    return config


def _hf_target(path: str, device: str, dtype) -> tuple[HFModel, Any]:
    from transformers import AutoModelForCausalLM

    if not os.path.isdir(path):
        raise ConfigError(
            f"target.spec: {path!r} is neither {' nor '.join(map(repr, TINY_SPECS))} nor a local directory. "
            f"Fix: point it at a downloaded Hugging Face model directory (config.json + weights)"
        )
    hf_config(path)
    try:
        model: HFModel = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
    except MODEL_DIR_ERRORS as exc:
        fix = "check that the directory holds config.json and complete weights"
        raise model_dir_error(path, "load a causal LM from", exc, fix) from exc
    return model.to(device), tokenizer_of(path)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


def tokenizer_of(path: str) -> Any:
    """The model directory's tokenizer, or None; without tokenizer files transformers would build an
    empty one whose pad id 0 became the mask token."""
    if not any(os.path.exists(os.path.join(path, name)) for name in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError):
        return None


def load_target(
    spec: str, device: str, dtype, layer_ids: list[int] | None = None, seed: int = 0, tiny: dict | None = None
) -> TargetModel:
    """The frozen target: a tiny spec (seeded random Qwen3 or Qwen3.5 hybrid) or a local HF model dir."""
    if is_tiny(spec):
        model, tokenizer = tiny_target(device, dtype, seed, tiny, spec), None
    else:
        model, tokenizer = _hf_target(spec, device, dtype)
    fuse_projections(model)  # here, before any thread reads the weights (see its docstring)
    ids = list(layer_ids) if layer_ids is not None else default_layer_ids(len(_decoder_of(model).layers))
    return TargetModel(
        model=model,
        layer_ids=ids,
        tokenizer=tokenizer,
        device=str(device),
        mask_token_id=default_mask_token_id(tokenizer, model.get_input_embeddings().weight.shape[0]),
    )
