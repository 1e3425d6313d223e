"""Option values as an operator types them, and their parsers: the bottom of the package.

Collectors declare their options here and the flag layer (:mod:`exporter.config`) reads them.  Nothing
here imports the web stack (FastAPI, bcrypt, YAML), so a collector can be imported, tested and run on a
machine that has only the standard library.  Each parser raises ValueError with the reason; the
option's ``accepted`` says what would do.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any


class ConfigError(ValueError):
    """A flag or environment value that cannot be used; the message is meant for the operator."""


@dataclass(frozen=True)
class Option:
    """A collector option, exposed as ``--collector.<collector>.<name>`` and ``GPUIO_COLLECTOR_...``."""

    name: str
    default: str | None  # as typed on the command line; None: unset
    parse: Callable[[str], Any]
    accepted: str
    help: str
    flag: str | None = None  # another flag name where the ecosystem has one (smartctl_exporter's smartctl.path)

    def flag_name(self, collector: str) -> str:
        return self.flag or f"collector.{collector}.{self.name}"


def with_defaults(declared: Sequence[Option], given: dict[str, Any]) -> dict[str, Any]:
    """Every declared option's value: as given, else (not given, or given as None: unset) its default
    parsed as a flag's would be, None where it has none.  The Option is the one place a default is written."""
    values = {option.name: None if option.default is None else option.parse(option.default) for option in declared}
    unknown = set(given) - set(values)
    if unknown:  # a misspelt option would quietly run at its default
        raise ValueError(f"no such option: {', '.join(sorted(unknown))}; declared: {', '.join(sorted(values))}")
    values.update((name, value) for name, value in given.items() if value is not None)
    return values


def parse_seconds(value: str) -> float:
    """A duration: plain seconds ("2.5") or Prometheus style ("500ms", "2s", "5m", "1h")."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)(ms|s|m|h)?", value.strip())
    if not match:
        raise ValueError("not a duration")
    scale = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}[match[2] or "s"]
    seconds = float(match[1]) * scale
    if seconds <= 0:
        raise ValueError("must be above zero")
    return seconds


def parse_count(minimum: int = 1) -> Callable[[str], int]:
    """A parser of whole numbers (ASCII digits: int() refuses '²', which isdigit() accepts) >= ``minimum``."""

    def parse(value: str) -> int:
        text = value.strip()
        if not (text.isascii() and text.isdigit()) or int(text) < minimum:
            raise ValueError(f"not a whole number of at least {minimum}")
        return int(text)

    return parse


def parse_choice(choices: Sequence[str]) -> Callable[[str], str]:
    def parse(value: str) -> str:
        if value not in choices:
            raise ValueError("unknown choice")
        return value

    parse.choices = tuple(choices)  # type: ignore[attr-defined]  # --help lists them
    return parse


def parse_bool(value: str) -> bool:
    lowered = value.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError("not a boolean")


def parse_regex(value: str) -> re.Pattern[str]:
    try:
        return re.compile(value)
    except (re.error, OverflowError, RecursionError) as exc:  # "a{4300000000}" is an OverflowError (found by fuzzing)
        raise ValueError(f"bad regular expression: {exc}") from None
