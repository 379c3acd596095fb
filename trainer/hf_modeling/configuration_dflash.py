"""Configuration of a DFlash drafter: a Qwen3 config plus the DFlash fields.

Extra fields (beyond Qwen3's):
- block_size: tokens per drafted block ([anchor, MASK x (block_size - 1)]);
- num_target_layers: the target model's layer count;
- dflash_config: {"mask_token_id": id of the MASK token, "target_layer_ids": target layers whose
  hidden states (HF hidden_states[layer_id + 1]) are concatenated into the drafter's context}.
"""

from transformers import Qwen3Config


class DFlashConfig(Qwen3Config):
    def __init__(self, block_size=16, num_target_layers=None, dflash_config=None, **kwargs):
        self.block_size = block_size
        self.num_target_layers = num_target_layers
        self.dflash_config = dict(dflash_config or {})
        super().__init__(**kwargs)

    @property
    def target_layer_ids(self):
        return list(self.dflash_config.get("target_layer_ids", []))

    @property
    def mask_token_id(self):
        return self.dflash_config.get("mask_token_id")
