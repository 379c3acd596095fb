"""dflash-ops: run and babysit DFlash drafter training on a GPU box (local, ssh or Proxmox LXC)."""

__version__ = "0.1.0"
