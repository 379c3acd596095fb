"""Transports: local, ssh (fabric) and pct (ssh to the Proxmox host, then `pct exec`)."""
from .base import Result, Transport  # noqa: F401
