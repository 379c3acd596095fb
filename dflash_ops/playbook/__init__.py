"""Running steps on one target: a StepContext records every command a step runs (context.py; under
--dry-run nothing reaches the target), a Run runs a plan of steps in order and halts at the first
failure (run.py). The built-in commands are plain Python on a Run (dflash_ops.commands); a user's
playbook is a YAML list of library steps run on one too (user.py, signature.py)."""
