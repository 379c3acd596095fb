"""The drafter's Transformers code, copied into every export; it imports nothing from `trainer`, as
an export directory loads on its own (`AutoModel.from_pretrained(dir, trust_remote_code=True)`)."""
