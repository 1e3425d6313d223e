"""The spool: how inference processes hand their engine metrics to the node's gpuio-exporter.

Each process writes its own file in a shared directory (``GPUIO_SPOOL_DIR`` for the library,
``--collector.engines.spool-dir`` for the exporter; a hostPath or emptyDir in Kubernetes).  The
exporter reads every file, folds the totals of processes that exited, and merges all of it into
per-engine series.  The design and its reasons are in docs/engines.md; in short:

Layout (version 1, little-endian, every value 8-byte aligned)::

    header (256 bytes)
      0  8s  magic b"GPUIOSPL"          40  u64  process start time, clock ticks since boot
      8  u32 version (1)                48  f64  creation time, seconds since the epoch
     12  u32 header size (256)          56  u64  instance id (random; also in the file name)
     16  u64 file size                  64  u64  series dropped because the file was full
     24  u64 used: end of the last      72  64s  process name (argv[0] basename)
             committed record
     32  u32 pid   36 u32 reserved
    records, appended after the header, never moved or freed:
      0  u32 record size (multiple of 8)   4 u16 kind   6 u16 key length
      8  key (utf-8, zero-padded to 8 bytes), then the payload:
         ENGINE: ENGINE_LAYOUT.size doubles (histogram buckets, sums, counters, gauges)
         ERROR:  1 double (count); key "engine\\0reason"
         LAYER:  2 doubles (seconds, samples); key "engine\\0layer"
         INFO:   INFO_STRUCT, then path, gpu uuid and runtime as utf-8 (the last INFO of an engine wins;
                 written when a load starts, with the load time of the last finished load or 0,
                 and again when it finishes)
         LOAD:   LOAD_SLOTS doubles (loads in progress, their bytes read so far, the start time of
                 the oldest, seconds since the epoch); key "engine\0gpu uuid\0MAJ:MIN" of the file

Hot path: an observation is one bisect and two stores of doubles into the process's MAP_SHARED
mapping, under a per-process ``threading.Lock`` (Python threads; there is never a cross-process lock
because nobody else writes the file).  No syscall: the kernel sees the stores only as dirty pages.

Publication: a record is written in full and only then is ``used`` advanced past it, so a reader
that honours ``used`` never sees half a record.  Histogram counts are stored per bucket (not
cumulative) and a histogram's count is the sum of its buckets, so an observation is two stores.

Liveness: the writer holds ``flock(LOCK_EX)`` on its file for its whole life; the kernel drops the
lock when the process ends, however it ends (SIGKILL included).  The reader probes with
``LOCK_EX|LOCK_NB``: refused means a live writer, granted means the writer is gone for good.  This
works across pid namespaces (every pod has its own pid 1), which a pid check in /proc cannot do; the
pid and start time in the header identify the process for people, not for liveness.  File names are
``gpuio-<pid>-<starttime>-<instance>.spool``, created under a dot-name and renamed into place after
the header is written and the lock taken, so a reader never sees an unlocked, half-made file.

Who deletes: a process never deletes its own file (the exporter may not have read its last
increments yet).  The exporter deletes a file only after it has proved the writer dead (it holds the
writer's lock itself) and folded the file's final totals into its memory; nothing can write the file
again, so nothing is lost.  Deleting needs write permission on the directory only; where it is
refused (a sticky directory owned by someone else) the file is remembered as folded (a tombstone)
and skipped by name.  The exporter never writes into any spool file.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import logging
import math
import mmap
import operator
import os
import secrets
import stat
import struct
import sys
import threading
import time
import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

log = logging.getLogger("gpuio.spool")

MAGIC = b"GPUIOSPL"
VERSION = 1
HEADER = struct.Struct("<8sIIQQIIQdQQ64s")
HEADER_SIZE = 256
RECORD_HEAD = struct.Struct("<IHH")
SUFFIX = ".spool"
PREFIX = "gpuio-"
DEFAULT_DIR = "/run/gpuio/spool"
DEFAULT_FILE_BYTES = 1 << 20  # sparse: pages are allocated as records are added
MAX_KEY_BYTES = 400
MAX_RECORD_BYTES = 1 << 16

# offsets into the header (see the module docstring)
USED_OFFSET = 24
DROPPED_OFFSET = 64

KIND_ENGINE = 1
KIND_ERROR = 2
KIND_LAYER = 3
KIND_INFO = 4
KIND_LOAD = 5
KINDS = (KIND_ENGINE, KIND_ERROR, KIND_LAYER, KIND_INFO, KIND_LOAD)
# The LOAD record's doubles: gauges of one process's loads of one engine, GPU and file system.
LOAD_SLOTS = ("in_progress", "read_bytes", "oldest_start")

# cuda device (i32, -1 unknown), st_dev major, minor (u32), st_ino, size (u64), mtime ns (i64),
# load time (f64, seconds since the epoch), then the lengths of path, gpu uuid, runtime (u16 each).
INFO_STRUCT = struct.Struct("<iIIQQqdHHH")
MAX_PATH_BYTES = 4096
MAX_SHORT_BYTES = 128

# Bucket bounds are part of the format: every process of one version shares them, so merging is
# plain addition.  They are wide on purpose (a 50 us CNN and a 30 s LLM prefill both resolve).
LATENCY_BOUNDS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                  0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
LOAD_BOUNDS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 60.0, 120.0, 300.0, 600.0)
BATCH_BOUNDS = (1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0)

# The ENGINE record, in order.  Gauges are the only slots that may go down; everything else only grows.
HISTOGRAMS: tuple[tuple[str, tuple[float, ...]], ...] = (
    ("load_read_seconds", LOAD_BOUNDS),
    ("load_deserialize_seconds", LOAD_BOUNDS),
    ("inference_seconds", LATENCY_BOUNDS),
    ("inference_gpu_seconds", LATENCY_BOUNDS),
    ("batch_size", BATCH_BOUNDS),
    ("pool_wait_seconds", LATENCY_BOUNDS),
    ("warmup_seconds", LOAD_BOUNDS),
    ("first_inference_seconds", LATENCY_BOUNDS),
)
COUNTERS = ("load_read_bytes", "layer_profiled_inferences")
GAUGES = ("in_flight", "pool_contexts", "pool_idle")


@dataclass(frozen=True)
class Layout:
    """Where each series of the ENGINE record lives, as indexes into its doubles."""

    histograms: dict[str, tuple[int, int, tuple[float, ...]]]  # name -> (first bucket, sum index, bounds)
    counters: dict[str, int]
    gauges: dict[str, int]
    size: int
    monotonic_prefix: int  # slots [0, monotonic_prefix) only grow (buckets, sums, counters); gauges follow


def _layout() -> Layout:
    index = 0
    histograms: dict[str, tuple[int, int, tuple[float, ...]]] = {}
    for name, bounds in HISTOGRAMS:
        histograms[name] = (index, index + len(bounds) + 1, bounds)
        index += len(bounds) + 2
    counters = {name: index + offset for offset, name in enumerate(COUNTERS)}
    index += len(COUNTERS)
    gauges = {name: index + offset for offset, name in enumerate(GAUGES)}
    monotonic_prefix = index
    index += len(GAUGES)
    return Layout(histograms, counters, gauges, index, monotonic_prefix)


ENGINE_LAYOUT = _layout()
# What the reader keeps per engine *and GPU* (the rest is per engine): the series that say whether work
# waits on one GPU.  A compact vector of these ENGINE slots, in this order; PER_GPU_LAYOUT indexes it.
PER_GPU_HISTOGRAMS = ("inference_seconds", "pool_wait_seconds")


def _per_gpu_layout() -> tuple[tuple[int, ...], Layout]:
    slots: list[int] = []
    histograms: dict[str, tuple[int, int, tuple[float, ...]]] = {}
    for name in PER_GPU_HISTOGRAMS:
        first, sum_index, bounds = ENGINE_LAYOUT.histograms[name]
        histograms[name] = (len(slots), len(slots) + sum_index - first, bounds)
        slots.extend(range(first, sum_index + 1))
    monotonic = len(slots)
    gauges = {name: monotonic + offset for offset, name in enumerate(GAUGES)}
    slots.extend(ENGINE_LAYOUT.gauges[name] for name in GAUGES)
    return tuple(slots), Layout(histograms, {}, gauges, len(slots), monotonic)


PER_GPU_SLOTS, PER_GPU_LAYOUT = _per_gpu_layout()
_per_gpu_values = operator.itemgetter(*PER_GPU_SLOTS)
# The histogram bucket slots of an ENGINE record: whole counts (OpenMetrics refuses anything else).
BUCKET_SLOTS = tuple(index for first, sum_index, _ in ENGINE_LAYOUT.histograms.values()
                     for index in range(first, sum_index))
MAX_VALUE = 2.0**53


def _pad8(length: int) -> int:
    return (length + 7) & ~7


def process_start_ticks(pid: int | str = "self", procfs: str = "/proc") -> int:
    """Field 22 of /proc/<pid>/stat: when the process started, in clock ticks since boot (0 if unknown)."""
    try:
        with open(f"{procfs}/{pid}/stat", "rb") as handle:
            text = handle.read()
        return int(text[text.rindex(b")") + 2 :].split()[19])
    except (OSError, ValueError, IndexError):
        return 0


# --------------------------------------------------------------------------------------------------
# Writer (the inference process)
# --------------------------------------------------------------------------------------------------


class SpoolFile:
    """One process's spool file, mapped shared; or, when the directory cannot be used, anonymous memory.

    Never raises out of its constructor for a bad directory: instrumentation must not take an
    inference service down.  ``path`` is None when the metrics go nowhere (logged once).
    """

    def __init__(self, directory: str | None, size: int = DEFAULT_FILE_BYTES) -> None:
        self.size = max(size, HEADER_SIZE + 4096) & ~7
        self.lock = threading.Lock()  # serialises value updates and record appends within this process
        self.path: str | None = None
        self._fd: int | None = None
        self.instance = secrets.randbits(63)
        self.pid = os.getpid()
        self.start_ticks = process_start_ticks()
        self._map = self._open(directory)
        self.values = memoryview(self._map).cast("d")
        self.used = HEADER_SIZE

    def _open(self, directory: str | None) -> mmap.mmap:
        if directory:
            try:
                return self._create(directory)
            except OSError as exc:
                log.warning("gpuio spool unusable, engine metrics will not reach the exporter: %s (%s)",
                            directory, exc.strerror or exc)
        anonymous = mmap.mmap(-1, self.size)
        self._write_header(anonymous)
        return anonymous

    def _create(self, directory: str) -> mmap.mmap:
        name = f"{PREFIX}{self.pid}-{self.start_ticks}-{self.instance:016x}{SUFFIX}"
        temporary = os.path.join(directory, f".{name}.tmp")
        fd = os.open(temporary, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        lock_fd = None
        try:
            # The lock lives on a descriptor of its own: mmap keeps a duplicate of the mapping's
            # descriptor, and a lock on that one could only be dropped by unmapping.
            lock_fd = os.open(temporary, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held until this process ends
            os.ftruncate(fd, self.size)
            mapped = mmap.mmap(fd, self.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            self._write_header(mapped)
            os.rename(temporary, os.path.join(directory, name))
        except BaseException:
            if lock_fd is not None:
                os.close(lock_fd)
            with contextlib.suppress(OSError):
                os.unlink(temporary)
            raise
        finally:
            os.close(fd)
        self._fd = lock_fd
        self.path = os.path.join(directory, name)
        return mapped

    def _write_header(self, target: mmap.mmap) -> None:
        comm = os.path.basename(sys.argv[0] if sys.argv and sys.argv[0] else "python").encode()[:64]
        HEADER.pack_into(target, 0, MAGIC, VERSION, HEADER_SIZE, self.size, HEADER_SIZE, self.pid, 0,
                         self.start_ticks, time.time(), self.instance, 0, comm)

    def add_record(self, kind: int, key: str, payload_bytes: int, payload: bytes = b"") -> int | None:
        """Append a record and return the byte offset of its (zeroed) payload, or None when full.

        Caller holds ``self.lock``.  The record is complete before ``used`` moves past it.
        """
        raw = key.encode("utf-8")[:MAX_KEY_BYTES]
        size = RECORD_HEAD.size + _pad8(len(raw)) + _pad8(payload_bytes)
        if self.used + size > self.size:
            dropped = struct.unpack_from("<Q", self._map, DROPPED_OFFSET)[0] + 1
            struct.pack_into("<Q", self._map, DROPPED_OFFSET, dropped)
            return None
        offset = self.used
        RECORD_HEAD.pack_into(self._map, offset, size, kind, len(raw))
        self._map[offset + RECORD_HEAD.size : offset + RECORD_HEAD.size + len(raw)] = raw
        payload_offset = offset + RECORD_HEAD.size + _pad8(len(raw))
        if payload:
            self._map[payload_offset : payload_offset + len(payload)] = payload
        self.used = offset + size
        struct.pack_into("<Q", self._map, USED_OFFSET, self.used)  # publish
        return payload_offset

    def close(self) -> None:
        """Unmap and drop the lock; the file stays for the exporter to fold."""
        with contextlib.suppress(BufferError, ValueError):
            self.values.release()
            self._map.close()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def release_lock(self) -> None:
        """Give the file up (the exporter will fold it) but keep the mapping valid for stray handles."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def abandon_after_fork(self) -> None:
        """In a forked child: forget the parent's file without touching the parent's lock or data.

        The child's copy of the lock descriptor shares the parent's open file description, so
        closing it leaves the parent's lock in place (and a child that lives on does not keep a
        dead parent's file looking alive); the mapping is simply dropped.
        """
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None
        with contextlib.suppress(BufferError, ValueError):
            self.values.release()
            self._map.close()


def pack_info(cuda_device: int, dev: tuple[int, int], ino: int, size: int, mtime_ns: int, load_time: float,
              path: str, gpu_uuid: str, runtime: str) -> bytes:
    raw_path = path.encode("utf-8", "replace")[:MAX_PATH_BYTES]
    raw_uuid = gpu_uuid.encode("utf-8", "replace")[:MAX_SHORT_BYTES]
    raw_runtime = runtime.encode("utf-8", "replace")[:MAX_SHORT_BYTES]
    head = INFO_STRUCT.pack(cuda_device, dev[0], dev[1], ino, size, mtime_ns, load_time,
                            len(raw_path), len(raw_uuid), len(raw_runtime))
    return head + raw_path + raw_uuid + raw_runtime


# --------------------------------------------------------------------------------------------------
# Reader (the exporter)
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class EngineInfo:
    path: str
    cuda_device: int
    gpu_uuid: str
    runtime: str
    dev: tuple[int, int]
    ino: int
    size: int
    mtime_ns: int
    load_time: float


LoadKey = tuple[str, str, tuple[int, int]]  # engine, GPU uuid ("" unknown), st_dev of the file


def load_key(engine: str, gpu_uuid: str, dev: tuple[int, int]) -> str:
    """The key of a LOAD record."""
    return f"{engine}\0{gpu_uuid}\0{dev[0]}:{dev[1]}"


@dataclass
class Parsed:
    """The content of one spool file."""

    pid: int
    start_ticks: int
    instance: int
    dropped: int
    engines: dict[str, list[float]] = field(default_factory=dict)
    errors: dict[tuple[str, str], float] = field(default_factory=dict)
    layers: dict[tuple[str, str], list[float]] = field(default_factory=dict)
    infos: dict[str, EngineInfo] = field(default_factory=dict)
    loads: dict[LoadKey, list[float]] = field(default_factory=dict)  # LOAD records, LOAD_SLOTS each
    bad_record: bool = False


class BadFile(ValueError):
    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


def parse_header(data: bytes) -> tuple[int, int, int, int, int]:
    """``(used, pid, start_ticks, instance, dropped)``, or BadFile with a spool-errors reason."""
    if not data:
        raise BadFile("empty", "zero-byte file")
    if len(data) < HEADER.size:
        raise BadFile("truncated", f"{len(data)} bytes, shorter than the header")
    magic, version, header_size, size, used, pid, _, ticks, _, instance, dropped, _ = HEADER.unpack_from(data)
    if magic != MAGIC:
        raise BadFile("garbage", "not a gpuio spool file (bad magic)")
    if version != VERSION:
        raise BadFile("version", f"spool format version {version}, this exporter reads {VERSION}")
    if header_size != HEADER_SIZE or not HEADER_SIZE <= used <= size or size % 8:
        raise BadFile("garbage", f"inconsistent header (header {header_size}, used {used}, size {size})")
    if used > len(data):
        raise BadFile("truncated", f"header says {used} bytes are in use, the file has {len(data)}")
    return used, pid, ticks, instance, dropped


def parse(data: bytes) -> Parsed:
    """Parse a whole spool file (``data`` at least up to its ``used`` offset).

    Records are checked one by one; at the first one that makes no sense parsing stops, keeps what
    came before and sets ``bad_record`` (a file is never trusted past garbage).
    """
    used, pid, ticks, instance, dropped = parse_header(data)
    parsed = Parsed(pid, ticks, instance, dropped)
    view = memoryview(data)
    offset = HEADER_SIZE
    while offset < used:
        if offset + RECORD_HEAD.size > used:
            parsed.bad_record = True
            break
        size, kind, key_len = RECORD_HEAD.unpack_from(data, offset)
        payload = offset + RECORD_HEAD.size + _pad8(key_len)
        if (size % 8 or size < RECORD_HEAD.size or size > MAX_RECORD_BYTES or offset + size > used
                or kind not in KINDS or key_len > MAX_KEY_BYTES or payload > offset + size):
            parsed.bad_record = True
            break
        try:
            key = bytes(view[offset + RECORD_HEAD.size : offset + RECORD_HEAD.size + key_len]).decode("utf-8")
            _parse_record(parsed, kind, key, view[payload : offset + size])
        except (ValueError, struct.error):
            parsed.bad_record = True
            break
        offset += size
    return parsed


def _parse_record(parsed: Parsed, kind: int, key: str, payload: memoryview) -> None:
    if kind == KIND_INFO:
        cuda, major, minor, ino, size, mtime_ns, load_time, n_path, n_uuid, n_runtime = INFO_STRUCT.unpack_from(payload)
        start = INFO_STRUCT.size
        if start + n_path + n_uuid + n_runtime > len(payload):
            raise ValueError("INFO strings overrun the record")
        text = bytes(payload[start : start + n_path + n_uuid + n_runtime])
        parsed.infos[key] = EngineInfo(
            text[:n_path].decode("utf-8", "replace"), cuda, text[n_path : n_path + n_uuid].decode("utf-8", "replace"),
            text[n_path + n_uuid :].decode("utf-8", "replace"), (major, minor), ino, size, mtime_ns, load_time)
        return
    values = typing.cast("list[float]", payload.cast("d").tolist())  # typeshed says list[int]
    # What the library never writes, and what would break the exposition or the merged totals: NaN or
    # infinity, a negative value (a counter that went down reads as a reset), one past 2**53 (where
    # doubles stop counting by ones; a sum of such values over many files could overflow).
    if values and (not math.isfinite(sum(values)) or min(values) < 0 or max(values) > MAX_VALUE):
        raise ValueError("value out of range in a record")
    if kind == KIND_ENGINE:
        if len(values) < ENGINE_LAYOUT.size or not key:
            raise ValueError("short ENGINE record")
        if not all(map(float.is_integer, (values[index] for index in BUCKET_SLOTS))):
            raise ValueError("a histogram bucket that is not a whole count")
        parsed.engines[key] = values[: ENGINE_LAYOUT.size]
        return
    if kind == KIND_LOAD:
        _parse_load(parsed, key, values)
        return
    engine, _, label = key.partition("\0")
    if not engine or not label:
        raise ValueError("record key without engine and label")
    if kind == KIND_ERROR and values:
        parsed.errors[(engine, label)] = values[0]
    elif kind == KIND_LAYER and len(values) >= 2:
        parsed.layers[(engine, label)] = values[:2]
    else:
        raise ValueError("short record")


def _parse_load(parsed: Parsed, key: str, values: list[float]) -> None:
    engine, uuid, dev = key.split("\0") if key.count("\0") == 2 else ("", "", "")
    major, colon, minor = dev.partition(":")
    whole = (major + minor).isascii() and major.isdigit() and minor.isdigit()
    if not engine or not colon or not whole or len(values) < len(LOAD_SLOTS):
        raise ValueError("bad LOAD record")
    parsed.loads[(engine, uuid, (int(major), int(minor)))] = values[: len(LOAD_SLOTS)]


def _max_into(previous: list[float], current: list[float], monotonic: int) -> list[float]:
    """``current`` with each of its first ``monotonic`` slots raised to at least its previous value.

    A counter slot cannot really go down (the writer only adds), but a read racing a store on a CPU
    or kernel copy routine that does not move 8 bytes at once could see a torn double; clamping keeps
    such a read from ever looking like a counter reset.  The check runs at C speed; the fix-up loop
    only when something did go down.
    """
    if any(map(operator.lt, current[:monotonic], previous[:monotonic])):
        for index in range(monotonic):
            if current[index] < previous[index]:
                current[index] = previous[index]
    return current


@dataclass
class FileState:
    """What the reader remembers of one live writer's file."""

    name: str
    ino: int
    raw: bytes = b""
    parsed: Parsed | None = None
    bad_reported: bool = False


@dataclass
class Totals:
    """Everything merged: live files plus the folded totals of exited processes."""

    engines: dict[str, list[float]] = field(default_factory=dict)
    errors: dict[tuple[str, str], float] = field(default_factory=dict)
    layers: dict[tuple[str, str], list[float]] = field(default_factory=dict)
    # live processes only; one entry per distinct (path, GPU, runtime, file identity), the latest load
    infos: dict[str, list[EngineInfo]] = field(default_factory=dict)
    processes: dict[str, int] = field(default_factory=dict)  # engine -> live processes reporting it
    # (engine, GPU uuid) -> PER_GPU_LAYOUT vector: live processes merged per GPU, plus folded totals
    per_gpu: dict[tuple[str, str], list[float]] = field(default_factory=dict)
    # loads in progress of live processes: (engine, GPU uuid, st_dev) -> LOAD_SLOTS (counts and bytes
    # summed, the oldest start time the smallest)
    loads: dict[LoadKey, list[float]] = field(default_factory=dict)
    last_load: dict[str, float] = field(default_factory=dict)
    live_files: int = 0
    dropped_by_writers: int = 0


class SpoolReader:
    """Merges a spool directory; keeps the folded totals of exited processes for as long as it runs.

    ``read()`` costs one directory listing plus, per live file, open + pread + flock probe + close;
    a file whose bytes did not change since the last read is not parsed again.  A dead file costs
    that once: it is folded, then deleted (or tombstoned) and never opened again.
    """

    def __init__(self, directory: str, max_folded_engines: int = 4096, remove_dead: bool = True,
                 gpu_of: Callable[[int, int], str | None] | None = None) -> None:
        self.directory = directory
        # The GPU of a live writer (pid, start ticks) that did not record one: the exporter asks NVML.
        self.gpu_of = gpu_of
        # A tool (gpuio engines) reads without removing: the exporter must still fold what it finds.
        self.remove_dead = remove_dead
        self.max_folded_engines = max_folded_engines
        self.errors: dict[str, int] = {}
        self.folded_processes = 0
        self.forgotten_engines = 0
        self._live: dict[str, FileState] = {}
        self._tombstones: set[str] = set()
        self._bad: dict[str, tuple[int, int, int]] = {}  # name -> (ino, size, mtime_ns) counted as bad
        self._folded = Totals()
        self._folded_touched: dict[str, float] = {}
        self._folded_per_gpu: dict[tuple[str, str], list[float]] = {}
        self._gpu_seen: dict[tuple[int, str], str] = {}  # (writer instance, engine) -> GPU at the last read
        self._per_gpu_pruned_at = 0
        self._lock = threading.Lock()  # a scrape and a tool may read at the same time

    # --- the directory -------------------------------------------------------------------------

    def read(self) -> Totals:
        with self._lock:
            names = self._list()
            if names is None:
                return self._merge()
            for name in list(self._live):
                if name not in names:
                    self._vanished(name)
            for name in names:
                if name not in self._tombstones:
                    self._visit(name)
            self._tombstones &= names  # forget tombstones of files someone else removed
            return self._merge()

    def _list(self) -> set[str] | None:
        try:
            with os.scandir(self.directory) as entries:
                names = set()
                for entry in entries:
                    if entry.name.endswith(SUFFIX) and not entry.name.startswith("."):
                        names.add(entry.name)
                    elif entry.name.startswith(f".{PREFIX}") and entry.name.endswith(".tmp"):
                        self._sweep_temporary(entry.name)
                return names
        except FileNotFoundError:
            return None
        except OSError:
            self._count("io")
            return None

    def _sweep_temporary(self, name: str) -> None:
        """A writer that died between creating its file and renaming it leaves a dot-file: remove it."""
        path = os.path.join(self.directory, name)
        with self._opened(path) as fd:
            if (fd is not None and self.remove_dead and time.time() - os.fstat(fd).st_mtime > 60
                    and self._writer_gone(fd)):
                with contextlib.suppress(OSError):
                    os.unlink(path)

    @contextlib.contextmanager
    def _opened(self, path: str) -> Iterator[int | None]:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError:
            yield None
            return
        try:
            yield fd
        finally:
            os.close(fd)

    @staticmethod
    def _writer_gone(fd: int) -> bool:
        """Probe the writer's lock: granted means no process holds it, so the writer has exited."""
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                return False
            raise
        return True

    def _visit(self, name: str) -> None:
        path = os.path.join(self.directory, name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except FileNotFoundError:
            if name in self._live:
                self._vanished(name)
            return
        except OSError:
            self._count_bad(name, (0, 0, 0), "io")
            return
        try:
            self._visit_open(name, path, fd)
        finally:
            os.close(fd)  # also drops the lock the probe may have taken

    def _visit_open(self, name: str, path: str, fd: int) -> None:
        st = os.fstat(fd)
        state = self._live.get(name)
        if state is not None and state.ino != st.st_ino:  # replaced under the same name: treat as new
            self._vanished(name)
            state = None
        identity = (st.st_ino, st.st_size, st.st_mtime_ns)
        if state is None and self._bad.get(name) == identity:
            return  # known bad and unchanged: counted once already
        if not stat.S_ISREG(st.st_mode) or st.st_size > 1 << 30:
            self._count_bad(name, identity, "garbage")
            return
        try:
            gone = self._writer_gone(fd)
        except OSError:
            gone = False
        data = self._read(fd, state.raw if state else b"")
        if data is None:
            self._count_bad(name, identity, "io")
            return
        if state is None:
            state = FileState(name, st.st_ino)
        parsed = self._parse(state, data, name, identity)
        if parsed is None:
            # Never understood: not ours to fold or delete (a foreign version's file, garbage); it stays,
            # counted once.  Understood before and broken now (truncated by someone): its last good
            # content is what we fold once the writer is gone.
            if state.parsed is not None:
                if gone:
                    self._fold_dead(name, path, state)
                else:
                    self._live[name] = state
            return
        if gone:
            self._fold_dead(name, path, state)
        else:
            self._live[name] = state

    def _parse(self, state: FileState, data: bytes, name: str, identity: tuple[int, int, int]) -> Parsed | None:
        if data == state.raw and state.parsed is not None:
            return state.parsed
        try:
            parsed = parse(data)
        except BadFile as exc:
            if state.parsed is None:
                self._count_bad(name, identity, exc.reason)
            elif not state.bad_reported:  # was fine, now is not (truncated by someone): keep the last good
                state.bad_reported = True
                self._count("truncated" if exc.reason in ("empty", "truncated") else exc.reason)
            return None
        if parsed.bad_record and not state.bad_reported:
            state.bad_reported = True
            self._count("record")
        if state.parsed is not None:
            _clamp(state.parsed, parsed)
        state.raw = data
        state.parsed = parsed
        return parsed

    @staticmethod
    def _read(fd: int, previous: bytes) -> bytes | None:
        """The file up to its ``used`` offset: usually one pread (sized by the last read)."""
        hint = max(len(previous), 4096)
        try:
            data = os.pread(fd, hint, 0)
            if len(data) >= USED_OFFSET + 8:
                used = struct.unpack_from("<Q", data, USED_OFFSET)[0]
                if len(data) < used <= 1 << 30:
                    data += os.pread(fd, used - len(data), len(data))
                if used <= len(data):
                    data = data[:used] if used >= HEADER_SIZE else data
        except OSError:
            return None
        return data

    # --- folding -----------------------------------------------------------------------------

    def _fold_dead(self, name: str, path: str, state: FileState) -> None:
        """The writer is gone: fold its final totals, then remove the file (or tombstone it)."""
        self._live.pop(name, None)
        if state.parsed is not None:
            self._fold(state.parsed)
        self.folded_processes += 1
        if not self.remove_dead:
            self._tombstones.add(name)
            return
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError:
            self._tombstones.add(name)

    def _vanished(self, name: str) -> None:
        """A live file disappeared without us folding it (another reader, a wiped emptyDir):
        fold what we last saw, so no counter goes backwards."""
        state = self._live.pop(name)
        self._count("vanished")
        if state.parsed is not None:
            self._fold(state.parsed)
        self.folded_processes += 1

    def _fold(self, parsed: Parsed) -> None:
        folded = self._folded
        now = time.monotonic()
        for engine, values in parsed.engines.items():
            total = folded.engines.get(engine)
            kept = list(values)
            for index in ENGINE_LAYOUT.gauges.values():
                kept[index] = 0.0  # a dead process has nothing in flight and no pool
            folded.engines[engine] = kept if total is None else list(map(operator.add, total, kept))
            self._folded_touched[engine] = now
        for key, count in parsed.errors.items():
            folded.errors[key] = folded.errors.get(key, 0.0) + count
        for key, pair in parsed.layers.items():
            old = folded.layers.get(key, [0.0, 0.0])
            folded.layers[key] = [old[0] + pair[0], old[1] + pair[1]]
        for engine, info in parsed.infos.items():
            if info.load_time > 0:  # 0: loading, never finished a load
                folded.last_load[engine] = max(folded.last_load.get(engine, 0.0), info.load_time)
        folded.dropped_by_writers += parsed.dropped
        self._bound_folded()
        self._fold_per_gpu(parsed)

    def _bound_folded(self) -> None:
        """Folded totals are kept while the exporter runs, up to a cap: past it, the engines folded
        longest ago are forgotten (counted), so endless distinct names cannot grow memory forever."""
        excess = len(self._folded.engines) - self.max_folded_engines
        if excess <= 0:
            return
        for engine in sorted(self._folded_touched, key=self._folded_touched.__getitem__)[:excess]:
            self._folded_touched.pop(engine)
            self._folded.engines.pop(engine, None)
            self._folded.last_load.pop(engine, None)
            for table in (self._folded.errors, self._folded.layers):
                for key in [k for k in table if k[0] == engine]:
                    del table[key]
            self.forgotten_engines += 1

    # --- errors ------------------------------------------------------------------------------

    def _count(self, reason: str) -> None:
        self.errors[reason] = self.errors.get(reason, 0) + 1

    def _count_bad(self, name: str, identity: tuple[int, int, int], reason: str) -> None:
        if self._bad.get(name) == identity:
            return
        if len(self._bad) > 10_000:
            self._bad.clear()
        self._bad[name] = identity
        self._count(reason)

    # --- merging -----------------------------------------------------------------------------

    def _merge(self) -> Totals:
        folded = self._folded
        totals = Totals(
            engines={engine: list(values) for engine, values in folded.engines.items()},
            errors=dict(folded.errors),
            layers={key: list(pair) for key, pair in folded.layers.items()},
            last_load=dict(folded.last_load),
            dropped_by_writers=folded.dropped_by_writers,
        )
        distinct: dict[tuple[str, str, int, str, str, tuple[int, int], int], EngineInfo] = {}
        for state in self._live.values():
            parsed = state.parsed
            if parsed is None:
                continue
            totals.live_files += 1
            totals.dropped_by_writers += parsed.dropped
            for engine, values in parsed.engines.items():
                total = totals.engines.get(engine)
                totals.engines[engine] = list(values) if total is None else list(map(operator.add, total, values))
                totals.processes[engine] = totals.processes.get(engine, 0) + 1
            for key, count in parsed.errors.items():
                totals.errors[key] = totals.errors.get(key, 0.0) + count
            for key, pair in parsed.layers.items():
                old = totals.layers.get(key)
                totals.layers[key] = list(pair) if old is None else [old[0] + pair[0], old[1] + pair[1]]
            for engine, info in parsed.infos.items():
                found = self.gpu_of(parsed.pid, parsed.start_ticks) if not info.gpu_uuid and self.gpu_of else None
                if found:
                    info = dataclasses.replace(info, gpu_uuid=found)
                identity = (engine, info.path, info.cuda_device, info.gpu_uuid, info.runtime, info.dev, info.ino)
                seen = distinct.get(identity)
                if seen is None or seen.load_time < info.load_time:
                    distinct[identity] = info
                if info.load_time > 0:  # 0: loading, never finished a load
                    totals.last_load[engine] = max(totals.last_load.get(engine, 0.0), info.load_time)
        for identity, info in distinct.items():
            totals.infos.setdefault(identity[0], []).append(info)
        self._merge_per_gpu_and_loads(totals)
        return totals

    # --- per engine and GPU; loads in progress ----------------------------------------------------

    def _gpu_of_writer(self, parsed: Parsed, recorded: str) -> str:
        """The GPU a live writer works on for ``engine``: what it recorded, else what NVML lists it on."""
        if recorded or self.gpu_of is None:
            return recorded
        return self.gpu_of(parsed.pid, parsed.start_ticks) or ""

    def _merge_per_gpu_and_loads(self, totals: Totals) -> None:
        """Per (engine, GPU): the live writers' per-GPU slots plus the folded ones; and the loads in
        progress of live writers (a dead writer's loads are over, whatever its file says)."""
        # Grouped first, summed once per (engine, GPU) at C speed: a scrape of 1,000 writers pays one
        # tuple per writer and engine here, not one list addition.
        groups: dict[tuple[str, str], list[typing.Sequence[float]]] = {
            key: [values] for key, values in self._folded_per_gpu.items()}
        seen: dict[tuple[int, str], str] = {}  # only GPUs NVML gave: a recorded one is in the file itself
        for state in self._live.values():
            parsed = state.parsed
            if parsed is None:
                continue
            infos = parsed.infos
            for engine, values in parsed.engines.items():
                info = infos.get(engine)
                uuid = info.gpu_uuid if info is not None else ""
                if not uuid and self.gpu_of is not None:
                    uuid = seen[(parsed.instance, engine)] = self.gpu_of(parsed.pid, parsed.start_ticks) or ""
                group = groups.get((engine, uuid))
                if group is None:
                    groups[(engine, uuid)] = [_per_gpu_values(values)]
                else:
                    group.append(_per_gpu_values(values))
            if parsed.loads:
                for (engine, uuid, dev), values in parsed.loads.items():
                    _merge_load(totals.loads, (engine, self._gpu_of_writer(parsed, uuid), dev), values)
        self._gpu_seen = seen
        totals.per_gpu = {key: list(group[0]) if len(group) == 1 else list(map(sum, zip(*group, strict=True)))
                          for key, group in groups.items()}

    def _fold_per_gpu(self, parsed: Parsed) -> None:
        """An exited writer's per-GPU counts stay under the GPU it had while alive (gauges zeroed).
        Bounded: past max_folded_engines * 4 keys, new GPUs of an engine fold into its "" series, and
        engines forgotten by the engine cap are forgotten here too."""
        folded = self._folded_per_gpu
        for engine, values in parsed.engines.items():
            info = parsed.infos.get(engine)
            uuid = (info.gpu_uuid if info else "") or self._gpu_seen.get((parsed.instance, engine), "")
            if (engine, uuid) not in folded and len(folded) >= self.max_folded_engines * 4:
                uuid = ""
            kept = list(_per_gpu_values(values))
            for index in PER_GPU_LAYOUT.gauges.values():
                kept[index] = 0.0
            _add_into(folded, (engine, uuid), kept)
        if self._per_gpu_pruned_at != self.forgotten_engines:
            self._per_gpu_pruned_at = self.forgotten_engines
            for key in [key for key in folded if key[0] not in self._folded.engines]:
                del folded[key]


def _add_into(table: dict[tuple[str, str], list[float]], key: tuple[str, str], values: typing.Sequence[float]) -> None:
    total = table.get(key)
    table[key] = list(values) if total is None else list(map(operator.add, total, values))


def _merge_load(table: dict[LoadKey, list[float]], key: LoadKey, values: list[float]) -> None:
    """Loads of several writers: counts and bytes add up, the oldest start is the earliest (a slot
    read while its writer was between stores may say loads with no start yet: 0, ignored)."""
    in_progress, read_bytes, oldest = values
    merged = table.get(key)
    if merged is None:
        table[key] = [in_progress, read_bytes, oldest if in_progress > 0 else 0.0]
        return
    merged[0] += in_progress
    merged[1] += read_bytes
    if in_progress > 0 and oldest > 0 and (merged[2] <= 0 or oldest < merged[2]):
        merged[2] = oldest


def _clamp(previous: Parsed, current: Parsed) -> None:
    for engine, values in current.engines.items():
        before = previous.engines.get(engine)
        if before is not None:
            _max_into(before, values, ENGINE_LAYOUT.monotonic_prefix)
    for key, count in current.errors.items():
        current.errors[key] = max(count, previous.errors.get(key, 0.0))
    for key, pair in current.layers.items():
        before_pair = previous.layers.get(key)
        if before_pair is not None:
            _max_into(before_pair, pair, 2)
