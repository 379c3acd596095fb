"""What `status` and `health` print, from status objects (a TargetStatus, or a multinode job's
JobStatus): text for people, and one JSON document for scripts."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Protocol


class Printable(Protocol):
    @property
    def name(self) -> str: ...

    def to_json(self) -> dict: ...

    def to_text(self, color: bool = False) -> str: ...


def status_text(statuses: Sequence[Printable], color: bool = False) -> str:
    """Each status's table ends with its newline: one blank line between them, none after the last."""
    return "\n".join(s.to_text(color) for s in statuses)


def status_json(statuses: Sequence[Printable], indent: int | None = 2) -> str:
    """One object for one status, a list for several."""
    return _document([s.to_json() for s in statuses], indent)


def health_json(statuses: Sequence[Printable], relaunched: Mapping[str, str] | None = None) -> str:
    """`status --json`'s document; with --auto-relaunch (`relaunched` given, by name: what the
    relaunch did) each object adds `auto_relaunch`, null where none was tried."""
    if relaunched is None:
        return _document([s.to_json() for s in statuses], indent=2)
    return _document([dict(s.to_json(), auto_relaunch=relaunched.get(s.name)) for s in statuses], indent=2)


def _document(objects: list[dict], indent: int | None) -> str:
    return json.dumps(objects[0] if len(objects) == 1 else objects, indent=indent)
