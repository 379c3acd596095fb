"""The playbooks behind built-in commands (relaunch, stop, ...): which file runs, and whether a
user's file that shadows the shipped one still declares the options the command's flags set."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Mapping, Sequence

from ..errors import InputError
from .document import Playbook
from .registry import StepRegistry
from .search import SHIPPED_PLAYBOOKS, load_playbook


@dataclasses.dataclass(frozen=True)
class Loaded:
    playbook: Playbook
    shipped: Path | None  # the built-in file of that name, if there is one
    warnings: tuple[str, ...] = ()

    @property
    def shadowed(self) -> bool:
        """True when a user's file of the same name runs instead of the shipped one."""
        return self.shipped is not None and Path(self.playbook.source).resolve() != self.shipped.resolve()

    def describe(self) -> str:
        """`ran /etc/dflash/playbooks/relaunch.yaml (shadows the built-in one)`."""
        return f"ran {self.playbook.source}" + (" (shadows the built-in one)" if self.shadowed else "")


def load_builtin(
    name: str,
    search_dirs: Sequence[str | Path],
    flags: Mapping[str, str],
    given: Mapping[str, Any] | None = None,
    registry: StepRegistry | None = None,
) -> Loaded:
    """The playbook built-in command `name` runs. `flags` maps each option the command binds to
    its flag (purge -> --no-purge). A shadowing file without one of those options is refused
    when that flag is given, and warned about otherwise (the flag would be refused)."""
    shipped = SHIPPED_PLAYBOOKS / f"{name}.yaml"
    loaded = Loaded(load_playbook(name, search_dirs, registry), shipped if shipped.is_file() else None)
    if not loaded.shadowed:
        return loaded
    source = loaded.playbook.source
    missing = [option for option in flags if option not in loaded.playbook.options]
    refused = [option for option in missing if (given or {}).get(option) is not None]
    if refused:
        listed = ", ".join(f"{flags[o]} (option {o!r})" for o in refused)
        raise InputError(
            f"{listed}: playbook {source} shadows the built-in {loaded.shipped} but does not "
            "declare that option; declare it under options: as the built-in does, or drop the flag"
        )
    if missing:
        listed = ", ".join(flags[o] for o in missing)
        return dataclasses.replace(
            loaded,
            warnings=(
                f"warning: playbook {source} shadows the built-in {loaded.shipped} and lacks the options "
                f"behind {listed}; those flags would be refused",
            ),
        )
    return loaded
