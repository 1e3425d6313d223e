"""A golden full /metrics file diffed in CI (with a switch to update it) and `promtool check metrics` clean
on it and on the live output of this machine.

For each fixture tree the exporter is built in-process exactly as the server builds it (exporter.cli's
build_scraper, from parse_args flags), scraped once and rendered; the sample lines that differ between
runs (collector durations) are dropped and the rest is compared byte for byte with
tests/golden/<tree>.prom.  ``pytest --update-golden`` (``make golden``) rewrites the files instead.
"""

from __future__ import annotations

import difflib
import os

import pytest
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics

from exporter import collectors  # noqa: F401  (importing registers the collectors)
from exporter.assemble import build_scraper
from exporter.config import parse_args
from exporter.exposition import render
from tests.conftest import KERNELS, REPO, root

GOLDEN = os.path.join(REPO, "tests", "golden")
TREES = (*KERNELS, "malformed")
# Sample lines whose value changes from run to run; their HELP/TYPE lines stay in the golden file.
VARYING = ("gpuio_scrape_collector_duration_seconds{", "gpuio_scrape_collector_duration_seconds ")

def scrape(argv: list[str], openmetrics: bool = False) -> str:
    """One scrape, rendered, of an exporter configured with ``argv`` (environment ignored)."""
    scraper = build_scraper(parse_args(argv, environ={}))
    try:
        families = scraper.scrape_sync()
    finally:
        scraper.stop()
    return render(families, openmetrics=openmetrics)


def tree_argv(tree: str) -> list[str]:
    procfs, sysfs = root(tree)
    # Only the collectors that read through --path.procfs/--path.sysfs: the others (SMART, NVML,
    # engines) see this machine's real hardware, which would make the golden files machine-dependent.
    return [f"--path.procfs={procfs}", f"--path.sysfs={sysfs}", "--web.disable-exporter-metrics",
            "--collector.disable-defaults", "--collector.diskstats", "--collector.pressure", "--collector.mountstats"]


def stable(text: str) -> str:
    return "".join(line for line in text.splitlines(keepends=True) if not line.startswith(VARYING))


def golden_path(tree: str) -> str:
    return os.path.join(GOLDEN, f"{tree}.prom")


@pytest.mark.parametrize("tree", TREES)
def test_output_matches_golden_file(tree, request) -> None:
    actual = stable(scrape(tree_argv(tree)))
    path = golden_path(tree)
    if request.config.getoption("--update-golden"):
        os.makedirs(GOLDEN, exist_ok=True)
        with open(path, "w", encoding="utf-8") as handle:
            handle.write(actual)
        return
    if not os.path.exists(path):
        pytest.fail(f"{os.path.relpath(path, REPO)} is missing: run `make golden` to create it", pytrace=False)
    with open(path, encoding="utf-8") as handle:
        expected = handle.read()
    if actual != expected:
        diff = "".join(difflib.unified_diff(
            expected.splitlines(keepends=True), actual.splitlines(keepends=True),
            fromfile=os.path.relpath(path, REPO), tofile=f"exporter output on tests/fixtures/roots/{tree}",
        ))
        pytest.fail(f"/metrics differs from the golden file; run `make golden` if the change is intended\n{diff}",
                    pytrace=False)


def test_golden_output_is_stable_between_scrapes() -> None:
    """Two scrapes of one exporter differ only in the lines the golden files drop."""
    scraper = build_scraper(parse_args(tree_argv("linux-6.8"), environ={}))
    try:
        first, second = render(scraper.scrape_sync()), render(scraper.scrape_sync())
    finally:
        scraper.stop()
    assert stable(first) == stable(second)
    assert first.count("gpuio_scrape_collector_duration_seconds{") == len(scraper.names)


@pytest.mark.parametrize("source", [*TREES, "live"])
def test_openmetrics_output_parses(source) -> None:
    text = scrape([] if source == "live" else tree_argv(source), openmetrics=True)
    assert text.endswith("# EOF\n")
    families = list(parse_openmetrics(text))
    assert families
    names = [family.name for family in families]
    assert len(names) == len(set(names)), "a family appears twice"
    assert sum(len(family.samples) for family in families) == sum(
        1 for line in text.splitlines() if line and not line.startswith("#")
    )
