"""The hand-rolled renderer must produce what Prometheus' own parsers accept, in both formats."""

import math

import pytest
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics
from prometheus_client.parser import text_string_to_metric_families as parse_text

from exporter.exposition import COUNTER, GAUGE, INFO, Desc, Family, format_value, label_string, render


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
