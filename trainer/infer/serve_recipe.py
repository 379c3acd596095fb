"""How to serve an export: the vLLM and SGLang command lines, written beside the weights (SERVE.md for
people, serve.json for tools) and printed at the end of `dflash-train export`.

vLLM takes `num_speculative_tokens` = block_size - 1 (DESIGN.md, "Serving") and its draft attention
backend must support non-causal attention (vllm/config/speculative.py); SGLang takes
`--speculative-num-draft-tokens` = block_size.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
from pathlib import Path

from trainer.atomic import write_atomic

SERVE_DOC = "SERVE.md"
SERVE_JSON = "serve.json"
NON_CAUSAL_BACKEND = "FLASH_ATTN"  # a vLLM attention backend that runs non-causal attention
BUILTIN_TARGETS = ("tiny-random",)  # the trainer's own test targets: no engine can load them


@dataclasses.dataclass(frozen=True)
class ServeRecipe:
    target: str  # the target model the drafter was trained against (a local dir, or a hub name)
    draft: str  # the export directory
    block_size: int
    chat_template_kwargs: dict | None = None  # what the training data was rendered with

    @property
    def vllm_speculative_config(self) -> dict:
        return {"method": "dflash", "model": self.draft, "num_speculative_tokens": self.block_size - 1}

    def vllm_command(self) -> str:
        spec = json.dumps(self.vllm_speculative_config)
        return f"vllm serve {shlex.quote(self.target)} --speculative-config {shlex.quote(spec)}"

    def sglang_command(self) -> str:
        return (
            f"python -m sglang.launch_server --model-path {shlex.quote(self.target)} "
            f"--speculative-algorithm DFLASH --speculative-draft-model-path {shlex.quote(self.draft)} "
            f"--speculative-num-draft-tokens {self.block_size} --trust-remote-code"
        )

    def notes(self) -> list[str]:
        notes = [
            f"vLLM drafts block_size - 1 = {self.block_size - 1} tokens (it does not read block_size); "
            f"SGLang takes the block size, {self.block_size}.",
            "The draft attends both ways within its block: its vLLM attention backend must support "
            f'non-causal attention; if vLLM picks one that does not, add "attention_backend": '
            f'"{NON_CAUSAL_BACKEND}" to the --speculative-config JSON.',
        ]
        if self.chat_template_kwargs:
            kwargs = json.dumps(self.chat_template_kwargs)
            notes.append(
                f"The training data was rendered with chat_template_kwargs {kwargs}: send the same "
                f'with every chat request ("chat_template_kwargs": {kwargs}), or tau drops.'
            )
        if self.target in BUILTIN_TARGETS:
            notes.append(
                f"The target {self.target!r} is the trainer's built-in test model, which no engine can "
                "load: these lines show the form; put a real target's directory in its place."
            )
        return notes

    def lines(self) -> list[str]:
        """The recipe as printed at the end of an export."""
        return [
            "serve it with vLLM:",
            "  " + self.vllm_command(),
            "or with SGLang:",
            "  " + self.sglang_command(),
            *("note: " + note for note in self.notes()),
        ]

    def markdown(self) -> str:
        notes = "\n".join(f"- {note}" for note in self.notes())
        return (
            "# Serve this DFlash drafter\n\n"
            f"Target: `{self.target}`; block size {self.block_size}.\n\n"
            f"vLLM:\n\n```sh\n{self.vllm_command()}\n```\n\n"
            f"SGLang:\n\n```sh\n{self.sglang_command()}\n```\n\n"
            "Transformers (the modeling code ships in this directory):\n\n```python\n"
            "from transformers import AutoModel, AutoModelForCausalLM\n"
            f"target = AutoModelForCausalLM.from_pretrained({self.target!r}, dtype='auto').eval()\n"
            f"draft = AutoModel.from_pretrained({self.draft!r}, trust_remote_code=True,\n"
            "                                  dtype='auto').eval()\n"
            "output_ids = draft.spec_generate(input_ids=input_ids, max_new_tokens=256, temperature=0.0,\n"
            "                                 target=target, stop_token_ids=[eos_id])\n"
            "```\n\n"
            f"{notes}\n"
        )

    def to_dict(self) -> dict:
        return dict(
            dataclasses.asdict(self),
            vllm=self.vllm_command(),
            vllm_speculative_config=self.vllm_speculative_config,
            sglang=self.sglang_command(),
            notes=self.notes(),
        )


def write_recipe(recipe: ServeRecipe, out_dir) -> None:
    out = Path(out_dir)
    write_atomic(str(out / SERVE_DOC), recipe.markdown())
    write_atomic(str(out / SERVE_JSON), json.dumps(recipe.to_dict(), indent=2) + "\n")


def recipe_for_checkpoint(state, out_dir, target: str | None = None):
    """How to serve the export of checkpoint `state` in `out_dir` (trainer.infer.serve_recipe)."""
    from trainer.template_args import run_chat_template_kwargs

    spec = target or ((state.config or {}).get("target") or {}).get("spec") or "TARGET"
    return ServeRecipe(
        # as an engine should find it: a local directory as an absolute path, else as given (a hub
        # name or a built-in test target)
        target=os.path.abspath(spec) if os.path.isdir(spec) else spec,
        draft=os.path.abspath(out_dir),
        block_size=int(state.drafter_config["block_size"]),
        chat_template_kwargs=run_chat_template_kwargs(state.config),
    )
