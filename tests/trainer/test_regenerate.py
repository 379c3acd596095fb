"""dflash-train data regenerate on the tiny-random target: batching, rejects, exactly-once resume after a kill."""
from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from trainer.cli.data import main as data_main
from trainer.data.regenerate import Generator, RegenerateOptions, parse_record, Reject, regenerate
from trainer.progress import ProgressLine

pytestmark = [pytest.mark.timeout(180), pytest.mark.usefixtures("one_torch_thread")]
REPO = Path(__file__).resolve().parents[2]


def conversation(i: int) -> dict:
    return {"id": i, "messages": [{"role": "system", "content": "be brief"},
                                  {"role": "user", "content": f"question {i}" + " and more" * (i % 3)},
                                  {"role": "assistant", "content": "an answer another model wrote"}]}


def write_lines(path: Path, lines: list) -> Path:
    path.write_text("".join((json.dumps(x) if not isinstance(x, str) else x) + "\n" for x in lines), encoding="utf-8")
    return path



@pytest.fixture(scope="module")
def generator():
    return Generator("tiny-random", "cpu", RegenerateOptions("tiny-random", "in", "out", max_new_tokens=6))


def test_left_padded_batch_generates_what_each_prompt_generates_alone(generator):
    short = generator.prompt_ids([{"role": "user", "content": "hi"}])
    long = generator.prompt_ids([{"role": "user", "content": "a much longer question, padded on the left"}])
    assert len(long) > len(short) + 10
    together = generator.generate([short, long])
    assert together == [generator.generate([short])[0], generator.generate([long])[0]]
    # and it is the target's own greedy continuation (6 argmax steps without any cache)
    ids = torch.tensor([short])
    for _ in range(6):
        ids = torch.cat([ids, generator.model(input_ids=ids).logits[:, -1].argmax(-1, keepdim=True)], 1)
    expected = ids[0, len(short):].tolist()
    cut = next((k for k, t in enumerate(expected) if t in generator.eos_ids), None)
    assert together[0][0] == expected[:cut]


def test_template_kwargs_reach_the_chat_template(generator):
    generator.tokenizer.chat_template = ("{% for m in messages %}{{ m['content'] }}{% endfor %}"
                                         "{% if flavour %}{{ flavour }}{% endif %}")
    try:
        plain = generator.prompt_ids([{"role": "user", "content": "x"}])
        generator.opts.chat_template_kwargs = {"flavour": "yz"}
        assert generator.prompt_ids([{"role": "user", "content": "x"}]) == plain + generator.tokenizer.encode("yz")
    finally:
        from trainer.data.chat_tokenizer import CHATML

        generator.tokenizer.chat_template = CHATML
        generator.opts.chat_template_kwargs = {}


@pytest.mark.parametrize("line, reason", [
    ("not json", "not valid JSON"),
    ('{"text": "x"}', "no `messages` list"),
    ('{"messages": [{"role": "tool", "content": "x"}]}', "role 'tool'"),
    ('{"messages": [{"role": "assistant", "content": "x"}, {"role": "user", "content": "y"}]}', "before any user"),
    ('{"messages": [{"role": "system", "content": "x"}]}', "no user turn"),
    ('{"messages": [{"role": "user", "content": 3}]}', "content"),
])
def test_bad_records_are_rejected_with_a_reason(line, reason):
    with pytest.raises(Reject, match=reason):
        parse_record(line)


def test_turns_to_answer_keep_user_and_system_and_answer_a_trailing_question():
    conv = parse_record(json.dumps({"messages": [
        {"role": "system", "content": "s"}, {"role": "user", "content": "u1"}, {"role": "assistant", "content": "a1"},
        {"role": "user", "content": "u2"}]}))
    assert [m["role"] for m in conv.messages] == ["system", "user", "assistant", "user", "assistant"]
    assert conv.slots == [2, 4] and conv.messages[1]["content"] == "u1"


def test_regenerate_writes_target_answers_rejects_and_a_summary(tmp_path):
    src = write_lines(tmp_path / "in.jsonl", [conversation(0), "not json", conversation(1),
                                              {"messages": [{"role": "user", "content": "x" * 600}]}])
    out = tmp_path / "out.jsonl"
    summary = regenerate(RegenerateOptions("tiny-random", str(src), str(out), max_new_tokens=4, batch_size=2,
                                           max_prompt_tokens=200), out=io.StringIO(), tty=False)
    assert (summary["records"], summary["rejects"], summary["turns"], summary["seen"]) == (2, 2, 2, 4)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in rows] == [0, 1]
    assert rows[0]["messages"][:2] == conversation(0)["messages"][:2]
    assert rows[0]["messages"][2]["role"] == "assistant"
    assert rows[0]["messages"][2]["content"] != "an answer another model wrote"
    rejects = [json.loads(line) for line in Path(summary["rejects_path"]).read_text().splitlines()]
    assert [r["line"] for r in rejects] == [2, 4]
    assert "not valid JSON" in rejects[0]["reason"] and rejects[1]["reason"].startswith("too long")
    assert 0 < summary["new_tokens"] <= 8


def test_existing_output_without_resume_or_with_other_settings_is_refused(tmp_path, capsys):
    src = write_lines(tmp_path / "in.jsonl", [conversation(0)])
    out = tmp_path / "out.jsonl"
    args = ["regenerate", "--target", "tiny-random", "--in", str(src), "--out", str(out), "--max-new-tokens", "2"]
    assert data_main(args) == 0
    assert data_main(args) == 2
    assert "add --resume" in capsys.readouterr().err
    assert data_main(args[:-1] + ["3", "--resume"]) == 2
    assert "max_new_tokens: was 2, now 3" in capsys.readouterr().err
    assert data_main(args + ["--chat-template-kwargs", "[1]"]) == 2
    assert "must be a JSON object" in capsys.readouterr().err


def _run(src, out, *extra):
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    return subprocess.Popen([sys.executable, "-m", "trainer", "data", "regenerate", "--target", "tiny-random",
                             "--in", str(src), "--out", str(out), "--max-new-tokens", "3", "--batch-size", "1",
                             *extra], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_killed_run_resumes_with_no_duplicate_or_lost_record(tmp_path):
    records = [conversation(i) for i in range(60)]
    records[5] = "not json"  # a reject on the way
    src = write_lines(tmp_path / "in.jsonl", records)
    killed_out = tmp_path / "out.jsonl"
    victim = _run(src, killed_out)
    progress = Path(str(killed_out) + ".progress.json")
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # kill once a few records are committed, mid-run
        if progress.exists() and json.loads(progress.read_text() or "{}").get("next_line", 0) >= 3:
            break
        time.sleep(0.01)
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    committed = json.loads(progress.read_text())["next_line"]
    assert 3 <= committed < len(records), "the kill should land mid-run"
    with open(killed_out, "ab") as f:  # what a kill in the middle of a write leaves behind
        f.write(b'{"messages": [{"role": "user", "cont')
    reference = tmp_path / "reference.jsonl"  # the same work uninterrupted
    options = dict(max_new_tokens=3, batch_size=1)
    regenerate(RegenerateOptions("tiny-random", str(src), str(reference), **options), out=io.StringIO(), tty=False)
    summary = regenerate(RegenerateOptions("tiny-random", str(src), str(killed_out), resume=True, **options),
                         out=io.StringIO(), tty=False)
    assert killed_out.read_bytes() == reference.read_bytes()
    assert Path(str(killed_out) + ".rejects.jsonl").read_bytes() == Path(str(reference) + ".rejects.jsonl").read_bytes()
    ids = [json.loads(line)["id"] for line in killed_out.read_text().splitlines()]
    assert ids == [i for i in range(60) if i != 5]
    assert (summary["records"], summary["rejects"], summary["seen"]) == (59, 1, 60)


@pytest.mark.parametrize("flags, message", [
    (["--devices", "gpu0"], "gpu0 is not a device"), (["--devices", "cuda:7"], "names cuda:7 but"),
    (["--batch-size", "0"], "--batch-size must be at least 1"), (["--temperature", "-1"], "--temperature"),
])
def test_bad_flags_are_one_line_and_exit_2(tmp_path, capsys, flags, message):
    src = write_lines(tmp_path / "in.jsonl", [conversation(0)])
    assert data_main(["regenerate", "--target", "tiny-random", "--in", str(src), "--out", str(tmp_path / "o"),
                      *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "o").exists()


def test_two_devices_write_the_same_records_in_input_order(tmp_path):
    src = write_lines(tmp_path / "in.jsonl", [conversation(i) for i in range(5)])
    one, two = tmp_path / "one.jsonl", tmp_path / "two.jsonl"
    regenerate(RegenerateOptions("tiny-random", str(src), str(one), max_new_tokens=3, batch_size=1),
               out=io.StringIO(), tty=False)
    summary = regenerate(RegenerateOptions("tiny-random", str(src), str(two), max_new_tokens=3, batch_size=1,
                                           devices=["cpu", "cpu"]), out=io.StringIO(), tty=False)
    assert summary["records"] == 5 and two.read_bytes() == one.read_bytes()


def test_progress_is_a_bar_on_a_tty_and_a_periodic_line_elsewhere():
    now = [0.0]
    plain = io.StringIO()
    line = ProgressLine("records", 100, done=20, out=plain, tty=False, every_s=30, clock=lambda: now[0])
    for done, t in ((30, 10.0), (40, 31.0), (50, 40.0), (100, 50.0)):
        now[0] = t
        line.update(done)
    # a line at 31 s (30 s passed) and at the end; rates count this run's work only (resumed at 20)
    assert plain.getvalue().splitlines() == ["records 40/100  0.65/s  ETA 1m33s", "records 100/100  1.60/s  ETA 0m00s"]
    bar = io.StringIO()
    line = ProgressLine("records", 10, out=bar, tty=True, clock=lambda: now[0])
    now[0] += 2
    line.update(5, "7 rejected")
    line.finish()
    assert bar.getvalue() == "\r\x1b[2K[############............] records 5/10  2.50/s  ETA 0m02s  7 rejected\n"


def test_sampling_is_seeded_by_position_so_a_resumed_run_samples_the_same(tmp_path):
    src = write_lines(tmp_path / "in.jsonl", [conversation(i) for i in range(4)])
    opts = dict(max_new_tokens=4, batch_size=2, temperature=1.0, seed=3)
    whole, part = tmp_path / "whole.jsonl", tmp_path / "part.jsonl"
    regenerate(RegenerateOptions("tiny-random", str(src), str(whole), **opts), out=io.StringIO(), tty=False)
    head = write_lines(tmp_path / "head.jsonl", [conversation(i) for i in range(2)])
    regenerate(RegenerateOptions("tiny-random", str(head), str(part), **opts), out=io.StringIO(), tty=False)
    greedy = tmp_path / "greedy.jsonl"
    regenerate(RegenerateOptions("tiny-random", str(head), str(greedy), max_new_tokens=4, batch_size=2),
               out=io.StringIO(), tty=False)
    first_two = whole.read_text().splitlines()[:2]
    assert part.read_text().splitlines() == first_two  # same chunk position, same samples
    assert greedy.read_text().splitlines() != first_two  # and it did sample


@pytest.mark.parametrize("how, code, word", [(signal.SIGTERM, 143, "SIGTERM"), (signal.SIGINT, 130, "interrupted")])
def test_a_stopped_run_prints_its_summary_with_new_tokens_per_second(tmp_path, how, code, word):
    src = write_lines(tmp_path / "in.jsonl", [conversation(i) for i in range(60)])
    out = tmp_path / "out.jsonl"
    victim = _run(src, out)
    progress = Path(str(out) + ".progress.json")
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if progress.exists() and json.loads(progress.read_text() or "{}").get("next_line", 0) >= 3:
            break
        time.sleep(0.01)
    victim.send_signal(how)
    _, err = victim.communicate(timeout=60)
    assert victim.returncode == code, err
    summary = [line for line in err.splitlines() if line.startswith(f"dflash-train data: regenerate stopped ({word})")]
    assert len(summary) == 1, err
    committed = json.loads(progress.read_text())["stats"]
    assert f": {committed['records']} records (" in summary[0] and "new tokens/s" in summary[0]
    assert f"this run {committed['seen']} records, {committed['new_tokens']} new tokens in" in summary[0]
    assert "rerun with --resume" in summary[0]


def test_a_finished_run_reports_new_tokens_per_second(tmp_path, capsys):
    src = write_lines(tmp_path / "in.jsonl", [conversation(0), conversation(1)])
    assert data_main(["regenerate", "--target", "tiny-random", "--in", str(src), "--out", str(tmp_path / "o.jsonl"),
                      "--max-new-tokens", "3"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("dflash-train data: regenerated 2 records (2 turns, 6 new tokens") and "new tokens/s" in line


def test_a_truncated_record_is_rejected_at_its_real_column():
    cut = '{"messages": [{"role": "user", "content": "hi"}'  # stops before the closing bracket
    with pytest.raises(Reject, match=rf"at column {len(cut) + 1}\)"):
        parse_record(cut + "\n")


def test_a_stop_right_after_a_commit_reports_what_was_committed(tmp_path, monkeypatch):
    """A signal landing between a chunk's commit and the report update must not leave the summary a chunk behind."""
    import trainer.data.regenerate as regen
    src = write_lines(tmp_path / "in.jsonl", [conversation(i) for i in range(4)])
    out = tmp_path / "out.jsonl"
    real_commit, commits = regen._commit, []

    def commit_then_stop(*args, **kwargs):
        real_commit(*args, **kwargs)
        commits.append(1)
        if len(commits) == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(regen, "_commit", commit_then_stop)
    report: dict = {}
    with pytest.raises(KeyboardInterrupt):
        regenerate(RegenerateOptions("tiny-random", str(src), str(out), max_new_tokens=2, batch_size=1),
                   out=io.StringIO(), tty=False, report=report)
    committed = json.loads(Path(str(out) + ".progress.json").read_text())["stats"]
    assert committed["seen"] == 2
    assert (report["seen"], report["records"], report["new_tokens"]) == (
        committed["seen"], committed["records"], committed["new_tokens"])
    assert report["this_run"]["seen"] == 2


def test_the_run_says_at_once_how_much_it_does_before_the_first_progress_line(tmp_path):
    """A chunk of a big target can take minutes: the first line comes before it, not after."""
    src = write_lines(tmp_path / "in.jsonl", [conversation(i) for i in range(3)])
    out = io.StringIO()
    regenerate(RegenerateOptions("tiny-random", str(src), str(tmp_path / "o.jsonl"), max_new_tokens=2, batch_size=2),
               out=out, tty=False)
    assert out.getvalue().splitlines()[0] == (
        "regenerating 3 records on cpu: up to 2 a chunk (--batch-size), progress as each chunk is written")
    bar = io.StringIO()
    ProgressLine("records", 4, out=bar, tty=True).say("started")
    assert bar.getvalue() == "\r\x1b[2Kstarted\n"


def test_a_line_that_is_not_utf8_is_rejected_and_kept_as_read(tmp_path):
    """It stopped the whole run with UnicodeDecodeError ('failed', exit 1) before any record was written."""
    src = tmp_path / "in.jsonl"
    bad = b'{"messages": [{"role": "user", "content": "caf\xe9"}]}'
    src.write_bytes(json.dumps(conversation(0)).encode() + b"\n" + bad + b"\n")
    out = tmp_path / "out.jsonl"
    summary = regenerate(RegenerateOptions("tiny-random", str(src), str(out), max_new_tokens=4, batch_size=2),
                         out=io.StringIO(), tty=False)
    assert (summary["records"], summary["rejects"]) == (1, 1)
    reject = Path(summary["rejects_path"]).read_bytes()
    assert b"not UTF-8 text (a byte at offset 46)" in reject and b"caf\xe9" in reject


def _damaged_target(tmp_path) -> str:
    from trainer.data.target import tiny_target

    tiny_target("cpu", torch.float32, 0, None).save_pretrained(tmp_path / "target")
    (tmp_path / "target" / "model.safetensors").write_text("cut short")
    return str(tmp_path / "target")


@pytest.mark.parametrize("case", ["no input", "out is a directory", "out under a file", "target does not load"])
def test_bad_input_is_one_line_exit_2_and_leaves_no_output_files(tmp_path, capsys, case):
    """Before: a missing --in left <out>.chat-template.json behind; --out under a missing or file parent said
    'failed: [Errno ...]; rerun with --resume', exit 1; a target that did not load left the output, rejects
    and progress files and said 'regenerate stopped ... rerun with --resume' above its error."""
    src, out = write_lines(tmp_path / "in.jsonl", [conversation(0)]), tmp_path / "o.jsonl"
    target, said = "tiny-random", ""
    if case == "no input":
        src, said = tmp_path / "nope.jsonl", "input file not found"
    elif case == "out is a directory":
        out.mkdir()
        said = "o.jsonl: is a directory. Fix: name the output file"
    elif case == "out under a file":
        (tmp_path / "file").write_text("")
        out, said = tmp_path / "file" / "o.jsonl", "cannot create its directory"
    else:
        target, said = _damaged_target(tmp_path), "target.spec: cannot load a causal LM from"
    before = sorted(p.name for p in tmp_path.iterdir())
    capsys.readouterr()  # save_pretrained's progress bar
    assert data_main(["regenerate", "--target", target, "--in", str(src), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and said in err[0], err
    assert sorted(p.name for p in tmp_path.iterdir()) == before


@pytest.mark.parametrize("progress", ["{cut", "[1]", '{"settings": {}}'])
def test_resume_from_a_damaged_progress_file_is_one_line_exit_2(tmp_path, capsys, progress):
    """It was JSONDecodeError / TypeError / KeyError: 'failed', exit 1."""
    src, out = write_lines(tmp_path / "in.jsonl", [conversation(0)]), tmp_path / "o.jsonl"
    args = ["regenerate", "--target", "tiny-random", "--in", str(src), "--out", str(out), "--max-new-tokens", "2"]
    assert data_main(args) == 0
    Path(str(out) + ".progress.json").write_text(progress)
    capsys.readouterr()
    assert data_main(args + ["--resume"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"dflash-train data: error: {out}.progress.json: unreadable ("), err
    assert "Fix: remove the files to start over." in err[0]
