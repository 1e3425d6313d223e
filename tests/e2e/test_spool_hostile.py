"""Hostile or buggy spool writers against the reader (issue 27, findings 3-5): what one writer, or a local
user who may write the spool directory, can make the published engine totals do.

Writers are real processes using the real library (``Writer``: a subprocess that observes on command and
holds its file's flock for its whole life); an attack is what any of them could do: rewrite its own file
with pwrite, rename or hard-link files in the directory.  The reader runs in this process.

* Counters never fall (finding 4): a writer that cuts its ``used``, lowers a value, writes NaN, an
  infinity or a negative value, renames a record in place, or lowers its drop count cannot make a
  published total that also holds other processes' and folded counts go down; a writer whose values
  fell counts on from its new values.
* A file is its inode (finding 5): a live file renamed, hard-linked, moved out and back, or a dead one
  hard-linked, counts once; a live file renamed onto the name of a dead file while that one is being
  folded is not deleted.
* One writer's flood costs only its own series (finding 3): INFO records naming thousands of devices,
  hundreds of engines, a thousand error reasons on a neighbour's engine; a small file listed after
  twenty full ones is read at once.
"""

from __future__ import annotations

import math
import os
import struct
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator

import pytest

from exporter.engines import model, parse
from exporter.engines import spool as spool_source
from gpuio import spool as spool_format
from tests.conftest import REPO
from tests.unit.test_spool_trust import fill_with_engines

pytestmark = pytest.mark.e2e

LAYOUT = spool_format.ENGINE_LAYOUT
# What one file may keep (parse.FILE_LIMITS): devices named, engines, error reasons per engine.
LIMITS = getattr(parse, "FILE_LIMITS", None)
DEVICES_PER_FILE = LIMITS.devices if LIMITS else 64
ENGINES_PER_FILE = LIMITS.engines if LIMITS else 256
ERRORS_PER_ENGINE = LIMITS.errors_per_engine if LIMITS else 64
LOAD_BYTES = LAYOUT.counters["load_read_bytes"]

WRITER = textwrap.dedent("""
    import os, sys
    sys.path.insert(0, {repo!r})
    import gpuio
    from gpuio import metrics
    gpuio.configure({directory!r})
    print(metrics.spool_file().path, flush=True)
    for line in sys.stdin:
        command, *words = line.split()
        if command == "observe":  # observe ENGINE COUNT: COUNT inferences, COUNT bytes loaded, one error
            engine = gpuio.engine(words[0])
            for _ in range(int(words[1])):
                engine.inference_seconds.observe(0.01)
            engine.load_read_bytes.inc(int(words[1]))
            engine.error("timeout")
        elif command == "info":  # info ENGINE PATH GPU
            gpuio.engine(words[0]).set_info(words[1], 0, words[2], "tensorrt")
        elif command == "links":  # how many names the file this process writes has now
            print(os.fstat(metrics.spool_file()._fd).st_nlink, flush=True)
            continue
        print("ok", flush=True)
""")


class Writer:
    """An inference process using the real library, driven over its stdin."""

    def __init__(self, directory: str) -> None:
        self.process = subprocess.Popen([sys.executable, "-c", WRITER.format(repo=REPO, directory=directory)],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.path = self._answer()
        assert os.path.exists(self.path)

    def _answer(self) -> str:
        assert self.process.stdout is not None
        line = self.process.stdout.readline().strip()
        assert line, "the writer process died"
        return line

    def do(self, command: str) -> str:
        assert self.process.stdin is not None
        self.process.stdin.write(command + "\n")
        self.process.stdin.flush()
        return self._answer()

    def observe(self, engine: str, count: int) -> None:
        assert self.do(f"observe {engine} {count}") == "ok"

    def links(self) -> int:
        return int(self.do("links"))

    def exit(self) -> None:
        """The process ends (its lock with it); the file stays for the reader to fold."""
        if self.process.poll() is None:
            assert self.process.stdin is not None
            self.process.stdin.close()
            self.process.wait(timeout=30)


@pytest.fixture
def writers() -> Iterator[list[Writer]]:
    started: list[Writer] = []
    yield started
    for writer in started:
        writer.process.kill()
        writer.process.wait()


def start(writers: list[Writer], directory: str) -> Writer:
    writer = Writer(directory)
    writers.append(writer)
    return writer


def inferences(totals: model.Totals, engine: str) -> float:
    return model.histogram_count_and_sum(totals.engines[engine], "inference_seconds")[0]


def spool_names(directory: str) -> list[str]:
    return sorted(name for name in os.listdir(directory) if name.endswith(spool_format.SUFFIX))


# --- 4. published counters never fall ------------------------------------------------------------


def records(path: str) -> dict[tuple[int, str], tuple[int, int]]:
    """(kind, key) -> (offset of the record, offset of its payload) of the records a spool file holds."""
    with open(path, "rb") as handle:
        data = handle.read()
    used = struct.unpack_from("<Q", data, spool_format.USED_OFFSET)[0]
    found, offset = {}, spool_format.HEADER_SIZE
    while offset + spool_format.RECORD_HEAD.size <= used:
        size, kind, key_length = spool_format.RECORD_HEAD.unpack_from(data, offset)
        key = data[offset + 8 : offset + 8 + key_length].decode()
        found[(kind, key)] = (offset, offset + 8 + spool_format.pad8(key_length))
        offset += size
    return found


def rewrite(path: str, offset: int, data: bytes) -> None:
    """What the writer of ``path`` can do to its own file: write anything anywhere in it (and move the
    header's generation, so that the reader reads it whole at once rather than within a minute)."""
    fd = os.open(path, os.O_RDWR)
    try:
        os.pwrite(fd, data, offset)
        generation = struct.unpack("<d", os.pread(fd, 8, spool_format.GENERATION_OFFSET))[0]
        os.pwrite(fd, struct.pack("<d", generation + 1), spool_format.GENERATION_OFFSET)
    finally:
        os.close(fd)


def double_at(path: str, engine: str, slot: int, value: float) -> None:
    _, payload = records(path)[(spool_format.KIND_ENGINE, engine)]
    rewrite(path, payload + slot * 8, struct.pack("<d", value))


# where 0.01 s counts
FIRST_BUCKET = LAYOUT.histograms["inference_seconds"][0] + spool_format.LATENCY_BOUNDS.index(0.01)
SUM = LAYOUT.histograms["inference_seconds"][1]


def cut_used(path: str) -> None:
    rewrite(path, spool_format.USED_OFFSET, struct.pack("<Q", spool_format.HEADER_SIZE))


def rename_record(path: str) -> None:
    offset, _ = records(path)[(spool_format.KIND_ENGINE, "resnet50")]
    rewrite(path, offset + 8, b"resnet5X")  # same length: the record now says it is another engine's


def lower_values(path: str) -> None:
    double_at(path, "resnet50", FIRST_BUCKET, 0.0)
    double_at(path, "resnet50", LOAD_BYTES, 0.0)
    _, payload = records(path)[(spool_format.KIND_ERROR, "resnet50\0timeout")]
    rewrite(path, payload, struct.pack("<d", 0.0))


ATTACKS = {
    "used cut": cut_used,
    "record renamed in place": rename_record,
    "counters lowered": lower_values,
    "NaN": lambda path: double_at(path, "resnet50", FIRST_BUCKET, math.nan),
    "+Inf": lambda path: double_at(path, "resnet50", SUM, math.inf),
    "negative": lambda path: double_at(path, "resnet50", LOAD_BYTES, -1.0),
    "drop count lowered": lambda path: rewrite(path, spool_format.DROPPED_OFFSET, struct.pack("<Q", 0)),
}


def published(totals: model.Totals) -> tuple[float, float, float, float]:
    """What Prometheus sees of engine resnet50: inferences, bytes loaded, timeouts; and the writers' drops."""
    values = totals.engines["resnet50"]
    return (inferences(totals, "resnet50"), values[LOAD_BYTES], totals.errors[("resnet50", "timeout")],
            float(totals.dropped_by_writers))


@pytest.mark.parametrize("attack", list(ATTACKS))
def test_a_writer_rewriting_its_own_file_cannot_make_a_published_counter_fall(tmp_path, writers, attack) -> None:
    """resnet50's totals hold an exited process's (folded), an honest live neighbour's and the hostile
    writer's counts.  Whatever the hostile writer does to its own file, none of them may fall: before,
    a used cut, a renamed record, NaN, +Inf or a negative value took the writer's whole share away
    (a counter reset to Prometheus: rate() spikes), and a lowered drop count lowered the node's.  A
    writer whose counters fell counts on from its new values (before: stuck at the old ones)."""
    directory = str(tmp_path)
    exited = start(writers, directory)
    exited.observe("resnet50", 300)
    exited.exit()
    start(writers, directory).observe("resnet50", 200)
    hostile = start(writers, directory)
    hostile.observe("resnet50", 100)
    rewrite(hostile.path, spool_format.DROPPED_OFFSET, struct.pack("<Q", 7))  # its own count of series it dropped
    reader = spool_source.SpoolReader(directory)
    before = published(reader.read())
    assert before == (600, 600, 3, 7) and reader.folded_processes == 1

    ATTACKS[attack](hostile.path)
    after = published(reader.read())
    assert all(now >= then for now, then in zip(after, before, strict=True)), (before, after)

    hostile.observe("resnet50", 5)
    later = reader.read()
    assert all(now >= then for now, then in zip(published(later), after, strict=True)), (after, published(later))
    if attack == "counters lowered":  # lowered to 0, then 5 more: 5 more published, not 0
        assert published(later)[0] == after[0] + 5
    for values in (*later.engines.values(), *later.per_gpu.values()):
        assert all(map(math.isfinite, values))  # NaN or an infinity is never published, nor added
    assert reader.errors.get("reset", 0) >= 1  # said, not silent


# --- 5. a file is its inode ------------------------------------------------------------------------------


@pytest.mark.parametrize("attack", ["rename", "hard link"])
def test_a_live_file_renamed_or_hard_linked_counts_once(tmp_path, writers, attack) -> None:
    """Before, the reader knew files by name: renamed, a live file was folded as vanished and read again
    under its new name; linked, it was read under both.  1,000 inferences became 2,000, for ever."""
    directory = str(tmp_path)
    writer = start(writers, directory)
    writer.observe("resnet50", 1000)
    reader = spool_source.SpoolReader(directory)
    assert inferences(reader.read(), "resnet50") == 1000
    other = os.path.join(directory, "gpuio-1-1-0000000000000bad.spool")
    (os.rename if attack == "rename" else os.link)(writer.path, other)
    for _ in range(2):
        totals = reader.read()
        assert inferences(totals, "resnet50") == 1000 and totals.live_files == 1
    writer.observe("resnet50", 10)
    assert inferences(reader.read(), "resnet50") == 1010
    writer.exit()
    for _ in range(2):
        totals = reader.read()
        assert inferences(totals, "resnet50") == 1010 and totals.live_files == 0
    assert reader.folded_processes == 1 and spool_names(directory) == []  # every name of it removed


def test_a_dead_file_hard_linked_is_folded_once(tmp_path, writers) -> None:
    directory = str(tmp_path)
    writer = start(writers, directory)
    writer.observe("resnet50", 1000)
    writer.exit()
    os.link(writer.path, os.path.join(directory, "gpuio-1-1-0000000000000bad.spool"))
    reader = spool_source.SpoolReader(directory)
    for _ in range(2):
        assert inferences(reader.read(), "resnet50") == 1000  # before: 2,000
    assert reader.folded_processes == 1 and spool_names(directory) == []


def test_a_live_file_moved_out_of_the_directory_and_back_counts_once(tmp_path, writers) -> None:
    """Moved out, the file is still its writer's: read through the descriptor the reader keeps on it
    (before: folded as vanished, its later counts lost); moved back under another name, the same file
    (before: counted a second time)."""
    directory, elsewhere = tmp_path / "spool", tmp_path / "elsewhere"
    directory.mkdir()
    elsewhere.mkdir()
    writer = start(writers, str(directory))
    writer.observe("resnet50", 1000)
    reader = spool_source.SpoolReader(str(directory))
    reader.read()
    os.rename(writer.path, elsewhere / "hidden")
    writer.observe("resnet50", 10)
    totals = reader.read()
    assert inferences(totals, "resnet50") == 1010 and totals.live_files == 1
    os.rename(elsewhere / "hidden", directory / "gpuio-1-1-0000000000000bad.spool")
    writer.observe("resnet50", 10)
    totals = reader.read()
    assert inferences(totals, "resnet50") == 1020 and totals.live_files == 1
    writer.exit()
    assert inferences(reader.read(), "resnet50") == 1020
    assert reader.folded_processes == 1 and reader.errors == {} and spool_names(str(directory)) == []


def test_a_live_file_folded_as_vanished_and_found_again_is_not_counted_twice_nor_deleted(tmp_path, writers) -> None:
    """With no descriptor kept on it (past the reader's cap), a live file renamed out of the directory
    cannot be told from one removed: its totals are folded as vanished.  Renamed back, it is the same
    inode and writer: not counted a second time (before: 2,000), and not removed while its writer lives."""
    directory, elsewhere = tmp_path / "spool", tmp_path / "elsewhere"
    directory.mkdir()
    elsewhere.mkdir()
    writer = start(writers, str(directory))
    writer.observe("resnet50", 1000)
    reader = spool_source.SpoolReader(str(directory))
    reader._kept_cap = 0
    reader.read()
    os.rename(writer.path, elsewhere / "hidden")
    assert inferences(reader.read(), "resnet50") == 1000 and reader.errors == {"vanished": 1}
    back = directory / "gpuio-1-1-0000000000000bad.spool"
    os.rename(elsewhere / "hidden", back)
    writer.observe("resnet50", 10)  # not shown: someone took its name away
    for _ in range(2):
        totals = reader.read()
        assert inferences(totals, "resnet50") == 1000 and totals.live_files == 0
    assert writer.links() == 1
    writer.exit()
    assert inferences(reader.read(), "resnet50") == 1000 and not back.exists()  # removed once its writer is gone


def test_a_live_file_renamed_onto_a_folded_files_name_in_a_pods_volume_is_read_on(tmp_path, writers) -> None:
    """In a pod's volume the reader removes nothing: a folded file's name is tombstoned (skipped unopened).
    A live file renamed onto that name used to be skipped with it (and folded as vanished under its old
    name): its later counts were lost.  The tombstone holds for that name and inode only."""
    directory = tmp_path / "pod-volume"
    directory.mkdir()
    exited = start(writers, str(directory))
    exited.observe("resnet50", 100)
    exited.exit()
    live = start(writers, str(directory))
    live.observe("resnet50", 10)
    reader = spool_source.SpoolReader(str(tmp_path / "node-spool"))
    reader.set_pod_directories({str(directory): "6f1c2d3e-4a5b-4c6d-8e7f-90a1b2c3d4e5"})
    assert inferences(reader.read(), "resnet50") == 110
    os.rename(live.path, exited.path)
    live.observe("resnet50", 5)
    for _ in range(2):
        totals = reader.read()
        assert inferences(totals, "resnet50") == 115 and totals.live_files == 1
    assert reader.errors == {} and reader.folded_processes == 1


RENAMER = textwrap.dedent("""
    import ctypes, os, select, sys
    directory, pairs = sys.argv[1], sys.argv[2:]
    targets = dict(zip(pairs[::2], pairs[1::2]))  # dead file's name -> a live file to rename onto it
    libc = ctypes.CDLL(None, use_errno=True)
    fd = libc.inotify_init1(0)
    assert fd >= 0 and libc.inotify_add_watch(fd, directory.encode(), 0x20) >= 0  # IN_OPEN
    print("watching", flush=True)
    renamed = 0
    while targets and select.select([fd], [], [], 20)[0]:
        data, offset = os.read(fd, 65536), 0
        while offset < len(data):
            length = int.from_bytes(data[offset + 12 : offset + 16], "little")
            name = data[offset + 16 : offset + 16 + length].rstrip(b"\\0").decode()
            offset += 16 + length
            if name in targets:  # the exporter just opened a dead file: put a live one under its name
                os.rename(targets.pop(name), os.path.join(directory, name))
                renamed += 1
    print(renamed, flush=True)
""")


def test_a_live_file_renamed_onto_a_dead_files_name_while_it_is_folded_is_not_deleted(tmp_path, writers) -> None:
    """The reader opens a dead file, reads and folds it, then removes it.  A local user watching the
    directory with inotify renames a live writer's file onto that name in between.  Before, the reader
    unlinked the name it had folded: the live file went (a real run lost 24 of 549).  Now the name is
    removed only while it still means the inode folded, and the live file counts on, once."""
    directory = str(tmp_path)
    live = [start(writers, directory) for _ in range(6)]
    for writer in live:
        writer.observe("resnet50", 100)
    dead = []
    for index in range(6):
        file = spool_format.SpoolFile(directory)
        with file.lock:  # a few hundred engines: its read and fold take a while, as a busy node's would
            for number in range(300):
                file.add_record(spool_format.KIND_ENGINE, f"dead{index}-{number:03d}", LAYOUT.size * 8)
        file.close()
        dead.append(os.path.basename(str(file.path)))
    pairs = [item for name, writer in zip(dead, live, strict=True) for item in (name, writer.path)]
    renamer = subprocess.Popen([sys.executable, "-c", RENAMER, directory, *pairs], stdout=subprocess.PIPE, text=True)
    assert renamer.stdout is not None and renamer.stdout.readline().strip() == "watching"
    reader = spool_source.SpoolReader(directory)
    deadline = time.monotonic() + 30
    while renamer.poll() is None and time.monotonic() < deadline:
        reader.read()
        time.sleep(0.05)
    assert int(renamer.stdout.read().strip() or 0) == 6 and renamer.wait() == 0  # every rename happened
    assert [writer.links() for writer in live] == [1] * 6  # before: some at 0, deleted by the exporter
    for _ in range(2):
        totals = reader.read()
    assert totals.live_files == 6 and inferences(totals, "resnet50") == 600
    for writer in live:
        writer.observe("resnet50", 1)
        writer.exit()
    totals = reader.read()
    assert inferences(totals, "resnet50") == 606 and totals.live_files == 0 and spool_names(directory) == []


SWAPPER = textwrap.dedent("""
    import ctypes, os, sys
    rename = ctypes.CDLL(None, use_errno=True).renameat2
    directory = os.open(sys.argv[1], os.O_RDONLY | os.O_DIRECTORY)
    first, second = sys.argv[2].encode(), sys.argv[3].encode()
    print("swapping", flush=True)
    while True:
        rename(directory, first, directory, second, 2)  # RENAME_EXCHANGE: the two names trade files, at once
""")


def test_a_live_file_swapped_with_a_dead_one_in_a_loop_is_never_deleted(tmp_path, writers) -> None:
    """A writer who may rename in the spool directory swaps a dead file and a live writer's file
    (renameat2 RENAME_EXCHANGE) as fast as it can while the reader folds and removes the dead one.
    Before: the live file went in about one trial in three (the name checked, then unlinked: the swap
    lands in between).  Now whatever the name means is moved into the reader's own directory first and
    checked there: in no trial is the live file removed, and it counts once."""
    for trial in range(8):
        directory = str(tmp_path / f"trial{trial}")
        os.mkdir(directory)
        dead = start(writers, directory)
        dead.observe("resnet50", 100)
        dead.exit()
        live = start(writers, directory)
        live.observe("resnet50", 10)
        swapper = subprocess.Popen([sys.executable, "-c", SWAPPER, directory, os.path.basename(dead.path),
                                    os.path.basename(live.path)], stdout=subprocess.PIPE, text=True)
        try:
            assert swapper.stdout is not None and swapper.stdout.readline().strip() == "swapping"
            reader = spool_source.SpoolReader(directory)
            for _ in range(20):
                reader.read()
        finally:
            swapper.kill()
            swapper.wait()
        assert live.links() == 1, f"trial {trial}: the live writer's file was deleted"
        for _ in range(2):
            totals = reader.read()
        assert totals.live_files == 1 and inferences(totals, "resnet50") == 110, trial
        assert len(spool_names(directory)) == 1 and reader.folded_processes == 1, trial
        live.exit()


def test_the_reaping_directory_is_the_readers_own_and_what_a_crash_left_in_it_is_put_right(tmp_path, writers) -> None:
    """The name the reader would use for its reaping directory taken by someone (here: a directory others
    may write, and a symlink would do as well) is not used: another, of its own, is made.  What a reader
    killed mid-removal left in its own: a dead file is removed, a live one put back and read (once)."""
    directory = str(tmp_path)
    taken = os.path.join(directory, f".{spool_format.PREFIX}reaping-{os.geteuid()}")
    os.mkdir(taken)
    os.chmod(taken, 0o777)
    live = start(writers, directory)
    live.observe("resnet50", 10)
    reader = spool_source.SpoolReader(directory)
    assert inferences(reader.read(), "resnet50") == 10
    exited = start(writers, directory)
    exited.observe("resnet50", 100)
    exited.exit()
    assert inferences(reader.read(), "resnet50") == 110
    assert os.listdir(taken) == [] and sorted(os.listdir(directory)) == sorted(
        [os.path.basename(live.path), os.path.basename(taken)])  # its own one made, used and removed again
    os.rmdir(taken)

    # A crash left the live file and a dead one in the reader's own reaping directory.
    own = os.path.join(directory, f".{spool_format.PREFIX}reaping-{os.geteuid()}")
    os.mkdir(own, 0o700)
    left_dead = start(writers, directory)
    left_dead.observe("bert", 1)
    left_dead.exit()
    os.rename(left_dead.path, os.path.join(own, "1-1"))
    os.rename(live.path, os.path.join(own, "2-1"))
    another = start(writers, directory)
    another.observe("yolo", 1)
    another.exit()  # the next read removes a file: its reaping directory empties what was left
    for _ in range(2):
        totals = reader.read()
    assert totals.live_files == 1 and inferences(totals, "resnet50") == 110 and "bert" not in totals.engines
    assert live.links() == 1 and not os.path.exists(own)
    assert [name for name in spool_names(directory) if name.startswith(f"{spool_format.PREFIX}restored-")]


# --- 3. one writer's flood costs only its own series ----------------------------------------------------


def flood_of_infos(directory: str, count: int) -> spool_format.SpoolFile:
    """A live writer whose file holds ``count`` INFO records, each naming an engine and a device of its own."""
    file = spool_format.SpoolFile(directory, 2 << 20)
    with file.lock:
        for number in range(count):
            payload = spool_format.pack_info(0, (300 + number // 256, number % 256), 1000 + number, 4096, 0, 1.0,
                                             f"/models/flood/{number:05d}.engine", f"GPU-{number:08d}", "tensorrt")
            assert file.add_record(spool_format.KIND_INFO, f"flood-{number:05d}", len(payload), payload) is not None
    return file


def honest_neighbour(writers: list[Writer], directory: str) -> Writer:
    writer = start(writers, directory)
    for engine in ("resnet50", "bert", "yolo"):
        writer.do(f"info {engine} /etc/hostname GPU-honest")
        writer.observe(engine, 10)
    return writer


def assert_read_in_full(totals: model.Totals) -> None:
    for engine in ("resnet50", "bert", "yolo"):
        assert inferences(totals, engine) == 10 and totals.engines[engine][LOAD_BYTES] == 10
        assert totals.errors[(engine, "timeout")] == 1
        assert [(info.path, info.gpu_uuid) for info in totals.infos[engine]] == [("/etc/hostname", "GPU-honest")]


def test_a_writer_naming_twelve_thousand_devices_costs_only_its_own_series(tmp_path, writers) -> None:
    """12,000 INFO records naming 12,000 devices (1.6 MB, read where --collector.engines.max-file-bytes
    allows 2 MiB) beside an honest writer: before, every read parsed and merged all 12,000 (and the
    collector looked each device up).  Now that file keeps the INFO records of its first 64 devices,
    the rest is left out and counted once, and the neighbour is read in full."""
    directory = str(tmp_path)
    flood = flood_of_infos(directory, 12_000)
    honest_neighbour(writers, directory)
    reader = spool_source.SpoolReader(directory, max_file_bytes=2 << 20)
    for _ in range(2):
        with flood.lock:
            pass  # the flood changes before every read: parsed again each time
        totals = reader.read()
        assert_read_in_full(totals)
        assert len(totals.infos) == DEVICES_PER_FILE + 3
        assert getattr(totals, "records_left_out", 0) > 0
    assert reader.errors == {"over_budget": 1}  # once per file
    flood.close()


def test_a_writer_flooding_engines_and_a_neighbours_error_reasons_keeps_only_its_share(tmp_path, writers) -> None:
    """Hundreds of engines, and a thousand error reasons on the honest writer's own engine, from one file."""
    directory = str(tmp_path)
    flood = spool_format.SpoolFile(directory)
    with flood.lock:
        for number in range(1000):
            offset = flood.add_record(spool_format.KIND_ERROR, f"resnet50\0reason{number:04d}", 8)
            assert offset is not None
            flood.values[offset // 8] = 1.0
        for number in range(600):
            assert flood.add_record(spool_format.KIND_ENGINE, f"junk-{number:03d}", LAYOUT.size * 8) is not None
    honest_neighbour(writers, directory)
    reader = spool_source.SpoolReader(directory)
    totals = reader.read()
    assert_read_in_full(totals)
    assert len([key for key in totals.errors if key[0] == "resnet50"]) == ERRORS_PER_ENGINE + 1
    # the flood's engines: resnet50 (named by its errors) and junk ones up to the file's engine cap
    assert len([engine for engine in totals.engines if engine.startswith("junk-")]) == ENGINES_PER_FILE - 1
    assert reader.errors == {"over_budget": 1}
    flood.close()


def test_a_small_file_listed_after_twenty_full_ones_is_read_at_once(tmp_path, writers) -> None:
    """Twenty live writers with full 1 MiB files fill what the reader keeps for big files; a small honest
    file listed after them used to wait for ever: each big file that could not be kept was still read
    whole first, and the read budget ran out just before it, read after read."""
    directory = str(tmp_path)
    hostile = [spool_format.SpoolFile(directory) for _ in range(20)]
    for index, file in enumerate(hostile):
        fill_with_engines(file, f"big{index:02d}")
    honest = honest_neighbour(writers, directory)
    os.rename(honest.path, os.path.join(directory, "gpuio-~listed-last.spool"))
    reader = spool_source.SpoolReader(directory)
    for _ in range(2):
        totals = reader.read()
    assert_read_in_full(totals)
    for file in hostile:
        file.close()


def test_a_new_writer_is_read_while_full_files_change_at_every_read(tmp_path, writers) -> None:
    """Four live writers with full 1 MiB files that change before every read use up a read's parse budget
    (4 MiB, here exactly what they take).  Live files were read first: a writer that started after them
    was never read.  Now the files a read had no budget for are the first the next read looks at."""
    directory = str(tmp_path)
    hostile = [spool_format.SpoolFile(directory) for _ in range(4)]
    for index, file in enumerate(hostile):
        fill_with_engines(file, f"big{index:02d}")
    reader = spool_source.SpoolReader(directory)
    reader.scrape_parse_bytes = sum(file.used for file in hostile)
    reader.retained_bytes = 64 << 20  # memory is not what this is about: every live file may be kept
    reader.read()
    honest_neighbour(writers, directory)
    for _ in range(3):
        for file in hostile:
            with file.lock:
                pass  # a change: read and parsed again
        totals = reader.read()
    assert_read_in_full(totals)
    for file in hostile:
        file.close()
