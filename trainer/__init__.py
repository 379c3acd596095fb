"""DFlash drafter trainer. Deployed into the container by dflash-ops; imports nothing from it.

Keep this file free of heavy imports: `trainer.metrics_format` is read by the ops side without torch.
"""
