"""The inventory: where jobs run, how to reach them, and the job each runs (load.py reads the file;
layers/rules/target check it field by field; dflash_ops.job.model holds the typed result; multinode.py the
jobs that span several targets)."""
