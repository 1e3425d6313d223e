"""Fuzz the PSI parser and the pressure collector on generated /proc/pressure trees.

Oracles: parse_total returns a well-formed line's kind and total exactly and raises only BadLine
otherwise; the collector raises nothing but MalformedSource (a file with no good line) or Absent (no
file of the tree can be read: PSI off), and its output parses as Prometheus text and as OpenMetrics.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics

from exporter.collect import Absent, Collector, MalformedSource
from exporter.collectors.pressure import RESOURCES, BadLine, PressureCollector, parse_total
from exporter.context import Context
from exporter.exposition import Family, render
from tests.conftest import parse_samples


def collected(collector: Collector) -> list[Family]:
    """What a scrape serves of the collector: its families, or those MalformedSource or Absent carries
    (a tree with no readable file at all is an absent source)."""
    try:
        return collector.collect()
    except (MalformedSource, Absent) as outcome:
        return outcome.families


AVERAGE = st.floats(0, 100, allow_nan=False).map(lambda value: f"{value:.2f}")


@st.composite
def good_line(draw: st.DrawFn) -> tuple[str, tuple[str, int]]:
    kind = draw(st.sampled_from(["some", "full"]))
    total = draw(st.integers(0, 2**64 - 1))
    fields = [f"avg10={draw(AVERAGE)}", f"avg60={draw(AVERAGE)}", f"avg300={draw(AVERAGE)}", f"total={total}"]
    return f"{kind} {' '.join(draw(st.permutations(fields)))}", (kind, total)


# What reaches parse_total from the collector: ASCII text (the file is read as ASCII with replacement).
ASCII_TEXT = st.text(st.characters(max_codepoint=127) | st.just("\ufffd"), max_size=120)


@given(good_line())
def test_parse_total_returns_what_a_good_line_holds(case: tuple[str, tuple[str, int]]) -> None:
    line, expected = case
    assert parse_total(line) == expected


@given(ASCII_TEXT | good_line().map(lambda case: case[0][: len(case[0]) // 2]))
@example("some total=")
@example("full total=-1")
@example("some avg10=1 total=12x")
@example(f"some total={'9' * 5000}")  # past Python's 4,300-digit int() limit: a bad line, not a ValueError
def test_parse_total_raises_only_bad_line(line: str) -> None:
    try:
        kind, total = parse_total(line)
    except BadLine:
        return
    assert kind in ("some", "full") and total >= 0


@st.composite
def pressure_tree(draw: st.DrawFn) -> dict[str, bytes | None]:
    """Per resource: a file of good lines, junk and raw bytes, or no file at all."""
    tree: dict[str, bytes | None] = {}
    for resource in RESOURCES:
        if draw(st.booleans()):
            tree[resource] = None
            continue
        lines = draw(st.lists(good_line().map(lambda case: case[0]) | ASCII_TEXT, max_size=4))
        tree[resource] = "\n".join(lines).encode() + draw(st.binary(max_size=16))
    return tree


ROOT = tempfile.mkdtemp(prefix="gpuio-fuzz-pressure-")
CONTEXT = Context(procfs=ROOT, sysfs=ROOT)
DIRECTORY = os.path.join(ROOT, "pressure")


@given(pressure_tree())
@example({"cpu": None, "io": None, "memory": None, "irq": None})  # found by this suite: PSI off, an absent source
def test_collector_on_generated_trees(tree: dict[str, bytes | None]) -> None:
    _write(tree)
    families = collected(PressureCollector(CONTEXT, {}))
    samples = parse_samples(render(families))
    assert all(name.startswith("gpuio_pressure_") and value >= 0 for (name, _), value in samples.items())
    list(parse_openmetrics(render(families, openmetrics=True)))


def _write(tree: dict[str, bytes | None]) -> None:
    shutil.rmtree(DIRECTORY, ignore_errors=True)
    os.makedirs(DIRECTORY)
    for resource, data in tree.items():
        if data is not None:
            with open(os.path.join(DIRECTORY, resource), "wb") as handle:
                handle.write(data)


# Found by this suite (2026-11) and fixed in exporter/collectors/pressure.py.
def test_a_file_with_two_some_lines_renders_one_family() -> None:
    """No kernel writes two "some" lines; the first one counts, and OpenMetrics stays valid."""
    _write({"io": b"some avg10=0.00 avg60=0.00 avg300=0.00 total=1\n"
                  b"some avg10=0.00 avg60=0.00 avg300=0.00 total=2\n", "cpu": None, "memory": None, "irq": None})
    families = collected(PressureCollector(CONTEXT, {}))
    list(parse_openmetrics(render(families, openmetrics=True)))
    assert parse_samples(render(families)) == {("gpuio_pressure_io_waiting_seconds_total", frozenset()): 1e-06}


def test_parse_total_refuses_non_ascii_digits_with_bad_line() -> None:
    """str.isdigit() accepts '\u00b2', int() does not: that must be BadLine, not ValueError."""
    with pytest.raises(BadLine):
        parse_total("some total=\u00b2")
