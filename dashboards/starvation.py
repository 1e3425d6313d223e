"""gpuio / Starvation (on-call): is this node's GPU idle because a disk cannot keep up?

One node, one time axis: GPU busy and SM activity next to the await, queue depth and IO pressure of the
node's disks, the bytes coming in from disks, PCIe and NVLink, the disks gpuio judges saturated, engine
latency and in-flight work, and what is firing.  Read it top to bottom at 3 a.m.: GPU idle (few SMs
working)? work waiting? a disk slow and queued with tasks stalled on IO?
"""

from __future__ import annotations

from grafana_foundation_sdk.builders import dashboard as db

from deploy.prometheus import config as c
from deploy.prometheus import rules as r

from .common import (
    ENGINE,
    GPU,
    assemble,
    engine_loads_annotation,
    engine_variable,
    gpu_variable,
    graph,
    guarded_ratio,
    histogram_quantile,
    query,
    rate,
    sel,
    value_table,
)


def gpu_panels() -> list:
    return [
        graph("GPU busy vs. SM and tensor activity",
              f"Busy: share of time a kernel ran (NVML, integrated from its samples). SM active: share of SMs with "
              f"a warp resident; tensor: share of time the tensor pipes worked; DRAM: share of peak memory "
              f"bandwidth (GPM, Hopper and newer). Busy reads 100 % while an engine's weights cross PCIe with no "
              f"SM running: the starvation alerts count a GPU as idle under {c.GPU_BUSY_LOW:.0%} busy or under "
              f"{c.GPU_SM_ACTIVE_LOW:.0%} SM active, with work waiting.", "percentunit",
              query(rate("gpuio_gpu_busy_seconds_total", sel(GPU)), "GPU {{gpu}} busy"),
              query(rate("gpuio_gpu_sm_active_seconds_total", sel(GPU)), "GPU {{gpu}} SM active"),
              query(rate("gpuio_gpu_pipe_active_seconds_total", sel(GPU, 'pipe="tensor"')), "GPU {{gpu}} tensor"),
              query(rate("gpuio_gpu_dram_active_seconds_total", sel(GPU)), "GPU {{gpu}} DRAM"), max_value=1),
        graph("GPU up", "1 while the GPU answers NVML; 0: lost, reset required or gone from the bus.", "short",
              query(f"gpuio_gpu_up{sel(GPU)}", "GPU {{gpu}}"), max_value=1),
        graph("Bytes in: disks vs. PCIe and NVLink", "Read throughput of the node's disks beside the bytes the "
              "GPUs receive over PCIe (host to GPU: engine weights, inputs) and NVLink (GPM, Hopper and newer). "
              "A load that crawls off a disk shows as disk reads and PCIe receive both low while the GPU waits.",
              "binBps",
              query(rate("gpuio_disk_read_bytes_total", sel()), "disk {{device}} read"),
              query(rate("gpuio_gpu_pcie_receive_bytes_total", sel(GPU)), "GPU {{gpu}} PCIe receive"),
              query(rate("gpuio_gpu_nvlink_receive_bytes_total", sel(GPU)), "GPU {{gpu}} NVLink receive")),
    ]


def disk_panels() -> list:
    node_disks = sel()
    return [
        graph("Disk await (r_await, w_await)", "Mean time per request of the node's disks. No line: the device "
              "completed nothing.", "s",
              query(guarded_ratio("gpuio_disk_read_time_seconds_total", "gpuio_disk_reads_completed_total",
                                  node_disks), "{{device}} r_await"),
              query(guarded_ratio("gpuio_disk_write_time_seconds_total", "gpuio_disk_writes_completed_total",
                                  node_disks), "{{device}} w_await")),
        graph("Disk queue size (aqu-sz)", "Requests in flight or queued per device.", "short",
              query(rate("gpuio_disk_io_time_weighted_seconds_total", node_disks), "{{device}}")),
        graph("IO pressure (PSI)", "Share of time tasks waited on IO (some) or all stalled on it (full).",
              "percentunit",
              query(rate("gpuio_pressure_io_waiting_seconds_total", node_disks), "io some"),
              query(rate("gpuio_pressure_io_stalled_seconds_total", node_disks), "io full"), max_value=1),
        graph("Saturated disks", "Disks slow for their class with a deep queue or IO pressure (what `gpuio top` "
              "flags 'saturated'); the line is the await. Empty is good.", "s",
              query(f"{r.SATURATED}{node_disks}", "{{device}}")),
    ]


def engine_panels() -> list:
    engines = sel(ENGINE)

    def quantile(q: float) -> str:
        return histogram_quantile(q, "gpuio_engine_inference_seconds", engines)

    return [
        graph("Inference latency (p50, p95, p99)", "End-to-end inference latency per engine, from the "
              "engines' histograms.", "s",
              query(quantile(0.5), "{{engine}} p50"), query(quantile(0.95), "{{engine}} p95"),
              query(quantile(0.99), "{{engine}} p99")),
        graph("Inferences in flight", "Inferences running now, per engine and GPU. A request in flight is not "
              "work waiting; as many in flight as the pool has contexts is.", "short",
              query(f"gpuio_engine_inferences_in_flight{engines}", "{{engine}} {{gpu_uuid}}"),
              query(f"gpuio_engine_pool_contexts{engines}", "{{engine}} {{gpu_uuid}} contexts")),
        graph("Work waiting", "Why work queues for an engine on a GPU (pool wait, in flight >= contexts, p99 "
              "latency over its calm normal, a load in progress): what GPUStarvedByDiskIO needs besides an idle "
              "GPU and slow storage. Empty is good.", "short",
              query(f"{r.WORK_WAITING}{engines}", "{{engine}} {{gpu_uuid}}: {{reason}}")),
        graph("Engine loads in progress", "Loads started and not finished, per disk and per mount point: a "
              "cold-start storm while it happens. DiskIOStorm / MountIOStorm page when loads wait on "
              "storage that is saturated.", "short",
              query(f"gpuio_disk_engine_loads_in_progress{sel()}", "disk {{device}}"),
              query(f"gpuio_mount_engine_loads_in_progress{sel()}", "mount {{mountpoint}}")),
        graph("Network storage: NFS READ round trip", f"Mean round trip of an NFS READ per mount (mountstats); "
              f"{c.NFS_READ_RTT_SLOW_SECONDS * 1000:g} ms or more under IO pressure is a slow mount.", "s",
              query(f"{r.NFS_READ_RTT}{sel()}", "{{mountpoint}}")),
        graph("Engine cold starts", f"Mean load time (read + deserialize) and its read part, of the loads "
              f"that finished in the last {c.ENGINE_LOAD_WINDOW} (recording rules); EngineColdStartSlow fires "
              f"above {c.ENGINE_LOAD_SLOW_SECONDS:g} s.", "s",
              query(f"{r.ENGINE_LOAD}{engines}", "{{engine}} load"),
              query(f"{r.ENGINE_LOAD_READ}{engines}", "{{engine}} read")),
        graph("Pool wait (mean)", "Mean time a request waited for a free execution context in the engine "
              "pool. No line: no request acquired a context.", "s",
              query(guarded_ratio("gpuio_engine_pool_wait_seconds_sum", "gpuio_engine_pool_wait_seconds_count",
                                  engines), "{{engine}}")),
        value_table("Engines on this node", "Each engine file a live process loaded: its block device and its GPU "
                    "(gpuio_engine_info), the join the starvation alerts use.",
                    f"gpuio_engine_info{engines}", ["job"], height=6),
    ]


def build() -> db.Dashboard:
    firing = value_table("Firing alerts", "Alerts firing for this node now (Prometheus' ALERTS series).",
                         f'ALERTS{{alertstate="firing",{c.NODE_LABEL}=~"$instance"}}', ["alertstate"], height=6)
    busy, up, bytes_in = gpu_panels()
    await_, queue, pressure, saturated = disk_panels()
    # GPU on the left, its disks on the right, one shared crosshair: is the GPU idle while a disk is slow?
    sections = (("Firing", [firing]),
                ("GPU vs. disks", [busy, await_, bytes_in, queue, up, pressure, saturated]),
                ("Engines", engine_panels()))
    return assemble(c.STARVATION_UID, "Is a GPU idle because a disk cannot keep up? GPU, disks, IO pressure and "
                    "engines of one node on one time axis.", sections,
                    variables=[gpu_variable(),
                               engine_variable()],
                    annotations=[engine_loads_annotation(sel(ENGINE))])
