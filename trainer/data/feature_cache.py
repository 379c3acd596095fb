"""An offline cache of target features: run the target once, train many epochs from disk.

A directory of manifest.json (what it was made from, counts, per-shard sizes and digests) and
shard-NNNNN.safetensors (unpadded features, input_ids, loss_mask and offsets of consecutive
sequences). Training refuses a cache of another target, layer ids or seq_len, a truncated shard at
startup and a corrupted one at its first read.
"""

from __future__ import annotations

import bisect
import collections
import hashlib
import itertools
import json
import os
import threading

import torch
from safetensors import SafetensorError

from trainer.atomic import write_atomic
from trainer.data import chunk_digest
from trainer.data.dataset import DataError, Dataset

MANIFEST = "manifest.json"
FORMAT = 1
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
# Keys a training run must agree on; the rest of the manifest is provenance.
COMPATIBLE_KEYS = ("target", "layer_ids", "seq_len")
OPEN_SHARDS_PER_THREAD = 64
# What the readers rely on: a manifest's keys and each shard entry's, with the type of their values.
MANIFEST_TYPES = {
    "target": dict,
    "layer_ids": list,
    "seq_len": int,
    "dtype": str,
    "pad_id": int,
    "shards": list,
}
SHARD_TYPES = {"file": str, "first": int, "count": int, "tokens": int, "loss_tokens": int, "bytes": int}
COUNT_KEYS = ("sequences", "tokens", "loss_tokens", "bytes", "shards")
TOKEN_BYTES = 5  # an int32 id and a bool mask per token, beside its features


def file_sha256(path: str, chunk: int = 1 << 24) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def target_identity(target) -> dict:
    """Who made the features: config hash + a fingerprint of the embedding and lm_head weights
    (bf16-rounded, so fp32 and bf16 loads match)."""
    # keys that name how the config was stored, not what the model computes (save_pretrained sets some)
    config = {
        k: v
        for k, v in target.config.to_dict().items()
        if not k.startswith("_")
        and k not in ("transformers_version", "dtype", "torch_dtype", "architectures")
    }
    digest = hashlib.sha256()
    for weight in (target.embed_tokens.weight, target.lm_head.weight):
        digest.update(weight[:256].detach().to("cpu", torch.bfloat16).float().numpy().tobytes())
    return {
        "config_sha256": hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest(),
        "weights_fingerprint": digest.hexdigest(),
        "num_layers": int(target.config.num_hidden_layers),
        "hidden_size": int(target.hidden_size),
        "vocab_size": int(target.vocab_size),
    }


def tokenizer_identity(tokenizer) -> dict | None:
    if tokenizer is None:
        return None
    template = getattr(tokenizer, "chat_template", None) or ""
    return {
        "name_or_path": str(getattr(tokenizer, "name_or_path", "")),
        "vocab_size": len(tokenizer),
        "chat_template_sha256": hashlib.sha256(str(template).encode()).hexdigest(),
    }


def data_identity(cfg) -> dict:
    if cfg.data.source == "jsonl":
        return {
            "source": "jsonl",
            "path": os.path.abspath(cfg.data.path),
            "sha256": file_sha256(cfg.data.path),
        }
    syn = cfg.data.synthetic
    return {
        "source": "synthetic",
        "num_samples": syn.num_samples,
        "prompt_len": syn.prompt_len,
        "seed": cfg.train.seed,
    }


def cache_header(cfg, target, dtype_name: str, pad_id: int) -> dict:
    """The manifest minus counts and shards: what the cache is of."""
    return {
        "format": FORMAT,
        "target": target_identity(target),
        "target_spec": cfg.target.spec,
        "layer_ids": list(target.layer_ids),
        "seq_len": cfg.data.seq_len,
        "dtype": dtype_name,
        "pad_id": int(pad_id),
        "tokenizer": tokenizer_identity(target.tokenizer),
        "data": data_identity(cfg),
    }


def feature_width(manifest: dict) -> int:
    """Features per token: the fused hidden states of every cached layer."""
    return len(manifest["layer_ids"]) * manifest["target"]["hidden_size"]


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.2f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.2f} TiB"


def bytes_per_token(num_layers: int, hidden: int, dtype_name: str) -> int:
    return num_layers * hidden * DTYPES[dtype_name].itemsize + TOKEN_BYTES


def read_manifest(cache_dir: str) -> dict | None:
    path = os.path.join(cache_dir, MANIFEST)
    if not os.path.exists(path):  # a directory of that name is an unreadable manifest, not no manifest
        return None
    try:
        with open(path, encoding="utf-8") as f:
            manifest = json.load(f)
    except (OSError, ValueError) as exc:
        raise damaged_manifest(cache_dir, exc) from None
    problem = manifest_problem(manifest)
    if problem:
        raise damaged_manifest(cache_dir, problem)
    return manifest


def _not_a(value, kind: type) -> bool:
    return not isinstance(value, kind) or (kind is int and isinstance(value, bool))


def manifest_problem(manifest) -> str | None:
    """What in a manifest's shape the readers could not use (a key missing or mistyped), or None."""
    if not isinstance(manifest, dict):
        return f"{type(manifest).__name__}, not a JSON object"
    for key, kind in MANIFEST_TYPES.items():
        if _not_a(manifest.get(key), kind):
            return f"{key!r} missing or not {kind.__name__}"
    if manifest["dtype"] not in DTYPES:
        return f"dtype {manifest['dtype']!r} is none of {sorted(DTYPES)}"
    if _not_a(manifest["target"].get("hidden_size"), int) or any(
        _not_a(i, int) for i in manifest["layer_ids"]
    ):
        return "target.hidden_size or layer_ids not integers"
    first = 0  # the shards hold consecutive sequences, in order
    for i, shard in enumerate(manifest["shards"]):
        missing = [
            k for k, kind in SHARD_TYPES.items() if not isinstance(shard, dict) or _not_a(shard.get(k), kind)
        ]
        if missing or not (chunk_digest.FIELD in shard or "sha256" in shard):
            return f"shards[{i}]: {', '.join(missing) or 'its checksum'} missing or mistyped"
        if shard["first"] != first or shard["count"] < 1:
            return (
                f"shards[{i}]: sequences {shard['first']}+{shard['count']}, the shards before end at {first}"
            )
        first += shard["count"]
    if manifest.get("complete"):
        counts = manifest.get("counts")
        if not isinstance(counts, dict) or any(_not_a(counts.get(k), int) for k in COUNT_KEYS):
            return f"'counts' missing or not integers ({', '.join(COUNT_KEYS)})"
        if not manifest["shards"]:
            return "complete, but no shards"
    return None


def damaged_manifest(cache_dir: str, why) -> DataError:
    return DataError(
        os.path.join(cache_dir, MANIFEST),
        f"unreadable manifest ({why}). Fix: delete {cache_dir} and rerun `dflash-train data cache-features`.",
    )


def write_manifest(cache_dir: str, manifest: dict) -> None:
    write_atomic(os.path.join(cache_dir, MANIFEST), json.dumps(manifest, indent=1) + "\n")


def differences(expected: dict, found: dict) -> list[str]:
    """`key: cache X, config Y` for each compatibility key (target subkeys one by one)."""
    out = []
    for key in COMPATIBLE_KEYS:
        want, have = expected.get(key), found.get(key)
        if key == "target" and isinstance(want, dict) and isinstance(have, dict):
            out += [
                f"target.{k}: cache {have.get(k)!r}, config {want.get(k)!r}"
                for k in sorted(set(want) | set(have))
                if want.get(k) != have.get(k)
            ]
        elif want != have:
            out.append(f"{key}: cache {have!r}, config {want!r}")
    return out


def shard_problem(cache_dir: str, shard: dict, check_sha: bool) -> str | None:
    """Why a shard listed in the manifest is unusable, or None."""
    path = os.path.join(cache_dir, shard["file"])
    if not os.path.isfile(path):
        return f"{path} is missing"
    size = os.path.getsize(path)
    if size != shard["bytes"]:
        return f"{path} is {size} bytes, the manifest says {shard['bytes']} (truncated or rewritten)"
    if check_sha and _checksum_differs(path, shard):
        return f"{path} fails its sha256 check (corrupted)"
    return None


def _refuse_bad_shard(cache_dir: str, shard: dict, check_sha: bool) -> None:
    """DataError naming shard_problem and the fix, when there is one."""
    problem = shard_problem(cache_dir, shard, check_sha)
    if problem:
        raise DataError(
            cache_dir,
            problem + ". Fix: rerun `dflash-train data cache-features` with the "
            "same --config and --out (it rewrites bad shards).",
        )


def _checksum_differs(path: str, shard: dict) -> bool:
    if chunk_digest.FIELD in shard:
        return chunk_digest.file_digest(path) != shard[chunk_digest.FIELD]
    return file_sha256(path) != shard["sha256"]  # a cache written before chunk digests


def prepare(cache_dir: str, header: dict) -> tuple[dict, int]:
    """Start or resume: (manifest, first sequence to compute). Refuses another cache's directory."""
    os.makedirs(cache_dir, exist_ok=True)
    found = read_manifest(cache_dir)
    if found is None:
        if any(n.startswith("shard-") for n in os.listdir(cache_dir)):
            raise DataError(cache_dir, "holds shards but no manifest. Fix: use an empty --out directory.")
        manifest = dict(header, complete=False, shards=[])
        write_manifest(cache_dir, manifest)
        return manifest, 0
    theirs = {k: v for k, v in found.items() if k not in ("complete", "shards", "counts")}
    if theirs != header:
        diff = differences(header, theirs) or [
            f"{k}: cache {theirs.get(k)!r}, now {header.get(k)!r}"
            for k in sorted(set(header) | set(theirs))
            if header.get(k) != theirs.get(k)
        ]
        raise DataError(
            cache_dir,
            "holds a cache made from other inputs ("
            + "; ".join(diff)
            + "). Fix: pick another --out directory, or delete this one.",
        )
    # Keep whole shards up to the first bad one; everything after it is recomputed.
    good = list(itertools.takewhile(lambda s: not shard_problem(cache_dir, s, True), found["shards"]))
    kept, resume_at = {s["file"] for s in good}, (good[-1]["first"] + good[-1]["count"] if good else 0)
    found["complete"] = bool(found.get("complete")) and len(good) == len(found["shards"])
    found["shards"] = good
    for name in os.listdir(cache_dir):  # shards no manifest entry names (killed mid-write)
        if name.startswith("shard-") and name not in kept:
            os.remove(os.path.join(cache_dir, name))
    write_manifest(cache_dir, found)
    return found, resume_at


def complete_manifest(cache_dir: str, manifest: dict) -> None:
    shards = manifest["shards"]
    shard_key_of = {"sequences": "count", "tokens": "tokens", "loss_tokens": "loss_tokens", "bytes": "bytes"}
    manifest["counts"] = {total: sum(s[key] for s in shards) for total, key in shard_key_of.items()}
    manifest["counts"]["shards"] = len(shards)
    manifest["complete"] = True
    write_manifest(cache_dir, manifest)


class CacheReader:
    """Random access to cached features; each shard's sha256 is checked on its first read."""

    def __init__(self, cache_dir: str, manifest: dict, pin_memory: bool = False):
        self.cache_dir, self.manifest, self.pin_memory = cache_dir, manifest, pin_memory
        self.shards = manifest["shards"]
        self.firsts = [s["first"] for s in self.shards]
        self.seq_len = manifest["seq_len"]
        self.width = feature_width(manifest)
        self.dtype = DTYPES[manifest["dtype"]]
        self._verified: set[int] = set()
        self._verify_lock = threading.Lock()
        self._local = threading.local()  # safe_open handles are per thread
        self._offsets_of: dict[int, torch.Tensor] = {}

    def verify_all(self) -> None:
        """Check every shard's sha256 now rather than at its first read."""
        for index in range(len(self.shards)):
            self._handle(index)

    def _handle(self, index: int):
        from safetensors import safe_open

        handles = getattr(self._local, "handles", None)
        if handles is None:
            handles = self._local.handles = collections.OrderedDict()
        if index in handles:
            handles.move_to_end(index)
        else:
            # each open shard is an mmap; the kernel caps their number
            if len(handles) >= OPEN_SHARDS_PER_THREAD:
                handles.popitem(last=False)
            with self._verify_lock:
                if index not in self._verified:
                    _refuse_bad_shard(self.cache_dir, self.shards[index], check_sha=True)
                    self._verified.add(index)
            handles[index] = safe_open(
                os.path.join(self.cache_dir, self.shards[index]["file"]), framework="pt"
            )
        return handles[index]

    def _offsets(self, index: int) -> torch.Tensor:
        if index not in self._offsets_of:  # a race only loads the same small tensor twice
            self._offsets_of[index] = self._handle(index).get_tensor("offsets")
        return self._offsets_of[index]

    def features(self, indices: torch.Tensor) -> torch.Tensor:
        """[B, seq_len, K*H] for dataset indices; zeros after each sequence's end (never visible)."""
        out = torch.empty(
            len(indices), self.seq_len, self.width, dtype=self.dtype, pin_memory=self.pin_memory
        )
        for row, seq in enumerate(indices.tolist()):
            index = bisect.bisect_right(self.firsts, seq) - 1
            offsets = self._offsets(index)
            local = seq - self.shards[index]["first"]
            a, b = int(offsets[local]), int(offsets[local + 1])
            out[row, : b - a] = self._handle(index).get_slice("features")[a:b]
            out[row, b - a :] = 0
        return out

    def token_arrays(self, pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Padded input_ids, loss_mask, attention_mask of every sequence (small: no features)."""
        from safetensors import safe_open

        total = self.shards[-1]["first"] + self.shards[-1]["count"]
        ids = torch.full((total, self.seq_len), pad_id, dtype=torch.long)
        mask = torch.zeros(total, self.seq_len, dtype=torch.bool)
        attn = torch.zeros(total, self.seq_len, dtype=torch.bool)
        for shard in self.shards:
            try:
                with safe_open(os.path.join(self.cache_dir, shard["file"]), framework="pt") as f:
                    offsets, flat_ids, flat_mask = (
                        f.get_tensor(n) for n in ("offsets", "input_ids", "loss_mask")
                    )
            except SafetensorError:  # a damaged header: the sha256 check names the shard and the fix
                _refuse_bad_shard(self.cache_dir, shard, check_sha=True)
                raise
            if len(offsets) != shard["count"] + 1:
                held = (
                    f"{shard['file']} holds {len(offsets) - 1} sequences, the manifest says {shard['count']}"
                )
                raise damaged_manifest(self.cache_dir, held)
            for local in range(shard["count"]):
                a, b = int(offsets[local]), int(offsets[local + 1])
                row = shard["first"] + local
                ids[row, : b - a] = flat_ids[a:b].long()
                mask[row, : b - a] = flat_mask[a:b]
                attn[row, : b - a] = True
        return ids, mask, attn


def open_cache(cache_dir: str, expected: dict, pin_memory: bool = False) -> Dataset:
    """The cache as a Dataset whose batches carry their features; DataError when it is unusable."""
    manifest = read_manifest(cache_dir)
    if manifest is None:
        raise DataError(
            cache_dir,
            f"no {MANIFEST}: not a feature cache. Fix: create it with "
            f"`dflash-train data cache-features --config FILE --out {cache_dir}`.",
        )
    if not manifest.get("complete"):
        raise DataError(
            cache_dir,
            "the feature cache is incomplete (its writer stopped). Fix: rerun "
            "`dflash-train data cache-features` with the same --out to finish it.",
        )
    diff = differences(expected, manifest)
    if diff:
        raise DataError(
            cache_dir,
            "the feature cache was made for another setup: "
            + "; ".join(diff)
            + ". Fix: point data.path at a cache made with this config, or make one.",
        )
    for shard in manifest["shards"]:
        _refuse_bad_shard(cache_dir, shard, check_sha=False)  # sizes now; sha256 on first read
    reader = CacheReader(cache_dir, manifest, pin_memory=pin_memory)
    ids, mask, attn = reader.token_arrays(manifest["pad_id"])
    counts = manifest["counts"]
    size = f"{counts['tokens']} tokens, {human_bytes(counts['bytes'])}, {manifest['dtype']}"
    return Dataset(ids, mask, attn, source=f"feature cache {cache_dir} ({size})", features=reader.features)


def training_source(cfg, dtype) -> tuple[list, Dataset]:
    """For `data.source: features`: an embedding+lm_head stand-in per drafter replica, and the cache."""
    from trainer.data.target_head import load_target_head, weight_bytes

    # a tiny target is built for its head where cache-features built it
    devices = list(cfg.run.target_devices or []) + list(cfg.run.drafter_devices or [])
    on_cuda = [d for d in devices if str(d).startswith("cuda")]
    head = load_target_head(
        cfg.target.spec,
        dtype,
        layer_ids=cfg.target.layer_ids,
        seed=cfg.train.seed,
        tiny=cfg.target.tiny or None,
        device=on_cuda[0] if on_cuda and torch.cuda.is_available() else "cpu",
    )
    expected = {
        "target": target_identity(head),
        "layer_ids": list(head.layer_ids),
        "seq_len": cfg.data.seq_len,
    }
    pin = any(dev.startswith("cuda") for dev in cfg.run.drafter_devices) and torch.cuda.is_available()
    dataset = open_cache(cfg.data.path, expected, pin_memory=pin)
    saved = weight_bytes(head.config)["saved"]
    dataset.source += f"; target decoder layers not loaded ({human_bytes(saved)} of bf16 weights)"
    return [head] * len(cfg.run.drafter_devices), dataset
