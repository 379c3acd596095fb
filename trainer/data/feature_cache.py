"""An offline cache of target features: run the target once, train many epochs from disk.

Layout of a cache directory:
    manifest.json            what it was made from (target, layer ids, seq_len, data, tokenizer),
                             counts, and per shard: file, first sequence, count, bytes, sha256
    shard-00000.safetensors  flat tensors for consecutive sequences (only real tokens, no padding):
                             features [tokens, K*H] (bf16 by default), input_ids [tokens] int32,
                             loss_mask [tokens] bool, offsets [count+1] int64

Written shard by shard (file fsynced, then the manifest replaced atomically), so a killed run
resumes after the last whole shard. A training run refuses a cache made for another target,
other layer ids or another seq_len (exit 2, naming each difference), detects a truncated shard
from its size at startup and a corrupted one from its sha256 on first read.
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import hashlib
import json
import os
import queue
import shutil
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import torch

from trainer.atomic import write_atomic
from trainer.data.dataset import DataError, Dataset
from trainer.data.safetensors_stream import write_pieces

MANIFEST = "manifest.json"
FORMAT = 1
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
# Keys a training run must agree on; the rest of the manifest is provenance.
COMPATIBLE_KEYS = ("target", "layer_ids", "seq_len")
OPEN_SHARDS_PER_THREAD = 64


def _sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def file_sha256(path: str, chunk: int = 1 << 24) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def target_identity(target) -> dict:
    """Who made the features: config hash + a fingerprint of the embedding and lm_head weights.

    The fingerprint uses bf16-rounded rows, so the same weights loaded in fp32 or bf16 match; it
    cannot see a change confined to the decoder layers (the config hash and spec still can).
    """
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
        "config_sha256": _sha256_bytes(json.dumps(config, sort_keys=True, default=str).encode()),
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
        "chat_template_sha256": _sha256_bytes(str(template).encode()),
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


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.2f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.2f} TiB"


def bytes_per_token(num_layers: int, hidden: int, dtype_name: str) -> int:
    """Disk bytes per cached token: features + int32 id + bool mask."""
    return num_layers * hidden * DTYPES[dtype_name].itemsize + 4 + 1


def read_manifest(cache_dir: str) -> dict | None:
    path = os.path.join(cache_dir, MANIFEST)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as exc:
        raise DataError(
            path,
            f"unreadable manifest ({exc}). Fix: delete {cache_dir} and rerun "
            f"`dflash-train data cache-features`.",
        ) from None


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
    if check_sha and file_sha256(path) != shard["sha256"]:
        return f"{path} fails its sha256 check (corrupted)"
    return None


# ---- writing ------------------------------------------------------------------------------------


class ShardWriter:
    """Collects sequences and writes a shard when `shard_bytes` is reached.

    With `parallel` > 0 up to that many shards are written (save + sha256 in one pass, fsync) by a
    thread pool at once, and committed to the manifest strictly in order: a shard file always exists
    before the manifest names it, and a kill leaves only whole, named shards (prepare() removes the
    rest). close() waits for them.
    """

    def __init__(self, cache_dir: str, manifest: dict, shard_bytes: int, parallel: int = 0):
        self.cache_dir, self.manifest, self.shard_bytes = cache_dir, manifest, shard_bytes
        shards = manifest["shards"]
        # of the shard being collected
        self._first = shards[-1]["first"] + shards[-1]["count"] if shards else 0
        self._index = len(shards)
        self._pool = ThreadPoolExecutor(parallel, thread_name_prefix="shard-writer") if parallel else None
        self._parallel = parallel
        self._pending: collections.deque = collections.deque()
        self._reset()

    def _reset(self):
        self.features, self.ids, self.masks, self.lengths, self.bytes = [], [], [], [], 0

    def add(self, features: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor) -> None:
        self.features.append(features)
        self.ids.append(input_ids.to(torch.int32))
        self.masks.append(loss_mask.to(torch.bool))
        self.lengths.append(int(input_ids.shape[0]))
        self.bytes += features.numel() * features.element_size() + 5 * input_ids.shape[0]
        if self.bytes >= self.shard_bytes:
            self.flush()

    def flush(self) -> None:
        """Hand the collected sequences over as one shard (written now, or by the pool)."""
        if not self.lengths:
            return
        job = (
            f"shard-{self._index:05d}.safetensors",
            self._first,
            self.features,
            self.ids,
            self.masks,
            self.lengths,
        )
        self._index, self._first = self._index + 1, self._first + len(self.lengths)
        self._reset()
        if self._pool is None:
            self._commit(self._write(*job))
            return
        self._pending.append(self._pool.submit(self._write, *job))
        while len(self._pending) > self._parallel or (self._pending and self._pending[0].done()):
            self._commit(self._pending.popleft().result())

    def close(self) -> None:
        """Wait for shards being written and commit them in order (up to the first that failed)."""
        try:
            while self._pending:
                self._commit(self._pending.popleft().result())
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True, cancel_futures=True)

    def _write(self, name, first, features, ids, masks, lengths) -> dict:
        path = os.path.join(self.cache_dir, name)
        offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64)
        offsets[1:] = torch.tensor(lengths).cumsum(0)
        size, sha256 = write_pieces(
            path + ".tmp", {"features": features, "input_ids": ids, "loss_mask": masks, "offsets": [offsets]}
        )
        os.replace(path + ".tmp", path)
        return {
            "file": name,
            "first": first,
            "count": len(lengths),
            "tokens": int(offsets[-1]),
            "loss_tokens": sum(int(m.sum()) for m in masks),
            "bytes": size,
            "sha256": sha256,
        }

    def _commit(self, shard: dict) -> None:
        self.manifest["shards"].append(shard)
        write_manifest(self.cache_dir, self.manifest)  # the shard exists before the manifest names it


def disk_estimate(dataset: Dataset, start: int, num_layers: int, hidden: int, dtype_name: str) -> dict:
    tokens = int(dataset.attention_mask[start:].sum())
    per_token = bytes_per_token(num_layers, hidden, dtype_name)
    return {
        "sequences": len(dataset) - start,
        "tokens": tokens,
        "bytes": tokens * per_token,
        "bytes_per_1k_tokens": 1000 * per_token,
    }


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
    good = []
    for shard in found["shards"]:
        if shard_problem(cache_dir, shard, check_sha=True):
            break
        good.append(shard)
    found["complete"] = bool(found.get("complete")) and len(good) == len(found["shards"])
    found["shards"] = good
    for name in os.listdir(cache_dir):  # shards no manifest entry names (killed mid-write)
        if name.startswith("shard-") and name not in {s["file"] for s in good}:
            os.remove(os.path.join(cache_dir, name))
    write_manifest(cache_dir, found)
    start = good[-1]["first"] + good[-1]["count"] if good else 0
    return found, start


# Sequences per target forward when no batch size is given: about this many tokens.
BATCH_TOKENS = 16384
WRITE_QUEUE_DEPTH = 2  # batches computed ahead of the writer thread
# Shards written at once (writing + sha256 of ~2 GiB in one pass, then fsync, is seconds of CPU and disk
# per shard; at paper dims the target fills one in about a second)
SHARD_WRITERS = 4


def auto_batch_size(seq_len: int, tokens: int = BATCH_TOKENS) -> int:
    return max(1, tokens // max(1, seq_len))


class _HostBuffers:
    """Reusable pinned host buffers for device->host copies of feature batches (pinning is slow;
    pinned memory lets the copy run while the next batch's forward is queued)."""

    def __init__(self, count: int, numel: int, dtype: torch.dtype):
        self.free: queue.Queue = queue.Queue()
        for _ in range(count):
            self.free.put(torch.empty(numel, dtype=dtype, pin_memory=True))

    def copy_of(self, features: torch.Tensor, writer: _WriterThread):
        """(host tensor, its ready event, release) for an on-device tensor; the copy is asynchronous."""
        while True:  # buffers come back as the writer is done with them
            writer.check()
            try:
                flat = self.free.get(timeout=0.1)
                break
            except queue.Empty:
                continue
        host = flat[: features.numel()].view(features.shape)
        host.copy_(features, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return host, ready, lambda: self.free.put(flat)


class _WriterThread:
    """ShardWriter.add/flush on a thread of their own: the per-sequence copies, the shard writes,
    fsync and sha256 run while the target computes the next batch. An error in the thread is
    raised in the caller at its next put() or at close()."""

    def __init__(self, writer: ShardWriter, progress=None, depth: int = WRITE_QUEUE_DEPTH):
        self.writer, self.progress = writer, progress
        self.queue: queue.Queue = queue.Queue(maxsize=depth)
        self.error: BaseException | None = None
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="feature-cache-writer", daemon=True)
        self.thread.start()

    def check(self) -> None:
        if self.error is not None:
            raise self.error

    def put(self, item) -> None:
        while True:
            self.check()
            try:
                self.queue.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def _run(self) -> None:
        try:
            while True:
                item = self.queue.get()
                if self.stop.is_set():
                    return
                if item is None:
                    self.writer.flush()
                    return
                features, ready, ids, masks, lengths, done, release = item
                if ready is not None:
                    ready.synchronize()
                for row, length in enumerate(lengths):
                    self.writer.add(features[row, :length].clone(), ids[row, :length], masks[row, :length])
                release()
                if self.progress is not None:
                    self.progress.update(done)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            self.error = exc
        finally:
            try:  # whole shards already handed over are committed, whatever stopped us
                self.writer.close()
            except BaseException as exc:  # noqa: BLE001
                self.error = self.error or exc

    def close(self) -> None:
        """Write what is left and wait for the thread; raises its error."""
        self.put(None)
        self.thread.join()
        if self.error is not None:
            raise self.error

    def abort(self, timeout_s: float = 60.0) -> None:
        """Stop after the item in hand (a shard being written is finished), keeping what is queued
        out of the cache: the next run recomputes it."""
        self.stop.set()
        try:
            while True:
                self.queue.get_nowait()
        except queue.Empty:
            pass
        with contextlib.suppress(queue.Full):
            self.queue.put_nowait(None)  # wake the thread if it waits
        self.thread.join(timeout_s)


@torch.no_grad()
def write_cache(
    target,
    dataset: Dataset,
    cache_dir: str,
    header: dict,
    *,
    batch_size: int | None = None,
    shard_bytes: int = 2 << 30,
    say: Callable[[str], None] = print,
    progress=None,
) -> dict:
    """Compute and write features for every sequence of `dataset` (resuming after whole shards).

    Batches of `batch_size` sequences (default: about BATCH_TOKENS tokens) go through the target;
    a writer thread stores them while the next batch runs.
    """
    manifest, start = prepare(cache_dir, header)
    _check_space(target, dataset, cache_dir, header["dtype"], start, say)
    dtype = DTYPES[header["dtype"]]
    seq_len = dataset.input_ids.shape[1]
    batch_size = batch_size or auto_batch_size(seq_len)
    on_cuda = str(target.device).startswith("cuda")
    width = len(target.layer_ids) * target.hidden_size
    buffers = _HostBuffers(WRITE_QUEUE_DEPTH + 2, batch_size * seq_len * width, dtype) if on_cuda else None
    if progress is not None:  # its rate counts this run's sequences only
        progress.first = progress.done = start
    writer = _WriterThread(ShardWriter(cache_dir, manifest, shard_bytes, parallel=SHARD_WRITERS), progress)
    try:
        for begin in range(start, len(dataset), batch_size):
            end = min(begin + batch_size, len(dataset))
            writer.put(_features_of(target, dataset, begin, end, dtype, buffers, writer))
        writer.close()
    except BaseException:
        writer.abort()
        raise
    complete_manifest(cache_dir, manifest)
    return manifest


def _check_space(target, dataset: Dataset, cache_dir: str, dtype: str, start: int, say) -> None:
    """Say how much the cache needs and refuse when the filesystem lacks it."""
    estimate = disk_estimate(dataset, start, len(target.layer_ids), target.hidden_size, dtype)
    free = shutil.disk_usage(cache_dir).free
    say(
        f"feature cache: {estimate['sequences']} sequences to write ({start} already cached), "
        f"{estimate['tokens']} tokens x {len(target.layer_ids)} layers x {target.hidden_size} hidden x "
        f"{DTYPES[dtype].itemsize} bytes = {human_bytes(estimate['bytes'])} "
        f"({human_bytes(estimate['bytes_per_1k_tokens'])} per 1k tokens); "
        f"free on {cache_dir}: {human_bytes(free)}"
    )
    if estimate["bytes"] > free:
        raise DataError(
            cache_dir,
            f"needs {human_bytes(estimate['bytes'])} but the filesystem has "
            f"{human_bytes(free)} free. Fix: free space or choose another --out.",
        )


def _features_of(target, dataset: Dataset, begin: int, end: int, dtype, buffers, writer) -> tuple:
    """The writer's item for sequences begin..end: their features on the host (or on their way)."""
    attn = dataset.attention_mask[begin:end]
    ids = dataset.input_ids[begin:end]
    # Always the full seq_len: a sequence's features then do not depend on its batch (a resumed
    # cache is byte-identical to a fresh one); a batch cut to its longest sequence would not be.
    feats = target.features(ids.to(target.device), attention_mask=attn.to(target.device))
    if buffers is not None:
        host, ready, release = buffers.copy_of(feats.to(dtype), writer)
    else:
        host, ready, release = feats.to("cpu", dtype), None, (lambda: None)
    return host, ready, ids, dataset.loss_mask[begin:end], attn.sum(dim=1).tolist(), end, release


def complete_manifest(cache_dir: str, manifest: dict) -> None:
    """Total the shards into the manifest and mark the cache complete."""
    shards = manifest["shards"]
    manifest["counts"] = {
        "sequences": sum(s["count"] for s in shards),
        "tokens": sum(s["tokens"] for s in shards),
        "loss_tokens": sum(s["loss_tokens"] for s in shards),
        "bytes": sum(s["bytes"] for s in shards),
        "shards": len(shards),
    }
    manifest["complete"] = True
    write_manifest(cache_dir, manifest)


# ---- reading ------------------------------------------------------------------------------------


class CacheReader:
    """Random access to cached features; each shard's sha256 is checked on its first read."""

    def __init__(self, cache_dir: str, manifest: dict, pin_memory: bool = False):
        self.cache_dir, self.manifest, self.pin_memory = cache_dir, manifest, pin_memory
        self.shards = manifest["shards"]
        self.firsts = [s["first"] for s in self.shards]
        self.seq_len = manifest["seq_len"]
        self.width = len(manifest["layer_ids"]) * manifest["target"]["hidden_size"]
        self.dtype = DTYPES[manifest["dtype"]]
        self._verified: set[int] = set()
        self._verify_lock = threading.Lock()
        self._local = threading.local()  # safe_open handles are per thread
        self._offsets_of: dict[int, torch.Tensor] = {}

    def verify_all(self) -> None:
        """Check every shard's sha256 now rather than at its first read (before timed steps)."""
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
                    problem = shard_problem(self.cache_dir, self.shards[index], check_sha=True)
                    if problem:
                        raise DataError(
                            self.cache_dir,
                            problem + ". Fix: rerun `dflash-train data cache-features` "
                            "with the same --config and --out (it rewrites bad shards).",
                        )
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
        total = self.shards[-1]["first"] + self.shards[-1]["count"]
        ids = torch.full((total, self.seq_len), pad_id, dtype=torch.long)
        mask = torch.zeros(total, self.seq_len, dtype=torch.bool)
        attn = torch.zeros(total, self.seq_len, dtype=torch.bool)
        from safetensors import safe_open

        for shard in self.shards:
            with safe_open(os.path.join(self.cache_dir, shard["file"]), framework="pt") as f:
                offsets, flat_ids, flat_mask = (
                    f.get_tensor("offsets"),
                    f.get_tensor("input_ids"),
                    f.get_tensor("loss_mask"),
                )
            for local in range(shard["count"]):
                a, b = int(offsets[local]), int(offsets[local + 1])
                row = shard["first"] + local
                ids[row, : b - a] = flat_ids[a:b].long()
                mask[row, : b - a] = flat_mask[a:b]
                attn[row, : b - a] = True
        return ids, mask, attn


def open_cache(cache_dir: str, expected: dict, pin_memory: bool = False) -> Dataset:
    """The cache as a Dataset whose batches carry their features. Raises DataError (exit 2) when it
    is incomplete, made for another target/layer ids/seq_len, or a shard is missing or truncated."""
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
        problem = shard_problem(cache_dir, shard, check_sha=False)  # sizes now; sha256 on first read
        if problem:
            raise DataError(
                cache_dir,
                problem + ". Fix: rerun `dflash-train data cache-features` with the "
                "same --config and --out (it rewrites bad shards).",
            )
    reader = CacheReader(cache_dir, manifest, pin_memory=pin_memory)
    ids, mask, attn = reader.token_arrays(manifest["pad_id"])
    counts = manifest["counts"]
    return Dataset(
        ids,
        mask,
        attn,
        source=f"feature cache {cache_dir} ({counts['tokens']} tokens, "
        f"{human_bytes(counts['bytes'])}, {manifest['dtype']})",
        features=reader.features,
    )


def _building_device(cfg) -> str:
    """Where a tiny target is built for its head: the run's first CUDA device when CUDA is here (where
    cache-features built it), else the CPU."""
    devices = list(cfg.run.target_devices or []) + list(cfg.run.drafter_devices or [])
    on_cuda = [d for d in devices if str(d).startswith("cuda")]
    return on_cuda[0] if on_cuda and torch.cuda.is_available() else "cpu"


def training_source(cfg, dtype) -> tuple[list, Dataset]:
    """For `data.source: features`: one embedding+lm_head stand-in for the target per drafter replica
    (each is that replica's background loader thread) and the cache as a Dataset."""
    from trainer.data.target_head import load_target_head, weight_bytes

    head = load_target_head(
        cfg.target.spec,
        dtype,
        layer_ids=cfg.target.layer_ids,
        seed=cfg.train.seed,
        tiny=cfg.target.tiny or None,
        device=_building_device(cfg),
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
