"""Inference: speculative decoding with the drafter (static_decode.py: the fast loop;
speculative.py: the reference loop), acceptance length and the lossless check (evaluate.py,
lossless.py; trainer.train.training_eval during training), and the export engines load (export.py)."""
