"""trainer.typed_yaml: strict YAML (1.2 booleans, no duplicate keys, lines kept) and typed dataclasses
built from it, every problem one line naming FILE:LINE, the field and the fix."""
from __future__ import annotations

import dataclasses
import math
import typing

import pytest

from trainer import typed_yaml
from trainer.typed_yaml import YamlInputError, YamlMap, build, parse_value, parse_yaml


# --------------------------------------------------------------------------- loading


def test_only_true_and_false_are_booleans():
    data = parse_yaml("a: off\nb: no\nc: on\nd: yes\ne: true\nf: False\ng: [y, n]\n", "f.yaml")
    assert data == {"a": "off", "b": "no", "c": "on", "d": "yes", "e": True, "f": False, "g": ["y", "n"]}


def test_mappings_remember_their_lines():
    data = parse_yaml("# comment\ntop:\n  first: 1\n\n  second: {inner: 2}\n", "f.yaml")
    assert isinstance(data, YamlMap) and data.key_lines == {"top": 2}
    assert data["top"].line == 3 and data["top"].key_lines == {"first": 3, "second": 5}
    assert typed_yaml.dotted_lines(data) == {"top": 2, "top.first": 3, "top.second": 5, "top.second.inner": 5}


def test_a_key_written_twice_is_refused_naming_both_lines():
    with pytest.raises(YamlInputError) as err:
        parse_yaml("train:\n  lr: 0.1\n  seed: 1\n  lr: 0.2\n", "c.yaml")
    assert str(err.value).startswith("c.yaml:4: key 'lr' under train is defined twice (also on line 2)")
    assert "rename or remove one" in str(err.value)


def test_named_items_name_what_was_written_twice():
    text = "targets:\n  box: {}\n  box: {}\n"
    expected = r"^inv.yaml:3: target 'box' is defined twice \(also on line 2\)"
    with pytest.raises(YamlInputError, match=expected):
        parse_yaml(text, "inv.yaml", named_items={"targets": "target"})


def test_a_merge_may_override_what_it_pulls_in():
    data = parse_yaml("base: &b {lr: 1, seed: 2}\nrun:\n  <<: *b\n  lr: 3\n", "f.yaml")
    assert data["run"] == {"lr": 3, "seed": 2}


def test_syntax_errors_name_the_line_and_the_column():
    with pytest.raises(YamlInputError) as err:
        parse_yaml("a: 1\nb: {c: 2\nd: 3\n", "f.yaml")
    message = str(err.value)
    assert message.startswith("f.yaml:") and "not valid YAML" in message and "column" in message
    assert 2 <= int(message.split(":")[1]) <= 4


def test_a_list_as_a_key_is_refused():
    with pytest.raises(YamlInputError, match=r"^f.yaml:1: .*plain name"):
        parse_yaml("? [a, b]\n: 1\n", "f.yaml")


def test_empty_text_is_none():
    assert parse_yaml("", "f.yaml") is None and parse_yaml("# nothing\n", "f.yaml") is None


def test_unreadable_files_say_why_and_what_to_do(tmp_path):
    with pytest.raises(YamlInputError, match="file not found; check the path"):
        typed_yaml.read_yaml(str(tmp_path / "absent.yaml"))
    with pytest.raises(YamlInputError, match="is a directory"):
        typed_yaml.read_yaml(str(tmp_path))
    latin = tmp_path / "latin.yaml"
    latin.write_bytes(b"a: caf\xe9\n")
    with pytest.raises(YamlInputError, match="not UTF-8"):
        typed_yaml.read_yaml(str(latin))
    good = tmp_path / "good.yaml"
    good.write_text("a: off\n", encoding="utf-8")
    assert typed_yaml.read_yaml(str(good)) == {"a": "off"}


@pytest.mark.parametrize("text, value", [
    ("off", "off"), ("3", 3), ("0.5", 0.5), ("true", True), ("null", None), ("[a, b]", ["a", "b"]),
    ("{a: 1}", {"a": 1}), ("[unclosed", "[unclosed"), ("a: 1: 2", "a: 1: 2"),
])
def test_command_line_values_follow_the_file_rules(text, value):
    assert parse_value(text) == value


def test_yaml_map_of_a_plain_mapping_has_no_lines():
    wrapped = YamlMap.of({"a": {"b": 1}, "c": [1]})
    assert wrapped == {"a": {"b": 1}, "c": [1]}
    assert isinstance(wrapped["a"], YamlMap) and wrapped["a"].line == 0 and wrapped.key_lines == {}


# --------------------------------------------------------------------------- building


@dataclasses.dataclass
class Inner:
    count: int = 1
    ratio: float = 0.5
    names: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class Outer:
    name: str = "x"
    enabled: bool = False
    limit: typing.Optional[int] = None
    extra: dict = dataclasses.field(default_factory=dict)
    inner: Inner = dataclasses.field(default_factory=Inner)
    source: str = dataclasses.field(default="", metadata={"internal": True})


def built(text: str) -> Outer:
    return build(Outer, parse_yaml(text, "o.yaml"), "o.yaml")


def error_of(text: str) -> str:
    with pytest.raises(YamlInputError) as err:
        built(text)
    return str(err.value)


def test_builds_nested_dataclasses_with_defaults_for_what_is_left_out():
    cfg = built("name: run\nenabled: true\nlimit: 3\ninner: {count: 2, names: [a, b]}\n")
    assert cfg == Outer(name="run", enabled=True, limit=3, inner=Inner(count=2, names=["a", "b"]))
    assert built("inner:\n") == Outer()  # a section with nothing under it keeps its defaults
    assert built("limit: null\n").limit is None


def test_text_that_spells_a_value_is_accepted_as_on_a_command_line():
    cfg = built("limit: '7'\ninner: {ratio: 6e-4, names: 'a, b'}\n")
    assert cfg.limit == 7 and cfg.inner.ratio == pytest.approx(6e-4) and cfg.inner.names == ["a", "b"]
    assert built("name: 12\n").name == "12"


def test_mappings_come_out_plain():
    extra = built("extra: {a: {b: [1, {c: 2}]}}\n").extra
    assert extra == {"a": {"b": [1, {"c": 2}]}}
    assert type(extra) is dict and type(extra["a"]) is dict and type(extra["a"]["b"][1]) is dict
    assert dataclasses.asdict(built("extra: {a: 1}\n"))["extra"] == {"a": 1}


def test_an_unknown_key_names_its_line_and_the_near_miss():
    message = error_of("name: a\ninner:\n  cont: 2\n")
    assert message.startswith("o.yaml:3: unknown key `inner.cont`. Did you mean `inner.count`?")
    assert message.endswith("Valid keys in `inner`: count, ratio, names")


def test_internal_fields_are_not_keys():
    assert "Valid keys in the top level: name, enabled, limit, extra, inner" in error_of("source: f\n")


@pytest.mark.parametrize("text, line, words", [
    ("enabled: off\n", 1, ["`enabled` must be true or false, got the text 'off'", "only true and"]),
    ("name: a\nlimit: 2.5\n", 2, ["`limit` must be a whole number, got the number 2.5"]),
    ("limit: true\n", 1, ["`limit` must be a whole number, got the boolean true"]),
    ("inner:\n  ratio: fast\n", 2, ["`inner.ratio` must be a number", "'fast'"]),
    ("inner:\n  ratio: .nan\n", None, []),  # a number; whether NaN is allowed is the caller's rule
    ("name: [a]\n", 1, ["`name` must be a string", "quote it"]),
    ("inner: {names: 3}\n", 1, ["`inner.names` must be a list", "[a, b, ...]"]),
    ("inner: {names: [a, [b]]}\n", 1, ["`inner.names[1]` must be a string"]),
    ("extra: [a]\n", 1, ["`extra` must be a mapping"]),
    ("name: a\ninner: 3\n", 2, ["`inner` must be a mapping of keys, got the number 3"]),
])
def test_a_bad_value_is_one_line_naming_file_line_and_field(text, line, words):
    if line is None:
        assert math.isnan(built(text).inner.ratio)
        return
    message = error_of(text)
    assert message.startswith(f"o.yaml:{line}: "), message
    assert "\n" not in message
    for word in words:
        assert word in message, message


def test_values_without_lines_name_only_the_file():
    with pytest.raises(YamlInputError, match=r"^run.json: `inner.count` must be a whole number"):
        build(Outer, {"inner": {"count": "many"}}, "run.json")
    with pytest.raises(YamlInputError, match=r"^run.json: expected a mapping of keys, got a list"):
        build(Outer, [1], "run.json")


# --------------------------------------------------------------------------- small helpers


def test_did_you_mean_and_closest_match():
    assert typed_yaml.closest_match("hots", ["host", "port"]) == "host"
    assert typed_yaml.closest_match("zzz", ["host", "port"]) is None
    assert typed_yaml.did_you_mean("sesion", ["session"]) == "did you mean 'session'?"
    in_train = typed_yaml.did_you_mean("lrr", ["lr"], quote=lambda k: f"`train.{k}`")
    assert in_train == "did you mean `train.lr`?"
    assert typed_yaml.did_you_mean("zzz", ["host"]) == ""


@pytest.mark.parametrize("value, expected", [
    (1, 1.0), (2.5, 2.5), (float("nan"), None), (float("inf"), None), (True, None), ("3", None), (None, None),
])
def test_finite(value, expected):
    assert typed_yaml.finite(value) == expected


def test_values_are_described_in_words():
    assert typed_yaml.kind_of("abc") == "the text 'abc'" and typed_yaml.kind_of(True) == "the boolean true"
    assert typed_yaml.kind_of(None) == "nothing" and typed_yaml.kind_of([1]) == "a list"
    assert typed_yaml.show("x" * 100).endswith("...") and len(typed_yaml.show("x" * 100)) == 60
    assert typed_yaml.located("f.yaml", 3) == "f.yaml:3" and typed_yaml.located("f.yaml", None) == "f.yaml"


@pytest.mark.parametrize("text, line, byte", [
    ("a: 1\nb: x\x07y\n", 2, 0x07),  # a bell copied from a terminal
    ("a: 1\nb: 2\nc: \x00\n", 3, 0x00),
    ("\x1b[31ma: 1\n", 1, 0x1b),
])
def test_a_control_byte_is_named_with_its_line(text, line, byte):
    with pytest.raises(YamlInputError) as err:
        parse_yaml(text, "c.yaml")
    assert str(err.value) == (
        f"c.yaml:{line}: character {byte:#04x} (a control byte) is not allowed in YAML; "
        "remove it (a copy from a terminal or a binary file?)"
    )


def test_a_second_document_is_refused_at_the_line_that_starts_it():
    with pytest.raises(YamlInputError) as err:
        parse_yaml("a: 1\n---\nb: 2\n", "two.yaml")
    assert str(err.value).startswith("two.yaml:2: not valid YAML: expected a single document")
    assert str(err.value).endswith("(column 1); fix the syntax there")
