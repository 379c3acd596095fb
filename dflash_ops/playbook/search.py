"""Finding playbooks by name along the search path, and loading one."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping, Sequence

from ..errors import InputError
from .binding import validate_playbook
from .document import Playbook, parse_playbook
from .registry import StepRegistry
from .typecheck import did_you_mean

ENV_PLAYBOOK_DIRS = "DFLASH_OPS_PLAYBOOKS"
# The built-in playbooks are package data (dflash_ops/playbooks/*.yaml), next to the step library
# they are written for, so every install has them; the top-level playbooks/ folder of a checkout
# is a place for the user's own files.
SHIPPED_PLAYBOOKS = Path(__file__).resolve().parent.parent / "playbooks"


def playbook_search_dirs(
    playbook_dir: str | os.PathLike | Sequence[str | os.PathLike] | None = None,
    inventory_path: str | os.PathLike | None = None,
    environ: Mapping[str, str] | None = None,
) -> list[Path]:
    """Where playbooks are looked up by name, first match wins: --playbook-dir, $DFLASH_OPS_PLAYBOOKS
    (os.pathsep-separated), <inventory's dir>/playbooks, then the playbooks shipped with dflash-ops.
    A directory the user named explicitly must exist."""
    environ = os.environ if environ is None else environ
    explicit = [playbook_dir] if isinstance(playbook_dir, (str, os.PathLike)) else list(playbook_dir or [])
    dirs: list[Path] = []
    for d in explicit:
        if not Path(d).is_dir():
            raise InputError(
                f"--playbook-dir {d}: no such directory; give a directory holding NAME.yaml files"
            )
    dirs += [Path(d) for d in explicit]
    for d in filter(None, environ.get(ENV_PLAYBOOK_DIRS, "").split(os.pathsep)):
        if not Path(d).is_dir():
            raise InputError(f"${ENV_PLAYBOOK_DIRS}: {d} is not a directory; fix or unset the variable")
        dirs.append(Path(d))
    if inventory_path is not None and (Path(inventory_path).parent / "playbooks").is_dir():
        dirs.append(Path(inventory_path).parent / "playbooks")
    dirs.append(SHIPPED_PLAYBOOKS)
    unique: list[Path] = []
    for d in dirs:
        if d.resolve() not in [u.resolve() for u in unique]:
            unique.append(d)
    return unique


def list_playbooks(search_dirs: Sequence[str | os.PathLike]) -> dict[str, Path]:
    """name -> file of every playbook found; an earlier directory shadows a later one."""
    found: dict[str, Path] = {}
    for d in search_dirs:
        if Path(d).is_dir():
            for path in sorted(Path(d).iterdir()):
                if path.suffix in (".yaml", ".yml") and path.is_file():
                    found.setdefault(path.stem, path)
    return found


def load_playbook(
    name_or_path: str | os.PathLike,
    search_dirs: Sequence[str | os.PathLike] | None = None,
    registry: StepRegistry | None = None,
) -> Playbook:
    """A playbook by name (searched in `search_dirs`, default `playbook_search_dirs()`) or by path;
    checked against `registry` too when one is given."""
    text_name = os.fspath(name_or_path)
    looks_like_path = "/" in text_name or os.sep in text_name or text_name.endswith((".yaml", ".yml"))
    if looks_like_path:
        path = Path(text_name)
        if not path.is_file():
            raise InputError(
                f"playbook file {text_name} not found; give an existing .yaml file or a playbook name"
            )
    else:
        dirs = playbook_search_dirs() if search_dirs is None else search_dirs
        available = list_playbooks(dirs)
        if text_name not in available:
            names = ", ".join(sorted(available)) or "none"
            raise InputError(
                f"no playbook named {text_name!r}{did_you_mean(text_name, available)}; "
                f"available: {names} (searched {', '.join(str(d) for d in dirs)})"
            )
        path = available[text_name]
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"playbook {path}: cannot read it: {e}") from None
    playbook = parse_playbook(text, str(path), path.stem)
    if registry is not None:
        validate_playbook(playbook, registry)
    return playbook
