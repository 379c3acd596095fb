"""Acting on a job: the steps, how they run, and the phases of a job of one or more nodes."""
