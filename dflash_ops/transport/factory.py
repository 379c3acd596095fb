"""Build the transport a target's inventory entry asks for."""

from __future__ import annotations

import contextlib
from typing import Iterator

from dflash_ops.job.model import Target
from dflash_ops.transport.base import Transport


def make_transport(target: Target) -> Transport:
    """A transport for `target`, connecting on first use; fabric is imported only for ssh targets."""
    if target.transport == "local":
        from dflash_ops.transport.local import LocalTransport

        return LocalTransport(target.name)
    assert target.ssh is not None, f"target {target.name!r} did not come from the inventory"
    if target.transport == "ssh":
        from dflash_ops.transport.ssh import SshTransport

        return SshTransport(target.name, target.ssh)
    assert target.ctid is not None, f"target {target.name!r} did not come from the inventory"
    from dflash_ops.transport.pct import PctTransport

    return PctTransport(target.name, target.ssh, target.ctid)


@contextlib.contextmanager
def connect(target: Target) -> Iterator:
    transport = make_transport(target)
    try:
        yield transport
    finally:
        transport.close()
