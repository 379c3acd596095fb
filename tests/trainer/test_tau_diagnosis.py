"""tau that says why: the likely cause from held-in, held-out and expected tau, and `eval --why`."""

from __future__ import annotations

import json

import pytest

from trainer.cli.eval import eval_parser, run_eval
from trainer.cli.main import main
from trainer.metrics_format import expected_tau
from trainer.tau_diagnosis import expected_tau_of, likely_cause


def test_mismatch_when_held_in_is_far_below_expected():
    line = likely_cause(expected=4.0, held_in=2.0, held_out=1.9)
    assert line.startswith("likely cause: mismatch") and "over-fit" not in line


def test_over_fit_when_held_out_is_far_below_held_in():
    line = likely_cause(expected=4.0, held_in=3.8, held_out=1.5)
    assert line.startswith("likely cause: over-fit") and "mismatch" not in line


def test_held_out_alone_below_expected_names_both_causes():
    line = likely_cause(3.0, None, 1.5)
    assert "held-out tau 1.50" in line and "over-fit or a mismatch" in line and "data.eval_fraction" in line
    assert "none found" in likely_cause(3.0, None, 2.5)


def test_both_and_neither():
    assert "mismatch" in likely_cause(4.0, 2.0, 1.0) and "over-fit" in likely_cause(4.0, 2.0, 1.0)
    assert likely_cause(4.0, 3.5, 3.4).startswith("likely cause: none found")


def test_expected_tau_averages_the_last_steps():
    steps = [{"acc": [0.0, 0.0]}] + [{"acc": [0.5, 0.5]}] * 10
    assert expected_tau_of(steps) == pytest.approx(expected_tau([0.5, 0.5]))
    assert expected_tau_of([{"loss": 1.0}]) is None


TRAIN = ["--config", "tiny-cpu", "--max-steps", "3", "--set", "eval.every=0", "--set", "run.log_every=100"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    run = tmp_path_factory.mktemp("why") / "run"
    assert main([*TRAIN, "--output-dir", str(run)]) == 0
    return run


def test_eval_why_reports_three_taus_and_a_cause(run, tmp_path, capsys):
    prompts = tmp_path / "other.jsonl"
    prompts.write_text("".join(json.dumps({"input_ids": [i, i + 1] * 4}) + "\n" for i in range(3)))
    capsys.readouterr()
    base = [
        "--checkpoint",
        str(run),
        "--num-prompts",
        "3",
        "--max-new-tokens",
        "12",
        "--device",
        "cpu",
        "--json",
    ]
    assert run_eval(eval_parser().parse_args(base + ["--why", "--prompts", str(prompts)])) == 0
    why = json.loads(capsys.readouterr().out)
    assert run_eval(eval_parser().parse_args(base)) == 0  # plain eval: the run's held-in prompts
    plain = json.loads(capsys.readouterr().out)
    assert why["tau_held_in"] == pytest.approx(plain["tau"])
    assert why["tau_held_out"] >= 1 and why["tau_expected"] >= 1
    assert why["likely_cause"] == likely_cause(why["tau_expected"], why["tau_held_in"], why["tau_held_out"])


def test_eval_why_needs_a_run(run, tmp_path, capsys):
    assert main(["export", "--checkpoint", str(run), "--out", str(tmp_path / "e")]) == 0
    capsys.readouterr()
    code = run_eval(
        eval_parser().parse_args(["--checkpoint", str(tmp_path / "e"), "--why", "--device", "cpu"])
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "--why needs the run" in err[0]


def test_expected_tau_uses_the_last_window_the_narrowest_record_and_no_non_numbers():
    old = [{"acc": [0.0, 0.0]}] * 5
    recent = [{"acc": [1.0, 0.5]}, {"acc": [0.5, 0.5, 0.9]}]
    assert expected_tau_of(old + recent, window=2) == pytest.approx(expected_tau([0.75, 0.5]))
    assert expected_tau_of(old + recent, window=3) == pytest.approx(expected_tau([0.5, 1 / 3]))
    for bad in (float("nan"), True, "0.5", None):
        assert expected_tau_of([{"acc": [0.5, bad]}]) is None
    assert expected_tau_of([{"acc": []}, {"loss": 1.0}]) is None


def test_with_no_tau_measured_the_cause_is_unknown():
    assert likely_cause(3.0, None, None) == "likely cause: unknown (no tau measured)"
    assert likely_cause(None, None, None) == "likely cause: unknown (no tau measured)"
    assert likely_cause(None, 2.0, 1.9).startswith("likely cause: none found")


def test_eval_why_renders_chat_prompts_for_a_tiny_target_as_plain_eval_does(run, tmp_path, capsys):
    """--why --prompts with {"messages"} rows: the tiny target's byte-level chat tokenizer renders them
    (it said "the target has no tokenizer with a chat template", exit 2, while plain eval ran them)."""
    prompts = tmp_path / "chat.jsonl"
    prompts.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"hi {i}"}]}) + "\n"
                               for i in range(2)))
    capsys.readouterr()
    argv = ["--checkpoint", str(run), "--num-prompts", "2", "--max-new-tokens", "4", "--device", "cpu", "--json",
            "--why", "--prompts", str(prompts)]
    code = run_eval(eval_parser().parse_args(argv))
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert json.loads(captured.out)["tau_held_out"] >= 1


def test_an_accuracy_outside_0_1_gives_no_expected_tau_and_eval_why_json_stays_json(run, tmp_path, capsys):
    """acc 1e300 (a damaged record) predicted tau inf: `eval --why` said "tau expected inf" and
    `--why --json` died in json.dumps (Infinity is not JSON) with a traceback."""
    assert expected_tau_of([{"acc": [1e300] * 7}]) is None and expected_tau_of([{"acc": [0.5, -0.1]}]) is None
    assert expected_tau_of([{"acc": [1.0, 0.0]}]) == pytest.approx(2.0)
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text('{"v": 1, "event": "step", "time": 1.0, "step": 1, "loss": 1.0, "acc": [1e300, 1e300, '
                       '1e300, 1e300, 1e300, 1e300, 1e300]}\n')
    config = json.loads((run / "checkpoints" / "step-0000003" / "config.json").read_text())
    step = tmp_path / "step-0000003"
    import shutil
    shutil.copytree(run / "checkpoints" / "step-0000003", step)
    config["run"]["metrics_file"] = str(metrics)
    (step / "config.json").write_text(json.dumps(config))
    capsys.readouterr()
    argv = ["--checkpoint", str(step), "--num-prompts", "1", "--max-new-tokens", "4", "--device", "cpu", "--why", "--json"]
    assert run_eval(eval_parser().parse_args(argv)) == 0
    assert json.loads(capsys.readouterr().out)["tau_expected"] is None
