"""Every family is declared once, beside the code that produces it; the catalogue lists them all, the
exporter serves them as declared, and docs/metrics.md is generated from them.

``python -m exporter.catalogue --write docs/metrics.md`` regenerates the reference after a change.
"""

from __future__ import annotations

import glob
import importlib
import os
import pkgutil
import re
import types

import pytest

import exporter
from exporter import catalogue
from exporter.assemble import build_scraper
from exporter.config import parse_args
from exporter.exposition import COUNTER, GAUGE, INFO, Desc, render
from tests.conftest import KERNELS, LIBRARY, REPO, root, undeclared

REFERENCE = os.path.join(REPO, "docs", "metrics.md")
UNITS = ("seconds", "bytes", "ratio", "celsius", "watts", "joules", "hertz")


def test_the_reference_is_generated_from_the_catalogue() -> None:
    """Drift check: docs/metrics.md is what the declarations generate (regenerate it, never edit it)."""
    with open(REFERENCE, encoding="utf-8") as file:
        assert file.read() == catalogue.render_markdown(), \
            "docs/metrics.md is stale: run python -m exporter.catalogue --write docs/metrics.md"


def test_the_check_command_finds_a_stale_reference(tmp_path) -> None:
    stale = tmp_path / "metrics.md"
    stale.write_text(catalogue.render_markdown().replace("| `gpuio_disk_io_now` |", "| `gpuio_disk_io_later` |"))
    assert catalogue.main(["--check", str(stale)]) == 1
    assert catalogue.main(["--write", str(stale)]) == 0 and catalogue.main(["--check", str(stale)]) == 0


def test_every_catalogued_family_has_its_row_in_the_reference() -> None:
    with open(REFERENCE, encoding="utf-8") as file:
        rows = set(file.read().splitlines())
    assert len(catalogue.FAMILIES) > 200
    assert [desc.name for desc in catalogue.FAMILIES if catalogue.row(desc) not in rows] == []
    assert all(desc.help and desc.doc for desc in catalogue.FAMILIES)


@pytest.mark.parametrize("tree", (*KERNELS, "malformed"))
def test_every_family_served_on_a_fixture_tree_is_declared_as_served(tree: str) -> None:
    """The exporter as the server builds it (every default collector and its own families) on each tree:
    each family in the catalogue, with the declared type, label names and label values."""
    procfs, sysfs = root(tree)
    scraper = build_scraper(parse_args([f"--path.procfs={procfs}", f"--path.sysfs={sysfs}"], environ={}))
    try:
        text = render(scraper.scrape_sync())
    finally:
        scraper.stop()
    assert "# TYPE gpuio_disk_io_now gauge" in text and "# TYPE process_open_fds gauge" in text
    assert undeclared(text) == []


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(REPO, "tests", "golden", "*.prom"))),
                         ids=os.path.basename)
def test_the_golden_outputs_are_served_as_declared(path: str) -> None:
    with open(path, encoding="utf-8") as file:
        text = file.read()
    assert "# TYPE" in text and undeclared(text) == []


def test_the_check_of_served_families_sees_a_wrong_type_a_missing_label_and_an_unknown_family() -> None:
    text = ("# HELP gpuio_disk_io_now x\n# TYPE gpuio_disk_io_now counter\n"
            'gpuio_disk_io_now{device="sda"} 1\n'
            "# HELP gpuio_disk_reads_merged_total x\n# TYPE gpuio_disk_reads_merged_total counter\n"
            "gpuio_disk_reads_merged_total 1\n"
            "# HELP gpuio_made_up x\n# TYPE gpuio_made_up gauge\ngpuio_made_up 1\n"
            "# HELP gpuio_scrape_collector_state x\n# TYPE gpuio_scrape_collector_state gauge\n"
            'gpuio_scrape_collector_state{collector="a",state="sleepy"} 1\n')
    assert undeclared(text) == [
        "gpuio_disk_io_now: served as counter, declared gauge",
        "gpuio_disk_reads_merged_total: labels [], declared ['device']",
        "gpuio_made_up: not declared",
        "gpuio_scrape_collector_state: state='sleepy' is not among the declared values",
    ]


def test_a_name_declared_twice_is_refused() -> None:
    first = types.ModuleType("first")
    first.A = Desc("gpuio_twice", GAUGE, "One.")  # type: ignore[attr-defined]
    second = types.ModuleType("second")
    second.B = (Desc("gpuio_twice", GAUGE, "Two."),)  # type: ignore[attr-defined]
    with pytest.raises(catalogue.DuplicateFamily, match="gpuio_twice is declared twice"):
        catalogue.families_of([catalogue.Section("a", (first,)), catalogue.Section("b", (second,))])
    second.B = (first.A,)  # type: ignore[attr-defined]  # the same declaration, held twice: listed once
    listed = catalogue.families_of([catalogue.Section("a", (first,)), catalogue.Section("b", (second,))])
    assert [desc.name for _, desc in listed] == ["gpuio_twice"]


def _sources() -> dict[str, str]:
    found = {}
    for folder in (os.path.join(REPO, "exporter"), os.path.join(LIBRARY, "gpuio")):
        for path in glob.glob(os.path.join(folder, "**", "*.py"), recursive=True):
            if path.startswith(os.path.join(LIBRARY, "build") + os.sep):  # a wheel build's copies
                continue
            with open(path, encoding="utf-8") as file:
                found[os.path.relpath(path, REPO)] = file.read()
    return found


def test_each_name_is_written_out_once_where_it_is_declared() -> None:
    """No name built from pieces: grep for a family's full name lands on its declaration, in the module
    the catalogue found it in (the engine record's series: in the library's spool format)."""
    sources = _sources()
    where = {}
    for section, desc in catalogue.LISTED:
        found = [path for path, text in sources.items() if f'"{desc.name}"' in text]
        homes = {os.path.relpath(module.__file__ or "", REPO) for module in section.modules}
        if len(found) != 1 or not (found[0] in homes or found[0].endswith(os.path.join("gpuio", "spool.py"))):
            where[desc.name] = found
    assert where == {}


def test_the_unit_is_the_one_the_name_ends_in() -> None:
    wrong = {}
    for desc in catalogue.FAMILIES:
        last = desc.name.removesuffix("_total").rsplit("_", 1)[-1]
        if desc.unit != (last if last in UNITS else ""):
            wrong[desc.name] = desc.unit
    assert wrong == {}


def test_names_follow_the_conventions() -> None:
    for desc in catalogue.FAMILIES:
        assert re.fullmatch(r"(gpuio|process)_[a-z0-9_]+", desc.name), desc.name
        assert desc.name.endswith("_total") == (desc.kind == COUNTER), desc.name
        assert desc.name.endswith("_info") == (desc.kind == INFO), desc.name
        assert len(set(desc.labels)) == len(desc.labels) and "le" not in desc.labels, desc.name


def test_no_module_declares_a_family_the_catalogue_leaves_out() -> None:
    """A family declared in a module the catalogue does not read (or left out by a section's filter)
    would be served undocumented: every module of the package is imported and looked through."""
    listed = {id(desc) for desc in catalogue.FAMILIES}
    missed = {}
    for module_info in pkgutil.walk_packages(exporter.__path__, "exporter."):
        if module_info.name.endswith("__main__") or ".instrument" in module_info.name:
            continue
        module = importlib.import_module(module_info.name)
        left_out = [desc.name for desc in catalogue.declared_in(module) if id(desc) not in listed]
        if left_out:
            missed[module_info.name] = left_out
    assert missed == {}


def test_values_are_given_only_for_labels_the_family_has() -> None:
    with pytest.raises(ValueError, match="values given for labels it does not have"):
        Desc("gpuio_x", GAUGE, "X.", ("device",), values={"state": ("ok",)})


def test_by_name_finds_a_declaration_and_names_an_unknown_family() -> None:
    assert catalogue.by_name("gpuio_disk_io_now").labels == ("device",)
    with pytest.raises(KeyError, match="gpuio_disk_io_later"):
        catalogue.by_name("gpuio_disk_io_later")
