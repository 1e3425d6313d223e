"""The hand-rolled renderer must produce what Prometheus' own parsers accept, in both formats."""

import gzip
import math
import zlib

import pytest
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics
from prometheus_client.parser import text_string_to_metric_families as parse_text

from exporter.exposition import (
    COUNTER,
    GAUGE,
    INFO,
    Desc,
    Family,
    GzipRenderer,
    format_value,
    label_string,
    render,
)


def families() -> list[Family]:
    reads = Desc("gpuio_test_reads_total", COUNTER, "Reads.\nWith a second line and a \\ backslash.")
    depth = Desc("gpuio_test_depth", GAUGE, "Depth.")
    info = Desc("gpuio_test_info", INFO, "Identity.")
    return [
        Family(reads, [reads.sample(label_string({"device": "sda"}), 12), reads.sample('{device="b"}', 2**64)]),
        Family(depth, [depth.sample("", 0.25), depth.sample('{k="nan"}', math.nan)]),
        Family(info, [info.sample(label_string({"model": 'Q"uote\\d\nnew'}), 1)]),
        Family(depth, []),  # an empty family is left out entirely
    ]


def test_text_format_round_trips_through_prometheus_parser() -> None:
    parsed = {f.name: f for f in parse_text(render(families()))}
    assert parsed["gpuio_test_reads"].type == "counter"
    values = {tuple(s.labels.items()): s.value for s in parsed["gpuio_test_reads"].samples}
    assert values == {(("device", "sda"),): 12.0, (("device", "b"),): float(2**64)}
    assert parsed["gpuio_test_info"].samples[0].labels["model"] == 'Q"uote\\d\nnew'
    assert parsed["gpuio_test_info"].type == "gauge"
    assert parsed["gpuio_test_reads"].documentation == "Reads.\nWith a second line and a \\ backslash."


def test_openmetrics_format_round_trips_through_openmetrics_parser() -> None:
    text = render(families(), openmetrics=True)
    assert text.endswith("# EOF\n")
    parsed = {f.name: f for f in parse_openmetrics(text)}
    assert parsed["gpuio_test_reads"].type == "counter"
    assert parsed["gpuio_test"].type == "info"  # OpenMetrics names the family without _info
    assert parsed["gpuio_test"].samples[0].name == "gpuio_test_info"


@pytest.mark.parametrize(("value", "text"), [
    (3, "3"), (0.001 * 9516, "9.516"), (math.inf, "+Inf"), (-math.inf, "-Inf"), (math.nan, "NaN"),
    (1e300, "1e+300"), (18446744073709551615, "18446744073709551615"),
])
def test_format_value_parses_back_to_the_same_float(value: float, text: str) -> None:
    assert format_value(value) == text
    if not math.isnan(value):
        assert float(text) == float(value)


def test_desc_rejects_names_that_break_conventions() -> None:
    with pytest.raises(ValueError, match="_total"):
        Desc("gpuio_reads", COUNTER, "x")
    with pytest.raises(ValueError, match="_info"):
        Desc("gpuio_identity", INFO, "x")


def _families(frozen_sweep: list[Family]) -> list[Family]:
    live = Desc("gpuio_live_total", COUNTER, "changes every scrape")
    last = Desc("gpuio_last", GAUGE, "after the frozen run")
    return [live.family([live.sample("", 1)]), *frozen_sweep, last.family([last.sample('{a="x"}', 2.5)])]


def _members(body: bytes) -> int:
    """How many gzip members a body holds (each one a complete gzip stream)."""
    count = 0
    while body:
        decompressor = zlib.decompressobj(wbits=31)
        decompressor.decompress(body)
        body = decompressor.unused_data
        count += 1
    return count


@pytest.mark.parametrize("openmetrics", [False, True])
def test_gzip_renderer_bodies_decompress_to_the_plain_exposition(openmetrics: bool) -> None:
    smart = Desc("gpuio_smart_value", GAUGE, "from a background sweep")
    sweep = [Family(smart, [smart.sample(label_string({"device": f"sd{c}"}), 7) for c in "abc"], frozen=True)]
    renderer = GzipRenderer(1)
    first = renderer.compress(_families(sweep), openmetrics)
    assert gzip.decompress(first).decode() == render(_families(sweep), openmetrics)
    assert _members(first) == 3  # before the frozen run, the run, after it (with # EOF)
    # The same sweep again: its member is the cached bytes, the rest compressed anew.
    second = renderer.compress(_families(sweep), openmetrics)
    assert second == first
    # A new sweep (new objects, other values) is compressed again, not served from the cache.
    new_sweep = [Family(smart, [smart.sample(label_string({"device": "sda"}), 8)], frozen=True)]
    third = renderer.compress(_families(new_sweep), openmetrics)
    assert gzip.decompress(third).decode() == render(_families(new_sweep), openmetrics)
    if openmetrics:
        list(parse_openmetrics(gzip.decompress(third).decode()))


def test_gzip_renderer_ends_with_eof_after_a_trailing_frozen_run() -> None:
    smart = Desc("gpuio_smart_value", GAUGE, "from a background sweep")
    sweep = [Family(smart, [smart.sample("", 1)], frozen=True)]
    body = GzipRenderer(1).compress(sweep, openmetrics=True)
    assert gzip.decompress(body).decode() == render(sweep, openmetrics=True)
    assert gzip.decompress(body).decode().endswith("# EOF\n")
