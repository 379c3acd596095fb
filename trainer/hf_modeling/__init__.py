"""Files copied verbatim into every export: the drafter's Transformers modeling code (no training code).

They must import nothing from `trainer`: an export directory is loaded on its own with
`AutoModel.from_pretrained(export_dir, trust_remote_code=True)`.
"""
