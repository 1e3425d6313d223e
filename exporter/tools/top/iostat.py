"""`gpuio top`'s arithmetic: two snapshots give one View (iostat -x figures per device, PSI rates, GPU
busy and SM activity, engine quantiles) and its judgements, from exporter.thresholds: no I/O here."""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field
from typing import Any

from ... import thresholds as th
from ...sorting import natural_key
from .data import (
    # --- figures -----------------------------------------------------------------------------------------
    COLLECTOR_SUCCESS,
    DISK_INFO,
    DISK_IO_TIME,
    DISK_IO_TIME_WEIGHTED,
    DISK_PHYSICAL,
    DISK_READ_BYTES,
    DISK_READ_TIME,
    DISK_READS,
    DISK_WRITE_TIME,
    DISK_WRITES,
    DISK_WRITTEN_BYTES,
    ENGINE_IN_FLIGHT,
    ENGINE_INFO,
    ENGINE_INFO_DEVICE_LABEL,
    ENGINE_INFO_GPU_LABEL,
    ENGINE_LABEL,
    ENGINE_LATENCY,
    ENGINE_PHYSICAL,
    ENGINE_POOL_CONTEXTS,
    ENGINE_POOL_WAIT,
    ENGINE_RESIDENCY,
    GPU_AGE,
    GPU_BUSY,
    GPU_INFO,
    GPU_MEMORY_TOTAL,
    GPU_MEMORY_USED,
    GPU_POWER,
    GPU_SM_ACTIVE,
    GPU_TEMPERATURE,
    GPU_THROTTLE,
    GPU_THROTTLE_IGNORED,
    GPU_THROTTLE_REASON_LABEL,
    GPU_TIME,
    GPU_TIME_STATE_LABEL,
    GPU_UP,
    GPU_UUID_LABEL,
    PSI_CPU_SOME,
    PSI_IO_FULL,
    PSI_IO_SOME,
    PSI_MEMORY_FULL,
    PSI_MEMORY_SOME,
    SMART_HEALTH,
    Labels,
    Snapshot,
    gpu_key,
)


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
    # The GPU-time ledger over the interval: state -> its share of the time (serving, loading, starved,
    # allocated_idle, idle); empty without the ledger's series
    states: dict[str, float] = field(default_factory=dict)
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


def compute(before: Snapshot, after: Snapshot, source: str = "", now: float | None = None,
            limits: th.Thresholds = th.DEFAULT) -> View:
    """The figures of the interval between two snapshots of the same source, judged by ``limits``."""
    seconds = after.at - before.at
    if seconds <= 0:
        raise ValueError("the second snapshot must be later than the first")
    pressure = _pressure(before, after, seconds, limits)
    disks = _disks(before, after, seconds, pressure.io_high, limits)
    saturated = {row.device for row in disks if th.SATURATED in row.flags}
    gpus = _gpus(before, after, seconds, bool(saturated), limits)
    engines = _engines(before, after, gpus, saturated, limits)
    failing = sorted(k for k, v in after.values(COLLECTOR_SUCCESS, "collector").items() if v == 0)
    return View(source, seconds, time.time() if now is None else now, pressure, disks, gpus, engines, failing)


def _rate(before: Snapshot, after: Snapshot, name: str, seconds: float) -> float | None:
    return ratio(increase(before.scalar(name), after.scalar(name)), seconds)


def _pressure(before: Snapshot, after: Snapshot, seconds: float, limits: th.Thresholds) -> Pressure:
    def rate(name: str) -> float | None:
        return _rate(before, after, name, seconds)

    pressure = Pressure(io_some=rate(PSI_IO_SOME), io_full=rate(PSI_IO_FULL), memory_some=rate(PSI_MEMORY_SOME),
                        memory_full=rate(PSI_MEMORY_FULL), cpu_some=rate(PSI_CPU_SOME))
    pressure.io_high = limits.io_pressure_high(pressure.io_some, pressure.io_full)
    return pressure


def _disks(before: Snapshot, after: Snapshot, seconds: float, io_pressure: bool,
           limits: th.Thresholds) -> list[DiskRow]:
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
        row.flags = limits.disk_flags(rotational.get(device), row.reads_per_second, row.writes_per_second,
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




def _gpus(before: Snapshot, after: Snapshot, seconds: float, disk_saturated: bool,
          limits: th.Thresholds) -> list[GpuRow]:
    identity: dict[str, Labels] = {}
    for name in (GPU_INFO, GPU_UP, GPU_BUSY, GPU_MEMORY_USED, GPU_TEMPERATURE):
        for labels in after.labels(name):
            key = gpu_key(labels)
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
        reason, key = labels.get(GPU_THROTTLE_REASON_LABEL, ""), gpu_key(labels)
        if key is not None and value >= 1 and reason not in GPU_THROTTLE_IGNORED:
            throttled.setdefault(key, []).append(reason)
    states = _state_shares(before, after)
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
            states=states.get(identity[key].get(GPU_UUID_LABEL, ""), {}),
        )
        row.flags = [flag for flag, on in (
            (th.LOST, row.up is False),
            (th.STARVED, limits.gpu_starved(row.busy, disk_saturated, row.sm_active)),
            (th.THROTTLED, bool(limits.gpu_throttled(row.throttle_reasons))),
        ) if on]
        rows.append(row)
    return rows


def _state_shares(before: Snapshot, after: Snapshot) -> dict[str, dict[str, float]]:
    """uuid -> state -> the share of the interval the GPU-time ledger counted in it (the states' increases
    over their sum: the ledger's own clock, whatever the scrapes' timing)."""
    def seconds(snapshot: Snapshot) -> dict[tuple[str, str], float]:
        return {(labels.get(GPU_UUID_LABEL, ""), labels.get(GPU_TIME_STATE_LABEL, "")): value
                for labels, value in snapshot.series.get(GPU_TIME, ())}

    old, new = seconds(before), seconds(after)
    grown: dict[str, dict[str, float]] = {}
    for (uuid, state), value in new.items():
        delta = increase(old.get((uuid, state)), value)
        if delta is not None:
            grown.setdefault(uuid, {})[state] = delta
    return {uuid: {state: delta / total for state, delta in by_state.items()}
            for uuid, by_state in grown.items() if (total := sum(by_state.values())) > 0}


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


def _engines(before: Snapshot, after: Snapshot, gpus: list[GpuRow], saturated: set[str],
             limits: th.Thresholds) -> list[EngineRow]:
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
        if limits.engine_starved(gpu.busy if gpu else None, disk_saturated, row.in_flight, row.pool_wait_seconds,
                             contexts.get(engine), gpu.sm_active if gpu else None):
            row.flags.append(th.STARVED)
        rows.append(row)
    return rows


def view_json(view: View) -> dict[str, Any]:
    return dataclasses.asdict(view)


