"""Trainer config: bundled files load, overrides apply, bad values name the key and the fix."""
from __future__ import annotations

import textwrap

import pytest

from trainer.config import CONFIGS_DIR, ConfigError, check_devices, load_config


def write(tmp_path, text: str, name: str = "c.yaml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return str(path)


MINIMAL = """\
    target: {spec: tiny-random}
    data: {source: synthetic, seq_len: 32}
    run: {drafter_devices: [cpu, cpu], attention: sdpa}
"""


def test_bundled_names_resolve_to_the_packaged_files():
    tiny = load_config("tiny-cpu", {})
    assert tiny.source == str(CONFIGS_DIR / "tiny-cpu.yaml")
    assert tiny.run.drafter_devices == ["cpu", "cpu"] and tiny.run.attention == "sdpa"
    paper = load_config("gpu-paper", {})
    # the paper's recipe, as stated in DESIGN.md / the issue
    assert (paper.drafter.num_layers, paper.drafter.block_size, paper.train.num_anchors) == (5, 16, 512)
    assert (paper.data.seq_len, paper.train.lr, paper.train.warmup_frac) == (3072, 6e-4, 0.04)
    assert (paper.train.grad_clip, paper.train.epochs, paper.run.attention) == (1.0, 6, "flex")
    assert paper.run.target_devices == ["cuda:0"]
    assert paper.run.drafter_devices == ["cuda:1", "cuda:2", "cuda:3"]


def test_gpu_config_runs_on_cpu_devices_with_sdpa():
    cfg = load_config("gpu-paper", {"target_devices": "cpu", "drafter_devices": "cpu,cpu,cpu",
                                    "attention": "sdpa"})
    assert cfg.run.drafter_devices == ["cpu", "cpu", "cpu"]
    check_devices(cfg)  # cpu always exists


def test_cli_style_overrides_land_in_their_sections(tmp_path):
    cfg = load_config(write(tmp_path, MINIMAL), {
        "output_dir": "/x/run", "max_steps": 7, "resume": "latest", "compile_lock": "none",
        "seed": 3, "metrics_file": "/x/m.jsonl", "train.lr": "6e-4", "data.synthetic.num_samples": 9,
    })
    assert cfg.run.output_dir == "/x/run" and cfg.train.max_steps == 7 and cfg.run.resume == "latest"
    assert cfg.run.compile_lock == "none" and cfg.train.seed == 3
    assert cfg.metrics_path == "/x/m.jsonl"
    assert cfg.train.lr == pytest.approx(6e-4)  # YAML 1.1 reads 6e-4 as a string; accepted as a number
    assert cfg.data.synthetic.num_samples == 9


def test_metrics_file_defaults_into_output_dir(tmp_path):
    cfg = load_config(write(tmp_path, MINIMAL), {"output_dir": "/runs/a"})
    assert cfg.metrics_path == "/runs/a/metrics.jsonl"


@pytest.mark.parametrize("yaml_text, key, fix", [
    ("train: {lrr: 0.1}", "train.lrr", "train.lr"),
    ("train: {lr: fast}", "train.lr", "number"),
    ("train: {max_steps: 2.5}", "train.max_steps", "whole number"),
    ("run: {attention: flash}", "run.attention", "flex, sdpa"),
    ("run: {compile_lock: maybe}", "run.compile_lock", "lock, none, patch"),
    ("run: {drafter_devices: [gpu1]}", "run.drafter_devices", "cuda:N"),
    ("run: {drafter_devices: []}", "run.drafter_devices", "at least one"),
    ("data: {source: jsonl}", "data.path", ".jsonl"),
    ("train: {warmup_frac: 1.5}", "train.warmup_frac", "0.04"),
    ("drafter: {num_heads: 6, num_kv_heads: 4}", "drafter.num_kv_heads", "divide"),
    ("data: {source: synthetic, seq_len: 0}", "data.seq_len", "at least 1"),
    ("train: {betas: 0.9}", "train.betas", "list"),
    ("wat: 1", "wat", "target, drafter, data, train, run"),
    ("data: {source: parquet}", "data.source", "synthetic, jsonl, features"),
    ("data: {source: features}", "data.path", "cache-features"),
    ("data: {source: jsonl, path: d.jsonl, seq_len: 1}", "data.seq_len", "at least 2"),
    ("data: {source: synthetic, seq_len: 8, synthetic: {prompt_len: 8}}", "data.synthetic.prompt_len", "shorter"),
    ("data: {source: synthetic, eval_fraction: 1.0}", "data.eval_fraction", "0.05"),
    ("data: {source: synthetic, eval_fraction: -0.1}", "data.eval_fraction", "[0, 1)"),
])
def test_bad_values_name_the_key_and_the_fix(tmp_path, yaml_text, key, fix):
    if not yaml_text.startswith("data:"):  # everything else needs valid data to get that far
        yaml_text = "data: {source: synthetic}\n" + yaml_text
    path = write(tmp_path, yaml_text)
    with pytest.raises(ConfigError) as err:
        load_config(path, {})
    message = str(err.value)
    assert f"`{key}`" in message
    assert fix in message
    assert path in message


def test_flex_on_cpu_drafters_is_refused_with_the_way_out(tmp_path):
    path = write(tmp_path, "data: {source: synthetic}\nrun: {attention: flex, drafter_devices: [cpu]}")
    with pytest.raises(ConfigError, match=r"`run.attention`.*--attention sdpa"):
        load_config(path, {})


def test_yaml_syntax_error_names_file_and_line(tmp_path):
    # line 3 opens a flow mapping that never closes
    path = write(tmp_path, "target:\n  spec: tiny-random\ntrain: {lr: 0.1\nrun: {}\n")
    with pytest.raises(ConfigError) as err:
        load_config(path, {})
    assert f"{path}:" in str(err.value)
    line = int(str(err.value).split(f"{path}:")[1].split(":")[0])
    assert 3 <= line <= 5  # PyYAML reports where it noticed: within the broken mapping


def test_missing_config_lists_the_bundled_ones(tmp_path):
    with pytest.raises(ConfigError, match="tiny-cpu") as err:
        load_config(str(tmp_path / "absent.yaml"), {})
    assert "gpu-paper" in str(err.value)


def test_devices_that_do_not_exist_are_named(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA")
    cfg = load_config(write(tmp_path, MINIMAL), {"drafter_devices": "cpu,cuda:1", "attention": "sdpa"})
    with pytest.raises(ConfigError, match=r"`run.drafter_devices`.*'cuda:1'.*no CUDA device"):
        check_devices(cfg)


def test_drafter_overrides_only_carry_what_the_config_sets(tmp_path):
    cfg = load_config(write(tmp_path, MINIMAL + "    drafter: {num_layers: 2, head_dim: 8}\n"), {})
    assert cfg.drafter.overrides() == {"num_layers": 2, "block_size": 16, "head_dim": 8}


# --------------------------------------------------------------------------- strict YAML (1.2)


@pytest.mark.parametrize("value", ["off", "no", "on", "yes"])
def test_yaml_1_1_booleans_stay_text_and_are_refused_at_their_line(tmp_path, value):
    # YAML 1.1 would read `off` as False and the message would blame a boolean the user never wrote.
    path = write(tmp_path, f"data: {{source: synthetic}}\nrun:\n  compile_lock: {value}\n")
    with pytest.raises(ConfigError) as err:
        load_config(path, {})
    message = str(err.value)
    assert message.startswith(f"{path}:3: `run.compile_lock` must be one of lock, none, patch, got '{value}'")


def test_a_key_written_twice_is_refused_naming_both_lines(tmp_path):
    path = write(tmp_path, "data: {source: synthetic}\ntrain:\n  lr: 0.1\n  seed: 3\n  lr: 0.2\n")
    with pytest.raises(ConfigError) as err:
        load_config(path, {})
    assert str(err.value).startswith(f"{path}:5: key 'lr' under train is defined twice (also on line 3)")


def test_a_section_written_twice_is_refused(tmp_path):
    path = write(tmp_path, "train: {lr: 0.1}\ndata: {source: synthetic}\ntrain: {seed: 1}\n")
    with pytest.raises(ConfigError, match=rf"^{path}:3: key 'train' is defined twice \(also on line 1\)"):
        load_config(path, {})


@pytest.mark.parametrize("yaml_text, line, key", [
    ("data: {source: synthetic}\ntrain:\n  lrr: 0.1\n", 3, "train.lrr"),  # unknown key
    ("data: {source: synthetic}\ntrain:\n  seed: 1\n  max_steps: 2.5\n", 4, "train.max_steps"),  # wrong type
    ("data: {source: synthetic}\nrun:\n  attention: flash\n", 3, "run.attention"),  # a cross-field check
    ("data:\n  source: synthetic\n  seq_len: 0\n", 3, "data.seq_len"),
])
def test_bad_values_name_their_line(tmp_path, yaml_text, line, key):
    path = write(tmp_path, yaml_text)
    with pytest.raises(ConfigError) as err:
        load_config(path, {})
    assert str(err.value).startswith(f"{path}:{line}: ")
    assert f"`{key}`" in str(err.value)


def test_a_bad_override_names_the_flag_not_the_file(tmp_path):
    # The file's line holds a good value; the bad one came from the command line.
    path = write(tmp_path, "data: {source: synthetic}\ntrain:\n  lr: 0.1\n")
    with pytest.raises(ConfigError) as err:
        load_config(path, {"train.lr": "fast"})
    assert str(err.value).startswith("--set train.lr: `train.lr` must be a number")
    with pytest.raises(ConfigError) as err:
        load_config(path, {"train.lr": -1.0})
    assert str(err.value).startswith("--set train.lr: `train.lr` must be positive")
    with pytest.raises(ConfigError) as err:  # a key the bundled config never had
        load_config("tiny-cpu", {"run.note": "x"})
    assert str(err.value).startswith("--set run.note: unknown key `run.note`.")
    assert "tiny-cpu.yaml" not in str(err.value)
    with pytest.raises(ConfigError) as err:  # a flag of its own
        load_config("tiny-cpu", {"max_steps": 0})
    assert str(err.value).startswith("--max-steps: `train.max_steps` must be at least 1")


def test_line_bookkeeping_stays_out_of_the_saved_config(tmp_path):
    text = MINIMAL.replace("{spec: tiny-random}", "{spec: tiny-random, tiny: {hidden_size: 8}}")
    cfg = load_config(write(tmp_path, text), {})
    saved = cfg.to_dict()
    assert "key_lines" not in saved and "source" not in saved
    assert type(saved["target"]["tiny"]) is dict and saved["target"]["tiny"] == {"hidden_size": 8}


# --------------------------------------------------------------------------- every rule, at its line

# (section, key: bad value, the words of its fix); the file sets only that key, on line 2 or 3
RULES = [
    ("train", "lr: 0", "train.lr", "6e-4"),
    ("train", "lr: -0.1", "train.lr", "positive"),
    ("train", "min_lr_ratio: 1.5", "train.min_lr_ratio", "[0, 1]"),
    ("train", "gamma: 0", "train.gamma", "7"),
    ("train", "grad_clip: 0", "train.grad_clip", "1.0"),
    ("train", "betas: [0.9]", "train.betas", "[0.9, 0.95]"),
    ("train", "betas: [0.9, 1.0]", "train.betas", "[0.9, 0.95]"),
    ("train", "precision: fp16", "train.precision", "fp32, bf16-mixed"),
    ("train", "activation_checkpointing: all", "train.activation_checkpointing", "none, layers"),
    ("train", "max_steps: 0", "train.max_steps", "at least 1 or null"),
    ("train", "epochs: 0", "train.epochs", "at least 1"),
    ("train", "num_anchors: 0", "train.num_anchors", "at least 1"),
    ("train", "batch_size: -2", "train.batch_size", "at least 1"),
    ("drafter", "num_layers: 0", "drafter.num_layers", "at least 1"),
    ("drafter", "block_size: 1", "drafter.block_size", "16"),
    ("drafter", "num_heads: 0", "drafter.num_heads", "at least 1"),  # 0 is not null (the target's)
    ("drafter", "num_kv_heads: 0", "drafter.num_kv_heads", "at least 1"),
    ("drafter", "head_dim: 0", "drafter.head_dim", "at least 1"),
    ("drafter", "intermediate_size: 0", "drafter.intermediate_size", "at least 1"),
    ("run", "launcher: slurm", "run.launcher", "torchrun"),
    ("run", "compile_mode: fast", "run.compile_mode", "default"),
    ("run", "stop_grace_s: 0", "run.stop_grace_s", "below ops' --grace"),
    ("run", "keep_last: 0", "run.keep_last", "at least 1"),
    ("run", "checkpoint_every: 0", "run.checkpoint_every", "at least 1"),
    ("run", "target_devices: [tpu]", "run.target_devices", "cuda:N"),
    ("run", "report_to: [tensorbord]", "run.report_to", "Did you mean 'tensorboard'?"),
    ("run", "report_to: [comet]", "run.report_to", "tensorboard, wandb, mlflow"),
    ("eval", "every: -1", "eval.every", "0 (off)"),
    ("eval", "num_prompts: 0", "eval.num_prompts", "at least 1"),
    ("eval", "max_new_tokens: 0", "eval.max_new_tokens", "at least 1"),
]


@pytest.mark.parametrize("section, setting, key, fix", RULES)
def test_every_rule_is_one_line_at_the_keys_line_naming_key_and_fix(tmp_path, section, setting, key, fix):
    path = write(tmp_path, f"data: {{source: synthetic}}\n{section}:\n  {setting}\n")
    with pytest.raises(ConfigError) as err:
        load_config(path, {})
    message = str(err.value)
    assert message.startswith(f"{path}:3: `{key}` "), message
    assert fix in message and "\n" not in message
    assert err.value.exit_code == 2


def test_a_refused_compile_mode_says_why_it_is_not_offered(tmp_path):
    from trainer.compile_modes import REFUSED_COMPILE_MODES

    for mode, why in REFUSED_COMPILE_MODES.items():
        path = write(tmp_path, f"data: {{source: synthetic}}\nrun: {{compile_mode: {mode}}}\n")
        with pytest.raises(ConfigError) as err:
            load_config(path, {})
        assert f"'{mode}' is not offered: {why}" in str(err.value)


@pytest.mark.parametrize("setting", [
    "train: {warmup_frac: 0, min_lr_ratio: 1, betas: [0, 0.999], max_steps: null}",
    "data: {source: synthetic, seq_len: 9, synthetic: {prompt_len: 8}, eval_fraction: 0.0}",
    "drafter: {block_size: 2, num_heads: 8, num_kv_heads: 8}",
    "eval: {every: 0, num_prompts: 1, max_new_tokens: 1}",
    "run: {stop_grace_s: 0.5, target_devices: [cuda], drafter_devices: ['cuda:12', cpu]}",
])
def test_the_edges_of_each_range_are_accepted(tmp_path, setting):
    text = setting if setting.startswith("data:") else "data: {source: synthetic}\n" + setting
    load_config(write(tmp_path, text + "\n"), {})


def test_report_to_keeps_each_tracker_once_in_order(tmp_path):
    path = write(tmp_path, "data: {source: synthetic}\nrun: {report_to: [wandb, tensorboard, wandb]}\n")
    assert load_config(path, {}).run.report_to == ["wandb", "tensorboard"]


def test_precision_defaults_to_bf16_mixed_on_cuda_drafters_and_fp32_on_cpu(tmp_path):
    path = write(tmp_path, MINIMAL)
    assert load_config(path, {}).train.precision == "fp32"
    assert load_config(path, {"drafter_devices": "cpu,cuda:1"}).train.precision == "bf16-mixed"
    assert load_config(path, {"drafter_devices": "cuda", "train.precision": "fp32"}).train.precision == "fp32"


def test_a_saved_config_reads_back_as_the_same_config(tmp_path):
    from trainer.config import config_from_dict

    cfg = load_config("tiny-cpu", {"train.lr": 1e-3, "run.report_to": ["tensorboard"], "eval.every": 4})
    again = config_from_dict(cfg.to_dict(), "run/config.json")
    assert again.to_dict() == cfg.to_dict() and again.source == "run/config.json"
    bad = cfg.to_dict()
    bad["train"]["lr"] = 0
    with pytest.raises(ConfigError, match=r"^run/config.json: `train.lr` must be positive"):
        config_from_dict(bad, "run/config.json")


def test_an_override_under_a_value_names_the_flag_whether_or_not_the_file_has_the_section(tmp_path):
    with pytest.raises(ConfigError, match=r"^--set train.lr.x: `lr` is not a section"):
        load_config(write(tmp_path, MINIMAL + "    train: {lr: 0.1}\n"), {"train.lr.x": 1})
    path = write(tmp_path, MINIMAL)  # no train section: the flag makes it, and the message names the flag
    with pytest.raises(ConfigError, match=r"^--set train.lr.x: `train.lr` must be a number"):
        load_config(path, {"train.lr.x": 1})
    assert load_config(path, {"eval.every": 2}).eval.every == 2


def test_a_mapping_given_on_the_command_line_names_the_flag_not_line_1_of_the_file(capsys):
    """--set train='{a: 1}' said `tiny-cpu.yaml:1: unknown key train.a`: the keys' lines were those of the
    flag's own text, read as lines of the config file."""
    from trainer.cli.main import main

    assert main(["--config", "tiny-cpu", "--set", "train={a: 1}"]) == 2
    assert capsys.readouterr().err.startswith("dflash-train: error: --set train: unknown key `train.a`.")
    assert main(["--config", "tiny-cpu", "--set", "train={lr: abc}"]) == 2
    assert capsys.readouterr().err.startswith("dflash-train: error: --set train: `train.lr` must be a number")
