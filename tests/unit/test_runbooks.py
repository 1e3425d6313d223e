"""The runbooks are rendered from their templates (deploy/prometheus/runbooks/*.md) under the config: the
checked-in pages are current, every placeholder resolves, and a changed knob changes the page's words."""

from __future__ import annotations

import dataclasses
import glob
import os
from typing import Any

import pytest

from deploy.generated import stale_files
from deploy.prometheus import durations, runbooks
from deploy.prometheus.config import DEFAULT

TEMPLATES = runbooks.template_names()


def rendered_by_name(config: Any = DEFAULT) -> dict[str, str]:
    return {os.path.basename(path): text for path, text in runbooks.rendered(config).items()}


def test_checked_in_runbooks_are_what_the_templates_render() -> None:
    """CI's drift check: docs/runbooks/*.md are rendered(DEFAULT), and no page is left without a template."""
    present = glob.glob(os.path.join(runbooks.RUNBOOKS_DIR, "*.md"))
    stale = stale_files(runbooks.rendered(), present)
    assert stale == [], f"stale runbooks {[os.path.basename(path) for path in stale]}: run `make generate`"


def test_every_page_says_it_is_generated_and_from_which_template() -> None:
    for name, text in rendered_by_name().items():
        first = text.splitlines()[0]
        assert first.startswith("<!--") and first.endswith("-->"), name
        assert f"deploy/prometheus/runbooks/{name}" in first and "make generate" in first, name


@pytest.mark.parametrize("template", TEMPLATES)
def test_every_placeholder_resolves(template: str) -> None:
    text = runbooks.read_template(template)
    for name, form in runbooks.placeholders(text):
        assert runbooks.substitute(name, form, DEFAULT), f"{template}: [[{name}|{form}]] renders empty"
    assert "[[" not in runbooks.render(template, text)


def test_a_changed_knob_changes_the_storm_runbook_and_nothing_else() -> None:
    """The numbers DiskIOStorm's page quotes move with the knobs; no old value is left where a knob is meant,
    and pages that quote none of these knobs stay as they are."""
    variant = dataclasses.replace(DEFAULT, STORM_BASELINE_FACTOR=3.0, STORM_PAGE_FOR="7m", IO_PRESSURE_FULL=0.4)
    before, after = rendered_by_name(), rendered_by_name(variant)
    storm = after["DiskIOStorm.md"]
    for quoted in ("at least 3x the device's calm median", "at least 3x its calm median", "fires only at 3x",
                   "| critical | the storm, for 7 minutes,", 'or all tasks 40 % ("full")'):
        assert quoted in storm
    for old in ("4x", "the storm, for 2 minutes", "10 %"):
        assert old not in storm
    # Only the lines that quote those knobs changed.
    old_lines, new_lines = before["DiskIOStorm.md"].splitlines(), storm.splitlines()
    changed = [new for old, new in zip(old_lines, new_lines, strict=True) if old != new]
    assert changed and all(any(mark in line for mark in ("3x", "7 minutes", "40 %")) for line in changed)
    # MountIOStorm quotes STORM_PAGE_FOR and IO_PRESSURE_FULL too; no other page quotes any of the three.
    assert 'tasks\n  40 % ("full")' in after["MountIOStorm.md"] and "slow for 7 minutes" in after["MountIOStorm.md"]
    assert {name for name in before if before[name] != after[name]} == {"DiskIOStorm.md", "MountIOStorm.md"}


def distinct(value: Any) -> Any:
    """Another value of a knob's kind, one that no format renders like the default."""
    if isinstance(value, tuple):
        return ("99",)
    if isinstance(value, str):
        return "17h" if durations.DURATION.fullmatch(value) else 'job="elsewhere"'
    return value * 3 + 7


def test_every_quoted_knob_moves_its_page() -> None:
    """No placeholder renders the same text whatever its knob says (a format that ignores its value)."""
    knobs = {name for template in TEMPLATES for name, _ in runbooks.placeholders(runbooks.read_template(template))
             if "." not in name}
    before = rendered_by_name()
    for knob in sorted(knobs):
        after = rendered_by_name(dataclasses.replace(DEFAULT, **{knob: distinct(getattr(DEFAULT, knob))}))
        quoting = {template for template in TEMPLATES
                   if knob in {name for name, _ in runbooks.placeholders(runbooks.read_template(template))}}
        assert {name for name in before if before[name] != after[name]} == quoting, knob


@pytest.mark.parametrize(("text", "complaint"), [
    ("fires at [[NO_SUCH_KNOB]] x", "[[NO_SUCH_KNOB]]"),
    ("fires at [[NVME.await]]", "[[NVME.await]]"),
    ("for [[STORM_FOR|fortnights]]", "unknown format 'fortnights'"),
    ("selected by [[SELECTOR|ms]]", "[[SELECTOR|ms]]"),
    ("a duration [[SELECTOR|duration]]", "is not a duration"),
    ("for [[STORM_FOR]", "line 1: '[['"),
    ("\nfor STORM_FOR]]", "line 2: ']]'"),
])
def test_a_broken_placeholder_raises_naming_template_and_placeholder(text: str, complaint: str) -> None:
    with pytest.raises(ValueError, match="Broken.md") as raised:
        runbooks.render("Broken.md", text)
    assert complaint in str(raised.value)


@pytest.mark.parametrize(("form", "value", "written"), [
    ("g", 4.0, "4"),
    ("g", 0.25, "0.25"),
    ("percent", 0.1, "10 %"),
    ("percent", 0.07, "7 %"),
    ("percent_number", 0.3, "30"),
    ("share", 0.5, "half"),
    ("share", 0.4, "40 %"),
    ("ms", 0.005, "5 ms"),
    ("ms", 0.05, "50 ms"),
    ("s", 60.0, "60 s"),
    ("s", 30, "30 s"),
    ("duration", "2m", "2 minutes"),
    ("duration", "1m", "1 minute"),
    ("duration", "6h", "6 hours"),
    ("duration", "1h30m", "90 minutes"),
    ("duration", 900, "15 minutes"),
    ("duration", 1800, "30 minutes"),
    ("duration", "90s", "90 seconds"),
    ("a_duration", "1m", "a minute"),
    ("a_duration", "1h", "an hour"),
    ("a_duration", "1d", "a day"),
    ("a_duration", "2d", "2 days"),
    ("bare_duration", "1m", "minute"),
    ("bare_duration", "3m", "3 minutes"),
    ("possessive_duration", "1h", "hour's"),
    ("possessive_duration", "2h", "2 hours'"),
    ("hyphen_duration", "15m", "15-minute"),
])
def test_formats(form: str, value: Any, written: str) -> None:
    assert runbooks.FORMATS[form](value) == written


def test_no_format_writes_numbers_text_and_lists_as_they_are() -> None:
    assert runbooks.render("T.md", "[[STORM_BASELINE_FACTOR]]x [[GPU_ECC_WINDOW]] ([[XID_APPLICATION]]) "
                                   "{[[SELECTOR]]} [[NVME.queue_size]]") == '4x 1h (13, 31, 43, 45) {job="gpuio"} 16'
