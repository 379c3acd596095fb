"""The offline feature cache: manifest, resume per shard, refusals, corruption, and online == cached training."""
from __future__ import annotations

import hashlib
import io
import json
import os
import random
from pathlib import Path

import pytest
import torch

from trainer.data import cache_writer as cw
from trainer.data import feature_cache as fc
from trainer.cli.main import main as cli_main
from trainer.config import load_config
from trainer.data.dataset import BatchPlan, DataError, make_batch
from trainer.model import DFlashDrafter
from trainer.data.target import load_target
from trainer.data.target_head import load_target_head, weight_bytes
from trainer.train.loop import build_dataset, drafter_config, make_loss_fn, train
from trainer.train.workers import Replica


def chunk_sha(data: bytes, chunk: int = 16 << 20) -> str:
    """The manifest's shard checksum, from its definition: sha256 over the 16 MiB pieces' sha256."""
    pieces = [data[at:at + chunk] for at in range(0, max(len(data), 1), chunk)]
    return hashlib.sha256(b"".join(hashlib.sha256(p).digest() for p in pieces)).hexdigest()

pytestmark = [pytest.mark.timeout(180), pytest.mark.usefixtures("one_torch_thread")]

SEQ = 32



def pretokenized(path: Path, count: int = 12) -> str:
    """Records of different lengths (so batches have padding), loss on the second half."""
    rng = random.Random(0)
    with open(path, "w", encoding="utf-8") as f:
        for _i in range(count):
            n = rng.randint(12, SEQ)
            f.write(json.dumps({"input_ids": [rng.randrange(500) for _ in range(n)],
                                "loss_mask": [0] * (n // 2) + [1] * (n - n // 2)}) + "\n")
    return str(path)


def config(tmp_path, data_path, **extra):
    overrides = {"data.source": "jsonl", "data.path": data_path, "data.seq_len": SEQ, "train.batch_size": 2,
                 "train.num_anchors": 6, "run.torch_threads": 1, "run.log_every": 1000,
                 "run.drafter_devices": ["cpu"], "output_dir": str(tmp_path / "run")}
    overrides.update(extra)
    return load_config("tiny-cpu", overrides)


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """A tiny target, its jsonl data, and a fp32 cache of it in several shards."""
    root = tmp_path_factory.mktemp("cache")
    cfg = config(root, pretokenized(root / "data.jsonl"))
    target = load_target("tiny-random", "cpu", torch.float32, layer_ids=cfg.target.layer_ids, seed=0,
                         tiny=cfg.target.tiny)
    dataset = build_dataset(cfg, target)
    header = fc.cache_header(cfg, target, "fp32", 0)
    manifest = cw.write_cache(target, dataset, str(root / "fp32"), header, batch_size=3, shard_bytes=60_000,
                              say=lambda _: None)
    return cfg, target, dataset, header, manifest, root


def expected_for(cfg, target):
    return {"target": fc.target_identity(target), "layer_ids": list(target.layer_ids), "seq_len": cfg.data.seq_len}


def test_manifest_describes_the_cache(made):
    cfg, target, dataset, header, manifest, root = made
    assert manifest["complete"] and manifest["layer_ids"] == [1, 2, 3] and manifest["seq_len"] == SEQ
    assert manifest["dtype"] == "fp32" and manifest["data"]["sha256"] == fc.file_sha256(cfg.data.path)
    assert manifest["target"]["hidden_size"] == 64 and len(manifest["target"]["config_sha256"]) == 64
    tokens = int(dataset.attention_mask.sum())
    assert manifest["counts"]["sequences"] == 12 and manifest["counts"]["tokens"] == tokens  # no padding stored
    assert len(manifest["shards"]) >= 3  # the size cap split it
    for shard in manifest["shards"]:
        path = root / "fp32" / shard["file"]
        assert shard["bytes"] == path.stat().st_size and shard["sha256_chunks"] == chunk_sha(path.read_bytes())
    assert json.loads((root / "fp32" / "manifest.json").read_text()) == manifest


def test_cached_features_are_the_targets_features(made):
    cfg, target, dataset, header, manifest, root = made
    cached = fc.open_cache(str(root / "fp32"), expected_for(cfg, target))
    assert torch.equal(cached.input_ids, dataset.input_ids) and torch.equal(cached.loss_mask, dataset.loss_mask)
    idx = torch.tensor([7, 0, 11])
    online = target.features(dataset.input_ids[idx], attention_mask=dataset.attention_mask[idx])
    real = dataset.attention_mask[idx].unsqueeze(-1)
    got = cached.features(idx)
    assert torch.allclose(got * real, online * real, atol=1e-6)
    assert not got[~dataset.attention_mask[idx]].any()  # padding stays zero (never visible to a block)


def _loss_and_grads(cfg, target, dataset, batch_features=None):
    plan = BatchPlan(len(dataset), cfg.train.batch_size, 1, cfg.train.seed)
    batch = make_batch(dataset, plan, step=1, replica=0)
    if batch.features is None:
        batch.features = target.features(batch.input_ids, attention_mask=batch.attention_mask)
    batch.features = batch.features.float()
    torch.manual_seed(0)
    model = DFlashDrafter(drafter_config(cfg, target), target.embed_tokens, target.lm_head).float()
    out = make_loss_fn(cfg)(Replica(0, "cpu", model, None, None), batch)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("dtype, tol", [("fp32", 1e-6), ("bf16", 1e-3)])
def test_same_batch_online_and_from_the_cache_gives_the_same_loss_and_gradients(made, tmp_path, dtype, tol):
    cfg, target, dataset, header, manifest, root = made
    cache_dir = root / "fp32"
    if dtype == "bf16":
        cache_dir = tmp_path / "bf16"
        cw.write_cache(target, dataset, str(cache_dir), dict(header, dtype="bf16"), say=lambda _: None)
    cached = fc.open_cache(str(cache_dir), expected_for(cfg, target))
    online_loss, online_grads = _loss_and_grads(cfg, target, dataset)
    cached_loss, cached_grads = _loss_and_grads(cfg, target, cached)
    assert online_grads.keys() == cached_grads.keys() and len(online_grads) > 5
    assert abs(float(online_loss) - float(cached_loss)) <= tol, (online_loss, cached_loss)
    for name, grad in online_grads.items():
        diff = float((grad - cached_grads[name]).norm() / grad.norm().clamp_min(1e-12))
        assert diff <= (1e-5 if dtype == "fp32" else 2e-2), (name, diff)


def test_training_from_the_cache_loads_no_target_layers(made, tmp_path, monkeypatch):
    cfg, target, dataset, header, manifest, root = made
    import trainer.train.loop as train_module

    def no_target(*args, **kwargs):
        raise AssertionError("the full target must not be loaded when features come from a cache")

    monkeypatch.setattr(train_module, "load_target", no_target)
    run = config(tmp_path, str(root / "fp32"), **{"data.source": "features", "max_steps": 3,
                                                   "run.drafter_devices": ["cpu", "cpu"]})
    out = io.StringIO()
    result = train(run, out=out)
    assert result.steps_done == 3 and all(r.model.fc.weight.grad is None for r in result.replicas)
    assert "feature cache" in out.getvalue() and "target decoder layers not loaded" in out.getvalue()
    head = load_target_head("tiny-random", torch.float32, layer_ids=[1, 2, 3], tiny=cfg.target.tiny)
    assert torch.equal(head.embed_tokens.weight, target.embed_tokens.weight)
    assert torch.equal(head.lm_head.weight, target.lm_head.weight)


@pytest.mark.parametrize("override, difference", [
    ({"target.layer_ids": [1, 2]}, "layer_ids: cache [1, 2, 3], config [1, 2]"),
    ({"data.seq_len": 48}, "seq_len: cache 32, config 48"),
    ({"train.seed": 5}, "target.weights_fingerprint"),  # tiny-random's weights come from the seed
    ({"target.tiny": {"initializer_range": 0.05, "rms_norm_eps": 0.001}}, "target.config_sha256"),
])
def test_a_cache_for_another_setup_is_refused_with_the_difference(made, tmp_path, capsys, override, difference):
    cfg, target, dataset, header, manifest, root = made
    args = ["--config", "tiny-cpu", "--output-dir", str(tmp_path / "run"), "--drafter-devices", "cpu",
            "--set", "data.source=features", "--set", f"data.path={root / 'fp32'}", "--set", f"data.seq_len={SEQ}"]
    for key, value in override.items():
        args += ["--set", f"{key}={json.dumps(value)}"]
    assert cli_main(args) == 2
    err = capsys.readouterr().err
    assert "made for another setup" in err and difference in err, err
    assert len(err.strip().splitlines()) == 1


def test_a_truncated_or_corrupted_shard_is_named(made, tmp_path):
    cfg, target, dataset, header, manifest, root = made
    import shutil

    copy = tmp_path / "cache"
    shutil.copytree(root / "fp32", copy)
    victim = copy / manifest["shards"][1]["file"]
    data = victim.read_bytes()
    victim.write_bytes(data[:-100])
    with pytest.raises(DataError, match=f"{victim.name} is {len(data) - 100} bytes.*truncated"):
        fc.open_cache(str(copy), expected_for(cfg, target))
    victim.write_bytes(data[:-8] + bytes(8))  # same size, other content: found by sha256 on first read
    cached = fc.open_cache(str(copy), expected_for(cfg, target))
    first = manifest["shards"][1]["first"]
    cached.features(torch.tensor([0]))  # shard 0 is fine
    with pytest.raises(DataError, match=f"{victim.name} fails its sha256 check"):
        cached.features(torch.tensor([first]))
    reader = fc.open_cache(str(copy), expected_for(cfg, target)).features.__self__
    with pytest.raises(DataError, match=f"{victim.name} fails its sha256 check"):
        reader.verify_all()  # every shard now, before any read


def test_a_cache_with_whole_file_sha256_still_opens_and_catches_corruption(made, tmp_path):
    """Caches written before chunk digests name each shard's whole-file sha256."""
    cfg, target, dataset, header, manifest, root = made
    import shutil

    copy = tmp_path / "cache"
    shutil.copytree(root / "fp32", copy)
    old = dict(manifest, shards=[])
    for shard in manifest["shards"]:
        entry = {k: v for k, v in shard.items() if k != "sha256_chunks"}
        old["shards"].append(dict(entry, sha256=hashlib.sha256((copy / shard["file"]).read_bytes()).hexdigest()))
    fc.write_manifest(str(copy), old)
    fc.open_cache(str(copy), expected_for(cfg, target)).features.__self__.verify_all()
    victim = copy / old["shards"][0]["file"]
    data = victim.read_bytes()
    victim.write_bytes(data[:-8] + bytes(8))
    with pytest.raises(DataError, match=f"{victim.name} fails its sha256 check"):
        fc.open_cache(str(copy), expected_for(cfg, target)).features.__self__.verify_all()


def test_cache_features_resumes_after_the_last_whole_shard(made, tmp_path):
    cfg, target, dataset, header, manifest, root = made
    import shutil

    copy = tmp_path / "cache"
    shutil.copytree(root / "fp32", copy)
    # as a kill leaves it: manifest names 2 shards, a later shard file exists, half a .tmp too
    partial = dict(manifest, complete=False, shards=manifest["shards"][:2])
    partial.pop("counts")
    fc.write_manifest(str(copy), partial)
    (copy / "shard-00009.safetensors.tmp").write_bytes(b"half")
    computed = []
    real_features = target.features

    def counting(ids, attention_mask=None):
        computed.append(ids.shape[0])
        return real_features(ids, attention_mask=attention_mask)

    target.features = counting
    try:
        again = cw.write_cache(target, dataset, str(copy), header, batch_size=3, shard_bytes=60_000, say=lambda _: None)
    finally:
        del target.features
    done_before = sum(s["count"] for s in manifest["shards"][:2])
    assert sum(computed) == len(dataset) - done_before  # only the rest was computed
    assert [s["sha256_chunks"] for s in again["shards"]] == [s["sha256_chunks"] for s in manifest["shards"]]
    assert sorted(os.listdir(copy)) == sorted(["manifest.json"] + [s["file"] for s in manifest["shards"]])


def test_another_setup_in_the_out_dir_and_too_little_space_are_refused(made, tmp_path, monkeypatch):
    cfg, target, dataset, header, manifest, root = made
    with pytest.raises(DataError, match="seq_len: cache 32, config 48"):
        cw.write_cache(target, dataset, str(root / "fp32"), dict(header, seq_len=48), say=lambda _: None)
    lines = []

    class Tiny:
        free = 1000

    monkeypatch.setattr(cw.shutil, "disk_usage", lambda path: Tiny)
    with pytest.raises(DataError, match="needs .* but the filesystem has 1000 B free"):
        cw.write_cache(target, dataset, str(tmp_path / "new"), header, say=lines.append)
    assert "per 1k tokens" in lines[0]  # the estimate comes first
    assert not [n for n in os.listdir(tmp_path / "new") if n.startswith("shard-")]


def test_cache_features_command(tmp_path, capsys):
    data = pretokenized(tmp_path / "d.jsonl", count=4)
    args = ["data", "cache-features", "--config", "tiny-cpu", "--out", str(tmp_path / "c"), "--set", "data.source=jsonl",
            "--set", f"data.path={data}", "--set", f"data.seq_len={SEQ}"]
    assert cli_main(args) == 0
    out = capsys.readouterr().out
    assert "per 1k tokens" in out and "feature cache complete: 4 sequences" in out
    assert json.loads((tmp_path / "c" / "manifest.json").read_text())["dtype"] == "bf16"
    assert cli_main(args[:-2] + ["--set", "data.seq_len=48"]) == 2
    assert "other inputs" in capsys.readouterr().err


def test_gpu_memory_an_8b_target_no_longer_holds():
    from transformers import Qwen3Config

    qwen3_8b = Qwen3Config(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                           num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False)
    sizes = weight_bytes(qwen3_8b)
    h, i, layers = 4096, 12288, 36
    per_layer = h * (32 * 128) * 2 + h * (8 * 128) * 2 + 3 * h * i + 2 * h + 2 * 128  # attn, mlp, norms
    assert sizes["saved"] == 2 * (layers * per_layer + h)  # + the final norm
    assert sizes["embed_and_lm_head"] == 2 * 2 * 151936 * h
    assert 13.8e9 < sizes["saved"] < 14.0e9  # ~12.9 GiB of bf16 weights per target GPU


@pytest.mark.slow
def test_throughput_benchmark_cache_part_runs_small(tmp_path):
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[2]
    out = tmp_path / "features.md"
    proc = subprocess.run([sys.executable, str(repo / "benchmarks" / "train_throughput.py"), "--small", "--parts", "cache",
                           "--steps", "2", "--warmup", "1", "--shard-mb", "1", "--cache-dir", str(tmp_path),
                           "--out", str(out)], capture_output=True, text=True, timeout=170, cwd=repo,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    text = out.read_text()
    assert "| feature cache (disk) |" in text and "Cache-backed step (feature cache (disk)) vs drafter-only" in text, text
    report = json.loads((tmp_path / "features.json").read_text())["cache"]
    assert report["cache_bytes_per_1k_tokens"] == 1000 * (3 * 64 * 2 + 5)  # small dims: 3 layers x 64 hidden
    assert all(r["median_step_s"] > 0 for r in report["runs"].values())
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("feature-cache-")] == []  # cleaned up


def test_a_model_directory_head_reads_two_tensors_and_matches_the_full_target(made, tmp_path):
    cfg, target, dataset, header, manifest, root = made
    target.model.save_pretrained(tmp_path / "model")
    full = load_target(str(tmp_path / "model"), "cpu", torch.float32, layer_ids=[1, 2, 3])
    head = load_target_head(str(tmp_path / "model"), torch.float32, layer_ids=[1, 2, 3])
    assert torch.equal(head.embed_tokens.weight, target.embed_tokens.weight)
    assert torch.equal(head.lm_head.weight, target.lm_head.weight)
    assert not head.lm_head.weight.requires_grad and head.num_layers == 6
    # a cache written with the full model is accepted by a run that loads only the head
    assert fc.target_identity(head) == fc.target_identity(full) == fc.target_identity(target)


def test_rerunning_cache_features_rewrites_a_bad_shard_and_everything_after_it(made, tmp_path):
    cfg, target, dataset, header, manifest, root = made
    import shutil

    copy = tmp_path / "cache"
    shutil.copytree(root / "fp32", copy)
    victim = copy / manifest["shards"][1]["file"]
    victim.write_bytes(victim.read_bytes()[:-50])
    found, start = fc.prepare(str(copy), header)
    assert start == manifest["shards"][1]["first"] and not found["complete"]  # a kill now leaves it incomplete
    with pytest.raises(DataError, match="incomplete"):
        fc.open_cache(str(copy), expected_for(cfg, target))
    again = cw.write_cache(target, dataset, str(copy), header, batch_size=3, shard_bytes=60_000, say=lambda _: None)
    assert again["complete"] and [s["sha256_chunks"] for s in again["shards"]] == [s["sha256_chunks"] for s in manifest["shards"]]


def test_features_source_needs_a_path():
    from trainer.config import ConfigError

    with pytest.raises(ConfigError, match="`data.path` is required when data.source is features"):
        load_config("tiny-cpu", {"data.source": "features"})


def test_regenerate_then_cache_then_train_with_a_model_directory(made, tmp_path):
    """The whole route on a real HF directory (the tiny model + the byte-level ChatML tokenizer)."""
    from trainer.data.chat_tokenizer import byte_chat_tokenizer
    from trainer.data.regenerate import RegenerateOptions, regenerate

    cfg, target, dataset, header, manifest, root = made
    model_dir = tmp_path / "model"
    target.model.save_pretrained(model_dir)
    byte_chat_tokenizer(target.vocab_size).save_pretrained(model_dir)
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"question {i}"},
                                                      {"role": "assistant", "content": "written elsewhere"}]}) + "\n"
                             for i in range(4)), encoding="utf-8")
    regen = tmp_path / "regen.jsonl"
    summary = regenerate(RegenerateOptions(str(model_dir), str(chats), str(regen), max_new_tokens=8, batch_size=4),
                         out=io.StringIO(), tty=False)
    assert summary["records"] == 4
    base = {"target.spec": str(model_dir), "data.path": str(regen), "data.seq_len": 64}
    assert cli_main(["data", "cache-features", "--config", "tiny-cpu", "--out", str(tmp_path / "cache"),
                     *[a for k, v in dict(base, **{"data.source": "jsonl"}).items() for a in ("--set", f"{k}={v}")]]) == 0
    cache_manifest = json.loads((tmp_path / "cache" / "manifest.json").read_text())
    assert cache_manifest["tokenizer"]["vocab_size"] == 512 and cache_manifest["counts"]["loss_tokens"] > 0
    run = config(tmp_path, str(tmp_path / "cache"), **dict(base, **{"data.source": "features",
                                                                     "data.path": str(tmp_path / "cache"),
                                                                     "max_steps": 2}))
    assert train(run, out=io.StringIO()).steps_done == 2


def test_a_corrupted_shard_found_while_training_is_exit_2_naming_it(made, tmp_path, capsys):
    cfg, target, dataset, header, manifest, root = made
    import shutil

    copy = tmp_path / "cache"
    shutil.copytree(root / "fp32", copy)
    for shard in manifest["shards"]:  # same sizes, other bytes: only the sha256 check can tell
        path = copy / shard["file"]
        data = path.read_bytes()
        path.write_bytes(data[:-8] + bytes(8))
    args = ["--config", "tiny-cpu", "--output-dir", str(tmp_path / "run"), "--drafter-devices", "cpu",
            "--set", "data.source=features", "--set", f"data.path={copy}", "--set", f"data.seq_len={SEQ}",
            "--set", "train.batch_size=2", "--set", "train.num_anchors=6", "--max-steps", "2"]
    assert cli_main(args) == 2
    err = capsys.readouterr().err
    assert "fails its sha256 check (corrupted)" in err and "shard-0000" in err, err


def test_open_shard_handles_per_thread_are_capped(made, monkeypatch):
    cfg, target, dataset, header, manifest, root = made
    monkeypatch.setattr(fc, "OPEN_SHARDS_PER_THREAD", 2)
    cached = fc.open_cache(str(root / "fp32"), expected_for(cfg, target))
    reader = cached.features.__self__
    firsts = [s["first"] for s in manifest["shards"]]
    assert len(firsts) >= 3
    for _ in range(2):
        got = cached.features(torch.tensor(firsts))
        assert len(reader._local.handles) == 2
    idx = torch.tensor(firsts)
    online = target.features(dataset.input_ids[idx], attention_mask=dataset.attention_mask[idx])
    real = dataset.attention_mask[idx].unsqueeze(-1)
    assert torch.allclose(got * real, online * real, atol=1e-6)


@pytest.mark.slow
def test_two_torchrun_ranks_from_the_cache_follow_the_threaded_run(made, tmp_path):
    import socket
    import subprocess
    import sys

    from trainer import metrics_format

    cfg, target, dataset, header, manifest, root = made
    cache = str(root / "fp32")
    threaded = config(tmp_path / "threads", cache, **{"data.source": "features", "max_steps": 3,
                                                      "run.drafter_devices": ["cpu", "cpu"]})
    train(threaded, out=io.StringIO())
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    repo = Path(__file__).resolve().parents[2]
    sets = {"data.source": "features", "data.path": cache, "data.seq_len": SEQ, "train.batch_size": 2,
            "train.num_anchors": 6, "run.torch_threads": 1}
    cmd = ["timeout", "-k", "10", "150", sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(port), "-m", "trainer", "--config", "tiny-cpu",
           "--launcher", "torchrun", "--output-dir", str(tmp_path / "ranks"), "--max-steps", "3",
           *[a for k, v in sets.items() for a in ("--set", f"{k}={v}")]]
    proc = subprocess.run(cmd, cwd=repo, env=dict(os.environ, PYTHONPATH=str(repo), OMP_NUM_THREADS="1"),
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    def losses(path):
        return [r["loss"] for r in metrics_format.parse_lines(Path(path).read_text()) if r["event"] == "step"]

    ranked, reference = losses(tmp_path / "ranks" / "metrics.jsonl"), losses(threaded.metrics_path)
    assert len(ranked) == 3 and ranked == pytest.approx(reference, rel=1e-6)


# ---- batched target forwards + the writer thread ---------------------------------------------------

def _shards_by_save_file(target, dataset, out: Path, shard_bytes: int) -> list[str]:
    """The reference for byte identity: features 4 sequences per forward, shards cut after the
    sequence that takes them to shard_bytes, each written whole by safetensors' save_file."""
    from safetensors.torch import save_file

    pieces, names, size = [], [], 0
    out.mkdir()
    for begin in range(0, len(dataset), 4):
        attn = dataset.attention_mask[begin:begin + 4]
        feats = target.features(dataset.input_ids[begin:begin + 4], attention_mask=attn).to("cpu", torch.bfloat16)
        for row in range(attn.shape[0]):
            n = int(attn[row].sum())
            pieces.append((feats[row, :n], dataset.input_ids[begin + row, :n].to(torch.int32),
                           dataset.loss_mask[begin + row, :n]))
            size += n * (feats.shape[-1] * 2 + 5)
            if size >= shard_bytes or begin + row == len(dataset) - 1:
                lengths = [p[0].shape[0] for p in pieces]
                names.append(f"shard-{len(names):05d}.safetensors")
                save_file({"features": torch.cat([p[0] for p in pieces]), "input_ids": torch.cat([p[1] for p in pieces]),
                           "loss_mask": torch.cat([p[2] for p in pieces]),
                           "offsets": torch.tensor([0, *lengths], dtype=torch.int64).cumsum(0)}, str(out / names[-1]))
                pieces, size = [], 0
    return names


@pytest.fixture(scope="module")
def tiny_cpu(tmp_path_factory):
    """The tiny-cpu config's target and synthetic data (fewer sequences: 300, two auto batches)."""
    cfg = load_config("tiny-cpu", {"data.synthetic.num_samples": 300})
    target = load_target("tiny-random", "cpu", torch.float32, layer_ids=cfg.target.layer_ids, seed=0,
                         tiny=cfg.target.tiny)
    with torch.no_grad():
        dataset = build_dataset(cfg, target)
    return cfg, target, dataset, fc.cache_header(cfg, target, "bf16", 0)


def test_the_streamed_cache_is_byte_identical_to_save_file_of_each_shard(tiny_cpu, tmp_path):
    cfg, target, dataset, header = tiny_cpu
    assert cw.auto_batch_size(cfg.data.seq_len) == 256  # 300 sequences: a full and a partial batch
    shard_bytes = 2_000_000  # several shards
    with torch.no_grad():
        names = _shards_by_save_file(target, dataset, tmp_path / "whole", shard_bytes)
    new = cw.write_cache(target, dataset, str(tmp_path / "new"), header, shard_bytes=shard_bytes,
                         say=lambda _: None)
    assert len(new["shards"]) >= 3 and [s["file"] for s in new["shards"]] == names
    for shard in new["shards"]:
        data = (tmp_path / "new" / shard["file"]).read_bytes()
        assert data == (tmp_path / "whole" / shard["file"]).read_bytes()
        assert shard["sha256_chunks"] == chunk_sha(data) and shard["bytes"] == len(data)


def test_an_interrupted_cache_keeps_its_whole_shards_and_resumes_identically(tiny_cpu, tmp_path, monkeypatch):
    cfg, target, dataset, header = tiny_cpu
    fresh = cw.write_cache(target, dataset, str(tmp_path / "fresh"), header, batch_size=32, shard_bytes=500_000,
                           say=lambda _: None)
    real_features, calls = target.features, []

    def interrupted(*args, **kwargs):
        calls.append(1)
        if len(calls) == 6:
            raise KeyboardInterrupt
        return real_features(*args, **kwargs)

    monkeypatch.setattr(target, "features", interrupted)
    with pytest.raises(KeyboardInterrupt):
        cw.write_cache(target, dataset, str(tmp_path / "cut"), header, batch_size=32, shard_bytes=500_000,
                       say=lambda _: None)
    cut = fc.read_manifest(str(tmp_path / "cut"))
    assert not cut["complete"] and 1 <= len(cut["shards"]) < len(fresh["shards"])
    monkeypatch.setattr(target, "features", real_features)
    again = cw.write_cache(target, dataset, str(tmp_path / "cut"), header, batch_size=32, shard_bytes=500_000,
                           say=lambda _: None)
    assert [s["sha256_chunks"] for s in again["shards"]] == [s["sha256_chunks"] for s in fresh["shards"]]


def test_a_writer_thread_failure_reaches_the_caller(tiny_cpu, tmp_path, monkeypatch):
    cfg, target, dataset, header = tiny_cpu

    def full_disk(self, file, shard):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(cw.ShardStream, "_finish", full_disk)
    with pytest.raises(OSError, match="No space left"):
        cw.write_cache(target, dataset, str(tmp_path / "full"), header, batch_size=16, shard_bytes=100_000,
                       say=lambda _: None)


def test_a_shard_that_fails_to_finish_is_the_last_the_manifest_could_name(tiny_cpu, tmp_path, monkeypatch):
    """Shards are finished in order on their own thread: once one fails, none after it is named
    (a gap would make a resume skip its sequences)."""
    from trainer.data.safetensors_stream import StreamedFile

    cfg, target, dataset, header = tiny_cpu
    real_finish, calls = StreamedFile.finish, []

    def second_fails(self):
        calls.append(self.path)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return real_finish(self)

    monkeypatch.setattr(StreamedFile, "finish", second_fails)
    with pytest.raises(OSError, match="No space left"):
        cw.write_cache(target, dataset, str(tmp_path / "c"), header, batch_size=64, shard_bytes=200_000,
                       say=lambda _: None)
    named = fc.read_manifest(str(tmp_path / "c"))["shards"]
    assert len(calls) >= 2 and [s["file"] for s in named] == ["shard-00000.safetensors"]
    monkeypatch.setattr(StreamedFile, "finish", real_finish)
    fresh = cw.write_cache(target, dataset, str(tmp_path / "fresh"), header, batch_size=64, shard_bytes=200_000,
                           say=lambda _: None)
    again = cw.write_cache(target, dataset, str(tmp_path / "c"), header, batch_size=64, shard_bytes=200_000,
                           say=lambda _: None)
    assert [s["sha256_chunks"] for s in again["shards"]] == [s["sha256_chunks"] for s in fresh["shards"]]



def _drop(key):
    return lambda m: {k: v for k, v in m.items() if k != key}


@pytest.mark.parametrize("damage, said", [
    (lambda m: [1, 2], "unreadable manifest (list, not a JSON object)"),
    (_drop("counts"), "unreadable manifest ('counts' missing or not integers"),
    (_drop("pad_id"), "unreadable manifest ('pad_id' missing or not int)"),
    (lambda m: dict(m, pad_id=True), "unreadable manifest ('pad_id' missing or not int)"),
    (lambda m: dict(m, dtype="fp8"), "unreadable manifest (dtype 'fp8' is none of ['bf16', 'fp32'])"),
    (lambda m: dict(m, layer_ids=["1"]), "unreadable manifest (target.hidden_size or layer_ids not integers)"),
    (lambda m: dict(m, shards=[]), "unreadable manifest (complete, but no shards)"),
    (lambda m: dict(m, shards=[{"file": m["shards"][0]["file"]}]),
     "unreadable manifest (shards[0]: first, count, tokens, loss_tokens, bytes missing or mistyped)"),
    (lambda m: dict(m, shards=[dict(s, first=0) for s in m["shards"]]),
     "unreadable manifest (shards[1]: sequences 0+"),
    (lambda m: dict(m, shards=m["shards"][:-1] + [dict(m["shards"][-1], count=m["shards"][-1]["count"] + 1)]),
     "unreadable manifest (shard-"),
])
def test_a_damaged_manifest_is_one_line_naming_it_when_training(made, tmp_path, capsys, damage, said):
    """Each was a traceback and `training failed: 'counts'` (exit 1); shards whose sequences overlap trained on
    the wrong rows, silently."""
    import shutil

    cfg, target, dataset, header, manifest, root = made
    copy = tmp_path / "cache"
    shutil.copytree(root / "fp32", copy)
    (copy / "manifest.json").write_text(json.dumps(damage(json.loads((copy / "manifest.json").read_text()))))
    args = ["--config", "tiny-cpu", "--output-dir", str(tmp_path / "run"), "--drafter-devices", "cpu",
            "--set", "data.source=features", "--set", f"data.path={copy}", "--set", f"data.seq_len={SEQ}",
            "--set", "train.batch_size=2", "--set", "train.num_anchors=6", "--max-steps", "2"]
    assert cli_main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"dflash-train: error: {copy / 'manifest.json'}: {said}"), err
    assert f"Fix: delete {copy} and rerun `dflash-train data cache-features`" in err[0]


def test_a_manifest_that_is_a_directory_is_unreadable_not_missing(made, tmp_path):
    """It said "no manifest.json: not a feature cache"."""
    cfg, target, dataset, header, manifest, root = made
    (tmp_path / "manifest.json").mkdir()
    with pytest.raises(DataError, match=r"manifest.json: unreadable manifest \(\[Errno 21\] Is a directory"):
        fc.open_cache(str(tmp_path), expected_for(cfg, target))


def test_cache_features_into_a_cache_whose_shard_entries_are_damaged_refuses_and_deletes_nothing(made, tmp_path):
    """prepare() said KeyError ('failed', exit 1) and could have deleted shards before finding out."""
    import shutil

    cfg, target, dataset, header, manifest, root = made
    copy = tmp_path / "cache"
    shutil.copytree(root / "fp32", copy)
    shards = sorted(p.name for p in copy.glob("shard-*"))
    (copy / "manifest.json").write_text(json.dumps(dict(manifest, shards=[{"file": shards[0]}, "x"])))
    with pytest.raises(DataError, match=r"manifest.json: unreadable manifest \(shards\[0\]: first, count, tokens"):
        fc.prepare(str(copy), header)
    assert sorted(p.name for p in copy.glob("shard-*")) == shards


def test_a_shard_whose_header_is_damaged_is_named_at_startup(made, tmp_path):
    """safe_open of a same-size shard with a damaged header raised SafetensorError (a traceback)."""
    import shutil

    cfg, target, dataset, header, manifest, root = made
    copy = tmp_path / "cache"
    shutil.copytree(root / "fp32", copy)
    victim = copy / manifest["shards"][0]["file"]
    data = bytearray(victim.read_bytes())
    data[8:20] = b"#" * 12
    victim.write_bytes(bytes(data))
    with pytest.raises(DataError, match=f"{victim.name} fails its sha256 check"):
        fc.open_cache(str(copy), expected_for(cfg, target))
