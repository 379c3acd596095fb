"""Regenerate the assistant turns of a chat dataset with the target itself.

The drafter learns to predict the TARGET, so answers by another model teach it the wrong
distribution. Output is exactly-once: each chunk is fsynced, then `<out>.progress.json` records the
next line and file sizes atomically; `--resume` truncates to them and continues.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TextIO

import torch

from trainer.atomic import write_atomic
from trainer.data import generation_memory
from trainer.data.dataset import DataError, derive_seed, render_chat
from trainer.progress import ProgressLine
from trainer.template_args import write_for_data

KEPT_ROLES = ("system", "user")
PROMPT_GUESS = 1024  # prompt tokens assumed when sizing how many records a chunk reads
# the committed counters (the progress file's "stats"); "seen" counts records and rejects alike
STATS = ("records", "turns", "new_tokens", "prompt_tokens", "rejects", "truncated", "seen")


@dataclasses.dataclass
class RegenerateOptions:
    target: str
    input: str
    output: str
    max_new_tokens: int = 2048
    max_prompt_tokens: int | None = None
    temperature: float = 0.0
    top_p: float = 1.0
    batch_size: int | None = None  # None: sized from the device's free memory (generation_memory)
    devices: list[str] = dataclasses.field(default_factory=lambda: ["cpu"])
    chat_template_kwargs: dict = dataclasses.field(default_factory=dict)
    seed: int = 0
    resume: bool = False
    progress_every_s: float = 30.0
    tiny: dict = dataclasses.field(default_factory=dict)  # a tiny spec's overrides (target.tiny)

    def settings(self) -> dict:
        """What shapes the output: a resumed run must use the same (devices and batch size may change)."""
        as_given = "max_new_tokens max_prompt_tokens temperature top_p chat_template_kwargs seed".split()
        return {
            "target": self.target,
            "input": os.path.abspath(self.input),
            "input_bytes": os.path.getsize(self.input),
            **{name: getattr(self, name) for name in as_given},
            **({"tiny": self.tiny} if self.tiny else {}),
        }


class Reject(Exception):
    """A record that cannot be regenerated; the message is the reason written to the rejects file."""


@dataclasses.dataclass
class Conversation:
    record: dict  # the input record (other keys are kept in the output)
    messages: list[dict]  # output messages; assistant slots filled as they are generated
    slots: list[int]  # indices in `messages` the target answers, in order
    done: int = 0  # slots filled so far
    new_tokens: int = 0
    prompt_tokens: int = 0
    truncated: int = 0


def parse_record(line: str) -> Conversation:
    try:
        line.encode("utf-8")  # _lines kept a byte that is not UTF-8 as a lone surrogate
    except UnicodeEncodeError as exc:
        raise Reject(f"not UTF-8 text (a byte at offset {exc.start})") from None
    try:
        record = json.loads(line.rstrip("\r\n"))  # without its line end, the column is the real one
    except json.JSONDecodeError as exc:
        raise Reject(f"not valid JSON ({exc.msg} at column {exc.colno})") from None
    messages = record.get("messages") if isinstance(record, dict) else None
    if not isinstance(messages, list) or not messages:
        raise Reject("no `messages` list")
    out: list[dict[str, Any]] = []
    slots: list[int] = []
    seen_user = False
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("content", ""), str):
            raise Reject(f'bad message: messages[{i}] must be {{"role", "content": string}}')
        role = m.get("role")
        if role == "assistant":
            if not seen_user:
                raise Reject(f"bad roles: messages[{i}] is an assistant turn before any user turn")
            slots.append(len(out))
            out.append({"role": "assistant", "content": None})
        elif role in KEPT_ROLES:
            seen_user = seen_user or role == "user"
            out.append({"role": role, "content": m.get("content", "")})
        else:
            raise Reject(
                f"bad roles: messages[{i}] has role {role!r}; only system/user/assistant can be regenerated"
            )
    if not seen_user:
        raise Reject("bad roles: no user turn")
    if out[-1]["role"] == "user":  # the target answers a trailing question too
        slots.append(len(out))
        out.append({"role": "assistant", "content": None})
    return Conversation(record, out, slots)


class Generator:
    """One target copy on one device, answering batches of conversations turn by turn."""

    def __init__(self, spec: str, device: str, opts: RegenerateOptions):
        from trainer.data.chat_tokenizer import chat_tokenizer_of
        from trainer.data.target import load_target

        dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
        target = load_target(spec, device, dtype, layer_ids=[0], seed=0, tiny=opts.tiny or None)
        # the HF causal LM and its tokenizer, duck-typed (generate, generation_config, chat template)
        self.model: Any = target.model
        self.device, self.opts = device, opts
        self.config, self.dtype_bytes = target.config, torch.finfo(dtype).bits // 8
        auto_on_gpu = opts.batch_size is None and device.startswith("cuda")
        self.free_bytes = torch.cuda.mem_get_info(torch.device(device))[0] if auto_on_gpu else None
        self.largest_batch = 0
        self.tokenizer: Any = chat_tokenizer_of(target, spec)
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise DataError(
                spec,
                "the target has no tokenizer with a chat template. Fix: use a model directory "
                "whose tokenizer_config.json has a chat_template.",
            )
        eos = {self.tokenizer.eos_token_id}
        configured = getattr(getattr(self.model, "generation_config", None), "eos_token_id", None)
        eos.update(configured if isinstance(configured, list) else [configured])
        self.eos_ids = sorted(e for e in eos if e is not None)
        pad = self.tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else self.eos_ids[0]
        context = getattr(self.model.config, "max_position_embeddings", None)
        self.max_prompt = opts.max_prompt_tokens or (context - opts.max_new_tokens if context else None)
        if self.max_prompt is not None and self.max_prompt < 1:
            raise DataError(
                "--max-new-tokens",
                f"{opts.max_new_tokens} leaves no room for a prompt in the "
                f"target's context of {context}. Fix: lower it.",
            )

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        return render_chat(self.tokenizer, messages, True, self.opts.chat_template_kwargs)

    @torch.no_grad()
    def generate(self, prompts: list[list[int]]) -> list[tuple[list[int], bool]]:
        """(new tokens up to and without the end token, cut at max_new_tokens?) per prompt."""
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        attn = torch.zeros(len(prompts), width, dtype=torch.long)
        for row, prompt in enumerate(prompts):  # left padding: every prompt ends where generation starts
            ids[row, width - len(prompt) :] = torch.tensor(prompt)
            attn[row, width - len(prompt) :] = 1
        sampled = {"do_sample": True, "temperature": self.opts.temperature, "top_p": self.opts.top_p}
        greedy = {"do_sample": False, "temperature": None, "top_p": None, "top_k": None}
        extra = sampled if self.opts.temperature > 0 else greedy
        out = self.model.generate(
            input_ids=ids.to(self.device),
            attention_mask=attn.to(self.device),
            max_new_tokens=self.opts.max_new_tokens,
            pad_token_id=self.pad_id,
            eos_token_id=self.eos_ids,
            use_cache=True,
            **extra,
        )
        rows = out[:, width:].tolist()
        ends = [next((k for k, tok in enumerate(row) if tok in self.eos_ids), None) for row in rows]
        return [(row[:end], end is None) for row, end in zip(rows, ends, strict=True)]

    def batches(self, lengths: list[int]) -> list[slice]:
        """Prompts generated together: --batch-size at a time, else as many as free memory holds."""
        if self.free_bytes is None:
            size = self.opts.batch_size or generation_memory.CPU_BATCH
            return [slice(i, i + size) for i in range(0, len(lengths), size)]
        return generation_memory.split_by_memory(
            lengths, self.opts.max_new_tokens, self.config, self.free_bytes, self.dtype_bytes
        )

    def records_per_chunk(self) -> int:
        """Records this generator takes per committed chunk: one batch of 1k-token prompts."""
        if self.free_bytes is None:
            return self.opts.batch_size or generation_memory.CPU_BATCH
        positions = PROMPT_GUESS + self.opts.max_new_tokens
        return generation_memory.batch_that_fits(
            self.config, positions, PROMPT_GUESS, self.free_bytes, self.dtype_bytes
        )

    def batch_rule(self) -> str:
        if self.opts.batch_size:
            return "--batch-size"
        return "free memory" if self.free_bytes is not None else "CPU default"

    def run(self, items: list[tuple[int, Conversation]]) -> dict[int, Conversation | Reject]:
        results: dict[int, Conversation | Reject] = {}
        active = dict(items)
        while active:
            batch, prompts = [], []
            for index, conv in list(active.items()):
                if conv.done == len(conv.slots):
                    results[index] = active.pop(index)
                    continue
                try:
                    prompt = self.prompt_ids(conv.messages[: conv.slots[conv.done]])
                except Exception as exc:  # noqa: BLE001 - a template that refuses this conversation
                    results[index] = Reject(f"chat template failed: {type(exc).__name__}: {exc}")
                else:
                    if self.max_prompt is None or len(prompt) <= self.max_prompt:
                        batch.append(conv)
                        prompts.append(prompt)
                        continue
                    results[index] = Reject(
                        f"too long: the prompt of assistant turn {conv.done + 1} has "
                        f"{len(prompt)} tokens, more than {self.max_prompt}"
                    )
                active.pop(index)
            for chunk in self.batches([len(p) for p in prompts]):
                self.largest_batch = max(self.largest_batch, len(prompts[chunk]))
                for conv, prompt, (tokens, cut) in zip(
                    batch[chunk], prompts[chunk], self.generate(prompts[chunk]), strict=True
                ):
                    conv.messages[conv.slots[conv.done]]["content"] = self.tokenizer.decode(
                        tokens, skip_special_tokens=True
                    )
                    conv.done += 1
                    conv.new_tokens += len(tokens)
                    conv.prompt_tokens += len(prompt)
                    conv.truncated += int(cut)
        return results


def _progress_path(output: str) -> str:
    return output + ".progress.json"


def rejects_path(output: str) -> str:
    return output + ".rejects.jsonl"


def _start_state(opts: RegenerateOptions) -> dict:
    """The committed state to continue from (nothing is written yet: _open_outputs does)."""
    progress_file, settings = _progress_path(opts.output), opts.settings()
    exists = [p for p in (opts.output, rejects_path(opts.output), progress_file) if os.path.exists(p)]
    if opts.resume and os.path.exists(progress_file):
        try:
            with open(progress_file, encoding="utf-8") as f:
                state = json.load(f)
            was = dict(state["settings"])
            if not {"next_line", "out_bytes", "rejects_bytes", "stats"} <= set(state):
                raise KeyError("next_line, out_bytes, rejects_bytes or stats")
        except (OSError, ValueError, KeyError, TypeError) as exc:
            why = f"unreadable ({type(exc).__name__}: {exc})"
            raise DataError(progress_file, f"{why}. Fix: remove the files to start over.") from None
        differ = sorted(k for k in set(settings) | set(was) if settings.get(k) != was.get(k))
        if differ:
            raise DataError(
                opts.output,
                "--resume with other settings than the stopped run: "
                + "; ".join(f"{k}: was {was.get(k)!r}, now {settings.get(k)!r}" for k in differ)
                + ". Fix: rerun with the original settings, or start a new --out.",
            )
    elif exists and opts.resume:
        raise DataError(
            opts.output,
            f"exists but has no {os.path.basename(progress_file)}, so where it "
            f"stopped is unknown. Fix: remove it to start over.",
        )
    elif exists:
        raise DataError(
            opts.output,
            f"already exists ({', '.join(exists)}). Fix: add --resume to continue "
            f"that run, or remove the files to start over.",
        )
    else:
        state = {
            "settings": settings,
            "next_line": 0,
            "out_bytes": 0,
            "rejects_bytes": 0,
            "stats": dict.fromkeys(STATS, 0),
        }
    return state


def _open_outputs(opts: RegenerateOptions) -> tuple[dict, list[Generator]]:
    """The state to continue from and the loaded target(s); only then are the output files prepared
    (or truncated to the last commit): bad input or a target that does not load leaves none behind."""
    if not os.path.isfile(opts.input):
        raise DataError(opts.input, 'input file not found. Fix: pass a JSONL of {"messages": [...]} records.')
    if os.path.isdir(opts.output):
        raise DataError(opts.output, "is a directory. Fix: name the output file, e.g. --out DIR/train.jsonl.")
    state = _start_state(opts)
    generators = [Generator(opts.target, device, opts) for device in opts.devices]
    try:
        os.makedirs(os.path.dirname(os.path.abspath(opts.output)), exist_ok=True)
    except OSError as exc:
        raise DataError(
            opts.output, f"cannot create its directory ({exc.strerror}). Fix: another --out."
        ) from None
    write_for_data(opts.output, opts.chat_template_kwargs)  # the arguments travel with the data into the run
    for path, size_key in ((opts.output, "out_bytes"), (rejects_path(opts.output), "rejects_bytes")):
        with open(path, "a+b") as f:  # drop whatever a killed run wrote after its last commit
            f.truncate(state[size_key])
    write_atomic(_progress_path(opts.output), json.dumps(state))
    return state, generators


def _lines(path: str, first: int):
    """(line index, text) of non-blank lines from line index `first`."""
    with open(path, "rb") as f:  # a line that is not UTF-8 is rejected (parse_record), not a crash
        for index, line in enumerate(f):
            if index >= first and line.strip():
                yield index, line.decode("utf-8", "surrogateescape")


def run_summary(committed: dict, first: dict, seconds: float) -> dict:
    """This run's share of the committed stats (a resumed run starts from the stopped run's) and its rates."""
    this_run = {k: committed[k] - first.get(k, 0) for k in ("records", "new_tokens", "rejects", "seen")}
    return dict(
        committed,
        this_run=this_run,
        seconds=seconds,
        new_tokens_per_s=this_run["new_tokens"] / max(seconds, 1e-9),
        records_per_s=this_run["seen"] / max(seconds, 1e-9),
    )


def regenerate(
    opts: RegenerateOptions, out: TextIO | None = None, tty: bool | None = None, report: dict | None = None
) -> dict:
    """Regenerate opts.input into opts.output; returns the summary. `report` holds what is committed
    at every moment, for a caller reporting a run that ends by an exception."""
    report = report if report is not None else {}
    state, generators = _open_outputs(opts)
    stats = state["stats"]
    total = sum(1 for _ in _lines(opts.input, 0))
    first = dict(stats)
    report.update(
        run_summary(stats, first, 0.0),
        total=total,
        output=opts.output,
        rejects_path=rejects_path(opts.output),
    )
    began = time.monotonic()  # rates count generation, not loading the model
    progress = ProgressLine(
        "records", total, done=stats["seen"], out=out, tty=tty, every_s=opts.progress_every_s
    )
    chunk_size = sum(g.records_per_chunk() for g in generators)
    # a chunk can take minutes on a big target: say now what the first progress line waits for
    progress.say(
        f"regenerating {total - stats['seen']} records on {', '.join(opts.devices)}: up to {chunk_size} "
        f"a chunk ({generators[0].batch_rule()}), progress as each chunk is written"
    )
    lines = _lines(opts.input, state["next_line"])
    try:  # generate, write and commit chunk after chunk until the input ends
        with (
            open(opts.output, "ab") as out_file,
            open(rejects_path(opts.output), "ab") as rej_file,
            ThreadPoolExecutor(max_workers=len(generators)) as pool,
        ):
            while chunk := [item for _, item in zip(range(chunk_size), lines, strict=False)]:
                results = _generate_chunk(chunk, generators, pool, opts)
                _write_results(chunk, results, stats, out_file, rej_file)
                _commit(state, chunk[-1][0] + 1, out_file, rej_file, opts.output)
                report.update(
                    run_summary(stats, first, time.monotonic() - began), **_batch_report(generators)
                )
                progress.update(
                    stats["seen"],
                    f"{stats['new_tokens']} new tokens "
                    f"({report['new_tokens_per_s']:.1f}/s), {stats['rejects']} rejected",
                )
    except BaseException:  # a stop can land between the commit and the report: the file is the truth
        committed = _committed_stats(opts.output)
        if committed is not None:
            report.update(run_summary(committed, first, time.monotonic() - began))
        raise
    progress.finish()
    report.update(run_summary(stats, first, time.monotonic() - began), **_batch_report(generators))
    return dict(report)


def _committed_stats(output: str) -> dict | None:
    """The stats the progress file commits; None where it cannot be read (the run's own error stands)."""
    try:
        with open(_progress_path(output), encoding="utf-8") as f:
            return json.load(f)["stats"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _batch_report(generators: list[Generator]) -> dict:
    """The largest batch generated and what sized it."""
    return {"batch": max(g.largest_batch for g in generators), "batch_rule": generators[0].batch_rule()}


def _generate_chunk(
    chunk: list[tuple[int, str]],
    generators: list[Generator],
    pool: ThreadPoolExecutor,
    opts: RegenerateOptions,
) -> dict[int, Conversation | Reject]:
    """Each input line's result by line index: its regenerated conversation, or why it is rejected."""
    results: dict[int, Conversation | Reject] = {}
    if opts.temperature > 0:  # seeded by position: a resumed run samples what the first would have
        torch.manual_seed(derive_seed(opts.seed, chunk[0][0]))
    shares: list[list[tuple[int, Conversation]]] = [[] for _ in generators]
    for n, (index, text) in enumerate(chunk):
        try:
            shares[n % len(generators)].append((index, parse_record(text)))
        except Reject as reason:
            results[index] = reason
    if len(generators) == 1:  # in this thread: CPU torch in a pool thread runs far slower
        results.update(generators[0].run(shares[0]))
    else:
        for part in pool.map(lambda pair: pair[0].run(pair[1]), zip(generators, shares, strict=True)):
            results.update(part)
    return results


def _write_results(
    chunk: list[tuple[int, str]], results: dict[int, Conversation | Reject], stats: dict, out_file, rej_file
) -> None:
    """Append the chunk's records and rejects in input order, counting them into `stats`."""
    for index, text in chunk:
        result = results[index]
        stats["seen"] += 1
        if isinstance(result, Reject):
            stats["rejects"] += 1
            rej_file.write(_jsonl({"line": index + 1, "reason": str(result), "record": text.strip()}))
            continue
        record = dict(result.record)  # parse_record took only JSON objects
        record["messages"] = result.messages
        out_file.write(_jsonl(record))
        stats["records"] += 1
        stats["turns"] += len(result.slots)
        stats["new_tokens"] += result.new_tokens
        stats["prompt_tokens"] += result.prompt_tokens
        stats["truncated"] += result.truncated


def _commit(state: dict, next_line: int, out_file, rej_file, output: str) -> None:
    """Make what is written durable, then record where the next run continues."""
    for file in (out_file, rej_file):
        file.flush()
        os.fsync(file.fileno())
    state.update(next_line=next_line, out_bytes=out_file.tell(), rejects_bytes=rej_file.tell())
    write_atomic(_progress_path(output), json.dumps(state))  # the commit point


def _jsonl(obj) -> bytes:  # a reject's bytes that are not UTF-8 are written back as read
    return (json.dumps(obj, ensure_ascii=False) + "\n").encode("utf-8", "surrogateescape")
