# SPDX-License-Identifier: Apache-2.0
"""Settings declared once: each dataclass field names its flag, environment variable, conversion and bounds.

A service's config is a frozen dataclass deriving from Settings whose
fields are declared with setting(...). Its command-line flags (with the
environment variable as default), the per-field checks and the reading of
a plain mapping (vLLM's kv_connector_extra_config) all come from those
declarations; __post_init__ adds only the checks that span fields.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Self

_METADATA_KEY = "kvpush.setting"


@dataclasses.dataclass(frozen=True)
class Setting:
    """How one field is set and which values it may take."""

    help: str
    flag: str | None = None
    env: str | None = None
    convert: Callable[[Any], Any] = str
    positive: bool = False
    at_least: float | None = None
    choices: Sequence[str] = ()
    # repeatable: the flag may be given several times and the environment
    # variable holds a comma-separated list; the field is a tuple.
    repeatable: bool = False
    metavar: str | None = None

    @property
    def dest(self) -> str:
        """The argparse attribute of the flag."""
        if self.flag is None:
            raise ValueError("a setting without a flag has no argparse attribute")
        return self.flag.lstrip("-").replace("-", "_")

    def expected(self, value: Any) -> str | None:
        """What value should have been, or None when it is acceptable."""
        if value is None:
            return None
        if self.positive and not value > 0:
            return "a positive number"
        if self.at_least is not None and not value >= self.at_least:
            return f"at least {self.at_least:g}"
        if self.choices and value not in self.choices:
            return f"one of {', '.join(self.choices)}"
        return None

    def from_env(self, default: Any) -> Any:
        """The environment variable's value, converted, or default when it is unset or empty."""
        raw = os.environ.get(self.env, "") if self.env else ""
        if not raw:
            return default
        try:
            if self.repeatable:
                return tuple(self.convert(item.strip()) for item in raw.split(",") if item.strip())
            return self.convert(raw)
        except (TypeError, ValueError) as exc:
            raise SystemExit(f"{self.env}={raw!r} is not valid: {exc}") from None


def setting(default: Any = dataclasses.MISSING, **declaration: Any) -> Any:
    """A dataclass field declared as a setting; keywords as Setting's fields."""
    return dataclasses.field(default=default, metadata=declared(**declaration))


def declared(**declaration: Any) -> dict[str, Setting]:
    """A setting's field metadata. A setting without a default is `dataclasses.field(metadata=declared(...))`:
    type checkers take any other call for a default, so they would let a field without one follow it."""
    return {_METADATA_KEY: Setting(**declaration)}


class _Repeat(argparse.Action):
    """Collects a repeatable flag into a tuple; the first use replaces the environment's list instead of extending it."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any, option_string: str | None = None) -> None:
        items = getattr(namespace, self.dest)
        if items is self.default:
            items = ()
        setattr(namespace, self.dest, (*items, values))


def _declared(cls: type) -> list[tuple[dataclasses.Field, Setting]]:
    return [(f, f.metadata[_METADATA_KEY]) for f in dataclasses.fields(cls) if _METADATA_KEY in f.metadata]


class Settings:
    """Base of a settings dataclass: flags, environment defaults and per-field checks from its declarations."""

    def __post_init__(self) -> None:
        for f, spec in _declared(type(self)):
            value = getattr(self, f.name)
            expected = spec.expected(value)
            if expected is not None:
                raise ValueError(f"{spec.flag or f.name} must be {expected}, not {value!r}")

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser, **defaults: Any) -> None:
        """Adds a flag per declared setting; its default is the environment variable's value, else defaults[name], else the field's."""
        for f, spec in _declared(cls):
            if spec.flag is None:
                continue
            if spec.repeatable:
                help_text = f"{spec.help} (env {spec.env}, comma-separated)"
                parser.add_argument(spec.flag, action=_Repeat, type=_flag_type(spec.convert), default=spec.from_env(()), metavar=spec.metavar, help=help_text)
                continue
            default = defaults.get(f.name, None if f.default is dataclasses.MISSING else f.default)
            shown = "unset" if default is None else default
            help_text = f"{spec.help} (env {spec.env}; default {shown})"
            parser.add_argument(spec.flag, type=_flag_type(spec.convert), default=spec.from_env(default), metavar=spec.metavar, help=help_text)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Self:
        """The settings parsed by a parser add_arguments configured; fields without a flag keep their defaults."""
        return cls(**{f.name: getattr(args, spec.dest) for f, spec in _declared(cls) if spec.flag is not None})

    @classmethod
    def values_from_mapping(cls, mapping: Mapping[str, Any], *, source: str) -> dict[str, Any]:
        """The declared settings found in mapping (keys are field names), else in their environment variables, converted and checked.

        Raises ValueError naming source.key (or $ENV) for an unknown key or a bad value.
        """
        declared = _declared(cls)
        known = sorted(f.name for f, _ in declared)
        unknown = sorted(set(mapping) - set(known))
        if unknown:
            raise ValueError(f"unknown {source} keys {unknown}; known: {known}")
        values: dict[str, Any] = {}
        for f, spec in declared:
            if f.name in mapping:
                raw, where = mapping[f.name], f"{source}.{f.name}"
            elif spec.env and os.environ.get(spec.env):
                raw, where = os.environ[spec.env], f"${spec.env}"
            else:
                continue
            try:
                value = spec.convert(raw)
            except (TypeError, ValueError) as exc:
                raise ValueError(f"{where}={raw!r}: expected {exc}") from exc
            expected = spec.expected(value)
            if expected is not None:
                raise ValueError(f"{where}={raw!r}: expected {expected}")
            values[f.name] = value
        return values


def _flag_type(convert: Callable[[str], Any]) -> Callable[[str], Any]:
    """convert as an argparse type: the reason a converter gives for refusing a value reaches the user, not only the value."""

    def converted(text: str) -> Any:
        try:
            return convert(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from exc

    converted.__name__ = getattr(convert, "__name__", "value")
    return converted
