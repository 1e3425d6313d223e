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
    136  f64 generation: moves up after every change of the file's values (0: a writer that does not
             count them; its reader reads the whole file every time)
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
         WATERFALL: WATERFALL_SLOTS doubles, key "engine": the engine's loads phase by phase and where
                 their bytes came from (counters), and its last load (see WATERFALL_SLOTS)
         MOUNT:  MOUNT_STRUCT, then mount point, fstype, source and layer directory as utf-8; key
                 "engine\0MAJ:MIN": the writer's own mountinfo line of the engine file's st_dev
         POD:    the process's pod, once, when the file is made: POD_STRUCT (four lengths), then
                 namespace, pod, container and pod UID as utf-8; key "pod" (pod_identity())

Hot path: an observation is one bisect and two stores of doubles into the process's MAP_SHARED
mapping (plus the generation below).  Python threads of the process never lose each other's
increments: on CPython with its GIL the hot paths' read-modify-writes cannot be interleaved
(``gpuio.metrics.STORES_ARE_ATOMIC`` says why), elsewhere they take a per-process ``threading.Lock``;
there is never a cross-process lock because nobody else writes the file.  No syscall: the kernel sees
the stores only as dirty pages.

Publication: a record is written in full and only then is ``used`` advanced past it, so a reader
that honours ``used`` never sees half a record.  Every change of a value is followed by a store that
moves ``generation`` up (``SpoolFile.lock`` does it when released; the hot paths store it with their
values): a reader
that finds the header as it last read it skips the rest of the file.  Histogram counts are stored per bucket (not
cumulative) and a histogram's count is the sum of its buckets, so an observation is two stores.

Liveness: the writer holds ``flock(LOCK_EX)`` on its file for its whole life; the kernel drops the
lock when the process ends, however it ends (SIGKILL included).  The reader probes with
``LOCK_EX|LOCK_NB``: refused means a live writer, granted means the writer is gone for good.  This
works across pid namespaces (every pod has its own pid 1), which a pid check in /proc cannot do; the
pid and start time in the header identify the process for people, not for liveness.  File names are
``gpuio-<pid>-<starttime>-<instance>.spool``, created under a dot-name and renamed into place after
the header is written and the lock taken, so a reader never sees an unlocked, half-made file.

Fork: a forked child maps a file of its own, the parent's records with every value at zero, at the very
address of the parent's mapping (``SpoolFile.take_over_after_fork``), so handles it inherited count its
work in its file.  Truncation: where the C extension is built, each mapping is guarded (``_hotpath.Guard``):
a store past the end of a file cut under the process lands in private memory instead of raising SIGBUS.

Who deletes: a process never deletes its own file (the exporter may not have read its last
increments yet).  The exporter deletes a file only after it has proved the writer dead (it holds the
writer's lock itself) and folded the file's final totals into its memory; nothing can write the file
again, so nothing is lost.  Deleting needs write permission on the directory only; where it is
refused (a sticky directory owned by someone else) the file is remembered as folded (a tombstone)
and skipped (known by inode and writer, not by name).  The exporter never writes into any spool file.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import mmap
import os
import re
import secrets
import struct
import sys
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TypeVar

try:  # the C hot path also guards mappings against SIGBUS (see SpoolFile._guard_mapping)
    from . import _hotpath
except ImportError:
    _hotpath = None  # type: ignore[assignment]

log = logging.getLogger("gpuio.spool")
_M = TypeVar("_M")

MAGIC = b"GPUIOSPL"
VERSION = 1
HEADER = struct.Struct("<8sIIQQIIQdQQ64s")
HEADER_SIZE = 256
RECORD_HEAD = struct.Struct("<IHH")
SUFFIX = ".spool"
PREFIX = "gpuio-"
DEFAULT_DIR = "/run/gpuio/spool"
DEFAULT_FILE_BYTES = 1 << 20  # sparse: pages are reserved (RESERVE_BYTES at a time) as records are added
RESERVE_BYTES = 16 << 10
MAX_KEY_BYTES = 400
MAX_RECORD_BYTES = 1 << 16

# offsets into the header (see the module docstring)
USED_OFFSET = 24
DROPPED_OFFSET = 64
GENERATION_OFFSET = 136
GENERATION_INDEX = GENERATION_OFFSET // 8  # as an index into the file's doubles

KIND_ENGINE = 1
KIND_ERROR = 2
KIND_LAYER = 3
KIND_INFO = 4
KIND_LOAD = 5
KIND_WATERFALL = 6
KIND_MOUNT = 7
KIND_POD = 16
# An exporter skips (and counts) the kinds it does not know: a library newer than the exporter adds
# kinds, never changes one.
KINDS = (KIND_ENGINE, KIND_ERROR, KIND_LAYER, KIND_INFO, KIND_LOAD, KIND_WATERFALL, KIND_MOUNT, KIND_POD)
# The LOAD record's doubles: gauges of one process's loads of one engine, GPU and file system.
LOAD_SLOTS = ("in_progress", "read_bytes", "oldest_start")

# The phases of a load, in the order they happen (docs/engines.md, "The waterfall of a load").
PHASES = ("open", "read", "deserialize", "context", "warmup", "first_inference")
# How a load got its bytes: cold (mostly from the device), warm (page cache), partial (between).
LOAD_CLASSES = ("cold", "warm", "partial")
# How the writer measured its file's page-cache residency: 0 not measured, else RESIDENCY_METHODS[n - 1].
RESIDENCY_METHODS = ("cachestat", "mincore", "probe")
# The WATERFALL record's doubles.  ``seq`` first and ``seq_end`` last: the writer moves ``seq`` up,
# stores everything, then copies it to ``seq_end``, so a reader's copy whose two differ was taken mid-update.
# Then counters (only grow), then the last load's figures (gauges).
WATERFALL_COUNTERS = ("seq", *(f"loads_{name}" for name in LOAD_CLASSES), *(f"phase_{name}" for name in PHASES),
                      "device_bytes", "cache_bytes", "major_faults", "cold_device_bytes", "cold_read_seconds")
WATERFALL_LAST = ("last_start", "last_wall", *(f"last_{name}" for name in PHASES), "last_bytes",
                  "last_device_bytes", "last_cache_bytes", "last_major_faults", "last_class", "file_bytes",
                  "cached_start_bytes", "cached_end_bytes", "residency_method", "residency_time")
WATERFALL_SLOTS = (*WATERFALL_COUNTERS, *WATERFALL_LAST, "seq_end")
WATERFALL = {name: index for index, name in enumerate(WATERFALL_SLOTS)}
# MOUNT: lengths of mount point, fstype, source, layer directory (u16 each)
MOUNT_STRUCT = struct.Struct("<HHHH")

# cuda device (i32, -1 unknown), st_dev major, minor (u32), st_ino, size (u64), mtime ns (i64),
# load time (f64, seconds since the epoch), then the lengths of path, gpu uuid, runtime (u16 each).
INFO_STRUCT = struct.Struct("<iIIQQqdHHH")
MAX_PATH_BYTES = 4096
MAX_SHORT_BYTES = 128
# POD: lengths (u16 each) of namespace, pod name, container name and pod UID, the strings follow.
POD_STRUCT = struct.Struct("<HHHH")
MAX_POD_NAME_BYTES = 253  # a DNS subdomain (pod names); namespaces and containers are 63-byte labels
# The Downward API variables the library reads (docs/engines.md has the pod spec snippet).
POD_ENVIRONMENT = ("POD_NAMESPACE", "POD_NAME", "CONTAINER_NAME", "POD_UID")

# Bucket bounds are part of the format: every process of one version shares them, so merging is
# plain addition.  They are wide on purpose (a 50 us CNN and a 30 s LLM prefill both resolve).
LATENCY_BOUNDS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                  0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
LOAD_BOUNDS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 60.0, 120.0, 300.0, 600.0)
BATCH_BOUNDS = (1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0)


@dataclass(frozen=True)
class Series:
    """One series of the ENGINE record, declared once: the slot(s) the library writes (``slot`` is also
    the attribute of :class:`gpuio.metrics.EngineMetrics`) and the family the exporter serves from them.
    The record's layout, the library's attributes and the exporter's descriptions all follow from these."""

    slot: str
    type: str  # "histogram", "counter" or "gauge" (the exposition's type names)
    name: str  # the family's full name as the exporter serves it
    help: str
    bounds: tuple[float, ...] = ()  # histograms: upper bounds of the buckets (part of the format)
    # The exporter serves it per engine and GPU (label gpu_uuid), else per engine: the series that say
    # whether work waits on one GPU.  Gauges are always per GPU.
    per_gpu: bool = False
    unit: str = ""  # the base unit the name ends in (seconds, bytes), "" for a count

    @property
    def labels(self) -> tuple[str, ...]:
        """The family's label names (histograms' ``le`` aside)."""
        return ("engine", "gpu_uuid") if self.per_gpu or self.type == GAUGE else ("engine",)


HISTOGRAM, COUNTER, GAUGE = "histogram", "counter", "gauge"

# The ENGINE record: histograms, then counters, then gauges, each group in this order (the layout
# follows the order, so a new series goes at the end of its group and VERSION moves).  Gauges are the
# only slots that may go down; everything else only grows.
ENGINE_SERIES: tuple[Series, ...] = (
    Series("load_read_seconds", HISTOGRAM, "gpuio_engine_load_read_seconds",
           "Time to read engine files from disk or page cache, per load (the disk's part).", LOAD_BOUNDS,
           unit="seconds"),
    Series("load_deserialize_seconds", HISTOGRAM, "gpuio_engine_load_deserialize_seconds",
           "Time to deserialize engines once read (TensorRT deserialize_cuda_engine or the model loader), per load.",
           LOAD_BOUNDS, unit="seconds"),
    Series("inference_seconds", HISTOGRAM, "gpuio_engine_inference_seconds",
           "End-to-end latency of completed inferences (enqueue to stream synchronised).", LATENCY_BOUNDS,
           per_gpu=True, unit="seconds"),
    Series("inference_gpu_seconds", HISTOGRAM, "gpuio_engine_inference_gpu_seconds",
           "GPU time of inferences from CUDA events, where the process measures it.", LATENCY_BOUNDS, unit="seconds"),
    Series("batch_size", HISTOGRAM, "gpuio_engine_inference_batch_size",
           "Batch size of inferences, where known.", BATCH_BOUNDS),
    Series("pool_wait_seconds", HISTOGRAM, "gpuio_engine_pool_wait_seconds",
           "Time requests waited for a free execution context in the engine pool.", LATENCY_BOUNDS, per_gpu=True,
           unit="seconds"),
    Series("warmup_seconds", HISTOGRAM, "gpuio_engine_warmup_seconds",
           "Warm-up time of each execution context before it served (all warm-up iterations).", LOAD_BOUNDS,
           unit="seconds"),
    Series("first_inference_seconds", HISTOGRAM, "gpuio_engine_first_inference_seconds",
           "Latency of each execution context's first inference (cold), to compare with the steady inference "
           "latency.", LATENCY_BOUNDS, unit="seconds"),
    Series("load_read_bytes", COUNTER, "gpuio_engine_load_read_bytes_total",
           "Bytes read from engine files by loads.", unit="bytes"),
    Series("layer_profiled_inferences", COUNTER, "gpuio_engine_layer_profiled_inferences_total",
           "Inferences profiled per layer (sampled 1 in N); divide layer seconds by this for a mean."),
    Series("in_flight", GAUGE, "gpuio_engine_inferences_in_flight", "Inferences running now, per engine and GPU."),
    Series("pool_contexts", GAUGE, "gpuio_engine_pool_contexts",
           "Execution contexts in engine pools, per engine and GPU."),
    Series("pool_idle", GAUGE, "gpuio_engine_pool_idle_contexts",
           "Execution contexts free in engine pools, per engine and GPU."),
)
SERIES = {series.slot: series for series in ENGINE_SERIES}
HISTOGRAMS = tuple((s.slot, s.bounds) for s in ENGINE_SERIES if s.type == HISTOGRAM)
COUNTERS = tuple(s.slot for s in ENGINE_SERIES if s.type == COUNTER)
GAUGES = tuple(s.slot for s in ENGINE_SERIES if s.type == GAUGE)


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
def pad8(length: int) -> int:
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


class ChangeLock:
    """The lock that serialises one process's changes to its spool file; releasing it publishes them
    (moves the header's generation up), so the exporter re-reads exactly the files that changed.

    ``acquire`` is the plain lock's; hot paths that hold it and store the generation themselves may
    release with ``release_quietly``."""

    __slots__ = ("_values", "acquire", "release_quietly", "locked")

    def __init__(self) -> None:
        lock = threading.Lock()
        self.acquire = lock.acquire
        self.release_quietly = lock.release
        self.locked = lock.locked
        self._values: memoryview[float] | None = None

    def release(self) -> None:
        values = self._values
        if values is not None:
            values[GENERATION_INDEX] += 1.0
        self.release_quietly()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


class SpoolFile:
    """One process's spool file, mapped shared; or, when the directory cannot be used, anonymous memory.

    Never raises out of its constructor for a bad directory: instrumentation must not take an
    inference service down.  ``path`` is None when the metrics go nowhere (logged once).
    """

    def __init__(self, directory: str | None, size: int = DEFAULT_FILE_BYTES) -> None:
        self.size = max(size, HEADER_SIZE + 4096) & ~7
        self.lock = ChangeLock()  # serialises value updates and record appends within this process
        self.path: str | None = None
        self.unusable: str | None = None  # why the directory could not take this process's file
        self._fd: int | None = None
        # The file's descriptor for reserving its pages, and how many bytes from its start are reserved (an
        # anonymous mapping is all backed from the start).
        self._write_fd: int | None = None
        self._reserved = self.size
        self.instance = secrets.randbits(63)
        self.pid = os.getpid()
        self.start_ticks = process_start_ticks()
        self._map = self._open(directory)
        self._guard: _hotpath.Guard | None = _guard_mapping(self._map) if self.path else None  # memory: no truncation
        self.values = memoryview(self._map).cast("d")
        self.lock._values = self.values
        self.used = HEADER_SIZE
        _MAPPED.add(self)
        identity = pod_identity()
        if identity[1] or identity[3]:  # a pod name or UID; CONTAINER_NAME alone is too common to mean a pod
            self.add_record(KIND_POD, "pod", len(pack_pod(*identity)), pack_pod(*identity))

    def _open(self, directory: str | None) -> mmap.mmap:
        if directory:
            try:
                return self._create(directory)
            except OSError as exc:
                self.unusable = str(exc.strerror or exc)
                log.warning("gpuio spool unusable, engine metrics will not reach the exporter: %s (%s)",
                            directory, self.unusable)
        anonymous = mmap.mmap(-1, self.size)
        self._write_header(anonymous)
        return anonymous

    def _create(self, directory: str) -> mmap.mmap:
        def map_new(fd: int) -> mmap.mmap:
            mapped = mmap.mmap(fd, self.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            self._write_header(mapped)
            return mapped

        return self._made_file(directory, RESERVE_BYTES, map_new)

    def _made_file(self, directory: str, reserve: int, map_it: Callable[[int], _M]) -> _M:
        """Make this process's file in ``directory``: created under a dot-name, locked, its first ``reserve``
        bytes backed, ``map_it(fd)`` maps and fills it, then it is renamed into place.  Raises OSError
        (nothing left behind) when the directory cannot take it."""
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
            # A store into a page that the file system cannot back (a full tmpfs /run, an emptyDir at its
            # sizeLimit) kills the process with SIGBUS: every page is reserved before it is written, the
            # first ones now (full already: no file, the metrics stay in memory, see ``_open``), the
            # rest as records need them (``add_record``).  The file takes only what it uses.
            os.posix_fallocate(fd, 0, reserve)
            mapped = map_it(fd)
            os.rename(temporary, os.path.join(directory, name))
        except BaseException:
            if lock_fd is not None:
                os.close(lock_fd)
            with contextlib.suppress(OSError):
                os.unlink(temporary)
            os.close(fd)
            raise
        self._fd = lock_fd
        self._write_fd, self._reserved = fd, reserve
        self.path = os.path.join(directory, name)
        return mapped

    def _write_header(self, target: mmap.mmap) -> None:
        comm = os.fsencode(os.path.basename(sys.argv[0] if sys.argv and sys.argv[0] else "python"))[:64]
        HEADER.pack_into(target, 0, MAGIC, VERSION, HEADER_SIZE, self.size, HEADER_SIZE, self.pid, 0,
                         self.start_ticks, time.time(), self.instance, 0, comm)
        struct.pack_into("<d", target, GENERATION_OFFSET, 1.0)  # not 0: this writer counts its changes

    def add_record(self, kind: int, key: str, payload_bytes: int, payload: bytes = b"") -> int | None:
        """Append a record and return the byte offset of its (zeroed) payload, or None when full.

        Caller holds ``self.lock``.  The record is complete before ``used`` moves past it.
        """
        raw = encoded(key)[:MAX_KEY_BYTES]
        size = RECORD_HEAD.size + pad8(len(raw)) + pad8(payload_bytes)
        if self.used + size > self.size or not self._reserve(self.used + size):
            dropped = struct.unpack_from("<Q", self._map, DROPPED_OFFSET)[0] + 1
            struct.pack_into("<Q", self._map, DROPPED_OFFSET, dropped)
            return None
        offset = self.used
        RECORD_HEAD.pack_into(self._map, offset, size, kind, len(raw))
        self._map[offset + RECORD_HEAD.size : offset + RECORD_HEAD.size + len(raw)] = raw
        payload_offset = offset + RECORD_HEAD.size + pad8(len(raw))
        if payload:
            self._map[payload_offset : payload_offset + len(payload)] = payload
        self.used = offset + size
        struct.pack_into("<Q", self._map, USED_OFFSET, self.used)  # publish
        return payload_offset

    def _reserve(self, end: int) -> bool:
        """Whether the file's first ``end`` bytes are backed by the file system (reserving more in steps of
        RESERVE_BYTES); False when it is full: the record is not made, and counted as dropped."""
        if end <= self._reserved:
            return True
        if self._guard is not None and self._guard.faults:
            return True  # the file was cut under the process: memory backs the mapping from the cut on
        if self._write_fd is None:
            return False
        target = min(self.size, -(-end // RESERVE_BYTES) * RESERVE_BYTES)
        try:
            os.posix_fallocate(self._write_fd, self._reserved, target - self._reserved)
        except OSError as exc:
            if not self.unusable:
                self.unusable = str(exc.strerror or exc)
                log.warning("gpuio spool full, new engine series are dropped: %s (%s)", self.path, self.unusable)
            return False
        self._reserved = target
        return True

    def _close_write_fd(self) -> None:
        if self._write_fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._write_fd)
            self._write_fd = None

    @property
    def problem(self) -> str | None:
        """Why this process's metrics do not (all) reach the exporter, or None."""
        faults = 0 if self._guard is None else self._guard.faults
        if faults:
            return (f"the spool file was truncated under this process ({faults} SIGBUS survived); "
                    "engine metrics stay in its memory")
        return self.unusable

    def close(self) -> None:
        """Unmap and drop the lock; the file stays for the exporter to fold."""
        self._close_write_fd()
        self.lock._values = None
        self._unmap()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def _unmap(self) -> None:
        """Unmap, unless a handle still holds the mapping (it stays mapped, and guarded, until the last goes)."""
        guarded = self._guard is not None
        if self._guard is not None:
            self._guard.release()  # the guard holds the mapping too
        try:
            self.values.release()
            self._map.close()
        except (BufferError, ValueError):
            self._guard = _guard_mapping(self._map) if guarded else None
        else:
            self._guard = None

    def release_lock(self) -> None:
        """Give the file up (the exporter will fold it) but keep the mapping valid for stray handles (which
        add no records past what is reserved)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        self._close_write_fd()

    # --- fork ------------------------------------------------------------------------------------
    #
    # A forked child shares its parent's MAP_SHARED mapping: every handle it inherited (an observe kept
    # by a gunicorn --preload app, a with infer() made before the fork) would add the child's counts to
    # the parent's file.  The child maps a file of its own at the very same address instead (MAP_FIXED),
    # holding the same records with their values at zero: every inherited handle keeps working and now
    # counts the child's work, in the child's file.

    def take_over_after_fork(self, as_process_spool: bool) -> bool:
        """In a forked child: put this process's own copy under the mapping's address, values at zero.

        The process's spool (``as_process_spool``) gets a new file in the parent's directory, locked by
        the child; where that fails (a full file system) and for every other mapping (scratch memory,
        files given up by ``configure``) the copy is private memory.  False when not even that could be
        done (no MAP_FIXED here): the caller must stop the inherited handles.
        """
        if self._map.closed:
            return True
        address = _address_of(self._map)
        if address is None:
            return False
        image = self._child_image()
        parent_directory = os.path.dirname(self.path) if self.path else None
        self._forget_parent_file()
        self.pid, self.start_ticks, self.instance = os.getpid(), process_start_ticks(), secrets.randbits(63)
        self._stamp_header(image)
        if as_process_spool and parent_directory:
            try:
                self._made_file(parent_directory, self._reserved, lambda fd: self._map_file_at(address, fd, image))
                return True
            except OSError as exc:
                self.unusable = str(exc.strerror or exc)
                log.warning("gpuio spool unusable in a forked child, its engine metrics stay in its memory: %s (%s)",
                            parent_directory, self.unusable)
        if not _map_fixed(address, self.size, -1):
            return False
        self._map[: len(image)] = image
        self._reserved = self.size
        return True

    def _child_image(self) -> bytearray:
        """The mapping's header and records as the child starts them: what the records say about the
        engines (INFO, MOUNT, POD) kept, every value (counters, histograms, gauges, loads) at zero."""
        image = bytearray(self._map[: self.used])
        offset = HEADER_SIZE
        while offset + RECORD_HEAD.size <= self.used:
            size, kind, key_length = RECORD_HEAD.unpack_from(image, offset)
            if size < RECORD_HEAD.size or offset + size > self.used:
                break
            if kind in VALUE_KINDS:
                payload = offset + RECORD_HEAD.size + pad8(key_length)
                image[payload : offset + size] = bytes(offset + size - payload)
            offset += size
        return image

    def _stamp_header(self, image: bytearray) -> None:
        comm = bytes(image[72:136]).rstrip(b"\0")
        HEADER.pack_into(image, 0, MAGIC, VERSION, HEADER_SIZE, self.size, self.used, self.pid, 0,
                         self.start_ticks, time.time(), self.instance, 0, comm)
        struct.pack_into("<d", image, GENERATION_OFFSET, 1.0)

    def _map_file_at(self, address: int, fd: int, image: bytearray) -> None:
        os.pwrite(fd, image, 0)
        if not _map_fixed(address, self.size, fd):
            raise OSError(0, "MAP_FIXED was refused")

    def _forget_parent_file(self) -> None:
        """Close the child's copies of the parent's descriptors.  The lock descriptor shares the parent's
        open file description, so closing it leaves the parent's lock in place (and a child that lives on
        does not keep a dead parent's file looking alive)."""
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None
        self._close_write_fd()
        self.path = None

    def abandon_after_fork(self) -> None:
        """In a forked child whose mapping could not be taken over: forget the parent's file without
        touching the parent's lock or data, and drop the mapping where no handle holds it."""
        self._forget_parent_file()
        self.lock._values = None
        self._unmap()


# The records whose payload is values (counts, sums, gauges): a forked child starts them at zero.
VALUE_KINDS = frozenset((KIND_ENGINE, KIND_ERROR, KIND_LAYER, KIND_LOAD, KIND_WATERFALL))

# Every SpoolFile of this process: a forked child takes each over (``take_over_after_fork``).
_MAPPED: weakref.WeakSet[SpoolFile] = weakref.WeakSet()


def mapped_files() -> list[SpoolFile]:
    return list(_MAPPED)


def _guard_mapping(mapped: mmap.mmap) -> _hotpath.Guard | None:
    """A SIGBUS guard over the mapping where the C extension is built (``_hotpath.Guard``), else None."""
    if _hotpath is None:
        return None
    try:
        return _hotpath.Guard(mapped)
    except OSError as exc:  # every guard slot taken: the mapping works unguarded
        log.warning("gpuio spool mapping not guarded against truncation: %s", exc)
        return None


_MAP_FIXED = 0x10  # <sys/mman.h> on every Linux architecture gpuio runs on (x86-64, aarch64)
_libc_mmap: Callable[..., int | None] | None = None


def prepare_for_fork() -> None:
    """Load what a forked child needs to place its mapping (ctypes and libc's mmap) in the parent, once,
    so that no child pays for the import."""
    global _libc_mmap
    if _libc_mmap is not None:
        return
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                              ctypes.c_long)
        _libc_mmap = libc.mmap
    except (ImportError, OSError, AttributeError):
        pass


def _map_fixed(address: int, length: int, fd: int) -> bool:
    """mmap(2) with MAP_FIXED over ``[address, address + length)``: the file ``fd`` shared, or (fd -1)
    private zeroed memory.  The Python mmap module cannot place a mapping; ctypes calls libc's."""
    prepare_for_fork()
    if _libc_mmap is None:
        return False
    flags = _MAP_FIXED | (mmap.MAP_SHARED if fd >= 0 else mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return _libc_mmap(address, length, mmap.PROT_READ | mmap.PROT_WRITE, flags, fd, 0) == address


def _address_of(mapped: mmap.mmap) -> int | None:
    try:
        import ctypes

        view = ctypes.c_char.from_buffer(mapped)
    except (ImportError, TypeError, ValueError):
        return None
    address = ctypes.addressof(view)
    del view  # the buffer export: the mapping must stay closable
    return address


def encoded(text: str) -> bytes:
    """A name as the bytes it stands for: a path Python read from the OS keeps its bytes that are not UTF-8
    (lone surrogates, os.fsencode's way: the exporter shows them as \\xNN, as it shows the same file found
    from /proc); any other text that UTF-8 cannot hold gets "?" there.  Never raises: a name must not
    break the process it describes."""
    try:
        return text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        return text.encode("utf-8", "replace")


def pack_info(cuda_device: int, dev: tuple[int, int], ino: int, size: int, mtime_ns: int, load_time: float,
              path: str, gpu_uuid: str, runtime: str) -> bytes:
    raw_path = encoded(path)[:MAX_PATH_BYTES]
    raw_uuid = encoded(gpu_uuid)[:MAX_SHORT_BYTES]
    raw_runtime = encoded(runtime)[:MAX_SHORT_BYTES]
    head = INFO_STRUCT.pack(cuda_device, dev[0], dev[1], ino, size, mtime_ns, load_time,
                            len(raw_path), len(raw_uuid), len(raw_runtime))
    return head + raw_path + raw_uuid + raw_runtime


_POD_CGROUP = re.compile(r"(?:^|-)pod([0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12})"
                         r"(?:\.slice)?$")


def _own_pod_uid() -> str:
    """This process's pod UID from its own cgroup path, where its cgroup namespace shows the path (cgroup
    v1, or v2 with a host cgroup namespace); "" otherwise (a private namespace shows only "/")."""
    try:
        with open("/proc/self/cgroup", "rb") as handle:
            text = handle.read(16384).decode("utf-8", "replace")
    except OSError:
        return ""
    for line in text.splitlines():
        for segment in line.rpartition(":")[2].split("/"):
            found = _POD_CGROUP.search(segment)
            if found:
                return found[1].replace("_", "-")
    return ""


def pod_identity(environ: Mapping[str, str] | None = None) -> tuple[str, str, str, str]:
    """``(namespace, pod, container, pod UID)`` of this process, from the Downward API environment
    (POD_ENVIRONMENT) and, for the UID, the process's own cgroup; "" for what is not known."""
    env = os.environ if environ is None else environ
    namespace, pod, container, uid = (env.get(name, "") for name in POD_ENVIRONMENT)
    return namespace, pod, container, uid or _own_pod_uid()


def pack_pod(namespace: str, pod: str, container: str, pod_uid: str) -> bytes:
    raw = [encoded(text)[:limit] for text, limit in
           ((namespace, MAX_POD_NAME_BYTES), (pod, MAX_POD_NAME_BYTES), (container, MAX_POD_NAME_BYTES),
            (pod_uid, MAX_SHORT_BYTES))]
    return POD_STRUCT.pack(*map(len, raw)) + b"".join(raw)


def pack_mount(mountpoint: str, fstype: str, source: str, layer: str) -> bytes:
    """A MOUNT record's payload (each string cut to MAX_PATH_BYTES or MAX_SHORT_BYTES)."""
    raw = [encoded(mountpoint)[:MAX_PATH_BYTES], encoded(fstype)[:MAX_SHORT_BYTES],
           encoded(source)[:MAX_PATH_BYTES], encoded(layer)[:MAX_PATH_BYTES]]
    return MOUNT_STRUCT.pack(*(len(part) for part in raw)) + b"".join(raw)
