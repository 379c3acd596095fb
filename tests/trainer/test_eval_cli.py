"""`dflash-train eval`: the report, the lossless verdict, and one clear line for each bad input."""
from __future__ import annotations

import io
import json

import pytest
import torch

from trainer.cli import main as cli

from trainer.infer import speculative
from trainer.train.checkpoint import save_checkpoint
from trainer.config import load_config
from trainer.data.prompts import load_prompts
from trainer.infer.export import export_drafter
from trainer.model import DFlashDrafter, DrafterConfig
from trainer.data.target import load_target

pytestmark = pytest.mark.timeout(240)


class Tty(io.StringIO):
    def __init__(self, tty: bool):
        super().__init__()
        self.tty = tty

    def isatty(self):
        return self.tty


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A run directory holding one checkpoint of an untrained tiny-cpu drafter (no training needed)."""
    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("run")
    cfg = load_config("tiny-cpu", {"output_dir": str(out), "data.synthetic.num_samples": 40,
                                   "data.eval_fraction": 0.1})
    target = load_target("tiny-random", "cpu", torch.float32, layer_ids=cfg.target.layer_ids,
                         seed=cfg.train.seed, tiny=cfg.target.tiny)
    dcfg = DrafterConfig.for_target(target, **cfg.drafter.overrides())
    drafter = DFlashDrafter(dcfg, target.embed_tokens, target.lm_head)
    save_checkpoint(str(out), 1, weights=drafter.state_dict(), optimizer={}, scheduler={}, data_position={},
                    rng={}, config=cfg.to_dict(), drafter_config=dcfg.to_dict(), keep_last=1)
    export_drafter(drafter, out / "export")
    return out


def run(argv, tty=False):
    out, err = Tty(tty), Tty(tty)
    from trainer.cli.eval import eval_parser, run_eval

    code = run_eval(eval_parser().parse_args(argv), out=out, err=err)
    return code, out.getvalue(), err.getvalue()


def test_eval_of_a_run_dir_uses_its_held_out_prompts_and_reports_json(run_dir):
    code, out, err = run(["--checkpoint", str(run_dir), "--num-prompts", "2", "--max-new-tokens", "8", "--json"])
    assert code == 0, err
    result = json.loads(out)
    assert result["prompts"] == 2 and result["lossless"] is True and result["block_size"] == 8
    assert 1.0 <= result["tau"] <= 8 and len(result["acceptance"]) == 7
    assert 1.0 <= result["tau_per_prompt_mean"] <= 8 and set(result["tau_per_prompt"]) == {"min", "median", "max"}
    assert result["loop"] == "static" and result["batch"] == 1
    assert result["target_tokens_per_s"] > 0 and result["speedup"] > 0
    assert "step-0000001" in result["checkpoint"] and err == ""  # no progress bar off a terminal


def test_text_report_and_progress_on_a_terminal(run_dir, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"input_ids": [5, 6, 7, 8]}) + "\n\n" + json.dumps({"input_ids": [9, 10]}) + "\n")
    code, out, err = run(["--checkpoint", str(run_dir / "export"), "--target", "tiny-random", "--prompts",
                          str(prompts), "--max-new-tokens", "6"], tty=True)
    assert code == 0, err
    assert "tau " in out and "acceptance by block position: 1:" in out and "lossless check: ok" in out
    assert "pooled over" in out and "as the mean of per-prompt means; per prompt min" in out
    assert "2/2 prompts" in err and "eta" in err


@pytest.mark.parametrize("loop", ["static", "reference"])
def test_a_lossless_mismatch_names_the_prompt_position_and_logits_and_exits_1(run_dir, monkeypatch, loop):
    from trainer.infer.static_decode import StaticDecoder

    real_static, real_reference = StaticDecoder.decode, speculative.speculative_generate

    def corrupt(tokens):
        tokens[3] = (tokens[3] + 1) % 512

    def static(self, prompts, max_new_tokens, speculative):
        batch = real_static(self, prompts, max_new_tokens, speculative)
        if speculative:
            corrupt(batch.results[0].tokens)
        return batch

    def reference(*args, **kwargs):
        result = real_reference(*args, **kwargs)
        corrupt(result.tokens)
        return result

    monkeypatch.setattr(StaticDecoder, "decode", static)
    monkeypatch.setattr("trainer.infer.evaluate.speculative_generate", reference)
    code, out, err = run(["--checkpoint", str(run_dir), "--num-prompts", "1", "--max-new-tokens", "8",
                          "--loop", loop])
    assert code == 1
    assert "LOSSLESS CHECK FAILED: prompt 0" in err and "new token 3" in err and "fp32 logits there" in err
    assert "top token" in err and "a gap to the top beyond" in err


def test_prompts_file_errors_name_file_and_line(run_dir, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"input_ids": [1, 2]}) + "\n" + "{not json\n")
    code, _, err = run(["--checkpoint", str(run_dir), "--prompts", str(bad)])
    assert code == 2 and f"{bad}:2: not valid JSON" in err and "Traceback" not in err
    bad.write_text(json.dumps({"input_ids": [1, 99999]}) + "\n")
    code, _, err = run(["--checkpoint", str(run_dir), "--prompts", str(bad)])
    assert code == 2 and f"{bad}:1: token 99999 is outside the target's vocabulary" in err
    bad.write_text(json.dumps({"messages": [{"role": "robot", "content": "hi"}]}) + "\n")
    code, _, err = run(["--checkpoint", str(run_dir), "--prompts", str(bad)])
    assert code == 2 and f"{bad}:1: messages must be a non-empty list" in err
    code, _, err = run(["--checkpoint", str(run_dir), "--prompts", str(tmp_path / "missing.jsonl")])
    assert code == 2 and "prompts file not found" in err


def test_a_target_that_does_not_fit_the_drafter_is_one_line_exit_2(run_dir, tmp_path):
    import yaml

    # a different tiny target: hidden 32 and 3 layers instead of 64 and 6
    cfg = json.loads((run_dir / "checkpoints" / "step-0000001" / "config.json").read_text())
    model_dir = tmp_path / "other"
    from transformers import Qwen3Config, Qwen3ForCausalLM
    Qwen3ForCausalLM(Qwen3Config(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                 num_attention_heads=2, num_key_value_heads=1, head_dim=16)).save_pretrained(model_dir)
    code, _, err = run(["--checkpoint", str(run_dir), "--target", str(model_dir)])
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "the drafter does not match the target: hidden size 64 vs the target's 32" in err
    assert "trained on a 6-layer target, this one has 3" in err
    assert cfg["target"]["spec"] == "tiny-random" and yaml  # the run's own target stays the default
    code, _, err = run(["--checkpoint", str(run_dir / "export")])
    assert code == 2 and "--target is required with an export dir" in err
    code, _, err = run(["--checkpoint", str(tmp_path / "nowhere")])
    assert code == 2 and "no such directory" in err


def test_a_failure_whose_message_is_empty_or_long_is_one_line_exit_1(run_dir, monkeypatch):
    """The first line of an empty message was an IndexError traceback; a long one is cut to its first line."""
    for raised, said in ((RuntimeError(), "RuntimeError: "), (RuntimeError("CUDA out of memory.\nTried"), "RuntimeError: CUDA out of memory.")):
        def broken(*args, raised=raised, **kwargs):
            raise raised

        monkeypatch.setattr("trainer.cli.eval.load_models", broken)
        code, _, err = run(["--checkpoint", str(run_dir)])
        assert (code, err) == (1, f"dflash-train eval: failed: {said}\n")


def test_prompts_longer_than_the_target_context_are_skipped_with_a_count(run_dir, tmp_path):
    prompts = tmp_path / "long.jsonl"
    prompts.write_text(json.dumps({"input_ids": [7] * 4090}) + "\n" + json.dumps({"input_ids": [3, 4, 5]}) + "\n")
    code, out, err = run(["--checkpoint", str(run_dir), "--prompts", str(prompts), "--max-new-tokens", "4"])
    assert code == 0, err
    assert "skipped 1 prompt(s) longer than the target's context allows" in out
    assert "1 prompts" in out


def test_prompts_from_messages_use_the_chat_template_without_the_answer(tmp_path):
    class Tokenizer:
        chat_template = "x"

        def apply_chat_template(self, messages, tokenize, add_generation_prompt):
            return "|".join(m["content"] for m in messages) + ("|A:" if add_generation_prompt else "")

        def encode(self, text, add_special_tokens):
            return [len(part) for part in text.split("|")]

    path = tmp_path / "m.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "abc"},
                                             {"role": "assistant", "content": "the answer"}]}) + "\n")
    assert load_prompts(str(path), Tokenizer(), 512) == [[3, 2]]


def test_dflash_train_eval_is_a_subcommand(run_dir, capsys):
    code = cli.main(["eval", "--checkpoint", str(run_dir), "--num-prompts", "1", "--max-new-tokens", "4", "--json"])
    assert code == 0
    assert json.loads(capsys.readouterr().out)["prompts"] == 1
