"""`dflash-train` and its subcommands; input errors map to exit codes in one place (errors.py)."""
