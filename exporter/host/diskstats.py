"""/proc/diskstats: the line parser (Documentation/admin-guide/iostats.rst), and which disks are
saturated now, judged as the rules and ``gpuio top`` judge them (exporter.thresholds.Thresholds.disk_flags).

The collector (exporter.collectors.diskstats) serves the counters; :class:`SaturatedDisks` is for the
GPU-time ledger, which asks every second whether a disk an engine reads is saturated: one read of
/proc/diskstats and one of /proc/pressure/io a call, the rates over the time since the call before.
"""

from __future__ import annotations

import os
import time

from .. import thresholds as th
from .blockdev import BlockDevices
from .lines import BadLine
from .psi import parse_total

MIN_FIELDS = 14  # major, minor, name and the 11 fields every kernel since 2.6 writes
MAX_STATS = 17  # the fields after major, minor and name that a 5.5+ kernel writes; a later kernel's are ignored
MAX_BYTES = 1 << 20  # /proc/diskstats of 4,000 devices is ~600 KiB
SYSFS_REFRESH_SECONDS = 60.0  # a disk sysfs did not list is looked for again at most this often
# Stats indexes (0-based after major, minor, name): what the saturation judgement reads.
READS, READ_MS, WRITES, WRITE_MS, WEIGHTED_MS = 0, 3, 4, 7, 10


def parse_line(line: str) -> tuple[int, int, str, list[int]]:
    """``major, minor, name, stats`` of one diskstats line (up to 17 stats); BadLine if it is not one."""
    parts = line.split()
    if len(parts) < MIN_FIELDS:
        raise BadLine("too_few_fields", f"{len(parts)} fields, at least {MIN_FIELDS} expected")
    try:
        numbers = [int(part) for part in parts[3 : 3 + MAX_STATS]]
        major, minor = int(parts[0]), int(parts[1])
    except ValueError:
        raise BadLine("non_numeric", "non-numeric field") from None
    if major < 0 or minor < 0 or min(numbers) < 0:
        raise BadLine("negative", "negative field")
    return major, minor, parts[2], numbers


class SaturatedDisks:
    """Which of the disks asked about are saturated over the time since the last call: slow for their
    class and (a deep queue, or the node's IO pressure high), as ``gpuio top`` and the alert rules judge
    (Thresholds.disk_flags).  A disk not in /proc/diskstats, or asked about for the first time, is not
    saturated; an unreadable /proc/diskstats makes none saturated (no judgement, no false "starved")."""

    def __init__(self, procfs: str, sysfs: str, limits: th.Thresholds = th.DEFAULT) -> None:
        self.procfs = procfs
        self.limits = limits
        self._devices = BlockDevices(sysfs)
        self._refreshed_at = 0.0  # monotonic: when the sysfs index was last read again for an unknown disk
        self._before: dict[str, tuple[list[int], float]] = {}
        self._pressure_before: tuple[dict[str, int], float] | None = None

    def judge(self, disks: set[str], now: float) -> frozenset[str]:
        """The saturated ones among ``disks``; ``now`` is a monotonic clock."""
        stats = self._read_stats(disks)
        pressure = self._io_pressure_high(now)
        saturated = set()
        for disk, numbers in stats.items():
            before = self._before.get(disk)
            self._before[disk] = (numbers, now)
            if before is None or now <= before[1]:
                continue
            if self._saturated(disk, before[0], numbers, now - before[1], pressure):
                saturated.add(disk)
        for gone in set(self._before) - disks:
            del self._before[gone]
        return frozenset(saturated)

    def _saturated(self, disk: str, old: list[int], new: list[int], seconds: float, pressure: bool) -> bool:
        delta = [max(0, after - before) for before, after in zip(old, new, strict=False)]
        reads, writes = delta[READS], delta[WRITES]
        if disk not in self._devices.devices and time.monotonic() - self._refreshed_at > SYSFS_REFRESH_SECONDS:
            self._devices.refresh()  # a disk that appeared since the index was read (a gone one: not each call)
            self._refreshed_at = time.monotonic()
        flags = self.limits.disk_flags(
            self._devices.rotational(disk), reads / seconds, writes / seconds,
            delta[READ_MS] / 1000 / reads if reads else None, delta[WRITE_MS] / 1000 / writes if writes else None,
            delta[WEIGHTED_MS] / 1000 / seconds, pressure, device=disk)
        return th.SATURATED in flags

    def _read_stats(self, disks: set[str]) -> dict[str, list[int]]:
        if not disks:
            return {}
        try:
            with open(os.path.join(self.procfs, "diskstats"), encoding="ascii", errors="replace") as file:
                text = file.read(MAX_BYTES)
        except OSError:
            return {}
        found: dict[str, list[int]] = {}
        for line in text.splitlines():
            try:
                _, _, name, numbers = parse_line(line)
            except BadLine:
                continue
            if name in disks and len(numbers) > WEIGHTED_MS:
                found[name] = numbers
        return found

    def _io_pressure_high(self, now: float) -> bool:
        """The node's IO pressure over the time since the last call: high as Thresholds.io_pressure_high
        judges (some or full stall share); False where /proc/pressure/io cannot be read."""
        try:
            with open(os.path.join(self.procfs, "pressure", "io"), encoding="ascii") as file:
                text = file.read(4096)
            totals = dict(parse_total(line) for line in text.splitlines() if line.strip())
        except (OSError, BadLine):
            return False
        before, self._pressure_before = self._pressure_before, (totals, now)
        if before is None or now <= before[1]:
            return False
        seconds = now - before[1]

        def share(kind: str) -> float | None:
            if kind not in totals or kind not in before[0]:
                return None
            return max(0, totals[kind] - before[0][kind]) / 1e6 / seconds

        return self.limits.io_pressure_high(share("some"), share("full"))
