"""`dflash-train` and its subcommands (main.py: train and export; data.py, eval.py, report.py),
with one mapping of input errors to exit codes (errors.py)."""
