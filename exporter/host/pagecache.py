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
import posixpath
import stat
from collections.abc import Callable, Sequence
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
        self.st: os.stat_result | None = None  # set where the file itself was found and checked


class SymlinkMet(Unavailable):
    """A walk (:func:`walk_nofollow`) met a symbolic link: which part it is and what the link says."""

    def __init__(self, detail: str, index: int, target: str) -> None:
        super().__init__("symlink", detail)
        self.index = index  # into the parts walked
        self.target = target  # the link's text, as readlink gives it


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


# --------------------------------------------------------------------------------------------------
# Opening a file someone else named (a spool writer's engine path): only what that writer could load
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Claim:
    """An engine file as a spool writer reported it: where, which inode, and who the writer is."""

    path: str  # absolute, in the writer's view (the exporter finds it under --path.rootfs)
    dev: tuple[int, int]  # st_dev (major, minor) the writer saw
    ino: int  # st_ino the writer saw; 0 (not recorded) means "do not open"
    uids: frozenset[int]  # owners of the spool files that name it: the writers


def _inside(parts: list[str], roots: tuple[str, ...]) -> bool:
    for root in roots:
        prefix = [part for part in root.split("/") if part]
        if parts[: len(prefix)] == prefix:
            return True
    return False


def _writer_may(st: os.stat_result, uids: frozenset[int], bit_user: int, bit_other: int) -> bool:
    """Whether one of the writers could have had that access by the mode bits (root always could).
    Group bits are not taken: the writer's groups are not known here (a group-only file is refused)."""
    return bool(st.st_mode & bit_other) or any(uid == 0 or (uid == st.st_uid and st.st_mode & bit_user)
                                               for uid in uids)


def open_claimed(rootfs: str, claim: Claim, allowed: tuple[str, ...]) -> tuple[int, os.stat_result]:
    """Open, read-only, the regular file ``claim`` names, under ``rootfs``; or raise Unavailable.

    Nothing a writer says can make this open anything else (each check comes before any open that
    could have an effect):

    * ``ino`` 0 is not opened ("unverified"); the path must be absolute, without ``..`` or ``.``, inside
      one of ``allowed`` ("outside_paths");
    * the walk goes component by component from ``rootfs`` with O_PATH|O_NOFOLLOW (an O_PATH open
      touches no driver and follows no link, so ``..`` and symlinks cannot leave ``rootfs``): a
      symlink anywhere is refused ("symlink"), and every directory must be searchable by a writer
      ("writer_permission");
    * the last component is opened O_PATH and fstat'ed: anything but a regular file (FIFO, device,
      socket) is refused ("not_regular") before it is ever opened for reading; another device or
      inode than the writer reported is "not_visible"; a file no writer could read, "writer_permission";
    * only then is it reopened for reading through /proc/self/fd (the very inode), O_NONBLOCK.

    Returns the readable descriptor (the caller closes it) and its stat.
    """
    if claim.ino == 0:
        raise Unavailable("unverified", f"{claim.path}: the writer recorded no inode")
    parts = claim.path.split("/")
    if not claim.path.startswith("/") or any(part in (".", "..") for part in parts):
        raise Unavailable("outside_paths", f"{claim.path}: not a plain absolute path")
    parts = [part for part in parts if part]
    if not parts or not _inside(parts, allowed):
        raise Unavailable("outside_paths", f"{claim.path}: outside --collector.engines.path-include")
    fd = walk_nofollow(rootfs, parts, claim.path, _writer_may_enter(claim))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise Unavailable("not_regular", f"{claim.path} is not a regular file")
        if (os.major(st.st_dev), os.minor(st.st_dev)) != claim.dev or st.st_ino != claim.ino:
            raise Unavailable("not_visible", f"{claim.path}: another file than the writer loaded")
        if not _writer_may(st, claim.uids, stat.S_IRUSR, stat.S_IROTH):
            raise Unavailable("writer_permission", f"{claim.path}: no writer could read it")
        readable = _reopen(fd)
    finally:
        os.close(fd)
    return readable, st


def _writer_may_enter(claim: Claim) -> Callable[[os.stat_result, str], None]:
    """open_claimed's rule for each directory on the way: one of the writers may search it."""
    def check(st: os.stat_result, part: str) -> None:
        if not _writer_may(st, claim.uids, stat.S_IXUSR, stat.S_IXOTH):
            raise Unavailable("writer_permission", f"{claim.path}: no writer may enter {part}")
    return check


def walk_nofollow(start: str, parts: Sequence[str], shown: str,
                  check_dir: Callable[[os.stat_result, str], None] | None = None,
                  before_stat: Callable[[int, str], None] | None = None) -> int:
    """An O_PATH descriptor of ``parts`` under the directory ``start``, no link followed; the caller closes it.

    ``start`` is opened as the kernel resolves it; then each part is opened O_PATH|O_NOFOLLOW relative to
    the one before (an O_PATH open touches no driver and follows no link, so neither ``..`` nor a symlink
    leaves ``start``).  A symbolic link, the last part included, raises :class:`SymlinkMet` (what it says
    is read from the link's own descriptor); a part on the way that is not a directory, or that cannot
    be opened, raises Unavailable("not_visible"); ``check_dir`` sees each directory on the way (its stat,
    its name) and raises to refuse it.  ``before_stat`` sees each descriptor (``start``'s too) and its
    name as soon as it is opened, before anything asks its file system (an fstat of the root of a hung
    FUSE or NFS mount waits for ever), and raises to refuse it.  ``shown`` is the path as messages name it.
    """
    flags = os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        current = os.open(start or "/", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise Unavailable("not_visible", f"{shown}: {start}: {exc.strerror}") from None
    try:
        if before_stat is not None:
            before_stat(current, start or "/")
        for index, part in enumerate(parts):
            try:
                following = os.open(part, flags, dir_fd=current)
            except OSError as exc:
                raise Unavailable("not_visible", f"{shown}: {exc.strerror}") from None
            os.close(current)
            current = following
            if before_stat is not None:
                before_stat(current, part)
            st = os.fstat(current)
            if stat.S_ISLNK(st.st_mode):
                raise SymlinkMet(f"{shown}: {part} is a symbolic link", index, os.readlink("", dir_fd=current))
            if index == len(parts) - 1:
                break
            if not stat.S_ISDIR(st.st_mode):
                raise Unavailable("not_visible", f"{shown}: {part} is not a directory")
            if check_dir is not None:
                check_dir(st, part)
    except BaseException:
        os.close(current)
        raise
    return current


def _reopen(path_fd: int, shown: str | None = None) -> int:
    """Open for reading the inode an O_PATH descriptor holds (already known to be a regular file);
    a refusal's message names ``shown`` where given."""
    try:
        return os.open(f"/proc/self/fd/{path_fd}", os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        detail = str(exc) if shown is None else f"{shown}: {exc.strerror}"
        raise Unavailable("permission" if exc.errno in (errno.EACCES, errno.EPERM) else "io", detail) from None


# --------------------------------------------------------------------------------------------------
# Opening a file a command line named (gpuio warm, often as root): only inside the paths it named
# --------------------------------------------------------------------------------------------------

MAX_LINKS = 8  # symbolic links followed from one named path to another, at most (a -> b -> a ends)

# Kernel interfaces that look like regular files (statfs f_type, linux/magic.h): reading one asks the kernel
# to make its content (/proc/self/pagemap: 8 bytes for every page of the address space, hundreds of GiB),
# and none is on a disk, so none is a file to warm or evict.  Told by the descriptor's filesystem, not by
# the name: a bind mount or a second procfs mount elsewhere is the same filesystem.
PSEUDO_FILESYSTEMS = {
    0x9FA0: "procfs (/proc)", 0x62656572: "sysfs (/sys)", 0x64626720: "debugfs", 0x74726163: "tracefs",
    0x73636673: "securityfs", 0x27E0EB: "cgroupfs", 0x63677270: "cgroup2fs", 0xCAFE4A11: "bpffs",
    0x62656570: "configfs", 0x6165676C: "pstorefs", 0xDE5E81E4: "efivarfs", 0xF97CFF8C: "selinuxfs",
}


class _Statfs(ctypes.Structure):
    # f_type (__fsword_t: a long on x86-64 and arm64), then fields not read here; padded past struct statfs
    _fields_ = [("f_type", ctypes.c_long), ("_rest", ctypes.c_byte * 256)]


_libc.fstatfs.argtypes = [ctypes.c_int, ctypes.c_void_p]


def filesystem_type(fd: int) -> int:
    """statfs f_type of the filesystem ``fd`` is on (an O_PATH descriptor will do: Linux 3.12+)."""
    result = _Statfs()
    if _libc.fstatfs(fd, ctypes.byref(result)) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))
    return result.f_type & 0xFFFFFFFF  # the magic numbers are 32-bit; a signed long would sign-extend


class NamedPaths:
    """The paths a command line named — each argument, each path one of its globs matched — by name:
    absolute, ``..`` resolved in the name, no link resolved.  Each has an anchor: the directory part
    typed before any glob wildcard (for a plain path, its directory).  The anchor is the user's own
    choice and is resolved as the kernel does; below it, nothing is followed but links to named paths.
    """

    def __init__(self) -> None:
        self._anchors: dict[str, str] = {}

    def add(self, path: str, anchor: str) -> None:
        self._anchors[lexical(path)] = lexical(anchor)

    def holding(self, path: str) -> str | None:
        """The named path that ``path`` is, or lies under; None if none does."""
        candidate = path
        while candidate not in self._anchors:
            if candidate == "/":
                return None
            candidate = posixpath.dirname(candidate)
        return candidate

    def anchor(self, named: str) -> str:
        return self._anchors[named]


def lexical(path: str) -> str:
    """``path`` made absolute and normal by name alone (``..`` drops the part before it, no link is read)."""
    normal = posixpath.normpath(posixpath.join(os.getcwd(), path))
    return "/" + normal.lstrip("/")  # normpath keeps a leading "//"


def open_named(path: str, named: NamedPaths) -> tuple[int, os.stat_result]:
    """Open for reading the regular file at ``path`` (one of ``named``), never leaving the named paths.

    The walk is :func:`walk_nofollow` from the path's anchor.  A symbolic link met below the anchor is
    resolved by name (its text against the directory it sits in, the path's remaining parts after it)
    and followed only where that lands on or under a named path, by walking again from that path's
    anchor; anything else is refused ("outside_named"), as is a chain of more than MAX_LINKS links.
    The file must be a regular file ("not_regular") and on a disk, not a kernel interface such as /proc
    or /sys ("pseudo_fs", by the filesystem's magic number); only then is it opened for reading.
    Returns the readable descriptor (the caller closes it) and its stat; raises Unavailable.
    """
    where = lexical(path)
    for _ in range(MAX_LINKS + 1):
        holder = named.holding(where)
        if holder is None:
            raise Unavailable("outside_named", f"{path}: not one of the paths named")
        anchor = named.anchor(holder)
        parts = [part for part in posixpath.relpath(where, anchor).split("/") if part not in ("", ".")]
        try:
            fd = walk_nofollow(anchor, parts, path)
        except SymlinkMet as link:
            where = _landing(path, anchor, parts, link, named)
            continue
        return _open_checked(fd, path)
    raise Unavailable("outside_named", f"{path}: more than {MAX_LINKS} symbolic links")


def _landing(path: str, anchor: str, parts: list[str], link: SymlinkMet, named: NamedPaths) -> str:
    """Where following ``link`` leads (by name), if that is on or under a named path; else Unavailable."""
    directory = posixpath.join(anchor, *parts[: link.index])
    landing = lexical(posixpath.join(directory, link.target, *parts[link.index + 1:]))
    if named.holding(landing) is None:
        raise Unavailable("outside_named", f"{path}: {posixpath.join(directory, parts[link.index])} is a "
                          f"symbolic link to {link.target}, outside the paths named (name its target too)")
    return landing


def _open_checked(path_fd: int, shown: str) -> tuple[int, os.stat_result]:
    """The O_PATH descriptor ``path_fd`` (closed here) reopened for reading, if a regular file on a disk."""
    try:
        st = os.fstat(path_fd)
        if not stat.S_ISREG(st.st_mode):
            raise Unavailable("not_regular", f"{shown}: not a regular file")
        kind = PSEUDO_FILESYSTEMS.get(filesystem_type(path_fd))
        if kind is not None:
            raise Unavailable("pseudo_fs", f"{shown}: on {kind}, a kernel interface, not a file on a disk")
        return _reopen(path_fd, shown), st
    finally:
        os.close(path_fd)


def residency_of_claim(rootfs: str, claim: Claim, allowed: tuple[str, ...]) -> tuple[os.stat_result, Residency]:
    """Stat and residency of a writer-named engine file, checked by :func:`open_claimed`.

    Raises Unavailable with the reason; the stat of a file that passed every check but whose
    residency cannot be measured is on the exception's ``st``.
    """
    fd, st = open_claimed(rootfs, claim, allowed)
    try:
        return st, residency_fd(fd, st, f"/proc/self/fd/{fd}", "auto")
    except Unavailable as exc:
        exc.st = st
        raise
    finally:
        os.close(fd)


def residency(path: str, method: str = "auto") -> Residency:
    """Page-cache residency of ``path``.  ``method``: "auto" (cachestat, else mincore), "cachestat", "mincore".

    Raises Unavailable("permission") where the kernel would refuse or fake the answer,
    Unavailable("io") when the file cannot be opened, Unavailable("unsupported") when neither call
    exists, Unavailable("not_regular") for anything but a regular file (never opened for reading).
    """
    fd, st = open_regular(path)
    try:
        return residency_fd(fd, st, path, method)
    finally:
        os.close(fd)


def open_regular(path: str, follow: bool = True) -> tuple[int, os.stat_result]:
    """A read-only descriptor of ``path`` and its stat, if it is a regular file; else Unavailable.

    The type is checked on an O_PATH descriptor before the file is opened for reading, so a FIFO is
    never waited on and a device node's driver never sees an open (a watchdog would arm, /dev/ptmx
    would make a terminal).  ``follow=False`` refuses a symbolic link as the last component.
    """
    try:
        path_fd = os.open(path, os.O_PATH | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW))
    except OSError as exc:
        raise Unavailable("permission" if exc.errno in (errno.EACCES, errno.EPERM) else "io", str(exc)) from None
    try:
        st = os.fstat(path_fd)
        if stat.S_ISLNK(st.st_mode):
            raise Unavailable("symlink", f"{path} is a symbolic link")
        if not stat.S_ISREG(st.st_mode):
            raise Unavailable("not_regular", f"{path} is not a regular file")
        return _reopen(path_fd), st
    finally:
        os.close(path_fd)


def residency_fd(fd: int, st: os.stat_result, path: str, method: str) -> Residency:
    global _cachestat_missing
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
