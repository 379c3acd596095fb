"""The drafter at inference: the projected context's keys/values cached once, one block per call.

Re-projecting the growing context every round would cost O(length) per round, so `DrafterContext`
keeps each layer's context keys (RoPE at their true positions) and values, and `draft_logits` runs the
block [anchor, MASK...] after them unmasked (what the training mask reproduces). It is the export's
own cache (trainer/hf_modeling's DraftContext) over the drafter's submodules; a test checks it against
the training forward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from trainer.hf_modeling.modeling_dflash import DraftContext
from trainer.model import DFlashDrafter


class DrafterContext:
    """Per-layer cached context keys/values of one sequence (batch 1)."""

    def __init__(self, drafter: DFlashDrafter):
        self.drafter = drafter
        self.cache = DraftContext(drafter)
        self.length = 0  # context positions cached: 0..length-1

    @torch.no_grad()
    def extend(self, features: torch.Tensor) -> None:
        """Append the target features [T, K*H] of the next T positions."""
        count = features.shape[0]
        if count == 0:
            return
        self.cache.extend(features.to(self.drafter.fc.weight.device).unsqueeze(0), self.length)
        self.length += count

    @torch.no_grad()
    def draft_logits(self, anchor_token: int) -> torch.Tensor:
        """[B, V] logits of the block [anchor, MASK x (B-1)] placed right after the cached context (the
        anchor at position `length`): row k predicts position length+k."""
        d, cfg = self.drafter, self.drafter.cfg
        ids = torch.full((1, cfg.block_size), cfg.mask_token_id, dtype=torch.long, device=d.fc.weight.device)
        ids[0, 0] = int(anchor_token)
        return d.logits(self.cache.draft(F.embedding(ids, d.embed_weight), self.length)[0])
