"""diskstats: node_exporter's arithmetic, every kernel's line length, filters, sysfs metadata, bad input."""

import logging
import os

import pytest

from exporter.collect import Scraper
from exporter.collectors.diskstats import DiskstatsCollector
from exporter.context import Context
from exporter.exposition import render
from exporter.options import parse_regex
from tests.conftest import parse_samples

LINE_14 = "   8       0 sda 100 2 800 30 50 5 4000 70 1 90 100"
LINE_18 = " 259       0 nvme0n1 100 2 800 30 50 5 4000 70 0 90 100 7 1 64 3"
LINE_20 = " 259       1 nvme1n1 100 2 800 30 50 5 4000 70 0 90 100 7 1 64 3 11 13"
LINE_24 = " 259       2 nvme2n1 100 2 800 30 50 5 4000 70 0 90 100 7 1 64 3 11 13 99 99 99 99"


def write(path: str, text: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as handle:
        handle.write(text)


def collector(tmp_path, diskstats: str, **options) -> DiskstatsCollector:
    write(str(tmp_path / "proc" / "diskstats"), diskstats)
    os.makedirs(tmp_path / "sys" / "block", exist_ok=True)
    parsed = {key: parse_regex(value) for key, value in options.items()}
    return DiskstatsCollector(Context(procfs=str(tmp_path / "proc"), sysfs=str(tmp_path / "sys")), parsed)


def samples(c: DiskstatsCollector) -> dict:
    return parse_samples(render(c.collect()))


def value(found: dict, name: str, device: str) -> float | None:
    return found.get((name, frozenset({("device", device)})))


def test_units_follow_node_exporter(tmp_path) -> None:
    found = samples(collector(tmp_path, LINE_20 + "\n"))
    assert value(found, "gpuio_disk_reads_completed_total", "nvme1n1") == 100
    assert value(found, "gpuio_disk_read_bytes_total", "nvme1n1") == 800 * 512.0
    assert value(found, "gpuio_disk_read_time_seconds_total", "nvme1n1") == 30 * 0.001
    assert value(found, "gpuio_disk_written_bytes_total", "nvme1n1") == 4000 * 512.0
    assert value(found, "gpuio_disk_io_time_weighted_seconds_total", "nvme1n1") == 100 * 0.001
    assert value(found, "gpuio_disk_discarded_sectors_total", "nvme1n1") == 64  # left in sectors, as upstream
    assert value(found, "gpuio_disk_flush_requests_time_seconds_total", "nvme1n1") == 13 * 0.001


@pytest.mark.parametrize(("line", "device", "series"), [
    (LINE_14, "sda", 11), (LINE_18, "nvme0n1", 15), (LINE_20, "nvme1n1", 17), (LINE_24, "nvme2n1", 17),
])
def test_each_kernel_generation_exports_the_fields_it_wrote(tmp_path, line, device, series) -> None:
    found = samples(collector(tmp_path, line + "\n"))
    assert sum(1 for name, labels in found if name.startswith("gpuio_disk_") and
               labels == frozenset({("device", device)})) == series


def test_counters_near_2_to_the_64_keep_float64_precision_as_go_does(tmp_path) -> None:
    big = 18446744073709551000
    found = samples(collector(tmp_path, f" 259 0 nvme0n1 {big} 0 {big} {big} 0 0 0 0 0 0 0\n"))
    # Prometheus reads every sample value as a float64, as Go's float64(uint64) conversion rounds it.
    assert float(value(found, "gpuio_disk_reads_completed_total", "nvme0n1")) == float(big)
    assert value(found, "gpuio_disk_read_bytes_total", "nvme0n1") == float(big) * 512.0
    assert value(found, "gpuio_disk_read_time_seconds_total", "nvme0n1") == float(big) * 0.001


def test_default_exclude_drops_partitions_loop_ram_and_floppies(tmp_path) -> None:
    names = ["sda", "sda1", "nvme0n1", "nvme0n1p1", "loop0", "ram0", "zram0", "fd0", "dm-0", "md0",
             "mmcblk0", "xvda", "xvda1", "vdb", "vdb2", "sr0"]
    text = "".join(f"   8 {i} {name} 1 0 0 0 0 0 0 0 0 0 0\n" for i, name in enumerate(names))
    found = {dict(labels)["device"] for name, labels in samples(collector(tmp_path, text))
             if name == "gpuio_disk_reads_completed_total"}
    assert found == {"sda", "nvme0n1", "dm-0", "md0", "mmcblk0", "xvda", "vdb", "sr0"}


def test_include_regex(tmp_path) -> None:
    text = "   7 0 loop0 1 0 0 0 0 0 0 0 0 0 0\n   8 0 sda 1 0 0 0 0 0 0 0 0 0 0\n"
    found = samples(collector(tmp_path, text, **{"device-include": "^loop"}))
    assert value(found, "gpuio_disk_reads_completed_total", "loop0") == 1
    assert value(found, "gpuio_disk_reads_completed_total", "sda") is None


def test_bad_lines_are_skipped_and_logged_once_good_lines_survive(tmp_path, caplog) -> None:
    bad = ["   8 1 sdb 1 2 3", "   8 2 sdc 1 2 abc 4 5 6 7 8 9 10 11", "   8 3 sdd 1 2 -3 4 5 6 7 8 9 10 11",
           "", "this is not diskstats"]
    c = collector(tmp_path, "\n".join([LINE_14, *bad, LINE_20]) + "\n")
    with caplog.at_level(logging.WARNING):
        first = samples(c)
        c.collect()
    assert value(first, "gpuio_disk_reads_completed_total", "sda") == 100
    assert value(first, "gpuio_disk_reads_completed_total", "nvme1n1") == 100
    assert not any(("device", d) in labels for _, labels in first for d in ("sdb", "sdc", "sdd"))
    bad_logs = [r for r in caplog.records if r.getMessage() == "skipping bad diskstats line"]
    assert len(bad_logs) == 4  # one per distinct bad line, not one per scrape; the blank line is not news
    assert {r.fields["detail"] for r in bad_logs} >= {"8 1 sdb 1 2 3", "this is not diskstats"}
    # Counted, by reason, on every scrape (two here): the blank line is no line.
    assert {(source, reason): n for source, reason, n in c.dropped_lines.counts()} == {
        ("diskstats", "too_few_fields"): 4, ("diskstats", "non_numeric"): 2, ("diskstats", "negative"): 2}


def test_a_repeated_device_line_is_dropped_and_counted(tmp_path) -> None:
    c = collector(tmp_path, "\n".join([LINE_14, LINE_14.replace(" 100 2 ", " 999 2 ", 1)]) + "\n")
    assert value(samples(c), "gpuio_disk_reads_completed_total", "sda") == 100  # the first line, as before
    assert c.dropped_lines.counts() == [("diskstats", "repeated", 1)]


def test_a_file_of_nothing_but_bad_lines_fails_the_collector(tmp_path) -> None:
    """node_exporter 1.5 reports success 0 on such a file; an empty file (no block device) is no failure."""
    c = collector(tmp_path, "garbage here and there\n   8 0 sda 1 2 x 4 5 6 7 8 9 10 11\n")
    found = parse_samples(render(Scraper([c], 5.0, "").scrape_sync()))
    assert found[("gpuio_scrape_collector_success", frozenset({("collector", "diskstats")}))] == 0
    assert found[("gpuio_scrape_collector_failures_total",
                  frozenset({("collector", "diskstats"), ("reason", "malformed")}))] == 1
    empty = collector(tmp_path / "empty", "")
    found = parse_samples(render(Scraper([empty], 5.0, "").scrape_sync()))
    assert found[("gpuio_scrape_collector_success", frozenset({("collector", "diskstats")}))] == 1


def test_missing_diskstats_fails_the_collector(tmp_path) -> None:
    c = collector(tmp_path, "")
    os.remove(tmp_path / "proc" / "diskstats")
    with pytest.raises(FileNotFoundError):
        c.collect()


def test_a_changed_line_is_seen_on_the_next_scrape(tmp_path) -> None:
    c = collector(tmp_path, LINE_14 + "\n" + LINE_20 + "\n")
    c.collect()
    write(str(tmp_path / "proc" / "diskstats"), LINE_14 + "\n" + LINE_20.replace(" 100 2 ", " 101 2 ", 1) + "\n")
    found = samples(c)
    assert value(found, "gpuio_disk_reads_completed_total", "sda") == 100
    assert value(found, "gpuio_disk_reads_completed_total", "nvme1n1") == 101


def make_sysfs(tmp_path) -> None:
    block = tmp_path / "sys" / "block"
    write(str(block / "sda" / "device" / "model"), "Samsung SSD 870 \n")
    write(str(block / "sda" / "device" / "vendor"), "ATA     \n")
    write(str(block / "sda" / "device" / "rev"), "2B6Q\n")
    write(str(block / "sda" / "device" / "wwid"), "naa.5002538f1234\n")
    write(str(block / "sda" / "queue" / "rotational"), "0\n")
    write(str(block / "sda" / "sda2" / "partition"), "2\n")
    write(str(block / "dm-0" / "dm" / "name"), "vg0-root\n")
    write(str(block / "dm-0" / "dm" / "uuid"), "LVM-abc\n")
    os.makedirs(block / "dm-0" / "slaves")
    os.symlink("../../sda/sda2", block / "dm-0" / "slaves" / "sda2")
    write(str(block / "nvme0n1" / "queue" / "rotational"), "garbage\n")
    write(str(block / "nvme0n1" / "device" / "serial"), "S4EVNX0N123\n")


def test_sysfs_metadata_and_stacking(tmp_path, caplog) -> None:
    text = ("   8 0 sda 1 0 0 0 0 0 0 0 0 0 0\n   8 2 sda2 1 0 0 0 0 0 0 0 0 0 0\n"
            " 253 0 dm-0 1 0 0 0 0 0 0 0 0 0 0\n 259 0 nvme0n1 1 0 0 0 0 0 0 0 0 0 0\n")
    c = collector(tmp_path, text, **{"device-include": "."})
    make_sysfs(tmp_path)
    with caplog.at_level(logging.WARNING):
        found = samples(c)
    info = {dict(labels)["device"]: dict(labels) for name, labels in found if name == "gpuio_disk_info"}
    assert info["sda"] | {} == {"device": "sda", "major": "8", "minor": "0", "model": "Samsung SSD 870",
                                "vendor": "ATA", "serial": "", "wwn": "naa.5002538f1234", "revision": "2B6Q",
                                "rotational": "0"}
    assert info["sda2"]["model"] == "Samsung SSD 870" and info["sda2"]["rotational"] == "0"
    assert info["nvme0n1"]["serial"] == "S4EVNX0N123"
    assert info["nvme0n1"]["rotational"] == ""  # unreadable attribute: label empty, logged, scrape fine
    assert any(r.getMessage() == "ignoring unreadable sysfs attribute" for r in caplog.records)
    keys = set(found)
    assert ("gpuio_disk_device_mapper_info",
            frozenset({("device", "dm-0"), ("name", "vg0-root"), ("uuid", "LVM-abc")})) in keys
    assert ("gpuio_disk_backing_device_info", frozenset({("device", "dm-0"), ("backing_device", "sda2")})) in keys
    assert ("gpuio_disk_backing_device_info", frozenset({("device", "sda2"), ("backing_device", "sda")})) in keys
    physical = {(dict(labels)["device"], dict(labels)["physical_device"]) for name, labels in found
                if name == "gpuio_disk_physical_device_info"}
    assert physical == {("sda", "sda"), ("sda2", "sda"), ("dm-0", "sda"), ("nvme0n1", "nvme0n1")}
