"""A DFlash drafter's config: Qwen3's plus block_size, num_target_layers and dflash_config
({"mask_token_id", "target_layer_ids": layers whose HF hidden_states[id + 1] form the context})."""

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
