"""A spool writer is untrusted input: what one can make the reader spend, and what it can make it hide.

Writers here are real spool files with real flocks (``SpoolFile`` in this process: the reader's probe
from its own open file description sees the lock as it would another process's), bent the way a
hostile writer would bend them: sizes and ``used`` offsets that claim far more than a writer makes
(sparse files: no disk cost), thousands of files and names, garbage.  Memory is what tracemalloc sees
the reader allocate; the reader runs in this process.
"""

from __future__ import annotations

import os
import struct
import tracemalloc

import gpuio
from exporter.collectors import engines
from exporter.engines import model, spool_listing
from exporter.engines import spool as spool_source
from gpuio import spool as spool_format
from gpuio.metrics import EngineMetrics
from tests.conftest import engines_collector, parse_samples

LAYOUT = spool_format.ENGINE_LAYOUT
MiB = 1 << 20


def live_writer(directory: str, engine: str | None = None,
                size: int = spool_format.DEFAULT_FILE_BYTES) -> spool_format.SpoolFile:
    file = spool_format.SpoolFile(directory, size)
    assert file.path is not None
    if engine is not None:
        EngineMetrics(engine, file).inference_seconds.observe(0.01)
    return file


def claim_used(file: spool_format.SpoolFile, used: int) -> None:
    """What a hostile writer does: say that ``used`` bytes of its (sparse) file hold records."""
    struct.pack_into("<Q", file._map, spool_format.USED_OFFSET, used)


def fill_with_engines(file: spool_format.SpoolFile, prefix: str) -> int:
    """Valid ENGINE records until the file is full: the most a real writer's file can hold."""
    count = 0
    with file.lock:
        while file.add_record(spool_format.KIND_ENGINE, f"{prefix}-{count:04d}", LAYOUT.size * 8) is not None:
            count += 1
    return count


def traced(function, *args):  # type: ignore[no-untyped-def]
    """``function(*args)`` and the peak of what it allocated (bytes)."""
    tracemalloc.start()
    try:
        result = function(*args)
        return result, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def collector(spool: str, **options: object) -> engines.EnginesCollector:
    return engines_collector(spool, **options)


# --- 1. a spool file cannot take the exporter's memory --------------------------------------------


def test_sparse_files_claiming_huge_sizes_are_refused_unread(tmp_path) -> None:
    """Three live files each claiming 256 MiB (sparse: no disk) beside a real one.  The reader used to
    read each whole, keep the bytes, and read them again every scrape (1 GiB claims: RSS 52 MB ->
    4.2 GB).  Now they are refused from their header, counted once, and cost nothing."""
    directory = str(tmp_path)
    real = live_writer(directory, "resnet50")
    hostile = [live_writer(directory, size=256 * MiB) for _ in range(3)]
    for file in hostile:
        claim_used(file, 256 * MiB)
    reader = spool_source.SpoolReader(directory)
    peaks = []
    for _ in range(3):
        totals, peak = traced(reader.read)
        peaks.append(peak)
    assert max(peaks) < 4 * MiB, f"the reader allocated {max(peaks) / MiB:.0f} MiB"
    assert reader.errors == {"oversized": 3}
    assert sum(totals.engines["resnet50"][: LAYOUT.monotonic_prefix]) > 0  # the real writer still counts
    for file in [real, *hostile]:
        file.close()


def test_a_used_offset_past_the_file_cap_is_refused_even_in_a_small_file(tmp_path) -> None:
    """The header's ``used`` is the writer's word too: 200 MiB claimed in a file that is 1 MiB."""
    file = live_writer(str(tmp_path))
    claim_used(file, 200 * MiB)
    reader = spool_source.SpoolReader(str(tmp_path))
    _, peak = traced(reader.read)
    assert peak < 4 * MiB and reader.errors == {"oversized": 1}
    file.close()


def test_full_files_are_read_within_a_budget_and_kept_within_a_budget(tmp_path) -> None:
    """Twenty live writers whose 1 MiB files are full of valid records (840 engines each): what a
    hostile writer can do within the format.  Before: every scrape read and parsed all 20 MiB
    (~4 MB of Python objects per MiB) and kept it all.  Now one read() parses at most
    SCRAPE_PARSE_BYTES, and the content kept comes from at most RETAINED_BYTES of files; a small real
    writer still gets in (big files may take only half of what is kept)."""
    directory = str(tmp_path)
    hostile = [live_writer(directory) for _ in range(20)]
    for index, file in enumerate(hostile):
        fill_with_engines(file, f"junk{index:02d}")
    real = live_writer(directory, "zz-real")  # sorts last: reached only after the junk
    reader = spool_source.SpoolReader(directory)
    tracemalloc.start()
    try:
        peaks = []
        for _ in range(8):
            tracemalloc.reset_peak()
            totals = reader.read()
            peaks.append(tracemalloc.get_traced_memory()[1])
        kept = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert "zz-real" in totals.engines
    assert kept < 48 * MiB, f"{kept / MiB:.0f} MiB kept"  # before: ~100 MiB
    assert max(peaks) < 64 * MiB, f"a read peaked at {max(peaks) / MiB:.0f} MiB"
    assert totals.deferred_files > 0  # and it says so
    assert len(totals.engines) < 20 * 840
    for file in [real, *hostile]:
        file.close()


# --- 5. caps that junk cannot use to push out real engines; counters that never go down -----------


def test_a_real_engine_started_after_thousands_of_junk_names_is_exported(spool_dir) -> None:
    """3,000 writers (files) each with an engine of its own name fill the 200-engine cap first.  A real
    engine started later, serving, used to be left out for good (the first 200 kept their place)."""
    junk = []
    for index in range(3000):
        file = live_writer(spool_dir, size=8192)
        EngineMetrics(f"junk-{index:04d}", file).load_read_bytes.inc(1)
        junk.append(file)
    target = collector(spool_dir)
    target.collect()
    real = gpuio.engine("resnet50")
    for _ in range(3):
        real.inference_seconds.observe(0.01)  # it serves between scrapes
        samples = parse_samples(_render(target))
    exported = {dict(labels)["engine"] for name, labels in samples if name == "gpuio_engine_processes"}
    assert "resnet50" in exported and len(exported) == 200
    assert samples[("gpuio_engine_dropped_series_total", frozenset({("kind", "engine")}))] >= 2801
    for file in junk:
        file.close()


def _render(target: engines.EnginesCollector) -> str:
    from exporter.exposition import render

    return render(target.collect())


def test_one_engine_named_with_thousands_of_paths_has_bounded_info_series(spool_dir) -> None:
    """3,000 writers of one engine, each naming another path, gave 3,000 gpuio_engine_info series."""
    files = []
    for index in range(3000):
        file = live_writer(spool_dir, size=8192)
        m = EngineMetrics("resnet50", file)
        m._append_info(spool_format.pack_info(0, (0, 0), 0, 0, 0, float(index), f"/models/copy-{index}.engine", "",
                                              "x"))
        files.append(file)
    target = collector(spool_dir)
    samples = parse_samples(_render(target))
    while getattr(target.service.reader, "deferred_files", 0):  # 3,000 files take more than one scrape's read budget
        samples = parse_samples(_render(target))
    infos = [labels for name, labels in samples if name == "gpuio_engine_info"]
    cap = getattr(engines, "MAX_INFOS", 16)
    assert len(infos) == cap  # before: 3,000
    assert samples[("gpuio_engine_dropped_series_total", frozenset({("kind", "info")}))] == 3000 - cap
    for file in files:
        file.close()


def test_dead_junk_cannot_push_a_dead_real_engines_folded_totals_out(spool_dir) -> None:
    """A real engine's process exits (its totals are folded); then 1,000 dead junk files with names of
    their own arrive, past the folded cap (4 x max-engines).  The real engine's counter used to fall
    from 123,457,789 to what a later writer of that name added (a reset to Prometheus)."""
    real = live_writer(spool_dir)
    EngineMetrics("resnet50", real).load_read_bytes.inc(123_456_789)
    target = collector(spool_dir, max_engines=200)
    target.collect()
    real.close()
    target.collect()  # folded
    for index in range(1000):
        junk = live_writer(spool_dir, size=8192)
        EngineMetrics(f"junk-{index:04d}", junk).load_read_bytes.inc(1000)
        junk.close()
    later = live_writer(spool_dir)  # a new process of the real engine
    EngineMetrics("resnet50", later).load_read_bytes.inc(1000)
    for _ in range(2):
        samples = parse_samples(_render(target))
    key = ("gpuio_engine_load_read_bytes_total", frozenset({("engine", "resnet50")}))
    assert samples[key] == 123_457_789
    assert samples[("gpuio_engine_dropped_series_total", frozenset({("kind", "folded_engine")}))] >= 200
    later.close()


def test_garbage_files_are_counted_once_however_many(tmp_path) -> None:
    """10,500 garbage files: the reader's memory of bad files was cleared past 10,000, so every scrape
    counted all of them again (20,000 files: +20,000 a scrape)."""
    directory = str(tmp_path)
    for index in range(10_500):
        with open(os.path.join(directory, f"gpuio-{index}-1-garbage.spool"), "wb") as handle:
            handle.write(b"not a spool file at all" * 20)
    reader = spool_source.SpoolReader(directory)
    counts = []
    for _ in range(6):  # the first reads take the files in turn, within each read's budget
        reader.read()
        counts.append(reader.errors.get("garbage", 0))
    assert counts[-3:] == [10_500, 10_500, 10_500]
    assert counts[0] < 10_500 and reader.deferred_files == 0
    os.unlink(os.path.join(directory, "gpuio-7-1-garbage.spool"))  # forgotten: its name is gone
    with open(os.path.join(directory, "gpuio-7-2-garbage.spool"), "wb") as handle:
        handle.write(b"another bad file" * 20)  # a new file: counted
    reader.read()
    assert reader.errors["garbage"] == 10_501 and len(reader.listing.bad) == 10_500


def test_a_live_file_that_turns_oversized_keeps_its_last_values_and_is_folded_when_its_writer_exits(tmp_path) -> None:
    """A writer read before that then claims too much is neither read past the cap nor stuck as live:
    its last good totals stand, it is counted once, and folded (then removed) when the writer exits."""
    directory = str(tmp_path)
    file = live_writer(directory, "resnet50")
    reader = spool_source.SpoolReader(directory)
    assert reader.read().processes == {"resnet50": 1}
    claim_used(file, 200 * MiB)
    for _ in range(2):
        totals = reader.read()
    assert totals.processes == {"resnet50": 1} and reader.errors == {"oversized": 1}
    file.close()
    totals = reader.read()
    assert totals.processes == {} and reader.folded_processes == 1 and os.listdir(directory) == []
    assert sum(totals.engines["resnet50"][: LAYOUT.monotonic_prefix]) > 0


def test_junk_names_past_the_listing_slice_cannot_make_a_live_file_count_twice(tmp_path) -> None:
    """A read looks at a slice of the directory's entries (``scan_entries``).  A writer that fills the
    directory with empty files must not push a live writer's file out of the listing: read as vanished,
    its totals would be folded; listed again, counted again on top (its counters doubled at each round)."""
    directory = tmp_path / "spool"
    directory.mkdir()
    victim = spool_format.SpoolFile(str(directory))
    EngineMetrics("victim", victim).inference_seconds.observe(0.001)
    reader = spool_source.SpoolReader(str(directory))
    reader.scan_entries = 5
    counts = []
    junk = [directory / f"{spool_format.PREFIX}junk-{index}{spool_format.SUFFIX}" for index in range(300)]
    try:
        for _ in range(2):  # junk comes, junk goes, twice
            for path in junk:
                path.touch()
                counts.append(model.histogram_count_and_sum(reader.read().engines["victim"],
                                                                   "inference_seconds")[0])
            for path in junk:
                path.unlink()
                counts.append(model.histogram_count_and_sum(reader.read().engines["victim"],
                                                                   "inference_seconds")[0])
    finally:
        victim.close()
    assert set(counts) == {1.0}
    assert "vanished" not in reader.errors


def test_temporary_files_are_swept_a_few_a_read_and_never_in_a_pods_volume(tmp_path, monkeypatch) -> None:
    """A writer that died before renaming its file leaves ``.gpuio-*.tmp``; the reader removes those older
    than a minute.  Each is opened (a flock probe): thousands of them cost thousands of opens in every
    scrape, so a read looks at a few only.  In a pod's own volume the reader deletes nothing."""
    from exporter.pods import kubelet

    directory = tmp_path / "spool"
    directory.mkdir()
    old = os.stat(tmp_path).st_mtime - 3600
    for index in range(500):
        path = directory / f".{spool_format.PREFIX}{index}-1-0000000000000001{spool_format.SUFFIX}.tmp"
        path.touch()
        os.utime(path, (old, old))
    uid = "6f1c2d3e-4a5b-4c6d-8e7f-90a1b2c3d4e5"
    pod_volume = tmp_path / "pods" / uid / "volumes" / kubelet.EMPTY_DIR / "gpuio-spool"
    pod_volume.mkdir(parents=True)
    in_pod = pod_volume / f".{spool_format.PREFIX}7-1-0000000000000001{spool_format.SUFFIX}.tmp"
    in_pod.touch()
    os.utime(in_pod, (old, old))
    reader = spool_source.SpoolReader(str(directory))
    reader.set_pod_directories({str(pod_volume): uid})
    reader.read()
    removed = 500 - len(os.listdir(directory))
    assert 0 < removed <= spool_source.MAX_SWEPT_TEMPORARY  # swept, a few at a time
    assert in_pod.exists()  # the pod's volume is the pod's
    for _ in range(500 // spool_source.MAX_SWEPT_TEMPORARY + 1):
        reader.read()
    assert os.listdir(directory) == []  # all of them in the end


def test_a_file_gone_while_the_listing_takes_several_reads_is_folded_once_at_the_end_of_the_pass(tmp_path) -> None:
    """Only a listing walked through proves a file gone: a live writer's file that disappears (another
    reader took it) keeps its last values while the pass goes on, is folded once when the pass ends
    without it, and nothing else is taken for gone on the way."""
    directory = tmp_path / "spool"
    directory.mkdir()
    writers = [spool_format.SpoolFile(str(directory)) for _ in range(3)]
    for file in writers:
        EngineMetrics("steady", file).inference_seconds.observe(0.001)
    for index in range(20):
        (directory / f"junk-{index}").touch()
    reader = spool_source.SpoolReader(str(directory))
    reader.scan_entries = 5  # 23 entries: 5 reads a pass
    reads = 0
    while True:  # one pass to find them all
        totals = reader.read()
        reads += 1
        if not totals.unfinished_listings and totals.live_files == 3:
            break
        assert reads <= 10
    gone = writers[0]
    assert gone.path is not None
    os.unlink(gone.path)  # its writer lives on, its file is gone
    seen = []
    for _ in range(6):  # more than a pass
        totals = reader.read()
        seen.append((totals.live_files, model.histogram_count_and_sum(totals.engines["steady"],
                                                                             "inference_seconds")[0]))
    assert {count for _, count in seen} == {3.0}  # as last seen, then folded: never twice, never lost
    assert seen[-1][0] == 2 and reader.errors.get("vanished") == 1 and reader.folded_processes == 1
    for file in writers:
        file.close()


def test_bad_files_remembered_are_capped_however_many_the_walk_reaches(tmp_path, monkeypatch) -> None:
    """The listing reaches every name of the directory in turn, junk included: the bad files remembered
    (to count each once and not open it again) stop at MAX_BAD_REMEMBERED, and those past it are counted
    again when seen again (the counter runs on, visibly), rather than growing memory without end."""
    monkeypatch.setattr(spool_listing, "MAX_BAD_REMEMBERED", 4)
    directory = tmp_path / "spool"
    directory.mkdir()
    for index in range(10):
        (directory / f"{spool_format.PREFIX}junk-{index}{spool_format.SUFFIX}").touch()
    reader = spool_source.SpoolReader(str(directory))
    reader.scan_entries = 3
    for _ in range(8):  # two walks of the directory
        reader.read()
    assert len(reader.listing.bad) == 4
    assert reader.errors["empty"] == 4 + 2 * 6  # 4 remembered, counted once; 6 counted at each walk
