"""Mount tables: the one reader of mountinfo, which mount holds a file, which mounts are network or FUSE.

The source is ``/proc/<pid>/mountinfo`` (proc(5)): one line per mount,
``ID PARENT MAJ:MIN ROOT MOUNTPOINT OPTIONS [OPTIONAL...] - FSTYPE SOURCE SUPER_OPTIONS``.

Which process's table (:func:`host_file`): ``<procfs>/1/mountinfo`` (the host's init, so the host's mount
namespace when the exporter runs with the host's /proc and its pid namespace, as the DaemonSet does),
falling back to ``<procfs>/self/mountinfo`` where /proc/1 is not visible (hidepid, ProtectProc=invisible,
a container without hostPID): then the exporter sees its own namespace's mounts only (docs/mounts.md).

Every user asks one reader, :class:`MountTableWatch`, which reads the file again only when it changed.
The collectors share the host's through ``Context.host_mounts``: the mountstats collector (every network
mount, NFS mount addresses) and the engines collector (the mount of each engine file, and the st_dev ->
block device look-ups of :class:`exporter.host.blockdev.DeviceNumbers`), so after a mount or unmount they all
see the same new table, read once.

A file belongs to the mount whose MAJ:MIN equals the file's st_dev (exact even when the path means
something else in the exporter's namespace: an inference pod's /models is a kubelet volume path on
the host).  Several mounts can share one st_dev (bind mounts, the same NFS export mounted twice):
the one whose mount point is the longest prefix of the path wins, else the first listed.  A file
whose st_dev no mount has (it was read in another namespace the host table does not show) falls back
to the longest mount point that is a prefix of its path.

Untrusted input, bounded: mount points are names any user of the node chose (a pod's volumes, a FUSE
mount), so at most ``MAX_BYTES`` of the file, ``MAX_LINES`` lines of at most ``MAX_LINE_CHARS`` and
``max_mounts`` mounts are read; malformed lines are counted and skipped, never fatal.
"""

from __future__ import annotations

import os
import re
import select
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import BinaryIO

from . import hosttext
from .pagecache import SymlinkMet, Unavailable, walk_nofollow
from .procstat import whole_number

MAX_BYTES = 8 << 20  # a node with thousands of pod volumes has a mountinfo of a few hundred KiB
DEFAULT_MAX_MOUNTS = 10_000
MAX_LINES = 50_000  # lines looked at, junk included: the rest of a longer file is not
# The kernel's longest line: two escaped PATH_MAX paths (root and mount point, 16 KiB each), a source,
# and the options, where an overlay lists every layer directory (about 16 KiB for a hundred layers).
MAX_LINE_CHARS = 128 << 10

# Filesystems whose data lives on another machine (or behind a FUSE daemon, which is usually an
# object store or a network filesystem client): no local block device carries their IO.
NETWORK_FSTYPES = frozenset({
    "nfs", "nfs4", "cifs", "smb3", "smbfs", "ceph", "glusterfs", "lustre", "9p", "afs", "beegfs",
    "gpfs", "wekafs", "orangefs", "pvfs2", "ocfs2", "gfs2", "virtiofs", "fuse", "davfs", "ncpfs",
})


def is_network(fstype: str) -> bool:
    """Network filesystems and FUSE mounts (``fuse.s3fs``, ``fuse.juicefs``...; not ``fuseblk``,
    which is a local block device behind FUSE, like ntfs-3g)."""
    return fstype in NETWORK_FSTYPES or fstype.startswith("fuse.")


@dataclass(frozen=True)
class MountPoint:
    mount_id: int  # unique within its mount namespace: the mnt_id /proc/<pid>/fdinfo names
    dev: tuple[int, int]
    root: str
    mountpoint: str
    fstype: str
    source: str
    super_options: str

    def option(self, name: str) -> str | None:
        """A super option's value (``addr`` of an NFS mount, ``upperdir`` of an overlay), or None."""
        for item in self.super_options.split(","):
            key, _, value = item.partition("=")
            if key == name:
                return unescape(value)
        return None


@dataclass
class MountTable:
    mounts: list[MountPoint] = field(default_factory=list)
    malformed: int = 0  # lines that made no sense, skipped
    dropped: int = 0  # mounts past the cap
    source: str = ""  # the file read ("" when none could be)
    by_dev: dict[tuple[int, int], list[MountPoint]] = field(default_factory=dict)
    _by_point: dict[str, MountPoint] | None = field(default=None, repr=False, compare=False)  # by_mountpoint()
    _by_id: dict[int, MountPoint] | None = field(default=None, repr=False, compare=False)  # by_id()

    def of_file(self, dev: tuple[int, int], path: str) -> MountPoint | None:
        """The mount holding a file with st_dev ``dev`` at ``path`` (see the module docstring)."""
        candidates = self.by_dev.get(dev)
        if candidates:
            if len(candidates) == 1:
                return candidates[0]
            return _longest_prefix(candidates, path) or candidates[0]
        return self.holding(path)

    def holding(self, path: str) -> MountPoint | None:
        """The mount whose mount point is the longest prefix of ``path`` (by name: nothing is stat()ed),
        the last one listed where several share it.  A dictionary look-up per component of ``path``, not
        a pass over every mount: paths come from spool writers, and a node may have thousands of mounts."""
        if self._by_point is None:
            self._by_point = self.by_mountpoint()
        for prefix in _prefixes(path):
            mount = self._by_point.get(prefix)
            if mount is not None:
                return mount
        return None

    def by_mountpoint(self) -> dict[str, MountPoint]:
        """Each mount point's visible mount (the last one listed: later mounts cover earlier ones)."""
        return {mount.mountpoint: mount for mount in self.mounts}

    def by_id(self) -> dict[int, MountPoint]:
        """The mounts by mount id, what :func:`mount_id_of` answers for a descriptor (built once: a
        table is shared, and never changed once read)."""
        if self._by_id is None:
            self._by_id = {mount.mount_id: mount for mount in self.mounts}
        return self._by_id


def _prefixes(path: str) -> Iterator[str]:
    """The mount points that could hold ``path``, longest first: itself, each leading part of it that
    ends before a "/", then "/"."""
    yield path
    end = path.rfind("/")
    while end > 0:
        yield path[:end]
        end = path.rfind("/", 0, end)
    if path.startswith("/"):
        yield "/"


def _longest_prefix(mounts: list[MountPoint], path: str) -> MountPoint | None:
    best: MountPoint | None = None
    for mount in mounts:
        point = mount.mountpoint
        inside = path == point or path.startswith(point if point.endswith("/") else point + "/")
        if inside and (best is None or len(point) >= len(best.mountpoint)):
            best = mount
    return best


# --- the parser: one line, one file --------------------------------------------------------------------

_ESCAPE = re.compile(r"\\([0-3][0-7]{2})")  # the kernel escapes bytes: \000 to \377, nothing above


def unescape(text: str) -> str:
    """mountinfo and mountstats write space, tab, newline and backslash as octal escapes (\\040 ...).  A
    byte of 0x80 or more becomes what os.fsdecode makes of it (hosttext.decode), so a mount point compares
    equal to the paths under it as os.readlink names them."""
    return _ESCAPE.sub(lambda match: hosttext.decode(bytes((int(match[1], 8),))), text) if "\\" in text else text


def parse_line(line: str) -> MountPoint | None:
    """One mountinfo line, or None when it makes no sense or is longer than any the kernel writes."""
    if len(line) > MAX_LINE_CHARS:
        return None
    # Split at ASCII spaces only: the kernel escapes space, tab, newline and backslash in names, but
    # leaves the other characters str.split() would split at (\x1c, \x85, U+00A0) in a mount point.
    fields = [item for item in line.split(" ") if item]
    try:
        dash = fields.index("-", 6)  # the separator comes after the six fixed fields and any optional ones
    except ValueError:
        return None
    if len(fields) < dash + 3:
        return None
    mount_id = whole_number(fields[0])
    major, colon, minor = fields[2].partition(":")
    numbers = (whole_number(major), whole_number(minor))
    if mount_id is None or not colon or numbers[0] is None or numbers[1] is None:
        return None
    tail = fields[dash + 1:]
    return MountPoint(mount_id, (numbers[0], numbers[1]), unescape(fields[3]), unescape(fields[4]), tail[0],
                      unescape(tail[1]), tail[2] if len(tail) > 2 else "")


def parse(text: str, max_mounts: int = DEFAULT_MAX_MOUNTS) -> MountTable:
    """A mount table of mountinfo text: MAX_LINES lines looked at, at most, and ``max_mounts`` mounts kept."""
    table = MountTable()
    lines = text.split("\n", MAX_LINES)  # the item past MAX_LINES, if any, is the unread rest
    for line in lines[:MAX_LINES]:
        if not line or line.isspace():
            continue
        mount = parse_line(line)
        if mount is None:
            table.malformed += 1
        elif len(table.mounts) >= max_mounts:
            table.dropped += 1
        else:
            table.mounts.append(mount)
            table.by_dev.setdefault(mount.dev, []).append(mount)
    return table


def read_bounded(path: str, limit: int = MAX_BYTES) -> str:
    """At most ``limit`` bytes of a /proc file as text (OSError when it cannot be opened)."""
    with open(path, "rb") as handle:
        return _text_of(handle, limit)


def _text_of(handle: BinaryIO, limit: int = MAX_BYTES) -> str:
    return hosttext.decode(handle.read(limit))


def read_file(path: str, max_mounts: int = DEFAULT_MAX_MOUNTS) -> MountTable:
    """One mountinfo file read once, for one-shot look-ups; an empty table (``source`` "") when it cannot
    be read.  What is read more than once goes through a :class:`MountTableWatch`."""
    try:
        text = read_bounded(path)
    except OSError:
        return MountTable()
    table = parse(text, max_mounts)
    table.source = path
    return table


def host_file(procfs: str, name: str) -> str:
    """``<procfs>/1/<name>`` when it can be read (the host's mount namespace), else ``<procfs>/self/<name>``."""
    host = os.path.join(procfs, "1", name)
    return host if os.access(host, os.R_OK) else os.path.join(procfs, "self", name)


# --- the reader every user shares ----------------------------------------------------------------------

FileIdentity = tuple[int, int, int, int]  # st_dev, st_ino, st_size, st_mtime_ns


def _identity(st: os.stat_result) -> FileIdentity:
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


class MountTableWatch:
    """A mount table, read again only when it changed: the one reader of mountinfo every user asks.

    Which file: the host's (:func:`host_file`), picked at each open; with ``own``, the exporter's own
    ``<procfs>/self/mountinfo`` (the mount ids /proc/self/fdinfo gives are of its namespace).

    A change is seen two ways, both cheap enough to check at every call:

    * the kernel's word: a mountinfo file is pollable: poll() on an open descriptor reports
      POLLPRI|POLLERR once the mount namespace's table changed since the last poll (proc(5)).  A poll
      with no timeout costs a few microseconds; parsing the table cost about 0.5 ms on a node of 20
      mounts, more than diskstats and pressure together;
    * the file's: a table in a plain file (a copy of a node's, a test's) says nothing to poll(), so its
      path naming another file, or the file another size or mtime, is a change too.  A procfs mountinfo
      never looks changed this way: its inode, size (0) and mtime stay while it is held open.

    A file that cannot be opened is tried again at most every ``retry`` seconds, with an empty table
    meanwhile.  Thread-safe: scrapes and background samplers ask the same watch.
    """

    def __init__(self, procfs: str = "/proc", *, own: bool = False, max_mounts: int = DEFAULT_MAX_MOUNTS,
                 retry: float = 10.0) -> None:
        self.procfs = procfs
        self.own = own
        self.max_mounts = max_mounts
        self.retry = retry
        self._lock = threading.Lock()
        self._poll = select.poll()
        self._handle: BinaryIO | None = None
        self._path = ""
        self._identity: FileIdentity | None = None
        self._table = MountTable()
        self._failed_at: float | None = None

    def path(self) -> str:
        """The file the next open reads."""
        return os.path.join(self.procfs, "self", "mountinfo") if self.own else host_file(self.procfs, "mountinfo")

    def table(self) -> MountTable:
        """The current table; a new object only when it was read again (callers may compare by identity).
        Shared: nobody changes it."""
        with self._lock:
            if self._handle is not None and self._replaced():
                self._close()
            if self._handle is None:
                self._open()
            elif self._poll.poll(0):
                self._read()
            return self._table

    def close(self) -> None:
        with self._lock:
            self._close()

    def _replaced(self) -> bool:
        try:
            return _identity(os.stat(self._path)) != self._identity
        except OSError:
            return True

    def _open(self) -> None:
        now = time.monotonic()
        if self._failed_at is not None and now - self._failed_at < self.retry:
            return
        path = self.path()
        try:
            handle = open(path, "rb")  # noqa: SIM115  (held open: poll() watches it)
        except OSError:
            self._failed(now)
            return
        self._handle, self._path = handle, path
        self._poll.register(handle.fileno(), select.POLLPRI | select.POLLERR)
        self._read()

    def _read(self) -> None:
        assert self._handle is not None
        try:
            # Taken before the read: a change while it reads shows at the next call.
            self._identity = _identity(os.fstat(self._handle.fileno()))
            self._handle.seek(0)
            text = _text_of(self._handle)
        except OSError:
            self._close()
            self._failed(time.monotonic())
            return
        table = parse(text, self.max_mounts)
        table.source = self._path
        self._table = table
        self._failed_at = None

    def _failed(self, now: float) -> None:
        self._failed_at = now
        if self._table.source:  # what was read is no table now; the empty one stays the same object
            self._table = MountTable()

    def _close(self) -> None:
        if self._handle is not None:
            self._poll.unregister(self._handle.fileno())
            self._handle.close()
            self._handle = None


# --- walking a path someone else named, without waiting on a server ------------------------------------
#
# A path a spool writer names (the overlay layer directory of its MOUNT record) is the writer's word: any
# component may be a symlink (planted in its own emptyDir, pointing into a dead NFS export or a FUSE mount
# whose daemon is gone) or a directory on such a mount.  stat(), statfs() and every lookup under a mount
# that does not answer wait for as long as it does: forever, for a FUSE daemon that never replies (checked:
# fstat and fstatfs of the root of such a mount block).  Two things ask nothing of the file system a
# component lands on: opening it O_PATH|O_NOFOLLOW from its parent's descriptor (the lookup is the
# parent's; crossing onto a mount's root needs no answer from it; a symlink is opened, not followed) and
# reading /proc/self/fdinfo/<fd>, whose "mnt_id" names the mount it landed on.  So each component is
# judged by that mount, in the exporter's own mount table, *before* anything else is done with it: only
# on a file system that answers from this machine alone is it fstat'ed, and only then looked into.
# (exporter.host.pagecache's walk fstats each component first: it cannot be used for this.)

SELF_MOUNTINFO = "/proc/self/mountinfo"  # the exporter's own: the ids fdinfo gives are of its mounts
# File systems of memory (tmpfs, ramfs, devtmpfs), a container runtime's overlays of local directories, and
# ZFS (its source is a dataset, not a /dev node): local, though their source is no block device.
LOCAL_WITHOUT_DEVICE = frozenset({"tmpfs", "ramfs", "devtmpfs", "overlay", "zfs"})


def answers_locally(mount: MountPoint) -> bool:
    """Whether a lookup on ``mount`` is answered by this machine alone: a file system on a block device
    (a /dev source; not fuseblk, whose FUSE daemon answers) or one of LOCAL_WITHOUT_DEVICE.  Network
    file systems, FUSE and autofs (a lookup there waits for the automounter) are not."""
    if is_network(mount.fstype) or mount.fstype.startswith("fuse") or mount.fstype == "autofs":
        return False
    return mount.source.startswith("/dev/") or mount.fstype in LOCAL_WITHOUT_DEVICE


def mount_id_of(fd: int) -> int | None:
    """The id of the mount an open descriptor is on (/proc/self/fdinfo: procfs answers, not that mount)."""
    try:
        with open(f"/proc/self/fdinfo/{fd}", "rb") as handle:
            text = handle.read(4096).decode("ascii", "replace")
    except OSError:
        return None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key == "mnt_id":
            return whole_number(value.strip())
    return None


class Refused(Exception):  # noqa: N818  (an outcome: the path was not walked, and why)
    """A path not walked to its end: ``reason`` is symlink, not_directory, not_local (a component on a
    file system that may wait on a server or a daemon, or on no disk and no memory: proc, sysfs), unknown_mount,
    absent or not_plain."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


def open_without_waiting(root: str, path: str, table: dict[int, MountPoint]) -> tuple[int, os.stat_result]:
    """An O_PATH descriptor of ``path`` under ``root`` (the caller closes it) and its fstat; or Refused.

    ``path`` is absolute, without ``.`` or ``..``; it is walked by :func:`exporter.host.pagecache.walk_nofollow`
    from ``root``, each component judged by its mount (``table``: the exporter's own mounts by id,
    :meth:`MountTable.by_id` of ``MountTableWatch(own=True)``) before it is fstat'ed: on a file system that does not
    :func:`answer locally <answers_locally>`, or on a mount the table does not know, the walk stops
    ("not_local", "unknown_mount").  A symlink anywhere is refused, never followed; every component but the
    last must be a directory.  Nothing is opened for reading: an O_PATH open reaches no driver."""
    parts = path.split("/")
    if not path.startswith("/") or any(part in (".", "..") for part in parts):
        raise Refused("not_plain", f"{path!r} is not a plain absolute path")
    names = [part for part in parts if part]
    try:
        fd = walk_nofollow(root, names, path, before_stat=lambda fd, name: _judge_mount(fd, name, table))
    except SymlinkMet as met:
        raise Refused("symlink", f"{path}: {names[met.index]} is a symbolic link") from None
    except Unavailable as exc:
        raise Refused("absent", str(exc)) from None
    try:
        return fd, os.fstat(fd)
    except BaseException:
        os.close(fd)
        raise


def _judge_mount(fd: int, name: str, table: dict[int, MountPoint]) -> None:
    """Refused, unasked, unless the component's mount is known and answers locally."""
    number = mount_id_of(fd)
    mount = table.get(number) if number is not None else None
    if mount is None:
        raise Refused("unknown_mount", f"{name}: on a mount the exporter's mount table does not list")
    if not answers_locally(mount):
        raise Refused("not_local", f"{name}: on {mount.fstype} {mount.source}, not a local disk's or memory's")


