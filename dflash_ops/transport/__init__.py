"""Transports: local, ssh (fabric) and pct (ssh to the Proxmox host, then `pct exec`)."""

from .base import Result, Transport  # noqa: F401
from .factory import make_transport  # noqa: F401
from .local import LocalTransport  # noqa: F401
from .pct import PctTransport  # noqa: F401
from .ssh import SshTransport  # noqa: F401
