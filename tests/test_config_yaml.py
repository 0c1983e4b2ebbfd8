"""Config YAML as untrusted input: alias bombs, recursive anchors, deep nesting and huge numbers are
refused with a short message; `1e3` is a number in a config file and in --set."""

import itertools

import pytest

from cluster.cli import main as kvray_main
from cluster.config import ConfigError, load_config, parse_override
from cluster.config_yaml import YamlLimitError, load_yaml

LEVELS = "abcdefghijklmnop"
# 600 bytes that expand to 9**16 (1.9e15) strings under safe_load's alias sharing
BOMB = (
    'a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]\n'
    + "".join(f"{x}: &{x} [{','.join([f'*{p}'] * 9)}]\n" for p, x in itertools.pairwise(LEVELS))
    + "model:\n  model: *p\n"
)
# the same bomb on one line, for --set
FLOW_BOMB = "{" + ", ".join(line for line in BOMB.splitlines()[: len(LEVELS)]) + ", m: *p}"


def test_the_bomb_is_small():
    assert 550 < len(BOMB) < 650


def test_an_alias_bomb_is_refused_by_load_config(tmp_path):
    path = tmp_path / "bomb.yaml"
    path.write_text(BOMB)
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert str(e.value) == (
        f"config file {str(path)!r}: refused: expands to more than 100000 nodes (aliases counted as copies)"
    )


def test_an_alias_bomb_through_kvray_info(tmp_path, capsys):
    path = tmp_path / "bomb.yaml"
    path.write_text(BOMB)
    assert kvray_main(["info", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "refused: expands to more than 100000 nodes" in err and len(err) < 500, err


def test_an_alias_bomb_in_set_is_refused():
    with pytest.raises(ConfigError) as e:
        parse_override("model.model=" + FLOW_BOMB)
    assert str(e.value) == (
        "--set 'model.model': the value is refused: expands to more than 100000 nodes (aliases counted as copies)"
    )


@pytest.mark.parametrize(
    "text,rule",
    [
        ("a: &a [*a]\n", "a recursive alias (an anchor used inside itself)"),
        ("a: " + "[" * 100 + "]" * 100 + "\n", "nested deeper than 64 levels"),
        ("a: " + "[" * 20000 + "\n", "nested too deeply"),
        ("model:\n  seed: " + "9" * 5000 + "\n", "a value cannot be read (Exceeds the limit (4300 digits)"),
    ],
)
def test_other_hostile_documents(tmp_path, text, rule):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert f"refused: {rule}" in str(e.value) and len(str(e.value)) < 400


def test_a_config_too_big_is_refused(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("# " + "x" * (1 << 20) + "\n")
    with pytest.raises(ConfigError, match="refused: 1048577 characters; a config is at most 1048576"):
        load_config(path)


def test_a_config_not_utf8(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_bytes(b"model:\n  model: \xff\n")
    with pytest.raises(ConfigError, match=r"not UTF-8 \(byte 16\)"):
        load_config(path)


def test_python_tags_are_refused(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model: !!python/object/apply:os.system ['true']\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(path)


def test_anchors_within_the_limit_still_work():
    assert load_yaml("a: &x {b: 1}\nc: *x\n") == {"a": {"b": 1}, "c": {"b": 1}}


@pytest.mark.parametrize(
    "text,value",
    [
        ("1e3", 1000.0),
        ("-2E-5", -2e-5),
        ("1.5", 1.5),
        ("1.0e+3", 1000.0),
        (".5", 0.5),
        ("10", 10),
        ("1_000", 1000),
        ('"1e3"', "1e3"),
        ("e3", "e3"),
        ("true", True),
        ("null", None),
    ],
)
def test_yaml_numbers(text, value):
    assert load_yaml(f"v: {text}") == {"v": value}


def test_1e3_is_a_number_in_a_config_file_and_in_set(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("parallel:\n  step_timeout_s: 1e3\n")
    assert load_config(path).parallel.step_timeout_s == 1000.0
    assert load_config(None, ["parallel.placement_timeout_s=2e1"]).parallel.placement_timeout_s == 20.0
    assert parse_override("parallel.step_timeout_s=1e3") == ("parallel.step_timeout_s", 1000.0)


def test_limit_error_is_a_value_error():
    with pytest.raises(YamlLimitError):
        load_yaml("a: &a [*a]")
