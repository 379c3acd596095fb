"""Activation checkpointing of drafter layers (train.activation_checkpointing: layers).

Each decoder layer keeps only its inputs during the forward and runs again inside backward to
rebuild what its gradients need: less memory (the attention and MLP activations of all layers are
never held at once) for one more layer forward per step.

Non-reentrant torch.utils.checkpoint: it works with the compiled flex_attention inside the layer
and with inputs that do not require grad. The recompute goes through compile_lock.carry_step, so
a compile it triggers belongs to the step and follows the compile lock (see trainer.compile_lock).
RNG state is not saved and restored: the layers draw no random numbers, and restoring would reset
the process-wide generators under the other drafter threads.
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
