"""The exporter's side of the spool: read every writer's file, fold the exited ones, merge the rest.

The file format and the writer live in the instrumentation library (:mod:`gpuio.spool`),
which inference processes import; this module is what only the exporter (and ``gpuio engines``)
runs: parsing a file no one trusts, the bounded directory read, folding the totals of exited
processes, and merging everything per engine, per engine and GPU, and per load in progress.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import errno
import fcntl
import hashlib
import math
import operator
import os
import random
import resource
import stat
import struct
import threading
import time
import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from gpuio.spool import (
    DEFAULT_FILE_BYTES,
    ENGINE_LAYOUT,
    ENGINE_SERIES,
    GAUGES,
    GENERATION_OFFSET,
    HEADER,
    HEADER_SIZE,
    INFO_STRUCT,
    KIND_ENGINE,
    KIND_ERROR,
    KIND_INFO,
    KIND_LAYER,
    KIND_LOAD,
    KIND_MOUNT,
    KIND_POD,
    KIND_WATERFALL,
    KINDS,
    LOAD_SLOTS,
    MAGIC,
    MAX_KEY_BYTES,
    MAX_PATH_BYTES,
    MAX_POD_NAME_BYTES,
    MAX_RECORD_BYTES,
    MAX_SHORT_BYTES,
    MOUNT_STRUCT,
    POD_STRUCT,
    PREFIX,
    RECORD_HEAD,
    SUFFIX,
    USED_OFFSET,
    VERSION,
    WATERFALL,
    WATERFALL_COUNTERS,
    WATERFALL_SLOTS,
    Layout,
    pad8,
)

from . import procstat

# What the reader keeps per engine *and GPU* (the rest is per engine): the series that say whether work
# waits on one GPU.  A compact vector of these ENGINE slots, in this order; PER_GPU_LAYOUT indexes it.
PER_GPU_HISTOGRAMS = tuple(series.slot for series in ENGINE_SERIES if series.per_gpu and series.type == "histogram")


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
_bucket_values = operator.itemgetter(*BUCKET_SLOTS)  # at C speed: a scrape of 1,000 changed files checks 141,000
MAX_VALUE = 2.0**53


def histogram_count_and_sum(values: typing.Sequence[float], name: str) -> tuple[float, float]:
    """An ENGINE vector's histogram ``name``: how many observations, and their sum."""
    first, sum_index, _ = ENGINE_LAYOUT.histograms[name]
    return sum(values[first:sum_index]), values[sum_index]


def counter(values: typing.Sequence[float], name: str) -> float:
    """An ENGINE vector's counter ``name``."""
    return values[ENGINE_LAYOUT.counters[name]]


class WriterGpus:
    """The GPU NVML lists a spool writer on, for a writer that recorded none: pid -> GPU, one way.

    ``gpu_of_process`` is what the nvml collector last saw ((pid, start ticks) -> GPU UUID, the start
    time read from this exporter's procfs at its sweep).  A pid counts only when this exporter's procfs
    shows that very process now as well (same start time): a writer in another pid namespace (a pod
    without hostPID) has a pid that means another process here, or none, and NVML reports host pids.
    """

    def __init__(self, gpu_of_process: Callable[[int, int], str | None], procfs: str = "/proc") -> None:
        self.gpu_of_process = gpu_of_process
        self.procfs = procfs
        self._same_process: dict[tuple[int, int], bool] = {}  # (pid, start ticks) -> our /proc shows it

    def __call__(self, pid: int, start_ticks: int) -> str | None:
        uuid = self.gpu_of_process(pid, start_ticks)
        if uuid is None:
            return None
        return uuid if self.same_process(pid, start_ticks) else None

    def same_process(self, pid: int, start_ticks: int) -> bool:
        """Whether this exporter's procfs shows the writer itself under ``pid`` (same start time)."""
        if start_ticks <= 0:
            return False
        key = (pid, start_ticks)
        same = self._same_process.get(key)
        if same is None:
            if len(self._same_process) > 4096:
                self._same_process.clear()
            same = self._same_process[key] = procstat.start_ticks(pid, self.procfs) == start_ticks
        return same


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
# What makes two INFO records one engine file: engine, path, CUDA device, GPU uuid, runtime, st_dev, inode.
InfoIdentity = tuple[str, str, int, str, str, tuple[int, int], int]
MountKey = tuple[str, tuple[int, int]]  # engine, st_dev of its file


@dataclass(frozen=True)
class WriterMount:
    """A writer's own mountinfo line for its engine file's st_dev (its word: untrusted)."""

    mountpoint: str
    fstype: str
    source: str
    layer: str  # overlayfs: a layer directory, a path of the host's filesystem


MAX_MOUNTS_PER_ENGINE = 4


@dataclass(frozen=True)
class PodIdentity:
    """The pod a spool writer runs in.  ``pod_uid`` is the kubelet's where the exporter found the file in
    that pod's volume (the path says it); otherwise, like the names, what the writer recorded (its
    Downward API environment and cgroup): a claim, shown as such."""

    namespace: str = ""
    pod: str = ""
    container: str = ""
    pod_uid: str = ""


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
    waterfalls: dict[str, list[float]] = field(default_factory=dict)  # WATERFALL records by engine
    mounts: dict[MountKey, WriterMount] = field(default_factory=dict)
    pod: PodIdentity | None = None  # the POD record, where the writer made one
    unknown_records: int = 0  # well-framed records of kinds this reader does not know (a newer library)
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
        payload = offset + RECORD_HEAD.size + pad8(key_len)
        if (size % 8 or size < RECORD_HEAD.size or size > MAX_RECORD_BYTES or offset + size > used
                or kind == 0 or key_len > MAX_KEY_BYTES or payload > offset + size):
            parsed.bad_record = True
            break
        if kind not in KINDS:
            # A kind of a newer library, well framed: skipped, so that a library upgraded before the
            # exporter costs only what the exporter cannot show yet, not the records after it.
            parsed.unknown_records += 1
            offset += size
            continue
        try:
            key = bytes(view[offset + RECORD_HEAD.size : offset + RECORD_HEAD.size + key_len]).decode("utf-8")
            _parse_record(parsed, kind, key, view[payload : offset + size])
        except (ValueError, struct.error):
            parsed.bad_record = True
            break
        offset += size
    return parsed


# The longest strings the library writes: namespace, pod, container, UID; mount point, fstype, source, layer.
POD_LIMITS = (MAX_POD_NAME_BYTES, MAX_POD_NAME_BYTES, MAX_POD_NAME_BYTES, MAX_SHORT_BYTES)
MOUNT_LIMITS = (MAX_PATH_BYTES, MAX_SHORT_BYTES, MAX_PATH_BYTES, MAX_PATH_BYTES)


def _parse_mount(parsed: Parsed, key: str, payload: memoryview) -> None:
    engine, _, dev = key.partition("\0")
    major, colon, minor = dev.partition(":")
    if not engine or not colon or not (major + minor).isascii() or not major.isdigit() or not minor.isdigit():
        raise ValueError("bad MOUNT key")
    lengths = MOUNT_STRUCT.unpack_from(payload)
    if MOUNT_STRUCT.size + sum(lengths) > len(payload):
        raise ValueError("MOUNT strings overrun the record")
    if any(length > limit for length, limit in zip(lengths, MOUNT_LIMITS, strict=True)):
        raise ValueError("MOUNT string longer than the library writes")
    text, start, parts = bytes(payload), MOUNT_STRUCT.size, []
    for length in lengths:
        parts.append(text[start : start + length].decode("utf-8", "replace"))
        start += length
    parsed.mounts[(engine, (int(major), int(minor)))] = WriterMount(*parts)


def _parse_pod(parsed: Parsed, payload: memoryview) -> None:
    lengths = POD_STRUCT.unpack_from(payload)
    if POD_STRUCT.size + sum(lengths) > len(payload):
        raise ValueError("POD strings overrun the record")
    # Label values of every series of the writer's engines: never longer than the library writes them
    # (what Kubernetes allows), or one record of 64 KiB names makes each of those series 64 KiB.
    if any(length > limit for length, limit in zip(lengths, POD_LIMITS, strict=True)):
        raise ValueError("POD string longer than Kubernetes allows")
    text, offset = bytes(payload[POD_STRUCT.size :]), 0
    values = []
    for length in lengths:
        values.append(text[offset : offset + length].decode("utf-8", "replace"))
        offset += length
    parsed.pod = PodIdentity(*values)


def _parse_record(parsed: Parsed, kind: int, key: str, payload: memoryview) -> None:
    if kind == KIND_MOUNT:
        _parse_mount(parsed, key, payload)
        return
    if kind == KIND_POD:
        _parse_pod(parsed, payload)
        return
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
        if not all(map(float.is_integer, _bucket_values(values))):
            raise ValueError("a histogram bucket that is not a whole count")
        parsed.engines[key] = values[: ENGINE_LAYOUT.size]
        return
    if kind == KIND_LOAD:
        _parse_load(parsed, key, values)
        return
    if kind == KIND_WATERFALL:
        if len(values) < len(WATERFALL_SLOTS) or not key:
            raise ValueError("short WATERFALL record")
        values = values[: len(WATERFALL_SLOTS)]
        if values[0] != values[-1]:  # copied mid-update: no last load from this copy (_clamp keeps the last good)
            values[len(WATERFALL_COUNTERS) : -1] = [0.0] * (len(values) - 1 - len(WATERFALL_COUNTERS))
        parsed.waterfalls[key] = values
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
    numbers = (procstat.whole_number(major), procstat.whole_number(minor))
    if not engine or not colon or numbers[0] is None or numbers[1] is None or len(values) < len(LOAD_SLOTS):
        raise ValueError("bad LOAD record")
    parsed.loads[(engine, uuid, (numbers[0], numbers[1]))] = values[: len(LOAD_SLOTS)]


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

    # Which file: its inode (another one under the same name is a new file), its owner (the writer,
    # whose view of engine files the exporter checks), the pod whose volume holds it ("" for the
    # node's spool directory: the file's path says it, the writer cannot choose it).
    ino: int
    uid: int = -1
    pod_uid: str = ""
    # What it said at its last full read.  ``digest``: of the bytes ``parsed`` came from (unchanged
    # bytes are not parsed again); ``used``: how many (the reader's memory budget counts them).
    parsed: Parsed | None = None
    digest: bytes = b""
    used: int = 0
    needs_gpu: bool = False  # ``parsed`` has series without a GPU: the merge asks ``gpu_of`` for this writer
    bad_reported: bool = False  # damaged since it was understood: counted once
    # Whether it changed since, cheaply (see SpoolReader._unchanged): a descriptor kept open between
    # reads (up to a cap), the inode the directory listing gave when it was opened (the name still lists
    # it, so the name still means this file; compared with the listing's, which on overlayfs is not
    # always st_ino), the header ``parsed`` came with (the same header again means nothing changed) and
    # when to read the whole file even so (monotonic seconds).
    fd: int | None = None
    listed_ino: int | None = None
    header: bytes = b""
    recheck_at: float = 0.0
    # The pids the kernel's lock table shows holding its lock: which process the header may truthfully
    # name as its writer (None: not known yet, looked up at the next full read).
    lockers: frozenset[int] | None = None


@dataclass
class Totals:
    """Everything merged: live files plus the folded totals of exited processes."""

    engines: dict[str, list[float]] = field(default_factory=dict)
    errors: dict[tuple[str, str], float] = field(default_factory=dict)
    layers: dict[tuple[str, str], list[float]] = field(default_factory=dict)
    # live processes only; one entry per distinct (path, GPU, runtime, file identity), the latest load
    infos: dict[str, list[EngineInfo]] = field(default_factory=dict)
    processes: dict[str, int] = field(default_factory=dict)  # engine -> live processes reporting it
    writers: dict[str, list[tuple[int, int]]] = field(default_factory=dict)  # engine -> (pid, start ticks) live
    # (engine, GPU uuid) -> PER_GPU_LAYOUT vector: live processes merged per GPU, plus folded totals
    per_gpu: dict[tuple[str, str], list[float]] = field(default_factory=dict)
    # loads in progress of live processes: (engine, GPU uuid, st_dev) -> LOAD_SLOTS (counts and bytes
    # summed, the oldest start time the smallest)
    loads: dict[LoadKey, list[float]] = field(default_factory=dict)
    last_load: dict[str, float] = field(default_factory=dict)
    # engine -> WATERFALL vector: counters summed over live and exited writers, the last-load slots of
    # the latest load among them
    waterfalls: dict[str, list[float]] = field(default_factory=dict)
    mounts: dict[MountKey, WriterMount] = field(default_factory=dict)  # live writers', per engine capped
    live_files: int = 0
    dropped_by_writers: int = 0
    # (engine, path) -> owners (uids) of the live files whose INFO names that path: the exporter opens an
    # engine file only where one of them could have read it (collectors/engines.py)
    info_uids: dict[tuple[str, str], set[int]] = field(default_factory=dict)
    deferred_files: int = 0  # files left for a later scrape: this one's read budget was spent
    unfinished_listings: int = 0  # directories whose listing goes on at the next scrapes (DirectoryScan)
    # (engine, GPU uuid) -> the pods of the live writers reporting it (PodIdentity of each file)
    pods: dict[tuple[str, str], set[PodIdentity]] = field(default_factory=dict)
    # (engine, GPU uuid) -> loads that were in progress when their writer exited (folded only): a process
    # killed while loading (a startup probe, OOM) never finishes its load, and a crash-looping cold start
    # is one such load per attempt.  The evidence that survives the processes (docs/engines.md).
    abandoned: dict[tuple[str, str], float] = field(default_factory=dict)


# What one reader may spend.  A spool writer is untrusted input: it chooses how big its file claims to
# be, how much of it is "used", how many files it makes and how often it changes them.
# Directory entries looked at per read (spool files or not): a directory of millions of names is walked
# a slice per read, each read going on where the last one stopped (see DirectoryScan), so that a read
# costs the same bounded time however many names a writer makes, and every name gets its turn.
MAX_SCANNED_ENTRIES = 65_536  # of the node's spool directory
# Of the pods' own spool volumes, together, shared evenly among them and at most MAX_POD_DIRECTORY_ENTRIES
# each: a pod that fills its volume with files cannot take the listing from the other pods (a real pod
# has a few processes, one file each).
POD_SCANNED_ENTRIES = 65_536
MAX_POD_DIRECTORY_ENTRIES = 1024
MIN_POD_DIRECTORY_ENTRIES = 64
# Bad files remembered (name and inode: ~150 bytes each), so that each is counted once and not opened
# again; a listing walked a slice per read reaches every name, so without a cap junk names would be.
MAX_BAD_REMEMBERED = 65_536
# Leftover temporary files (a writer that died before renaming its file) opened per read to see whether
# they may be removed: each costs an open and a lock probe, and a writer can make any number of them.
MAX_SWEPT_TEMPORARY = 32
SCRAPE_READ_BYTES = 16 << 20  # bytes read from spool files per read()
SCRAPE_PARSE_BYTES = 4 << 20  # bytes of changed content parsed per read() (~35 ms per MiB here)
RETAINED_BYTES = 8 << 20  # bytes of live files whose parsed content the reader keeps (~4x in Python objects)
# A real process's file holds a few engines: a few KiB.  Files above this may take only half of
# RETAINED_BYTES, so a few big files cannot keep the small ones out.
SMALL_FILE_BYTES = 64 << 10
# Live files whose descriptors stay open between reads; the others are opened on every read, as a new
# file is.  Only from what the open-file limit leaves above FD_ROOM (the server's connections, up to
# 512, and everything else the exporter opens), and half of that: a low limit keeps none.
MAX_KEPT_FILES = 4096
FD_ROOM = 1024
# A file whose header says nothing changed is still read whole this often (give or take a quarter, so
# that files first seen together do not all come due on one scrape): a writer's word is trusted for
# its own series only, and never for longer than this.
RECHECK_SECONDS = 60.0
_GENERATION = struct.Struct("<d")


def _libc_flock() -> Callable[[int, int], int] | None:
    """libc's flock, called directly: a refused probe then costs a return value, where fcntl.flock
    raises an OSError (about half of what a scrape of unchanged files spends per file)."""
    try:
        flock = ctypes.CDLL(None, use_errno=True).flock
    except (OSError, AttributeError):
        return None
    flock.argtypes, flock.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return typing.cast("Callable[[int, int], int]", flock)


_FLOCK = _libc_flock()
_PROBE = fcntl.LOCK_EX | fcntl.LOCK_NB


def _kept_files_cap() -> int:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return MAX_KEPT_FILES if soft == resource.RLIM_INFINITY else max(0, min(MAX_KEPT_FILES, (soft - FD_ROOM) // 2))


class DirectoryScan:
    """One directory's listing, walked a slice per read(): at most ``budget`` entries, the next read going
    on where this one stopped (the directory stream stays open in between), so that a directory of
    millions of names costs each read the same bounded time and every name gets its turn.

    A *pass* is one walk through the whole directory, in one read or over several.  Only a finished pass
    proves that a file is gone (readdir(3) returns every entry that stays in place exactly once per
    pass); until then the files the reader remembers (live, folded, bad) that this read's slice did not
    show stand as they were.  ``seen`` keeps which of those earlier slices of the pass showed."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._stream: typing.Any = None  # os.scandir's iterator, while a pass is under way
        self.finished = False  # the last slice ended the pass
        self.seen: dict[str, int] = {}  # remembered names shown by earlier slices of this pass -> inode
        self.slice_names: list[str] = []  # the spool names of the last slice (the reader fills it in)

    def next_slice(self, budget: int) -> Iterator[os.DirEntry[str]]:
        """The next ``budget`` entries at most (OSError as os.scandir raises it; the pass then starts over)."""
        self.finished = False
        if self._stream is None:
            self._stream = os.scandir(self.path)
            self.seen = {}
        taken = 0
        try:
            for entry in self._stream:
                yield entry
                taken += 1
                if taken >= budget:
                    return
        except OSError:
            self.close()
            raise
        self.close()
        self.finished = True

    def close(self) -> None:
        if self._stream is not None:
            self._stream.close()
            self._stream = None


@dataclass
class ReadBudget:
    """What is left of one read()'s work: bytes read, bytes parsed."""

    read: int
    parse: int


class SpoolReader:
    """Merges a spool directory; keeps the folded totals of exited processes for as long as it runs.

    ``read()`` costs one directory listing plus, per live file, a flock probe and a pread of its
    header on a descriptor kept open: a writer moves the header's generation up after every change,
    so the same header means the same content (and the last merge stands when no file changed).  A
    changed file, a new one, one whose writer does not count generations and, once a minute, every
    file are read whole (open + pread + flock probe); bytes that did not change are not parsed
    again.  A dead file costs that once: it is folded, then deleted (or tombstoned) and never opened
    again.

    Bounded whatever the writers do: one read() looks at ``scan_entries`` directory entries at most (a
    bigger directory is walked over several reads, DirectoryScan); a file is read up to
    ``max_file_bytes`` at most (a bigger one is refused, ``oversized``); one read() reads at most
    SCRAPE_READ_BYTES and parses at most SCRAPE_PARSE_BYTES (files past that keep their last values
    and are read at a later call, live files first, in turn); the parsed content kept for live files
    comes from at most RETAINED_BYTES of them; a bad file is counted once for as long as it stays
    (remembered by name and inode).
    """

    def __init__(self, directory: str, max_folded_engines: int = 4096, remove_dead: bool = True,
                 gpu_of: Callable[[int, int], str | None] | None = None,
                 max_file_bytes: int = DEFAULT_FILE_BYTES, procfs: str = "/proc") -> None:
        self.directory = directory
        # Where the kernel's lock table is (<procfs>/locks): it says which process holds a file's lock, so
        # which writer a file's header may truthfully name (see _writer).
        self.procfs = procfs
        # inode -> lock holders, read at most once per read() (None: unreadable this time)
        self._lock_table: dict[int, frozenset[int]] | None = None
        self._lock_table_read = False
        # The GPU of a live writer (pid, start ticks) that did not record one: the exporter asks NVML.
        self.gpu_of = gpu_of
        # A tool (gpuio engines) reads without removing: the exporter must still fold what it finds.
        self.remove_dead = remove_dead
        self.max_folded_engines = max_folded_engines
        self.max_file_bytes = max_file_bytes
        self.scrape_read_bytes = SCRAPE_READ_BYTES
        self.scrape_parse_bytes = SCRAPE_PARSE_BYTES
        self.retained_bytes = RETAINED_BYTES
        self.recheck_seconds = RECHECK_SECONDS
        # Engines whose folded totals are never forgotten (the exporter's exported engines).
        self.protected: set[str] = set()
        self.errors: dict[str, int] = {}
        self.folded_processes = 0
        self.forgotten_engines = 0
        self.deferred_files = 0  # at the last read()
        self._live: dict[str, FileState] = {}
        self._tombstones: set[str] = set()
        # name -> inode of files counted as bad; pruned to the names still listed, never cleared
        # wholesale (that re-counted every bad file), so it is as big as the bad files present.
        self._bad: dict[str, int] = {}
        self._listed: dict[str, int] = {}  # name -> inode, from the last listing (readdir's d_ino: no stat)
        self._scans: dict[str, DirectoryScan] = {}  # directory -> its listing, a slice per read
        self.scan_entries = MAX_SCANNED_ENTRIES
        self._resume_at = ""  # the first file the last read() had no budget for: the next one starts there
        self._budget = ReadBudget(0, 0)
        self._deferred_now = 0
        self.unfinished_listings = 0  # at the last read(): directories whose pass goes on at the next
        self._sweeps_left = 0
        self._left_out_directories: set[str] = set()  # pod directories that exist but the scan left out
        self._retained = {False: 0, True: 0}
        self._folded = Totals()
        self._folded_touched: dict[str, float] = {}
        self._folded_per_gpu: dict[tuple[str, str], list[float]] = {}
        self._folded_abandoned: dict[tuple[str, str], float] = {}
        self._gpu_seen: dict[tuple[int, str], str] = {}  # (writer instance, engine) -> GPU at the last read
        self._per_gpu_pruned_at = 0
        self._lock = threading.Lock()  # a scrape and a tool may read at the same time
        self._kept_cap = _kept_files_cap()
        self._kept = 0  # descriptors held open by live FileStates
        self._now = 0.0  # time.monotonic() at the start of this read
        # Moves whenever what _merge() reads changes (a live file parsed anew, added, folded, forgotten):
        # the same version and the same GPU answers give the same merge, which is then reused.
        self._version = 0
        self._merged: tuple[tuple[object, ...], Totals] | None = None
        # Spool directories found in pods' volumes (exporter.pods.kubelet): directory -> pod UID.  Their
        # files are keyed by absolute path (the main directory's by name), read with the same budgets,
        # and never deleted (the volume is the pod's, mounted read-only): folded, then tombstoned.
        self.pod_directories: dict[str, str] = {}

    def set_pod_directories(self, directories: dict[str, str]) -> None:
        """Replace the discovered directories (directory -> pod UID); files of one no longer listed
        are folded at the next read, as files that vanished, once the directory is gone (while it
        exists, the scan only left it out: see _list)."""
        if directories != self.pod_directories:
            self._version += 1  # the files read change: the last merge may not be reused
        self.pod_directories = dict(directories)

    def close(self) -> None:
        """Close the descriptors kept open (the reader stays usable: it opens them again)."""
        with self._lock:
            for state in self._live.values():
                self._close_kept(state)
            for scan in self._scans.values():
                scan.close()
            self._scans.clear()

    def __del__(self) -> None:
        for state in getattr(self, "_live", {}).values():
            if state.fd is not None:
                with contextlib.suppress(OSError):
                    os.close(state.fd)
                state.fd = None
        for scan in getattr(self, "_scans", {}).values():
            scan.close()

    # --- the directory -------------------------------------------------------------------------

    def read(self) -> Totals:
        """Everything merged now.  The Totals may be the one an earlier read returned (nothing changed
        since): callers read it and never modify it."""
        with self._lock:
            self._now = time.monotonic()
            names = self._list()
            if names is None:
                return self._with_owners(self._merge())
            for name in list(self._live):
                if name not in names:
                    self._vanished(name)
            self._start_budgets()
            self._visit_all(names)
            self._note_seen()
            self._bound_folded()  # once per read, not per fold: a thousand folds would sort a thousand times
            return self._merged_totals()

    def _start_budgets(self) -> None:
        """This read's budgets: bytes read, bytes parsed, and the memory the parsed content of live files
        already takes (small and big files apart)."""
        self._budget = ReadBudget(self.scrape_read_bytes, self.scrape_parse_bytes)
        self._lock_table_read = False
        self._retained = {False: 0, True: 0}
        for state in self._live.values():
            self._retained[state.used > SMALL_FILE_BYTES] += state.used
        self._deferred_now = 0

    def _visit_all(self, names: set[str]) -> None:
        """Every file listed, in turn, while the budgets last: an unchanged live file settled here (a
        lock probe and a header read), everything else visited in full.  The loop a thousand idle
        writers cost: names bound once."""
        live, listed, bad, tombstones, budget = self._live, self._listed, self._bad, self._tombstones, self._budget
        unchanged, first_deferred, deferred = self._unchanged, "", 0
        for name in self._visit_order(names):
            if name in tombstones or bad.get(name, -1) == listed.get(name):
                continue  # folded already, or known bad and not replaced: not even opened
            if budget.read <= 0 or budget.parse <= 0:
                deferred += 1
                first_deferred = first_deferred or name
                continue
            known = live.get(name)
            if known is None or known.fd is None or not unchanged(name, known, known.fd):
                waiting = self._deferred_now
                self._visit(name)
                if self._deferred_now > waiting:  # too big for what was left: its turn comes first next time
                    first_deferred = first_deferred or name
        self._resume_at = first_deferred
        self.deferred_files = deferred + self._deferred_now

    def _merged_totals(self) -> Totals:
        """The merge, reused while no file changed and NVML places the writers that recorded no GPU
        where it did (the only input of the merge that is not in the files)."""
        gpus: tuple[str | None, ...] = ()
        if self.gpu_of is not None:
            gpu_of = self.gpu_of
            gpus = tuple(gpu_of(*self._writer(state, state.parsed)) for state in self._live.values()
                         if state.needs_gpu and state.parsed is not None)
        key = (self._version, gpus)
        if self._merged is None or self._merged[0] != key:
            self._merged = (key, self._with_owners(self._merge()))
        return dataclasses.replace(self._merged[1], deferred_files=self.deferred_files,
                                   unfinished_listings=self.unfinished_listings)

    def _visit_order(self, names: set[str]) -> list[str]:
        """Live files first (their values go stale when skipped), then the rest; each group in name
        order, starting at the first file the last read() had no budget left for, so all get their turn
        (a file that did not fit once goes first next time, not behind the same files again)."""
        def turn(group: list[str]) -> list[str]:
            group.sort()
            after = [name for name in group if name >= self._resume_at]
            return after + group[: len(group) - len(after)]
        return turn([n for n in names if n in self._live]) + turn([n for n in names if n not in self._live])

    def _with_owners(self, totals: Totals) -> Totals:
        """Which writers (file owners) report each engine path: the exporter opens an engine file only
        where one of them could have read it."""
        for state in self._live.values():
            if state.parsed is not None:
                for engine, info in state.parsed.infos.items():
                    totals.info_uids.setdefault((engine, info.path), set()).add(state.uid)
        totals.deferred_files = self.deferred_files
        totals.unfinished_listings = self.unfinished_listings
        return totals

    def _list(self) -> set[str] | None:
        """The spool files of this read: the main directory's (by name) and the pod directories' (by
        absolute path), each directory's next slice (see DirectoryScan) plus its live files; None when
        the main directory is missing or unreadable and no pod directory is known."""
        self.unfinished_listings = 0
        self._sweeps_left = MAX_SWEPT_TEMPORARY
        names: set[str] = set()
        listed: dict[str, int] = {}
        found = self._list_one(self.directory, "", names, listed, self.scan_entries)
        if not found and not self.pod_directories and not any(map(os.path.isabs, self._live)):
            return None  # nothing to list; a pod directory gone last has its files vanish below
        if not found:  # the main directory's files keep their last values, as they did alone
            self._carry(self.directory, names, listed)
        share = max(MIN_POD_DIRECTORY_ENTRIES, POD_SCANNED_ENTRIES // max(1, len(self.pod_directories)))
        for directory in sorted(self.pod_directories):
            if self._list_one(directory, directory, names, listed, min(MAX_POD_DIRECTORY_ENTRIES, share)) is None:
                self._carry(directory, names, listed)  # unreadable now: not proof that the pod is gone
        # A pod directory the scan no longer hands over (past --collector.engines.max-pod-spools) that
        # still exists: its pod is not gone.  Its live files are read on and its tombstones kept, so that
        # it is neither folded now nor counted a second time when the scan takes it back.
        known = {os.path.dirname(key) for key in (*self._live, *self._tombstones) if os.path.isabs(key)}
        self._left_out_directories = {directory for directory in known - self.pod_directories.keys()
                                      if _real_directory(directory)}
        for directory in sorted(self._left_out_directories):
            self._carry(directory, names, listed)
        self._forget_unread_directories()
        self._listed = listed
        return names

    def _list_one(self, directory: str, prefix: str, names: set[str], listed: dict[str, int],
                  budget: int) -> bool | None:
        """Add the spool files of one directory's next slice of at most ``budget`` entries to ``names``
        (keyed by ``prefix``/name), and its live files the slice did not show while its pass goes on;
        False when it does not exist (any file of it listed before has vanished), None when it could
        not be read."""
        scan = self._scans.get(directory)
        if scan is None:
            scan = self._scans[directory] = DirectoryScan(directory)
        taken: list[str] = []
        scan.slice_names = taken
        try:
            for entry in scan.next_slice(budget):
                name = entry.name
                if name.endswith(SUFFIX) and not name.startswith("."):
                    key = os.path.join(prefix, name) if prefix else name
                    taken.append(key)
                    names.add(key)
                    listed[key] = entry.inode()
                elif (not prefix and self._sweeps_left > 0 and name.startswith(f".{PREFIX}")
                      and name.endswith(".tmp")):  # a pod's volume is the pod's: never swept
                    self._sweeps_left -= 1
                    self._sweep_temporary(name)
        except FileNotFoundError:
            del self._scans[directory]
            return False
        except OSError:
            del self._scans[directory]
            self._count("io")
            return None
        if scan.finished:
            self._end_of_pass(scan, names, listed)
        else:
            self.unfinished_listings += 1
            self._carry(directory, names, listed)  # not reached yet this pass: as last seen
        return True

    def _end_of_pass(self, scan: DirectoryScan, names: set[str], listed: dict[str, int]) -> None:
        """A directory walked through: a file it remembers that the pass showed is still there; one it
        did not show is gone (a live one vanishes: read() folds it; a tombstone or a bad file is
        forgotten: a file put under that name later is a new file)."""
        directory = scan.path
        for key, ino in scan.seen.items():  # shown by an earlier slice of the pass
            if key in self._live:
                names.add(key)
                listed[key] = ino
        if self._tombstones:
            self._tombstones = {key for key in self._tombstones
                                if key in names or key in scan.seen or self._directory_of(key) != directory}
        if self._bad:
            self._bad = {key: ino for key, ino in self._bad.items()
                         if listed.get(key, scan.seen.get(key)) == ino or self._directory_of(key) != directory}
        scan.seen = {}

    def _note_seen(self) -> None:
        """After the visits of a read: which files the reader remembers (live, folded, bad) the slices of
        passes still under way showed, for the end of their pass."""
        for scan in self._scans.values():
            if not scan.finished:
                for key in scan.slice_names:
                    if key in self._live or key in self._tombstones or key in self._bad:
                        scan.seen[key] = self._listed.get(key, 0)
                scan.slice_names = []

    def _forget_unread_directories(self) -> None:
        """Directories no longer read (a pod gone, or its directory gone while left out by the scan):
        their listings are closed, their tombstones and bad files forgotten.  The node's directory is
        always read, and a left-out pod directory is carried."""
        kept = {self.directory, *self.pod_directories, *self._left_out_directories}
        for directory in [directory for directory in self._scans if directory not in kept]:
            self._scans.pop(directory).close()
        if any(self._directory_of(key) not in kept for key in self._tombstones):
            self._tombstones = {key for key in self._tombstones if self._directory_of(key) in kept}
        if any(self._directory_of(key) not in kept for key in self._bad):
            self._bad = {key: ino for key, ino in self._bad.items() if self._directory_of(key) in kept}

    def _carry(self, directory: str, names: set[str], listed: dict[str, int]) -> None:
        """Keep the live files of a directory that could not be listed, or whose listing has not reached
        them yet, as last seen."""
        for key in self._live:
            if key not in names and self._directory_of(key) == directory:
                names.add(key)
                listed[key] = self._listed.get(key, 0)

    def _directory_of(self, key: str) -> str:
        return os.path.dirname(key) if os.path.isabs(key) else self.directory

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
        if _FLOCK is not None:
            if _FLOCK(fd, _PROBE) == 0:
                return True
            error = ctypes.get_errno()
            if error in (errno.EWOULDBLOCK, errno.EAGAIN):
                return False
            raise OSError(error, os.strerror(error))
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                return False
            raise
        return True

    def _visit(self, name: str) -> None:
        state = self._live.get(name)
        fd = None if state is None else self._take_kept(state)
        if fd is not None and state is not None and state.listed_ino != self._listed.get(name):
            os.close(fd)  # replaced under the same name: the path opens the new file
            fd = None
        path = os.path.join(self.directory, name)
        if fd is None:
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
            live = self._live.get(name)
            if live is not None and live.fd is None and self._kept < self._kept_cap:
                self._keep(live, fd)  # the state of this very file (_visit_open made it from this fd)
                live.listed_ino = self._listed.get(name)
            else:
                os.close(fd)  # also drops the lock the probe may have taken

    # --- descriptors kept open; files that did not change ---------------------------------------------

    def _take_kept(self, state: FileState) -> int | None:
        fd, state.fd = state.fd, None
        if fd is not None:
            self._kept -= 1
        return fd

    def _keep(self, state: FileState, fd: int) -> None:
        state.fd = fd
        self._kept += 1

    def _close_kept(self, state: FileState) -> None:
        fd = self._take_kept(state)
        if fd is not None:
            os.close(fd)

    def _unchanged(self, name: str, state: FileState, fd: int) -> bool:
        """Whether a live file is as it was at its last full read: same inode under its name, writer
        alive, the same header (used bytes, drops, a counted generation), not yet due for a full read.
        The scrape of a thousand unchanged files is a thousand of these: two syscalls, little else."""
        if not state.header or self._now >= state.recheck_at or state.listed_ino != self._listed.get(name):
            return False
        if _FLOCK is None or _FLOCK(fd, _PROBE) == 0:
            return False  # gone, or no cheap probe: the full read decides (a lock we got is ours until fd closes)
        try:
            header = os.pread(fd, HEADER_SIZE, 0)
        except OSError:
            return False
        self._budget.read -= HEADER_SIZE
        return header == state.header

    def _remember_header(self, state: FileState, data: bytes) -> None:
        """The header of the content ``state.parsed`` stands for (read in the same pread, before it).
        A writer that does not count generations (0) leaves none: its file is read whole every time."""
        counted = len(data) >= HEADER_SIZE and _GENERATION.unpack_from(data, GENERATION_OFFSET)[0] != 0
        state.header = data[:HEADER_SIZE] if counted else b""
        state.recheck_at = self._now + self.recheck_seconds * random.uniform(0.75, 1.25)

    def _make_live(self, name: str, state: FileState) -> None:
        if self._live.get(name) is not state:
            self._live[name] = state
            self._version += 1

    def _visit_open(self, name: str, path: str, fd: int) -> None:
        """Read a file whole: parse what changed, fold it if its writer is gone, else keep it live."""
        st = os.fstat(fd)
        state = self._live.get(name)
        if state is not None and state.ino != st.st_ino:  # replaced under the same name: treat as new
            self._vanished(name)
            state = None
        identity = (st.st_ino, st.st_size, st.st_mtime_ns)
        if not stat.S_ISREG(st.st_mode):
            self._count_bad(name, identity, "garbage")
            return
        try:
            gone = self._writer_gone(fd)
        except OSError:
            gone = False
        # Sparse or not, a file is never read past what a writer makes.
        data = "oversized" if st.st_size > self.max_file_bytes else self._read_bounded(fd, state.used if state else 0)
        if isinstance(data, str):
            if state is None or state.parsed is None:
                self._count_bad(name, identity, data)
            else:
                self._count_damaged(state, data)
                self._keep_last_good(name, path, state, gone)
            return
        if state is None:
            state = FileState(st.st_ino, uid=st.st_uid,
                              pod_uid=self.pod_directories.get(self._directory_of(name), ""))
        digest = hashlib.blake2b(data, digest_size=16).digest()
        if not self._affordable(state, data, digest, gone):
            if state.parsed is not None:
                self._make_live(name, state)  # keeps its last values; parsed again when there is room
            return
        if self._parse(state, data, digest, name, identity) is None:
            # Never understood: not ours to fold or delete (a foreign version's file, garbage); it stays,
            # counted once.  Understood before: see _keep_last_good.
            self._keep_last_good(name, path, state, gone)
            return
        self._remember_header(state, data)
        if gone:
            self._fold_dead(name, path, state)
        else:
            if state.lockers is None:
                state.lockers = self._lockers(st.st_ino)
                if state.lockers is not None:
                    self._version += 1  # the writer the merge names may change, with the same bytes
            self._make_live(name, state)

    def _keep_last_good(self, name: str, path: str, state: FileState, gone: bool) -> None:
        """A file understood before and not now (truncated or scribbled on by someone, unreadable): its
        last good content stands, and is what is folded once the writer is gone."""
        if state.parsed is None:
            return
        if gone:
            self._fold_dead(name, path, state)
        else:
            self._make_live(name, state)

    def _lockers(self, inode: int) -> frozenset[int] | None:
        """The pids holding a lock on a file with this inode, from the kernel's lock table (read at most
        once per read(), up to 4 MiB: ~80,000 locks); None when the table could not be read, which says
        nothing about the writer (asked again at the file's next full read, not taken for "nobody")."""
        if not self._lock_table_read:
            self._lock_table_read = True
            self._lock_table = read_lock_table(os.path.join(self.procfs, "locks"))
        return None if self._lock_table is None else self._lock_table.get(inode, frozenset())

    def _writer(self, state: FileState, parsed: Parsed) -> tuple[int, int]:
        """(pid, start ticks) of the file's writer as its header says, where the kernel shows that pid
        holding the file's lock; else (pid, 0), which names no process.  The header is the writer's word:
        a file claiming another live process would lend it that process's GPU and per-process series."""
        if state.lockers is not None and parsed.pid in state.lockers:
            return parsed.pid, parsed.start_ticks
        return parsed.pid, 0

    def _affordable(self, state: FileState, data: bytes, digest: bytes, gone: bool) -> bool:
        """Whether parsing ``data`` (if changed) fits this read's parse budget and the memory kept for
        live files (not for a dead writer's file: it is folded and let go at once); charges the parse
        budget.  A file that does not fit waits (``deferred_files``)."""
        if state.parsed is not None and digest == state.digest:
            return True
        big = len(data) > SMALL_FILE_BYTES
        retained = self._retained[big] - (state.used if (state.used > SMALL_FILE_BYTES) == big else 0)
        allowance = self.retained_bytes // 2 if big else self.retained_bytes - self._retained[True]
        if len(data) > self._budget.parse or (not gone and retained + len(data) > allowance):
            self._deferred_now += 1
            return False
        self._budget.parse -= len(data)
        self._retained[big] += len(data)  # an over-estimate until the next read() sums them again
        return True

    def _read_bounded(self, fd: int, hint: int) -> bytes | str:
        """The file up to its ``used`` offset, or the spool-errors reason why not.

        One pread of the last size seen (at least a page); a second only when the file grew.  ``used``
        past ``max_file_bytes`` is refused before anything past the header is read.
        """
        try:
            data = os.pread(fd, max(hint, 4096), 0)
            if len(data) >= USED_OFFSET + 8 and data[:8] == MAGIC:  # else parse() says what it is
                used, size = (struct.unpack_from("<Q", data, offset)[0] for offset in (USED_OFFSET, 16))
                if used > self.max_file_bytes or size > self.max_file_bytes:
                    return "oversized"
                if len(data) < used:
                    data += os.pread(fd, used - len(data), len(data))
                if HEADER_SIZE <= used <= len(data):
                    data = data[:used]
        except OSError:
            return "io"
        self._budget.read -= max(len(data), 4096)
        return data

    def _parse(self, state: FileState, data: bytes, digest: bytes, name: str,
               identity: tuple[int, int, int]) -> Parsed | None:
        if digest == state.digest and state.parsed is not None:
            return state.parsed
        try:
            parsed = parse(data)
        except BadFile as exc:
            if state.parsed is None:
                self._count_bad(name, identity, exc.reason)
            else:  # was fine, now is not (truncated by someone): keep the last good
                self._count_damaged(state, exc.reason)
            return None
        if parsed.bad_record and not state.bad_reported:
            state.bad_reported = True
            self._count("record")
        if state.parsed is not None:
            _clamp(state.parsed, parsed)
        state.digest, state.used = digest, len(data)
        state.parsed = parsed
        state.needs_gpu = (any(not info.gpu_uuid for info in parsed.infos.values())
                           or any(engine not in parsed.infos for engine in parsed.engines)
                           or any(not uuid for _, uuid, _ in parsed.loads))
        self._version += 1
        return parsed

    # --- folding -----------------------------------------------------------------------------

    def _fold_dead(self, name: str, path: str, state: FileState) -> None:
        """The writer is gone: fold its final totals, then remove the file (or tombstone it)."""
        self._live.pop(name, None)
        self._close_kept(state)
        self._version += 1
        if state.parsed is not None:
            self._fold(state.parsed)
        self.folded_processes += 1
        if not self.remove_dead or os.path.isabs(name):  # a tool, or a pod's own volume: left in place
            self._tombstones.add(name)
            return
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError:
            # The directory does not let the exporter delete (a sticky 1777 directory owned by someone
            # else): the file stays, and an exporter restart folds it again.  Said once per file.
            self._tombstones.add(name)
            self._count("not_deleted")

    def _vanished(self, name: str) -> None:
        """A live file disappeared without us folding it (another reader, a wiped emptyDir):
        fold what we last saw, so no counter goes backwards."""
        state = self._live.pop(name)
        self._close_kept(state)
        self._version += 1
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
        for engine, values in parsed.waterfalls.items():
            _merge_waterfall(folded.waterfalls, engine, values)
        folded.dropped_by_writers += parsed.dropped
        self._fold_per_gpu(parsed)

    def _bound_folded(self) -> None:
        """Folded totals are kept while the exporter runs, up to a cap, so endless distinct names cannot
        grow memory forever.  Past it an engine is forgotten whole (counted), never in part, and never
        one whose counters someone sees: not a ``protected`` (exported) engine, not one a live file
        still reports (its counters would drop to the live part: a reset).  Junk goes first: engines
        with no observation at all, then those with the fewest, then those folded longest ago."""
        excess = len(self._folded.engines) - self.max_folded_engines
        if excess <= 0:
            return
        live = {engine for state in self._live.values() if state.parsed for engine in state.parsed.engines}
        candidates = [engine for engine in self._folded_touched if engine not in self.protected and engine not in live]
        candidates.sort(key=lambda engine: (observations(self._folded.engines.get(engine)),
                                            self._folded_touched[engine]))
        for engine in candidates[:excess]:
            self._folded_touched.pop(engine)
            self._folded.engines.pop(engine, None)
            self._folded.last_load.pop(engine, None)
            self._folded.waterfalls.pop(engine, None)
            for table in (self._folded.errors, self._folded.layers):
                for key in [k for k in table if k[0] == engine]:
                    del table[key]
            self.forgotten_engines += 1
            self._version += 1

    # --- errors ------------------------------------------------------------------------------

    def _count(self, reason: str) -> None:
        self.errors[reason] = self.errors.get(reason, 0) + 1

    def _count_damaged(self, state: FileState, reason: str) -> None:
        """A file understood before and not now: counted once, whatever happens to it after."""
        if not state.bad_reported:
            state.bad_reported = True
            self._count("truncated" if reason in ("empty", "truncated") else reason)

    def _count_bad(self, name: str, identity: tuple[int, int, int], reason: str) -> None:
        """Count a bad file once for as long as it stays under that name and inode (read() skips it
        unopened from then on; a file put in its place is a new file).  Up to MAX_BAD_REMEMBERED of them:
        past that, a bad file is opened and counted again whenever the listing shows it (its errors
        counter runs on: visible, where remembering every one would let junk names grow memory)."""
        if self._bad.get(name) == identity[0]:
            return
        if name in self._bad or len(self._bad) < MAX_BAD_REMEMBERED:
            self._bad[name] = identity[0]
        self._count(reason)

    # --- merging -----------------------------------------------------------------------------

    def _merge(self) -> Totals:
        """The folded totals of exited writers plus every live file, per engine, per engine and GPU and per
        load in progress."""
        totals = self._folded_copy()
        infos: dict[InfoIdentity, EngineInfo] = {}
        mounts_of: dict[str, set[tuple[int, int]]] = {}  # engine -> the st_devs whose mount is kept
        for state in self._live.values():
            parsed = state.parsed
            if parsed is None:
                continue
            writer = self._writer(state, parsed)
            totals.live_files += 1
            totals.dropped_by_writers += parsed.dropped
            _add_counts(totals, parsed, writer)
            for (engine, dev), mount in parsed.mounts.items():
                kept = mounts_of.setdefault(engine, set())
                if (engine, dev) in totals.mounts or len(kept) < MAX_MOUNTS_PER_ENGINE:
                    kept.add(dev)
                    totals.mounts[(engine, dev)] = mount
            self._add_infos_and_pods(totals, infos, _pod_of(state, parsed), parsed, writer)
        for identity, info in infos.items():
            totals.infos.setdefault(identity[0], []).append(info)
        self._merge_per_gpu_and_loads(totals)
        return totals

    def _folded_copy(self) -> Totals:
        """A Totals to merge live files into: a copy of the exited writers' folded totals."""
        folded = self._folded
        return Totals(
            engines={engine: list(values) for engine, values in folded.engines.items()},
            errors=dict(folded.errors),
            layers={key: list(pair) for key, pair in folded.layers.items()},
            last_load=dict(folded.last_load),
            waterfalls={engine: list(values) for engine, values in folded.waterfalls.items()},
            dropped_by_writers=folded.dropped_by_writers,
            abandoned=dict(self._folded_abandoned),
        )

    def _add_infos_and_pods(self, totals: Totals, infos: dict[InfoIdentity, EngineInfo], pod: PodIdentity | None,
                            parsed: Parsed, writer: tuple[int, int]) -> None:
        """A live file's engine files (one INFO per distinct file and GPU, the latest load), the last load
        of each engine, and the pod of each (engine, GPU) it reports."""
        if pod is not None:
            for engine in parsed.engines.keys() - parsed.infos.keys():
                totals.pods.setdefault((engine, ""), set()).add(pod)
        for engine, info in parsed.infos.items():
            found = self.gpu_of(*writer) if not info.gpu_uuid and self.gpu_of else None
            if found:
                info = dataclasses.replace(info, gpu_uuid=found)
            if pod is not None:
                totals.pods.setdefault((engine, info.gpu_uuid), set()).add(pod)
            identity = (engine, info.path, info.cuda_device, info.gpu_uuid, info.runtime, info.dev, info.ino)
            seen = infos.get(identity)
            if seen is None or seen.load_time < info.load_time:
                infos[identity] = info
            if info.load_time > 0:  # 0: loading, never finished a load
                totals.last_load[engine] = max(totals.last_load.get(engine, 0.0), info.load_time)

    # --- per engine and GPU; loads in progress ----------------------------------------------------

    def _gpu_of_writer(self, writer: tuple[int, int], recorded: str) -> str:
        """The GPU a live writer works on for ``engine``: what it recorded, else what NVML lists it on."""
        if recorded or self.gpu_of is None:
            return recorded
        return self.gpu_of(*writer) or ""

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
            writer = self._writer(state, parsed)
            for engine, values in parsed.engines.items():
                info = infos.get(engine)
                uuid = info.gpu_uuid if info is not None else ""
                if not uuid and self.gpu_of is not None:
                    uuid = seen[(parsed.instance, engine)] = self.gpu_of(*writer) or ""
                group = groups.get((engine, uuid))
                if group is None:
                    groups[(engine, uuid)] = [_per_gpu_values(values)]
                else:
                    group.append(_per_gpu_values(values))
            if parsed.loads:
                for (engine, uuid, dev), values in parsed.loads.items():
                    _merge_load(totals.loads, (engine, self._gpu_of_writer(writer, uuid), dev), values)
        self._gpu_seen = seen
        totals.per_gpu = {key: list(group[0]) if len(group) == 1 else list(map(sum, zip(*group, strict=True)))
                          for key, group in groups.items()}

    def _fold_per_gpu(self, parsed: Parsed) -> None:
        """An exited writer's per-GPU counts stay under the GPU it had while alive (gauges zeroed), and
        its loads still in progress count as abandoned there.  Bounded: past max_folded_engines * 4 keys,
        new GPUs of an engine fold into its "" series, and engines forgotten by the engine cap are
        forgotten here too."""
        folded = self._folded_per_gpu
        for engine, values in parsed.engines.items():
            kept = list(_per_gpu_values(values))
            for index in PER_GPU_LAYOUT.gauges.values():
                kept[index] = 0.0
            _add_into(folded, (engine, self._folded_gpu(parsed, engine, "")), kept)
        abandoned = self._folded_abandoned
        for (engine, uuid, _), (in_progress, _, _) in parsed.loads.items():
            if in_progress >= 1:  # whole loads only: the slot is a count the writer moves by one
                key = (engine, self._folded_gpu(parsed, engine, uuid))
                abandoned[key] = abandoned.get(key, 0.0) + float(int(in_progress))
        if self._per_gpu_pruned_at != self.forgotten_engines:
            self._per_gpu_pruned_at = self.forgotten_engines
            for table in (folded, abandoned):
                for key in [key for key in table if key[0] not in self._folded.engines]:
                    del table[key]

    def _folded_gpu(self, parsed: Parsed, engine: str, recorded: str) -> str:
        """The GPU an exited writer's ``engine`` folds under: the one it recorded (for a load, on the load
        itself), else the one its INFO or NVML gave while it lived; "" once the folded keys are at their cap."""
        info = parsed.infos.get(engine)
        uuid = recorded or (info.gpu_uuid if info else "") or self._gpu_seen.get((parsed.instance, engine), "")
        known = (engine, uuid) in self._folded_per_gpu or (engine, uuid) in self._folded_abandoned
        return uuid if known or len(self._folded_per_gpu) < self.max_folded_engines * 4 else ""


MAX_LOCK_TABLE_BYTES = 4 << 20


def read_lock_table(path: str) -> dict[int, frozenset[int]] | None:
    """inode -> pids holding a lock on it, from /proc/locks (proc(5)): ``1: FLOCK ADVISORY WRITE 4242
    fe:00:2281097 0 EOF``; a blocked waiter's line (``->``) holds nothing.  Matched by inode alone: the
    device field is the file system's own, which overlayfs may report differently from fstat, and a
    pid and an inode both matching by chance is not a claim anyone can arrange.  None: unreadable."""
    chunks: list[bytes] = []
    try:
        with open(path, "rb", buffering=0) as handle:  # in pieces: read(4 MiB) would allocate 4 MiB at once
            while sum(map(len, chunks)) < MAX_LOCK_TABLE_BYTES and (chunk := handle.read(64 << 10)):
                chunks.append(chunk)
    except OSError:
        return None
    text = b"".join(chunks)
    table: dict[int, set[int]] = {}
    for line in text.split(b"\n"):
        parts = line.split()
        if len(parts) < 6 or parts[1] != b"FLOCK":  # a blocked waiter ("->") holds nothing
            continue
        pid, _, inode = parts[4], parts[5].rpartition(b":")[1], parts[5].rpartition(b":")[2]
        if pid.isdigit() and inode.isdigit():
            table.setdefault(int(inode), set()).add(int(pid))
    return {inode: frozenset(pids) for inode, pids in table.items()}


def _real_directory(path: str) -> bool:
    """Whether ``path`` is a directory and not a symlink to one."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def _pod_of(state: FileState, parsed: Parsed) -> PodIdentity | None:
    """The pod of a live file: the writer's record, with the UID of the pod volume it was found in
    (the kubelet's, which a writer cannot choose) in place of the one it recorded."""
    pod = parsed.pod
    if state.pod_uid:
        return dataclasses.replace(pod or PodIdentity(), pod_uid=state.pod_uid)
    return pod if pod is not None and any(dataclasses.astuple(pod)) else None


def _add_counts(totals: Totals, parsed: Parsed, writer: tuple[int, int]) -> None:
    """A live file's engines (and who reports them), error counts, layer times and waterfalls, added up."""
    for engine, values in parsed.engines.items():
        total = totals.engines.get(engine)
        totals.engines[engine] = list(values) if total is None else list(map(operator.add, total, values))
        totals.processes[engine] = totals.processes.get(engine, 0) + 1
        totals.writers.setdefault(engine, []).append(writer)
    for key, count in parsed.errors.items():
        totals.errors[key] = totals.errors.get(key, 0.0) + count
    for key, pair in parsed.layers.items():
        old = totals.layers.get(key)
        totals.layers[key] = list(pair) if old is None else [old[0] + pair[0], old[1] + pair[1]]
    for engine, values in parsed.waterfalls.items():
        _merge_waterfall(totals.waterfalls, engine, values)


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


WATERFALL_LAST_FROM = len(WATERFALL_COUNTERS)  # the last-load slots start here (seq_end is the last slot)


def _merge_waterfall(table: dict[str, list[float]], engine: str, values: list[float]) -> None:
    """Counters add up; the last-load slots are those of the latest load (its start time)."""
    merged = table.get(engine)
    if merged is None:
        table[engine] = list(values)
        return
    start = WATERFALL["last_start"]
    newer = values[start] > merged[start]
    for index in range(WATERFALL_LAST_FROM):
        merged[index] += values[index]
    if newer:
        merged[WATERFALL_LAST_FROM:] = values[WATERFALL_LAST_FROM:]


def observations(values: list[float] | None) -> float:
    """How much an engine's totals say: histogram observations plus bytes loaded (0: nothing)."""
    if values is None:
        return 0.0
    return sum(values[index] for index in BUCKET_SLOTS) + values[ENGINE_LAYOUT.counters["load_read_bytes"]]


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
    for engine, values in current.waterfalls.items():
        before = previous.waterfalls.get(engine)
        if values[0] != values[-1] and before is not None:  # copied mid-update (parse): keep the last good
            values[:] = before
        elif before is not None:
            _max_into(before, values, WATERFALL_LAST_FROM)
