"""Training: the one loop (loop.py) over a world of drafter replicas (world.py: threads;
distributed.py: torchrun ranks), the workers and their compile lock, checkpoints, metrics and the
trackers fed from them, and how a run stops (shutdown.py, stop_watchdog.py)."""
