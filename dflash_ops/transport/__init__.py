"""Transports: local, ssh and pct; import each from its module (local must not pay for paramiko)."""
