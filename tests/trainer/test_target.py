"""The frozen target: features equal Hugging Face hidden states, tiny-random and local loading."""
from __future__ import annotations

import threading

import pytest
import torch

from trainer.config import ConfigError
from trainer.model import DFlashDrafter, DrafterConfig
from trainer.data.target import default_layer_ids, load_target
from tests.trainer.conftest import run_in_threads


@pytest.fixture(scope="module")
def tiny():
    return load_target("tiny-random", "cpu", torch.float32, seed=0)


def hf_reference(target, input_ids, layer_ids, attention_mask=None):
    """What the DFlash convention asks for: HF output_hidden_states[l + 1], concatenated."""
    with torch.no_grad():
        out = target.model(input_ids, attention_mask=attention_mask, output_hidden_states=True)
    return torch.cat([out.hidden_states[layer + 1] for layer in layer_ids], dim=-1)


def test_tiny_target_shape_and_defaults(tiny):
    assert (tiny.num_layers, tiny.hidden_size, tiny.vocab_size) == (6, 64, 512)
    assert tiny.layer_ids == [1, 2, 3]      # spread over 1 .. num_layers-3
    assert tiny.tokenizer is None
    assert tiny.mask_token_id == 511        # no tokenizer: the last embedding row
    assert tiny.device == "cpu"
    assert not tiny.embed_tokens.weight.requires_grad
    assert not tiny.lm_head.weight.requires_grad
    assert not any(p.requires_grad for p in tiny.model.parameters())


def test_features_equal_hf_hidden_states(tiny):
    ids = torch.randint(0, 512, (2, 17), generator=torch.Generator().manual_seed(0))
    feats = tiny.features(ids)
    assert feats.shape == (2, 17, 3 * 64)
    assert torch.equal(feats, hf_reference(tiny, ids, tiny.layer_ids))


def test_features_any_order_including_the_last_layer():
    # HF reports the LAST layer after the final norm; the features must follow HF exactly.
    target = load_target("tiny-random", "cpu", torch.float32, layer_ids=[5, 0, 3])
    ids = torch.randint(0, 512, (1, 9), generator=torch.Generator().manual_seed(1))
    assert torch.allclose(target.features(ids), hf_reference(target, ids, [5, 0, 3]), atol=1e-6)


def test_features_with_padding_mask(tiny):
    ids = torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, 8:] = 0
    got = tiny.features(ids, attention_mask=mask)
    want = hf_reference(tiny, ids, tiny.layer_ids, attention_mask=mask)
    assert torch.allclose(got[:, :8], want[:, :8], atol=1e-6)
    assert torch.allclose(got[0], want[0], atol=1e-6)


def test_layers_after_the_last_needed_one_do_not_run(tiny):
    calls = []
    handles = [layer.register_forward_hook(lambda m, a, o, i=i: calls.append(i))
               for i, layer in enumerate(tiny.model.model.layers)]
    try:
        tiny.features(torch.zeros(1, 4, dtype=torch.long))
    finally:
        for h in handles:
            h.remove()
    assert calls == [0, 1, 2, 3]
    # the hooks used to stop early are gone: a full forward runs every layer afterwards
    out = tiny.model(torch.zeros(1, 4, dtype=torch.long), output_hidden_states=True)
    assert len(out.hidden_states) == 7


def test_features_feed_autograd_and_carry_no_grad(tiny):
    feats = tiny.features(torch.zeros(1, 5, dtype=torch.long))
    assert not feats.requires_grad and not feats.is_inference()
    proj = torch.nn.Linear(feats.shape[-1], 2)
    proj(feats).sum().backward()  # would fail on an inference-mode tensor
    assert proj.weight.grad is not None


def test_features_from_several_threads(tiny):
    ids = [torch.randint(0, 512, (1, 10), generator=torch.Generator().manual_seed(s)) for s in range(4)]
    want = [tiny.features(i) for i in ids]
    got = [None] * 4

    def work(k):
        got[k] = tiny.features(ids[k])

    assert not run_in_threads(4, work)
    assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_another_threads_forward_is_not_cut_short(tiny):
    # While features() has its stop-early hooks installed, a full forward from another thread
    # (e.g. synthetic data generation) must still run every layer.
    ids = torch.randint(0, 512, (1, 6), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = tiny.model(ids, output_hidden_states=True).hidden_states
    inside, other_done, got, errors = threading.Event(), threading.Event(), [], []
    features_thread = []

    def hold_features(_m, _a, _o):
        if threading.current_thread() is features_thread[0]:
            inside.set()
            other_done.wait(30)

    def other():
        try:
            inside.wait(30)
            with torch.no_grad():
                got.append(tiny.model(ids, output_hidden_states=True).hidden_states)
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)
        finally:
            other_done.set()

    handle = tiny.model.model.layers[0].register_forward_hook(hold_features)
    try:
        features_thread.append(threading.Thread(target=tiny.features, args=(ids,)))
        side = threading.Thread(target=other)
        side.start()
        features_thread[0].start()
        features_thread[0].join(60)
        side.join(60)
    finally:
        handle.remove()
    assert inside.is_set() and not errors
    assert len(got[0]) == 7 and all(torch.equal(g, w) for g, w in zip(got[0], want))


def test_tiny_target_is_seeded_and_leaves_global_rng_alone():
    torch.manual_seed(123)
    expected_next = torch.rand(3)
    torch.manual_seed(123)
    a = load_target("tiny-random", "cpu", torch.float32, seed=4)
    assert torch.equal(torch.rand(3), expected_next)
    b = load_target("tiny-random", "cpu", torch.float32, seed=4)
    c = load_target("tiny-random", "cpu", torch.float32, seed=5)
    assert torch.equal(a.lm_head.weight, b.lm_head.weight)
    assert not torch.equal(a.lm_head.weight, c.lm_head.weight)


def test_tiny_overrides_and_dtype():
    target = load_target("tiny-random", "cpu", torch.bfloat16,
                         tiny={"num_hidden_layers": 8, "hidden_size": 32, "head_dim": 8})
    assert (target.num_layers, target.hidden_size) == (8, 32)
    assert target.layer_ids == [1, 2, 3, 4, 5]
    assert target.features(torch.zeros(1, 3, dtype=torch.long)).dtype == torch.bfloat16


def test_default_layer_ids():
    # The published DFlash drafter for the 36-layer Qwen3-8B reads layers [1, 9, 17, 25, 33].
    assert default_layer_ids(36) == [1, 9, 17, 25, 33]
    assert default_layer_ids(28) == [1, 7, 13, 19, 25]
    assert default_layer_ids(36, k=3) == [1, 17, 33]
    with pytest.raises(ConfigError, match="target.layer_ids"):
        default_layer_ids(3)


def test_bad_inputs_name_the_field(tmp_path):
    with pytest.raises(ConfigError, match=r"target\.layer_ids.*\[0, 5\]"):
        load_target("tiny-random", "cpu", torch.float32, layer_ids=[1, 6])
    with pytest.raises(ConfigError, match=r"target\.spec.*Fix"):
        load_target(str(tmp_path / "no-such-model"), "cpu", torch.float32)
    with pytest.raises(ConfigError, match=r"target\.tiny.*hiden_size"):
        load_target("tiny-random", "cpu", torch.float32, tiny={"hiden_size": 32})
    with pytest.raises(ConfigError, match=r"target\.spec"):
        load_target(str(tmp_path), "cpu", torch.float32)  # a directory without a model


def save_word_tokenizer(path, vocab_size):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<pad>": 1}
    vocab.update({f"w{i}": i for i in range(2, vocab_size)})
    tok = Tokenizer(WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>").save_pretrained(path)


def test_local_hf_directory(tiny, tmp_path):
    tiny.model.save_pretrained(tmp_path)
    save_word_tokenizer(tmp_path, 512)
    local = load_target(str(tmp_path), "cpu", torch.float32, layer_ids=[0, 2])
    assert local.tokenizer is not None
    assert local.tokenizer("w5 w7")["input_ids"] == [5, 7]
    assert local.mask_token_id == 1   # the tokenizer's pad token
    ids = torch.randint(0, 512, (1, 8), generator=torch.Generator().manual_seed(3))
    assert torch.allclose(local.features(ids), hf_reference(tiny, ids, [0, 2]), atol=1e-6)


def test_drafter_config_for_target(tiny):
    cfg = DrafterConfig.for_target(tiny, num_layers=1, block_size=4)
    assert (cfg.hidden_size, cfg.vocab_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (
        64, 512, 4, 2, 16)
    assert cfg.target_layer_ids == [1, 2, 3] and cfg.num_target_layers == 6
    assert cfg.mask_token_id == 511 and cfg.rope_theta == tiny.config.rope_parameters["rope_theta"]
    drafter = DFlashDrafter(cfg, tiny.embed_tokens, tiny.lm_head)
    assert drafter.fc.weight.shape == (64, 3 * 64)


def test_a_model_directory_without_tokenizer_files_has_no_tokenizer(tiny, tmp_path):
    """Transformers builds an empty tokenizer (pad id 0) for such a directory; its pad id must not
    become the mask token: the last embedding row stays the mask, as for a tiny target."""
    from trainer.data.target_head import load_target_head

    tiny.model.save_pretrained(tmp_path)
    local = load_target(str(tmp_path), "cpu", torch.float32, layer_ids=[0, 2])
    head = load_target_head(str(tmp_path), torch.float32, layer_ids=[0, 2])
    assert local.tokenizer is None and local.mask_token_id == 511
    assert head.mask_token_id == 511
