"""The host's cgroup tree as the cgroup_io collector reads it: where it is, a bounded walk, and the parsers
of the files that count each cgroup's block IO (cgroup v2 ``io.stat`` and ``io.pressure``, cgroup v1 blkio).

**Where.**  ``<sysfs>/fs/cgroup``: cgroup v2 (the unified hierarchy, as on the GPU hosts and every current
distribution) when that directory holds ``cgroup.controllers``; else cgroup v1's blkio hierarchy at
``<sysfs>/fs/cgroup/blkio`` (legacy and hybrid hosts).  A hybrid host's unified tree
(``fs/cgroup/unified``) has io.pressure for systemd's units but no IO counters: it is not read.

**What the kernel writes** (Documentation/admin-guide/cgroup-v2.rst "IO Interface Files", block/
blk-cgroup.c ``blkcg_print_one_stat``; cgroup-v1/blkio-controller.rst, block/blk-cgroup-rwstat.c):

* v2 ``io.stat``: one line per device, keyed by the whole disk's ``MAJ:MIN``, in no order:
  ``259:0 rbytes=N wbytes=N rios=N wios=N dbytes=N dios=N`` (no ``dbytes``/``dios`` before 4.19).
  A device whose counters are all zero gets its line without them (``259:0 `` alone, or only an IO
  policy's own keys); policies append keys of their own (iocost ``cost.vrate=``..., iolatency
  ``depth= avg_lat= win=``, debug ``use_delay=``), which are skipped.  The counters are the cgroup's
  *and its descendants'* (rstat adds children up, removed ones included), counted when a bio is issued.
* v2 ``io.pressure``: PSI's two lines, ``some avg10=.. avg60=.. avg300=.. total=<µs>`` and ``full ...``,
  for the cgroup's tasks and its descendants'.
* v1 ``blkio.throttle.io_service_bytes`` and ``blkio.throttle.io_serviced``: per device the lines
  ``MAJ:MIN Read N``, ``Write``, ``Sync``, ``Async``, ``Discard`` (4.19+) and ``Total``, then one
  ``Total N`` over all devices.  Only the cgroup's *own* tasks (the ``_recursive`` twins add its
  descendants).  Linux 6.10+ counts them only on devices where blk-throttle is active (a throttle limit
  was once set on the device, in any cgroup: commit a3166c51702b); older kernels on every device.

**Which cgroups rank** (are compared for "who does the IO"): a v2 parent's io.stat repeats its
children's, so only the deepest cgroups carrying io.stat rank: those without child cgroups, or whose
children have no io controller (``cgroup.subtree_control`` without ``io``: then the parent is where their
IO is counted, e.g. all of system.slice on a host where systemd enables no io accounting for services).
v2's "no internal processes" rule keeps tasks in exactly those.  A v1 cgroup's counters are its own, so
every v1 cgroup but the root ranks.  io.pressure ranks in cgroups without child cgroups.  The root is
never read: it is the whole node (the diskstats and pressure collectors).

**Bounds** (anything may create cgroups: a delegated user session, a container with write access to its
cgroup namespace): a walk reads at most ``max_cgroups`` cgroups, breadth first with each directory's
children in name order (so the shallow cgroups where kubepods and system services live are read
before anything a delegated subtree nests below them) and none deeper than MAX_DEPTH; at most
MAX_FILE_BYTES of any file (the rest is a ``truncated`` bad line); a line longer than MAX_LINE_CHARS is
bad; numbers go through :func:`~exporter.host.procstat.whole_number` (at most 20 digits).  A bad line fails
only itself.  Path labels are at most MAX_PATH_CHARS characters (a longer path is cut and keeps a hash
of the whole, so two stay apart) and a byte of a name that is not UTF-8 shows as ``\\xNN`` (names are kept as
str, such bytes as surrogates, os.fsdecode, until the label is made: nothing raises on them).  A cgroup whose
path passes PATH_MAX (4096 bytes: nesting 32 levels of 255-byte names makes 8 KiB) cannot be opened by its
path (ENAMETOOLONG): each directory is opened once (a path that long a piece at a time, each piece relative
to the directory the last one opened, openat) and its files are read relative to it, so it is read like any
other.  A directory that is there but cannot be opened is counted with those left out (``skipped``); one
removed while the walk goes on is not.

**Owners** (for :mod:`exporter.pods.cgroup`'s rule 3: a pod's directory is believed where it and its
ancestors are root's): each reading says how many of its leading segments are directories owned by root, as
are all above them (``root_owned``), from the fstat() of the directory the walk opens anyway; None where the
hierarchy's root is not root's (owners tell nothing there).
"""

from __future__ import annotations

import errno
import hashlib
import os
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from . import hosttext, procstat
from .lines import BadLine
from .procstat import whole_number
from .psi import parse_total

MAX_DEPTH = 32
MAX_FILE_BYTES = 64 << 10  # io.stat: ~100 bytes a device (~300 with iocost's keys); v1: ~6 lines a device
MAX_LINE_CHARS = 4096
MAX_PATH_CHARS = 512  # a kind node's container path is ~260
MAX_LISTED = 1 << 16  # entries of one directory looked at (a cgroup directory holds ~40 files)
PATH_MAX = 4096  # bytes of a path the kernel takes, its NUL included (linux/limits.h)
_DIRECTORY = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC

V1, V2 = "v1", "v2"
# The sources named in gpuio_scrape_collector_dropped_lines_total.
IO_STAT, IO_PRESSURE = "cgroup/io.stat", "cgroup/io.pressure"
BLKIO_BYTES, BLKIO_IOS = "cgroup/blkio.throttle.io_service_bytes", "cgroup/blkio.throttle.io_serviced"

DeviceNumber = tuple[int, int]  # (major, minor)
# Told of each bad line: (source, reason, the line).
BadLineSink = Callable[[str, str, str], None]


@dataclass(frozen=True)
class DeviceIo:
    """One cgroup's IO on one device.  Discards are None where the kernel writes none (before 4.19)."""

    read_bytes: int
    written_bytes: int
    reads: int
    writes: int
    discarded_bytes: int | None = None
    discards: int | None = None

    @property
    def moved_bytes(self) -> int:
        """Bytes read and written: what cgroups are ranked by."""
        return self.read_bytes + self.written_bytes


NO_IO = DeviceIo(0, 0, 0, 0)


@dataclass(frozen=True)
class Pressure:
    """io.pressure's totals in microseconds: some task waited ("some"), every task stalled ("full")."""

    waiting_us: int
    stalled_us: int | None


@dataclass
class CgroupReading:
    """What one walk read of one cgroup."""

    path: str  # relative to the hierarchy's root, "/"-separated, bounded (see label_of)
    io: dict[DeviceNumber, DeviceIo] = field(default_factory=dict)
    pressure: Pressure | None = None
    ranks_io: bool = False  # its IO counters are its workload's own (see the module note)
    ranks_pressure: bool = False
    # How many leading segments of the path are directories owned by root, as are all above them; None where
    # the hierarchy's root is not root's (exporter.pods.cgroup, rule 3).
    root_owned: int | None = None


@dataclass(frozen=True)
class Hierarchy:
    version: str  # V1 or V2
    root: str  # the hierarchy's root directory


@dataclass
class Walk:
    hierarchy: Hierarchy
    cgroups: list[CgroupReading] = field(default_factory=list)
    skipped: int = 0  # cgroups found but not read (past max_cgroups or MAX_DEPTH, unopenable): at least this many


def find_hierarchy(sysfs: str) -> Hierarchy | None:
    """The hierarchy that counts block IO per cgroup under ``sysfs``, or None when there is none."""
    mount = os.path.join(sysfs, "fs", "cgroup")
    if os.path.isfile(os.path.join(mount, "cgroup.controllers")):
        return Hierarchy(V2, mount)
    blkio = os.path.join(mount, "blkio")
    if os.path.isfile(os.path.join(blkio, "blkio.throttle.io_service_bytes")):
        return Hierarchy(V1, blkio)
    return None


# --- parsers: one line at a time, BadLine for a line they cannot use ----------------------------------


def parse_device(text: str) -> DeviceNumber:
    """``MAJ:MIN`` as two numbers."""
    major, colon, minor = text.partition(":")
    numbers = whole_number(major), whole_number(minor)
    if not colon or numbers[0] is None or numbers[1] is None:
        raise BadLine("bad_device", "the first field is not MAJ:MIN")
    return numbers[0], numbers[1]


IO_STAT_KEYS = ("rbytes", "wbytes", "rios", "wios", "dbytes", "dios")


def parse_io_stat_line(line: str) -> tuple[DeviceNumber, DeviceIo]:
    """One line of a v2 io.stat.  Keys of IO policies are skipped; a line with none of the counters is a
    device whose counters are all zero."""
    if len(line) > MAX_LINE_CHARS:
        raise BadLine("too_long", f"longer than {MAX_LINE_CHARS} characters")
    fields = line.split()
    device = parse_device(fields[0] if fields else "")
    found: dict[str, int] = {}
    for item in fields[1:]:
        key, _, value = item.partition("=")
        if key not in IO_STAT_KEYS:
            continue  # cost.vrate=, avg_lat=, use_delay=...: another policy's
        if key in found:
            raise BadLine("repeated", f"{key} given twice")
        number = whole_number(value)
        if number is None:
            raise BadLine("non_numeric", f"{key} is not a whole number of at most 20 digits")
        found[key] = number
    if not found:
        return device, NO_IO
    if not all(key in found for key in IO_STAT_KEYS[:4]):
        raise BadLine("incomplete", "rbytes, wbytes, rios and wios are written together")
    has_discards = "dbytes" in found and "dios" in found
    return device, DeviceIo(found["rbytes"], found["wbytes"], found["rios"], found["wios"],
                            found["dbytes"] if has_discards else None, found["dios"] if has_discards else None)


BLKIO_OPERATIONS = ("Read", "Write", "Sync", "Async", "Discard", "Total")


def parse_blkio_line(line: str) -> tuple[DeviceNumber, str, int] | None:
    """One line of a v1 blkio rwstat file: ``(device, operation, value)``; None for the last line's
    total over all devices."""
    if len(line) > MAX_LINE_CHARS:
        raise BadLine("too_long", f"longer than {MAX_LINE_CHARS} characters")
    fields = line.split()
    if len(fields) == 2 and fields[0] == "Total":
        if whole_number(fields[1]) is None:
            raise BadLine("non_numeric", "the total is not a whole number of at most 20 digits")
        return None
    if len(fields) != 3:
        raise BadLine("field_count", f"{len(fields)} fields, 3 expected")
    device = parse_device(fields[0])
    if fields[1] not in BLKIO_OPERATIONS:
        raise BadLine("unknown_operation", "not Read, Write, Sync, Async, Discard or Total")
    value = whole_number(fields[2])
    if value is None:
        raise BadLine("non_numeric", "not a whole number of at most 20 digits")
    return device, fields[1], value


def parse_pressure_line(line: str) -> tuple[str, int]:
    """``("some"|"full", total microseconds)`` of one line of io.pressure (exporter/host/psi.py), bounded in length."""
    if len(line) > MAX_LINE_CHARS:
        raise BadLine("too_long", f"longer than {MAX_LINE_CHARS} characters")
    return parse_total(line)


def _lines(text: str, cut: bool, source: str, report: BadLineSink) -> list[str]:
    """The file's complete lines; the last one is dropped (and reported) when the read was cut."""
    lines = text.split("\n")
    if cut:
        report(source, "truncated", lines.pop()[:200])
    return [line for line in lines if line.strip()]


def parse_io_stat(text: str, cut: bool, report: BadLineSink) -> dict[DeviceNumber, DeviceIo]:
    devices: dict[DeviceNumber, DeviceIo] = {}
    for line in _lines(text, cut, IO_STAT, report):
        try:
            device, io = parse_io_stat_line(line)
            if device in devices:
                raise BadLine("repeated", "a second line for this device")
        except BadLine as bad:
            report(IO_STAT, bad.reason, line)
            continue
        devices[device] = io
    return devices


def parse_blkio(text: str, cut: bool, source: str, report: BadLineSink) -> dict[DeviceNumber, dict[str, int]]:
    """Per device, each operation's value, of one v1 rwstat file."""
    devices: dict[DeviceNumber, dict[str, int]] = {}
    for line in _lines(text, cut, source, report):
        try:
            parsed = parse_blkio_line(line)
            if parsed is None:
                continue
            device, operation, value = parsed
            if operation in devices.get(device, {}):
                raise BadLine("repeated", "a second line for this device and operation")
        except BadLine as bad:
            report(source, bad.reason, line)
            continue
        devices.setdefault(device, {})[operation] = value
    return devices


def join_blkio(service_bytes: dict[DeviceNumber, dict[str, int]],
               serviced: dict[DeviceNumber, dict[str, int]]) -> dict[DeviceNumber, DeviceIo]:
    """The v1 byte and operation counts as one DeviceIo per device.  A device missing from one file, or
    without its Read and Write lines (a device the cgroup first used between the two reads), waits for
    the next walk."""
    joined: dict[DeviceNumber, DeviceIo] = {}
    for device, octets in service_bytes.items():
        ios = serviced.get(device, {})
        if not all(op in counts for counts in (octets, ios) for op in ("Read", "Write")):
            continue
        has_discards = "Discard" in octets and "Discard" in ios
        joined[device] = DeviceIo(octets["Read"], octets["Write"], ios["Read"], ios["Write"],
                                  octets["Discard"] if has_discards else None, ios["Discard"] if has_discards else None)
    return joined


def parse_pressure(text: str, cut: bool, report: BadLineSink) -> Pressure | None:
    """io.pressure's totals; None without a good ``some`` line."""
    totals: dict[str, int] = {}
    for line in _lines(text, cut, IO_PRESSURE, report):
        try:
            kind, total = parse_pressure_line(line)
            if kind in totals:
                raise BadLine("repeated", f"a second {kind} line")
        except BadLine as bad:
            report(IO_PRESSURE, bad.reason, line)
            continue
        totals[kind] = total
    if "some" not in totals:
        return None
    return Pressure(totals["some"], totals.get("full"))


# --- reading -----------------------------------------------------------------------------------------


def read_bounded(path: str, limit: int = MAX_FILE_BYTES) -> tuple[str, bool] | None:
    """At most ``limit`` bytes of a cgroup file as text, and whether there was more; None when it cannot be
    read (gone with its cgroup, no such controller here, unreadable)."""
    return procstat.read_bounded(path, limit)


def read_bounded_at(directory: int, name: str, limit: int = MAX_FILE_BYTES) -> tuple[str, bool] | None:
    """:func:`read_bounded` of the file ``name`` in the open directory ``directory`` (whatever its path's length)."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW, dir_fd=directory)
    except OSError:
        return None
    try:
        data = procstat.read_at_most(fd, limit)
    except OSError:
        return None  # ENODEV and the like: the cgroup went after the open
    finally:
        os.close(fd)
    return data[:limit].decode("ascii", "replace"), len(data) > limit


def open_directory(path: str, follow: bool = False) -> int:
    """An fd of the directory ``path`` (a symlink only where ``follow``: the hierarchy's root, which a v1 host
    may link to a joint mount, never a cgroup).  A path of PATH_MAX bytes or more is opened a piece at a time,
    each piece shorter than PATH_MAX and relative to the directory the last one opened.  OSError as open()
    raises it."""
    raw = os.fsencode(path)
    if len(raw) < PATH_MAX:
        return os.open(raw, _DIRECTORY & ~os.O_NOFOLLOW if follow else _DIRECTORY)
    parts = raw.split(b"/")
    pieces: list[list[bytes]] = [[parts[0]]]  # b"" first for an absolute path: the piece starts at "/"
    for part in parts[1:]:
        if not part:
            continue
        if len(b"/".join([*pieces[-1], part])) >= PATH_MAX:
            pieces.append([])
        pieces[-1].append(part)
    fd = os.open(b"/".join(pieces[0]) or b".", _DIRECTORY)
    try:
        for piece in pieces[1:]:
            below = os.open(b"/".join(piece), _DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = below
    except BaseException:
        os.close(fd)
        raise
    return fd


def label_of(segments: list[str]) -> str:
    """A cgroup's path as a label value: "/"-joined from the hierarchy's root, valid UTF-8 (a byte that is
    not shown \\xNN, as every host name is: hosttext), bounded."""
    text = hosttext.visible("/" + "/".join(segments))
    if len(text) <= MAX_PATH_CHARS:
        return text
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    return f"{text[:MAX_PATH_CHARS - len(digest) - 1]}~{digest}"


def child_directories(directory: str | int, limit: int) -> tuple[list[str], bool]:
    """The first ``limit`` child directories (the child cgroups) of a directory (its path, or an open fd of
    it) by name, and whether there were more.  At most MAX_LISTED entries of a directory are looked at (the
    rest count as more).  Names are str (bytes that are not UTF-8 as surrogates, os.fsdecode)."""
    found: list[str] = []
    listed = 0
    more = False
    try:
        with os.scandir(directory) as entries:
            for entry in entries:
                listed += 1
                if listed > MAX_LISTED:
                    more = True
                    break
                try:
                    if entry.is_dir(follow_symlinks=False):
                        found.append(entry.name)
                except OSError:
                    continue
    except OSError:
        pass  # removed while the walk went on
    found.sort()
    return found[:limit], more or len(found) > limit


class Reader:
    """Reads one hierarchy's files for one cgroup, from an open fd of its directory; reports bad lines to
    ``report``."""

    def __init__(self, hierarchy: Hierarchy, report: BadLineSink) -> None:
        self.hierarchy = hierarchy
        self.report = report

    def read(self, directory: int, path: str, has_children: bool) -> CgroupReading:
        if self.hierarchy.version == V2:
            return self._read_v2(directory, path, has_children)
        return self._read_v1(directory, path)

    def _read_v2(self, directory: int, path: str, has_children: bool) -> CgroupReading:
        reading = CgroupReading(path)
        stat = read_bounded_at(directory, "io.stat")
        if stat is not None:
            reading.io = parse_io_stat(*stat, self.report)
            reading.ranks_io = not has_children or not self._io_below(directory)
        pressure = read_bounded_at(directory, "io.pressure")
        if pressure is not None:
            reading.pressure = parse_pressure(*pressure, self.report)
            reading.ranks_pressure = not has_children
        return reading

    @staticmethod
    def _io_below(directory: int) -> bool:
        """Whether the io controller is enabled for the cgroup's children (then they count their own IO)."""
        enabled = read_bounded_at(directory, "cgroup.subtree_control", 4096)
        return enabled is not None and "io" in enabled[0].split()

    def _read_v1(self, directory: int, path: str) -> CgroupReading:
        service_bytes = read_bounded_at(directory, "blkio.throttle.io_service_bytes")
        serviced = read_bounded_at(directory, "blkio.throttle.io_serviced")
        reading = CgroupReading(path, ranks_io=True)
        if service_bytes is not None and serviced is not None:
            reading.io = join_blkio(parse_blkio(*service_bytes, BLKIO_BYTES, self.report),
                                    parse_blkio(*serviced, BLKIO_IOS, self.report))
        return reading


def _root_owned(directory: int, depth: int, above: int | None) -> int | None:
    """``root_owned`` of the directory open as ``directory``, ``depth`` levels below the root, whose parent's is
    ``above`` (see CgroupReading)."""
    try:
        owner = os.fstat(directory).st_uid
    except OSError:
        owner = -1
    if depth == 0:
        return 0 if owner == 0 else None
    if above is None:
        return None
    return depth if above == depth - 1 and owner == 0 else above


def walk(hierarchy: Hierarchy, max_cgroups: int, report: BadLineSink) -> Walk:
    """Read up to ``max_cgroups`` cgroups below the root, breadth first, each directory's children in name
    order (see the module note); a cgroup removed while the walk goes on is left out, one that is there but
    cannot be opened is counted in ``skipped``."""
    reader = Reader(hierarchy, report)
    result = Walk(hierarchy)
    # (directory, path segments below the root, the parent's root_owned); the root itself is listed, never read.
    queue: deque[tuple[str, list[str], int | None]] = deque([(hierarchy.root, [], None)])
    while queue:
        directory, segments, above = queue.popleft()
        try:
            fd = open_directory(directory, follow=not segments)
        except OSError as error:
            if segments and error.errno != errno.ENOENT:
                result.skipped += 1  # there, but not to be opened: left out, and counted
            continue
        try:
            owned = _root_owned(fd, len(segments), above)
            # Room below this cgroup: the cgroups read, this one and those queued are already counted.
            room = max_cgroups - len(result.cgroups) - bool(segments) - len(queue) if len(segments) < MAX_DEPTH else 0
            children, more = child_directories(fd, max(room, 0))
            if more:
                result.skipped += 1  # at least one cgroup below this one is not read
            for name in children:
                queue.append((os.path.join(directory, name), [*segments, name], owned))
            if segments:
                reading = reader.read(fd, label_of(segments), bool(children) or more)
                reading.root_owned = owned
                result.cgroups.append(reading)
        finally:
            os.close(fd)
    return result
