"""The ENGINE record's series are declared once (gpuio.spool.ENGINE_SERIES); everything else follows."""

from __future__ import annotations

import typing

import pytest

from exporter import catalogue
from exporter.collectors import engines
from exporter.engines.model import PER_GPU_HISTOGRAMS
from exporter.exposition import render
from gpuio import metrics
from gpuio import spool as spool_format
from tests.conftest import engines_collector, parse_samples, undeclared

KINDS = {"histogram": "Histogram", "counter": "Counter", "gauge": "Gauge"}


def test_the_record_layout_follows_the_declarations() -> None:
    layout = spool_format.ENGINE_LAYOUT
    declared = [series.slot for series in spool_format.ENGINE_SERIES]
    assert list(layout.histograms) + list(layout.counters) + list(layout.gauges) == declared
    for series in spool_format.ENGINE_SERIES:
        if series.type == "histogram":
            assert layout.histograms[series.slot][2] == series.bounds


def test_each_declared_series_is_an_attribute_of_the_library_of_its_kind(spool_dir: str) -> None:
    hints = typing.get_type_hints(metrics.EngineMetrics)
    assert {name: hint.__name__ for name, hint in hints.items()} == {
        series.slot: KINDS[series.type] for series in spool_format.ENGINE_SERIES}
    bound = metrics.engine("declared")
    for series in spool_format.ENGINE_SERIES:
        assert type(getattr(bound, series.slot)).__name__ == KINDS[series.type]


@pytest.mark.parametrize("series", spool_format.ENGINE_SERIES, ids=lambda series: series.slot)
def test_the_catalogue_holds_the_declared_family(series: spool_format.Series) -> None:
    """Name, type, help, labels and unit as the library declares them: what docs/metrics.md (generated from
    the catalogue) says about the family."""
    desc = catalogue.by_name(series.name)
    # a histogram whose buckets nothing reads is served as a summary by default (its _count and _sum)
    served = "summary" if series.type == "histogram" and series.name not in engines.DEFAULT_BUCKETED else series.type
    assert (desc.kind, desc.help, desc.labels, desc.unit) == (served, series.help, series.labels, series.unit)
    assert desc in (*engines.HISTOGRAM_DESCS.values(), engines.LOAD_BYTES, engines.PROFILED, engines.IN_FLIGHT,
                    engines.POOL_CONTEXTS, engines.POOL_IDLE)
    assert series.name.startswith("gpuio_engine_")
    assert series.name.endswith("_total") == (series.type == "counter")


def test_the_exporter_serves_the_declared_labels(spool_dir: str) -> None:
    assert PER_GPU_HISTOGRAMS == ("inference_seconds", "pool_wait_seconds")
    bound = metrics.engine("labelled")
    for series in spool_format.ENGINE_SERIES:
        if series.type == "histogram":
            getattr(bound, series.slot).observe(1.0)
    text = render(engines_collector(spool_dir).collect())
    assert undeclared(text) == []
    samples = parse_samples(text)
    for series in spool_format.ENGINE_SERIES:
        suffix = "_count" if series.type == "histogram" else ""
        found = [set(dict(labels)) for name, labels in samples if name == series.name + suffix]
        assert found and all(labels == set(series.labels) for labels in found), series.slot


def test_one_version_for_both_distributions() -> None:
    """exporter/instrument/gpuio/VERSION is the version: the library and the exporter read it, and the
    exporter's pins on the library carry it (make version VERSION=x.y.z changes them together)."""
    import pathlib
    import re

    import exporter
    import gpuio

    root = pathlib.Path(exporter.__file__).parent.parent
    version = (root / "exporter" / "instrument" / "gpuio" / "VERSION").read_text().strip()
    assert exporter.__version__ == gpuio.__version__ == version
    pins = re.findall(r'"gpuio(?:\[tensorrt\])?==([^"]+)"', (root / "pyproject.toml").read_text())
    assert pins == [version, version]
