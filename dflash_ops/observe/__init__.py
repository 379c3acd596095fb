"""Watching a job: one probe round trip per target (probe.py), the health verdict and its Nagios
line (health.py, budget.py for the time it may take), status for people and for --json
(status.py), and what the trainer's metrics and logs say (logs.py, acceptance.py, report.py)."""
