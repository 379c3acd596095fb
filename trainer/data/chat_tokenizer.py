"""A byte-level ChatML tokenizer for the tiny-random target (which ships none), so chat commands run
the real code path on a CPU; ids past the bytes and specials are reserved special tokens."""

from __future__ import annotations

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def chat_tokenizer_of(target, spec: str):
    """The tokenizer chats are rendered with (a tiny spec's: the byte-level ChatML one); regenerate and
    eval both take it from here, so a {"messages"} prompt means the same tokens to both."""
    from trainer.data.target import is_tiny

    if target.tokenizer is None and is_tiny(spec):
        return byte_chat_tokenizer(target.vocab_size)
    return target.tokenizer


def byte_chat_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())  # 256 printable stand-ins for the bytes
    if vocab_size < len(alphabet) + len(SPECIALS):
        raise ValueError(f"a byte tokenizer needs a vocabulary of at least {len(alphabet) + len(SPECIALS)}")
    reserved = [f"<|reserved_{i}|>" for i in range(vocab_size - len(alphabet) - len(SPECIALS))]
    core = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    # added to the core, not through the wrapper's additional_special_tokens: that path checks each
    # token against a list of the others, minutes for a real vocabulary (248,320 ids)
    core.add_special_tokens(SPECIALS + reserved)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token=None, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    tok.chat_template = CHATML
    return tok
