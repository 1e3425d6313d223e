"""gpuio / GPU: NVML state of every GPU of one node (the nvml collector).

Busy time first (the counter integrated from NVML's samples, exact at any scrape interval, beside the
aliasing utilisation gauge), then what holds a GPU back: memory, heat and power, clocks and the
reasons they are held down, the PCIe link and its traffic, errors (Xid, ECC, remapped rows), and
which processes hold memory on it.  Every series carries ``gpu`` (index) and ``uuid``.
"""

from __future__ import annotations

from grafana_foundation_sdk.builders import dashboard as db

from ...prometheus.config import GPU_UID, Config
from .common import (
    GPU,
    GPU_PODS,
    UP,
    assemble,
    gpu_variable,
    graph,
    limit,
    namespace_variable,
    pod_variable,
    query,
    rate,
    sel,
    series_limits,
    threshold_lines,
    timeline,
    value_table,
)

PER_GPU = "GPU {{gpu}}"


def activity_panels(config: Config) -> list:
    g = sel(config, GPU)
    return [
        threshold_lines(graph(
            "GPU busy (counter) vs. utilisation gauge",
            "Busy: rate of gpuio_gpu_busy_seconds_total, the share of time a kernel ran, integrated from every "
            "NVML sample (exact at any scrape interval). Gauge: NVML's utilisation of its last sample period "
            "only; it aliases when scrapes are further apart than that period, so trust the busy line. Neither "
            "is SM activity: a GPU copying an engine's weights in reads 100 % busy with no SM running. "
            f"Under {config.GPU_BUSY_LOW:.0%} (the shaded band) while work waits on a saturated disk is what "
            "GPUStarvedByDiskIO fires on; under it with nothing waiting is an idle GPU, not a starved one.",
            "percentunit",
            query(rate("gpuio_gpu_busy_seconds_total", g), f"{PER_GPU} busy"),
            query(f"gpuio_gpu_utilization_ratio{g}", f"{PER_GPU} gauge"), max_value=1),
            limit(config.GPU_BUSY_LOW, below=True)),
        series_limits(graph(
              "SM activity, occupancy and tensor pipes (GPM)",
              "What the SMs do, Hopper and newer (GPM): SM active = share of SMs with a warp resident; occupancy "
              "= resident warps over the SMs' capacity; tensor = share of time the tensor pipes worked. NVML busy "
              "reads 100 % while one thread spins or weights cross PCIe with no SM running; these do not. "
              f"GPUStarvedByDiskIO counts a GPU under {config.GPU_SM_ACTIVE_LOW:.0%} SM active (the dashed line) "
              "as idle, "
              "with work waiting on saturated storage.", "percentunit",
              query(rate("gpuio_gpu_sm_active_seconds_total", g), f"{PER_GPU} SM active"),
              query(rate("gpuio_gpu_sm_occupancy_seconds_total", g), f"{PER_GPU} occupancy"),
              query(rate("gpuio_gpu_pipe_active_seconds_total", sel(config, GPU, 'pipe="tensor"')),
                    f"{PER_GPU} tensor"),
              max_value=1),
              {"/ SM active$/": limit(config.GPU_SM_ACTIVE_LOW, below=True)}),
        graph("Pipes (GPM)", "Share of time each pipe of the SMs worked, averaged over the SMs: tensor by kind "
              "(hmma: fp16/bf16, imma: integer, dfma: fp64) and non-tensor fp64/fp32/fp16. Pipes overlap.",
              "percentunit",
              query(rate("gpuio_gpu_pipe_active_seconds_total", sel(config, GPU, 'pipe!="tensor"')),
                    f"{PER_GPU} {{{{pipe}}}}"),
              max_value=1),
        graph("Memory bandwidth: DRAM (GPM) vs. NVML memory utilisation",
              "DRAM: share of the peak device-memory bandwidth used (GPM, a counter: exact at any interval). "
              "NVML: share of its last sample period in which memory was read or written at all (a gauge).",
              "percentunit",
              query(rate("gpuio_gpu_dram_active_seconds_total", g), f"{PER_GPU} DRAM bandwidth"),
              query(f"gpuio_gpu_memory_utilization_ratio{g}", f"{PER_GPU} NVML memory"), max_value=1),
        graph("Video, JPEG and optical-flow engines (GPM)", "Share of time each NVDEC, NVJPG and NVOFA unit "
              "worked.", "percentunit",
              query(rate("gpuio_gpu_media_active_seconds_total", g), f"{PER_GPU} {{{{media}}}}{{{{media_index}}}}"),
              max_value=1),
        graph("Device memory", "Memory allocated and installed per GPU (used includes the driver's reserve on "
              "drivers without nvmlDeviceGetMemoryInfo_v2).", "bytes",
              query(f"gpuio_gpu_memory_used_bytes{g}", f"{PER_GPU} used"),
              query(f"gpuio_gpu_memory_total_bytes{g}", f"{PER_GPU} total")),
        timeline("GPUs up", "up while a GPU answers NVML; down: lost, reset required or gone from the bus "
                 f"(GPULost fires after {config.GPU_LOST_FOR}). A GPU gone before the exporter started has no lane "
                 "at all: compare the count enumerated below with the node's GPUs (GPUMissing).",
                 query(f"gpuio_gpu_up{g}", PER_GPU), mappings=UP, width=6),
        graph("GPUs enumerated", "How many GPUs NVML enumerates now. Fewer than the node had in the last "
              f"{config.GPU_MISSING_WINDOW} fires GPUMissing.", "short",
              query(f"gpuio_gpu_devices{sel(config)}", "GPUs enumerated"), width=6),
    ]


def thermal_panels(config: Config) -> list:
    g = sel(config, GPU)
    return [
        graph("Temperature", "GPU die and memory (HBM) temperature.", "celsius",
              query(f"gpuio_gpu_temperature_celsius{g}", f"{PER_GPU} die"),
              query(f"gpuio_gpu_memory_temperature_celsius{g}", f"{PER_GPU} memory")),
        graph("Power", "Power draw against the limit the driver enforces, and the mean draw from the energy "
              "counter (rate of joules: exact between scrapes).", "watt",
              query(f"gpuio_gpu_power_watts{g}", f"{PER_GPU} draw"),
              query(rate("gpuio_gpu_energy_joules_total", g), f"{PER_GPU} mean (energy)"),
              query(f"gpuio_gpu_power_limit_watts{g}", f"{PER_GPU} limit")),
        graph("Clocks", "SM and memory clocks against their maxima: a clock well under its maximum on a busy GPU "
              "is held down (see the reasons).", "hertz",
              query(f"gpuio_gpu_sm_clock_hertz{g}", f"{PER_GPU} SM"),
              query(f"gpuio_gpu_sm_clock_max_hertz{g}", f"{PER_GPU} SM max"),
              query(f"gpuio_gpu_memory_clock_hertz{g}", f"{PER_GPU} memory"),
              query(f"gpuio_gpu_memory_clock_max_hertz{g}", f"{PER_GPU} memory max")),
        threshold_lines(graph(
            "Clocks held down (share of time, by reason)",
            f"Rate of the clock-event violation counters. GPUThrottled fires when "
            f"{', '.join(config.GPU_THROTTLE_REASONS)} hold clocks down for over "
            f"{config.GPU_THROTTLE_RATIO:.0%} (the red "
            f"line) of {config.GPU_THROTTLE_WINDOW}; sw_power_cap on a fully loaded GPU is by design.", "percentunit",
            query(rate("gpuio_gpu_clocks_event_seconds_total", g), f"{PER_GPU} {{{{reason}}}}")),
            limit(config.GPU_THROTTLE_RATIO)),
        graph("Clock event reasons active now", "Each reason that holds clocks down at the last sample (1), "
              "as nvidia-smi's clocks_event_reasons.*.", "short",
              query(f"gpuio_gpu_clocks_event_reason_active{g} == 1", f"{PER_GPU} {{{{reason}}}}")),
    ]


def pcie_panels(config: Config) -> list:
    g = sel(config, GPU)
    return [
        graph("PCIe traffic", "Bytes per second over the GPU's PCIe link, TLP overhead included (Hopper and "
              "newer): host to GPU is receive. Engine loads and input batches cross here.", "binBps",
              query(rate("gpuio_gpu_pcie_receive_bytes_total", g), f"{PER_GPU} receive"),
              query(rate("gpuio_gpu_pcie_transmit_bytes_total", g), f"{PER_GPU} transmit")),
        graph("PCIe link (generation and width vs. maximum)",
              f"A width under its maximum is a degraded link (GPUPCIeLinkDegraded); the generation drops at idle "
              f"to save power, so it is judged only while the GPU is over {config.PCIE_GENERATION_BUSY:.0%} busy.",
              "short",
              query(f"gpuio_gpu_pcie_link_generation{g}", f"{PER_GPU} gen"),
              query(f"gpuio_gpu_pcie_link_generation_max{g}", f"{PER_GPU} gen max"),
              query(f"gpuio_gpu_pcie_link_width{g}", f"{PER_GPU} width"),
              query(f"gpuio_gpu_pcie_link_width_max{g}", f"{PER_GPU} width max")),
        graph("PCIe replays", "Link-level retransmissions per second: a steady rate points at a bad riser, "
              "slot or cable.", "short",
              query(rate("gpuio_gpu_pcie_replays_total", g), PER_GPU)),
    ]


def error_panels(config: Config) -> list:
    g = sel(config, GPU)
    return [
        graph("Xid events", "Xid events per second by code (driver error reports). 13, 31, 43, 45 are usually the "
              "application's fault; others (48, 63, 64, 74, 79, 92-95...) the hardware's or driver's.", "short",
              query(rate("gpuio_gpu_xid_errors_total", g), f"{PER_GPU} Xid {{{{xid}}}}")),
        graph("ECC errors", "ECC errors per second since the driver loaded, corrected and uncorrected "
              "(GPUECCUncorrectable).", "short",
              query(rate("gpuio_gpu_ecc_errors_total", g), f"{PER_GPU} {{{{error}}}}")),
        graph("Remapped rows", "Memory rows remapped, by cause; pending: a remap waits for a GPU reset; "
              "failure: a remap failed (replace the GPU).", "short",
              query(f"gpuio_gpu_remapped_rows{g}", f"{PER_GPU} {{{{cause}}}}"),
              query(f"gpuio_gpu_remapped_rows_pending{g}", f"{PER_GPU} pending"),
              query(f"gpuio_gpu_remapped_rows_failure{g}", f"{PER_GPU} failure")),
        graph("NVML call errors", "NVML calls that failed (other than unsupported), per second by call and "
              "error.", "short",
              query(rate("gpuio_gpu_nvml_errors_total", g), f"{PER_GPU} {{{{call}}}} {{{{error}}}}"), width=6),
        threshold_lines(graph(
            "GPU snapshot age", "Age of the NVML snapshot scrapes serve (the sampler reads every second). Over "
            f"{config.GPU_STALE_AFTER_SECONDS} s (the red line) the GPU data is stale: a frozen busy counter would "
            "read as an idle GPU, so no starvation alert judges the node's GPUs and GpuioGPUDataStale fires.",
            "s", query(f"gpuio_gpu_snapshot_age_seconds{sel(config)}", "snapshot age"), width=6),
            limit(config.GPU_STALE_AFTER_SECONDS)),
    ]


def process_panels(config: Config) -> list:
    g = sel(config, GPU)
    return [
        value_table("Compute processes", "Processes holding device memory on each GPU (largest first, up to "
                    "--collector.nvml.max-processes): how an engine's process is tied to its GPU.",
                    f"gpuio_gpu_process_memory_used_bytes{g}", ["job"]),
        value_table("GPUs", "Identity of each GPU (gpuio_gpu_info).", f"gpuio_gpu_info{g}", ["job"], height=6),
        graph("Per-process GPU busy (by engine where one reports)",
              "Share of time each listed process's kernels ran (NVML per-process utilisation of its last sample "
              "period, read every interval: an estimate), named by the engine it reports through the spool "
              "(gpuio_engine_process_info, joined on pid) or else by its process name.", "percentunit",
              query(f"{rate('gpuio_gpu_process_sm_busy_seconds_total', g)}\n"
                    f"* on ({config.NODE_LABEL}, pid) group_left (engine) max by ({config.NODE_LABEL}, pid, engine) "
                    f"(gpuio_engine_process_info{sel(config)})", f"{PER_GPU} {{{{engine}}}} (pid {{{{pid}}}})"),
              query(f"{rate('gpuio_gpu_process_sm_busy_seconds_total', g)}\n"
                    f"unless on ({config.NODE_LABEL}, pid) gpuio_engine_process_info{sel(config)}",
                    f"{PER_GPU} {{{{process_name}}}} (pid {{{{pid}}}})")),
        graph("MIG devices: memory", "Memory used and installed per MIG device, where MIG is on.", "bytes",
              query(f"gpuio_gpu_mig_device_memory_used_bytes{g}", f"{PER_GPU} {{{{mig_uuid}}}} used"),
              query(f"gpuio_gpu_mig_device_memory_total_bytes{g}", f"{PER_GPU} {{{{mig_uuid}}}} total")),
        graph("MIG GPU instances: SM and tensor activity (GPM)", "SM activity and tensor-pipe activity of each "
              "MIG GPU instance (gpu_instance; gpuio_gpu_mig_device_info names its MIG devices).", "percentunit",
              query(rate("gpuio_gpu_mig_sm_active_seconds_total", g), f"{PER_GPU} GI {{{{gpu_instance}}}} SM"),
              query(rate("gpuio_gpu_mig_pipe_active_seconds_total", g),
                    f"{PER_GPU} GI {{{{gpu_instance}}}} {{{{pipe}}}}"), max_value=1, width=24),
    ]


def build(config: Config) -> db.Dashboard:
    return assemble(config, GPU_UID, "NVML state of every GPU of a node: busy time, memory, heat and power, clocks "
                    "and throttling, PCIe, errors, processes.",
                    (("Activity", activity_panels(config)), ("Heat, power and clocks", thermal_panels(config)),
                     ("PCIe", pcie_panels(config)), ("Errors", error_panels(config)),
                     ("Processes", process_panels(config))),
                    variables=[namespace_variable(config, GPU_PODS), pod_variable(config, GPU_PODS),
                               gpu_variable(config, by_pod=True)])
