"""The waterfall of one load: its phases, where its bytes came from, and the file's cache and mount.

Everything here is measured by the loading thread on itself, so it needs no privilege:

* **device vs page-cache bytes**: ``/proc/thread-self/io`` around the file's reads (see WaterfallTimer).  ``read_bytes``
  counts what this thread made the block layer fetch (its reads, their readahead, and the page faults
  of an mmap'ing loader); ``rchar`` counts what read(2) calls returned, wherever it came from.  Bytes
  from the page cache are the difference.  Network filesystems (NFS, FUSE) fetch without the block
  layer, so their ``read_bytes`` stays 0: the residency at the start then decides (see :func:`classify`).
* **major faults**: ``getrusage(RUSAGE_THREAD)``, for loaders that mmap the file instead of reading it.
* **residency at load start**: ``cachestat(2)`` on the loader's own descriptor.  The kernel answers it
  only to a caller that owns the file, may write it, or has CAP_FOWNER (and mincore(2) tells anyone
  else that every page is resident).  An inference process that runs as another user than the file's
  owner is refused, so it samples instead: ``preadv2(RWF_NOWAIT)`` of one byte every
  ``PROBE_STRIDE`` bytes (at most ``MAX_PROBES`` probes) fails with EAGAIN where the page is not
  cached.  A probe that misses starts the read of that one page, harmless here because the load reads
  the whole file next, and the reason the exporter's own periodic scans never probe.
* **mount**: the writer's own ``/proc/self/mountinfo`` line for the file's st_dev (mount point,
  fstype, source and, for overlayfs, the layer directory), so the exporter can find the disk under a
  file in a container image, on a PVC or on NFS although it cannot see the path.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import mmap
import os
import resource
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from . import spool

SYS_CACHESTAT = 451  # the same number on x86_64 and aarch64 (the generic syscall table)
PROBE_STRIDE = 1 << 20
MAX_PROBES = 256  # each miss reads one page: bounded IOs on a slow (network) disk
PAGE = mmap.PAGESIZE
# Classification: the share of the file the load had to fetch from the device (module note).
COLD_AT_LEAST = 0.8
WARM_AT_MOST = 0.1
MAX_MOUNTINFO_BYTES = 4 << 20


@dataclass
class ThreadCounters:
    """This thread's IO counters (``/proc/thread-self/io``) and major faults; None where unreadable."""

    rchar: int | None
    read_bytes: int | None
    major_faults: int | None

    @classmethod
    def now(cls, io: bool = True) -> ThreadCounters:
        """``io=False``: the major faults alone (a read of /proc costs ~30 us, getrusage ~1 us)."""
        rchar = read_bytes = None
        try:
            if not io:
                raise OSError("not asked")
            with open("/proc/thread-self/io", "rb") as handle:
                for line in handle.read(4096).splitlines():
                    key, _, value = line.partition(b":")
                    if key == b"rchar":
                        rchar = int(value)
                    elif key == b"read_bytes":
                        read_bytes = int(value)
        except (OSError, ValueError):
            pass
        try:
            faults: int | None = resource.getrusage(resource.RUSAGE_THREAD).ru_majflt
        except (AttributeError, OSError, ValueError):
            faults = None
        return cls(rchar, read_bytes, faults)


def _delta(after: int | None, before: int | None) -> int:
    return max(0, after - before) if after is not None and before is not None else 0


@dataclass
class Residency:
    cached_bytes: int
    method: str  # one of spool.RESIDENCY_METHODS


class _Range(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Cachestat(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64) for name in
                ("nr_cache", "nr_dirty", "nr_writeback", "nr_evicted", "nr_recently_evicted")]


_libc: ctypes.CDLL | None = None


def _c() -> ctypes.CDLL:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.syscall.restype = ctypes.c_long
    return _libc


def cachestat_bytes(fd: int, size: int) -> int:
    """Cached bytes of the file by cachestat(2); OSError with the kernel's errno (EPERM, ENOSYS)."""
    result, span = _Cachestat(), _Range(0, 0)
    if _c().syscall(ctypes.c_long(SYS_CACHESTAT), ctypes.c_int(fd), ctypes.byref(span), ctypes.byref(result),
                    ctypes.c_uint(0)) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))
    return min(size, int(result.nr_cache) * PAGE)


def probe_bytes(fd: int, size: int) -> int:
    """Cached bytes estimated by ``preadv2(RWF_NOWAIT)`` of one byte per stride (module note)."""
    if size <= 0:
        return 0
    stride = max(PROBE_STRIDE, -(-size // MAX_PROBES))
    stride -= stride % PAGE
    offsets = range(0, size, stride)
    buffer = bytearray(1)
    hits = 0
    for offset in offsets:
        try:
            hits += os.preadv(fd, [buffer], offset, os.RWF_NOWAIT) > 0
        except BlockingIOError:  # EAGAIN: not in the page cache
            continue
    return min(size, round(size * hits / len(offsets)))


def residency_of_fd(fd: int, size: int) -> Residency | None:
    """The file's cached bytes, as truthfully as this process may know them; None if it cannot."""
    try:
        return Residency(cachestat_bytes(fd, size), "cachestat")
    except OSError as exc:
        if exc.errno not in (errno.EPERM, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL):
            return None
    if hasattr(os, "RWF_NOWAIT"):
        try:
            return Residency(probe_bytes(fd, size), "probe")
        except OSError:
            return None
    return None


def measure_residency(path: str) -> Residency | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        return residency_of_fd(fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)


def classify(file_bytes: int, device_bytes: int, cached_start: int | None) -> str:
    """cold / warm / partial from the share of the file the load had to fetch: the larger of what came
    from the device and what was not cached when it started (network filesystems count no device
    bytes; a read that raced another reader of the same file counts too few)."""
    if file_bytes <= 0:
        return "warm"
    fetched = device_bytes / file_bytes
    if cached_start is not None:
        fetched = max(fetched, 1.0 - cached_start / file_bytes)
    if fetched >= COLD_AT_LEAST:
        return "cold"
    if fetched <= WARM_AT_MOST:
        return "warm"
    return "partial"


@dataclass
class Waterfall:
    """One load, phase by phase (seconds), with where its bytes came from."""

    started: float = field(default_factory=time.time)
    phases: dict[str, float] = field(default_factory=dict)
    wall_seconds: float = 0.0
    bytes_read: int = 0
    device_bytes: int = 0
    cache_bytes: int = 0
    major_faults: int = 0
    file_bytes: int = 0
    cached_start: Residency | None = None
    cached_end: Residency | None = None
    load_class: str = ""

    @property
    def read_throughput(self) -> float | None:
        """Bytes per second of the read phase (None when it took no measurable time)."""
        seconds = self.phases.get("read", 0.0)
        return self.bytes_read / seconds if seconds > 0 else None


class WaterfallTimer:
    """Measures one load on the calling thread: ``phase(name, seconds)`` as they happen, the file's
    reads inside ``with timer.reading():``, then ``end()``.

    Bytes by source come from the thread's counters around the reads only (where the loader marks
    them), so that a deserializer that loads libraries (CUDA's lazily loaded modules come off the same
    disk after a cache drop) does not count as the engine file's bytes; without a marked read (a
    caller's own loop on this thread, an mmap'ing loader) they come from the whole load.  Major faults
    always cover the whole load."""

    def __init__(self) -> None:
        self.waterfall = Waterfall()
        self._start = time.perf_counter()
        self._before = ThreadCounters.now()  # the whole load's window, where no read is marked
        self._reads: list[tuple[ThreadCounters, ThreadCounters]] = []

    def phase(self, name: str, seconds: float) -> None:
        self.waterfall.phases[name] = self.waterfall.phases.get(name, 0.0) + max(0.0, seconds)

    @contextlib.contextmanager
    def reading(self) -> Iterator[None]:
        before = ThreadCounters.now()
        try:
            yield
        finally:
            self._reads.append((before, ThreadCounters.now()))

    def end(self, bytes_read: int, file_bytes: int) -> Waterfall:
        after = ThreadCounters.now(io=not self._reads)
        w = self.waterfall
        w.wall_seconds = time.perf_counter() - self._start
        w.bytes_read = bytes_read
        w.file_bytes = file_bytes
        windows = self._reads or [(self._before, after)]
        w.device_bytes = sum(_delta(end.read_bytes, begin.read_bytes) for begin, end in windows)
        w.cache_bytes = max(0, sum(_delta(end.rchar, begin.rchar) for begin, end in windows) - w.device_bytes)
        w.major_faults = _delta(after.major_faults, self._before.major_faults)
        w.load_class = classify(file_bytes, w.device_bytes, w.cached_start.cached_bytes if w.cached_start else None)
        return w


# --------------------------------------------------------------------------------------------------
# The file's mount, from this process's own mountinfo
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class OwnMount:
    mountpoint: str
    fstype: str
    source: str
    layer: str  # overlayfs: the upper directory, else the first lower one ("" otherwise)


def _unescape(text: str) -> str:
    out, index = [], 0
    while index < len(text):
        if text[index] == "\\" and text[index + 1 : index + 4].isdigit() and len(text[index + 1 : index + 4]) == 3:
            out.append(chr(int(text[index + 1 : index + 4], 8)))
            index += 4
        else:
            out.append(text[index])
            index += 1
    return "".join(out)


def mount_of(dev: tuple[int, int], path: str, mountinfo: str = "/proc/self/mountinfo") -> OwnMount | None:
    """The mount of this process's namespace with st_dev ``dev`` holding ``path`` (proc(5) mountinfo)."""
    try:
        with open(mountinfo, "rb") as handle:
            text = handle.read(MAX_MOUNTINFO_BYTES).decode("utf-8", "replace")
    except OSError:
        return None
    best: OwnMount | None = None
    for line in text.splitlines():
        fields = line.split(" ")
        if "-" not in fields[6:]:
            continue
        dash = fields.index("-", 6)
        if len(fields) < dash + 4 or fields[2] != f"{dev[0]}:{dev[1]}":
            continue
        point = _unescape(fields[4])
        inside = path == point or path.startswith(point.rstrip("/") + "/")
        if not inside or (best is not None and len(point) < len(best.mountpoint)):
            continue
        fstype, source, options = fields[dash + 1], _unescape(fields[dash + 2]), fields[dash + 3]
        best = OwnMount(point, fstype, source, _layer(fstype, options))
    return best


def _layer(fstype: str, super_options: str) -> str:
    if fstype != "overlay":
        return ""
    options = dict(item.partition("=")[::2] for item in super_options.split(","))
    return _unescape(options.get("upperdir") or options.get("lowerdir", "").split(":")[0])


def pack_waterfall_last(values: list[float], w: Waterfall) -> None:
    """Store ``w`` into a WATERFALL vector's last-load slots (a list of doubles, in place)."""
    slot = spool.WATERFALL
    values[slot["last_start"]] = w.started
    values[slot["last_wall"]] = w.wall_seconds
    for name in spool.PHASES:
        values[slot[f"last_{name}"]] = w.phases.get(name, 0.0)
    values[slot["last_bytes"]] = w.bytes_read
    values[slot["last_device_bytes"]] = w.device_bytes
    values[slot["last_cache_bytes"]] = w.cache_bytes
    values[slot["last_major_faults"]] = w.major_faults
    values[slot["last_class"]] = spool.LOAD_CLASSES.index(w.load_class) + 1 if w.load_class else 0
    values[slot["file_bytes"]] = w.file_bytes
    start, end = w.cached_start, w.cached_end
    values[slot["cached_start_bytes"]] = start.cached_bytes if start else 0
    values[slot["cached_end_bytes"]] = end.cached_bytes if end else 0
    measured = end or start
    values[slot["residency_method"]] = spool.RESIDENCY_METHODS.index(measured.method) + 1 if measured else 0
    values[slot["residency_time"]] = time.time() if measured else 0
