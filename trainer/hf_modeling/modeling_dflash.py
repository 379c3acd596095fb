"""DFlash drafter for Transformers: a few Qwen3-style layers conditioned on target hidden states.

Queries come from the block [anchor, MASK x (L-1)], keys/values from [target features ; block]; the
target's embedding and lm_head are used, so the drafter has neither. `spec_generate` decodes with a
Transformers target the way z-lab's published drafters do.
"""

import copy
import inspect
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel

from .configuration_dflash import DFlashConfig


class DFlashRMSNorm(nn.Module):
    """Normalise in fp32, scale in the input dtype (Qwen3)."""

    def __init__(self, dim, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def _inv_freq(config, head_dim, device):
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        theta = float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
        exponents = torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim
        return 1.0 / (theta**exponents), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # scaled RoPE variants

    return ROPE_INIT_FUNCTIONS[rope_type](config, device)


def apply_rope(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


class DFlashAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        hidden = config.hidden_size
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=False)
        self.q_norm = DFlashRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = DFlashRMSNorm(self.head_dim, config.rms_norm_eps)

    def context_kv(self, ctx, cos, sin):
        """Keys (k_norm, RoPE) and values [B, Hkv, T, D] of the positions in ctx [B, T, H]."""
        shape = (*ctx.shape[:2], self.num_kv_heads, self.head_dim)
        k = self.k_norm(self.k_proj(ctx).view(shape)).transpose(1, 2)
        v = self.v_proj(ctx).view(shape).transpose(1, 2)
        return apply_rope(k, cos, sin), v

    def query(self, x, cos, sin):
        """Queries (q_norm, RoPE) [B, Hq, L, D] of the block x [B, L, H]."""
        q = self.q_norm(self.q_proj(x).view(*x.shape[:2], self.num_heads, self.head_dim)).transpose(1, 2)
        return apply_rope(q, cos, sin)

    def forward_cached(self, x, keys, values, cos, sin):
        """The block x [B, L, H] against cached context keys/values, unmasked."""
        k, v = self.context_kv(x, cos, sin)
        k = k if keys is None else torch.cat([keys, k], dim=2)
        v = v if values is None else torch.cat([values, v], dim=2)
        out = F.scaled_dot_product_attention(self.query(x, cos, sin), k, v, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).flatten(2))

    def forward(self, x, ctx, cos, sin, attention_mask):
        q_len = x.shape[1]
        q = self.query(x, cos[:, :, -q_len:], sin[:, :, -q_len:])  # queries: the block positions
        k, v = self.context_kv(torch.cat([ctx, x], dim=1), cos, sin)  # keys over [ctx ; block]
        group = self.num_heads // self.num_kv_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask)
        return self.o_proj(out.transpose(1, 2).flatten(2))


class DFlashMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DFlashDecoderLayer(nn.Module):
    attention_class = DFlashAttention  # a subclass may bring another forward over the same weights

    def __init__(self, config):
        super().__init__()
        self.input_layernorm = DFlashRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = self.attention_class(config)
        self.post_attention_layernorm = DFlashRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = DFlashMLP(config)

    def forward(self, x, *attention_args):  # DFlashAttention's: ctx, cos, sin, attention_mask
        x = x + self.self_attn(self.input_layernorm(x), *attention_args)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_cached(self, x, keys, values, cos, sin):
        x = x + self.self_attn.forward_cached(self.input_layernorm(x), keys, values, cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDraftModel(PreTrainedModel):
    config_class = DFlashConfig
    base_model_prefix = "dflash"
    _no_split_modules = ["DFlashDecoderLayer"]

    def __init__(self, config):
        super().__init__(config)
        hidden = config.hidden_size
        self.fc = nn.Linear(len(config.dflash_config["target_layer_ids"]) * hidden, hidden, bias=False)
        self.hidden_norm = DFlashRMSNorm(hidden, config.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashDecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = DFlashRMSNorm(hidden, config.rms_norm_eps)
        self.post_init()

    def forward(self, target_hidden, noise_embedding, position_ids=None, attention_mask=None, **kwargs):
        """Hidden states [B, L, H] of the block from target_hidden [B, T, K*H] and noise_embedding
        [B, L, H]; position_ids [B, T+L] default 0..T+L-1; attention_mask None sees everything."""
        dtype = self.fc.weight.dtype
        ctx = self.hidden_norm(self.fc(target_hidden.to(dtype)))
        x = noise_embedding.to(dtype)
        if position_ids is None:
            position_ids = torch.arange(ctx.shape[1] + x.shape[1], device=x.device).expand(x.shape[0], -1)
        cos, sin = self.rope(position_ids)
        for layer in self.layers:
            x = layer(x, ctx, cos, sin, attention_mask)
        return self.norm(x)

    def rope(self, position_ids):
        """cos, sin [B, 1, N, head_dim] for positions [B, N], in the weights' dtype."""
        head_dim = self.layers[0].self_attn.head_dim
        inv_freq, scaling = _inv_freq(self.config, head_dim, position_ids.device)
        freqs = position_ids.float().unsqueeze(-1) * inv_freq.float()
        angles = torch.cat([freqs, freqs], dim=-1).unsqueeze(1)
        dtype = self.fc.weight.dtype
        return (angles.cos() * scaling).to(dtype), (angles.sin() * scaling).to(dtype)

    @torch.no_grad()
    def spec_generate(
        self,
        target,
        input_ids,
        max_new_tokens,
        stop_token_ids=None,
        temperature=0.0,
        top_p=1.0,
        top_k=0,
        return_stats=False,
    ):
        """Speculative decoding of `input_ids` [1, T] with a Transformers causal LM: output_ids [1, T + new],
        or with return_stats a namespace adding acceptance_lengths and accepted per round.

        Each round drafts one block in one drafter forward, verifies it in one target forward and keeps
        the drafts equal to the target's own (sampled when temperature > 0) tokens plus its next one, so
        every token is the target's.
        """
        self.eval()
        device = target.get_input_embeddings().weight.device
        input_ids = input_ids.to(device)
        if input_ids.dim() != 2 or input_ids.shape[0] != 1:
            raise ValueError(
                f"spec_generate decodes one sequence: input_ids must be [1, T], got {tuple(input_ids.shape)}"
            )
        stops = {int(t) for t in (stop_token_ids or [])}
        # sampling draws from torch's global RNG, as HF generate does
        run = _Speculation(self, target, lambda logits: pick(logits, temperature, top_p, top_k))
        tokens = run.prefill(input_ids)
        accepted = []
        stopped = tokens[-1] in stops
        while len(tokens) < max_new_tokens and not stopped:
            n, kept = run.round(tokens[-1])
            accepted.append(n)
            tokens += kept  # n drafts equal to the target's tokens, then its bonus token
            stopped = bool(stops.intersection(kept))
        tokens = finish(tokens, max_new_tokens, stops)
        new_ids = torch.tensor([tokens], dtype=input_ids.dtype, device=device)
        output_ids = torch.cat([input_ids, new_ids], dim=1)
        if not return_stats:
            return output_ids
        return SimpleNamespace(
            output_ids=output_ids,
            num_input_tokens=input_ids.shape[1],
            num_output_tokens=len(tokens),
            acceptance_lengths=[n + 1 for n in accepted],
            accepted=accepted,
        )


class _Speculation:
    """One sequence's target cache, drafter context and next anchor position."""

    def __init__(self, drafter, target, pick):
        config = drafter.config
        self.drafter, self.target, self.pick = drafter, target, pick
        self.block = int(config.block_size)
        self.mask_id = int(config.dflash_config["mask_token_id"])
        self.layer_ids = list(config.dflash_config["target_layer_ids"])
        self.embed, self.head = target.get_input_embeddings(), target.get_output_embeddings()
        self.cache = new_cache(target)
        self.rollback = _rollback_supported(self.cache)
        self.cache_arg = cache_argument(target)
        self.context = DraftContext(drafter)
        self.start = 0

    def _verify(self, ids):
        return self.target(
            input_ids=ids, use_cache=True, output_hidden_states=True, **{self.cache_arg: self.cache}
        )

    def prefill(self, input_ids) -> list:
        """The prompt through the target: its first token; the prompt's features become the context."""
        out = self._verify(input_ids)
        self.context.extend(target_features(out.hidden_states, self.layer_ids), 0)
        self.start = input_ids.shape[1]
        return [int(self.pick(out.logits[0, -1:])[0])]

    def round(self, anchor: int):
        """Draft a block after `anchor`, verify it: (drafts accepted, the tokens emitted)."""
        block_ids = torch.full((1, self.block), self.mask_id, device=self.embed.weight.device)  # int64
        block_ids[0, 0] = anchor
        hidden = self.context.draft(self.embed(block_ids), self.start)
        drafts = self.head(hidden[:, 1:]).argmax(dim=-1)[0]
        block_ids[0, 1:] = drafts
        saved = None if self.rollback else copy.deepcopy(self.cache)
        out = self._verify(block_ids)
        verified = self.pick(out.logits[0]).tolist()  # the target's token after each block position
        n = next((i for i, token in enumerate(drafts.tolist()) if token != verified[i]), self.block - 1)
        features = target_features(out.hidden_states, self.layer_ids)[:, : n + 1]
        if self.rollback:
            crop(self.cache, self.start + n + 1)
        else:  # back to the state before the verify, then exactly the accepted tokens
            self.cache = saved
            features = target_features(self._verify(block_ids[:, : n + 1]).hidden_states, self.layer_ids)
        self.context.extend(features, self.start)
        self.start += n + 1
        return n, verified[: n + 1]


class DraftContext:
    """Per drafter layer, the cached keys/values of the context positions (one sequence)."""

    def __init__(self, model):
        self.model = model
        self.keys = [None] * len(model.layers)
        self.values = [None] * len(model.layers)

    def extend(self, features, first_position):
        """Append target features [1, T, K*H] of positions first_position.. to the cache."""
        m = self.model
        ctx = m.hidden_norm(m.fc(features.to(m.fc.weight.dtype)))
        cos, sin = _rope_from(m, first_position, ctx)
        for i, layer in enumerate(m.layers):
            k, v = layer.self_attn.context_kv(ctx, cos, sin)
            self.keys[i] = k if self.keys[i] is None else torch.cat([self.keys[i], k], dim=2)
            self.values[i] = v if self.values[i] is None else torch.cat([self.values[i], v], dim=2)

    def draft(self, block_embedding, anchor_position):
        """Final hidden states [1, B, H] of the block whose anchor sits at `anchor_position`."""
        m = self.model
        x = block_embedding.to(m.fc.weight.dtype)
        cos, sin = _rope_from(m, anchor_position, x)
        for i, layer in enumerate(m.layers):
            x = layer.forward_cached(x, self.keys[i], self.values[i], cos, sin)
        return m.norm(x)


def _rope_from(model, first_position, x):
    """cos, sin for the positions of x [1, N, H], the first at first_position."""
    return model.rope(torch.arange(first_position, first_position + x.shape[1], device=x.device)[None])


def target_features(hidden_states, layer_ids):
    """[1, T, K*H]: HF hidden_states[layer + 1] (index 0 is the embedding output) per target layer."""
    return torch.cat([hidden_states[layer + 1] for layer in layer_ids], dim=-1)


def pick(logits, temperature, top_p=1.0, top_k=0, generator=None):
    """Tokens [N] from logits [N, V]: argmax at temperature 0, else a sample (from `generator` if given)."""
    if temperature <= 0:
        return logits.argmax(dim=-1)
    scores = logits.float() / temperature
    if 0 < top_k < scores.shape[-1]:
        kth = scores.topk(top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if top_p < 1.0:
        ordered, order = probs.sort(dim=-1, descending=True)
        keep = ordered.cumsum(dim=-1) - ordered < top_p  # the smallest prefix reaching top_p
        probs = torch.zeros_like(probs).scatter(-1, order, ordered * keep)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def finish(tokens, max_new_tokens, stops):
    tokens = tokens[:max_new_tokens]
    return tokens[: next((i + 1 for i, token in enumerate(tokens) if token in stops), len(tokens))]


def cache_argument(target):
    """The name the target's forward takes its cache by (newer transformers: `cache`)."""
    return "cache" if "cache" in inspect.signature(type(target).forward).parameters else "past_key_values"


def new_cache(target):
    """A DynamicCache for the target (its hybrid layer types when it has them)."""
    from transformers import DynamicCache

    try:
        return DynamicCache(config=target.config)
    except TypeError:  # older transformers: no config argument
        return DynamicCache()


def _rollback_supported(cache):
    """Whether the cache can be cropped back: not with a recurrent layer (Gated DeltaNet)."""
    return not any(hasattr(layer, "recurrent_states") for layer in getattr(cache, "layers", None) or [])


def crop(cache, length):
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)
