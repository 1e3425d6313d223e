"""What the nvml collector knows of each GPU between sweeps, kept by UUID across NVML sessions.

Plain state and the arithmetic on it (busy seconds, per-process busy seconds, GPM sample buffers); no
NVML call is made here: exporter.collectors.nvml reads and renders, nvml_session opens sessions.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from ..exposition import Desc, label_string
from ..host import nvml_device as nv
from ..pods import cgroup

MAX_SAMPLE_PERIOD_US = 1_100_000  # NVML samples utilisation every 1/6 s to 1 s, by product (+10 % jitter)
MAX_PROCESS_HOLD_S = 20.0  # longest gap one per-process sample is held over (a stalled sweep counts no more)

MIB = 1024 * 1024
PERCENT = 0.01  # GPM percent -> ratio: a counter of seconds
MIB_PER_SECOND = MIB  # GPM MiB/s -> a counter of bytes

Reading = tuple[Desc, str, float]


@dataclass(frozen=True)
class GpmMetric:
    """One GPM metric served as a counter: NVML's average over a window x the window's length (see Gpm).
    A percentage (scale PERCENT) is an activity ratio, counted window by window; a MiB/s figure is a byte
    rate, counted from a long-lived baseline.

    Every metric is computed every interval: on an H100 one nvmlGpmSampleGet + nvmlGpmMetricsGet costs
    0.22 ms of CPU for 6 metrics and 0.24 ms for 32 (bench/nvml_bench.py), so a smaller set or a slower
    cadence for some would save nothing worth the staleness.
    """

    metric: int  # NVML_GPM_METRIC_*
    desc: Desc
    labels: tuple[tuple[str, str], ...] = ()
    scale: float = PERCENT

    @property
    def ratio(self) -> bool:
        return self.scale == PERCENT


class BusyIntegrator:
    """Busy seconds from NVML utilisation samples: the sum of value x the period each sample covers.

    Each sample is "percent of the time since the previous sample in which a kernel ran", so the
    integral is exact however rarely it is read, as long as NVML's buffer (about 14 s on an H100)
    has not wrapped.  A gap longer than the longest sample period NVML uses (1 s) is missing data:
    only the sample's own period is counted.  The first read only sets the baseline: what ran before
    the exporter started is not ours to count.
    """

    def __init__(self) -> None:
        self.last_seen_us: int | None = None
        self.seconds = 0.0

    def feed(self, samples: list[tuple[int, float]]) -> None:
        if not samples:
            return
        if self.last_seen_us is None:
            self.last_seen_us = max(timestamp for timestamp, _ in samples)
            return
        for timestamp, percent in sorted(samples):
            if timestamp <= self.last_seen_us:
                continue
            period = min(timestamp - self.last_seen_us, MAX_SAMPLE_PERIOD_US)
            self.seconds += min(max(percent, 0.0), 100.0) / 100.0 * period / 1e6
            self.last_seen_us = timestamp


class ProcessBusy:
    """Per-process busy seconds from nvmlDeviceGetProcessUtilization, bounded to ``limit`` processes.

    What NVML answers (nvml.h: "one utilization sample structure is returned per process running, that
    had some non-zero utilization during the last sample period"; measured on an H100): for each
    process that ran in NVML's *last* sample period, that period's SM and memory percentages and its
    timestamp, if newer than the timestamp passed.  Not an average since that timestamp: two processes
    taking turns, 60 % and 20 % of every second, and a call 5 s after the previous one named only the
    process that had run in the last period.  So an answer is a sample of each process's utilisation,
    and each call counts it over the time since the previous call (a process not named did not run in
    the last period: it adds nothing).  Read every sweep, that estimate converges on the busy time
    over a rate() window, unless a load is periodic in step with the sweep (then no sampler can tell).
    NVML names one process per period on a time-sliced GPU (measured: two processes taking 70 ms turns,
    each 200 ms period named one of them with the whole GPU's utilisation): the split between
    processes holds for turns longer than a period.

    Per process it keeps the newest sample counted: NVML may hand back a sample at or before the
    timestamp passed, and SM or memory figures above 100 (nvtop filters both out): neither is counted.
    A NotFound answer (nothing ran in the last period) counts the interval as idle for everyone.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.called_at: float | None = None  # wall clock (s) of the previous call; None: no baseline yet
        self.newest_us: dict[int, int] = {}  # pid -> timestamp of its newest sample counted
        self.seconds: dict[int, list[float]] = {}  # pid -> [SM busy, memory busy]

    @property
    def last_seen_us(self) -> int:
        """The timestamp to pass NVML: the previous call's time (samples of earlier periods are counted)."""
        return 0 if self.called_at is None else int(self.called_at * 1e6)

    def feed(self, samples: list[nv.ProcessUtilization], now: float, listed: Collection[int] = ()) -> None:
        """One answer, read at wall-clock time ``now`` (seconds): each process's latest period counted
        over the time since the previous call.  ``listed``: the pids whose series are served; they are
        tracked first, whatever the order of NVML's answer (else other processes could fill the table and
        a served one read 0 for ever)."""
        previous, self.called_at = self.called_at, now
        if previous is None:  # the first call only sets the baseline: what ran before is not ours to count
            return
        held = min(max(now - previous, 0.0), MAX_PROCESS_HOLD_S)
        latest = self._latest_per_process(samples, int(previous * 1e6))
        for pid, sample in sorted(latest.items(), key=lambda item: item[0] not in listed):
            totals = self.seconds.get(pid)
            if totals is None:
                if len(self.seconds) >= self.limit and not self._make_room(pid in listed, listed):
                    continue  # past the cap: left out, as the process series are
                totals = self.seconds[pid] = [0.0, 0.0]
            totals[0] += sample.sm / 100 * held
            totals[1] += sample.memory / 100 * held
            self.newest_us[pid] = sample.timestamp_us

    def _latest_per_process(self, samples: list[nv.ProcessUtilization],
                            after_us: int) -> dict[int, nv.ProcessUtilization]:
        latest: dict[int, nv.ProcessUtilization] = {}
        for sample in samples:
            if not (0 <= sample.sm <= 100 and 0 <= sample.memory <= 100):
                continue  # garbage NVML has been seen to return
            if sample.timestamp_us <= max(after_us, self.newest_us.get(sample.pid, 0)):
                continue  # a period already counted, or older than the previous call
            if sample.pid not in latest or sample.timestamp_us > latest[sample.pid].timestamp_us:
                latest[sample.pid] = sample
        return latest

    def _make_room(self, for_listed: bool, listed: Collection[int]) -> bool:
        """Forget one tracked process that is not served, to track a served one (``limit`` is 4 x the
        served processes, so there is one)."""
        spare = next((pid for pid in self.seconds if pid not in listed), None) if for_listed else None
        if spare is None:
            return False
        del self.seconds[spare]
        return True

    def forget(self, pid: int) -> None:
        """Forget one process: its pid now names another process, whose seconds start from zero."""
        self.seconds.pop(pid, None)
        self.newest_us.pop(pid, None)

    def keep(self, pids: set[int]) -> None:
        """Forget the processes that ended (NVML no longer lists them)."""
        for pid in [pid for pid in self.seconds if pid not in pids]:
            del self.seconds[pid]
        for pid in [pid for pid in self.newest_us if pid not in pids]:
            del self.newest_us[pid]


@dataclass
class Gpm:
    """GPM counters from pairs of samples: byte rates from a long-lived baseline, activity ratios from
    one sample to the next.  One Gpm per GPU, and one per MIG GPU instance.

    GPM gives each metric's average between two samples (percent, or MiB/s), but a sample holds the
    counters of GPM's last internal refresh (every 100 ms, nvml.h), so the time NVML divides by
    differs from the time between our two calls by up to 0.1 s.

    **Byte rates** (PCIe, NVLink) are averages over time.  Measured on an H100: 2 GiB moved read as 0
    to 3.6 GiB over windows of 0.04-0.54 s, so average x our own interval would be off by up to 10 %
    each second.  Measured from a baseline ``age`` seconds old, the error is 0.1 s / age of the
    average (0.1 % after 100 s): the counter is ``carry`` + average since the baseline x age.  The
    baseline moves every GPM_REBASE seconds, its totals kept in ``carry``.  Such a total never
    decreases (a wobble of that error must not look like a counter reset).

    **Activity ratios** (SM, occupancy, pipes, DRAM, media) are shares of *cycles*, not of time: SM
    activity is SM cycles with a warp resident over elapsed SM cycles (DCGM's definition of the same
    field), and the SM clock follows the load (345 MHz idle, 1980 MHz busy on an H100).  Averaged
    since a baseline, an idle stretch at the low clock weighs a sixth of busy time at the high one, so
    average x age is not activity-seconds: measured over 4 s windows, an FP32 add read 1.34 SM-active
    seconds per second and a spinning thread block read 0 (the product fell; the never-decreases rule
    held it).  So each ratio is taken from the previous sample to this one (one sweep, during which
    the clock barely moves) x the time between them: never more than that time, and the 0.1 s refresh
    error telescopes away over consecutive windows.
    """

    buffers: tuple[Any, Any, Any]  # the sample buffers allocated for it
    baseline: Any = None  # the buffer holding the byte rates' baseline sample, taken at ``since``
    previous: Any = None  # the buffer holding the latest sample, taken at ``previous_at``
    since: float | None = None  # monotonic time of the baseline; None: no sample yet
    previous_at: float = 0.0
    carry: dict[int, float] = field(default_factory=dict)  # byte metric -> total counted up to the baseline

    def spare(self) -> Any:
        """A buffer holding neither the baseline nor the latest sample: where the next sample goes."""
        return next(b for b in self.buffers if b is not self.baseline and b is not self.previous)


@dataclass
class Gpu:
    """What the collector knows of one GPU, kept by UUID across NVML sessions (counters stay monotonic)."""

    uuid: str
    index: int
    handle: Any = None  # None: not in the current NVML session
    up: bool = False
    labels: str = ""
    info_labels: str = ""
    unsupported: set[str] = field(default_factory=set)
    errors: dict[tuple[str, str], int] = field(default_factory=dict)
    static: list[Reading] = field(default_factory=list)
    fast: list[Reading] = field(default_factory=list)
    slow: list[Reading] = field(default_factory=list)
    busy: BusyIntegrator = field(default_factory=BusyIntegrator)
    process_busy: ProcessBusy = field(default_factory=lambda: ProcessBusy(256))
    gpm: Gpm | None = None
    gpm_metrics: tuple[GpmMetric, ...] = ()  # what this GPU's GPM serves (NVLink only with active links)
    gpm_totals: dict[int, float] = field(default_factory=dict)  # metric -> counter, kept across sessions
    mig_gpm: dict[int, Gpm] = field(default_factory=dict)  # GPU instance id -> its GPM state
    mig_gpm_totals: dict[int, dict[int, float]] = field(default_factory=dict)
    reasons_supported: int = 0x1FF
    xid: dict[str, tuple[int, float]] = field(default_factory=dict)
    dropped: int = 0
    dropped_processes: set[tuple[int, int]] = field(default_factory=set)  # (pid, start time) left out by the cap
    # What is remembered of each process the series show (the kept ones), by pid: its name and pod, and
    # its start time, which tells a new process that got a recycled pid from the one remembered.
    names: dict[int, str] = field(default_factory=dict)
    pods: dict[int, cgroup.PodRef | None] = field(default_factory=dict)  # pid -> its pod (cgroup), kept processes
    starts: dict[int, int] = field(default_factory=dict)  # pid -> start time (clock ticks since boot; 0 unknown)
    mig_uuids: set[str] = field(default_factory=set)  # its MIG devices at the last slow read
    # Every compute process at the last slow read, cap or not: pid -> start time (0 where /proc shows none).
    started: dict[int, int] = field(default_factory=dict)
    used: dict[int, int | None] = field(default_factory=dict)  # pid -> its used memory (bytes) at that read
    label_cache: dict[tuple[tuple[str, str], ...], str] = field(default_factory=dict)

    def attach(self, index: int, handle: Any) -> None:
        """Join a new NVML session: fresh handle, nothing known unsupported, no stale readings."""
        self.index, self.handle, self.up = index, handle, True
        self.unsupported = set()
        self.static, self.fast, self.slow = [], [], []
        self.gpm, self.gpm_metrics, self.mig_gpm = None, (), {}
        self.label_cache = {}
        self.labels = label_string({"gpu": str(index), "uuid": self.uuid})

    def label(self, extra: tuple[tuple[str, str], ...]) -> str:
        if not extra:
            return self.labels
        labels = self.label_cache.get(extra)
        if labels is None:
            if len(self.label_cache) > 1000:  # pids and MIG devices come and go
                self.label_cache.clear()
            labels = self.label_cache[extra] = label_string({"gpu": str(self.index), "uuid": self.uuid, **dict(extra)})
        return labels
