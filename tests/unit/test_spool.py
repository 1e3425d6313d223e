"""The spool: format round trip, liveness by lock, folding of exited processes, damaged files, pid reuse.

Writers here are real: SpoolFile objects in this process (each holds its own flock, which a reader's
probe from another open file description sees, as it would from another process) and, where the
point is a process dying, real subprocesses killed with SIGKILL.
"""

from __future__ import annotations

import os
import struct
import time

import pytest

from exporter.engines import parse
from exporter.engines import spool as spool_source
from gpuio import spool as spool_format
from gpuio.metrics import EngineMetrics

LAYOUT = spool_format.ENGINE_LAYOUT


def writer(directory: str, engine: str = "resnet50", size: int = spool_format.DEFAULT_FILE_BYTES
           ) -> tuple[spool_format.SpoolFile, EngineMetrics]:
    file = spool_format.SpoolFile(directory, size)
    assert file.path is not None, "the spool directory should be usable"
    return file, EngineMetrics(engine, file)


def count(values: list[float], histogram: str) -> float:
    first, total, _ = LAYOUT.histograms[histogram]
    return sum(values[first:total])


def total(values: list[float], histogram: str) -> float:
    return values[LAYOUT.histograms[histogram][1]]


def spool_files(directory: str) -> list[str]:
    return sorted(name for name in os.listdir(directory) if name.endswith(spool_format.SUFFIX))


def test_round_trip_of_every_series(tmp_path) -> None:
    file, metrics = writer(str(tmp_path))
    for latency in (0.0004, 0.003, 0.003, 2.0):
        metrics.inference_seconds.observe(latency)
    metrics.batch_size.observe(8)
    metrics.load_read_bytes.inc(1 << 20)
    metrics.in_flight.inc(3)
    metrics.pool_contexts.inc(4)
    metrics.error("timeout")
    metrics.error("timeout")
    metrics.set_info("/etc/hostname", 1, "GPU-1234", "tensorrt")
    reader = spool_source.SpoolReader(str(tmp_path))
    totals = reader.read()
    values = totals.engines["resnet50"]
    assert count(values, "inference_seconds") == 4
    assert total(values, "inference_seconds") == pytest.approx(2.0064)
    first, _, bounds = LAYOUT.histograms["inference_seconds"]
    assert values[first + bounds.index(0.005)] == 2  # 0.003 <= 0.005, in the 0.005 bucket
    assert count(values, "batch_size") == 1
    assert values[LAYOUT.counters["load_read_bytes"]] == 1 << 20
    assert values[LAYOUT.gauges["in_flight"]] == 3
    assert totals.errors == {("resnet50", "timeout"): 2.0}
    (info,) = totals.infos["resnet50"]
    assert (info.path, info.cuda_device, info.gpu_uuid, info.runtime) == ("/etc/hostname", 1, "GPU-1234", "tensorrt")
    assert info.dev == (os.major(os.stat("/etc/hostname").st_dev), os.minor(os.stat("/etc/hostname").st_dev))
    assert totals.processes == {"resnet50": 1} and totals.live_files == 1
    assert reader.errors == {}
    file.close()


def test_histogram_bucket_edges_are_inclusive(tmp_path) -> None:
    file, metrics = writer(str(tmp_path))
    metrics.inference_seconds.observe(0.001)  # exactly a bound: le="0.001"
    metrics.inference_seconds.observe(1e9)  # past the last bound: +Inf
    metrics.inference_seconds.observe(float("nan"))  # ignored
    values = spool_source.SpoolReader(str(tmp_path)).read().engines["resnet50"]
    first, _, bounds = LAYOUT.histograms["inference_seconds"]
    assert values[first + bounds.index(0.001)] == 1
    assert values[first + len(bounds)] == 1
    assert count(values, "inference_seconds") == 2
    file.close()


def test_merges_processes_and_folds_exited_ones_without_going_backwards(tmp_path) -> None:
    reader = spool_source.SpoolReader(str(tmp_path))
    first, a = writer(str(tmp_path))
    second, b = writer(str(tmp_path))
    a.inference_seconds.observe(0.01)
    b.inference_seconds.observe(0.01)
    a.error("timeout")
    a.in_flight.inc()
    totals = reader.read()
    assert count(totals.engines["resnet50"], "inference_seconds") == 2
    assert totals.processes["resnet50"] == 2
    a.inference_seconds.observe(0.02)  # after the last scrape, before exiting: must not be lost
    first.close()  # the process exits: its lock is gone
    totals = reader.read()
    values = totals.engines["resnet50"]
    assert count(values, "inference_seconds") == 3
    assert values[LAYOUT.gauges["in_flight"]] == 0  # a dead process has nothing in flight
    assert totals.errors[("resnet50", "timeout")] == 1
    assert totals.processes["resnet50"] == 1 and totals.live_files == 1
    assert reader.folded_processes == 1
    assert len(spool_files(str(tmp_path))) == 1  # the dead file was deleted after folding
    b.inference_seconds.observe(0.01)
    assert count(reader.read().engines["resnet50"], "inference_seconds") == 4
    second.close()
    for _ in range(3):
        assert count(reader.read().engines["resnet50"], "inference_seconds") == 4
    assert spool_files(str(tmp_path)) == []


def write_file(directory: str, name: str, data: bytes) -> str:
    path = os.path.join(directory, name)
    with open(path, "wb") as handle:
        handle.write(data)
    return path


def valid_bytes(directory: str) -> bytes:
    """The bytes of a real, finished spool file (one engine, one error)."""
    file, metrics = writer(directory, "donor")
    metrics.inference_seconds.observe(0.01)
    metrics.error("boom")
    assert file.path is not None
    with open(file.path, "rb") as handle:
        data = handle.read(file.used)
    file.close()
    spool_source.SpoolReader(directory).read()  # fold and remove the donor
    return data


def test_damaged_and_foreign_files_are_skipped_counted_once_and_left_alone(tmp_path) -> None:
    directory = str(tmp_path)
    good = valid_bytes(directory)
    foreign = bytearray(good)
    struct.pack_into("<I", foreign, 8, 99)  # a newer library's format
    garbage_records = bytearray(good)
    struct.pack_into("<IHH", garbage_records, spool_format.HEADER_SIZE, 7, 77, 3)  # first record makes no sense
    oversized_used = bytearray(good)
    struct.pack_into("<Q", oversized_used, spool_format.USED_OFFSET, len(good) + 4096)
    files = {
        "gpuio-1-1-empty.spool": b"",
        "gpuio-1-1-short.spool": good[:100],
        "gpuio-1-1-truncated.spool": bytes(oversized_used),
        "gpuio-1-1-foreign.spool": bytes(foreign),
        "gpuio-1-1-garbage.spool": os.urandom(5000),
        "gpuio-1-1-records.spool": bytes(garbage_records),
    }
    for name, data in files.items():
        write_file(directory, name, data)
    live, metrics = writer(directory)
    metrics.inference_seconds.observe(0.5)
    reader = spool_source.SpoolReader(directory)
    for _ in range(3):  # the same bad files are not counted again
        totals = reader.read()
    assert reader.errors == {"empty": 1, "truncated": 2, "version": 1, "garbage": 1, "record": 1}
    assert count(totals.engines["resnet50"], "inference_seconds") == 1  # the good file still counts
    assert "donor" not in totals.engines  # nothing from files that could not be parsed
    # Files that could not be understood are not ours to delete; the one with a good header and a
    # bad record is ours: its writer is gone, what parsed (nothing) was folded, and it was removed.
    remaining = set(spool_files(directory))
    assert set(files) - remaining == {"gpuio-1-1-records.spool"}
    live.close()


def test_bad_record_after_good_ones_keeps_the_good_ones(tmp_path) -> None:
    directory = str(tmp_path)
    file, metrics = writer(directory)
    metrics.inference_seconds.observe(0.01)
    metrics.error("boom")  # a second record, after the ENGINE record
    assert file.path is not None
    with open(file.path, "r+b") as handle:  # scribble over the second record's header
        handle.seek(spool_format.HEADER_SIZE + spool_format.RECORD_HEAD.size + 8 + LAYOUT.size * 8)
        handle.write(b"\xff" * 8)
    reader = spool_source.SpoolReader(directory)
    totals = reader.read()
    reader.read()
    assert count(totals.engines["resnet50"], "inference_seconds") == 1
    assert totals.errors == {}
    assert reader.errors == {"record": 1}
    file.close()


def test_a_live_file_truncated_under_the_reader_keeps_its_last_good_totals(tmp_path) -> None:
    directory = str(tmp_path)
    file, metrics = writer(directory)
    metrics.inference_seconds.observe(0.01)
    reader = spool_source.SpoolReader(directory)
    assert count(reader.read().engines["resnet50"], "inference_seconds") == 1
    assert file.path is not None
    os.truncate(file.path, 0)
    for _ in range(2):
        assert count(reader.read().engines["resnet50"], "inference_seconds") == 1
    assert reader.errors == {"truncated": 1}
    file.release_lock()  # the writer dies: its last good totals are folded
    assert count(reader.read().engines["resnet50"], "inference_seconds") == 1
    assert reader.folded_processes == 1


def test_a_live_file_removed_by_someone_else_is_folded_from_what_was_seen(tmp_path) -> None:
    directory = str(tmp_path)
    file, metrics = writer(directory)
    metrics.inference_seconds.observe(0.01)
    reader = spool_source.SpoolReader(directory)
    reader.read()
    assert file.path is not None
    os.unlink(file.path)
    assert count(reader.read().engines["resnet50"], "inference_seconds") == 1
    assert reader.errors == {"vanished": 1}
    file.close()


def test_symlinks_are_not_followed(tmp_path) -> None:
    directory = str(tmp_path)
    os.symlink("/etc/passwd", os.path.join(directory, "gpuio-1-1-link.spool"))
    reader = spool_source.SpoolReader(directory)
    reader.read()
    assert reader.errors == {"io": 1}


def test_a_full_file_drops_new_series_and_says_so(tmp_path) -> None:
    directory = str(tmp_path)
    file, metrics = writer(directory, size=spool_format.HEADER_SIZE + 4096)  # room for the engine and a few errors
    for index in range(15):
        metrics.error(f"reason{index}-" + "x" * 190)
    metrics.inference_seconds.observe(0.01)  # existing series keep working
    totals = spool_source.SpoolReader(directory).read()
    assert totals.dropped_by_writers > 0
    assert count(totals.engines["resnet50"], "inference_seconds") == 1
    assert 0 < len([key for key in totals.errors if key[0] == "resnet50"]) < 15
    file.close()


def test_a_thousand_dead_processes_are_folded_once_then_cost_nothing(tmp_path, monkeypatch) -> None:
    directory = str(tmp_path)
    for index in range(1000):
        file, metrics = writer(directory, f"engine{index % 10}", size=8192)
        metrics.inference_seconds.observe(0.01)
        metrics.load_read_bytes.inc(100)
        file.close()
    reader = spool_source.SpoolReader(directory)
    totals = reader.read()
    assert reader.folded_processes == 1000
    assert sum(count(values, "inference_seconds") for values in totals.engines.values()) == 1000
    assert totals.engines["engine3"][LAYOUT.counters["load_read_bytes"]] == 100 * 100
    assert spool_files(directory) == []
    opened: list[str] = []
    real_open = os.open
    monkeypatch.setattr(os, "open", lambda path, *a, **k: opened.append(path) or real_open(path, *a, **k))
    again = reader.read()
    assert opened == [] and again.engines == totals.engines


def test_dead_files_that_cannot_be_deleted_are_tombstoned(tmp_path, monkeypatch) -> None:
    directory = str(tmp_path)
    for _ in range(5):
        file, metrics = writer(directory)
        metrics.inference_seconds.observe(0.01)
        file.close()

    def refuse(path: str, *args: object, **kwargs: object) -> None:
        raise PermissionError(1, "Operation not permitted", path)

    monkeypatch.setattr(os, "unlink", refuse)
    reader = spool_source.SpoolReader(directory)
    assert count(reader.read().engines["resnet50"], "inference_seconds") == 5
    opened: list[str] = []
    real_open = os.open
    monkeypatch.setattr(os, "open", lambda path, *a, **k: opened.append(path) or real_open(path, *a, **k))
    assert count(reader.read().engines["resnet50"], "inference_seconds") == 5  # not folded twice
    assert opened == [] and len(spool_files(directory)) == 5


def test_a_writer_that_died_before_renaming_leaves_a_temporary_that_is_swept(tmp_path) -> None:
    directory = str(tmp_path)
    stale = write_file(directory, ".gpuio-1-1-0000000000000001.spool.tmp", b"")
    fresh = write_file(directory, ".gpuio-2-1-0000000000000002.spool.tmp", b"")
    os.utime(stale, (time.time() - 3600, time.time() - 3600))
    spool_source.SpoolReader(directory).read()
    assert not os.path.exists(stale) and os.path.exists(fresh)


# --- real processes ------------------------------------------------------------------------------


def test_two_live_files_claiming_the_same_pid_are_two_processes(tmp_path) -> None:
    """Pid namespaces: every pod has a pid 1.  Identity is the file (and its lock), not the pid."""
    directory = str(tmp_path)
    first, a = writer(directory)
    second, b = writer(directory)
    assert first.pid == second.pid
    a.inference_seconds.observe(0.01)
    b.inference_seconds.observe(0.01)
    totals = spool_source.SpoolReader(directory).read()
    assert totals.processes["resnet50"] == 2
    assert count(totals.engines["resnet50"], "inference_seconds") == 2
    first.close()
    second.close()


def test_a_record_of_a_kind_from_a_newer_library_is_skipped_and_the_rest_is_read(tmp_path) -> None:
    file, metrics = writer(str(tmp_path), "resnet50")
    with file.lock:
        file.add_record(200, "from-the-future", 24, b"\x01" * 24)  # a kind this reader does not know
    later = EngineMetrics("yolo", file)  # an ENGINE record written after it
    later.load_read_bytes.inc(4096)
    assert file.path is not None
    with open(file.path, "rb") as handle:
        parsed = parse.parse(handle.read())
    assert not parsed.bad_record and parsed.unknown_records == 1
    assert set(parsed.engines) == {"resnet50", "yolo"}
    assert parsed.engines["yolo"][LAYOUT.counters["load_read_bytes"]] == 4096
    file.close()
