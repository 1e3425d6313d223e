"""gpuio / Disk IO: `iostat -x` per device, the DiskIOStorm inputs, and pressure (PSI) of one node.

Every figure is computed the way iostat computes it (sysstat's rd_stats.c), from counters that mirror
node_exporter's node_disk_*: r/s = rate(reads), r_await = rate(read time) / rate(reads) and so on.
Awaits and request sizes divide by ``(rate(ops) > 0)``: a device that completed nothing has no
series instead of NaN.
"""

from __future__ import annotations

from grafana_foundation_sdk.builders import dashboard as db

from ...prometheus.config import DISK_IO_UID, ROTATIONAL, SOLID_STATE, Config
from ...prometheus.sources.names import names
from .common import (
    assemble,
    dev,
    device_variable,
    disk_ratio,
    disk_series,
    graph,
    limit,
    query,
    rate,
    sel,
    series_limits,
    value_table,
)

UTIL_NOTE = (
    "Share of time with at least one request in flight (iostat %util). On NVMe, cloud volumes and "
    "md/dm over several disks requests run in parallel: 100 % there is not saturation. Judge by await, "
    "aqu-sz and IO pressure."
)


def iostat_panels(config: Config) -> list:
    per_device = "{{device}}"
    return [
        graph("IOPS (r/s, w/s)", "Requests completed per second (iostat r/s and w/s).", "iops",
              query(disk_series(config, "reads_completed_total"), f"{per_device} r/s"),
              query(disk_series(config, "writes_completed_total"), f"{per_device} w/s")),
        graph("Throughput (rkB/s, wkB/s)", "Bytes read and written per second.", "binBps",
              query(disk_series(config, "read_bytes_total"), f"{per_device} read"),
              query(disk_series(config, "written_bytes_total"), f"{per_device} write")),
        graph("Await (r_await, w_await)",
              "Mean time a request took, queue included (iostat r_await, w_await). No line while a device "
              "completed nothing.", "s",
              query(disk_ratio(config, "read_time_seconds_total", "reads_completed_total"), f"{per_device} r_await"),
              query(disk_ratio(config, "write_time_seconds_total", "writes_completed_total"), f"{per_device} w_await")),
        graph("Queue size (aqu-sz)", "Mean number of requests in flight or queued (iostat aqu-sz).", "short",
              query(disk_series(config, "io_time_weighted_seconds_total"), per_device)),
        graph("Request size (rareq-sz, wareq-sz)", "Mean size of a completed request.", "bytes",
              query(disk_ratio(config, "read_bytes_total", "reads_completed_total"), f"{per_device} read"),
              query(disk_ratio(config, "written_bytes_total", "writes_completed_total"), f"{per_device} write")),
        graph("%util (not saturation)", UTIL_NOTE, "percentunit",
              query(disk_series(config, "io_time_seconds_total"), per_device), max_value=1),
    ]


def storm_panels(config: Config) -> list:
    recorded = names(config)
    k = f"{config.STORM_BASELINE_FACTOR:g}"
    d = dev(config)
    return [
        graph("Judged await vs. its baseline and class limit",
              f"The await DiskIOStorm judges (the slower of reads and writes, each only with at least "
              f"{config.AWAIT_MIN_IOPS:g} requests/s), {k}x its {config.BASELINE_WINDOW} median, and its class limit "
              f"(solid state {SOLID_STATE.await_seconds:g} s, rotational {ROTATIONAL.await_seconds:g} s). "
              f"Recording rules at {config.RATE_WINDOW} resolution.", "s",
              query(f"{recorded.AWAIT}{d}", "{{device}} await"),
              query(f"{k} * {recorded.AWAIT_BASELINE}{d}", f"{{{{device}}}} {k}x median"),
              query(f"{recorded.AWAIT_LIMIT}{d}", "{{device}} class limit")),
        graph("Queue size vs. its baseline and class limit",
              f"aqu-sz, {k}x its {config.BASELINE_WINDOW} median, and its class limit (solid state "
              f"{SOLID_STATE.queue_size:g}, rotational {ROTATIONAL.queue_size:g}).", "short",
              query(f"{recorded.QUEUE}{d}", "{{device}} aqu-sz"),
              query(f"{k} * {recorded.QUEUE_BASELINE}{d}", f"{{{{device}}}} {k}x median"),
              query(f"{recorded.QUEUE_LIMIT}{d}", "{{device}} class limit")),
    ]


def pressure_panels(config: Config) -> list:
    s = sel(config)
    return [
        series_limits(graph(
            "IO pressure (PSI)",
            "Share of time in which some task waited on IO (some), and in which all non-idle tasks did "
            f"(full), from /proc/pressure/io. At {config.IO_PRESSURE_SOME:.0%} some or "
            f"{config.IO_PRESSURE_FULL:.0%} full "
            "(the dashed lines) a slow disk counts as saturated (DiskIOStorm, NodeGPUStarvedByIO). It is the "
            "whole node's pressure, not one disk's. No series: the kernel has no PSI (before 4.20, or booted "
            "without psi=1).", "percentunit",
            query(rate("gpuio_pressure_io_waiting_seconds_total", s), "io some"),
            query(rate("gpuio_pressure_io_stalled_seconds_total", s), "io full"), max_value=1),
            {"io some": limit(config.IO_PRESSURE_SOME), "io full": limit(config.IO_PRESSURE_FULL)}),
        graph("Memory and CPU pressure (PSI)",
              "Memory pressure often shows up as IO (page cache thrashing, reclaim); CPU pressure "
              "slows data loaders.", "percentunit",
              query(rate("gpuio_pressure_memory_waiting_seconds_total", s), "memory some"),
              query(rate("gpuio_pressure_memory_stalled_seconds_total", s), "memory full"),
              query(rate("gpuio_pressure_cpu_waiting_seconds_total", s), "cpu some"), max_value=1),
    ]


def who_panels(config: Config) -> list:
    """Who does the IO on the disks, and who stalls on it (the cgroup_io collector: pods, containers,
    systemd services; empty where it is off or serves nothing)."""
    d, s = dev(config), sel(config)
    per_cgroup = (f"sum by (device, cgroup) (rate(gpuio_cgroup_io_read_bytes_total{d}[$__rate_interval]) + "
                  f"rate(gpuio_cgroup_io_written_bytes_total{d}[$__rate_interval]))")
    return [
        graph("Who does the IO (top cgroups per disk)",
              f"Bytes read and written per second by the cgroups (pods, containers, systemd services) doing the "
              f"most IO on each disk: an image pull, a backup, another pod's model download. DiskIOStorm names "
              f"the top {config.STORM_TOP_CGROUPS} of the stormed disk. gpuio_cgroup_info tells a cgroup's pod UID or "
              f"service.", "binBps",
              query(f"topk(5, {per_cgroup})", "{{device}} {{cgroup}}")),
        graph("Who stalls on IO (cgroup IO pressure)",
              "Share of time in which some task of a cgroup waited on IO (io.pressure some, cgroup v2 only), "
              "for the cgroups that stall most: the pods a storm hurts, whoever causes it.", "percentunit",
              query(f"topk(5, rate(gpuio_cgroup_io_pressure_waiting_seconds_total{s}[$__rate_interval]))",
                    "{{cgroup}}"), max_value=1),
    ]


def device_table(config: Config) -> list:
    return [
        value_table("Devices", "Identity of each block device (gpuio_disk_info, or node_exporter's node_disk_info "
                    "where gpuio's diskstats collector is off); rotational 0 is solid state.",
                    disk_series(config, "info", rated=False), ["job", "major", "minor"]),
        value_table("Device stacks", "The whole disks under each device (partition -> disk, dm/md -> slaves).",
                    f"gpuio_disk_physical_device_info{dev(config)}", ["job"]),
    ]


def build(config: Config) -> db.Dashboard:
    return assemble(config, DISK_IO_UID, "iostat -x per block device, the DiskIOStorm inputs and pressure (PSI).",
                    (("iostat -x", iostat_panels(config)), ("DiskIOStorm inputs", storm_panels(config)),
                     ("Pressure", pressure_panels(config)), ("Who does the IO, who stalls", who_panels(config)),
                     ("Devices", device_table(config))),
                    variables=[device_variable(config)])
