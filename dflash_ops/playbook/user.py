"""Your own playbooks: library steps with literal parameters, run in order on one target. A step gets
earlier results by its parameter's type; `when:` tests `options.NAME` or `not options.NAME`."""

from __future__ import annotations

import copy
import dataclasses
import re
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import yaml

from trainer.typed_yaml import did_you_mean

from dflash_ops.errors import InputError
from dflash_ops.inventory.strict_yaml import parse_yaml
from dflash_ops.act.context import StepContext, StepOutcome
from dflash_ops.act.runner import OnProgress, Run, RunResult
from dflash_ops.playbook.signature import Inputs, describe, fits, inputs_of, type_name

Library = Mapping[str, Callable[..., Any]]  # step name -> step function
_WHEN = re.compile(r"(not )?options\.(\w+)")


@dataclasses.dataclass(frozen=True)
class Entry:
    number: int
    step: str
    params: Mapping[str, Any]
    line: int
    inputs: Inputs
    when: str = ""  # "options.NAME" or "not options.NAME"; "" always runs

    def runs(self, options: Mapping[str, Any]) -> bool:
        negate, _, name = self.when.rpartition("options.")
        return not self.when or bool(options[name]) != bool(negate)


@dataclasses.dataclass(frozen=True)
class Playbook:
    name: str
    source: str
    description: str
    options: Mapping[str, bool | int | float | str]  # name -> default
    steps: tuple[Entry, ...]


def load(name_or_path: str, dirs: Sequence[Path], library: Library) -> Playbook:
    """A playbook by name (first of `dirs` with NAME.yaml) or path, checked against `library`."""
    path = find(name_or_path, dirs)
    source = str(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"{source}: cannot read it ({e}); give a readable UTF-8 file") from None
    data = parse_yaml(text, source)
    if not isinstance(data, dict) or set(data) - {"description", "options", "steps"}:
        raise InputError(
            f"{source}: write `steps:` (and `description:`, `options:`); see playbooks/README.md"
        )
    steps, options = data.get("steps"), data.get("options") or {}
    if not isinstance(steps, list) or not steps:
        raise InputError(f"{source}: `steps:` must be a list of one step or more")
    if not isinstance(options, dict) or any(type(v) not in (bool, int, float, str) for v in options.values()):
        raise InputError(f"{source}: options: write NAME: DEFAULT for each (true, 3, 0.5 or text)")
    node = yaml.compose(text, Loader=yaml.SafeLoader)  # for the line of each step
    assert isinstance(node, yaml.MappingNode)  # parse_yaml read a mapping from the same text
    lines = [item.start_mark.line + 1 for k, v in node.value if k.value == "steps" for item in v.value]
    entries = tuple(_entry(source, i + 1, lines[i], item, library, options) for i, item in enumerate(steps))
    return Playbook(path.stem, source, str(data.get("description", "")), options, entries)


def _entry(source: str, number: int, line: int, item: Any, library: Library, options: Mapping) -> Entry:
    item = {"step": item} if isinstance(item, str) else item
    step = item.get("step") if isinstance(item, dict) else None
    where = f"{source}:{line}: step {number}" + (f" ({step})" if isinstance(step, str) else "")
    if not isinstance(step, str) or set(item) - {"step", "params", "when"}:
        raise InputError(f"{where}: write a step name, or `step: NAME` with `params:` and `when:`")
    if step not in library:
        raise InputError(f"{where}: unknown step{_close(step, library)}; steps: {', '.join(library)}")
    info, params, when = inputs_of(library[step]), item.get("params") or {}, item.get("when", "")
    if not isinstance(params, dict):
        raise InputError(
            f"{where}: params: write NAME: VALUE for each; it takes {describe(step, library[step])}"
        )
    for key, value in params.items():
        if key not in info.literals:
            takes = ", ".join(info.literals) or "no parameters"
            raise InputError(
                f"{where}: unknown parameter {key!r}{_close(key, info.literals)}; it takes {takes}"
            )
        if not fits(value, info.literals[key]):
            raise InputError(
                f"{where}: params.{key}: expected {type_name(info.literals[key])}, got {value!r}"
            )
    for key in sorted(info.required & set(info.literals) - set(params)):
        raise InputError(f"{where}: params.{key} is missing; add `{key}: VALUE` under params:")
    named = _WHEN.fullmatch(when) if isinstance(when, str) else None
    if when and (named is None or named[2] not in options):
        raise InputError(f"{where}: when: write `options.NAME` or `not options.NAME`, NAME under options:")
    return Entry(number, step, params, line, info, when)


def bind_options(book: Playbook, library: Library, given: Mapping[str, Any]) -> dict[str, Any]:
    """The playbook's option defaults overridden by `given`, once each step gets the results it needs."""
    values = dict(book.options)
    for name, value in ((k, v) for k, v in given.items() if v is not None):
        if name not in book.options:
            known = ", ".join(book.options) or "none"
            raise InputError(
                f"option {name!r}: not in {book.source}{_close(name, book.options)}; it has {known}"
            )
        kind = type(book.options[name])
        value = parse_yaml(value, f"--set {name}") if isinstance(value, str) and kind is not str else value
        if not fits(value, kind):
            example = {bool: "true", int: "3", float: "0.5", str: "text"}[kind]
            raise InputError(
                f"option {name!r}: expected {kind.__name__}, got {value!r}; e.g. --set {name}={example}"
            )
        values[name] = kind(value)
    given_types: set[type] = set()
    for entry in (e for e in book.steps if e.runs(values)):
        for param in sorted(entry.inputs.required & set(entry.inputs.results)):
            wanted = entry.inputs.results[param]
            if wanted not in given_types:
                givers = " or ".join(n for n, f in library.items() if inputs_of(f).gives is wanted)
                raise InputError(
                    f"{book.source}:{entry.line}: step {entry.number} ({entry.step}): {param} is what an "
                    f"earlier {givers} step gives, and none runs before it; add one, or the same `when:`"
                )
        if entry.inputs.gives is not None:
            given_types.add(entry.inputs.gives)
    return values


def run_playbook(
    book: Playbook,
    library: Library,
    ctx: StepContext,
    options: Mapping[str, Any],
    on_progress: OnProgress | None = None,
) -> RunResult:
    """Run `book` with bound options (bind_options) where `ctx` acts; the job is the target's."""
    results: dict[type, StepOutcome] = {}
    with Run(book.name, ctx, [e.step for e in book.steps], on_progress, book.source) as run:
        for entry in book.steps:
            if not entry.runs(options):
                negated = entry.when.startswith("not ")
                run.skip(entry.step, f"{entry.when.removeprefix('not ')} is {str(negated).lower()}")
                continue
            taken = {p: results[t] for p, t in entry.inputs.results.items() if t in results}
            job = {entry.inputs.job: ctx.target.job} if entry.inputs.job else {}
            outcome = run(library[entry.step], **copy.deepcopy(dict(entry.params)), **taken, **job)
            if isinstance(outcome, StepOutcome):
                results[type(outcome)] = outcome
    return run.result()


def search_dirs(playbook_dir: str | None, inventory_path: str | None) -> list[Path]:
    """Where playbooks are found by name: --playbook-dir, then playbooks/ next to the inventory."""
    if playbook_dir is not None and not Path(playbook_dir).is_dir():
        raise InputError(
            f"--playbook-dir {playbook_dir}: no such directory; give one holding NAME.yaml files"
        )
    beside = Path(inventory_path).parent / "playbooks" if inventory_path else None
    return [Path(d) for d in (playbook_dir, beside) if d is not None and Path(d).is_dir()]


def list_playbooks(dirs: Sequence[Path]) -> dict[str, Path]:
    """name -> file of every playbook found; the first directory that has a name wins."""
    found: dict[str, Path] = {}
    for path in (p for d in dirs for p in sorted(d.glob("*.yaml"))):
        found.setdefault(path.stem, path)
    return found


def find(name_or_path: str, dirs: Sequence[Path]) -> Path:
    found = list_playbooks(dirs)
    if "/" in name_or_path or name_or_path.endswith(".yaml"):
        found = {name_or_path: Path(name_or_path)} if Path(name_or_path).is_file() else {}
    if name_or_path not in found:
        searched = ", ".join(map(str, dirs)) or "no playbook directory"
        raise InputError(
            f"no playbook {name_or_path!r}{_close(name_or_path, found)}; yours: "
            f"{', '.join(found) or 'none'} (searched {searched}); give a NAME or a path to a .yaml file"
        )
    return found[name_or_path]


def parse_option_assignments(pairs: Iterable[str]) -> dict[str, str]:
    """["purge=false", "grace=60"] -> {"purge": "false", "grace": "60"} (typed by bind_options)."""
    out = {}
    for name, sep, value in (pair.partition("=") for pair in pairs):
        if not sep or not name.strip().isidentifier():
            raise InputError(f"--set {name}{sep}{value}: write NAME=VALUE, e.g. --set purge=false")
        out[name.strip()] = value
    return out


def _close(word: str, choices: Iterable[str]) -> str:
    hint = did_you_mean(str(word), choices)
    return f" ({hint})" if hint else ""
