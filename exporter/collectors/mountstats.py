"""NFS client statistics per mount from /proc/<pid>/mountstats, and every network or FUSE mount.

The semantics are node_exporter's mountstats collector (itself prometheus/procfs's parser), one to
one: ``node_mountstats_nfs_X`` there is ``gpuio_mountstats_nfs_X`` here, with the same labels plus
``mountpoint``, which node_exporter leaves out and the rules join on (``gpuio_engine_mount_info``
names the mount point of each engine file).  The kernel writes the file in fs/nfs/super.c
(``nfs_show_stats``) and net/sunrpc/stats.c (per-operation lines, ``rpc_clnt_show_stats``):

* ``bytes:`` normal read, normal write, direct read, direct write, server read, server write,
  pages read, pages written;
* ``xprt:`` per RPC transport (several with nconnect): port, bind count, connect count, connect
  idle time, idle time (seconds), sends, receives, bad transaction ids, cumulative active requests,
  cumulative backlog, and with statvers 1.1 the most slots used, the cumulative sending and
  pending queue;
* per operation: requests, transmissions, major timeouts, bytes sent, bytes received, then the
  cumulative queue, response (round trip) and request (execute) times in milliseconds, and since
  Linux 5.x the errors.

Which mount namespace: ``<procfs>/1/mountinfo`` (the host's, see :mod:`exporter.host.mounts`) where it
can be read, else ``self``; and the mountstats file of the same process.  /proc/<pid>/mountstats is
mode 0400 (only root, or CAP_DAC_READ_SEARCH, reads init's): where init's is refused, the exporter's
own is read instead, which shows the host's NFS mounts when the exporter shares the host's mount
namespace or a copy of it (systemd, even with ProtectSystem=) and only its own mounts in a container.
``gpuio_mountstats_source_info`` says which files were read.  Two mounts of one export with the same options share one
NFS superblock, so they show the same counters under both mount points: do not sum over mount points.

Bounded: at most ``max-mounts`` mounts and ``max-operations`` operations per mount (operations never
used, with zero requests, are left out); what does not fit is counted in
``gpuio_mountstats_dropped_series_total{kind}``.  A line that makes no sense is skipped and counted
in ``gpuio_mountstats_malformed_lines_total``; the rest of the file is still read.  No NFS mount is
no failure.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any

from ..collect import Absent, Collector, register
from ..context import Context
from ..exposition import COUNTER, GAUGE, INFO, Desc, Family, label_string
from ..host import mounts
from ..host.lines import BadLine
from ..host.procstat import whole_number
from ..options import Option, parse_count

log = logging.getLogger("gpuio.collector.mountstats")

NFS_TYPES = ("nfs", "nfs4")
MANTISSA = 2**53  # node_exporter keeps large cumulative times below 2**53 the same way (modulo)
BYTES_FIELDS = 8
EVENTS_FIELDS = 27
OP_MIN_FIELDS = 8  # numbers after the operation name; a 9th (errors) since Linux 5.x
# statvers -> protocol -> numbers on the xprt line (procfs's fieldTransport* constants)
TRANSPORT_FIELDS = {"1.0": {"tcp": 10, "udp": 7}, "1.1": {"tcp": 13, "udp": 10}}
RDMA_MIN_FIELDS = 20  # statvers 1.1 over RDMA: the tcp fields then RDMA's own (up to 28)


# The labels of every NFS mount's series (node_exporter's, plus mountpoint).
MOUNT = ("export", "protocol", "mountaddr", "mountpoint")
AGE = Desc("gpuio_mountstats_nfs_age_seconds_total", COUNTER,
           "The age of the NFS mount in seconds.", labels=MOUNT, unit="seconds")
BYTES = (
    Desc("gpuio_mountstats_nfs_read_bytes_total", COUNTER,
         "Number of bytes read using the read() syscall.", labels=MOUNT, unit="bytes"),
    Desc("gpuio_mountstats_nfs_write_bytes_total", COUNTER,
         "Number of bytes written using the write() syscall.", labels=MOUNT, unit="bytes"),
    Desc("gpuio_mountstats_nfs_direct_read_bytes_total", COUNTER,
         "Number of bytes read using the read() syscall in O_DIRECT mode.", labels=MOUNT, unit="bytes"),
    Desc("gpuio_mountstats_nfs_direct_write_bytes_total", COUNTER,
         "Number of bytes written using the write() syscall in O_DIRECT mode.", labels=MOUNT, unit="bytes"),
    Desc("gpuio_mountstats_nfs_total_read_bytes_total", COUNTER,
         "Number of bytes read from the NFS server, in total.", labels=MOUNT, unit="bytes"),
    Desc("gpuio_mountstats_nfs_total_write_bytes_total", COUNTER,
         "Number of bytes written to the NFS server, in total.", labels=MOUNT, unit="bytes"),
    Desc("gpuio_mountstats_nfs_read_pages_total", COUNTER, "Number of pages read directly via mmap()'d files.",
         labels=MOUNT),
    Desc("gpuio_mountstats_nfs_write_pages_total", COUNTER,
         "Number of pages written directly via mmap()'d files.", labels=MOUNT),
)
# (index in the normalised 13-number transport list, desc, modulo 2**53 as node_exporter does)
TRANSPORT = (
    (1, Desc("gpuio_mountstats_nfs_transport_bind_total", COUNTER,
             "Number of times the client has had to establish a connection from scratch to the NFS server.",
             labels=(*MOUNT, "transport")), False),
    (2, Desc("gpuio_mountstats_nfs_transport_connect_total", COUNTER,
             "Number of times the client has made a TCP connection to the NFS server.",
             labels=(*MOUNT, "transport")), False),
    (4, Desc("gpuio_mountstats_nfs_transport_idle_time_seconds", GAUGE,
             "Duration since the NFS mount last saw any RPC traffic, in seconds.", labels=(*MOUNT, "transport"),
             unit="seconds"), True),
    (5, Desc("gpuio_mountstats_nfs_transport_sends_total", COUNTER,
             "Number of RPC requests for this mount sent to the NFS server.", labels=(*MOUNT, "transport")), False),
    (6, Desc("gpuio_mountstats_nfs_transport_receives_total", COUNTER,
             "Number of RPC responses for this mount received from the NFS server.",
             labels=(*MOUNT, "transport")), False),
    (7, Desc("gpuio_mountstats_nfs_transport_bad_transaction_ids_total", COUNTER,
             "Number of times the NFS server sent a response with a transaction ID unknown to this client.",
             labels=(*MOUNT, "transport")), False),
    (9, Desc("gpuio_mountstats_nfs_transport_backlog_queue_total", COUNTER,
             "Total number of items added to the RPC backlog queue.", labels=(*MOUNT, "transport")), False),
    (10, Desc("gpuio_mountstats_nfs_transport_maximum_rpc_slots", GAUGE,
              "Maximum number of simultaneously active RPC requests ever used.", labels=(*MOUNT, "transport")), False),
    (11, Desc("gpuio_mountstats_nfs_transport_sending_queue_total", COUNTER,
              "Total number of items added to the RPC transmission sending queue.",
              labels=(*MOUNT, "transport")), False),
    (12, Desc("gpuio_mountstats_nfs_transport_pending_queue_total", COUNTER,
              "Total number of items added to the RPC transmission pending queue.",
              labels=(*MOUNT, "transport")), False),
)
# (index in the operation's numbers, desc, divisor (milliseconds -> seconds), modulo 2**53)
OPERATIONS = (
    (0, Desc("gpuio_mountstats_nfs_operations_requests_total", COUNTER,
             "Number of requests performed for a given operation.", labels=(*MOUNT, "operation")), 1, False),
    (1, Desc("gpuio_mountstats_nfs_operations_transmissions_total", COUNTER,
             "Number of times an actual RPC request has been transmitted for a given operation.",
             labels=(*MOUNT, "operation")), 1, False),
    (2, Desc("gpuio_mountstats_nfs_operations_major_timeouts_total", COUNTER,
             "Number of times a request has had a major timeout for a given operation.",
             labels=(*MOUNT, "operation")), 1, False),
    (3, Desc("gpuio_mountstats_nfs_operations_sent_bytes_total", COUNTER,
             "Number of bytes sent for a given operation, including RPC headers and payload.",
             labels=(*MOUNT, "operation"), unit="bytes"), 1, False),
    (4, Desc("gpuio_mountstats_nfs_operations_received_bytes_total", COUNTER,
             "Number of bytes received for a given operation, including RPC headers and payload.",
             labels=(*MOUNT, "operation"), unit="bytes"), 1, False),
    (5, Desc("gpuio_mountstats_nfs_operations_queue_time_seconds_total", COUNTER,
             "Duration all requests spent queued for transmission for a given operation before they were sent, in "
             "seconds.", labels=(*MOUNT, "operation"), unit="seconds"), 1000.0, True),
    (6, Desc("gpuio_mountstats_nfs_operations_response_time_seconds_total", COUNTER,
             "Duration all requests took to get a reply back after a request for a given operation was transmitted "
             "(the round trip), in seconds.", labels=(*MOUNT, "operation"), unit="seconds"), 1000.0, True),
    (7, Desc("gpuio_mountstats_nfs_operations_request_time_seconds_total", COUNTER,
             "Duration all requests took from when a request was enqueued to when it was completely handled for a "
             "given operation, in seconds.", labels=(*MOUNT, "operation"), unit="seconds"), 1000.0, True),
    (8, Desc("gpuio_mountstats_nfs_operations_errors_total", COUNTER,
             "Number of errors for a given operation.", labels=(*MOUNT, "operation")), 1, True),
)
# (index in the events line's numbers, desc)
EVENTS = (
    (0, Desc("gpuio_mountstats_nfs_event_inode_revalidate_total", COUNTER,
             "Number of times cached inode attributes are re-validated from the server.", labels=MOUNT)),
    (1, Desc("gpuio_mountstats_nfs_event_dnode_revalidate_total", COUNTER,
             "Number of times cached dentry nodes are re-validated from the server.", labels=MOUNT)),
    (2, Desc("gpuio_mountstats_nfs_event_data_invalidate_total", COUNTER,
             "Number of times an inode cache is cleared.", labels=MOUNT)),
    (3, Desc("gpuio_mountstats_nfs_event_attribute_invalidate_total", COUNTER,
             "Number of times cached inode attributes are invalidated.", labels=MOUNT)),
    (4, Desc("gpuio_mountstats_nfs_event_vfs_open_total", COUNTER,
             "Number of times files or directories have been open()'d.", labels=MOUNT)),
    (5, Desc("gpuio_mountstats_nfs_event_vfs_lookup_total", COUNTER,
             "Number of times a directory lookup has occurred.", labels=MOUNT)),
    (6, Desc("gpuio_mountstats_nfs_event_vfs_access_total", COUNTER,
             "Number of times permissions have been checked.", labels=MOUNT)),
    (7, Desc("gpuio_mountstats_nfs_event_vfs_update_page_total", COUNTER,
             "Number of updates (and potential writes) to pages.", labels=MOUNT)),
    (8, Desc("gpuio_mountstats_nfs_event_vfs_read_page_total", COUNTER,
             "Number of pages read directly via mmap()'d files.", labels=MOUNT)),
    (9, Desc("gpuio_mountstats_nfs_event_vfs_read_pages_total", COUNTER,
             "Number of times a group of pages have been read.", labels=MOUNT)),
    (10, Desc("gpuio_mountstats_nfs_event_vfs_write_page_total", COUNTER,
              "Number of pages written directly via mmap()'d files.", labels=MOUNT)),
    (11, Desc("gpuio_mountstats_nfs_event_vfs_write_pages_total", COUNTER,
              "Number of times a group of pages have been written.", labels=MOUNT)),
    (12, Desc("gpuio_mountstats_nfs_event_vfs_getdents_total", COUNTER,
              "Number of times directory entries have been read with getdents().", labels=MOUNT)),
    (13, Desc("gpuio_mountstats_nfs_event_vfs_setattr_total", COUNTER,
              "Number of times attributes have been set on inodes.", labels=MOUNT)),
    (14, Desc("gpuio_mountstats_nfs_event_vfs_flush_total", COUNTER,
              "Number of pending writes that have been forcefully flushed to the server.", labels=MOUNT)),
    (15, Desc("gpuio_mountstats_nfs_event_vfs_fsync_total", COUNTER,
              "Number of times fsync() has been called on directories and files.", labels=MOUNT)),
    (16, Desc("gpuio_mountstats_nfs_event_vfs_lock_total", COUNTER,
              "Number of times locking has been attempted on a file.", labels=MOUNT)),
    (17, Desc("gpuio_mountstats_nfs_event_vfs_file_release_total", COUNTER,
              "Number of times files have been closed and released.", labels=MOUNT)),
    # 18: congestion wait, unused by the kernel, not exported (as in node_exporter)
    (19, Desc("gpuio_mountstats_nfs_event_truncation_total", COUNTER,
              "Number of times files have been truncated.", labels=MOUNT)),
    (20, Desc("gpuio_mountstats_nfs_event_write_extension_total", COUNTER,
              "Number of times a file has been grown due to writes beyond its existing end.", labels=MOUNT)),
    (21, Desc("gpuio_mountstats_nfs_event_silly_rename_total", COUNTER,
              "Number of times a file was removed while still open by another process.", labels=MOUNT)),
    (22, Desc("gpuio_mountstats_nfs_event_short_read_total", COUNTER,
              "Number of times the NFS server gave less data than expected while reading.", labels=MOUNT)),
    (23, Desc("gpuio_mountstats_nfs_event_short_write_total", COUNTER,
              "Number of times the NFS server wrote less data than expected while writing.", labels=MOUNT)),
    (24, Desc("gpuio_mountstats_nfs_event_jukebox_delay_total", COUNTER,
              "Number of times the NFS server indicated EJUKEBOX; retrieving data from offline storage.",
              labels=MOUNT)),
    (25, Desc("gpuio_mountstats_nfs_event_pnfs_read_total", COUNTER, "Number of NFS v4.1+ pNFS reads.", labels=MOUNT)),
    (26, Desc("gpuio_mountstats_nfs_event_pnfs_write_total", COUNTER, "Number of NFS v4.1+ pNFS writes.",
              labels=MOUNT)),
)
MOUNT_INFO = Desc("gpuio_mount_info", INFO,
                  "A network or FUSE mount as the host sees it (nfs, nfs4, cifs, ceph, glusterfs, lustre, 9p, "
                  "fuse.*...): these have no block device, so disk series cannot describe them.",
                  labels=("mountpoint", "fstype", "source"))
MALFORMED = Desc("gpuio_mountstats_malformed_lines_total", COUNTER,
                 "Lines of mountstats or mountinfo that made no sense and were skipped, counted at every read "
                 "(mountinfo is read again only when the mount table changes).")
SOURCE = Desc("gpuio_mountstats_source_info", INFO,
              "Whose mount table and NFS statistics were read: <procfs>/<mountinfo>/mountinfo and "
              "<procfs>/<mountstats>/mountstats, 1 (the host's init) or self (\"\" when none was read: no NFS mount, "
              "or none readable; /proc/1/mountstats needs root or CAP_DAC_READ_SEARCH).",
              labels=("mountinfo", "mountstats"))
DROPPED = Desc("gpuio_mountstats_dropped_series_total", COUNTER,
               "Distinct mounts and operations left out by the collector's caps, by kind (mount, operation, "
               "mount_info).", labels=("kind",), values={"kind": ("mount", "operation", "mount_info")})


def _numbers(fields: list[str]) -> list[int]:
    numbers = [whole_number(text) for text in fields]
    if None in numbers:
        raise BadLine("malformed", "not a list of whole numbers of at most 20 digits")
    return [number for number in numbers if number is not None]


@dataclass
class NfsMount:
    export: str
    mountpoint: str
    fstype: str
    statvers: str
    opts: dict[str, str] = field(default_factory=dict)
    age: int | None = None
    bytes: list[int] | None = None
    events: list[int] | None = None
    transports: list[tuple[str, list[int]]] = field(default_factory=list)
    operations: list[tuple[str, list[int]]] = field(default_factory=list)


@dataclass
class Parsed:
    mounts: list[NfsMount] = field(default_factory=list)
    malformed: int = 0
    dropped_mounts: list[str] = field(default_factory=list)
    dropped_operations: list[tuple[str, str]] = field(default_factory=list)


def parse_device_line(fields: list[str]) -> NfsMount | None:
    """``device EXPORT mounted on MOUNTPOINT with fstype TYPE [statvers=V]``: the mount when it carries
    NFS statistics, None for any other mount; BadLine when the line is not of that shape."""
    if len(fields) < 8 or fields[2:4] != ["mounted", "on"] or fields[5:7] != ["with", "fstype"]:
        raise BadLine("malformed", "device line of an unknown shape")
    if len(fields) == 8 or fields[7] not in NFS_TYPES:
        return None
    statvers = fields[8].removeprefix("statvers=")
    return NfsMount(mounts.unescape(fields[1]), mounts.unescape(fields[4]), fields[7], statvers)


def parse_transport(fields: list[str], statvers: str) -> tuple[str, list[int]]:
    """An ``xprt:`` line as (protocol, 13 numbers), udp's missing connect fields as zeros (as procfs)."""
    protocol, numbers = fields[0], _numbers(fields[1:])
    if protocol == "rdma" and statvers == "1.1":
        if len(numbers) < RDMA_MIN_FIELDS:
            raise BadLine("malformed", "short rdma transport line")
        return protocol, numbers[:13]
    expected = TRANSPORT_FIELDS.get(statvers, {}).get(protocol)
    if expected is None or len(numbers) != expected:
        raise BadLine("malformed", f"transport line of an unknown shape ({protocol}, statvers {statvers})")
    if protocol == "udp":
        numbers = numbers[:2] + [0, 0, 0] + numbers[2:]
    return protocol, numbers + [0] * (13 - len(numbers))


def _parse_stat_line(mount: NfsMount, fields: list[str]) -> bool:
    """One line of a mount's block before its operations; True at ``per-op statistics``."""
    key = fields[0]
    if key == "per-op":
        return True
    if key == "opts:" and len(fields) >= 2:
        mount.opts = dict(item.partition("=")[::2] for item in fields[1].split(","))
    elif key == "age:":
        mount.age = _numbers(fields[1:2])[0] if len(fields) == 2 else _bad("age line")
    elif key == "bytes:":
        mount.bytes = _numbers(fields[1:]) if len(fields) == BYTES_FIELDS + 1 else _bad("bytes line")
    elif key == "events:":
        mount.events = _numbers(fields[1:]) if len(fields) == EVENTS_FIELDS + 1 else _bad("events line")
    elif key == "xprt:":
        if len(fields) < 3:
            raise BadLine("malformed", "short transport line")
        mount.transports.append(parse_transport(fields[1:], mount.statvers))
    return False  # caps:, sec:, nfsv4:, impl_id:, RPC iostats... are not exported


def _bad(what: str) -> Any:
    raise BadLine("malformed", f"bad {what}")


def parse_operation(fields: list[str]) -> tuple[str, list[int]]:
    if len(fields) < OP_MIN_FIELDS + 1 or not fields[0].endswith(":"):
        raise BadLine("malformed", "operation line of an unknown shape")
    numbers = _numbers(fields[1:])
    return fields[0][:-1], numbers + [0] * (9 - len(numbers))


def parse(text: str, max_mounts: int, max_operations: int) -> Parsed:
    """Every NFS mount's statistics; malformed lines are counted and skipped (the mount keeps the rest)."""
    result = Parsed()
    current: NfsMount | None = None
    in_operations = False
    for line in text.splitlines():
        fields = line.split()
        if not fields:
            continue
        try:
            if fields[0] == "device":
                current, in_operations = None, False
                current = _start_mount(result, parse_device_line(fields), max_mounts)
            elif current is None:
                continue
            elif in_operations:
                name, numbers = parse_operation(fields)
                if numbers[0] == 0:
                    continue  # never used: left out (NFSv4 lists ~70 operations per mount)
                if len(current.operations) >= max_operations:
                    result.dropped_operations.append((current.mountpoint, name))
                else:
                    current.operations.append((name, numbers))
            else:
                in_operations = _parse_stat_line(current, fields)
        except BadLine:
            result.malformed += 1
    return result


def _start_mount(result: Parsed, mount: NfsMount | None, max_mounts: int) -> NfsMount | None:
    if mount is None:
        return None
    if any(seen.mountpoint == mount.mountpoint and seen.export == mount.export for seen in result.mounts):
        return None  # the same mount point mounted twice over: the first, as node_exporter keeps
    if len(result.mounts) >= max_mounts:
        result.dropped_mounts.append(mount.mountpoint)
        return None
    result.mounts.append(mount)
    return mount


@register
class MountstatsCollector(Collector):
    name = "mountstats"
    options = (
        Option("max-mounts", "100", parse_count(1), "a whole number above zero",
               "At most this many NFS mounts (and as many other network or FUSE mounts in gpuio_mount_info)."),
        Option("max-operations", "64", parse_count(1), "a whole number above zero",
               "At most this many NFS operations per mount (operations never used are left out)."),
    )

    def __init__(self, context: Context, options: dict[str, Any]) -> None:
        super().__init__(context, options)
        self.max_mounts: int = self.settings["max-mounts"]
        self.max_operations: int = self.settings["max-operations"]
        self.malformed = 0
        self._dropped: dict[str, set[Any]] = {}
        self._counted: mounts.MountTable | None = None  # the table whose malformed lines are counted

    def collect(self) -> list[Family]:
        table = self.context.host_mounts.table()  # shared with the engines collector
        text, source = self._read_mountstats(table) if _may_have_nfs(table) else (None, "")
        if not table.source and text is None:
            raise Absent(f"no mount table under {self.context.procfs} (no mountinfo or mountstats readable)")
        if table is not self._counted:  # the table is read again only when it changed
            self.malformed += table.malformed
            self._counted = table
        families = [self._mount_info(table), Family(SOURCE, [SOURCE.sample(label_string(
            {"mountinfo": _process_of(table.source), "mountstats": _process_of(source)}), 1)])]
        if text is not None:
            parsed = parse(text, self.max_mounts, self.max_operations)
            self.malformed += parsed.malformed
            for point in parsed.dropped_mounts:
                self._drop("mount", point)
            for key in parsed.dropped_operations:
                self._drop("operation", key)
            families += self._nfs_families(parsed, table)
        families.append(Family(MALFORMED, [MALFORMED.sample("", self.malformed)]))
        dropped = [DROPPED.sample(label_string({"kind": kind}), len(keys))
                   for kind, keys in sorted(self._dropped.items())]
        families.append(Family(DROPPED, dropped))
        return families

    def _read_mountstats(self, table: mounts.MountTable) -> tuple[str | None, str]:
        """The mountstats of the mount table's process (one mount namespace for both), else the
        exporter's own where that one is refused (mode 0400); ``(None, "")`` when neither is there."""
        own = os.path.join(self.context.procfs, "self", "mountstats")
        first = os.path.join(os.path.dirname(table.source), "mountstats") if table.source else own
        for path in dict.fromkeys((first, own)):
            try:
                return mounts.read_bounded(path), path
            except (FileNotFoundError, PermissionError):
                continue  # a procfs without it (a fixture root), or init's refused to a non-root exporter
        return None, ""

    def _drop(self, kind: str, key: Any) -> None:
        seen = self._dropped.setdefault(kind, set())
        if len(seen) < 100_000:
            seen.add(key)

    def _mount_info(self, table: mounts.MountTable) -> Family:
        samples: list[str] = []
        for mount in table.by_mountpoint().values():  # the visible mount of each mount point
            if not mounts.is_network(mount.fstype):
                continue
            if len(samples) >= self.max_mounts:
                self._drop("mount_info", mount.mountpoint)
                continue
            samples.append(MOUNT_INFO.sample(label_string(
                {"mountpoint": mount.mountpoint, "fstype": mount.fstype, "source": mount.source}), 1))
        return Family(MOUNT_INFO, samples)

    def _nfs_families(self, parsed: Parsed, table: mounts.MountTable) -> list[Family]:
        by_point = table.by_mountpoint()
        samples: dict[Desc, list[str]] = {}

        def add(desc: Desc, labels: dict[str, str], value: float) -> None:
            samples.setdefault(desc, []).append(desc.sample(label_string(labels), value))

        for mount in parsed.mounts:
            info = by_point.get(mount.mountpoint)
            address = (info.option("addr") if info is not None else None) or ""
            protocol = mount.transports[0][0] if mount.transports else mount.opts.get("proto", "")
            base = {"export": mount.export, "protocol": protocol, "mountaddr": address,
                    "mountpoint": mount.mountpoint}
            if mount.age is not None:
                add(AGE, base, mount.age)
            for desc, value in zip(BYTES, mount.bytes or (), strict=False):
                add(desc, base, value)
            for index, (_, numbers) in enumerate(mount.transports):
                labels = {**base, "transport": str(index)}
                for position, desc, modulo in TRANSPORT:
                    add(desc, labels, numbers[position] % MANTISSA if modulo else numbers[position])
            for name, numbers in mount.operations:
                labels = {**base, "operation": name}
                for position, desc, divisor, modulo in OPERATIONS:
                    value = numbers[position] % MANTISSA if modulo else numbers[position]
                    add(desc, labels, value / divisor if divisor != 1 else value)
            if mount.events is not None:
                for index, desc in EVENTS:
                    add(desc, base, mount.events[index])
        order = [AGE, *BYTES, *(desc for _, desc, _ in TRANSPORT), *(desc for _, desc, _, _ in OPERATIONS),
                 *(desc for _, desc in EVENTS)]
        return [Family(desc, samples.get(desc, [])) for desc in order]


def _may_have_nfs(table: mounts.MountTable) -> bool:
    """Only NFS mounts have statistics in mountstats: a mount table that lists none spares reading it.
    An empty or unreadable table says nothing, so mountstats is read then."""
    return not table.mounts or any(mount.fstype.startswith("nfs") for mount in table.mounts)


def _process_of(path: str) -> str:
    """``1`` or ``self`` for ``<procfs>/1/mountinfo``...; "" for no file."""
    return os.path.basename(os.path.dirname(path)) if path else ""
