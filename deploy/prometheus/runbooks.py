"""The runbooks (docs/runbooks/*.md), rendered from their templates (runbooks/*.md) under a config: the
thresholds, windows and durations a runbook quotes are the ones its alert fires on, whatever the config.

A template is the runbook's Markdown with a placeholder wherever it quotes a knob:

    [[STORM_BASELINE_FACTOR]]x      a knob of config.Config: a number as Python's ``g`` writes it (4, 0.5),
                                    text as it is (2m, job="gpuio"), a list joined by ", " (13, 31, 43, 45)
    [[NVME.await_seconds|ms]]       a disk-class limit of exporter/thresholds.py: SOLID_STATE, ROTATIONAL,
                                    NVME or NETWORK, then .await_seconds or .queue_size
    [[IO_PRESSURE_FULL|percent]]    the value in one of the FORMATS below

Double brackets, because nothing a runbook shows uses them: PromQL and Go templates use braces, Grafana
and the shell use $.  An unknown name or format raises ValueError naming the template and the
placeholder, so a renamed knob fails ``make generate`` instead of leaving a runbook that lies.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from typing import Any

from ..exporter_modules import thresholds
from ..generated import REPO
from . import durations
from .config import DEFAULT, KNOBS, NETWORK, NVME, ROTATIONAL, SOLID_STATE, Config

HERE = os.path.dirname(os.path.abspath(__file__))
TEMPLATES_DIR = os.path.join(HERE, "runbooks")
RUNBOOKS_DIR = os.path.join(REPO, "docs", "runbooks")

# The numbers come from config.py, the text from the template: an edit of the output is lost.
HEADER = ("<!-- Generated from deploy/prometheus/runbooks/{name} by `make generate`: "
          "edit the template, not this file. -->\n")

# [[NAME]] or [[NAME|format]]; names and formats never contain brackets or a bar.
PLACEHOLDER = re.compile(r"\[\[([^\[\]|\n]*)(?:\|([^\[\]|\n]*))?\]\]")

DISK_CLASSES: dict[str, thresholds.DiskClass] = {
    "SOLID_STATE": SOLID_STATE,
    "ROTATIONAL": ROTATIONAL,
    "NVME": NVME,
    "NETWORK": NETWORK,
}
DISK_LIMITS = ("await_seconds", "queue_size")


# --- values ------------------------------------------------------------------------------------------------

def value_of(name: str, config: Config) -> Any:
    """The value a placeholder name stands for: a knob of ``config``, or a disk-class limit."""
    if name in KNOBS:
        return getattr(config, name)
    disk_class, dot, limit = name.partition(".")
    if dot and disk_class in DISK_CLASSES and limit in DISK_LIMITS:
        return getattr(DISK_CLASSES[disk_class], limit)
    raise ValueError("no such knob of deploy/prometheus/config.py, nor a disk-class limit "
                     f"({'|'.join(DISK_CLASSES)}.{'|'.join(DISK_LIMITS)})")


def number(value: Any) -> float:
    # bool is an int to Python, but no threshold is a bool.
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{value!r} is not a number")
    return value


# The words a duration is written in: the largest unit that divides it (1h30m reads "90 minutes").
UNIT_WORDS = (("day", 86_400_000), ("hour", 3_600_000), ("minute", 60_000), ("second", 1_000),
              ("millisecond", 1))


def milliseconds(value: Any) -> int:
    """A duration knob as the config writes it (90s, 1h30m), or a knob in seconds, in milliseconds."""
    return durations.milliseconds(value) if isinstance(value, str) else round(number(value) * 1000)


def count_and_unit(value: Any) -> tuple[int, str]:
    """``"2m"`` -> (2, "minute"); ``900`` (seconds) -> (15, "minute")."""
    total = milliseconds(value)
    for word, size in UNIT_WORDS:
        if total and total % size == 0:
            return total // size, word
    return 0, "second"


# --- formats -------------------------------------------------------------------------------------------------

def plain(value: Any) -> str:
    """No format given: a number as ``g`` writes it, text as it is, a list joined by commas."""
    if isinstance(value, (tuple, list)):
        return ", ".join(plain(item) for item in value)
    if isinstance(value, str):
        return value
    return f"{number(value):g}"


def duration(value: Any) -> str:
    count, unit = count_and_unit(value)
    return f"{count} {unit}" + ("" if count == 1 else "s")


def a_duration(value: Any) -> str:
    count, unit = count_and_unit(value)
    if count != 1:
        return duration(value)
    return f"{'an' if unit == 'hour' else 'a'} {unit}"


def bare_duration(value: Any) -> str:
    count, unit = count_and_unit(value)
    return unit if count == 1 else duration(value)


def possessive_duration(value: Any) -> str:
    count, unit = count_and_unit(value)
    return f"{unit}'s" if count == 1 else f"{duration(value)}'"


def hyphen_duration(value: Any) -> str:
    count, unit = count_and_unit(value)
    return f"{count}-{unit}"


def share(value: Any) -> str:
    # Runbooks say "more than half of its scrapes"; any other share reads as a percentage.
    return "half" if number(value) == 0.5 else f"{number(value) * 100:g} %"


FORMATS: dict[str, Callable[[Any], str]] = {
    "g": lambda value: f"{number(value):g}",                        # 0.5 -> 0.5, 4.0 -> 4
    "percent": lambda value: f"{number(value) * 100:g} %",          # 0.3 -> 30 %
    "percent_number": lambda value: f"{number(value) * 100:g}",     # 0.3 -> 30 (as `cat /proc/pressure/io` shows)
    "share": share,                                                 # 0.5 -> half, 0.4 -> 40 %
    "ms": lambda value: f"{number(value) * 1000:g} ms",             # 0.005 -> 5 ms
    "s": lambda value: f"{number(value):g} s",                      # 60.0 -> 60 s
    # Durations: a config duration ("2m", "1h") or a number of seconds (900).
    "duration": duration,                                           # 2m -> 2 minutes, 1m -> 1 minute
    "a_duration": a_duration,                                       # 1m -> a minute, 1h -> an hour, 2m -> 2 minutes
    "bare_duration": bare_duration,                                 # 1m -> minute ("the last minute"), 2m -> 2 minutes
    "possessive_duration": possessive_duration,                     # 1h -> hour's, 2h -> 2 hours'
    "hyphen_duration": hyphen_duration,                             # 15m -> 15-minute ("the 15-minute window")
}


# --- rendering -------------------------------------------------------------------------------------------------

def placeholders(text: str) -> list[tuple[str, str | None]]:
    """Each placeholder of a template, in order: (name, format or None)."""
    return [(match.group(1), match.group(2)) for match in PLACEHOLDER.finditer(text)]


def substitute(name: str, form: str | None, config: Config) -> str:
    value = value_of(name, config)
    if form is None:
        return plain(value)
    if form not in FORMATS:
        raise ValueError(f"unknown format {form!r} (known: {', '.join(FORMATS)})")
    return FORMATS[form](value)


def render(template: str, text: str, config: Config = DEFAULT) -> str:
    """``text`` (the template named ``template``) with every placeholder replaced by its value under ``config``."""
    def replacement(match: re.Match[str]) -> str:
        try:
            return substitute(match.group(1), match.group(2), config)
        except ValueError as error:
            raise ValueError(f"runbook template {template}: placeholder {match.group(0)}: {error}") from None

    # A bracket pair that is no placeholder is a typo that would reach on-call's page as is.
    leftover = PLACEHOLDER.sub("", text)
    for stray in ("[[", "]]"):
        if stray in leftover:
            line = leftover[:leftover.index(stray)].count("\n") + 1
            raise ValueError(f"runbook template {template}: line {line}: {stray!r} that is no placeholder")
    return PLACEHOLDER.sub(replacement, text)


def template_names() -> list[str]:
    return sorted(name for name in os.listdir(TEMPLATES_DIR) if name.endswith(".md"))


def read_template(name: str) -> str:
    with open(os.path.join(TEMPLATES_DIR, name), encoding="utf-8") as handle:
        return handle.read()


def rendered(config: Config = DEFAULT, directory: str = RUNBOOKS_DIR) -> dict[str, str]:
    """Path of each runbook (docs/runbooks/<Name>.md, or <Name>.md in ``directory``) -> its text under ``config``."""
    return {os.path.join(directory, name): HEADER.format(name=name) + render(name, read_template(name), config)
            for name in template_names()}
