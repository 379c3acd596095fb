"""How a training job's processes are started. The trainer's config (`run.launcher`) and the
dflash-ops inventory (`job.launcher`) both take exactly these names. Standard library only, so
dflash-ops can import it without the trainer's dependencies."""

THREADS = "threads"  # one process; the drafter replicas run on threads of it
TORCHRUN = "torchrun"  # one process per rank, started by torchrun (DDP)
LAUNCHERS = (THREADS, TORCHRUN)
DEFAULT_LAUNCHER = THREADS
