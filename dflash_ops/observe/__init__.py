"""Watching a job: the probe, the health verdict, status, GPUs and what the trainer's output says."""
