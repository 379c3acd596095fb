"""Transports: local, ssh (fabric) and pct (ssh to the Proxmox host, then `pct exec`).

Import each from its own module: the local transport must not pay for fabric and paramiko."""
