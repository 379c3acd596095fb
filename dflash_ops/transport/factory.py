"""Build the transport a target's inventory entry asks for."""
from __future__ import annotations

from ..errors import InputError
from ..model import Target
from .base import Transport
from .local import LocalTransport
from .pct import PctTransport
from .ssh import SshTransport

TRANSPORTS = ("local", "ssh", "pct")


def make_transport(target: Target) -> Transport:
    """A ready (not yet connected) transport for `target`; connections open on first use."""
    kind = target.transport
    if kind == "local":
        return LocalTransport(target.name)
    if kind not in TRANSPORTS:
        raise InputError(f"target {target.name!r}: transport {kind!r} is not one of {', '.join(TRANSPORTS)}")
    if target.ssh is None:
        raise InputError(f"target {target.name!r}: transport {kind} needs an `ssh:` section with at least `host`")
    if kind == "ssh":
        return SshTransport(target.name, target.ssh)
    if target.ctid is None:
        raise InputError(f"target {target.name!r}: transport pct needs `ctid` (the container id from `pct list`)")
    return PctTransport(target.name, target.ssh, target.ctid)
