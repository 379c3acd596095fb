"""Your own playbooks: a YAML list of library steps with literal parameters, checked before
anything runs (user.py; what a step takes, read from its signature: signature.py) and run on the
same runner as the built-in commands (dflash_ops.act.runner)."""
