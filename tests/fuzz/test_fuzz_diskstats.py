"""Fuzz the diskstats parser and the whole collector on generated /proc/diskstats files.

Oracles: parse_line returns exactly what a well-formed line holds and raises only BadLine otherwise;
the collector raises nothing but MalformedSource (a file with no good line), its output parses as
Prometheus text and as OpenMetrics, and every device whose first line is well formed is exported with
that line's counters.
"""

from __future__ import annotations

import contextlib
import os
import re
import tempfile

from hypothesis import example, given
from hypothesis import strategies as st
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics

from exporter.collect import Collector, MalformedSource
from exporter.collectors.diskstats import FIELDS, BadLine, DiskstatsCollector, parse_line
from exporter.context import Context
from exporter.exposition import Family, render
from tests.conftest import parse_samples


def collected(collector: Collector) -> list[Family]:
    """What a scrape serves of the collector: its families, or those MalformedSource carries."""
    try:
        return collector.collect()
    except MalformedSource as bad:
        return bad.families


COUNTER = st.integers(min_value=0, max_value=2**64 - 1)
# Device names as the kernel could write them, and worse: any non-blank printable text.
NAME = st.text(st.characters(blacklist_categories=("Cs", "Zs", "Zl", "Zp", "Cc")), min_size=1, max_size=12)


@st.composite
def good_line(draw: st.DrawFn) -> tuple[str, tuple[int, int, str, list[int]]]:
    major, minor = draw(st.integers(0, 2**32)), draw(st.integers(0, 2**32))
    name = draw(NAME)
    stats = draw(st.lists(COUNTER, min_size=11, max_size=20))
    spaces = draw(st.sampled_from([" ", "  ", "\t", "    "]))
    line = spaces.join([f"{major:4d}", f"{minor:7d}", name, *map(str, stats)])
    return line, (major, minor, name, stats[: len(FIELDS)])


JUNK = st.one_of(
    st.text(max_size=200),
    st.lists(st.one_of(st.integers(-(2**70), 2**70).map(str), NAME, st.just("")), max_size=25).map(" ".join),
)


@given(good_line())
def test_parse_line_returns_what_a_good_line_holds(case: tuple[str, tuple[int, int, str, list[int]]]) -> None:
    line, expected = case
    assert parse_line(line) == expected


@given(JUNK)
@example("8 0 sda 1 2 3 4 5 6 7 8 9 10 -11")
@example("8 0 sda " + " ".join(["1"] * 10))
@example("x 0 sda " + " ".join(["1"] * 11))
def test_parse_line_raises_only_bad_line(line: str) -> None:
    try:
        major, minor, name, stats = parse_line(line)
    except BadLine:
        return
    assert major >= 0 and minor >= 0 and min(stats) >= 0 and 11 <= len(stats) <= len(FIELDS)
    assert name and not any(ch.isspace() for ch in name)


@st.composite
def diskstats_file(draw: st.DrawFn) -> tuple[bytes, dict[str, list[int]]]:
    """A file of good lines and junk (some of it not even ASCII), and what each device should export.

    The collector reads the file as ASCII with replacement characters, splits it into lines, and
    exports each device's first line that parses; a good line's counters are known exactly.
    """
    lines: list[str] = []
    truth: dict[str, list[int]] = {}  # decoded good line -> its counters
    for _ in range(draw(st.integers(0, 12))):
        if draw(st.booleans()):
            line, (_, _, _, stats) = draw(good_line())
            truth[_ascii(line)] = stats
            lines.append(line)
        else:
            lines.append(draw(JUNK))
    data = "\n".join(lines).encode("utf-8", "surrogatepass") + draw(st.sampled_from([b"\n", b"\r\n", b""]))
    if draw(st.booleans()):
        data += b"\n" + draw(st.binary(max_size=64))
    expected: dict[str, list[int]] = {}
    for line in data.decode("ascii", errors="replace").splitlines():
        parts = line.split(None, 3)
        if len(parts) < 3 or parts[2] in expected:
            continue
        if line in truth:
            expected[parts[2]] = truth[line]
        else:
            with contextlib.suppress(BadLine):
                expected[parts[2]] = parse_line(line)[3]  # junk that happens to be a good line
    return data, expected


def _ascii(text: str) -> str:
    return text.encode("utf-8", "surrogatepass").decode("ascii", errors="replace")


ROOT = tempfile.mkdtemp(prefix="gpuio-fuzz-diskstats-")
os.makedirs(os.path.join(ROOT, "proc"))
os.makedirs(os.path.join(ROOT, "sys", "block"))
CONTEXT = Context(procfs=os.path.join(ROOT, "proc"), sysfs=os.path.join(ROOT, "sys"))
# One collector for every example, so that its caches see one file after another, as over a day of scrapes.
LONG_LIVED = DiskstatsCollector(CONTEXT, {"device-include": re.compile(""), "device-exclude": None})


@given(diskstats_file())
def test_collector_on_generated_files(case: tuple[bytes, dict[str, list[int]]]) -> None:
    data, expected = case
    with open(os.path.join(CONTEXT.procfs, "diskstats"), "wb") as handle:
        handle.write(data)
    fresh = DiskstatsCollector(CONTEXT, {"device-include": re.compile(""), "device-exclude": None})
    for collector in (fresh, LONG_LIVED, LONG_LIVED):  # the third: every line served from the cache
        families = collected(collector)
        text = render(families)
        samples = parse_samples(text)
        list(parse_openmetrics(render(families, openmetrics=True)))
        exported = {name for name, _ in samples}
        assert all(name.startswith("gpuio_disk_") for name in exported)
        assert {dict(labels)["device"] for name, labels in samples if name == "gpuio_disk_reads_completed_total"
                } == set(expected)
        for name, stats in expected.items():
            device = frozenset({("device", name)})
            assert samples[("gpuio_disk_reads_completed_total", device)] == stats[0]
            assert samples[("gpuio_disk_read_bytes_total", device)] == float(stats[2]) * 512.0
            count = sum(1 for (metric, labels) in samples if labels == device and metric != "gpuio_disk_info"
                        and not metric.endswith("_info"))
            assert count == len(stats)
