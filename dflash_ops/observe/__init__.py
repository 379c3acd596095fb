"""Watching a job: one probe round trip per node (probe.py; check.py turns it into a verdict and
a status, job_check.py a job's nodes into one verdict), the health verdict and its Nagios line
(health.py, budget.py for the time it may take), status for people and for --json (status.py: a
target's TargetStatus, built from the probe report; job_status.py: a multinode job's;
status_output.py prints them as text and JSON), the GPUs as nvidia-smi or NVML report them
(gpu.py, gpu_faults.py), and what the trainer's metrics and logs say (logs.py, acceptance.py,
report.py)."""
