"""Watching a job: one probe round trip per target (probe.py; check.py turns it into a verdict and
a status), the health verdict and its Nagios line (health.py, budget.py for the time it may take),
status for people and for --json (status.py builds a target's TargetStatus, target_status.py, from
the probe report; its parts are gpu_rows.py, session_status.py and training_status.py; a multinode
job's is job_status.py; status_output.py prints them), the GPUs as nvidia-smi or NVML report them
(gpu.py, gpu_faults.py), and what the trainer's metrics and logs say (logs.py, acceptance.py,
report.py)."""
