"""How much of a file sits in the page cache: cachestat(2), with mincore(2) as the fallback.

cachestat (Linux 6.5, syscall 451 on every architecture) counts a file's cached pages in the
kernel without mapping it, and also reports pages evicted and recently evicted (a file that
thrashes).  mincore needs the file mapped (never read: mapping faults nothing in) and a byte per
page; it is used where cachestat is missing (ENOSYS).

Permissions (the part that bites): since Linux 5.2 (commit 134fca9063ad, "make mincore() more
conservative") mincore reports a file-backed page's real state only to a caller that owns the
file, has CAP_FOWNER, or could open it for writing; anyone else is told every page is resident.
cachestat got the same rule (returning EPERM instead of a fake answer) in the 2025 side-channel
fix.  So for a file the exporter may not write, cachestat fails with EPERM and mincore would lie:
:func:`residency` then raises :class:`Unavailable` ("permission") rather than fall back, and the
exporter reports no residency for that file instead of a made-up 100 %.  Running the exporter as
root (or with CAP_FOWNER) makes residency available for every file.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import stat
from dataclasses import dataclass

SYS_CACHESTAT = 451
PAGE = mmap.PAGESIZE
MINCORE_WINDOW = 1 << 30  # map and query at most 1 GiB at a time (a 256 KiB vector)
CAP_FOWNER = 3
_LOW_BIT = bytes(value & 1 for value in range(256))


class Unavailable(Exception):
    """Residency cannot be measured (truthfully) for this file; ``reason`` is a short label."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


@dataclass(frozen=True)
class Residency:
    size: int  # bytes in the file
    cached_bytes: int  # bytes of it in the page cache (whole pages, capped at size)
    method: str  # "cachestat" or "mincore"
    evicted_pages: int | None = None  # cachestat only: pages of the file evicted from the cache
    recently_evicted_pages: int | None = None

    @property
    def ratio(self) -> float:
        return 1.0 if self.size == 0 else self.cached_bytes / self.size


class _Range(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Cachestat(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64) for name in
                ("nr_cache", "nr_dirty", "nr_writeback", "nr_evicted", "nr_recently_evicted")]


_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
_MAP_FAILED = ctypes.c_void_p(-1).value
_cachestat_missing = False


def cachestat(fd: int) -> _Cachestat:
    """The whole file's cachestat; OSError with the kernel's errno on failure."""
    result = _Cachestat()
    span = _Range(0, 0)  # len 0: to the end of the file
    if _libc.syscall(ctypes.c_long(SYS_CACHESTAT), ctypes.c_int(fd), ctypes.byref(span), ctypes.byref(result),
                     ctypes.c_uint(0)) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))
    return result


def mincore_pages(fd: int, size: int) -> int:
    """Resident pages of the first ``size`` bytes of ``fd`` by mincore (see the module note on trust)."""
    resident = 0
    offset = 0
    while offset < size:
        length = min(MINCORE_WINDOW, size - offset)
        address = _libc.mmap(None, length, mmap.PROT_READ, mmap.MAP_SHARED, fd, offset)
        if address is None or address == _MAP_FAILED:
            code = ctypes.get_errno()
            raise OSError(code, os.strerror(code))
        try:
            vector = (ctypes.c_ubyte * ((length + PAGE - 1) // PAGE))()
            if _libc.mincore(address, length, vector) != 0:
                code = ctypes.get_errno()
                raise OSError(code, os.strerror(code))
            resident += bytes(vector).translate(_LOW_BIT).count(1)
        finally:
            _libc.munmap(address, length)
        offset += length
    return resident


def _has_cap_fowner() -> bool:
    try:
        with open("/proc/self/status") as handle:
            for line in handle:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> CAP_FOWNER & 1)
    except (OSError, ValueError):
        pass
    return os.geteuid() == 0


def mincore_trustworthy(path: str, st: os.stat_result) -> bool:
    """Whether the kernel tells this process the truth about the file's pages (the 5.2 rule)."""
    return st.st_uid == os.geteuid() or _has_cap_fowner() or os.access(path, os.W_OK, effective_ids=True)


def residency(path: str, method: str = "auto") -> Residency:
    """Page-cache residency of ``path``.  ``method``: "auto" (cachestat, else mincore), "cachestat", "mincore".

    Raises Unavailable("permission") where the kernel would refuse or fake the answer,
    Unavailable("io") when the file cannot be opened, Unavailable("unsupported") when neither call
    exists, Unavailable("not_regular") for anything but a regular file.
    """
    global _cachestat_missing
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as exc:
        raise Unavailable("permission" if exc.errno in (errno.EACCES, errno.EPERM) else "io", str(exc)) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise Unavailable("not_regular", f"{path} is not a regular file")
        if method in ("auto", "cachestat") and not (_cachestat_missing and method == "auto"):
            try:
                stats = cachestat(fd)
                cached = min(stats.nr_cache * PAGE, st.st_size)
                return Residency(st.st_size, cached, "cachestat", stats.nr_evicted, stats.nr_recently_evicted)
            except OSError as exc:
                if exc.errno == errno.EPERM:
                    raise Unavailable("permission", f"cachestat refused for {path} (no write permission)") from None
                if exc.errno != errno.ENOSYS or method == "cachestat":
                    raise Unavailable("unsupported" if exc.errno == errno.ENOSYS else "io", str(exc)) from None
                _cachestat_missing = True
        if not mincore_trustworthy(path, st):
            raise Unavailable("permission", f"mincore would report {path} fully cached (no write permission)")
        try:
            pages = mincore_pages(fd, st.st_size)
        except OSError as exc:
            raise Unavailable("io", str(exc)) from None
        return Residency(st.st_size, min(pages * PAGE, st.st_size), "mincore")
    finally:
        os.close(fd)
