"""The spool reader reads what changed: the header's generation, descriptors kept open, the merge reused.

Writers are real SpoolFile objects in this process (each holds its own flock on its own open file
description, which the reader's probe sees as it would another process's); a writer that "lies" is
one whose file is changed behind the library's back with os.pwrite, as any process could.
"""

from __future__ import annotations

import contextlib
import os
import struct
import time

import pytest

from exporter.engines import spool as spool_source
from gpuio import metrics as gm
from gpuio import spool as spool_format
from gpuio.metrics import EngineMetrics

LAYOUT = spool_format.ENGINE_LAYOUT


def writer(directory: str, engine: str = "resnet50") -> tuple[spool_format.SpoolFile, EngineMetrics]:
    file = spool_format.SpoolFile(directory, 64 * 1024)
    assert file.path is not None
    return file, EngineMetrics(engine, file)


def generation(file: spool_format.SpoolFile) -> float:
    assert file.path is not None
    with open(file.path, "rb") as handle:
        return struct.unpack_from("<d", handle.read(spool_format.HEADER_SIZE), spool_format.GENERATION_OFFSET)[0]


def inferences(values: list[float]) -> float:
    first, total, _ = LAYOUT.histograms["inference_seconds"]
    return sum(values[first:total])


def sneak(file: spool_format.SpoolFile, metrics: EngineMetrics, value: float) -> None:
    """Set the engine's inference count in the file without moving the generation (a lying writer)."""
    assert file.path is not None
    index = metrics.inference_seconds._first  # its first bucket, as an index into the file's doubles
    fd = os.open(file.path, os.O_WRONLY)
    try:
        os.pwrite(fd, struct.pack("<d", value), index * 8)
    finally:
        os.close(fd)


def test_every_change_the_library_makes_moves_the_generation(tmp_path) -> None:
    file, metrics = writer(str(tmp_path))
    changes = {
        "observe": lambda: metrics.inference_seconds.observe(0.01),
        "counter": lambda: metrics.load_read_bytes.inc(10),
        "gauge inc": lambda: metrics.pool_contexts.inc(),
        "gauge dec": lambda: metrics.pool_contexts.dec(),
        "gauge set": lambda: metrics.pool_idle.set(3),
        "error": lambda: metrics.error("timeout"),
        "error again": lambda: metrics.error("timeout"),
        "info": lambda: metrics.set_info("/etc/hostname", 0, "GPU-1", "tensorrt"),
        "layers": lambda: [metrics.add_layer_times({"conv": 0.001}) for _ in range(metrics.layer_select_after + 1)],
        "infer": lambda: metrics.infer().__enter__().__exit__(None, None, None),
        "observe_inference": lambda: metrics.observe_inference(0.01, 8, 0.005),
    }
    for what, change in changes.items():
        before = generation(file)
        change()
        assert generation(file) > before, what
    before = generation(file)
    with metrics.loading("/etc/hostname", 0, "GPU-1") as progress:
        assert generation(file) > before, "load start"
        before = generation(file)
        progress.add(4096)
        assert generation(file) > before, "load progress"
        before = generation(file)
    assert generation(file) > before, "load end"
    file.close()


def test_a_new_file_starts_with_a_counted_generation(tmp_path) -> None:
    """0 means "this writer does not count" (read whole every time): a fresh file must not say so."""
    file = spool_format.SpoolFile(str(tmp_path), 64 * 1024)
    assert generation(file) == 1.0
    file.close()


def test_a_scrape_of_unchanged_files_reads_their_headers_only(tmp_path) -> None:
    """Ten live writers and a read budget of 10 KiB: a whole read of each file (at least a page each)
    does not fit and files are deferred; once nothing changed, a header each does fit."""
    writers = [writer(str(tmp_path), f"engine{n}") for n in range(10)]
    for _, metrics in writers:
        metrics.inference_seconds.observe(0.01)
    reader = spool_source.SpoolReader(str(tmp_path))
    first = reader.read()
    assert first.live_files == 10 and first.deferred_files == 0
    reader.scrape_read_bytes = 10 * 1024
    unchanged = reader.read()
    assert unchanged.deferred_files == 0
    assert unchanged.engines == first.engines and unchanged.live_files == 10
    writers[3][1].inference_seconds.observe(0.02)  # one file changed: read whole, the rest headers
    changed = reader.read()
    assert changed.deferred_files == 0
    assert inferences(changed.engines["engine3"]) == 2
    for file, _ in writers:
        file.close()


def test_changes_are_seen_at_once_and_totals_equal_a_fresh_reader(tmp_path) -> None:
    writers = [writer(str(tmp_path), f"engine{n % 3}") for n in range(6)]
    reader = spool_source.SpoolReader(str(tmp_path))
    for round_ in range(4):
        for number, (_, metrics) in enumerate(writers):
            if (number + round_) % 2:
                metrics.inference_seconds.observe(0.001 * (round_ + 1))
                metrics.in_flight.set(round_)
        totals = reader.read()
        fresh = spool_source.SpoolReader(str(tmp_path), remove_dead=False).read()
        assert totals.engines == fresh.engines
        assert totals.per_gpu == fresh.per_gpu
        assert totals.processes == fresh.processes
    for file, _ in writers:
        file.close()


def test_a_writer_that_changes_its_file_without_moving_the_generation_fools_only_itself_and_not_for_long(
        tmp_path) -> None:
    liar_file, liar = writer(str(tmp_path), "liar")
    honest_file, honest = writer(str(tmp_path), "honest")
    liar.inference_seconds.observe(0.01)
    honest.inference_seconds.observe(0.01)
    reader = spool_source.SpoolReader(str(tmp_path))
    reader.recheck_seconds = 0.4  # every file is read whole again within 0.5 s, lie or not
    reader.read()
    sneak(liar_file, liar, 1000.0)
    honest.inference_seconds.observe(0.01)
    totals = reader.read()
    assert inferences(totals.engines["honest"]) == 2  # the honest writer's change is seen
    assert inferences(totals.engines["liar"]) == 1  # the liar's is not yet: its own series only
    time.sleep(0.6)
    assert inferences(reader.read().engines["liar"]) == 1000 + 1
    liar_file.close()
    honest_file.close()


def test_a_writer_that_does_not_count_generations_is_read_whole_every_time(tmp_path) -> None:
    """A library from before the generation counter leaves it 0: every change must still be seen."""
    file, metrics = writer(str(tmp_path))
    metrics.inference_seconds.observe(0.01)
    assert file.path is not None
    fd = os.open(file.path, os.O_WRONLY)
    os.pwrite(fd, struct.pack("<d", 0.0), spool_format.GENERATION_OFFSET)
    reader = spool_source.SpoolReader(str(tmp_path))
    reader.read()
    sneak(file, metrics, 7.0)
    assert inferences(reader.read().engines["resnet50"]) == 7 + 1
    os.close(fd)
    file.close()


def test_a_file_replaced_under_its_name_by_one_with_the_same_header_is_read(tmp_path) -> None:
    file, metrics = writer(str(tmp_path))
    metrics.inference_seconds.observe(0.01)
    assert file.path is not None
    reader = spool_source.SpoolReader(str(tmp_path))
    assert inferences(reader.read().engines["resnet50"]) == 1
    with open(file.path, "rb") as handle:
        copy = bytearray(handle.read())
    first = metrics.inference_seconds._first
    struct.pack_into("<d", copy, first * 8, 50.0)  # same header, other counts
    other = str(tmp_path / ".other")
    with open(other, "wb") as handle:
        handle.write(copy)
    os.rename(other, file.path)  # a new inode under the old name; nobody holds its lock
    totals = reader.read()
    assert totals.live_files == 0  # the new file's "writer" is gone: folded, with what it says
    assert inferences(totals.engines["resnet50"]) == 1 + (50 + 1)  # the old file as last seen, then the new one
    file.close()


def test_a_writer_that_dies_without_changing_its_file_is_folded_at_the_next_read(tmp_path) -> None:
    file, metrics = writer(str(tmp_path))
    metrics.inference_seconds.observe(0.01)
    metrics.in_flight.inc()
    reader = spool_source.SpoolReader(str(tmp_path))
    assert reader.read().live_files == 1
    assert reader.read().live_files == 1  # unchanged, alive
    file.close()  # the lock goes; the bytes stay as they were
    totals = reader.read()
    assert totals.live_files == 0 and reader.folded_processes == 1
    assert inferences(totals.engines["resnet50"]) == 1
    assert totals.engines["resnet50"][LAYOUT.gauges["in_flight"]] == 0  # a dead process has nothing in flight
    assert os.listdir(tmp_path) == []


def open_descriptors(directory: str) -> int:
    """This process's descriptors open on files in ``directory`` (the writers' locks and the reader's)."""
    found = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the listing's own descriptor, gone already
            found += os.readlink(f"/proc/self/fd/{fd}").startswith(directory + "/")
    return found


def test_descriptors_kept_open_are_capped_and_closed(tmp_path) -> None:
    writers = [writer(str(tmp_path), f"engine{n}") for n in range(5)]
    for _, metrics in writers:
        metrics.inference_seconds.observe(0.01)
    reader = spool_source.SpoolReader(str(tmp_path))
    reader._kept_cap = 2
    before = open_descriptors(str(tmp_path))
    totals = reader.read()
    assert open_descriptors(str(tmp_path)) - before == 2
    for _, metrics in writers:
        metrics.inference_seconds.observe(0.01)
    again = reader.read()  # files past the cap are opened again, and read as well
    assert open_descriptors(str(tmp_path)) - before == 2
    assert all(inferences(again.engines[f"engine{n}"]) == 2 for n in range(5)) and totals.live_files == 5
    reader.close()
    assert open_descriptors(str(tmp_path)) == before
    for file, _ in writers:
        file.close()
    assert reader.read().live_files == 0  # usable after close(): folds the dead files


def test_the_merge_is_reused_only_while_nothing_changed(tmp_path) -> None:
    file, metrics = writer(str(tmp_path))
    metrics.inference_seconds.observe(0.01)
    reader = spool_source.SpoolReader(str(tmp_path))
    first = reader.read()
    second = reader.read()
    assert second.engines is first.engines  # nothing changed: the same merge
    metrics.inference_seconds.observe(0.01)
    third = reader.read()
    assert third.engines is not first.engines and inferences(third.engines["resnet50"]) == 2
    file.close()


@pytest.mark.parametrize("answer", ["GPU-A", "GPU-B"])
def test_the_merge_follows_nvml_for_writers_that_recorded_no_gpu(tmp_path, answer) -> None:
    file, metrics = writer(str(tmp_path))
    metrics.inference_seconds.observe(0.01)
    where = {"gpu": "GPU-0"}
    reader = spool_source.SpoolReader(str(tmp_path), gpu_of=lambda pid, ticks: where["gpu"])
    assert set(reader.read().per_gpu) == {("resnet50", "GPU-0")}
    where["gpu"] = answer  # the file did not change; NVML now places the process elsewhere
    assert set(reader.read().per_gpu) == {("resnet50", answer)}
    file.close()


def test_the_process_lock_still_serialises_changes(tmp_path) -> None:
    """The lock that publishes is still a lock: a with-block holds it, and releasing it publishes."""
    file = spool_format.SpoolFile(str(tmp_path), 64 * 1024)
    before = generation(file)
    with file.lock:
        assert file.lock.locked()
    assert not file.lock.locked() and generation(file) == before + 1
    file.close()
    with file.lock:  # a closed file's lock publishes nothing and does not fail
        pass
    assert gm.GENERATION == spool_format.GENERATION_INDEX


def test_a_plain_infer_and_one_with_options_record_the_same(tmp_path) -> None:
    """``infer()`` without options takes a shorter path (C's, or a class of its own): the same series move."""
    file, metrics = writer(str(tmp_path))
    for options in ({}, {"batch_size": 4}):
        with metrics.infer(**options) as call:
            assert call.latency is None  # not yet completed
            assert metrics.in_flight.value() == 1
            call.enqueued()
            time.sleep(0.002)
        assert metrics.in_flight.value() == 0
        assert call.latency is not None and call.latency >= 0.002
    assert metrics.inference_seconds.count() == 2 and metrics.inference_seconds.total() >= 0.004
    with pytest.raises(TimeoutError), metrics.infer():
        raise TimeoutError
    assert metrics.errors() == {"timeout": 1} and metrics.in_flight.value() == 0
    file.close()


def test_a_changed_file_too_big_for_what_is_left_of_the_parse_budget_gets_its_turn(tmp_path) -> None:
    """Two writers that change before every read; the first in visiting order leaves less of the parse
    budget than the second needs, but more than nothing.  The second must not wait behind the first
    for ever: it goes first at the next read."""
    writers = sorted((writer(str(tmp_path), f"engine{n}") for n in range(2)), key=lambda pair: str(pair[0].path))
    for number, (_, metrics) in enumerate(writers):
        for layer in range(40):  # bigger files: a few KiB each
            metrics.error(f"reason{number}-{layer}")
        metrics.inference_seconds.observe(0.01)
    reader = spool_source.SpoolReader(str(tmp_path))
    assert reader.read().live_files == 2
    reader.scrape_parse_bytes = max(file.used for file, _ in writers) + 1  # one file a read, never both
    for _ in range(3):
        for _, metrics in writers:
            metrics.inference_seconds.observe(0.01)
        totals = reader.read()
    # 4 observations each by now: every file parsed at least every other read, neither stuck at 1
    assert min(inferences(totals.engines[f"engine{n}"]) for n in range(2)) >= 3
    for file, _ in writers:
        file.close()


def reader_before_the_lock_table(tmp_path, recheck_seconds: float = spool_source.RECHECK_SECONDS
                                 ) -> tuple[spool_source.SpoolReader, object, object, object]:
    """A writer's file read once while the reader's lock table (its procfs) does not exist yet: the
    header's process is not claimed.  Returns the reader, the file, its metrics and the procfs folder."""
    spool, proc = tmp_path / "spool", tmp_path / "proc"
    spool.mkdir()
    proc.mkdir()
    file, metrics = writer(str(spool))
    metrics.inference_seconds.observe(0.01)
    reader = spool_source.SpoolReader(str(spool), procfs=str(proc))
    reader.recheck_seconds = recheck_seconds
    assert reader.read().writers["resnet50"] == [(os.getpid(), 0)]  # not shown holding the lock: no claim
    return reader, file, metrics, proc


def show_lock_table(proc) -> None:
    with open("/proc/locks", "rb") as handle:  # the kernel's, with this process's lock on the file
        (proc / "locks").write_bytes(handle.read())


def test_a_lock_table_that_could_not_be_read_is_looked_at_again(tmp_path) -> None:
    """Which process a file's header may name is what the kernel's lock table says: a table that could
    not be read (here: not there yet) says nothing, and the next full read of the file asks again."""
    reader, file, metrics, proc = reader_before_the_lock_table(tmp_path)
    show_lock_table(proc)
    metrics.inference_seconds.observe(0.01)  # the file changes: read whole
    assert reader.read().writers["resnet50"] == [(os.getpid(), file.start_ticks)]
    file.close()


def test_a_lock_table_read_late_names_the_writer_of_an_unchanged_file_too(tmp_path) -> None:
    """As above, for a file that does not change: its periodic full read asks the lock table again, and
    the merge (reused while nothing changed) must show what it said."""
    reader, file, _, proc = reader_before_the_lock_table(tmp_path, recheck_seconds=0.05)
    show_lock_table(proc)
    time.sleep(0.1)  # past the recheck: read whole, same bytes
    assert reader.read().writers["resnet50"] == [(os.getpid(), file.start_ticks)]
    file.close()
