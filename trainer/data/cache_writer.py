"""Writing a feature cache: features streamed into shards while the target computes the next batch.

Shard boundaries follow from sequence lengths alone, so a shard's header and token arrays are written
before its features, which go from the host buffer to the file once, through the checksum. Shards are
committed in order by a thread of their own: a kill leaves only whole, named shards, and a resumed
cache is byte-identical to a fresh one.
"""

from __future__ import annotations

import contextlib
import os
import queue
import shutil
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import torch

from trainer.data import chunk_digest
from trainer.data.dataset import DataError, Dataset
from trainer.data.feature_cache import (
    DTYPES,
    TOKEN_BYTES,
    bytes_per_token,
    complete_manifest,
    feature_width,
    human_bytes,
    prepare,
    write_manifest,
)
from trainer.data.safetensors_stream import StreamedFile, layout_of

# Sequences per target forward when no batch size is given: about this many tokens.
BATCH_TOKENS = 16384
WRITE_QUEUE_DEPTH = 2  # batches computed ahead of the writer thread


def auto_batch_size(seq_len: int) -> int:
    return max(1, BATCH_TOKENS // max(1, seq_len))


def shard_plan(lengths: list[int], token_bytes: int, shard_bytes: int) -> list[tuple[int, int]]:
    """(first, count) of consecutive shards over `lengths` (indices relative to its start)."""
    plan, first, size = [], 0, 0
    for index, length in enumerate(lengths):
        size += length * token_bytes
        if size >= shard_bytes:
            plan.append((first, index + 1 - first))
            first, size = index + 1, 0
    if first < len(lengths):
        plan.append((first, len(lengths) - first))
    return plan


class ShardStream:
    """The cache's shards from sequence `start` of `tokens` on, written as `add` hands over
    features in sequence order. `close` commits the finished shards and drops one left open."""

    def __init__(self, cache_dir: str, manifest: dict, tokens: Dataset, start: int, shard_bytes: int):
        self.cache_dir, self.manifest, self.tokens = cache_dir, manifest, tokens
        self.dtype, self.width = DTYPES[manifest["dtype"]], feature_width(manifest)
        self.lengths = [int(n) for n in tokens.attention_mask.sum(dim=1).tolist()]
        token_bytes = self.width * self.dtype.itemsize + TOKEN_BYTES
        relative = shard_plan(self.lengths[start:], token_bytes, shard_bytes)
        self.plan = [(start + first, count) for first, count in relative]
        self._files, self._started = len(manifest["shards"]), 0  # shards kept from before; started now
        self._open: tuple[StreamedFile, dict, dict] | None = None  # file, manifest entry, known tensors
        self._row = 0  # sequences written into the open shard
        self._finisher = ThreadPoolExecutor(1, thread_name_prefix="shard-finisher")
        self._finishing: list[Future] = []
        self._failed = False

    def add(self, features: torch.Tensor, count: int) -> None:
        """The next `count` sequences' features: rows of `features` [rows, seq_len, width]."""
        for done in [f for f in self._finishing if f.done()]:
            done.result()  # a finisher's error surfaces here
        for row in range(count):
            if self._open is None:
                self._open = self._start_shard()
            file, shard, _ = self._open
            file.write("features", features[row, : self.lengths[shard["first"] + self._row]])
            self._row += 1
            if self._row == shard["count"]:
                self._end_shard()

    def _start_shard(self) -> tuple[StreamedFile, dict, dict]:
        first, count = self.plan[self._started]
        lengths = self.lengths[first : first + count]
        known = {
            "input_ids": [self.tokens.input_ids[i, :n].to(torch.int32) for i, n in enumerate(lengths, first)],
            "loss_mask": [self.tokens.loss_mask[i, :n].to(torch.bool) for i, n in enumerate(lengths, first)],
            "offsets": [torch.tensor([0, *lengths], dtype=torch.int64).cumsum(0)],
        }
        tokens = sum(lengths)
        layout = {name: layout_of(name, pieces) for name, pieces in known.items()}
        layout["features"] = (self.dtype, [tokens, self.width])
        name = f"shard-{self._files + self._started:05d}.safetensors"
        self._started, self._row = self._started + 1, 0
        file = StreamedFile(os.path.join(self.cache_dir, name + ".tmp"), layout)
        loss_tokens = sum(int(m.sum()) for m in known["loss_mask"])
        shard = {"file": name, "first": first, "count": count, "tokens": tokens, "loss_tokens": loss_tokens}
        _write_known(file, known)
        return file, shard, known

    def _end_shard(self) -> None:
        assert self._open is not None
        file, shard, known = self._open
        _write_known(file, known)
        self._open = None
        self._finishing.append(self._finisher.submit(self._finish, file, shard))

    def _finish(self, file: StreamedFile, shard: dict) -> None:
        if self._failed:  # an earlier shard is not committed: naming this one would leave a gap
            file.close()
            return
        try:
            size, digest = file.finish()
            os.replace(file.path, os.path.join(self.cache_dir, shard["file"]))
        except BaseException:
            self._failed = True
            raise
        self.manifest["shards"].append(dict(shard, bytes=size, **{chunk_digest.FIELD: digest}))
        write_manifest(self.cache_dir, self.manifest)  # the shard exists before the manifest names it

    def close(self) -> None:
        """Wait for the finishing shards in order (raising the first error); drop a shard left open."""
        try:
            if self._open is not None:
                self._open[0].close()
                self._open = None
            for future in self._finishing:
                future.result()
        finally:
            self._finisher.shutdown(wait=True)


def _write_known(file: StreamedFile, known: dict[str, list[torch.Tensor]]) -> None:
    """Write the known tensors up to the streamed one (features) or to the end."""
    while file.current is not None and file.current != "features":
        name = file.current
        for piece in known[name]:
            file.write(name, piece)
        if file.current == name:
            raise ValueError(f"{file.path}: {name} is shorter than its shape says")


class _HostBuffers:
    """Up to `count` reusable pinned buffers (an async copy overlaps the next forward; pinning is slow)."""

    def __init__(self, count: int, numel: int, dtype: torch.dtype):
        self.free: queue.Queue = queue.Queue()
        self.left, self.numel, self.dtype = count, numel, dtype

    def _take(self, writer: _WriterThread) -> torch.Tensor:
        while True:  # buffers come back as the writer is done with them
            writer.check()
            try:
                return self.free.get_nowait()
            except queue.Empty:
                if self.left > 0:
                    self.left -= 1
                    return torch.empty(self.numel, dtype=self.dtype, pin_memory=True)
            with contextlib.suppress(queue.Empty):
                return self.free.get(timeout=0.1)

    def copy_of(self, features: torch.Tensor, writer: _WriterThread):
        """(host tensor, its ready event, release) for an on-device tensor; the copy is asynchronous."""
        flat = self._take(writer)
        host = flat[: features.numel()].view(features.shape)
        host.copy_(features, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return host, ready, lambda: self.free.put(flat)


class _WriterThread:
    """ShardStream.add on a thread of its own; its error is raised at the caller's next put() or close()."""

    def __init__(self, writer: ShardStream, progress):
        self.writer, self.progress = writer, progress
        self.queue: queue.Queue = queue.Queue(maxsize=WRITE_QUEUE_DEPTH)
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
            with contextlib.suppress(queue.Full):
                self.queue.put(item, timeout=0.1)
                return

    def _run(self) -> None:
        try:
            while True:
                item = self.queue.get()
                if item is None or self.stop.is_set():
                    return
                features, ready, count, done, release = item
                if ready is not None:
                    ready.synchronize()
                self.writer.add(features, count)
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
        self.check()

    def abort(self, timeout_s: float = 60.0) -> None:
        """Stop after the item in hand; what is queued stays out of the cache (the next run recomputes it)."""
        self.stop.set()
        with contextlib.suppress(queue.Empty):
            while True:
                self.queue.get_nowait()
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
    """Compute and write features for every sequence of `dataset`, resuming after whole shards."""
    manifest, start = prepare(cache_dir, header)
    _check_space(target, dataset, cache_dir, header["dtype"], start, say)
    dtype = DTYPES[header["dtype"]]
    seq_len = dataset.input_ids.shape[1]
    batch_size = batch_size or auto_batch_size(seq_len)
    on_cuda = str(target.device).startswith("cuda")
    numel = batch_size * seq_len * feature_width(manifest)
    buffers = _HostBuffers(WRITE_QUEUE_DEPTH + 2, numel, dtype) if on_cuda else None
    if progress is not None:  # its rate counts this run's sequences only
        progress.first = progress.done = start
    writer = _WriterThread(ShardStream(cache_dir, manifest, dataset, start, shard_bytes), progress)
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
    tokens = int(dataset.attention_mask[start:].sum())
    per_token = bytes_per_token(len(target.layer_ids), target.hidden_size, dtype)
    free = shutil.disk_usage(cache_dir).free
    say(
        f"feature cache: {len(dataset) - start} sequences to write ({start} already cached), "
        f"{tokens} tokens x {len(target.layer_ids)} layers x {target.hidden_size} hidden x "
        f"{DTYPES[dtype].itemsize} bytes = {human_bytes(tokens * per_token)} "
        f"({human_bytes(1000 * per_token)} per 1k tokens); "
        f"free on {cache_dir}: {human_bytes(free)}"
    )
    if tokens * per_token > free:
        raise DataError(
            cache_dir,
            f"needs {human_bytes(tokens * per_token)} but the filesystem has "
            f"{human_bytes(free)} free. Fix: free space or choose another --out.",
        )


def _features_of(target, dataset: Dataset, begin: int, end: int, dtype, buffers, writer) -> tuple:
    """The writer's item for sequences begin..end: their features on the host (or on their way)."""
    attn = dataset.attention_mask[begin:end]
    ids = dataset.input_ids[begin:end]
    # the full seq_len, not the batch's longest: features independent of the batch keep resumes identical
    feats = target.features(ids.to(target.device), attention_mask=attn.to(target.device))
    if buffers is not None:
        host, ready, release = buffers.copy_of(feats.to(dtype), writer)
    else:
        host, ready, release = feats.to("cpu", dtype), None, (lambda: None)
    return host, ready, end - begin, end, release
