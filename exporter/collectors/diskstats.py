"""Per-device IO counters from /proc/diskstats, with node_exporter's names, units and values.

Each ``gpuio_disk_<suffix>`` equals ``node_disk_<suffix>`` on the same input, to the last bit:
sectors are multiplied by 512.0 (the kernel's diskstats sectors are always 512 bytes, whatever the
device's block size), milliseconds by 0.001 (the same float operation Go performs), and discarded
sectors stay in sectors, as node_exporter leaves them.  A line exports as many fields as the kernel
wrote: 11 before 4.18, 15 with discards (4.18+), 17 with flushes (5.5+) — Documentation/admin-guide/
iostats.rst.  Fields past the 17th (a future kernel) are ignored.

Cost per scrape: one read of /proc/diskstats, a parse per line and one ``str.format`` call per family
(see :class:`Layout`); sysfs metadata is read again only when the set of devices changes or every
METADATA_MAX_AGE seconds.
"""

from __future__ import annotations

import logging
import os
import re
import time
from typing import Any

from ..collect import Collector, MalformedSource, register
from ..context import Context
from ..exposition import COUNTER, GAUGE, INFO, Desc, Family, label_string
from ..host.blockdev import BlockDevices
from ..host.diskstats import parse_line
from ..host.lines import BadLine
from ..logsetup import LogOnce
from ..options import ConfigError, Option, parse_regex

log = logging.getLogger("gpuio.collector.diskstats")

# node_exporter's current default (collector/diskstats_linux.go): partitions, loop, ram/zram, fd.
DEFAULT_EXCLUDE = r"^(z?ram|loop|fd|(h|s|v|xv)d[a-z]|nvme\d+n\d+p)\d+$"
METADATA_MAX_AGE = 300.0
SECONDS_PER_TICK = 1.0 / 1000.0
SECTOR_BYTES = 512.0

DEVICE = ("device",)
READS_COMPLETED = Desc("gpuio_disk_reads_completed_total", COUNTER,
                       "The total number of reads completed successfully.", labels=DEVICE)
READS_MERGED = Desc("gpuio_disk_reads_merged_total", COUNTER, "The total number of reads merged.", labels=DEVICE)
READ_BYTES = Desc("gpuio_disk_read_bytes_total", COUNTER,
                  "The total number of bytes read successfully.", labels=DEVICE, unit="bytes")
READ_TIME = Desc("gpuio_disk_read_time_seconds_total", COUNTER,
                 "The total number of seconds spent by all reads.", labels=DEVICE, unit="seconds")
WRITES_COMPLETED = Desc("gpuio_disk_writes_completed_total", COUNTER,
                        "The total number of writes completed successfully.", labels=DEVICE)
WRITES_MERGED = Desc("gpuio_disk_writes_merged_total", COUNTER, "The number of writes merged.", labels=DEVICE)
WRITTEN_BYTES = Desc("gpuio_disk_written_bytes_total", COUNTER,
                     "The total number of bytes written successfully.", labels=DEVICE, unit="bytes")
WRITE_TIME = Desc("gpuio_disk_write_time_seconds_total", COUNTER,
                  "This is the total number of seconds spent by all writes.", labels=DEVICE, unit="seconds")
IO_NOW = Desc("gpuio_disk_io_now", GAUGE, "The number of I/Os currently in progress.", labels=DEVICE)
IO_TIME = Desc("gpuio_disk_io_time_seconds_total", COUNTER,
               "Total seconds spent doing I/Os.", labels=DEVICE, unit="seconds")
IO_TIME_WEIGHTED = Desc("gpuio_disk_io_time_weighted_seconds_total", COUNTER,
                        "The weighted # of seconds spent doing I/Os.", labels=DEVICE, unit="seconds")
DISCARDS_COMPLETED = Desc("gpuio_disk_discards_completed_total", COUNTER,
                          "The total number of discards completed successfully.", labels=DEVICE)
DISCARDS_MERGED = Desc("gpuio_disk_discards_merged_total", COUNTER, "The total number of discards merged.",
                       labels=DEVICE)
DISCARDED_SECTORS = Desc("gpuio_disk_discarded_sectors_total", COUNTER,
                         "The total number of sectors discarded successfully.", labels=DEVICE)
DISCARD_TIME = Desc("gpuio_disk_discard_time_seconds_total", COUNTER,
                    "This is the total number of seconds spent by all discards.", labels=DEVICE, unit="seconds")
FLUSH_REQUESTS = Desc("gpuio_disk_flush_requests_total", COUNTER,
                      "The total number of flush requests completed successfully.", labels=DEVICE)
FLUSH_TIME = Desc("gpuio_disk_flush_requests_time_seconds_total", COUNTER,
                  "This is the total number of seconds spent by all flush requests.", labels=DEVICE, unit="seconds")

# The numbers of a /proc/diskstats line after major, minor and name, in order: (family, scale); scale
# None keeps the integer, else value * scale as a float.
FIELDS: tuple[tuple[Desc, float | None], ...] = (
    (READS_COMPLETED, None), (READS_MERGED, None), (READ_BYTES, SECTOR_BYTES), (READ_TIME, SECONDS_PER_TICK),
    (WRITES_COMPLETED, None), (WRITES_MERGED, None), (WRITTEN_BYTES, SECTOR_BYTES),
    (WRITE_TIME, SECONDS_PER_TICK), (IO_NOW, None), (IO_TIME, SECONDS_PER_TICK),
    (IO_TIME_WEIGHTED, SECONDS_PER_TICK), (DISCARDS_COMPLETED, None), (DISCARDS_MERGED, None),
    (DISCARDED_SECTORS, None), (DISCARD_TIME, SECONDS_PER_TICK), (FLUSH_REQUESTS, None),
    (FLUSH_TIME, SECONDS_PER_TICK),
)
DESCS = tuple(desc for desc, _ in FIELDS)
SCALED_FIELDS = tuple((index, scale) for index, (_, scale) in enumerate(FIELDS) if scale is not None)

INFO_DESC = Desc("gpuio_disk_info", INFO,
                 "Identity of a block device from sysfs.",
                 labels=(*DEVICE, "major", "minor", "model", "vendor", "serial", "wwn", "revision", "rotational"))
DM_DESC = Desc("gpuio_disk_device_mapper_info", INFO,
               "Name and uuid of a device-mapper device.", labels=(*DEVICE, "name", "uuid"))
BACKING_DESC = Desc("gpuio_disk_backing_device_info", INFO,
                    "A device directly under another: a partition's disk, or a dm/md device's slaves.",
                    labels=(*DEVICE, "backing_device"))
PHYSICAL_DESC = Desc("gpuio_disk_physical_device_info", INFO,
                     "The whole disks at the bottom of a device's stack (a plain disk names itself), for joins from "
                     "any device.", labels=(*DEVICE, "physical_device"))


def convert(stats: list[int]) -> list[int | float]:
    """Raw diskstats fields to exported values: counts stay integers, the rest ``float(raw) * scale``."""
    values: list[int | float] = list(stats)
    for index, scale in SCALED_FIELDS:
        if index < len(values):
            values[index] = stats[index] * scale  # int * float is float(int) * scale, as Go computes it
    return values


class Layout:
    """Per family, one ``str.format`` template holding every device's sample line.

    Why: formatting 17 lines per device one by one in Python costs ~1.4 us a line on this machine;
    a template per family, built once per set of devices, formats them all in one C call.  The
    template is rebuilt only when devices appear, disappear or change their field count.
    """

    def __init__(self, devices: tuple[tuple[str, int], ...]) -> None:
        self.devices = devices  # (device, number of fields its line has), in /proc/diskstats order
        self.templates = [
            "".join(_literal(f"{desc.name}{label_string({'device': device})} ") + "{}\n"
                    for device, count in devices if count > index)
            for index, desc in enumerate(DESCS)
        ]

    def render(self, rows: list[list[int | float]]) -> list[Family]:
        if len({len(row) for row in rows}) <= 1:
            columns: list[Any] = list(zip(*rows, strict=True))  # the usual case: one kernel, one line length
        else:
            columns = [[row[index] for row in rows if len(row) > index] for index in range(len(DESCS))]
        return [Family(desc, [template.format(*column)])
                for desc, template, column in zip(DESCS, self.templates, columns, strict=False) if column]


def _literal(text: str) -> str:
    return text.replace("{", "{{").replace("}", "}}")


@register
class DiskstatsCollector(Collector):
    name = "diskstats"
    options = (
        Option("device-include", None, parse_regex, "a regular expression",
               "Regexp of devices to include (mutually exclusive with device-exclude)."),
        Option("device-exclude", None, parse_regex, "a regular expression",
               f"Regexp of devices to exclude (default {DEFAULT_EXCLUDE})."),
    )

    def __init__(self, context: Context, options: dict[str, Any]) -> None:
        super().__init__(context, options)
        include, exclude = self.settings["device-include"], self.settings["device-exclude"]
        if include is not None and exclude is not None:
            raise ConfigError(
                "--collector.diskstats.device-include and --collector.diskstats.device-exclude are mutually "
                "exclusive; accepted: at most one of them"
            )
        self._include: re.Pattern[str] | None = include
        self._exclude: re.Pattern[str] | None = None if include is not None else exclude or re.compile(
            DEFAULT_EXCLUDE
        )
        self._path = os.path.join(context.procfs, "diskstats")
        self._bad_lines = LogOnce(log)
        self._wanted: dict[str, bool] = {}
        self._layout = Layout(())
        self._metadata_key: tuple[tuple[str, int, int], ...] | None = None
        self._metadata_time = 0.0
        self._metadata: list[Family] = []

    def wanted(self, device: str) -> bool:
        known = self._wanted.get(device)
        if known is None:
            if len(self._wanted) > 10_000:  # devices come and go (loop, nbd); keep the cache bounded
                self._wanted.clear()
            if self._include is not None:
                known = self._include.search(device) is not None
            else:
                known = self._exclude is None or self._exclude.search(device) is None
            self._wanted[device] = known
        return known

    def collect(self) -> list[Family]:
        """Every wanted device's counters.  A bad line is skipped and counted (node_exporter 1.5 fails the
        whole collector on one); a file of nothing but bad lines has failed (success 0).  An empty file
        is no failure: a machine may have no block device."""
        with open(self._path, encoding="ascii", errors="replace") as handle:
            text = handle.read()
        rows: list[list[int | float]] = []
        identities: list[tuple[str, int, int]] = []
        seen: set[str] = set()
        dropped = 0
        for line in text.splitlines():
            parts = line.split(None, 3)
            if not parts or (len(parts) >= 3 and not self.wanted(parts[2])):
                continue  # blank, or a device the filters leave out
            try:
                major, minor, device, stats = parse_line(line)
                if device in seen:
                    raise BadLine("repeated", "a second line for this device")
            except BadLine as exc:
                dropped += 1
                self.dropped_lines.add("diskstats", exc.reason)
                self._bad_lines.warning("skipping bad diskstats line", line.strip(), reason=str(exc))
                continue
            seen.add(device)
            rows.append(convert(stats))
            identities.append((device, major, minor))
        if dropped and not rows:
            raise MalformedSource(f"all {dropped} lines of {self._path} are malformed")
        shape = tuple((device, len(row)) for (device, _, _), row in zip(identities, rows, strict=True))
        if shape != self._layout.devices:
            self._layout = Layout(shape)
        return self._layout.render(rows) + self._metadata_families(tuple(identities))

    def _metadata_families(self, identities: tuple[tuple[str, int, int], ...]) -> list[Family]:
        now = time.monotonic()
        if identities != self._metadata_key or now - self._metadata_time > METADATA_MAX_AGE:
            self._metadata = self._read_metadata(identities)
            self._metadata_key = identities
            self._metadata_time = now
        return self._metadata

    def _read_metadata(self, identities: tuple[tuple[str, int, int], ...]) -> list[Family]:
        devices = BlockDevices(self.context.sysfs)
        info, dm, backing, physical = [], [], [], []
        for name, major, minor in identities:
            info.append(INFO_DESC.sample(label_string(self._identity_labels(devices, name, major, minor)), 1))
            device = devices.get(name)
            if device is not None and device.attribute("dm/name") is not None:
                labels = {"device": name, "name": device.attribute("dm/name") or "",
                          "uuid": device.attribute("dm/uuid") or ""}
                dm.append(DM_DESC.sample(label_string(labels), 1))
            for below in devices.backing(name):
                backing.append(BACKING_DESC.sample(label_string({"device": name, "backing_device": below}), 1))
            for disk in devices.physical(name):
                physical.append(PHYSICAL_DESC.sample(label_string({"device": name, "physical_device": disk}), 1))
        return [Family(INFO_DESC, info), Family(DM_DESC, dm), Family(BACKING_DESC, backing),
                Family(PHYSICAL_DESC, physical)]

    def _identity_labels(self, devices: BlockDevices, name: str, major: int, minor: int) -> dict[str, str]:
        device = devices.get(name)
        # A partition has no device/ of its own: it is the disk's model, serial and so on.
        owner = devices.get(device.parent) if device is not None and device.parent else device
        labels = {"device": name, "major": str(major), "minor": str(minor), "model": "", "vendor": "",
                  "serial": "", "wwn": "", "revision": "", "rotational": ""}
        if owner is None:
            return labels
        first = owner.attribute
        labels["model"] = first("device/model") or first("device/name") or ""
        vendor = first("device/vendor") or ""
        # SCSI/ATA write a name here; virtio and NVMe write a PCI vendor id (0x1af4), which is no vendor name.
        labels["vendor"] = "" if vendor.startswith("0x") else vendor
        labels["serial"] = first("device/serial") or first("serial") or ""
        labels["wwn"] = first("wwid") or first("device/wwid") or ""
        labels["revision"] = first("device/rev") or first("device/firmware_rev") or first("device/fwrev") or ""
        rotational = devices.rotational(name) or ""
        if rotational not in ("", "0", "1"):
            self._bad_lines.warning("ignoring unreadable sysfs attribute", rotational,
                                    device=name, attribute="queue/rotational")
            rotational = ""
        labels["rotational"] = rotational
        return labels
