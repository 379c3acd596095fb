"""Transports: local, ssh (fabric) and pct (ssh to the Proxmox host, then `pct exec`).

Names are imported on first use: the local transport must not pay for fabric and paramiko."""

from __future__ import annotations

import importlib

_WHERE = {
    "Result": ".base",
    "Transport": ".base",
    "make_transport": ".factory",
    "LocalTransport": ".local",
    "PctTransport": ".pct",
    "SshTransport": ".ssh",
}
__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_WHERE[name], __name__), name)
