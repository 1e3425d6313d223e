"""Alert thresholds: the one place that says when a disk, the node's IO or a GPU is in trouble.

`gpuio top` highlights a row by these judgements, and the alert rules take the same numbers
(deploy/prometheus/config.py imports this module), so that what is red on the node's screen is what
pages.  The module's constants are the defaults; ``Thresholds`` holds one set of them, the knobs of the
rules' config by the same names: ``gpuio top --set GPU_BUSY_LOW=0.2`` and ``python -m deploy.generate
--set GPU_BUSY_LOW=0.2`` judge alike.  All values are in base units: seconds, ratios 0-1.

Why these shapes (from node-mixin's history):
- never %util alone: a parallel device (NVMe, a network volume, md/dm over several disks) can be
  "100 % busy" with plenty of headroom; latency (await) is what the work feels;
- await is judged against the device's class: a spinning disk seeks in 5-15 ms, so 20 ms is normal
  load there but an alarm on flash, where reads take well under 1 ms;
- a disk is *saturated* when it is slow AND work piles up behind it (a deep queue, or tasks stalled
  on IO per PSI): a slow device that nobody waits on is not starving anyone;
- await needs a few completions per second to mean anything: one slow IO on an idle disk (a single
  cold read) is not a storm;
- a GPU that is mostly idle while a disk is saturated is *possibly* starved ("starved?"): at node
  level nothing tells a GPU waiting on data from one that simply has no requests; the engine rows
  (in-flight requests, pool wait) settle it where engines report.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from typing import Any

ROTATIONAL = "rotational"
SOLID_STATE = "solid_state"  # SATA/SAS SSDs, virtio and cloud disks that sysfs calls non-rotational
NVME = "nvme"
NETWORK = "network"  # network block devices: Ceph RBD (rbd*), NBD (nbd*)


@dataclass(frozen=True)
class DiskClass:
    await_seconds: float  # r_await or w_await at or above this is slow
    queue_size: float  # aqu-sz (average requests in flight) at or above this is a deep queue


# A device whose class sysfs does not tell (no rotational attribute, a device sysfs does not know) is
# judged as rotational: the lenient side, since a false page costs more than a late one here.
DISK_CLASSES = {
    ROTATIONAL: DiskClass(await_seconds=0.050, queue_size=4.0),
    SOLID_STATE: DiskClass(await_seconds=0.010, queue_size=16.0),
    # NVMe reads take ~0.1 ms and its queues are deep: 5 ms is far outside its normal even under load.
    NVME: DiskClass(await_seconds=0.005, queue_size=16.0),
    # Every request crosses the network to replicated storage: a few ms is normal, 100 ms is not;
    # the cluster serves many requests in parallel, so a deeper queue is normal too.
    NETWORK: DiskClass(await_seconds=0.100, queue_size=32.0),
}
# Device-name patterns (Python and PromQL regex syntax alike, anchored) of the classes sysfs cannot tell.
# Partitions (nvme0n1p1) are matched too; dm/md devices take their class from their rotational flag.
DEVICE_NAME_CLASSES = (
    (NVME, "nvme[0-9]+n[0-9]+.*"),
    (NETWORK, "(rbd|nbd)[0-9]+.*"),
)
# Await is judged only when the device completed at least this many requests per second (reads for
# r_await, writes for w_await) in the interval.
AWAIT_MIN_IOPS = 5.0

# Node IO pressure (PSI, /proc/pressure/io): the share of time in which some task waited on IO, and
# in which all non-idle tasks did ("full").
IO_PRESSURE_SOME = 0.30
IO_PRESSURE_FULL = 0.10

# GPU busy ratio (busy seconds per second) under which a GPU counts as mostly idle ("GPU busy
# under 30 %").
GPU_BUSY_LOW = 0.30
# Where GPM measures SM activity (Hopper and newer), a GPU is also mostly idle when under 10 % of its SMs
# work (the share of SMs with a warp resident), whatever NVML's busy says: busy reads 100 % while a
# single thread block spins, or while an engine's weights cross PCIe with no SM running (measured on an
# H100: SM activity 0.8 % and 0 %); real work keeps far more SMs busy (a bf16 matmul 97 %, an
# elementwise add 99 %).  SM activity never exceeds busy, so it only adds idle GPUs, never hides one.
GPU_SM_ACTIVE_LOW = 0.10
# Clock-event reasons that mean trouble (GPUThrottled).  sw_power_cap is left out: a fully loaded GPU
# sits at its power limit by design.  gpu_idle, sync_boost and the clock settings are not faults either.
# Heat shows here (sw/hw thermal slowdown), which is why there is no temperature flag of its own.
GPU_THROTTLE_REASONS = ("hw_slowdown", "sw_thermal_slowdown", "hw_thermal_slowdown", "hw_power_brake_slowdown")
# Share of time those reasons held clocks down, over the alert's window, for GPUThrottled.
GPU_THROTTLE_RATIO = 0.25
# Requests waiting this long (mean) for a pooled execution context count as work waiting on an engine.
ENGINE_POOL_WAIT_SECONDS = 0.010

# Flags, as `gpuio top` prints them and `--json` lists them.
AWAIT = "await"  # slow for its class
QUEUE = "queue"  # deep queue for its class
SATURATED = "saturated"  # slow and (deep queue or node IO pressure)
STARVED = "starved?"  # GPU (or engine) mostly idle while a disk is saturated
THROTTLED = "throttled"  # a GPU with one of GPU_THROTTLE_REASONS active
LOST = "lost"  # a GPU the driver reports lost (gpuio_gpu_up 0)
SMART_FAILED = "smart-fail"  # the disk, or a disk under it, fails its SMART overall-health self-assessment


def disk_class(rotational: str | None, device: str | None = None) -> str:
    """The class of a device from its name (NVMe, network block devices) and otherwise from
    gpuio_disk_info's ``rotational`` label ("1", "0" or "")."""
    for name, pattern in DEVICE_NAME_CLASSES:
        if device and re.fullmatch(pattern, device):
            return name
    return SOLID_STATE if rotational == "0" else ROTATIONAL


# The thresholds that are shares of time or of a whole (0-1); the others are counts or seconds (>= 0).
RATIOS = frozenset({"IO_PRESSURE_SOME", "IO_PRESSURE_FULL", "GPU_BUSY_LOW", "GPU_SM_ACTIVE_LOW", "GPU_THROTTLE_RATIO"})


def parse_threshold(name: str, value: str, ratio: bool) -> float:
    """A threshold set by name (``--set NAME=VALUE``): a finite number, at least 0, at most 1 for a ratio.
    nan would compare false everywhere (an alert that never fires), so it is refused like a typo."""
    try:
        number = float(value)
    except ValueError:
        raise ValueError(f"--set {name}={value!r}: expected a number") from None
    if not math.isfinite(number) or number < 0 or (ratio and number > 1):
        accepted = "a share between 0 and 1" if ratio else "a finite number of at least 0"
        raise ValueError(f"--set {name}={value!r}: expected {accepted}")
    return number


@dataclass(frozen=True)
class Thresholds:
    """The numbers a row is judged by (defaults above).  Frozen: another set is
    ``dataclasses.replace(DEFAULT, GPU_BUSY_LOW=0.2)`` or ``DEFAULT.with_overrides(["GPU_BUSY_LOW=0.2"])``."""

    AWAIT_MIN_IOPS: float = AWAIT_MIN_IOPS
    IO_PRESSURE_SOME: float = IO_PRESSURE_SOME
    IO_PRESSURE_FULL: float = IO_PRESSURE_FULL
    GPU_BUSY_LOW: float = GPU_BUSY_LOW
    GPU_SM_ACTIVE_LOW: float = GPU_SM_ACTIVE_LOW
    GPU_THROTTLE_REASONS: tuple[str, ...] = GPU_THROTTLE_REASONS
    GPU_THROTTLE_RATIO: float = GPU_THROTTLE_RATIO
    ENGINE_POOL_WAIT_SECONDS: float = ENGINE_POOL_WAIT_SECONDS

    def with_overrides(self, settings: list[str]) -> Thresholds:
        """These thresholds with ``NAME=VALUE`` settings in place (numbers only); ValueError names what is
        wrong and the names that can be set."""
        numbers = {field.name for field in dataclasses.fields(self) if isinstance(getattr(self, field.name), float)}
        changes: dict[str, Any] = {}
        for setting in settings:
            name, sep, value = setting.partition("=")
            if not sep or name not in numbers:
                raise ValueError(f"--set {setting!r}: expected NAME=VALUE, NAME one of {', '.join(sorted(numbers))}")
            changes[name] = parse_threshold(name, value, name in RATIOS)
        return dataclasses.replace(self, **changes)

    def io_pressure_high(self, some: float | None, full: float | None) -> bool:
        return ((some is not None and some >= self.IO_PRESSURE_SOME)
                or (full is not None and full >= self.IO_PRESSURE_FULL))

    def disk_flags(self, rotational: str | None, reads_per_second: float | None, writes_per_second: float | None,
                   read_await: float | None, write_await: float | None, queue_size: float | None,
                   io_pressure: bool, device: str | None = None) -> list[str]:
        """The flags of one device over one interval: [], or some of AWAIT, QUEUE, SATURATED."""
        limits = DISK_CLASSES[disk_class(rotational, device)]
        slow = any(
            rate is not None and rate >= self.AWAIT_MIN_IOPS and wait is not None and wait >= limits.await_seconds
            for rate, wait in ((reads_per_second, read_await), (writes_per_second, write_await))
        )
        deep = queue_size is not None and queue_size >= limits.queue_size
        flags = [flag for flag, on in ((AWAIT, slow), (QUEUE, deep)) if on]
        if slow and (deep or io_pressure):
            flags.append(SATURATED)
        return flags

    def gpu_idle(self, busy: float | None, sm_active: float | None = None) -> bool:
        """Mostly idle: NVML busy under GPU_BUSY_LOW, or (where GPM measures it) SM activity under
        GPU_SM_ACTIVE_LOW: a GPU busy 100 % with no SM working is idle for its engines."""
        if busy is not None and busy < self.GPU_BUSY_LOW:
            return True
        return sm_active is not None and sm_active < self.GPU_SM_ACTIVE_LOW

    def gpu_starved(self, busy: float | None, any_disk_saturated: bool, sm_active: float | None = None) -> bool:
        return self.gpu_idle(busy, sm_active) and any_disk_saturated

    def gpu_throttled(self, active_reasons: list[str]) -> list[str]:
        """The reasons among those active now that GPUThrottled judges (the alert also wants them to hold
        the clocks down for GPU_THROTTLE_RATIO of its window; a live view judges the moment)."""
        return [reason for reason in active_reasons if reason in self.GPU_THROTTLE_REASONS]

    def engine_starved(self, gpu_busy: float | None, disk_saturated: bool, in_flight: float | None,
                       pool_wait: float | None, contexts: float | None = None,
                       gpu_sm_active: float | None = None) -> bool:
        """An engine's GPU mostly idle while its backing disk is saturated and work queues for it: a mean
        pool wait of at least ENGINE_POOL_WAIT_SECONDS, or as many requests in flight as it has execution
        contexts.  A request in flight is not queueing: a spare replica serving one request now and then
        is idle, not starved."""
        return (self.gpu_starved(gpu_busy, disk_saturated, gpu_sm_active)
                and self.work_waiting(in_flight, pool_wait, contexts))

    def work_waiting(self, in_flight: float | None, pool_wait: float | None, contexts: float | None) -> bool:
        """Work queues for an engine: as many requests in flight as it has execution contexts, or a mean
        pool wait of at least ENGINE_POOL_WAIT_SECONDS (the GPU-time ledger's "waiting" too)."""
        saturated_pool = in_flight is not None and contexts is not None and 0 < contexts <= in_flight
        return saturated_pool or (pool_wait is not None and pool_wait >= self.ENGINE_POOL_WAIT_SECONDS)


DEFAULT = Thresholds()
