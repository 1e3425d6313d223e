"""``gpuio top``: one terminal screen of this node's disks, GPUs and engines, judged as the alerts judge.

Data path: a *source* yields snapshots (every sample of one scrape, parsed from the text exposition
with prometheus_client's parser), either in-process through the exporter's own collectors (the same
``build_scraper`` the server uses, so the same flags: ``--path.procfs``, ``--collector.*``) or from a
running exporter (``--url``).  Two consecutive snapshots give one :class:`View`: iostat -x figures per
device, PSI rates, GPU busy ratio from the busy-seconds counter, engine latency quantiles from histogram
buckets.  Everything is keyed on metric names, all listed in one block below, so a collector that
lands later (nvml, engines) shows up without code here, and a renamed metric is a one-line change.

Judgements (highlight, flags) come from :mod:`exporter.thresholds`, the numbers the alert rules use.

The screen is drawn with rich (Live on the alternate screen); keys are read from the terminal in
cbreak mode with select(), so nothing here writes an escape sequence of its own.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import dataclasses
import gzip
import json
import logging
import math
import operator
import os
import select
import sys
import termios
import time
import tty
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import IO, Any, Protocol

from rich.console import Console, Group, RenderableType
from rich.layout import Layout
from rich.live import Live
from rich.table import Table
from rich.text import Text

from gpuio.spool import SERIES

from . import collect
from . import thresholds as th
from .collectors import diskstats, engines, nvml, pressure, smart
from .sorting import natural_key
from .terminal import printable, safe_text

# --- The families top reads, from their declarations in the collectors (never a copied literal). ---
# Disks (diskstats collector; node_exporter's node_disk_* semantics).
DISK_READS = diskstats.READS_COMPLETED.name
DISK_WRITES = diskstats.WRITES_COMPLETED.name
DISK_READ_BYTES = diskstats.READ_BYTES.name
DISK_WRITTEN_BYTES = diskstats.WRITTEN_BYTES.name
DISK_READ_TIME = diskstats.READ_TIME.name
DISK_WRITE_TIME = diskstats.WRITE_TIME.name
DISK_IO_TIME = diskstats.IO_TIME.name
DISK_IO_TIME_WEIGHTED = diskstats.IO_TIME_WEIGHTED.name
DISK_INFO = diskstats.INFO_DESC.name  # label rotational: "1", "0" or ""
DISK_PHYSICAL = diskstats.PHYSICAL_DESC.name  # labels device, physical_device
# Disk health (smart collector): 1 passed, 0 failed, labelled device.
SMART_HEALTH = smart.HEALTH.name
# IO pressure (pressure collector), counters of seconds.
PSI_IO_SOME = pressure.DESCS[("io", "some")].name
PSI_IO_FULL = pressure.DESCS[("io", "full")].name
PSI_MEMORY_SOME = pressure.DESCS[("memory", "some")].name
PSI_MEMORY_FULL = pressure.DESCS[("memory", "full")].name
PSI_CPU_SOME = pressure.DESCS[("cpu", "some")].name
# GPUs (nvml collector), every series labelled gpu (index) and uuid.
GPU_LABEL, GPU_UUID_LABEL = nvml.GPU  # "gpu" (NVML's index), "uuid"
GPU_INFO = nvml.INFO_DESC.name  # labels gpu, uuid, name, ...
GPU_UP = nvml.UP.name
GPU_BUSY = nvml.BUSY.name
GPU_SM_ACTIVE = nvml.SM_ACTIVE.name  # GPM (Hopper and newer): where present, "idle" is judged on it
GPU_MEMORY_USED = nvml.MEMORY_USED.name
GPU_MEMORY_TOTAL = nvml.MEMORY_TOTAL.name
GPU_TEMPERATURE = nvml.TEMPERATURE.name
GPU_POWER = nvml.POWER.name  # NVML's 1 s average (the energy counter is read only every 10 s)
# Age of the NVML sweep a scrape serves: GPU counters advance once per sweep, so their rates are taken
# over the sweeps' own interval (scrape time minus age), not the scrapes'.
GPU_AGE = nvml.AGE.name
GPU_THROTTLE = nvml.REASON.name  # one 0/1 series per reason
GPU_THROTTLE_REASON_LABEL = "reason"
# Clock-event reasons that are no slowdown (an idle GPU, clocks an operator or a display set): not listed.
# Of those listed, only thresholds.GPU_THROTTLE_REASONS flag a row (sw_power_cap is listed, not flagged).
GPU_THROTTLE_IGNORED = ("gpu_idle", "applications_clocks_setting", "display_clock_setting")
# Engines (engines collector), every series labelled engine.
ENGINE_LABEL = "engine"
ENGINE_INFO = engines.ENGINE_INFO.name  # labels engine, path, device, gpu_uuid (one series per file and GPU)
ENGINE_INFO_DEVICE_LABEL = "device"
ENGINE_INFO_GPU_LABEL = "gpu_uuid"
ENGINE_LATENCY = SERIES["inference_seconds"].name  # histogram (_bucket, _sum, _count)
ENGINE_IN_FLIGHT = engines.IN_FLIGHT.name
ENGINE_POOL_CONTEXTS = engines.POOL_CONTEXTS.name  # execution contexts: in flight at or above them queues
ENGINE_POOL_WAIT = SERIES["pool_wait_seconds"].name  # histogram
ENGINE_RESIDENCY = engines.FILE_RATIO.name  # per file (engine, path): the least cached is shown
ENGINE_PHYSICAL = engines.PHYSICAL_INFO.name  # labels engine, path, physical_device
# The exporter itself.
COLLECTOR_SUCCESS = collect.SUCCESS.name
# ---------------------------------------------------------------------------------------------------

log = logging.getLogger("gpuio.top")
MIB = 1024.0 * 1024.0  # iostat's "MB" in rMB/s is 2^20 bytes (sectors / 2048)
GIB = 1024.0**3

Labels = dict[str, str]


class SourceError(Exception):
    """A snapshot could not be taken (exporter unreachable, bad answer); the message is for the screen."""


@dataclass
class Snapshot:
    """Every sample of one scrape, by sample name, and when it was taken (a monotonic clock)."""

    at: float
    series: dict[str, list[tuple[Labels, float]]]

    def values(self, name: str, key: str, combine: Callable[[float, float], float] = operator.add) -> dict[str, float]:
        """``{labels[key]: value}``, the series of the other labels combined (summed by default)."""
        out: dict[str, float] = {}
        for labels, value in self.series.get(name, ()):
            if key in labels and not math.isnan(value):
                seen = out.get(labels[key])
                out[labels[key]] = value if seen is None else combine(seen, value)
        return out

    def per_gpu(self, name: str) -> dict[str, float]:
        """``{gpu: value}`` of a per-GPU family (the first series of each GPU)."""
        out: dict[str, float] = {}
        for labels, value in self.series.get(name, ()):
            key = _gpu_key(labels)
            if key is not None and key not in out and not math.isnan(value):
                out[key] = value
        return out

    def scalar(self, name: str) -> float | None:
        found = self.series.get(name)
        return found[0][1] if found else None

    def labels(self, name: str) -> list[Labels]:
        return [labels for labels, _ in self.series.get(name, ())]


def parse_exposition(text: str) -> dict[str, list[tuple[Labels, float]]]:
    from prometheus_client.parser import text_string_to_metric_families

    series: dict[str, list[tuple[Labels, float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            series.setdefault(sample.name, []).append((dict(sample.labels), float(sample.value)))
    return series


class Source(Protocol):
    description: str

    def start(self) -> None: ...

    def sample(self) -> Snapshot: ...

    def close(self) -> None: ...


class LocalSource:
    """This machine, through the exporter's own collectors (its flags decide which, and where)."""

    def __init__(self, config: Any, clock: Callable[[], float] = time.monotonic) -> None:
        from .assemble import build_scraper

        # process_* would describe this gpuio top process, not the node.
        self.scraper = build_scraper(dataclasses.replace(config, disable_exporter_metrics=True))
        self.clock = clock
        self.description = "this machine" if config.procfs == "/proc" else f"procfs {config.procfs}"

    def start(self) -> None:
        self.scraper.start()

    def sample(self) -> Snapshot:
        from .exposition import render

        text = render(self.scraper.scrape_sync())
        return Snapshot(self.clock(), parse_exposition(text))

    def close(self) -> None:
        self.scraper.stop()


class UrlSource:
    """A running exporter's /metrics (text format; gzip accepted)."""

    def __init__(self, url: str, clock: Callable[[], float] = time.monotonic, timeout: float = 5.0) -> None:
        parts = urllib.parse.urlsplit(url if "://" in url else "http://" + url)
        self.headers = {"Accept": "text/plain;version=0.0.4", "Accept-Encoding": "gzip", "User-Agent": "gpuio-top"}
        if parts.username is not None:  # http://user:password@node:9817 (--web.config.file basic auth)
            user = urllib.parse.unquote(parts.username)
            password = urllib.parse.unquote(parts.password or "")
            self.headers["Authorization"] = "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()
        host = parts.hostname or ""
        netloc = (f"[{host}]" if ":" in host else host) + (f":{parts.port}" if parts.port else "")
        # A bare host:port means the default telemetry path.
        self.url = urllib.parse.urlunsplit((parts.scheme, netloc, parts.path or "/metrics", parts.query, ""))
        self.clock = clock
        self.timeout = timeout
        self.description = self.url  # without the password

    def start(self) -> None:
        pass

    def sample(self) -> Snapshot:
        request = urllib.request.Request(self.url, headers=self.headers)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                body = response.read()
                if response.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
        except urllib.error.HTTPError as exc:
            raise SourceError(f"{self.url}: HTTP {exc.code} {exc.reason}") from None
        except (OSError, EOFError) as exc:
            raise SourceError(f"{self.url}: {getattr(exc, 'reason', None) or exc}") from None
        try:
            return Snapshot(self.clock(), parse_exposition(body.decode("utf-8", errors="replace")))
        except ValueError as exc:
            raise SourceError(f"{self.url}: not a Prometheus text exposition ({exc})") from None

    def close(self) -> None:
        pass


# --- figures -----------------------------------------------------------------------------------------


def increase(before: float | None, after: float | None) -> float | None:
    """A counter's increase, with Prometheus' reset rule: a counter that went down restarted from zero."""
    if before is None or after is None:
        return None
    return after - before if after >= before else after


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or not denominator:
        return None
    return numerator / denominator


@dataclass
class Pressure:
    """Share of the interval (0-1) in which some task / all non-idle tasks stalled, per resource."""

    io_some: float | None = None
    io_full: float | None = None
    memory_some: float | None = None
    memory_full: float | None = None
    cpu_some: float | None = None
    io_high: bool = False


@dataclass
class DiskRow:
    device: str
    rotational: bool | None
    reads_per_second: float | None
    writes_per_second: float | None
    read_bytes_per_second: float | None
    written_bytes_per_second: float | None
    read_await_seconds: float | None  # None: no read completed in the interval (iostat prints 0.00)
    write_await_seconds: float | None
    queue_size: float | None  # aqu-sz
    utilization: float | None  # %util / 100
    flags: list[str] = field(default_factory=list)


@dataclass
class GpuRow:
    gpu: str
    uuid: str
    name: str
    up: bool | None
    busy: float | None  # busy seconds per second over the interval
    memory_used_bytes: float | None
    memory_total_bytes: float | None
    temperature_celsius: float | None
    power_watts: float | None
    throttle_reasons: list[str]
    sm_active: float | None = None  # SM-active seconds per second (GPM, Hopper and newer); None without GPM
    flags: list[str] = field(default_factory=list)


@dataclass
class EngineRow:
    engine: str
    gpu: str | None
    device: str | None
    latency_p50_seconds: float | None
    latency_p99_seconds: float | None
    in_flight: float | None
    pool_wait_seconds: float | None  # mean wait for a pooled context over the interval
    residency_ratio: float | None
    flags: list[str] = field(default_factory=list)


@dataclass
class View:
    source: str
    interval_seconds: float
    taken_at: float  # wall clock (time.time()) of the second snapshot
    pressure: Pressure
    disks: list[DiskRow]
    gpus: list[GpuRow]
    engines: list[EngineRow]
    failing_collectors: list[str]


def compute(before: Snapshot, after: Snapshot, source: str = "", now: float | None = None) -> View:
    """The figures of the interval between two snapshots of the same source."""
    seconds = after.at - before.at
    if seconds <= 0:
        raise ValueError("the second snapshot must be later than the first")
    pressure = _pressure(before, after, seconds)
    disks = _disks(before, after, seconds, pressure.io_high)
    saturated = {row.device for row in disks if th.SATURATED in row.flags}
    gpus = _gpus(before, after, seconds, bool(saturated))
    engines = _engines(before, after, gpus, saturated)
    failing = sorted(k for k, v in after.values(COLLECTOR_SUCCESS, "collector").items() if v == 0)
    return View(source, seconds, time.time() if now is None else now, pressure, disks, gpus, engines, failing)


def _rate(before: Snapshot, after: Snapshot, name: str, seconds: float) -> float | None:
    return ratio(increase(before.scalar(name), after.scalar(name)), seconds)


def _pressure(before: Snapshot, after: Snapshot, seconds: float) -> Pressure:
    def rate(name: str) -> float | None:
        return _rate(before, after, name, seconds)

    pressure = Pressure(io_some=rate(PSI_IO_SOME), io_full=rate(PSI_IO_FULL), memory_some=rate(PSI_MEMORY_SOME),
                        memory_full=rate(PSI_MEMORY_FULL), cpu_some=rate(PSI_CPU_SOME))
    pressure.io_high = th.io_pressure_high(pressure.io_some, pressure.io_full)
    return pressure


def _disks(before: Snapshot, after: Snapshot, seconds: float, io_pressure: bool) -> list[DiskRow]:
    names = (DISK_READS, DISK_WRITES, DISK_READ_BYTES, DISK_WRITTEN_BYTES, DISK_READ_TIME, DISK_WRITE_TIME,
             DISK_IO_TIME, DISK_IO_TIME_WEIGHTED)
    old = {name: before.values(name, "device") for name in names}
    new = {name: after.values(name, "device") for name in names}
    rotational = {labels["device"]: labels.get("rotational", "") for labels in after.labels(DISK_INFO)
                  if "device" in labels}
    physical = _physical(after)
    failed = {device for device, passed in after.values(SMART_HEALTH, "device").items() if passed == 0}
    rows = []
    for device in sorted(new[DISK_READS]):
        delta = {name: increase(old[name].get(device), new[name].get(device)) for name in names}
        reads, writes = delta[DISK_READS], delta[DISK_WRITES]
        utilization = ratio(delta[DISK_IO_TIME], seconds)
        row = DiskRow(
            device=device,
            rotational={"1": True, "0": False}.get(rotational.get(device, "")),
            reads_per_second=ratio(reads, seconds),
            writes_per_second=ratio(writes, seconds),
            read_bytes_per_second=ratio(delta[DISK_READ_BYTES], seconds),
            written_bytes_per_second=ratio(delta[DISK_WRITTEN_BYTES], seconds),
            read_await_seconds=ratio(delta[DISK_READ_TIME], reads),  # the idle guard: None without IO
            write_await_seconds=ratio(delta[DISK_WRITE_TIME], writes),
            queue_size=ratio(delta[DISK_IO_TIME_WEIGHTED], seconds),
            utilization=None if utilization is None else min(1.0, utilization),
        )
        row.flags = th.disk_flags(rotational.get(device), row.reads_per_second, row.writes_per_second,
                                  row.read_await_seconds, row.write_await_seconds, row.queue_size, io_pressure,
                                  device=device)
        if ({device} | physical.get(device, set())) & failed:
            row.flags.append(th.SMART_FAILED)  # the disk, or a disk under it, fails its SMART self-assessment
        rows.append(row)
    return rows


def _physical(snapshot: Snapshot) -> dict[str, set[str]]:
    """device -> the whole disks at the bottom of its stack (gpuio_disk_physical_device_info)."""
    physical: dict[str, set[str]] = {}
    for labels in snapshot.labels(DISK_PHYSICAL):
        physical.setdefault(labels.get("device", ""), set()).add(labels.get("physical_device", ""))
    return physical


def _gpu_key(labels: Labels) -> str | None:
    return labels.get(GPU_LABEL) or labels.get(GPU_UUID_LABEL)


def _gpus(before: Snapshot, after: Snapshot, seconds: float, disk_saturated: bool) -> list[GpuRow]:
    identity: dict[str, Labels] = {}
    for name in (GPU_INFO, GPU_UP, GPU_BUSY, GPU_MEMORY_USED, GPU_TEMPERATURE):
        for labels in after.labels(name):
            key = _gpu_key(labels)
            if key is not None:
                identity.setdefault(key, {}).update({k: v for k, v in labels.items() if v})
    if not identity:
        return []

    age_before, age_after = before.scalar(GPU_AGE), after.scalar(GPU_AGE)
    if age_before is not None and age_after is not None:
        seconds -= age_after - age_before  # the time between the two NVML sweeps
    # No new sweep in the interval (it is shorter than the collector's): no rate, rather than 0.

    def per_second(name: str) -> dict[str, float]:
        old, new = before.per_gpu(name), after.per_gpu(name)
        out: dict[str, float] = {}
        for key in new:
            value = ratio(increase(old.get(key), new[key]), seconds) if seconds > 1e-3 else None
            if value is not None:
                out[key] = value
        return out

    latest = after.per_gpu
    up, busy, used, total = latest(GPU_UP), per_second(GPU_BUSY), latest(GPU_MEMORY_USED), latest(GPU_MEMORY_TOTAL)
    temperature, power, sm_active = latest(GPU_TEMPERATURE), latest(GPU_POWER), per_second(GPU_SM_ACTIVE)
    throttled: dict[str, list[str]] = {}
    for labels, value in after.series.get(GPU_THROTTLE, ()):
        reason, key = labels.get(GPU_THROTTLE_REASON_LABEL, ""), _gpu_key(labels)
        if key is not None and value >= 1 and reason not in GPU_THROTTLE_IGNORED:
            throttled.setdefault(key, []).append(reason)
    rows = []
    for key in sorted(identity, key=natural_key):
        row = GpuRow(
            gpu=key, uuid=identity[key].get(GPU_UUID_LABEL, ""), name=identity[key].get("name", ""),
            up=None if key not in up else up[key] >= 1,
            busy=None if key not in busy else max(0.0, min(1.0, busy[key])),
            sm_active=None if key not in sm_active else max(0.0, min(1.0, sm_active[key])),
            memory_used_bytes=used.get(key), memory_total_bytes=total.get(key),
            temperature_celsius=temperature.get(key), power_watts=power.get(key),
            throttle_reasons=sorted(throttled.get(key, [])),
        )
        row.flags = [flag for flag, on in (
            (th.LOST, row.up is False),
            (th.STARVED, th.gpu_starved(row.busy, disk_saturated, row.sm_active)),
            (th.THROTTLED, bool(th.gpu_throttled(row.throttle_reasons))),
        ) if on]
        rows.append(row)
    return rows


def histogram_quantile(quantile: float, buckets: dict[float, float]) -> float | None:
    """Prometheus' histogram_quantile over ``{upper bound: cumulative count}`` (linear in a bucket)."""
    bounds = sorted(buckets)
    if not bounds or bounds[-1] != math.inf or buckets[math.inf] <= 0:
        return None
    rank = quantile * buckets[math.inf]
    lower, below = 0.0, 0.0
    for index, bound in enumerate(bounds):
        count = buckets[bound]
        if count >= rank:
            if bound == math.inf:
                return bounds[index - 1] if index > 0 else None
            if count == below:
                return bound
            return lower + (bound - lower) * (rank - below) / (count - below)
        lower, below = bound, count
    return None


def _bucket_increase(before: Snapshot, after: Snapshot, histogram: str) -> dict[str, dict[float, float]]:
    """Per engine: ``{le: increase of the cumulative bucket count}`` over the interval."""
    def buckets(snapshot: Snapshot) -> dict[str, dict[float, float]]:
        out: dict[str, dict[float, float]] = {}
        for labels, value in snapshot.series.get(histogram + "_bucket", ()):
            if ENGINE_LABEL in labels and "le" in labels:
                per = out.setdefault(labels[ENGINE_LABEL], {})
                bound = float(labels["le"])
                per[bound] = per.get(bound, 0.0) + value
        return out

    old, new = buckets(before), buckets(after)
    return {engine: {le: increase(old.get(engine, {}).get(le), count) or 0.0 for le, count in per.items()}
            for engine, per in new.items() if engine in old}


def _engines(before: Snapshot, after: Snapshot, gpus: list[GpuRow], saturated: set[str]) -> list[EngineRow]:
    def complete(labels: Labels) -> bool:
        return bool(labels.get(ENGINE_INFO_DEVICE_LABEL) and labels.get(ENGINE_INFO_GPU_LABEL))

    # An engine loaded from several files or on several GPUs has several info series: the first that
    # names both a disk and a GPU, else the first.
    info: dict[str, Labels] = {}
    for labels in after.labels(ENGINE_INFO):
        engine = labels.get(ENGINE_LABEL)
        if engine is not None and (engine not in info or (complete(labels) and not complete(info[engine]))):
            info[engine] = labels
    latency = _bucket_increase(before, after, ENGINE_LATENCY)
    in_flight = after.values(ENGINE_IN_FLIGHT, ENGINE_LABEL)
    contexts = after.values(ENGINE_POOL_CONTEXTS, ENGINE_LABEL)
    residency = after.values(ENGINE_RESIDENCY, ENGINE_LABEL, min)
    wait_sum, wait_count = ((before.values(ENGINE_POOL_WAIT + suffix, ENGINE_LABEL),
                             after.values(ENGINE_POOL_WAIT + suffix, ENGINE_LABEL)) for suffix in ("_sum", "_count"))
    names = set(info) | set(latency) | set(in_flight) | set(residency) | set(wait_count[1])
    by_uuid = {gpu.uuid: gpu for gpu in gpus if gpu.uuid}
    physical = _physical(after)
    engine_disks: dict[str, set[str]] = {}
    for labels in after.labels(ENGINE_PHYSICAL):
        engine_disks.setdefault(labels.get(ENGINE_LABEL, ""), set()).add(labels.get("physical_device", ""))
    rows = []
    for engine in sorted(names):
        labels = info.get(engine, {})
        gpu = by_uuid.get(labels.get(ENGINE_INFO_GPU_LABEL, ""))
        device = labels.get(ENGINE_INFO_DEVICE_LABEL) or None
        pool_wait = ratio(increase(wait_sum[0].get(engine), wait_sum[1].get(engine)),
                          increase(wait_count[0].get(engine), wait_count[1].get(engine)))
        buckets = latency.get(engine, {})
        row = EngineRow(
            engine=engine, gpu=gpu.gpu if gpu else labels.get(ENGINE_INFO_GPU_LABEL) or None, device=device,
            latency_p50_seconds=histogram_quantile(0.5, buckets), latency_p99_seconds=histogram_quantile(0.99, buckets),
            in_flight=in_flight.get(engine), pool_wait_seconds=pool_wait, residency_ratio=residency.get(engine),
        )
        disks = engine_disks.get(engine, set()) | ({device} | physical.get(device, set()) if device else set())
        disk_saturated = bool(disks & saturated)
        if th.engine_starved(gpu.busy if gpu else None, disk_saturated, row.in_flight, row.pool_wait_seconds,
                             contexts.get(engine), gpu.sm_active if gpu else None):
            row.flags.append(th.STARVED)
        rows.append(row)
    return rows


def view_json(view: View) -> dict[str, Any]:
    return dataclasses.asdict(view)


# --- tables: columns, sorting, filtering -------------------------------------------------------------

SEVERITY = {th.SATURATED: 3, th.STARVED: 3, th.SMART_FAILED: 3, th.LOST: 3, th.AWAIT: 2,
            th.QUEUE: 1, th.THROTTLED: 1}


def severity(flags: list[str]) -> int:
    return max((SEVERITY.get(flag, 1) for flag in flags), default=0)


def num(value: float | None) -> str:
    """At most 6 characters, iostat-like precision for small numbers."""
    if value is None:
        return "-"
    magnitude = abs(value)
    if round(magnitude, 2) < 10:  # rounded first: 9.999 is "10.0", not "10.00"
        return f"{value:.2f}"
    if round(magnitude, 1) < 1000:
        return f"{value:.1f}"
    if round(magnitude) < 100_000:
        return f"{value:.0f}"
    if round(magnitude / 1000) < 100_000:
        return f"{value / 1000:.0f}k"
    return f"{value / 1e6:.0f}M"


def scaled(value: float | None, factor: float) -> float | None:
    return None if value is None else value * factor


@dataclass(frozen=True)
class Column:
    header: str
    width: int
    text: Callable[[Any], str]
    key: Callable[[Any], Any]
    numeric: bool = True  # sorted high to low first
    left: bool = False  # aligned left (names, lists) rather than right (numbers)


def _col(header: str, width: int, attribute: str, factor: float = 1.0) -> Column:
    def value(row: Any) -> float | None:
        return scaled(getattr(row, attribute), factor)

    return Column(header, width, lambda row: num(value(row)), value)


def flag_text(flags: list[str]) -> str:
    """The most severe flag, and how many more (--json lists them all): "saturated+2"."""
    if not flags:
        return ""
    worst = max(flags, key=lambda flag: SEVERITY.get(flag, 1))
    return worst + (f"+{len(flags) - 1}" if len(flags) > 1 else "")


def _flags(tiebreak: Callable[[Any], float | None]) -> Column:
    return Column("flags", 11, lambda row: flag_text(row.flags),
                  lambda row: (severity(row.flags), tiebreak(row) or 0.0), left=True)


def _memory(row: GpuRow) -> str:
    if row.memory_total_bytes is None:
        return num(scaled(row.memory_used_bytes, 1 / GIB))
    return f"{num(scaled(row.memory_used_bytes, 1 / GIB))}/{row.memory_total_bytes / GIB:.0f}G"


@dataclass(frozen=True)
class TableSpec:
    name: str
    columns: tuple[Column, ...]
    rows: Callable[[View], list[Any]]
    match: Callable[[Any], str]  # the text the filter searches
    empty: str  # shown when the source has no such series at all


TABLES = (
    TableSpec("disk", (
        Column("disk", 10, lambda r: r.device, lambda r: r.device, numeric=False),
        _col("r/s", 6, "reads_per_second"),
        _col("w/s", 6, "writes_per_second"),
        _col("rMB/s", 6, "read_bytes_per_second", 1 / MIB),
        _col("wMB/s", 6, "written_bytes_per_second", 1 / MIB),
        _col("r_await", 7, "read_await_seconds", 1000.0),
        _col("w_await", 7, "write_await_seconds", 1000.0),
        _col("aqu-sz", 6, "queue_size"),
        _col("%util", 5, "utilization", 100.0),
        _flags(lambda r: r.utilization),
    ), lambda v: v.disks, lambda r: r.device, "no gpuio_disk_* series (diskstats collector off?)"),
    TableSpec("gpu", (
        Column("gpu", 4, lambda r: r.gpu, lambda r: natural_key(r.gpu), numeric=False),
        _col("busy%", 5, "busy", 100.0),
        _col("sm%", 5, "sm_active", 100.0),
        Column("mem GiB", 10, _memory, lambda r: r.memory_used_bytes),
        _col("temp", 4, "temperature_celsius"),
        _col("watts", 5, "power_watts"),
        Column("throttle", 20, lambda r: ",".join(r.throttle_reasons) or "-",
               lambda r: len(r.throttle_reasons), left=True),
        _flags(lambda r: None if r.busy is None else 1.0 - r.busy),
    ), lambda v: v.gpus, lambda r: f"{r.gpu} {r.uuid} {r.name}", "no gpuio_gpu_* series (no GPU, or nvml off)"),
    TableSpec("engine", (
        Column("engine", 14, lambda r: r.engine, lambda r: r.engine, numeric=False),
        Column("gpu", 4, lambda r: r.gpu or "-", lambda r: r.gpu or "", numeric=False),
        Column("disk", 8, lambda r: r.device or "-", lambda r: r.device or "", numeric=False),
        _col("p50 ms", 6, "latency_p50_seconds", 1000.0),
        _col("p99 ms", 6, "latency_p99_seconds", 1000.0),
        _col("inflt", 5, "in_flight"),
        _col("wait ms", 7, "pool_wait_seconds", 1000.0),
        _col("cache%", 6, "residency_ratio", 100.0),
        _flags(lambda r: r.latency_p99_seconds),
    ), lambda v: v.engines, lambda r: f"{r.engine} {r.gpu or ''} {r.device or ''}",
        "no gpuio_engine_* series (no instrumented engines)"),
)
TABLE_NAMES = tuple(spec.name for spec in TABLES)


@dataclass
class UiState:
    """What the keys change: the table in focus, each table's sort column and order, the filter."""

    focus: str = "disk"
    sort: dict[str, str] = field(default_factory=lambda: {spec.name: "flags" for spec in TABLES})
    reverse: dict[str, bool] = field(default_factory=lambda: {spec.name: False for spec in TABLES})
    filter: str = ""
    paused: bool = False
    editing: str | None = None  # the filter being typed, None when not typing
    before_edit: str = ""  # the filter to restore when typing is cancelled

    def column(self, table: str) -> Column:
        """The column a table is sorted by."""
        return next(c for spec in TABLES if spec.name == table for c in spec.columns if c.header == self.sort[table])

    def descending(self, table: str) -> bool:
        return self.column(table).numeric != self.reverse[table]

    def sort_by(self, header: str) -> bool:
        """Sort every table that has a column of that header by it; False if none has."""
        found = False
        for spec in TABLES:
            if any(column.header == header for column in spec.columns):
                self.sort[spec.name], self.reverse[spec.name], found = header, False, True
        return found


def arrange(spec: TableSpec, view: View, ui: UiState) -> list[Any]:
    """The rows of one table, filtered and sorted as the UI says (ties keep name order)."""
    needle = ui.filter.lower()
    rows = [row for row in spec.rows(view) if needle in spec.match(row).lower()]
    column = ui.column(spec.name)
    known = [row for row in rows if column.key(row) is not None]
    unknown = [row for row in rows if column.key(row) is None]  # "-" always last
    return sorted(known, key=column.key, reverse=ui.descending(spec.name)) + unknown


def arranged(view: View, ui: UiState, sort: bool) -> View:
    """The view with the filter applied to every table, and the UI's order when ``sort``."""
    def rows(spec: TableSpec) -> list[Any]:
        if sort:
            return arrange(spec, view, ui)
        return [row for row in spec.rows(view) if ui.filter.lower() in spec.match(row).lower()]

    disks, gpus, engines = (rows(spec) for spec in TABLES)
    return dataclasses.replace(view, disks=disks, gpus=gpus, engines=engines)


def present(view: View, spec: TableSpec) -> bool:
    return bool(spec.rows(view))


# --- drawing -----------------------------------------------------------------------------------------

ROW_STYLE = {3: "bold red", 2: "yellow", 1: "yellow"}


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:.1f}%"


def header_lines(view: View | None, ui: UiState, source: str, interval: float, error: str | None) -> list[Text]:
    first = Text("gpuio top", style="bold")
    if ui.paused:
        first.append("  PAUSED", style="bold reverse")
    if view is not None:
        first.append(f"  {time.strftime('%H:%M:%S', time.localtime(view.taken_at))}"
                     f" over {view.interval_seconds:.1f}s")
    first.append(f"  {printable(source)}")  # last: a long path is what gets cut at 80 columns
    second = Text()
    if view is None:
        second.append(f"collecting: rates need two samples {interval:g}s apart")
    else:
        p = view.pressure
        if p.io_some is None and p.cpu_some is None:
            second.append("PSI: none (kernel without /proc/pressure)")
        else:
            second.append(f"PSI io some {_pct(p.io_some)} full {_pct(p.io_full)}",
                          style="bold red" if p.io_high else "")
            second.append(f"  mem {_pct(p.memory_some)}/{_pct(p.memory_full)}  cpu {_pct(p.cpu_some)}")
        if view.failing_collectors:
            second.append(f"  failing: {printable(','.join(view.failing_collectors))}", style="bold red")
    if error:
        second.append(f"  {printable(error)}", style="bold red")
    return [first, second]


def status_line(ui: UiState) -> Text:
    if ui.editing is not None:
        return Text(f"filter: {printable(ui.editing)}_   (Enter keeps, Esc cancels)", style="reverse", no_wrap=True)
    order = "desc" if ui.descending(ui.focus) else "asc"
    line = Text(f"sort {ui.focus}:{ui.sort[ui.focus]} {order}", style="bold")
    if ui.filter:
        line.append(f"  filter '{printable(ui.filter)}'", style="bold")
    line.append("  s sort r rev tab table / filter p pause q quit")
    line.no_wrap, line.overflow = True, "ellipsis"
    return line


def allot(wanted: list[int], space: int) -> list[int]:
    """Rows each table may show: equal shares of ``space``, none more than it wants."""
    given = [0] * len(wanted)
    while space > 0 and any(g < w for g, w in zip(given, wanted, strict=True)):
        for index, want in enumerate(wanted):
            if space > 0 and given[index] < want:
                given[index] += 1
                space -= 1
    return given


def build_table(spec: TableSpec, rows: list[Any], ui: UiState, width: int, limit: int | None, live: bool,
                ascii_only: bool) -> Table:
    """One table; ``live``: the interactive screen, which marks the sort column and the focused table."""
    columns = spec.columns
    focused = live and spec.name == ui.focus
    others = sum(column.width + 1 for column in columns[1:])
    first_width = max(4, min(max([len(printable(columns[0].text(row))) for row in rows] + [columns[0].width]),
                             width - others))
    table = Table(box=None, show_edge=False, pad_edge=False, padding=(0, 0, 0, 1), expand=False,
                  header_style="bold reverse" if focused else "bold")
    for index, column in enumerate(columns):
        header = column.header
        if column.header == ui.sort[spec.name] and live:
            descending = ui.descending(spec.name)
            header += ("v" if descending else "^") if ascii_only else ("▼" if descending else "▲")
        table.add_column(header, width=first_width if index == 0 else max(column.width, len(header)),
                         justify="left" if column.left or not column.numeric else "right",
                         no_wrap=True, overflow="ellipsis")
    shown = rows if limit is None or len(rows) <= limit else rows[: max(0, limit - 1)]
    for row in shown:
        # Cells as Text, escaped: engine and device names come from spool writers and sysfs, and a plain
        # string would be read as rich markup and could carry terminal escapes.
        cells = (safe_text(column.text(row)) for column in columns)
        table.add_row(*cells, style=ROW_STYLE.get(severity(row.flags), ""))
    if len(shown) < len(rows):
        more = f"+{len(rows) - len(shown)}"
        table.add_row(more + " more" if len(more) + 5 <= first_width else more, style="dim")
    return table


def screen(view: View | None, ui: UiState, source: str, interval: float, width: int, height: int | None,
           error: str | None = None, ascii_only: bool = False) -> RenderableType:
    """The whole screen (``height`` None: no row limit, for --once)."""
    parts: list[RenderableType] = list(header_lines(view, ui, source, interval, error))
    if view is not None:
        specs = [spec for spec in TABLES if present(view, spec)]
        rows = [arrange(spec, view, ui) for spec in specs]
        notes = [Text(f"{spec.name}s: {spec.empty}", style="dim") for spec in TABLES if not present(view, spec)]
        limits: list[int | None] = [None] * len(specs)
        if height is not None:
            space = height - len(parts) - 1 - len(notes) - len(specs)  # headers, status line, notes, table heads
            given = allot([max(1, len(r)) for r in rows], max(space, len(specs)))
            limits = list(given)
        for spec, table_rows, limit in zip(specs, rows, limits, strict=True):
            if not table_rows:
                parts.append(Text(f"{spec.name}s: none match '{printable(ui.filter)}'", style="dim"))
                continue
            parts.append(build_table(spec, table_rows, ui, width, limit, live=height is not None,
                                     ascii_only=ascii_only))
        parts.extend(notes)
    for part in parts:
        if isinstance(part, Text):  # one line each, whatever the width: the row budget counts on it
            part.no_wrap, part.overflow = True, "ellipsis"
    if height is None:
        return Group(*parts)
    layout = Layout()
    layout.split_column(Layout(Group(*parts)), Layout(status_line(ui), size=1))
    return layout


# --- keys --------------------------------------------------------------------------------------------

QUIT = "quit"


def handle_key(key: str, ui: UiState, view: View | None) -> str | None:
    """Apply one key to the UI state; QUIT to leave."""
    if ui.editing is not None:
        if key in ("\r", "\n"):
            ui.editing = None
        elif key == "\x1b":
            ui.filter, ui.editing = ui.before_edit, None
        elif key in ("\x7f", "\x08"):
            ui.editing = ui.editing[:-1]
            ui.filter = ui.editing
        elif key.isprintable():
            ui.editing += key
            ui.filter = ui.editing
        return None
    if key in ("q", "Q", "\x03"):
        return QUIT
    if key in ("p", " "):
        ui.paused = not ui.paused
    elif key in ("/", "f"):
        ui.before_edit = ui.filter
        ui.editing = ui.filter
    elif key == "\x1b":
        ui.filter = ""
    elif key in ("s", "S"):
        spec = next(s for s in TABLES if s.name == ui.focus)
        headers = [column.header for column in spec.columns]
        step = 1 if key == "s" else -1
        ui.sort[ui.focus] = headers[(headers.index(ui.sort[ui.focus]) + step) % len(headers)]
        ui.reverse[ui.focus] = False
    elif key == "r":
        ui.reverse[ui.focus] = not ui.reverse[ui.focus]
    elif key in ("\t", "t"):
        shown = [spec.name for spec in TABLES if view is None or present(view, spec)] or list(TABLE_NAMES)
        index = shown.index(ui.focus) if ui.focus in shown else -1
        ui.focus = shown[(index + 1) % len(shown)]
    return None


def split_keys(data: str) -> list[str]:
    """Keys from what the terminal sent: an escape sequence (arrows, F-keys) is dropped whole."""
    keys: list[str] = []
    index = 0
    while index < len(data):
        char = data[index]
        if char == "\x1b" and index + 1 < len(data) and data[index + 1] in "[O":
            index += 2
            while index < len(data) and not ("@" <= data[index] <= "~"):
                index += 1
            index += 1
            continue
        keys.append(char)
        index += 1
    return keys


@contextmanager
def cbreak(fd: int) -> Iterator[None]:
    saved = termios.tcgetattr(fd)
    try:
        tty.setcbreak(fd)
        yield
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


class ScreenLog(logging.Handler):
    """Keeps the last warning for the header (a collector's complaint): log lines on stderr would tear the screen."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.last: str = ""

    def emit(self, record: logging.LogRecord) -> None:
        self.last = f"{record.levelname.lower()}: {record.getMessage()}"


def interactive(source: Source, interval: float, ui: UiState, console: Console,
                stdin: IO[str] | None = None) -> None:
    stdin = stdin or sys.stdin
    fd = stdin.fileno()
    ascii_only = not (console.encoding or "").lower().startswith("utf")
    handler = ScreenLog()
    root = logging.getLogger()
    saved_handlers, root.handlers = root.handlers, [handler]
    view: View | None = None
    error: str | None = None
    previous: Snapshot | None = None

    def draw() -> RenderableType:
        # The terminal's size now (it may have been resized), not $COLUMNS/$LINES, which rich would
        # prefer and which a shell may have exported long ago.
        with contextlib.suppress(OSError):
            console.size = os.get_terminal_size(console.file.fileno())
        return screen(view, ui, source.description, interval, console.size.width, console.size.height,
                      error or (handler.last or None), ascii_only)

    try:
        with cbreak(fd), Live(console=console, screen=True, auto_refresh=False, redirect_stdout=False,
                              redirect_stderr=False) as live:
            due = time.monotonic()
            while True:
                if time.monotonic() >= due:
                    due = time.monotonic() + interval
                    if not ui.paused:
                        try:
                            current = source.sample()
                            if previous is not None:
                                view = compute(previous, current, source.description)
                            previous, error = current, None
                        except SourceError as exc:
                            error = str(exc)
                    live.update(draw(), refresh=True)
                ready, _, _ = select.select([fd], [], [], max(0.0, due - time.monotonic()))
                if ready:
                    data = os.read(fd, 1024).decode("utf-8", errors="ignore")
                    if not data:
                        return  # the terminal went away
                    for key in split_keys(data):
                        if handle_key(key, ui, view) == QUIT:
                            return
                    live.update(draw(), refresh=True)
    finally:
        root.handlers = saved_handlers


# --- entry point -------------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gpuio top", allow_abbrev=False,
        description="A live view of this node's disks (iostat -x), IO pressure, GPUs and engines; rows that "
                    "meet the alert thresholds are highlighted.",
        epilog="Other flags are the exporter's (--path.procfs, --path.sysfs, --collector.*): without --url, "
               "gpuio top reads this machine through the same collectors. Keys: s/S sort column, r reverse, "
               "Tab next table, / filter (Enter keeps, Esc cancels; Esc clears), p or space pause, q quit.")
    parser.add_argument("--once", action="store_true", help="Print one view (two samples --interval apart).")
    parser.add_argument("--json", action="store_true", help="Print one view as JSON (implies --once).")
    parser.add_argument("--interval", default="1s", metavar="DURATION",
                        help="Time between samples, e.g. 500ms, 1s, 2s (default 1s).")
    parser.add_argument("--url", metavar="URL",
                        help="Read a running exporter (e.g. http://node:9817/metrics) instead of this machine.")
    parser.add_argument("--sort", metavar="COLUMN", help="Sort by this column header (e.g. r_await, %%util, busy%%).")
    parser.add_argument("--filter", default="", metavar="TEXT", help="Show only rows whose device/GPU/engine "
                        "contains TEXT.")
    return parser


def main(argv: Sequence[str] | None = None, *, clock: Callable[[], float] = time.monotonic,
         sleep: Callable[[float], None] = time.sleep, out: IO[str] | None = None) -> int:
    """``gpuio top``; ``clock`` and ``sleep`` are for tests that rewrite a procfs between two samples."""
    from . import collectors  # noqa: F401  (importing registers the collectors, and so their flags)
    from .config import parse_args
    from .logsetup import setup
    from .options import ConfigError, parse_seconds

    out = out or sys.stdout
    parser = _parser()
    args, rest = parser.parse_known_args(list(sys.argv[1:] if argv is None else argv))
    try:
        interval = parse_seconds(args.interval)
    except ValueError as exc:
        parser.error(f"invalid value {args.interval!r} for --interval: {exc}; accepted: a duration above zero "
                     "such as 500ms, 1s, 2s")
    ui = UiState(filter=args.filter)
    if args.sort and not ui.sort_by(args.sort):
        headers = sorted({c.header for spec in TABLES for c in spec.columns})
        parser.error(f"invalid value {args.sort!r} for --sort; accepted: {', '.join(headers)}")
    source: Source
    if args.url:
        if rest:
            parser.error(f"exporter flags ({' '.join(rest)}) apply to this machine, not with --url")
        source = UrlSource(args.url, clock)
    else:
        try:
            config = parse_args(rest, prog="gpuio top", server=False)
            source = LocalSource(config, clock)
        except ConfigError as exc:
            print(f"gpuio top: error: {printable(exc)}", file=sys.stderr)
            return 2
        setup(config.log_level, config.log_format)
    once = args.once or args.json
    if not once and not (sys.stdin.isatty() and out.isatty()):
        print("gpuio top: error: the live view needs a terminal; use --once or --json for scripts",
              file=sys.stderr)
        return 2
    source.start()
    try:
        if not once:
            with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C quits as q does
                interactive(source, interval, ui, Console(file=out))
            return 0
        try:
            first = source.sample()
            sleep(interval)
            second = source.sample()
            if set(second.series) - set(first.series):
                # A background source (the NVML sampler, a residency scan) delivered its first data after
                # the first sample: one interval more, so that its rates have two samples too.
                sleep(interval)
                first, second = second, source.sample()
            view = compute(first, second, source.description)
        except SourceError as exc:
            print(f"gpuio top: error: {printable(exc)}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            return 130
        try:
            if args.json:
                json.dump(view_json(arranged(view, ui, sort=bool(args.sort))), out, indent=2)
                out.write("\n")
            else:
                console = Console(file=out)  # a terminal's width; else $COLUMNS, else 80
                console.print(screen(view, ui, source.description, interval, console.size.width, None,
                                     ascii_only=True))
            out.flush()
        except BrokenPipeError:  # `gpuio top --json | head`: what Python's docs advise, so exit stays quiet
            os.dup2(os.open(os.devnull, os.O_WRONLY), out.fileno())
        return 0
    finally:
        source.close()


if __name__ == "__main__":
    raise SystemExit(main())
