"""pressure: node_exporter's values, what each kernel writes, and no-PSI as no data."""

import errno
import logging
import os

import pytest

from exporter.collect import Absent, Scraper
from exporter.collectors.pressure import PressureCollector
from exporter.context import Context
from exporter.exposition import render
from tests.conftest import parse_samples

SOME_FULL = "some avg10=1.64 avg60=1.53 avg300=0.42 total=5221373\nfull avg10=0.00 avg60=0.00 avg300=0.00 total=17\n"


def collector(tmp_path, files: dict[str, str] | None) -> PressureCollector:
    os.makedirs(tmp_path / "proc", exist_ok=True)
    if files is not None:
        os.makedirs(tmp_path / "proc" / "pressure", exist_ok=True)
        for name, text in files.items():
            (tmp_path / "proc" / "pressure" / name).write_text(text)
    return PressureCollector(Context(procfs=str(tmp_path / "proc")), {})


def values(c: PressureCollector) -> dict[str, float]:
    return {name: v for (name, _), v in parse_samples(render(c.collect())).items()}


def test_totals_in_seconds_with_node_exporters_arithmetic(tmp_path) -> None:
    found = values(collector(tmp_path, {"cpu": SOME_FULL, "io": SOME_FULL, "memory": SOME_FULL,
                                        "irq": "full avg10=0.00 avg60=0.00 avg300=0.00 total=999\n"}))
    assert found["gpuio_pressure_io_waiting_seconds_total"] == 5221373 / 1000.0 / 1000.0
    assert found["gpuio_pressure_io_stalled_seconds_total"] == 17 / 1000.0 / 1000.0
    assert found["gpuio_pressure_cpu_waiting_seconds_total"] == 5.221373
    assert "gpuio_pressure_cpu_stalled_seconds_total" not in found  # system-wide cpu full: always 0
    assert found["gpuio_pressure_memory_stalled_seconds_total"] == 17 / 1000.0 / 1000.0
    assert found["gpuio_pressure_irq_stalled_seconds_total"] == 999 / 1000.0 / 1000.0


def test_old_kernel_cpu_without_full_line(tmp_path) -> None:
    found = values(collector(tmp_path, {"cpu": SOME_FULL.splitlines()[0] + "\n", "io": SOME_FULL}))
    assert found["gpuio_pressure_cpu_waiting_seconds_total"] == 5.221373


def test_no_psi_is_no_data_not_failure(tmp_path) -> None:
    with pytest.raises(Absent, match="pressure does not exist"):
        collector(tmp_path, None).collect()


def test_psi_disabled_eopnotsupp_is_no_data(tmp_path, monkeypatch) -> None:
    """psi=0 makes the kernel's read return EOPNOTSUPP; no file here can, so the open raises it."""
    c = collector(tmp_path, {"cpu": SOME_FULL, "io": SOME_FULL, "memory": SOME_FULL})
    real_open = open

    def psi_off(path, *args, **kwargs):
        if "pressure" in str(path):
            raise OSError(errno.EOPNOTSUPP, os.strerror(errno.EOPNOTSUPP))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr("builtins.open", psi_off)
    with pytest.raises(Absent, match="psi=0"):
        c.collect()


def scrape(c: PressureCollector) -> dict:
    """One scrape through the framework, as the server runs it: what Prometheus would see."""
    return parse_samples(render(Scraper([c], 5.0, "").scrape_sync()))


def pressure_counts(found: dict, name: str) -> dict[tuple[str, ...], float]:
    return {tuple(v for _, v in sorted(labels)): value for (n, labels), value in found.items()
            if n == name and dict(labels)["collector"] == "pressure"}


def test_a_file_of_garbage_fails_the_collector_and_says_why(tmp_path, caplog) -> None:
    """/proc/pressure/io holding only garbage: no PSI line at all is a failed source, not success with
    no series (node_exporter 1.5 fails too)."""
    c = collector(tmp_path, {"io": "garbage\nsome avg10=x total=lots\n", "cpu": SOME_FULL})
    with caplog.at_level(logging.ERROR):
        found = scrape(c)
    assert found[("gpuio_scrape_collector_success", frozenset({("collector", "pressure")}))] == 0
    assert pressure_counts(found, "gpuio_scrape_collector_failures_total") == {("pressure", "malformed"): 1}
    assert pressure_counts(found, "gpuio_scrape_collector_dropped_lines_total") == {
        ("pressure", "unknown_kind", "pressure/io"): 1, ("pressure", "non_numeric", "pressure/io"): 1}
    assert found[("gpuio_pressure_cpu_waiting_seconds_total", frozenset())] == 5.221373  # cpu is still served
    (failed,) = [r for r in caplog.records if r.getMessage() == "collector failed"]
    assert "no valid PSI line in pressure/io" in failed.fields["err"]


def test_garbage_and_empty_files_keep_the_good_lines_and_count_the_bad(tmp_path, caplog) -> None:
    from exporter.collect import MalformedSource

    c = collector(tmp_path, {"io": SOME_FULL.splitlines()[0] + "\nfull what=ever\n", "memory": "",
                             "cpu": "some avg10=0 total=-5\n"})
    with caplog.at_level(logging.WARNING):
        with pytest.raises(MalformedSource, match="pressure/cpu, pressure/memory") as failed:
            c.collect()
        found = scrape(c)
    assert {name: v for (name, _), v in parse_samples(render(failed.value.families)).items()} == {
        "gpuio_pressure_io_waiting_seconds_total": 5.221373}
    assert found[("gpuio_pressure_io_waiting_seconds_total", frozenset())] == 5.221373
    assert len([r for r in caplog.records if r.getMessage() == "skipping bad pressure line"]) == 2
    # Two collects: every scrape counts the lines it dropped.
    assert pressure_counts(found, "gpuio_scrape_collector_dropped_lines_total") == {
        ("pressure", "no_total", "pressure/io"): 2, ("pressure", "non_numeric", "pressure/cpu"): 2}


def test_unreadable_pressure_directory_fails_the_collector(tmp_path) -> None:
    c = collector(tmp_path, {})
    os.rmdir(tmp_path / "proc" / "pressure")
    (tmp_path / "proc" / "pressure").mkdir()
    os.mkdir(tmp_path / "proc" / "pressure" / "io")  # reading a directory: EISDIR, not "no such file"
    with pytest.raises(IsADirectoryError):
        c.collect()
