"""Prompts to decode from a JSONL file."""

from __future__ import annotations

from trainer.data.dataset import ROLES, DataError, check_input_ids, jsonl_records, render_chat


def load_prompts(
    path: str,
    tokenizer=None,
    vocab_size: int | None = None,
    chat_template_kwargs: dict | None = None,
    flag: str = "--prompts",
) -> list[list[int]]:
    """`{"input_ids": [...]}` as is, or `{"messages": [...]}` rendered with a generation prompt (a final
    assistant turn, the reference answer, left out); DataError names file:line."""
    prompts = []
    for where, record in jsonl_records(path, "prompts", f"pass an existing .jsonl file to {flag}."):
        if isinstance(record, dict) and "input_ids" in record:
            ids = check_input_ids(record["input_ids"], where)
        elif isinstance(record, dict) and "messages" in record:
            ids = _render_messages(record["messages"], tokenizer, where, chat_template_kwargs)
        else:
            raise DataError(where, 'expected {"messages": [...]} or {"input_ids": [...]}.')
        bad = [t for t in ids if vocab_size is not None and not 0 <= t < vocab_size]
        if bad and vocab_size is not None:  # bad is empty without a vocab_size
            raise DataError(
                where,
                f"token {bad[0]} is outside the target's vocabulary "
                f"(0..{vocab_size - 1}). Fix: tokenize with the target's tokenizer.",
            )
        prompts.append(ids)
    if not prompts:
        raise DataError(path, "no prompts. Fix: one JSON object per line.")
    return prompts


def _render_messages(messages, tokenizer, where: str, chat_template_kwargs: dict | None = None) -> list[int]:
    if tokenizer is None or getattr(tokenizer, "chat_template", None) is None:
        raise DataError(
            where,
            "record has messages, but the target has no tokenizer with a chat template. "
            'Fix: give prompts as {"input_ids": [...]}.',
        )
    well_formed = isinstance(messages, list) and all(
        isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str) for m in messages
    )
    if not messages or not well_formed:
        raise DataError(
            where,
            f'messages must be a non-empty list of {{"role": one of {"/".join(ROLES)}, "content": string}}.',
        )
    if messages[-1]["role"] == "assistant":
        messages = messages[:-1]
    if not messages:
        raise DataError(where, "only an assistant turn: nothing to prompt with.")
    return render_chat(tokenizer, messages, True, chat_template_kwargs)
