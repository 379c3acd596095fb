"""The chat-template arguments (e.g. {"enable_thinking": false}) that data was rendered with, kept with it.

A drafter trained on answers the target wrote with thinking off learns nothing useful for prompts
rendered with thinking on (z-lab #60/#133). So the arguments travel with the data:
`dflash-train data regenerate` writes them beside its output as `<out>.chat-template.json`; a run
whose data.path has that file renders its conversations with them (data.chat_template_kwargs, unless
set) and so records them in its config, hence in every checkpoint; `dflash-train export` writes
them into serve.json; `dflash-train eval` renders prompts with them by default and warns when told
to use others.
"""

from __future__ import annotations

import json

from trainer.atomic import write_atomic

SUFFIX = ".chat-template.json"
KEY = "chat_template_kwargs"


def side_file(data_path: str) -> str:
    return data_path + SUFFIX


def write_for_data(data_path: str, kwargs: dict) -> None:
    """Record the arguments `data_path` is (being) rendered with."""
    write_atomic(side_file(data_path), json.dumps({KEY: kwargs}, indent=2) + "\n")


def read_for_data(data_path: str | None) -> dict | None:
    """The arguments recorded beside `data_path`, or None (no record, or not readable as one)."""
    return recorded_in(side_file(data_path)) if data_path else None


def recorded_in(path: str) -> dict | None:
    """The arguments a JSON file records under KEY (a data side file, an export's serve.json), or None."""
    try:
        with open(path, encoding="utf-8") as f:
            kwargs = json.load(f).get(KEY)
    except (OSError, ValueError, AttributeError):
        return None
    return kwargs if isinstance(kwargs, dict) else None


def resolve_for_run(cfg) -> None:
    """Fill data.chat_template_kwargs from the data's record when the config leaves it unset."""
    if cfg.data.chat_template_kwargs is None and cfg.data.source == "jsonl":
        cfg.data.chat_template_kwargs = read_for_data(cfg.data.path)


def run_chat_template_kwargs(run_config: dict | None) -> dict | None:
    """What a run's config (a checkpoint's, as a dict) says its data was rendered with."""
    kwargs = ((run_config or {}).get("data") or {}).get(KEY)
    return kwargs if isinstance(kwargs, dict) else None


def differs_warning(trained: dict | None, asked: dict | None) -> str | None:
    """A one-line warning when prompts are rendered with other arguments than the training data."""
    if (trained or {}) == (asked or {}):
        return None
    return (
        f"warning: the drafter's training data was rendered with chat_template_kwargs "
        f"{json.dumps(trained or {})}, these prompts with {json.dumps(asked or {})}: tau measured this "
        f"way can be far below what serving with the training arguments gives"
    )
