"""The job itself, the ground every other room stands on: what it is (model.py: the inventory's typed
job and target), where its files are on the target (jobpaths.py), its recorded state (jobstate.py),
its lock (joblock.py), its tmux session (tmux.py), its launch line and how its ranks fail
(torchrun.py), the cache guard (cache_guard.py) and the auto-relaunch budget (relaunch_guard.py)."""
