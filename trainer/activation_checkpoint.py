"""Activation checkpointing of drafter layers (train.activation_checkpointing: layers): each layer
keeps only its inputs and runs again in backward, so the activations of all layers are never held
at once, for one more layer forward per step.

Non-reentrant: it works with the compiled flex_attention inside the layer and with inputs that need
no grad. The recompute goes through compile_lock.carry_step, so a compile it triggers follows the
step's compile lock. RNG state is not saved/restored: the layers draw no random numbers, and
restoring would reset the process-wide generators under the other drafter threads.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from trainer.compile_lock import carry_step


def run_layer(layer: torch.nn.Module, *args, checkpointed: bool):
    """layer(*args), recomputed in backward when `checkpointed` and autograd is recording."""
    if not checkpointed or not torch.is_grad_enabled():
        return layer(*args)
    return checkpoint(carry_step(layer), *args, use_reentrant=False, preserve_rng_state=False)
