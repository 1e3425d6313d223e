"""SMART health of every disk smartctl can see, read through pySMART in the background (issue 5).

The peer is smartctl_exporter, and its users' open complaints shape this module: scrapes that hang on a
smartctl with no timeout (its #56), scrapes that time out with many disks (#197), and polls that wake
sleeping disks (#61).  Here:

- A scrape never runs smartctl.  A PeriodicSampler sweeps every ``--collector.smart.interval`` (5m) and
  renders its families once; ``collect()`` hands back that list, so a scrape pays only for writing out
  the lines (docs/smart.md, Performance).
- Every smartctl command line carries ``-n <powermode-check>`` (default ``standby``), the scan included:
  a sleeping disk answers "Device is in STANDBY mode" instead of spinning up, and keeps its last values
  with ``state="asleep"``.  pySMART adds extra probes of its own (``-l sasphy``, ``-l background``), so
  the flag is added where every process starts, not per command.
- pySMART has no timeout (it calls ``Popen.communicate()`` without one).  It is handed a Smartctl whose
  ``generic_call`` - the hook pySMART's own test suite replaces to replay recordings - is a
  :class:`~exporter.host.smartctl.Runner`: one deadline (``--collector.smart.timeout``) for all the smartctl
  processes of one poll, the process group killed when it passes (exporter/host/smartctl.py supervises the
  processes; this module turns their output into metrics).  A smartctl stuck in the kernel survives
  SIGKILL until its IO returns; its device is not polled again until it exits, so a hung disk holds one
  process, never one per sweep.  Devices are polled in parallel (``--collector.smart.concurrency``), so
  a hung disk delays no other.
- Text, not ``--json``: pySMART (gpuio's SMART library, docs/smart.md) parses smartctl's text, and its
  authors test that parser on the very recordings our tests replay (tests/fixtures/smartctl); text also works with
  smartctl 6.x.  What pySMART does not read - the exit status, the power-mode answer, open failures -
  the Runner reads.  Numbers are read in the C locale (``LC_ALL=C``), so "1,234" is never "1 234".
- ``device`` joins gpuio_disk_*: ``/dev/sda`` is ``sda``; an NVMe controller (``/dev/nvme0``) repeats
  its values for each of its namespaces (``nvme0n1``...) found under ``--path.sysfs``; ``/dev/sgN`` is
  its block device; a disk behind a RAID controller has no block device of its own and is named by its
  smartctl address (``bus/0:megaraid,16``).

No smartctl on the machine is "no such source here": no series, success 1.  No permission to open the
disks (not root, or no CAP_SYS_RAWIO/CAP_SYS_ADMIN) is logged once and shown by
``gpuio_smart_permission_denied``, not reported as an error on every sweep.  pySMART is imported on the
first sweep, not with this module: its import takes ~60 ms and sets LANG=C in the process environment.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import subprocess
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from ..collect import Absent, Collector, Pending, StaleData, register
from ..context import Context
from ..exposition import COUNTER, GAUGE, INFO, Desc, Family, label_string
from ..host.smartctl import DENIED, KILL_GRACE_SECONDS, Processes, Runner, SmartctlError, become_subreaper, run_parallel
from ..logsetup import LogOnce, fields
from ..options import ConfigError, Option, parse_choice, parse_count, parse_regex, parse_seconds
from ..sampler import PeriodicSampler
from ..sorting import natural_key

log = logging.getLogger("gpuio.collector.smart")

POWER_MODES = ("never", "sleep", "standby", "idle")  # smartctl -n: skip a disk in this mode or deeper
STATES = ("ok", "asleep", "timeout", "error", "permission_denied", "unsupported")
POLL_SLACK_SECONDS = 5.0  # a poll past its deadline: the kill's grace and pySMART's parse
# smartctl.cpp scan_devices(): "/dev/sda -d sat # /dev/sda [SAT], ATA device"; a device --scan-open
# could not open is commented out: "# /dev/sdb -d scsi # /dev/sdb, SCSI device open failed: <why>".
SCAN_LINE = re.compile(r"^(?P<path>[^#\s]\S*)\s+-d\s+(?P<type>\S+)(\s|$)")
SCAN_FAILED = re.compile(r"^#\s+(?P<path>\S+)\s+-d\s+(?P<type>\S+)\s+#.*device open failed: (?P<why>.*)$")
# -d types that address a disk behind a RAID controller: the path is the controller, not the disk.
CONTROLLER_TYPE = re.compile(r"(^|\+)(megaraid|cciss|areca|3ware|aacraid|hpt|sssraid|jmb39x)")
NVME_CONTROLLER = re.compile(r"nvme\d+")
NVME_NAMESPACE = re.compile(r"nvme(?P<subsystem>\d+)(?:c\d+)?n(?P<namespace>\d+)")


def parse_executable(value: str) -> str:
    """A smartctl to run: a path to an executable file, or a bare name looked up on PATH at each sweep."""
    if os.sep not in value:
        return value
    if not (os.path.isfile(value) and os.access(value, os.X_OK)):
        raise ValueError("no executable file there")
    return value


def parse_devices(value: str) -> tuple[tuple[str, str | None], ...]:
    """``"/dev/sda /dev/bus/0;megaraid,16"``: devices to poll instead of the scan, each ``PATH[;TYPE]``."""
    devices = []
    for item in value.split():
        path, _, kind = item.partition(";")
        if not path:
            raise ValueError(f"entry {item!r} has no device path")
        devices.append((path, kind or None))
    if not devices:
        raise ValueError("no device named")
    return tuple(devices)


# --- metric families --------------------------------------------------------------------------------

# NVMe base specification, SMART / Health Information log, byte 0.
NVME_WARNING_BITS = ("available_spare", "temperature", "reliability", "read_only", "volatile_memory_backup",
                     "persistent_memory_region")
DEVICE = ("device",)  # joins gpuio_disk_*
DEVICE_INFO = Desc("gpuio_smart_device_info", INFO,
                   "Identity of a disk as smartctl reports it; device joins gpuio_disk_* series.",
                   labels=(*DEVICE, "model", "serial", "firmware", "interface", "type", "rotational",
                           "smartctl_device"), values={"interface": ("ata", "nvme", "scsi")})
STATE = Desc("gpuio_smart_device_state", GAUGE,
             "Outcome of the last poll of a disk: 1 for the current state, 0 for the others.",
             labels=(*DEVICE, "state"), values={"state": STATES})
LAST_SUCCESS = Desc("gpuio_smart_last_success_timestamp_seconds", GAUGE,
                    "When the values of a disk were last read; older than the poll interval means stale.",
                    labels=DEVICE, unit="seconds")
POLL_DURATION = Desc("gpuio_smart_poll_duration_seconds", GAUGE,
                     "How long the last poll of a disk took, all its smartctl runs together.", labels=DEVICE,
                     unit="seconds")
PERMISSION_DENIED = Desc("gpuio_smart_permission_denied", GAUGE,
                         "1 when smartctl could not open a disk for lack of privileges.")
DROPPED = Desc("gpuio_smart_devices_dropped", GAUGE,
               "Disks found but not polled because of --collector.smart.max-devices.")
STRAYS = Desc("gpuio_smart_stray_processes_killed_total", COUNTER,
              "Processes a smartctl (or a wrapper around it) left behind outside its session, killed.",
              doc="Processes a smartctl (or a wrapper around it) left behind outside its session, killed by the "
                  "exporter (docs/smart.md).")
HEALTH = Desc("gpuio_smart_health_passed", GAUGE,
              "SMART overall-health self-assessment: 0 when it failed or an attribute is failing now, else 1.",
              labels=DEVICE)
TEMPERATURE = Desc("gpuio_smart_temperature_celsius", GAUGE, "Current temperature of the disk.", labels=DEVICE,
                   unit="celsius")
POWER_ON = Desc("gpuio_smart_power_on_seconds_total", COUNTER,
                "Time the disk has been powered on (disks count it in hours or minutes).", labels=DEVICE,
                unit="seconds")
POWER_CYCLES = Desc("gpuio_smart_power_cycles_total", COUNTER, "Power on/off cycles of the disk.", labels=DEVICE)
CAPACITY = Desc("gpuio_smart_capacity_bytes", GAUGE, "User capacity of the disk.", labels=DEVICE, unit="bytes")
ATA_ATTRIBUTE = Desc("gpuio_smart_ata_attribute", GAUGE,
                     "Every ATA SMART attribute by value_type: normalized (vendor scale, failing at or below its "
                     "threshold, given where non-zero) and raw (vendor-defined units).",
                     labels=(*DEVICE, "id", "name", "value_type"),
                     values={"value_type": ("normalized", "raw", "threshold")})
ATA_REALLOCATED = Desc("gpuio_smart_ata_reallocated_sectors_total", COUNTER,
                       "ATA attribute 5: sectors remapped to the spare area.", labels=DEVICE)
ATA_UNCORRECTABLE = Desc("gpuio_smart_ata_reported_uncorrectable_errors_total", COUNTER,
                         "ATA attribute 187: errors that ECC could not correct.", labels=DEVICE)
ATA_PENDING = Desc("gpuio_smart_ata_pending_sectors", GAUGE,
                   "ATA attribute 197: unstable sectors waiting to be remapped.", labels=DEVICE)
ATA_OFFLINE_UNCORRECTABLE = Desc("gpuio_smart_ata_offline_uncorrectable_sectors", GAUGE,
                                 "ATA attribute 198: sectors found uncorrectable by offline scans.", labels=DEVICE)
ATA_CRC = Desc("gpuio_smart_ata_udma_crc_errors_total", COUNTER,
               "ATA attribute 199: CRC errors on the link (cable, backplane).", labels=DEVICE)
NVME_WARNING = Desc("gpuio_smart_nvme_critical_warning", GAUGE,
                    "NVMe critical warning bits: 1 when set.", labels=(*DEVICE, "warning"),
                    values={"warning": NVME_WARNING_BITS})
NVME_USED = Desc("gpuio_smart_nvme_endurance_used_ratio", GAUGE,
                 "NVMe Percentage Used as a ratio: share of the rated endurance consumed (may exceed 1).",
                 labels=DEVICE, unit="ratio")
NVME_SPARE = Desc("gpuio_smart_nvme_available_spare_ratio", GAUGE,
                  "NVMe spare capacity left, 0-1.", labels=DEVICE, unit="ratio")
NVME_SPARE_THRESHOLD = Desc("gpuio_smart_nvme_available_spare_threshold_ratio", GAUGE,
                            "NVMe available spare below which the disk sets its critical warning, 0-1.", labels=DEVICE,
                            unit="ratio")
NVME_MEDIA_ERRORS = Desc("gpuio_smart_nvme_media_errors_total", COUNTER,
                         "NVMe unrecovered data integrity errors.", labels=DEVICE)
NVME_ERROR_LOG = Desc("gpuio_smart_nvme_error_log_entries_total", COUNTER,
                      "NVMe error information log entries over the life of the controller.", labels=DEVICE)
NVME_READ = Desc("gpuio_smart_nvme_read_bytes_total", COUNTER,
                 "Data read by the host, in bytes (the drive counts units of 512,000 bytes).", labels=DEVICE,
                 unit="bytes")
NVME_WRITTEN = Desc("gpuio_smart_nvme_written_bytes_total", COUNTER,
                    "Data written by the host, in bytes (the drive counts units of 512,000 bytes).", labels=DEVICE,
                    unit="bytes")
NVME_UNSAFE_SHUTDOWNS = Desc("gpuio_smart_nvme_unsafe_shutdowns_total", COUNTER, "NVMe unsafe shutdowns.",
                             labels=DEVICE)
SCSI_GROWN_DEFECTS = Desc("gpuio_smart_scsi_grown_defects_total", COUNTER,
                          "Elements in the SCSI grown defect list (blocks reassigned since manufacture).",
                          labels=DEVICE)
SCSI_UNCORRECTED = Desc("gpuio_smart_scsi_uncorrected_errors_total", COUNTER,
                        "SCSI errors the disk could not correct, by operation (read, write, verify).",
                        labels=(*DEVICE, "operation"), values={"operation": ("read", "write", "verify")})

# The order families appear in the output.
DESCS = (DEVICE_INFO, STATE, LAST_SUCCESS, POLL_DURATION, PERMISSION_DENIED, DROPPED, HEALTH, TEMPERATURE,
         POWER_ON, POWER_CYCLES, CAPACITY, ATA_ATTRIBUTE, ATA_REALLOCATED, ATA_UNCORRECTABLE, ATA_PENDING,
         ATA_OFFLINE_UNCORRECTABLE, ATA_CRC, NVME_WARNING, NVME_USED, NVME_SPARE, NVME_SPARE_THRESHOLD,
         NVME_MEDIA_ERRORS, NVME_ERROR_LOG, NVME_READ, NVME_WRITTEN, NVME_UNSAFE_SHUTDOWNS, SCSI_GROWN_DEFECTS,
         SCSI_UNCORRECTED)

ATA_NAMED = {5: ATA_REALLOCATED, 187: ATA_UNCORRECTABLE, 197: ATA_PENDING, 198: ATA_OFFLINE_UNCORRECTABLE,
             199: ATA_CRC}
NVME_DATA_UNIT_BYTES = 512_000
# Attribute 9 counts in the unit its name says (smartctl's drive database renames it per model).
POWER_ON_UNITS = {"Power_On_Hours": 3600, "Power_On_Minutes": 60, "Power_On_Half_Minutes": 30,
                  "Power_On_Seconds": 1}
HOURS_MINUTES_SECONDS = re.compile(r"(?P<h>\d+)h(?:\+(?P<m>\d+)m)?(?:\+(?P<s>\d+(?:\.\d+)?)s)?")

Labels = tuple[tuple[str, str], ...]
Value = tuple[Desc, Labels, float | int]


# --- which disks -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Target:
    """A disk as smartctl addresses it, and the ``device`` label(s) it is exported under."""

    path: str  # /dev/sda, /dev/nvme0, /dev/bus/0
    kind: str | None  # its -d type (sat, nvme, scsi, megaraid,16); None: let smartctl tell (-d test)
    devices: tuple[str, ...]
    open_error: str | None = None  # --scan-open could not open it

    @property
    def name(self) -> str:
        return self.path[len("/dev/"):] if self.path.startswith("/dev/") else self.path


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def nvme_namespaces(sysfs: str, controller: str) -> list[str]:
    """Block devices of an NVMe controller: nvme0 -> nvme0n1, nvme0n2...

    With native NVMe multipath the controller holds paths (nvme0c0n1) and the block device is the
    subsystem's head (nvme0n1), whose number is the subsystem's, not the controller's.
    """
    heads = set()
    for entry in _listdir(os.path.join(sysfs, "class", "nvme", controller)):
        match = NVME_NAMESPACE.fullmatch(entry)
        if match:
            heads.add(f"nvme{match['subsystem']}n{match['namespace']}")
    return sorted(heads, key=natural_key)


def device_labels(path: str, kind: str | None, sysfs: str) -> tuple[str, ...]:
    """The gpuio_disk_* device name(s) of a smartctl device (see the module docstring)."""
    name = path[len("/dev/"):] if path.startswith("/dev/") else path
    if kind and CONTROLLER_TYPE.search(kind):
        return (f"{name}:{kind}",)
    if NVME_CONTROLLER.fullmatch(name):
        return tuple(nvme_namespaces(sysfs, name)) or (name,)
    if re.fullmatch(r"sg\d+", name):
        blocks = sorted(_listdir(os.path.join(sysfs, "class", "scsi_generic", name, "device", "block")))
        return (blocks[0],) if blocks else (name,)
    return (name,)


def parse_scan(lines: Iterable[str], sysfs: str) -> list[Target]:
    """Targets of ``smartctl --scan-open`` output; SmartctlError when none of its lines is one."""
    targets: list[Target] = []
    unknown: list[str] = []
    for line in lines:
        found, failed = SCAN_LINE.match(line), SCAN_FAILED.match(line)
        if found:
            targets.append(Target(found["path"], found["type"], device_labels(found["path"], found["type"], sysfs)))
        elif failed:
            labels = device_labels(failed["path"], failed["type"], sysfs)
            targets.append(Target(failed["path"], failed["type"], labels, failed["why"].strip()))
        elif line.strip():
            unknown.append(line.strip())
    if unknown and not targets:
        raise SmartctlError("error", f"unrecognised --scan-open output: {unknown[0][:200]}")
    return targets


# --- reading one device ----------------------------------------------------------------------------

def number(text: Any) -> int | None:
    """An integer field of pySMART's, or None where the disk printed something else ("---", "?")."""
    try:
        return int(text)
    except (TypeError, ValueError):
        return None


def raw_number(raw: str) -> int | None:
    """An ATA raw value as smartctl prints it: "0", "31 (Min/Max 25/32)", "0x0000000a0001", "1369h+05m"."""
    raw = raw.strip()
    if re.fullmatch(r"0x[0-9a-fA-F]+", raw):
        return int(raw, 16)
    match = re.match(r"\d+", raw)
    return int(match.group()) if match else None


def power_on_seconds(name: str, raw: str) -> float | int | None:
    """Attribute 9 in seconds.  smartctl prints some drives' counts as "1234h+56m(+07.890s)"; a plain
    count is in the unit the attribute's name gives, and a name that gives none gives no value."""
    match = HOURS_MINUTES_SECONDS.match(raw.strip())
    if match:
        return int(match["h"]) * 3600 + int(match["m"] or 0) * 60 + (float(match["s"]) if match["s"] else 0)
    unit, count = POWER_ON_UNITS.get(name), raw_number(raw)
    return None if unit is None or count is None else count * unit


def field_of(attribute: Any, name: str) -> int | None:
    """An integer property of a pySMART Attribute; None where the disk printed no number ("---")."""
    try:
        return number(getattr(attribute, name))
    except (TypeError, ValueError):
        return None


def ata_values(attributes: Sequence[Any]) -> list[Value]:
    """Every attribute in one family, and the five that predict failure under names of their own (by ID,
    as the issue and smartctl_exporter do: vendors rename them, Intel's 187 is "Uncorrectable_Error_Cnt")."""
    values: list[Value] = []
    for attribute in attributes:
        if attribute is None:
            continue
        labels = (("id", str(attribute.num)), ("name", attribute.name))
        raw = raw_number(attribute.raw)
        # Worst is left out, and a threshold of 0 ("never fails", smartctl(8)): this is the largest
        # family of a scrape, and with gzip each byte costs every scrape (docs/smart.md, Performance).
        threshold = field_of(attribute, "thresh")
        for value_type, value in (("normalized", field_of(attribute, "value")), ("raw", raw),
                                  ("threshold", threshold or None)):
            if value is not None:
                values.append((ATA_ATTRIBUTE, (*labels, ("value_type", value_type)), value))
        if attribute.num in ATA_NAMED and raw is not None:
            values.append((ATA_NAMED[attribute.num], (), raw))
        if attribute.num == 9:
            seconds = power_on_seconds(attribute.name, attribute.raw)
            if seconds is not None:
                values.append((POWER_ON, (), seconds))
        if attribute.num == 12 and raw is not None:
            values.append((POWER_CYCLES, (), raw))
    return values


def ratio(percent: int | None) -> float | None:
    return None if percent is None else percent / 100


def nvme_values(nvme: Any) -> list[Value]:
    """The SMART/Health log in base units: percentages as ratios, data units as bytes, hours as seconds."""
    values: list[Value] = []
    if nvme.criticalWarning is not None:
        for bit, name in enumerate(NVME_WARNING_BITS):
            values.append((NVME_WARNING, (("warning", name),), (nvme.criticalWarning >> bit) & 1))
    plain: tuple[tuple[Desc, float | int | None], ...] = (
        (NVME_USED, ratio(nvme.percentageUsed)),
        (NVME_SPARE, ratio(nvme.availableSpare)),
        (NVME_SPARE_THRESHOLD, ratio(nvme.availableSpareThreshold)),
        (NVME_MEDIA_ERRORS, nvme.integrityErrors),
        (NVME_ERROR_LOG, nvme.errorEntries),
        # pySMART's bytesRead parses smartctl's rounded "[1.23 TB]"; the unit count is exact.
        (NVME_READ, None if nvme.dataUnitsRead is None else nvme.dataUnitsRead * NVME_DATA_UNIT_BYTES),
        (NVME_WRITTEN, None if nvme.dataUnitsWritten is None else nvme.dataUnitsWritten * NVME_DATA_UNIT_BYTES),
        (NVME_UNSAFE_SHUTDOWNS, nvme.unsafeShutdowns),
        (POWER_CYCLES, nvme.powerCycles),
        (POWER_ON, None if nvme.powerOnHours is None else nvme.powerOnHours * 3600),
    )
    values.extend((desc, (), value) for desc, value in plain if value is not None)
    return values


def scsi_values(diagnostics: Any) -> list[Value]:
    """SCSI has no attribute table: the grown defect list, the error counter log and the power-on time."""
    values: list[Value] = []
    if diagnostics.Reallocated_Sector_Ct is not None:  # pySMART's name for "Elements in grown defect list"
        values.append((SCSI_GROWN_DEFECTS, (), diagnostics.Reallocated_Sector_Ct))
    for operation, count in (("read", diagnostics.Uncorrected_Reads), ("write", diagnostics.Uncorrected_Writes),
                             ("verify", diagnostics.Uncorrected_Verifies)):
        if count is not None:
            values.append((SCSI_UNCORRECTED, (("operation", operation),), count))
    if diagnostics.Power_On_Hours is not None:
        values.append((POWER_ON, (), diagnostics.Power_On_Hours * 3600))
    return values


def interface_of(attributes: Any) -> str:
    """ata, nvme or scsi: which of pySMART's parsers read the device ("" for none)."""
    return {"AtaAttributes": "ata", "NvmeAttributes": "nvme", "SCSIAttributes": "scsi"}.get(
        type(attributes).__name__, "")


def common_values(device: Any) -> list[Value]:
    """What every protocol reports, as pySMART folds it: health, temperature, capacity."""
    values: list[Value] = []
    if device.assessment is not None:  # PASS, WARN (an attribute failed in the past) or FAIL
        values.append((HEALTH, (), 0 if device.assessment == "FAIL" else 1))
    if device.temperature is not None:
        values.append((TEMPERATURE, (), device.temperature))
    if device.size:
        values.append((CAPACITY, (), device.size))
    return values


def interface_values(attributes: Any) -> list[Value]:
    """The protocol's own values, by which of pySMART's parsers read the output."""
    interface = interface_of(attributes)
    if interface == "ata":
        return ata_values(attributes.legacyAttributes)
    if interface == "nvme":
        return nvme_values(attributes)
    if interface == "scsi":
        return scsi_values(attributes.diagnostics)
    return []


def info_labels(device: Any, target: Target) -> Labels:
    rotational = "0" if device.is_ssd else "1" if device.rotation_rate is not None else ""
    return (("model", device.model or ""), ("serial", device.serial or ""), ("firmware", device.firmware or ""),
            ("interface", interface_of(device.if_attributes)), ("type", target.kind or device.interface or ""),
            ("rotational", rotational), ("smartctl_device", target.path))


@dataclass(frozen=True)
class Reading:
    """What one poll of a device found."""

    info: Labels
    values: tuple[Value, ...]


@dataclass(frozen=True)
class PollResult:
    state: str
    detail: str
    seconds: float
    reading: Reading | None = None
    stuck: subprocess.Popen[bytes] | None = None


def classify(device: Any, values: Sequence[Value]) -> tuple[str, str]:
    """``ok`` when pySMART read SMART data; ``unsupported`` when the disk says it has none (or it is off).

    An output with neither an identity nor a value - truncated or garbled - is an error, so a disk is
    never declared unsupported (or fine: pySMART marks any NVMe device SMART-enabled) on garbage.
    """
    if not (device.model or device.serial or values):
        return "error", "no identity and no SMART data in smartctl's output"
    if device.if_attributes is None or not device.smart_enabled:
        return "unsupported", "SMART unavailable or disabled on the disk"
    return "ok", ""


def pysmart_smartctl(runner: Runner) -> Any:
    """pySMART's Smartctl with ``runner.call`` in place of the method that runs processes."""
    from pySMART.smartctl import Smartctl

    smartctl = Smartctl(smartctl_path=runner.path)
    smartctl.generic_call = runner.call
    return smartctl


def poll(target: Target, path: str, powermode: str, timeout: float, processes: Processes) -> PollResult:
    """Read one disk through pySMART with a deadline; never raises."""
    from pySMART import Device
    from pySMART.utils import smartctl_isvalid_type

    if target.kind is not None and not smartctl_isvalid_type(target.kind):
        return PollResult("unsupported", f"pySMART cannot drive smartctl device type {target.kind!r}", 0.0)
    runner = Runner(path, powermode, timeout, processes)
    started = time.perf_counter()
    try:
        device = Device(target.path, interface=target.kind, smartctl=pysmart_smartctl(runner))
        if runner.failure is not None:  # a swallowed probe failure: pySMART went on with less data
            raise runner.failure
        values = common_values(device) + interface_values(device.if_attributes)
        state, detail = classify(device, values)
        reading = None if state == "error" else Reading(info_labels(device, target), tuple(values))
    except SmartctlError as exc:
        state, detail, reading = exc.state, exc.detail, None
    except Exception as exc:  # pySMART's parser on output it did not expect
        state, detail, reading = "error", f"pySMART could not read the output: {type(exc).__name__}: {exc}", None
    return PollResult(state, detail, time.perf_counter() - started, reading, runner.stuck)


# --- the collector ---------------------------------------------------------------------------------

@dataclass
class Record:
    """One disk across sweeps: its last good reading survives polls that fail or find it asleep."""

    state: str = ""  # none yet: the first poll's outcome is always news
    detail: str = ""
    seconds: float = 0.0
    reading: Reading | None = None
    last_success: float | None = None
    stuck: subprocess.Popen[bytes] | None = None


@register
class SmartCollector(Collector):
    name = "smart"
    options = (
        Option("smartctl-path", None, parse_executable, "a path to an executable file, or a command name",
               "smartctl to run (default: smartctl on PATH; none there means no SMART data).",
               flag="smartctl.path"),  # smartctl_exporter's name for it
        Option("interval", "5m", parse_seconds, "a duration above zero such as 30s, 5m",
               "How often every disk is polled; scrapes serve the last poll."),
        Option("timeout", "30s", parse_seconds, "a duration above zero such as 10s, 1m",
               "Time allowed for one disk's poll (all its smartctl runs); smartctl is killed after it."),
        Option("concurrency", "4", parse_count(1), "a whole number of at least 1",
               "How many disks are polled at the same time."),
        Option("powermode-check", "standby", parse_choice(POWER_MODES), ", ".join(POWER_MODES),
               "smartctl -n: leave a disk alone while it is in this power mode or a deeper one "
               "(never: always poll, which spins sleeping disks up)."),
        Option("device-include", None, parse_regex, "a regular expression",
               "Regexp of disks to poll (device label or smartctl name; exclusive with device-exclude)."),
        Option("device-exclude", None, parse_regex, "a regular expression",
               "Regexp of disks not to poll (device label or smartctl name)."),
        Option("devices", None, parse_devices, "space-separated PATH or PATH;TYPE: '/dev/sda /dev/bus/0;megaraid,8'",
               "Poll these devices instead of the ones smartctl --scan-open finds."),
        Option("max-devices", "256", parse_count(1), "a whole number of at least 1",
               "At most this many disks are polled and exported; the rest are counted as dropped."),
    )

    def __init__(self, context: Context, options: dict[str, Any]) -> None:
        super().__init__(context, options)
        settings = self.settings
        if settings["device-include"] is not None and settings["device-exclude"] is not None:
            raise ConfigError("--collector.smart.device-include and --collector.smart.device-exclude are mutually "
                              "exclusive; accepted: at most one of them")
        # No default in the Option: parse_executable checks a path it is given, and smartctl on PATH is
        # looked for when the collector runs (absent there: no SMART data, not a bad flag).
        self._smartctl: str = settings["smartctl-path"] or "smartctl"
        self._timeout: float = settings["timeout"]
        self._powermode: str = settings["powermode-check"]
        self._concurrency: int = settings["concurrency"]
        self._max_devices: int = settings["max-devices"]
        self._include: re.Pattern[str] | None = settings["device-include"]
        self._exclude: re.Pattern[str] | None = settings["device-exclude"]
        self._configured: tuple[tuple[str, str | None], ...] | None = settings["devices"]
        self._records: dict[Target, Record] = {}  # this sweep's disks; a Record outlives a Target (see sweep)
        self._targets: list[Target] = []
        self._scan_stuck: subprocess.Popen[bytes] | None = None  # a scan killed but not exited: no new one
        self._processes = Processes()
        self._once = LogOnce(log)
        self._denied_logged = False
        self._absent: str | None = None  # why the last sweep had nothing to poll (no smartctl, no disk)
        self._strays_killed = 0
        self.sampler: PeriodicSampler[list[Family]] = PeriodicSampler(
            "smart", self.settings["interval"], self.sweep, log)

    def start(self) -> None:
        if not become_subreaper():
            log.debug("cannot become a child subreaper: processes a smartctl wrapper leaves outside its "
                      "session are not tracked")
        self.sampler.start()

    def stop(self) -> None:
        self.sampler.stop()
        self._processes.kill_all()

    def collect(self) -> list[Family]:
        """The families of the last finished sweep: no smartctl, no parsing, no rendering here."""
        snapshot = self.sampler.snapshot()
        # Served whatever the sweeps gave: strays come most from a wrapper whose every sweep fails.
        strays = Family(STRAYS, [STRAYS.sample("", self._strays_killed)])
        if snapshot.value is None:
            if snapshot.error is not None:
                raise StaleData(f"no SMART data yet: {snapshot.error}", [strays])
            if self.sampler.first_pending():
                raise Pending("the first SMART sweep since start-up (smartctl on every disk) is still running",
                              [strays])
            return []
        served = [*snapshot.value, strays] if snapshot.value else []  # []: no smartctl, no SMART series
        if self._absent is not None:
            raise Absent(self._absent, served)  # no failure; the scraper logs it once
        return served

    # -- one sweep, on the sampler's thread --

    def sweep(self) -> list[Family]:
        """Poll every disk and render the families that scrapes serve until the next sweep."""
        path = shutil.which(self._smartctl)
        if path is None:
            self._absent = f"smartctl not found ({self._smartctl} is not on PATH): no SMART data"
            self._records.clear()
            return []
        try:
            targets, dropped = self._select(self._discover(path))
            self._absent = None if targets or dropped else ("no disk to poll: smartctl --scan-open found none "
                                                                 "(or the device filters left none)")
            # A disk is the same disk while smartctl addresses it the same way, whatever its labels now.
            before = {(target.path, target.kind): record for target, record in self._records.items()}
            self._records = {target: before.get((target.path, target.kind)) or Record() for target in targets}
            self._poll_all(path, targets)
        finally:  # every smartctl of the sweep has ended: what is left of theirs is a stray
            self._kill_strays()
        return self._render(dropped)

    def _kill_strays(self) -> None:
        strays = self._processes.kill_strays()
        self._strays_killed += strays
        if strays:
            self._once.warning("smartctl left processes behind outside its session (a wrapper that "
                               "starts its own?); killed them", self._smartctl, processes=strays)

    def _discover(self, path: str) -> list[Target]:
        """This sweep's disks: the configured ones, or the scan's; a failed scan keeps the last list."""
        if self._configured is not None:
            return [Target(p, kind, device_labels(p, kind, self.context.sysfs)) for p, kind in self._configured]
        runner = Runner(path, self._powermode, self._timeout, self._processes)
        try:
            if self._scan_stuck is not None and self._scan_stuck.poll() is None:  # opening a dead disk hangs
                raise SmartctlError("timeout", f"the last scan (pid {self._scan_stuck.pid}) is still stuck")
            lines, _ = runner.call(["--scan-open"])
            self._targets = parse_scan(lines, self.context.sysfs)
        except SmartctlError as exc:
            if self._processes.closed:
                return self._targets  # stopping: the scan was killed, which is no failure to report
            if not self._targets:
                raise RuntimeError(f"smartctl --scan-open failed: {exc.detail}") from None
            self._once.warning("smartctl --scan-open failed; polling the disks it found before", exc.detail)
        finally:
            self._scan_stuck = runner.stuck or self._scan_stuck
        return self._targets

    def _select(self, targets: list[Target]) -> tuple[list[Target], int]:
        """Filtered, one target per device label (the first found), capped at max-devices."""
        chosen: list[Target] = []
        seen: set[str] = set()
        for target in targets:
            if not self._wanted(target) or seen.intersection(target.devices):
                continue
            seen.update(target.devices)
            chosen.append(target)
        dropped = max(0, len(chosen) - self._max_devices)
        if dropped:
            self._once.warning("more disks than --collector.smart.max-devices; the rest are not polled",
                               str(self._max_devices), dropped=dropped)
        return chosen[: self._max_devices], dropped

    def _wanted(self, target: Target) -> bool:
        names = (target.name, *target.devices)
        if self._include is not None:
            return any(self._include.search(name) for name in names)
        return self._exclude is None or not any(self._exclude.search(name) for name in names)

    def _poll_all(self, path: str, targets: list[Target]) -> None:
        """Poll the due disks in parallel; the backstop wait allows each worker its share of full timeouts."""
        due = [target for target in targets if self._due(target)]
        rounds = -(-len(due) // self._concurrency)  # polls one worker runs one after another, at most
        wait = rounds * (self._timeout + POLL_SLACK_SECONDS) + 30
        results = run_parallel(lambda t: poll(t, path, self._powermode, self._timeout, self._processes),
                               due, self._concurrency, wait)
        for target, result in zip(due, results, strict=True):
            self._record(target, result or PollResult("timeout", "poll did not return", wait))

    def _due(self, target: Target) -> bool:
        """Whether to poll a target now: not if --scan-open could not open it, nor while its smartctl hangs."""
        record = self._records[target]
        if target.open_error is not None:
            state = "permission_denied" if DENIED.search(target.open_error) else "error"
            self._record(target, PollResult(state, f"--scan-open could not open it: {target.open_error}", 0.0))
            return False
        if record.stuck is not None:
            if record.stuck.poll() is None:
                detail = f"smartctl (pid {record.stuck.pid}) still stuck after SIGKILL; not polled again until it exits"
                self._record(target, PollResult("timeout", detail, 0.0, stuck=record.stuck))
                return False
            with contextlib.suppress(subprocess.TimeoutExpired):
                record.stuck.wait(timeout=KILL_GRACE_SECONDS)  # reap it (kill() closed its pipes)
            self._processes.discard(record.stuck)
        return True

    def _record(self, target: Target, result: PollResult) -> None:
        """Keep a poll's outcome; only a poll that read the disk replaces its values and timestamp."""
        record = self._records[target]
        if result.state != record.state or result.detail != record.detail:
            self._log_change(target, result)
        record.state, record.detail, record.seconds, record.stuck = (
            result.state, result.detail, result.seconds, result.stuck)
        if result.reading is not None:
            record.reading, record.last_success = result.reading, time.time()

    def _log_change(self, target: Target, result: PollResult) -> None:
        if self._processes.closed:
            return  # stopping: the polls still queued fail, and that is not news
        context = fields(device=",".join(target.devices), smartctl_device=target.path, state=result.state,
                         detail=result.detail)
        if result.state == "permission_denied":
            if not self._denied_logged:  # one clear line for the whole exporter, not one per disk and sweep
                self._denied_logged = True
                log.error("smartctl has no permission to open disks: run gpuio-exporter as root, or with "
                          "CAP_SYS_RAWIO, CAP_SYS_ADMIN and read access to the disks' device files; "
                          "gpuio_smart_permission_denied is 1", extra=context)
        elif result.state in ("ok", "asleep"):
            log.debug("SMART poll", extra=context)
        elif result.state == "unsupported":
            log.info("disk has no SMART data to export", extra=context)
        else:
            log.warning("SMART poll failed; the disk keeps its last values", extra=context)

    # -- rendering, once per sweep --

    def _render(self, dropped: int) -> list[Family]:
        """Every family's sample lines, built once per sweep so that scrapes only write them out."""
        lines: dict[Desc, list[str]] = {desc: [] for desc in DESCS}
        denied = 0
        for target, record in self._records.items():
            denied |= record.state == "permission_denied"
            for device in target.devices:
                self._render_device(lines, device, record)
        lines[PERMISSION_DENIED].append(PERMISSION_DENIED.sample("", denied))
        lines[DROPPED].append(DROPPED.sample("", dropped))
        # Frozen: these very objects are served until the next sweep, so the server gzips them once.
        return [Family(desc, lines[desc], frozen=True) for desc in DESCS]

    @staticmethod
    def _render_device(lines: dict[Desc, list[str]], device: str, record: Record) -> None:
        for state in STATES:
            lines[STATE].append(STATE.sample(label_string({"device": device, "state": state}),
                                             1 if state == record.state else 0))
        lines[POLL_DURATION].append(POLL_DURATION.sample(label_string({"device": device}), record.seconds))
        if record.last_success is None or record.reading is None:
            return
        lines[LAST_SUCCESS].append(LAST_SUCCESS.sample(label_string({"device": device}), record.last_success))
        lines[DEVICE_INFO].append(DEVICE_INFO.sample(label_string({"device": device, **dict(record.reading.info)}), 1))
        for desc, extra, value in record.reading.values:
            lines[desc].append(desc.sample(label_string({"device": device, **dict(extra)}), value))
