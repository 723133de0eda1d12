# SPDX-License-Identifier: Apache-2.0
"""The settings layer: one declaration gives the flag, the environment default, the checks and the mapping reader."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from kvpush.settings import Settings, setting


@dataclasses.dataclass(frozen=True)
class Example(Settings):
    names: tuple[str, ...] = setting(flag="--name", env="EXAMPLE_NAMES", repeatable=True, help="a name, repeatable")
    timeout_s: float = setting(2.0, flag="--timeout", env="EXAMPLE_TIMEOUT_S", convert=float, positive=True, help="seconds to wait")
    retries: int = setting(1, flag="--retries", env="EXAMPLE_RETRIES", convert=int, at_least=1, help="tries, counting the first")
    color: str = setting("red", flag="--color", env="EXAMPLE_COLOR", choices=("red", "blue"), help="a color")
    key_only: str = setting("", env="EXAMPLE_KEY_ONLY", help="only in mappings")
    undeclared: int = 7


def parse(monkeypatch, env: dict[str, str], *argv: str, **defaults) -> Example:
    for name in ("EXAMPLE_NAMES", "EXAMPLE_TIMEOUT_S", "EXAMPLE_RETRIES", "EXAMPLE_COLOR", "EXAMPLE_KEY_ONLY"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    parser = argparse.ArgumentParser()
    Example.add_arguments(parser, **defaults)
    return Example.from_args(parser.parse_args(list(argv)))


def test_a_declaration_gives_a_flag_whose_help_names_the_env_variable_and_default():
    parser = argparse.ArgumentParser()
    Example.add_arguments(parser)
    text = parser.format_help()
    assert "--timeout TIMEOUT" in text and "(env EXAMPLE_TIMEOUT_S; default 2.0)" in text
    assert "(env EXAMPLE_NAMES, comma-separated)" in text
    assert "--undeclared" not in text and "--key-only" not in text


def test_flags_win_over_the_environment_which_wins_over_defaults(monkeypatch):
    assert parse(monkeypatch, {}) == Example(names=(), timeout_s=2.0, retries=1)
    assert parse(monkeypatch, {"EXAMPLE_TIMEOUT_S": "5"}).timeout_s == 5.0
    assert parse(monkeypatch, {"EXAMPLE_TIMEOUT_S": "5"}, "--timeout", "7").timeout_s == 7.0
    assert parse(monkeypatch, {}, retries=3).retries == 3


def test_a_repeatable_flag_replaces_the_environments_list(monkeypatch):
    assert parse(monkeypatch, {"EXAMPLE_NAMES": "a, b,"}).names == ("a", "b")
    assert parse(monkeypatch, {"EXAMPLE_NAMES": "a,b"}, "--name", "c", "--name", "d").names == ("c", "d")


def test_a_malformed_environment_value_names_the_variable(monkeypatch):
    with pytest.raises(SystemExit, match="EXAMPLE_RETRIES='many' is not valid"):
        parse(monkeypatch, {"EXAMPLE_RETRIES": "many"})


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--timeout", "0"], "--timeout must be a positive number, not 0.0"),
        (["--retries", "0"], "--retries must be at least 1, not 0"),
        (["--color", "green"], "--color must be one of red, blue, not 'green'"),
    ],
)
def test_a_value_out_of_bounds_is_refused_naming_its_flag(monkeypatch, argv, message):
    with pytest.raises(ValueError, match=message):
        parse(monkeypatch, {}, *argv)


def test_direct_construction_is_checked_too():
    with pytest.raises(ValueError, match="--retries must be at least 1"):
        Example(names=(), retries=0)


def test_a_mapping_is_read_converted_and_checked_naming_the_key(monkeypatch):
    monkeypatch.setenv("EXAMPLE_KEY_ONLY", "from-env")
    assert Example.values_from_mapping({"timeout_s": "3", "color": "blue"}, source="extra") == {
        "timeout_s": 3.0,
        "color": "blue",
        "key_only": "from-env",
    }
    with pytest.raises(ValueError, match=r"unknown extra keys \['undeclared'\]; known: \['color', 'key_only', 'names', 'retries', 'timeout_s'\]"):
        Example.values_from_mapping({"undeclared": 1}, source="extra")
    with pytest.raises(ValueError, match="extra.timeout_s=-1: expected a positive number"):
        Example.values_from_mapping({"timeout_s": -1}, source="extra")
    with pytest.raises(ValueError, match="extra.retries='x': expected invalid literal"):
        Example.values_from_mapping({"retries": "x"}, source="extra")
    monkeypatch.setenv("EXAMPLE_RETRIES", "0")
    with pytest.raises(ValueError, match=r"\$EXAMPLE_RETRIES='0': expected at least 1"):
        Example.values_from_mapping({}, source="extra")
