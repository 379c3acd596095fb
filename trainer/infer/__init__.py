"""Inference: speculative decoding with the drafter (static_decode.py: the fast loop;
speculative.py: the reference loop), acceptance length and the lossless check (evaluate.py,
lossless.py, training_eval.py), and the export inference engines load (export.py)."""
