"""A real small LM, end to end through the bundled tools: tau and the speed-up the static loop gives it.

    python benchmarks/real_lm.py --device cuda:0 --work /tmp/real-lm --out $OUT/real-lm.md     (~7 min, H200)
    python benchmarks/real_lm.py --smoke --device cpu --work /tmp/real-lm --out /tmp/real-lm.md  (CPU, ~3 min)

No downloads. Text: the Python sources of the installed packages, split BY PACKAGE (a package's
files are either all training text or all held out; held out: the packages whose name hashes into
the first eighth). Then:
1. a byte-level BPE tokenizer (`tokenizers`, vocab 8192) with a chat template
   (<|user|>...<|end|><|assistant|>...<|end|>), and a ~34M-parameter Qwen3 (8 layers, hidden 512)
   trained from scratch for --lm-seconds on chat-formatted chunks ("continue this code");
2. `dflash-train data regenerate`: the assistant turns of training records replaced by the LM's
   own greedy answers;
3. `dflash-train` trains 3-layer drafters at block 8 and block 16 (both at once on the one GPU,
   compiled flex, bf16-mixed) with tau evaluated during training on held-out prompts;
4. `dflash-train eval --json` on 32 held-out prompts x 128 new tokens, three times per drafter:
   tau both ways, acceptance per position, target-only and speculative tokens/s (same static,
   graph-captured loop, batch 1), the lossless check.
Every stage runs under `timeout -k`; the markdown (+ .json) goes to --out, written after each stage.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import statistics
import subprocess
import sys
import sysconfig
import time
from typing import Any
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SPECIALS = ["<|pad|>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>", "<|mask|>"]
TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
FULL: dict[str, Any] = {
    "corpus_mb": 80,
    "per_package_mb": 6,
    "vocab": 8192,
    "bpe_mb": 24,
    "layers": 8,
    "hidden": 512,
    "heads": 8,
    "kv_heads": 4,
    "intermediate": 1536,
    "prompt_tokens": 96,
    "answer_tokens": 284,
    "lm_batch": 96,
    "lm_seconds": 100,
    "regen_records": 3072,
    "regen_new": 160,
    "regen_batch": 1024,
    "seq_len": 288,
    "drafter_steps": 1400,
    "drafter_batch": 8,
    "anchors": 32,
    "train_eval_every": 400,
    "drafter_limit_s": 200,
    "eval_prompts": 32,
    "eval_new": 128,
    "repeats": 3,
}
SMOKE = dict(
    FULL,
    corpus_mb=3,
    per_package_mb=0.5,
    vocab=1024,
    bpe_mb=1,
    layers=4,
    hidden=64,
    heads=4,
    kv_heads=2,
    intermediate=128,
    prompt_tokens=24,
    answer_tokens=40,
    lm_batch=16,
    lm_seconds=20,
    regen_records=48,
    regen_new=24,
    regen_batch=16,
    seq_len=64,
    drafter_steps=20,
    drafter_batch=2,
    anchors=4,
    train_eval_every=10,
    eval_prompts=4,
    eval_new=16,
    repeats=2,
)


def say(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)


# ---- 0. text -------------------------------------------------------------------------------------


def held_out(package: str) -> bool:
    return hashlib.sha1(package.encode()).digest()[0] < 32  # 1/8 of the packages


def package_sources(max_bytes: int, per_package: int) -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    """(training, held-out) Python sources by top-level package of the installed packages."""
    roots = sorted(
        {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
        | {x for x in sys.path if Path(x).name in ("site-packages", "dist-packages") and Path(x).is_dir()}
    )
    packages: dict[str, list[Path]] = {}
    for root in roots:
        for entry in sorted(Path(root).iterdir()):
            if entry.is_dir() and entry.name.isidentifier():
                files = sorted(p for p in entry.rglob("*.py") if "__pycache__" not in p.parts)
                if files:
                    packages.setdefault(entry.name, []).extend(files)
    train: dict[str, list[str]] = {}
    held: dict[str, list[str]] = {}
    total = 0
    for name in sorted(packages, key=lambda n: hashlib.sha1(n.encode()).hexdigest()):
        side = held if held_out(name) else train
        taken = 0
        for path in packages[name]:
            try:
                text = path.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError):
                continue
            if len(text) < 400:
                continue
            side.setdefault(name, []).append(text)
            taken += len(text)
            total += len(text)
            if taken > per_package or total > max_bytes:
                break
        if total > max_bytes:
            break
    return train, held


# ---- 1. tokenizer and LM -------------------------------------------------------------------------


def build_tokenizer(texts: list[str], vocab: int, model_dir: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|end|>", pad_token="<|pad|>", mask_token="<|mask|>"
    )
    hf.chat_template = TEMPLATE
    hf.save_pretrained(model_dir)
    return hf


def chunks(tokenizer, texts: list[str], p: dict) -> list[tuple[list[int], list[int]]]:
    """(prompt, answer) token chunks: consecutive pieces of each file."""
    size = p["prompt_tokens"] + p["answer_tokens"]
    out = []
    for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]:
        for lo in range(0, len(ids) - size + 1, size):
            piece = ids[lo : lo + size]
            out.append((piece[: p["prompt_tokens"]], piece[p["prompt_tokens"] :]))
    return out


def chat_ids(tokenizer, prompt: list[int], answer: list[int]) -> list[int]:
    ids = tokenizer.convert_tokens_to_ids
    return [ids("<|user|>"), *prompt, ids("<|end|>"), ids("<|assistant|>"), *answer, ids("<|end|>")]


def train_lm(tokenizer, train_chunks, held_chunks, p: dict, device: str, model_dir: Path) -> dict:
    import torch
    import torch.nn.functional as F
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=p["hidden"],
        intermediate_size=p["intermediate"],
        num_hidden_layers=p["layers"],
        num_attention_heads=p["heads"],
        num_key_value_heads=p["kv_heads"],
        head_dim=p["hidden"] // p["heads"],
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(cfg).to(device)  # type: ignore[arg-type]  # transformers' decorated .to
    params = sum(x.numel() for x in model.parameters())
    rows = torch.tensor([chat_ids(tokenizer, a, b) for a, b in train_chunks])
    held = torch.tensor([chat_ids(tokenizer, a, b) for a, b in held_chunks[:256]])
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, betas=(0.9, 0.95), weight_decay=0.1)
    cuda = device.startswith("cuda")
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else torch.autocast("cpu", enabled=False)
    gen = torch.Generator().manual_seed(0)
    t0, step, tokens, losses = time.perf_counter(), 0, 0, []
    while (elapsed := time.perf_counter() - t0) < p["lm_seconds"]:
        frac = elapsed / p["lm_seconds"]
        lr = 2e-3 * min(1.0, (step + 1) / 50) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        for group in opt.param_groups:
            group["lr"] = lr
        batch = rows[torch.randint(0, len(rows), (p["lm_batch"],), generator=gen)].to(device)
        with autocast:
            logits = model(input_ids=batch[:, :-1]).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        tokens += batch.numel()
        if step % 100 == 0:
            losses.append(float(loss))
            say(f"  lm step {step}  loss {losses[-1]:.3f}  {tokens / (time.perf_counter() - t0):,.0f} tok/s")
    model.eval()
    with torch.no_grad(), autocast:
        held_loss = [
            float(
                F.cross_entropy(
                    model(input_ids=held[i : i + 32, :-1].to(device)).logits.float().flatten(0, 1),
                    held[i : i + 32, 1:].to(device).flatten(),
                )
            )
            for i in range(0, len(held), 32)
        ]
    model.save_pretrained(model_dir)
    return {
        "params": params,
        "steps": step,
        "train_tokens": tokens,
        "seconds": time.perf_counter() - t0,
        "train_loss": float(loss),
        "heldout_loss": statistics.fmean(held_loss) if held_loss else None,
    }


# ---- 2-4. the bundled tools ----------------------------------------------------------------------


def run(cmd: list[str], limit_s: int, log: Path, env: dict | None = None, wait: bool = True):
    say("$ " + " ".join(cmd))
    f = log.open("w")
    proc = subprocess.Popen(
        ["timeout", "-k", "10", str(limit_s), *cmd], stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, env=env
    )
    if not wait:
        return proc
    code = proc.wait()
    f.close()
    tail = log.read_text(errors="replace").splitlines()[-3:]
    say(f"  exit {code}: " + " | ".join(tail))
    return code


def drafter_config(work: Path, model_dir: Path, block: int, p: dict, device: str) -> Path:
    import yaml

    cuda = device.startswith("cuda")
    config = {
        "target": {"spec": str(model_dir), "layer_ids": None},
        "drafter": {"num_layers": 3, "block_size": block},
        "data": {"source": "jsonl", "path": str(work / "regen.jsonl"), "seq_len": p["seq_len"]},
        "train": {
            "batch_size": p["drafter_batch"],
            "num_anchors": p["anchors"],
            "gamma": 7.0 if block == 16 else 4.0,
            "lr": 1.0e-3,
            "epochs": 1000,
            "warmup_frac": 0.04,
            "precision": "bf16-mixed" if cuda else "fp32",
        },
        "run": {
            "target_devices": [device],
            "drafter_devices": [device],
            "attention": "flex" if cuda else "sdpa",
            "checkpoint_every": max(p["drafter_steps"] // 4, 1),  # a stopped run still has one
            "keep_last": 1,
            "log_every": 100,
        },
        "eval": {
            "path": str(work / "prompts.jsonl"),
            "every": p["train_eval_every"],
            "num_prompts": 8,
            "max_new_tokens": p["eval_new"],
        },
    }
    path = work / f"drafter-b{block}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def training_summary(run_dir: Path) -> dict:
    from trainer import metrics_format

    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return {}
    records = metrics_format.parse_lines(path.read_text())
    steps = [r for r in records if r["event"] == "step"]
    evals = [r for r in records if r["event"] == "eval"]
    wall = records[-1]["time"] - records[0]["time"] if len(records) > 1 else float("nan")
    eval_s = sum(r["seconds"] for r in evals)
    return {
        "steps": steps[-1]["step"] if steps else 0,
        "wall_s": wall,
        "eval_s": eval_s,
        "eval_overhead": eval_s / wall if wall == wall and wall > 0 else None,
        "evals": [
            {k: r.get(k) for k in ("step", "tau", "tau_per_prompt_mean", "seconds", "overhead", "lossless")}
            for r in evals
        ],
        "final_loss": steps[-1]["loss"] if steps else None,
        "final_acc": steps[-1]["acc"] if steps else None,
        "expected_tau": metrics_format.expected_tau(steps[-1]["acc"]) if steps else None,
    }


def eval_once(run_dir: Path, work: Path, p: dict, device: str, log: Path, limit: int) -> dict:
    cmd = [sys.executable, "-m", "trainer", "eval", "--checkpoint", str(run_dir), "--prompts"]
    cmd += [str(work / "prompts.jsonl"), "--num-prompts", str(p["eval_prompts"]), "--max-new-tokens"]
    cmd += [str(p["eval_new"]), "--device", device, "--json"]
    t0 = time.perf_counter()
    code = run(cmd, limit, log)
    lines = [x for x in log.read_text(errors="replace").splitlines() if x.startswith("{")]
    result = json.loads(lines[-1]) if lines else {}
    return dict(result, exit=code, process_s=time.perf_counter() - t0)


# ---- report --------------------------------------------------------------------------------------


def _evals(b: dict) -> list[dict]:
    return [e for e in b["evals"] if e.get("exit") == 0]


def _median(b: dict, key: str) -> float:
    return statistics.median(e[key] for e in _evals(b))


# (row name, its cell for one block's results) of the results table; a cell that cannot be made is "-"
BLOCK_ROWS = (
    ("drafter training: steps, wall s", lambda b: f"{b['train']['steps']}, {b['train']['wall_s']:.0f}"),
    (
        "in-training tau evaluation: total s, share of wall",
        lambda b: f"{b['train']['eval_s']:.1f} s, {100 * b['train']['eval_overhead']:.1f} %",
    ),
    ("expected tau from training accuracy", lambda b: f"{b['train']['expected_tau']:.3f}"),
    ("tau pooled over rounds (`dflash-train eval`)", lambda b: f"{_evals(b)[0]['tau']:.3f}"),
    ("tau mean of per-prompt means", lambda b: f"{_evals(b)[0]['tau_per_prompt_mean']:.3f}"),
    (
        "per-prompt tau min / median / max",
        lambda b: "{min:.2f} / {median:.2f} / {max:.2f}".format(**_evals(b)[0]["tau_per_prompt"]),
    ),
    ("acceptance by position", lambda b: " ".join(f"{a:.2f}" for a in _evals(b)[0]["acceptance"])),
    (
        "target-only tok/s (each run)",
        lambda b: ", ".join(f"{e['target_tokens_per_s']:,.0f}" for e in _evals(b)),
    ),
    (
        "speculative tok/s (each run)",
        lambda b: ", ".join(f"{e['speculative_tokens_per_s']:,.0f}" for e in _evals(b)),
    ),
    (
        "**speed-up** (median; each run)",
        lambda b: (
            f"**{_median(b, 'speedup'):.2f}x** (" + ", ".join(f"{e['speedup']:.2f}" for e in _evals(b)) + ")"
        ),
    ),
    (
        "runs within +-10 % of the median speed-up",
        lambda b: str(all(abs(e["speedup"] / _median(b, "speedup") - 1) <= 0.10 for e in _evals(b))),
    ),
    ("lossless (ties)", lambda b: ", ".join(f"{e['lossless']} ({e['ties']})" for e in _evals(b))),
    ("decode seconds in eval (each run)", lambda b: ", ".join(f"{e['seconds']:.1f}" for e in _evals(b))),
    ("eval process seconds (each run)", lambda b: ", ".join(f"{e['process_s']:.0f}" for e in _evals(b))),
    ("loop", lambda b: _evals(b)[0]["loop"]),
)


def markdown(args, info: dict, state: dict) -> str:
    lm, lines = state.get("lm", {}), []
    lines += [
        f"# A real small LM through the bundled tools, on {info.get('gpu', args.device)}",
        "",
        f"`python benchmarks/real_lm.py --device {args.device} --work {args.work} --out ...` "
        f"(torch {info.get('torch')}, transformers {info.get('transformers')}). Text: Python sources of the "
        f"installed packages, split by package: {state.get('packages_train', '?')} packages train, "
        f"{state.get('packages_heldout', '?')} held out (prompts come only from those).",
        "",
        f"- target: Qwen3, {lm.get('params', 0) / 1e6:.1f}M parameters, vocab {state.get('vocab')}, "
        f"byte-level BPE + chat template; {lm.get('steps')} steps / {lm.get('train_tokens', 0) / 1e6:.1f}M "
        f"tokens in {lm.get('seconds', 0):.0f} s; train loss {lm.get('train_loss', float('nan')):.2f}, "
        f"held-out loss {lm.get('heldout_loss') or float('nan'):.2f}",
    ]
    regen = state.get("regen")
    if regen:
        lines.append(
            f"- `dflash-train data regenerate`: {regen['records']} answers in {regen['seconds']:.0f} s "
            f"(exit {regen['exit']})"
        )
    lines.append("")
    blocks = state.get("blocks", {})
    if blocks:
        lines += [
            "| | " + " | ".join(f"block {b}" for b in blocks) + " |",
            "|---|" + "---|" * len(blocks),
        ]

        for name, fn in BLOCK_ROWS:
            cells = []
            for b in blocks.values():
                try:
                    cells.append(fn(b))
                except (KeyError, TypeError, IndexError, ValueError, statistics.StatisticsError):
                    cells.append("-")
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        lines.append("")
    lines.append(f"Stages: {json.dumps(state.get('stage_s', {}))} (seconds).")
    return "\n".join(lines) + "\n"


def _text_and_tokenizer(p: dict, model_dir: Path, state: dict):
    """(tokenizer, train chunks, held-out chunks): the packages' sources split by package, a BPE on
    part of the training text."""
    train, held = package_sources(int(p["corpus_mb"] * 1e6), int(p["per_package_mb"] * 1e6))
    train_texts = [x for files in train.values() for x in files]
    held_texts = [x for files in held.values() for x in files]
    state.update(packages_train=len(train), packages_heldout=len(held), heldout_names=sorted(held))
    say(
        f"text: {len(train)} packages / {sum(map(len, train_texts)) / 1e6:.1f} MB train, "
        f"{len(held)} packages / {sum(map(len, held_texts)) / 1e6:.1f} MB held out"
    )
    random.Random(0).shuffle(train_texts)
    budget, bpe_texts = int(p["bpe_mb"] * 1e6), []
    for text in train_texts:
        bpe_texts.append(text)
        budget -= len(text)
        if budget < 0:
            break
    tokenizer = build_tokenizer(bpe_texts, p["vocab"], model_dir)
    train_chunks, held_chunks = chunks(tokenizer, train_texts, p), chunks(tokenizer, held_texts, p)
    random.Random(1).shuffle(held_chunks)
    say(
        f"tokenizer {len(tokenizer)} tokens; {len(train_chunks)} train chunks, "
        f"{len(held_chunks)} held-out chunks"
    )
    return tokenizer, train_chunks, held_chunks


def _regenerate(args, p: dict, work: Path, model_dir: Path, tokenizer, train_chunks, held_chunks) -> dict:
    """Training records with the LM's own answers (`dflash-train data regenerate`), and the held-out
    prompts the evaluations use."""
    records = random.Random(2).sample(train_chunks, min(p["regen_records"], len(train_chunks)))
    with (work / "regen-in.jsonl").open("w") as f:
        for prompt, answer in records:
            messages = [
                {"role": "user", "content": tokenizer.decode(prompt)},
                {"role": "assistant", "content": tokenizer.decode(answer)},
            ]
            f.write(json.dumps({"messages": messages}) + "\n")
    with (work / "prompts.jsonl").open("w") as f:
        for prompt, _ in held_chunks[: max(p["eval_prompts"], 8)]:
            f.write(json.dumps({"messages": [{"role": "user", "content": tokenizer.decode(prompt)}]}) + "\n")
    t = time.perf_counter()
    cmd = [sys.executable, "-m", "trainer", "data", "regenerate", "--target", str(model_dir), "--in"]
    cmd += [str(work / "regen-in.jsonl"), "--out", str(work / "regen.jsonl"), "--max-new-tokens"]
    cmd += [str(p["regen_new"]), "--batch-size", str(p["regen_batch"]), "--devices", args.device]
    (work / "regen.jsonl").unlink(missing_ok=True)
    code = run(cmd, 240, work / "regen.log")
    done = sum(1 for _ in (work / "regen.jsonl").open()) if (work / "regen.jsonl").is_file() else 0
    return {"exit": code, "records": done, "seconds": time.perf_counter() - t}


def _train_drafters(args, p: dict, work: Path, model_dir: Path, blocks: list[int]) -> dict:
    """One drafter per block size, trained side by side; each one's exit and training summary."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    procs = {}
    for block in blocks:
        run_dir = work / f"drafter-b{block}"
        config = drafter_config(work, model_dir, block, p, args.device)
        cmd = [sys.executable, "-m", "trainer", "--config", str(config)]
        cmd += ["--output-dir", str(run_dir), "--max-steps", str(p["drafter_steps"])]
        procs[block] = (
            run(cmd, p["drafter_limit_s"], work / f"train-b{block}.log", env, wait=False),
            run_dir,
        )
    trained = {}
    for block, (proc, run_dir) in procs.items():
        code = proc.wait()
        tail = (work / f"train-b{block}.log").read_text(errors="replace").splitlines()[-2:]
        say(f"  train block {block}: exit {code}: " + " | ".join(tail))
        trained[block] = {"train_exit": code, "train": training_summary(run_dir), "evals": []}
    return trained


def _evaluate(args, p: dict, work: Path, blocks: list[int], state: dict, began: float, save) -> None:
    """`dflash-train eval` of each trained drafter, --repeats rounds, within the time budget."""
    for rep in range(p["repeats"]):
        for block in blocks:
            b = state["blocks"][block]
            if not list((work / f"drafter-b{block}" / "checkpoints").glob("step-*")):
                continue
            if time.perf_counter() - began > args.budget_s - 25:
                say(f"  eval block {block} run {rep}: skipped, the time budget is spent")
                continue
            log = work / f"eval-b{block}-{rep}.log"
            b["evals"].append(eval_once(work / f"drafter-b{block}", work, p, args.device, log, 120))
            e = b["evals"][-1]
            say(
                f"  eval block {block} run {rep}: tau {e.get('tau')} speedup {e.get('speedup')} "
                f"target {e.get('target_tokens_per_s')} spec {e.get('speculative_tokens_per_s')}"
            )
            save()


def main() -> int:
    from benchmarks.common import doc_parser, versions

    ap = doc_parser(__doc__)
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--work", required=True, help="scratch directory (created)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, for a CPU check of the pipeline")
    ap.add_argument("--blocks", default="8,16")
    ap.add_argument("--budget-s", type=float, default=480, help="skip the evaluations left after this long")
    args = ap.parse_args()
    p = SMOKE if args.smoke else FULL
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    model_dir = work / "lm"
    import transformers

    info = dict(versions(args.device), transformers=transformers.__version__)
    state: dict = {"params": p, "stage_s": {}, "vocab": p["vocab"]}
    out = Path(args.out)

    def save():
        out.write_text(markdown(args, info, state))
        out.with_suffix(".json").write_text(json.dumps({"info": info, "state": state}, indent=1, default=str))

    began = time.perf_counter()
    blocks = [int(b) for b in args.blocks.split(",")]

    def stage(name: str, fn):
        t = time.perf_counter()
        value = fn()
        state["stage_s"][name] = time.perf_counter() - t
        return value

    tokenizer, train_chunks, held_chunks = stage(
        "text_and_tokenizer", lambda: _text_and_tokenizer(p, model_dir, state)
    )
    state["lm"] = stage(
        "lm", lambda: train_lm(tokenizer, train_chunks, held_chunks, p, args.device, model_dir)
    )
    say(f"lm: {state['lm']}")
    save()
    state["regen"] = stage(
        "regenerate", lambda: _regenerate(args, p, work, model_dir, tokenizer, train_chunks, held_chunks)
    )
    save()
    state["blocks"] = stage("drafters", lambda: _train_drafters(args, p, work, model_dir, blocks))
    save()
    stage("evals", lambda: _evaluate(args, p, work, blocks, state, began, save))
    save()
    print(out.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
