"""docs/metrics.md documents every family the exporter can emit (checked on every fixture tree)."""

import re

import pytest

from exporter.assemble import build_scraper
from exporter.config import parse_args
from exporter.exposition import render
from tests.conftest import KERNELS, documented_families, root


@pytest.mark.parametrize("tree", KERNELS)
def test_every_family_is_documented(tree: str) -> None:
    procfs, sysfs = root(tree)
    scraper = build_scraper(parse_args([f"--path.procfs={procfs}", f"--path.sysfs={sysfs}"], environ={}))
    names = set(re.findall(r"^# TYPE (\S+) ", render(scraper.scrape_sync()), re.MULTILINE))
    documented = documented_families()
    assert names, "the scrape produced nothing"
    assert names - documented == set()
