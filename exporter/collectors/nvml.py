"""NVML state of every GPU, sampled in the background, safe when a GPU or the driver misbehaves (issue 3).

The peers are dcgm-exporter and nvidia_gpu_exporter; this module answers their users' complaints:

- **Nothing NVML does is on the scrape path.**  A PeriodicSampler thread owns the NVML session and
  renders the families every ``--collector.nvml.interval`` (1 s); ``collect()`` hands them back with
  ``gpuio_gpu_snapshot_age_seconds``.  Costly calls run every ``--collector.nvml.slow-interval`` (10 s):
  total energy (~4 ms of CPU per call on an H100), the violation counters (~1 ms), ECC, remapped rows,
  processes, MIG.  nvmlDeviceGetPcieThroughput (blocks 20 ms, and is a gauge) is never called.
- **Busy time is a counter**: ``gpuio_gpu_busy_seconds_total`` integrates NVML's utilisation samples
  (nvmlDeviceGetSamples, 5-6 per second on an H100, each "percent of the last sample period a kernel
  ran"), so ``rate()`` is the true busy fraction at any scrape interval; the utilisation gauge aliases.
- **PCIe bytes are counters that do not wrap**: NVML's PCIe byte fields (197/198) are 32-bit and wrap
  every 4 GiB — every 72 ms at the 59 GB/s an H100 moves (measured).  Read once a second they are noise.
  Instead GPM (Hopper and newer) gives the average rate since a baseline sample, times the baseline's
  age (:class:`Gpm` says why not since the previous sample).  GPUs without GPM have no PCIe byte series
  rather than wrong ones.
- **Activity is GPM too** (Hopper and newer): SM activity, occupancy, tensor and FP pipes, DRAM
  bandwidth, NVLink bytes, NVDEC/NVJPG/NVOFA, per GPU and per MIG GPU instance, as counters (``rate()``
  of ``gpuio_gpu_sm_active_seconds_total`` is the share of SMs working); the ratios are added window by
  window, because GPM weighs them by SM cycles and the SM clock follows the load (:class:`Gpm`).
  NVML's busy reads 100 % while one thread block spins or weights cross PCIe with no SM running; these
  do not.  A GPU without GPM has none of these families and ``gpuio_gpu_gpm_supported 0``.
- **Per-process busy seconds** are estimated from nvmlDeviceGetProcessUtilization, which answers for
  NVML's last sample period only, so it is read every sweep and each answer held over the interval
  (:class:`ProcessBusy`), for the processes listed; the engines collector names each engine's writer
  pids, the join to them.
- **Units are base units** (bytes, hertz, celsius, watts, joules, seconds, ratios), converted here.
- **Failures stay small.**  A call NVML does not support on this GPU or driver (NotSupported,
  FunctionNotFound, ...) leaves its series out; an old driver gets the older function where there is
  one.  GPU_IS_LOST or an unknown error on one GPU sets its ``gpuio_gpu_up`` to 0 while the others
  report; NVML is re-initialised after ``--collector.nvml.reinit-interval`` so a driver reload recovers
  without a restart.  A GPU once seen stays listed (``up`` 0) when it falls off the bus, rather than
  silently vanishing.  A sweep stuck in an NVML call past ``--collector.nvml.hang-timeout`` fails the
  collector (success 0) instead of serving frozen data; until then the last snapshot is served and its
  age shows.  No library or no driver is "no GPUs here": success 1 and no GPU series.
- **Xid** events come from a listener thread blocked in nvmlEventSetWait (NVMLError_Timeout when idle).
- Label sets are bounded: processes per GPU (``--collector.nvml.max-processes``, largest memory first,
  ``gpuio_gpu_processes_dropped_total`` counts those left out), Xid codes per GPU (MAX_XID_CODES).

The hardware sits behind :class:`exporter.host.nvml_device.Nvml`; tests run this module on a fake of it.
This module declares the families, reads the GPUs and renders; the NVML session's lifecycle is in
``nvml_session``, the Xid listener in ``nvml_xid``, what is kept of each GPU in ``nvml_state``.
"""

from __future__ import annotations

import functools
import logging
import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..collect import Absent, Collector, Pending, StaleData, register
from ..context import Context
from ..exposition import COUNTER, GAUGE, INFO, Desc, Family, label_string
from ..host import nvml_device as nv
from ..host import procstat
from ..host.abandonable import Unresponsive, proc_reads
from ..host.nvml_device import Nvml, NVMLError, error_code
from ..logsetup import LogOnce
from ..options import Option, parse_count, parse_seconds
from ..pods import cgroup
from ..sampler import PeriodicSampler, Snapshot
from .nvml_ledger import DeviceReading, GpuLedger
from .nvml_session import NvmlCalls, Session, SessionKeeper, quietly
from .nvml_state import MIB_PER_SECOND, Gpm, GpmMetric, Gpu, Reading
from .nvml_state import ProcessBusy as ProcessBusy  # tests and tools import it from here

log = logging.getLogger("gpuio.collector.nvml")

GPM_REBASE = 600.0  # seconds a GPM baseline serves before the next one (see Gpm)

DESCS: list[Desc] = []
GPU = ("gpu", "uuid")  # every per-GPU series: NVML's index and the GPU's UUID


def _desc(name: str, kind: str, help_text: str, labels: Sequence[str] = (), unit: str = "", *,
          values: Mapping[str, Sequence[str]] | None = None, doc: str = "", slow: bool = False) -> Desc:
    """A family of this collector; ``slow``: read every --collector.nvml.slow-interval (marked in the reference)."""
    if slow:
        doc = (doc or help_text).removesuffix(".") + " (*slow*)."
    desc = Desc(name, kind, help_text, labels=labels, unit=unit, values=values, doc=doc)
    DESCS.append(desc)  # the order families are served in
    return desc


COUNT = _desc("gpuio_gpu_devices", GAUGE, "Number of GPUs NVML enumerates.")
AGE = _desc("gpuio_gpu_snapshot_age_seconds", GAUGE, "Age of the NVML snapshot this scrape serves.", unit="seconds")
UP = _desc("gpuio_gpu_up", GAUGE, "Whether the GPU answers NVML (0: lost, reset required, or gone from the bus).",
           labels=GPU)
INFO_DESC = _desc("gpuio_gpu_info", INFO, "Identity of a GPU.",
                  labels=(*GPU, "name", "pci_bus_id", "serial", "minor_number", "driver_version", "cuda_version"))
BUSY = _desc("gpuio_gpu_busy_seconds_total", COUNTER,
             "Seconds in which a kernel was running, integrated from NVML's utilisation samples.", labels=GPU,
             unit="seconds",
             doc="Seconds in which a kernel was running, integrated from NVML's utilisation samples. `rate()` is the "
                 "busy fraction at any scrape interval.")
UTILIZATION = _desc("gpuio_gpu_utilization_ratio", GAUGE,
                    "Fraction of NVML's last sample period in which a kernel ran (aliases; prefer busy seconds).",
                    labels=GPU, unit="ratio")
MEMORY_UTILIZATION = _desc("gpuio_gpu_memory_utilization_ratio", GAUGE,
                           "Fraction of NVML's last sample period in which device memory was read or written.",
                           labels=GPU, unit="ratio")
MEMORY_TOTAL = _desc("gpuio_gpu_memory_total_bytes", GAUGE, "Device memory installed.", labels=GPU, unit="bytes")
MEMORY_RESERVED = _desc("gpuio_gpu_memory_reserved_bytes", GAUGE,
                        "Device memory reserved by driver and firmware.", labels=GPU, unit="bytes",
                        doc="Device memory reserved by driver and firmware (absent before "
                            "nvmlDeviceGetMemoryInfo_v2).")
MEMORY_USED = _desc("gpuio_gpu_memory_used_bytes", GAUGE,
                    "Device memory allocated.", labels=GPU, unit="bytes",
                    doc="Device memory allocated (includes the reserved memory on drivers without v2).")
MEMORY_FREE = _desc("gpuio_gpu_memory_free_bytes", GAUGE, "Device memory free.", labels=GPU, unit="bytes")
TEMPERATURE = _desc("gpuio_gpu_temperature_celsius", GAUGE, "GPU die temperature.", labels=GPU, unit="celsius")
MEMORY_TEMPERATURE = _desc("gpuio_gpu_memory_temperature_celsius", GAUGE,
                           "Memory (HBM) temperature.", labels=GPU, unit="celsius")
POWER = _desc("gpuio_gpu_power_watts", GAUGE, "Power draw (averaged over 1 s on Ampere and newer).", labels=GPU,
              unit="watts")
POWER_LIMIT = _desc("gpuio_gpu_power_limit_watts", GAUGE, "Power limit the driver enforces.", labels=GPU, unit="watts")
ENERGY = _desc("gpuio_gpu_energy_joules_total", COUNTER,
               "Energy consumed since the driver loaded.", labels=GPU, unit="joules", slow=True)
SM_CLOCK = _desc("gpuio_gpu_sm_clock_hertz", GAUGE, "SM clock.", labels=GPU, unit="hertz")
SM_CLOCK_MAX = _desc("gpuio_gpu_sm_clock_max_hertz", GAUGE, "Highest SM clock.", labels=GPU, unit="hertz")
MEMORY_CLOCK = _desc("gpuio_gpu_memory_clock_hertz", GAUGE, "Memory clock.", labels=GPU, unit="hertz")
MEMORY_CLOCK_MAX = _desc("gpuio_gpu_memory_clock_max_hertz", GAUGE, "Highest memory clock.", labels=GPU, unit="hertz")
LINK_GEN = _desc("gpuio_gpu_pcie_link_generation", GAUGE, "PCIe link generation now.", labels=GPU)
LINK_GEN_MAX = _desc("gpuio_gpu_pcie_link_generation_max", GAUGE,
                     "Highest PCIe generation of this GPU and slot.", labels=GPU,
                     doc="Highest PCIe generation of this GPU and slot: below it, the link is degraded (or "
                         "idle-downshifted).")
LINK_WIDTH = _desc("gpuio_gpu_pcie_link_width", GAUGE, "PCIe lanes now.", labels=GPU)
LINK_WIDTH_MAX = _desc("gpuio_gpu_pcie_link_width_max", GAUGE,
                       "Most PCIe lanes of this GPU and slot.", labels=GPU,
                       doc="Most PCIe lanes of this GPU and slot: below it, the link is degraded.")
PCIE_TX = _desc("gpuio_gpu_pcie_transmit_bytes_total", COUNTER,
                "PCIe bytes sent by the GPU (GPM, Hopper+).", labels=GPU, unit="bytes",
                doc="PCIe bytes sent by the GPU, TLP overhead included (GPM: Hopper and newer only).")
PCIE_RX = _desc("gpuio_gpu_pcie_receive_bytes_total", COUNTER,
                "PCIe bytes received by the GPU (GPM, Hopper+).", labels=GPU, unit="bytes",
                doc="PCIe bytes received by the GPU, TLP overhead included (GPM: Hopper and newer only).")
REPLAYS = _desc("gpuio_gpu_pcie_replays_total", COUNTER,
                "PCIe replays (link-level retransmissions).", labels=GPU, slow=True)
REASON = _desc("gpuio_gpu_clocks_event_reason_active", GAUGE,
               "Whether a clock event reason holds clocks down now.", labels=(*GPU, "reason"),
               doc="Whether a clock event reason holds clocks down now; reasons as nvidia-smi's "
                   "`clocks_event_reasons.*`.")
VIOLATION = _desc("gpuio_gpu_clocks_event_seconds_total", COUNTER,
                  "Time a clock event reason held clocks down.", labels=(*GPU, "reason"), unit="seconds",
                  values={"reason": ("sw_power_cap", "sync_boost", "sw_thermal_slowdown", "hw_thermal_slowdown",
                                     "hw_power_brake_slowdown")}, slow=True)
ECC = _desc("gpuio_gpu_ecc_errors_total", COUNTER,
            "ECC errors since the driver loaded.", labels=(*GPU, "error"),
            values={"error": ("corrected", "uncorrected")}, slow=True)
ECC_AGGREGATE = _desc("gpuio_gpu_ecc_aggregate_errors_total", COUNTER,
                      "ECC errors over the GPU's lifetime.", labels=(*GPU, "error"),
                      values={"error": ("corrected", "uncorrected")}, slow=True)
REMAPPED = _desc("gpuio_gpu_remapped_rows", GAUGE,
                 "Memory rows remapped, by the kind of error that caused it.", labels=(*GPU, "cause"),
                 values={"cause": ("correctable", "uncorrectable")}, slow=True)
REMAP_PENDING = _desc("gpuio_gpu_remapped_rows_pending", GAUGE,
                      "Whether a row remap waits for a GPU reset.", labels=GPU, slow=True)
REMAP_FAILURE = _desc("gpuio_gpu_remapped_rows_failure", GAUGE, "Whether a row remap has failed.", labels=GPU,
                      slow=True)
XID = _desc("gpuio_gpu_xid_errors_total", COUNTER,
            "Xid events seen since the exporter started, by Xid code.", labels=(*GPU, "xid"),
            doc="Xid events seen since the exporter started, by Xid code (at most 64 codes per GPU, then `other`).")
XID_LAST = _desc("gpuio_gpu_xid_last_timestamp_seconds", GAUGE,
                 "When an Xid code was last seen.", labels=(*GPU, "xid"), unit="seconds",
                 doc="When an Xid code was last seen. `time() - x < 600` alerts on a new Xid, even its first.")
PROCESSES = _desc("gpuio_gpu_processes", GAUGE,
                  "Compute processes on the GPU (all, before the cap).", labels=GPU, slow=True)
PROCESS_MEMORY = _desc("gpuio_gpu_process_memory_used_bytes", GAUGE,
                       "Device memory of a compute process (NaN where NVML cannot say).",
                       labels=(*GPU, "pid", "process_name"), unit="bytes",
                       doc="Device memory of a compute process, largest first up to `--collector.nvml.max-processes` "
                           "(NaN where NVML cannot say).", slow=True)
DROPPED = _desc("gpuio_gpu_processes_dropped_total", COUNTER,
                "Processes left out of the list by the cap.", labels=GPU,
                doc="Processes left out of the list by the cap, each counted once.", slow=True)
MIG_ENABLED = _desc("gpuio_gpu_mig_enabled", GAUGE, "Whether MIG mode is on.", labels=GPU, slow=True)
MIG_INFO = _desc("gpuio_gpu_mig_device_info", INFO, "A MIG device (compute instance) of a GPU.",
                 labels=(*GPU, "mig_uuid", "gpu_instance", "compute_instance", "name"), slow=True)
MIG_MEMORY_TOTAL = _desc("gpuio_gpu_mig_device_memory_total_bytes", GAUGE,
                         "Memory of a MIG device.", labels=(*GPU, "mig_uuid"), unit="bytes", slow=True)
MIG_MEMORY_USED = _desc("gpuio_gpu_mig_device_memory_used_bytes", GAUGE,
                        "Memory of a MIG device in use.", labels=(*GPU, "mig_uuid"), unit="bytes", slow=True)
MIG_MEMORY_FREE = _desc("gpuio_gpu_mig_device_memory_free_bytes", GAUGE,
                        "Memory of a MIG device free.", labels=(*GPU, "mig_uuid"), unit="bytes", slow=True)
NVML_ERRORS = _desc("gpuio_gpu_nvml_errors_total", COUNTER,
                    "NVML calls that failed other than unsupported or lost, by call and error.",
                    labels=(*GPU, "call", "error"),
                    doc="NVML calls that failed other than unsupported or lost, by call and error (e.g. `Timeout`).")

# GPM (GPU Performance Monitoring, Hopper and newer): what the SMs, pipes, memory and links did, as
# counters (see Gpm for how a rate becomes a counter).  rate() of a *_seconds_total is the average ratio.
GPU = ("gpu", "uuid")
GPM_SUPPORTED = _desc("gpuio_gpu_gpm_supported", GAUGE,
                      "Whether the GPU has GPM (Hopper and newer): without it the SM, pipe, DRAM, NVLink and PCIe "
                      "byte families are absent.", GPU)
SM_ACTIVE = _desc("gpuio_gpu_sm_active_seconds_total", COUNTER,
                  "SM-seconds with a warp resident, per SM of the GPU: rate() is the share of SMs busy "
                  "(GPM SM utilisation; DCGM_FI_PROF_SM_ACTIVE).", GPU, "seconds")
SM_OCCUPANCY = _desc("gpuio_gpu_sm_occupancy_seconds_total", COUNTER,
                     "Integral of resident warps over the SMs' warp capacity: rate() is the mean occupancy "
                     "(GPM SM occupancy; DCGM_FI_PROF_SM_OCCUPANCY).", GPU, "seconds")
PIPE_ACTIVE = _desc("gpuio_gpu_pipe_active_seconds_total", COUNTER,
                    "Seconds a pipe of the SMs was busy, averaged over the SMs: rate() is its activity ratio "
                    "(pipe tensor: any tensor op; tensor_hmma/imma/dfma: that kind; fp64/fp32/fp16: non-tensor "
                    "math). Pipes overlap: do not sum them.", (*GPU, "pipe"), "seconds")
DRAM_ACTIVE = _desc("gpuio_gpu_dram_active_seconds_total", COUNTER,
                    "Integral of device-memory bandwidth used over the theoretical peak: rate() is the share of "
                    "peak DRAM bandwidth (GPM DRAM bandwidth utilisation).", GPU, "seconds")
NVLINK_RX = _desc("gpuio_gpu_nvlink_receive_bytes_total", COUNTER,
                  "NVLink bytes received over all links (GPM).", GPU, "bytes")
NVLINK_TX = _desc("gpuio_gpu_nvlink_transmit_bytes_total", COUNTER,
                  "NVLink bytes sent over all links (GPM).", GPU, "bytes")
NVLINK_LINK_RX = _desc("gpuio_gpu_nvlink_link_receive_bytes_total", COUNTER,
                       "NVLink bytes received on one active link (GPM).", (*GPU, "link"), "bytes")
NVLINK_LINK_TX = _desc("gpuio_gpu_nvlink_link_transmit_bytes_total", COUNTER,
                       "NVLink bytes sent on one active link (GPM).", (*GPU, "link"), "bytes")
MEDIA_ACTIVE = _desc("gpuio_gpu_media_active_seconds_total", COUNTER,
                     "Seconds a video decoder (nvdec), JPEG decoder (nvjpg) or optical-flow accelerator (nvofa) "
                     "was busy (GPM).", (*GPU, "media", "media_index"), "seconds")
MIG = (*GPU, "gpu_instance")
MIG_SM_ACTIVE = _desc("gpuio_gpu_mig_sm_active_seconds_total", COUNTER,
                      "SM activity of one MIG GPU instance, per SM of the instance (GPM; see "
                      "gpuio_gpu_sm_active_seconds_total).", MIG, "seconds", slow=True)
MIG_SM_OCCUPANCY = _desc("gpuio_gpu_mig_sm_occupancy_seconds_total", COUNTER,
                         "SM occupancy of one MIG GPU instance (GPM).", MIG, "seconds", slow=True)
MIG_PIPE_ACTIVE = _desc("gpuio_gpu_mig_pipe_active_seconds_total", COUNTER,
                        "Tensor-pipe activity of one MIG GPU instance (GPM).", (*MIG, "pipe"), "seconds", slow=True)
MIG_DRAM_ACTIVE = _desc("gpuio_gpu_mig_dram_active_seconds_total", COUNTER,
                        "Share of peak DRAM bandwidth one MIG GPU instance used (GPM).", MIG, "seconds", slow=True)
# Per process (nvmlDeviceGetProcessUtilization): NVML's busy idea, not GPM's activity.
PROCESS_SM_BUSY = _desc("gpuio_gpu_process_sm_busy_seconds_total", COUNTER,
                        "Seconds in which a kernel of this process ran, estimated from NVML's per-process SM "
                        "utilisation of its last sample period read every interval, for the processes listed.",
                        (*GPU, "pid", "process_name"), "seconds")
PROCESS_MEMORY_BUSY = _desc("gpuio_gpu_process_memory_busy_seconds_total", COUNTER,
                            "Seconds in which this process read or wrote device memory, estimated from NVML's "
                            "per-process memory utilisation of its last sample period read every interval, for "
                            "the processes listed.", (*GPU, "pid", "process_name"), "seconds")

# nvmlClocksEventReason* bits, named as nvidia-smi's clocks_event_reasons.* fields.
EVENT_REASONS = ((0x1, "gpu_idle"), (0x2, "applications_clocks_setting"), (0x4, "sw_power_cap"),
                 (0x8, "hw_slowdown"), (0x10, "sync_boost"), (0x20, "sw_thermal_slowdown"),
                 (0x40, "hw_thermal_slowdown"), (0x80, "hw_power_brake_slowdown"), (0x100, "display_clock_setting"))
# NVML_FI_DEV_CLOCKS_EVENT_REASON_* field ids (nanoseconds), nvidia-smi's clocks_event_reasons_counters.*.
VIOLATION_FIELDS = ((74, "sw_power_cap"), (76, "sync_boost"), (269, "sw_thermal_slowdown"),
                    (270, "hw_thermal_slowdown"), (271, "hw_power_brake_slowdown"))
FIELD_MEMORY_TEMPERATURE = 82

def _pipe(metric: int, pipe: str, desc: Desc = PIPE_ACTIVE) -> GpmMetric:
    return GpmMetric(metric, desc, (("pipe", pipe),))


GPM_METRICS = (
    GpmMetric(nv.GPM_METRIC_SM_UTIL, SM_ACTIVE),
    GpmMetric(nv.GPM_METRIC_SM_OCCUPANCY, SM_OCCUPANCY),
    _pipe(nv.GPM_METRIC_ANY_TENSOR_UTIL, "tensor"),
    GpmMetric(nv.GPM_METRIC_DRAM_BW_UTIL, DRAM_ACTIVE),
    GpmMetric(nv.GPM_METRIC_PCIE_TX_PER_SEC, PCIE_TX, scale=MIB_PER_SECOND),
    GpmMetric(nv.GPM_METRIC_PCIE_RX_PER_SEC, PCIE_RX, scale=MIB_PER_SECOND),
    _pipe(nv.GPM_METRIC_HMMA_TENSOR_UTIL, "tensor_hmma"),
    _pipe(nv.GPM_METRIC_IMMA_TENSOR_UTIL, "tensor_imma"),
    _pipe(nv.GPM_METRIC_DFMA_TENSOR_UTIL, "tensor_dfma"),
    _pipe(nv.GPM_METRIC_FP64_UTIL, "fp64"),
    _pipe(nv.GPM_METRIC_FP32_UTIL, "fp32"),
    _pipe(nv.GPM_METRIC_FP16_UTIL, "fp16"),
    *(GpmMetric(first + index, MEDIA_ACTIVE, (("media", media), ("media_index", str(index))))
      for media, first, count in (("nvdec", nv.GPM_METRIC_NVDEC_0_UTIL, 8), ("nvjpg", nv.GPM_METRIC_NVJPG_0_UTIL, 8),
                                  ("nvofa", nv.GPM_METRIC_NVOFA_0_UTIL, 2))
      for index in range(count)),
)
# Only on a GPU with an active NVLink (nvmlDeviceGetNvLinkState), so a PCIe card serves no zero links.
NVLINK_TOTALS = (GpmMetric(nv.GPM_METRIC_NVLINK_TOTAL_RX_PER_SEC, NVLINK_RX, scale=MIB_PER_SECOND),
                 GpmMetric(nv.GPM_METRIC_NVLINK_TOTAL_TX_PER_SEC, NVLINK_TX, scale=MIB_PER_SECOND))


def nvlink_link_metrics(link: int) -> tuple[GpmMetric, GpmMetric]:
    labels = (("link", str(link)),)
    first = nv.GPM_METRIC_NVLINK_L0_RX_PER_SEC + 2 * link
    return (GpmMetric(first, NVLINK_LINK_RX, labels, MIB_PER_SECOND),
            GpmMetric(first + 1, NVLINK_LINK_TX, labels, MIB_PER_SECOND))


# Per MIG GPU instance: what says whether the instance works (read every slow interval).
MIG_GPM_METRICS = (
    GpmMetric(nv.GPM_METRIC_SM_UTIL, MIG_SM_ACTIVE),
    GpmMetric(nv.GPM_METRIC_SM_OCCUPANCY, MIG_SM_OCCUPANCY),
    _pipe(nv.GPM_METRIC_ANY_TENSOR_UTIL, "tensor", MIG_PIPE_ACTIVE),
    GpmMetric(nv.GPM_METRIC_DRAM_BW_UTIL, MIG_DRAM_ACTIVE),
)


@dataclass(frozen=True)
class Scalar:
    """One NVML getter that yields one number: the declarative part of the catalog."""

    call: str  # names the call in logs, in nvml_errors_total and in a GPU's unsupported set
    desc: Desc
    method: str  # the Nvml method
    args: tuple[int, ...] = ()
    scale: int | float | None = None  # raw unit -> base unit; None keeps NVML's number
    labels: tuple[tuple[str, str], ...] = ()


STATIC = (
    Scalar("max_sm_clock", SM_CLOCK_MAX, "device_max_clock_info", (nv.CLOCK_SM,), 1_000_000),
    Scalar("max_memory_clock", MEMORY_CLOCK_MAX, "device_max_clock_info", (nv.CLOCK_MEM,), 1_000_000),
    Scalar("max_pcie_link_generation", LINK_GEN_MAX, "device_max_pcie_link_generation"),
    Scalar("max_pcie_link_width", LINK_WIDTH_MAX, "device_max_pcie_link_width"),
)
FAST = (
    Scalar("temperature", TEMPERATURE, "device_temperature", (nv.TEMPERATURE_GPU,)),
    Scalar("power_usage", POWER, "device_power_usage", (), 0.001),
    Scalar("enforced_power_limit", POWER_LIMIT, "device_enforced_power_limit", (), 0.001),
    Scalar("sm_clock", SM_CLOCK, "device_clock_info", (nv.CLOCK_SM,), 1_000_000),
    Scalar("memory_clock", MEMORY_CLOCK, "device_clock_info", (nv.CLOCK_MEM,), 1_000_000),
    Scalar("pcie_link_generation", LINK_GEN, "device_curr_pcie_link_generation"),
    Scalar("pcie_link_width", LINK_WIDTH, "device_curr_pcie_link_width"),
)
SLOW = (
    Scalar("total_energy_consumption", ENERGY, "device_total_energy_consumption", (), 0.001),
    Scalar("pcie_replay_counter", REPLAYS, "device_pcie_replay_counter"),
    Scalar("ecc_corrected_volatile", ECC, "device_total_ecc_errors", (nv.MEMORY_ERROR_CORRECTED, nv.VOLATILE_ECC),
           None, (("error", "corrected"),)),
    Scalar("ecc_uncorrected_volatile", ECC, "device_total_ecc_errors", (nv.MEMORY_ERROR_UNCORRECTED, nv.VOLATILE_ECC),
           None, (("error", "uncorrected"),)),
    Scalar("ecc_corrected_aggregate", ECC_AGGREGATE, "device_total_ecc_errors",
           (nv.MEMORY_ERROR_CORRECTED, nv.AGGREGATE_ECC), None, (("error", "corrected"),)),
    Scalar("ecc_uncorrected_aggregate", ECC_AGGREGATE, "device_total_ecc_errors",
           (nv.MEMORY_ERROR_UNCORRECTED, nv.AGGREGATE_ECC), None, (("error", "uncorrected"),)),
)

MemoryDescs = tuple[Desc, "Desc | None", Desc, Desc]  # total, reserved, free, used
MEMORY_DESCS: MemoryDescs = (MEMORY_TOTAL, MEMORY_RESERVED, MEMORY_FREE, MEMORY_USED)
MIG_MEMORY_DESCS: MemoryDescs = (MIG_MEMORY_TOTAL, None, MIG_MEMORY_FREE, MIG_MEMORY_USED)  # v2's reserved: GPU-wide


class NvmlHung(StaleData):
    """An NVML call has not returned within the hang timeout: the collector fails, the last snapshot is served."""


class GpuReader:
    """The readings of one GPU: once per session (identity, static), every sweep (fast: busy, memory,
    power, clocks, GPM, per-process busy) and every slow interval (energy, ECC, processes, MIG)."""

    def __init__(self, calls: NvmlCalls, max_processes: int, context: Callable[[], Context]) -> None:
        self._calls = calls
        self._max_processes = max_processes
        self._context = context
        self._gpm = GpmReader(calls)
        # A GPU process's start time, read where the wait can be abandoned (abandonable.proc_reads): a process
        # stuck in execve reads as start 0 ("not read") for a minute, and the sweep goes on.
        self._proc = proc_reads("nvml-proc")

    @property
    def _nvml(self) -> Nvml | None:
        return self._calls.nvml

    # -- once per session --

    def prepare(self, session: Session, gpu: Gpu) -> None:
        """What a GPU joining ``session`` is read for once: identity, static readings, GPM."""
        self._read_identity(session, gpu)
        gpu.static = self._scalars(gpu, STATIC)
        gpu.gpm = self._gpm.open(gpu)
        gpu.static.append((GPM_SUPPORTED, gpu.labels, 0 if gpu.gpm is None else 1))
        gpu.gpm_metrics = GPM_METRICS + self._gpm.nvlink_metrics(gpu) if gpu.gpm is not None else ()
        gpu.process_busy.limit = 4 * self._max_processes

    def _read_identity(self, session: Session, gpu: Gpu) -> None:
        nvml = self._nvml
        assert nvml is not None
        handle = gpu.handle
        minor = self._calls.call(gpu, "minor_number", nvml.device_minor_number, handle)
        gpu.info_labels = label_string({
            "gpu": str(gpu.index), "uuid": gpu.uuid,
            "name": self._calls.call(gpu, "name", nvml.device_name, handle) or "",
            "pci_bus_id": self._calls.call(gpu, "pci_bus_id", nvml.device_pci_bus_id, handle) or "",
            "serial": self._calls.call(gpu, "serial", nvml.device_serial, handle) or "",
            "minor_number": "" if minor is None else str(minor),
            "driver_version": session.driver_version, "cuda_version": session.cuda_version,
        })
        supported = self._calls.call(gpu, "supported_clocks_event_reasons", nvml.device_supported_clocks_event_reasons,
                                     handle)
        gpu.reasons_supported = 0x1FF if supported is None else supported

    def _scalars(self, gpu: Gpu, catalog: tuple[Scalar, ...]) -> list[Reading]:
        assert self._nvml is not None
        readings: list[Reading] = []
        for scalar in catalog:
            value = self._calls.call(gpu, scalar.call, getattr(self._nvml, scalar.method), gpu.handle, *scalar.args)
            if value is not None:
                scaled = value if scalar.scale is None else value * scalar.scale
                readings.append((scalar.desc, gpu.label(scalar.labels), scaled))
        return readings

    # -- reading one GPU --

    def read(self, gpu: Gpu, slow: bool) -> None:
        fast = self._read_fast(gpu)
        slow_readings = self._read_slow(gpu) if slow else None
        fast += self._read_process_busy(gpu)  # after the process list: a process it names has series at once
        if not gpu.up:
            return
        gpu.fast = fast
        if slow_readings is not None:
            gpu.slow = slow_readings

    def _read_fast(self, gpu: Gpu) -> list[Reading]:
        readings = self._read_busy(gpu)
        readings += self._read_rates(gpu)
        readings += self._read_memory(gpu, gpu.handle, gpu.labels, MEMORY_DESCS, "")
        readings += self._scalars(gpu, FAST)
        readings += self._read_memory_temperature(gpu)
        readings += self._read_reasons(gpu)
        readings += self._gpm.read(gpu)
        return readings

    def _read_slow(self, gpu: Gpu) -> list[Reading]:
        readings = self._scalars(gpu, SLOW)
        readings += self._read_violations(gpu)
        readings += self._read_remapped_rows(gpu)
        readings += self._read_processes(gpu)
        readings += self._read_mig(gpu)
        return readings

    def _read_busy(self, gpu: Gpu) -> list[Reading]:
        assert self._nvml is not None
        if not gpu.up or "samples" in gpu.unsupported:
            return []
        self._calls.current_call = "samples"
        try:
            samples = self._nvml.device_samples(gpu.handle, nv.GPU_UTILIZATION_SAMPLES, gpu.busy.last_seen_us or 0)
        except NVMLError as exc:
            if error_code(exc) != nv.ERROR_NOT_FOUND:  # NotFound: no sample newer than the last one seen
                self._calls.failed(gpu, "samples", exc)
                return []
            samples = []
        gpu.busy.feed(samples)
        return [(BUSY, gpu.labels, gpu.busy.seconds)]

    def _read_rates(self, gpu: Gpu) -> list[Reading]:
        assert self._nvml is not None
        rates = self._calls.call(gpu, "utilization_rates", self._nvml.device_utilization_rates, gpu.handle)
        if rates is None:
            return []
        return [(UTILIZATION, gpu.labels, rates[0] / 100), (MEMORY_UTILIZATION, gpu.labels, rates[1] / 100)]

    def _read_memory(self, gpu: Gpu, handle: Any, labels: str, descs: MemoryDescs, prefix: str) -> list[Reading]:
        """total/reserved/free/used from nvmlDeviceGetMemoryInfo_v2, or total/free/used on a driver without it."""
        assert self._nvml is not None
        total, reserved, free, used = descs
        v2 = self._calls.call(gpu, prefix + "memory_info_v2", self._nvml.device_memory_info_v2, handle)
        if v2 is not None:
            readings: list[Reading] = [(total, labels, v2[0]), (free, labels, v2[2]), (used, labels, v2[3])]
            return readings if reserved is None else [*readings, (reserved, labels, v2[1])]
        v1 = self._calls.call(gpu, prefix + "memory_info", self._nvml.device_memory_info, handle)
        if v1 is None:
            return []
        return [(total, labels, v1[0]), (free, labels, v1[1]), (used, labels, v1[2])]

    def _read_memory_temperature(self, gpu: Gpu) -> list[Reading]:
        values = self._fields(gpu, "memory_temperature", (FIELD_MEMORY_TEMPERATURE,))
        value = values.get(FIELD_MEMORY_TEMPERATURE)
        return [] if value is None else [(MEMORY_TEMPERATURE, gpu.labels, value)]

    def _read_reasons(self, gpu: Gpu) -> list[Reading]:
        assert self._nvml is not None
        mask = self._calls.call(gpu, "clocks_event_reasons", self._nvml.device_current_clocks_event_reasons, gpu.handle)
        if mask is None and "clocks_event_reasons" in gpu.unsupported:  # driver < 535 names it "throttle"
            mask = self._calls.call(gpu, "clocks_throttle_reasons", self._nvml.device_current_clocks_throttle_reasons,
                                    gpu.handle)
        if mask is None:
            return []
        return [(REASON, gpu.label((("reason", name),)), 1 if mask & bit else 0)
                for bit, name in EVENT_REASONS if gpu.reasons_supported & bit]

    def _read_process_busy(self, gpu: Gpu) -> list[Reading]:
        """Busy seconds of each listed process (nvmlDeviceGetProcessUtilization, see ProcessBusy).

        Every sweep: NVML answers for its last sample period only, so the more often it is asked the
        closer the estimate (~1.4-2.7 ms of CPU per call on an H100, a quarter of the sampler's cost).
        A failed call counts nothing and keeps the series: whether a process has series depends on the
        process list alone, not on each call (a flickering series breaks rate())."""
        assert self._nvml is not None
        if not gpu.up or "process_utilization" in gpu.unsupported:
            return []
        tracker = gpu.process_busy
        self._calls.current_call = "process_utilization"
        now = time.time()  # NVML stamps samples with the wall clock, in microseconds
        try:
            tracker.feed(self._nvml.device_process_utilization(gpu.handle, tracker.last_seen_us), now,
                         gpu.names.keys())
        except NVMLError as exc:
            code = error_code(exc)
            if code == nv.ERROR_NOT_FOUND:  # nothing ran in NVML's last sample period
                tracker.feed([], now)
            elif code in nv.UNSUPPORTED and code not in (nv.ERROR_NOT_SUPPORTED, nv.ERROR_FUNCTION_NOT_FOUND):
                # NoPermission, InvalidArgument, NoData: may be an answer about the processes of the
                # moment rather than the driver's last word: counted (gpuio_gpu_nvml_errors_total) and
                # asked again next sweep, instead of leaving the families out until NVML restarts.
                self._calls.count_failure(gpu, "process_utilization", exc)
            else:
                self._calls.failed(gpu, "process_utilization", exc)
                if "process_utilization" in gpu.unsupported:  # this GPU or driver lacks it: absent, not zero
                    return []
        readings: list[Reading] = []
        for pid, name in gpu.names.items():  # the processes the list shows (largest memory first, capped)
            labels = gpu.label((("pid", str(pid)), ("process_name", name)))
            sm, memory = tracker.seconds.get(pid, (0.0, 0.0))
            readings += [(PROCESS_SM_BUSY, labels, sm), (PROCESS_MEMORY_BUSY, labels, memory)]
        return readings

    def _fields(self, gpu: Gpu, call: str, field_ids: tuple[int, ...]) -> dict[int, int | float]:
        """Field values NVML gave; a field it refused is classified like a failed call of its own."""
        assert self._nvml is not None
        wanted = [f for f in field_ids if f"field_{f}" not in gpu.unsupported]
        values = self._calls.call(gpu, call, self._nvml.device_field_values, gpu.handle, wanted) if wanted else None
        result: dict[int, int | float] = {}
        for field_id, value in (values or {}).items():
            if isinstance(value, Exception):
                self._calls.failed(gpu, f"field_{field_id}", value)
            else:
                result[field_id] = value
        return result

    def _read_violations(self, gpu: Gpu) -> list[Reading]:
        values = self._fields(gpu, "violation_fields", tuple(f for f, _ in VIOLATION_FIELDS))
        return [(VIOLATION, gpu.label((("reason", reason),)), values[f] / 1e9)
                for f, reason in VIOLATION_FIELDS if f in values]

    def _read_remapped_rows(self, gpu: Gpu) -> list[Reading]:
        assert self._nvml is not None
        rows = self._calls.call(gpu, "remapped_rows", self._nvml.device_remapped_rows, gpu.handle)
        if rows is None:
            return []
        correctable, uncorrectable, pending, failure = rows
        return [(REMAPPED, gpu.label((("cause", "correctable"),)), correctable),
                (REMAPPED, gpu.label((("cause", "uncorrectable"),)), uncorrectable),
                (REMAP_PENDING, gpu.labels, 1 if pending else 0), (REMAP_FAILURE, gpu.labels, 1 if failure else 0)]

    def _start_ticks(self, pid: int) -> int:
        try:
            return self._proc.call(pid, functools.partial(procstat.start_ticks, pid, self._context().procfs))
        except Unresponsive:
            return 0

    def _read_processes(self, gpu: Gpu) -> list[Reading]:
        assert self._nvml is not None
        processes = self._calls.call(gpu, "compute_running_processes", self._nvml.device_compute_running_processes,
                                     gpu.handle)
        if processes is None:
            return []
        # One small read of /proc/<pid>/stat per process: its start time tells a recycled pid's new
        # process from the one remembered under that pid.
        gpu.started = {p.pid: self._start_ticks(p.pid) for p in processes}
        gpu.used = {p.pid: p.used_memory for p in processes}
        gpu.process_busy.keep(set(gpu.started))
        processes = sorted(processes, key=lambda p: (-(p.used_memory or 0), p.pid))
        kept, dropped = processes[: self._max_processes], processes[self._max_processes :]
        dropped_processes = {(p.pid, gpu.started[p.pid]) for p in dropped}
        gpu.dropped += len(dropped_processes - gpu.dropped_processes)  # each counted once, when first left out
        gpu.dropped_processes = dropped_processes
        self._forget_recycled_pids(gpu, {p.pid: gpu.started[p.pid] for p in kept})
        gpu.names = {p.pid: gpu.names.get(p.pid) or self._process_name(p.pid) for p in kept}
        gpu.pods = {p.pid: gpu.pods[p.pid] if p.pid in gpu.pods else cgroup.of_pid(p.pid, self._context().procfs,
                                                                                   sysfs=self._context().sysfs)
                    for p in kept}
        readings: list[Reading] = [(PROCESSES, gpu.labels, len(processes)), (DROPPED, gpu.labels, gpu.dropped)]
        for process in kept:
            labels = gpu.label((("pid", str(process.pid)), ("process_name", gpu.names[process.pid]),
                                *self._pod_labels(gpu, gpu.pods[process.pid])))
            used = math.nan if process.used_memory is None else process.used_memory
            readings.append((PROCESS_MEMORY, labels, used))
        return readings

    def _forget_recycled_pids(self, gpu: Gpu, starts: dict[int, int]) -> None:
        """Forget the name, pod and busy seconds remembered for a pid that now names another process (the
        old one exited and the kernel gave its pid to a new one between two reads: NVML lists the pid on
        and on).  Told by the start time (``starts``: pid -> start ticks of each process shown); an
        unreadable one (0) proves nothing and forgets nothing."""
        starts = dict(starts)
        for pid, start in starts.items():
            known = gpu.starts.get(pid, 0)
            if start and known and start != known:
                gpu.names.pop(pid, None)
                gpu.pods.pop(pid, None)
                gpu.process_busy.forget(pid)
            if not start:
                starts[pid] = known
        gpu.starts = starts

    def _pod_labels(self, gpu: Gpu, ref: cgroup.PodRef | None) -> tuple[tuple[str, str], ...]:
        """namespace, pod and container of a process in a pod (exporter.pods.attribution); nothing for a
        process in no pod or whose pod cannot be named, so off Kubernetes the series are as they were."""
        if ref is None:
            return ()
        named = self._context().pods.of_process(ref.pod_uid, gpu.uuid)
        if named is None:
            return ()
        return (("namespace", named[0]), ("pod", named[1]), ("container", named[2]))

    def _process_name(self, pid: int) -> str:
        assert self._nvml is not None
        try:
            return self._nvml.system_process_name(pid)
        except NVMLError:
            return ""  # the process ended, or lives where NVML cannot see its name

    def _read_mig(self, gpu: Gpu) -> list[Reading]:
        """MIG mode; with it on, each MIG device's identity and memory (NVML has no MIG utilisation)."""
        assert self._nvml is not None
        gpu.mig_uuids = set()
        mode = self._calls.call(gpu, "mig_mode", self._nvml.device_mig_mode, gpu.handle)
        if mode is None:
            return []
        readings: list[Reading] = [(MIG_ENABLED, gpu.labels, 1 if mode[0] else 0)]
        if not mode[0]:
            return readings
        count = self._calls.call(gpu, "max_mig_device_count", self._nvml.device_max_mig_device_count, gpu.handle) or 0
        instances: set[int] = set()
        for index in range(count):
            self._calls.current_call = "mig_device_handle_by_index"
            try:
                handle = self._nvml.device_mig_device_handle_by_index(gpu.handle, index)
            except NVMLError as exc:
                if error_code(exc) == nv.ERROR_NOT_FOUND:  # an empty slot
                    continue
                self._calls.failed(gpu, "mig_device_handle_by_index", exc)
                break
            readings += self._read_mig_device(gpu, handle, instances)
        return readings + self._gpm.read_mig(gpu, instances)

    def _read_mig_device(self, gpu: Gpu, handle: Any, instances: set[int]) -> list[Reading]:
        assert self._nvml is not None
        nvml = self._nvml
        mig_uuid = self._calls.call(gpu, "mig_uuid", nvml.device_uuid, handle)
        if mig_uuid is None:
            return []
        gpu.mig_uuids.add(mig_uuid)
        gpu_instance = self._calls.call(gpu, "mig_gpu_instance_id", nvml.device_gpu_instance_id, handle)
        if gpu_instance is not None:
            instances.add(gpu_instance)
        compute_instance = self._calls.call(gpu, "mig_compute_instance_id", nvml.device_compute_instance_id, handle)
        info = gpu.label((("mig_uuid", mig_uuid),
                          ("gpu_instance", "" if gpu_instance is None else str(gpu_instance)),
                          ("compute_instance", "" if compute_instance is None else str(compute_instance)),
                          ("name", self._calls.call(gpu, "mig_name", nvml.device_name, handle) or "")))
        memory = self._read_memory(gpu, handle, gpu.label((("mig_uuid", mig_uuid),)), MIG_MEMORY_DESCS, "mig_")
        return [(MIG_INFO, info, 1), *memory]


class GpmReader:
    """The GPM counters of a GPU and of its MIG GPU instances (see Gpm), read through ``calls``."""

    def __init__(self, calls: NvmlCalls) -> None:
        self._calls = calls

    @property
    def _nvml(self) -> Nvml | None:
        return self._calls.nvml

    def open(self, gpu: Gpu) -> Gpm | None:
        nvml = self._nvml
        assert nvml is not None
        if not self._calls.call(gpu, "gpm_query_device_support", nvml.gpm_query_device_support, gpu.handle):
            return None
        return self._gpm_buffers(gpu)

    def _gpm_buffers(self, gpu: Gpu) -> Gpm | None:
        nvml = self._nvml
        assert nvml is not None
        buffers = [self._calls.call(gpu, "gpm_sample_alloc", nvml.gpm_sample_alloc) for _ in range(3)]
        if any(buffer is None for buffer in buffers):
            for buffer in buffers:
                if buffer is not None:
                    quietly(nvml.gpm_sample_free, buffer)
            return None
        return Gpm((buffers[0], buffers[1], buffers[2]))

    def nvlink_metrics(self, gpu: Gpu) -> tuple[GpmMetric, ...]:
        """The NVLink metrics of the links that are up, read once per session; none on a PCIe card."""
        nvml = self._nvml
        assert nvml is not None
        metrics: list[GpmMetric] = []
        for link in range(nv.NVLINK_LINKS):
            try:
                active = nvml.device_nvlink_state(gpu.handle, link)
            except NVMLError:  # no NVLink, or no such link: NVML numbers links from 0
                break
            if active:
                metrics += nvlink_link_metrics(link)
        return (*NVLINK_TOTALS, *metrics) if metrics else ()

    def read(self, gpu: Gpu) -> list[Reading]:
        """The GPU's GPM counters (see Gpm)."""
        nvml, gpm = self._nvml, gpu.gpm
        if gpm is None or nvml is None:
            return []
        self._advance_gpm(gpu, gpm, gpu.gpm_totals, gpu.gpm_metrics, "", nvml.gpm_sample_get, gpu.handle)
        if gpm.since is None or "gpm_metrics_get" in gpu.unsupported:
            return []
        return [(m.desc, gpu.label(m.labels), gpu.gpm_totals[m.metric])
                for m in gpu.gpm_metrics if m.metric in gpu.gpm_totals]

    def _advance_gpm(self, gpu: Gpu, gpm: Gpm, totals: dict[int, float], metrics: tuple[GpmMetric, ...],
                     prefix: str, sample_get: Callable[..., Any], *where: Any) -> None:
        """One GPM step (see Gpm): a sample into a spare buffer; each byte rate as its total since the
        baseline, each activity ratio added for the window since the previous sample; the baseline
        moves when it is old.  ``prefix`` ("mig_") keeps a GPU instance's refusals apart from the GPU's."""
        now = time.monotonic()
        sample_call = prefix + "gpm_sample_get"
        if gpm.since is None:
            first = gpm.buffers[0]
            if self._calls.call(gpu, sample_call, sample_get, *where, first) is not None:
                for metric in metrics:  # served from the first sample on: rate() misses nothing of the first step
                    totals.setdefault(metric.metric, 0.0)
                gpm.baseline = gpm.previous = first
                gpm.since = gpm.previous_at = now
                gpm.carry = dict(totals)
            return
        due = [m for m in metrics if f"{prefix}gpm_metric_{m.metric}" not in gpu.unsupported]
        sample = gpm.spare()
        if not due or self._calls.call(gpu, sample_call, sample_get, *where, sample) is None:
            return
        ratios = self._gpm_values(gpu, prefix, gpm.previous, sample, [m for m in due if m.ratio], totals)
        rates = self._gpm_values(gpu, prefix, gpm.baseline, sample, [m for m in due if not m.ratio], totals)
        if ratios is not None:
            window = now - gpm.previous_at
            for metric, ratio in ratios:
                added = min(max(ratio, 0.0), 100.0) * metric.scale * window
                totals[metric.metric] = totals.get(metric.metric, 0.0) + added
            gpm.previous, gpm.previous_at = sample, now  # a failed call leaves the window to the next sweep
        for metric, rate in rates or ():
            total = gpm.carry.get(metric.metric, 0.0) + max(rate, 0.0) * metric.scale * (now - gpm.since)
            totals[metric.metric] = max(totals.get(metric.metric, 0.0), total)
        if now - gpm.since >= GPM_REBASE and rates is not None and gpm.previous is sample:
            gpm.baseline, gpm.since = sample, now
            gpm.carry = dict(totals)

    def _gpm_values(self, gpu: Gpu, prefix: str, first: Any, second: Any, metrics: list[GpmMetric],
                    totals: dict[int, float]) -> list[tuple[GpmMetric, float]] | None:
        """nvmlGpmMetricsGet of ``metrics`` between two samples: the values NVML gave (a metric this GPU
        lacks is dropped from ``totals``, absent from then on); None when the call failed."""
        assert self._nvml is not None
        if not metrics:
            return []
        values = self._calls.call(gpu, "gpm_metrics_get", self._nvml.gpm_metrics_get, first, second,
                                  [m.metric for m in metrics])
        if values is None:
            return None
        found: list[tuple[GpmMetric, float]] = []
        for metric in metrics:
            value = values.get(metric.metric)
            if isinstance(value, Exception):
                self._calls.failed(gpu, f"{prefix}gpm_metric_{metric.metric}", value)
                if f"{prefix}gpm_metric_{metric.metric}" in gpu.unsupported:  # this GPU lacks it: absent
                    totals.pop(metric.metric, None)
            elif value is not None:
                found.append((metric, value))
        return found

    def read_mig(self, gpu: Gpu, instances: set[int]) -> list[Reading]:
        """GPM per MIG GPU instance (nvmlGpmMigSampleGet on the parent GPU), on the GPUs that have GPM."""
        nvml = self._nvml
        assert nvml is not None
        for gone in set(gpu.mig_gpm) - instances:  # an instance destroyed: its buffers go with it
            for buffer in gpu.mig_gpm.pop(gone).buffers:
                quietly(nvml.gpm_sample_free, buffer)
        if gpu.gpm is None:
            return []
        readings: list[Reading] = []
        for instance in sorted(instances):
            gpm = gpu.mig_gpm.get(instance)
            if gpm is None and "mig_gpm_sample_get" not in gpu.unsupported:
                gpm = self._gpm_buffers(gpu)
                if gpm is not None:
                    gpu.mig_gpm[instance] = gpm
            if gpm is None:
                continue
            totals = gpu.mig_gpm_totals.setdefault(instance, {})
            self._advance_gpm(gpu, gpm, totals, MIG_GPM_METRICS, "mig_", nvml.gpm_mig_sample_get,
                              gpu.handle, instance)
            if gpm.since is not None:
                extra = (("gpu_instance", str(instance)),)
                readings += [(m.desc, gpu.label(extra + m.labels), totals[m.metric])
                             for m in MIG_GPM_METRICS if m.metric in totals]
        return readings


DURATION = "a duration above zero such as 500ms, 2s, 5m"


@register
class NvmlCollector(Collector):
    """Schedules the sweeps (what is due: fast readings every interval, slow ones every slow interval),
    renders them, and serves the last rendering on the scrape path.  The NVML session is the
    :class:`SessionKeeper`'s, the readings of one GPU the :class:`GpuReader`'s."""

    name = "nvml"
    options = (
        Option("interval", "1s", parse_seconds, DURATION,
               "How often NVML is read (utilisation, memory, power, clocks)."),
        Option("slow-interval", "10s", parse_seconds, DURATION,
               "How often the costly fields are read: energy, violation counters, ECC, processes, MIG."),
        Option("hang-timeout", "10s", parse_seconds, DURATION,
               "An NVML call still running after this long fails the collector (the data is stale)."),
        Option("reinit-interval", "30s", parse_seconds, DURATION,
               "How long after a lost GPU NVML is re-initialised, and how often a missing NVML is retried."),
        Option("max-processes", "64", parse_count(1), "a whole number above zero",
               "Most compute processes listed per GPU (largest memory first); the rest are counted as dropped."),
    )

    def __init__(self, context: Context, options: dict[str, Any], nvml: Nvml | None = None) -> None:
        super().__init__(context, options)
        self._interval: float = self.settings["interval"]
        self._slow_interval: float = self.settings["slow-interval"]
        self._hang_timeout: float = self.settings["hang-timeout"]
        self._next_slow = 0.0
        self._lock = threading.Lock()  # one sweep at a time; stop() waits for it
        self._xid_lock = threading.Lock()  # the Xid listener's counts against a rendering
        self._sweep_started: float | None = None
        self._once = LogOnce(log)
        self._stopped = False
        # A GPU joining a session is prepared by the reader, which reads through the keeper's calls.
        self._sessions = SessionKeeper(nvml, self.settings["reinit-interval"], self._once, self._xid_lock,
                                       lambda session, gpu: self._reader.prepare(session, gpu))
        # The context is read at each use: whoever built the collector may hand it another one.
        self._reader = GpuReader(self._sessions.calls, self.settings["max-processes"], lambda: self.context)
        self.ledger = GpuLedger(lambda: self.context)
        self.sampler: PeriodicSampler[list[Family]] = PeriodicSampler("nvml", self._interval, self.sweep, log)

    @property
    def xid_wait_ms(self) -> int:
        """How long each nvmlEventSetWait blocks; a re-init waits up to this long."""
        return self._sessions.xid_wait_ms

    @xid_wait_ms.setter
    def xid_wait_ms(self, value: int) -> None:
        self._sessions.xid_wait_ms = value

    # -- the scrape path: no NVML here --

    def start(self) -> None:
        self.sampler.start()

    def stop(self) -> None:
        self.sampler.stop()
        self._stopped = True  # a sweep already past the sampler's stop check must not open a new session
        if self._lock.acquire(timeout=self.xid_wait_ms / 1000 + 1.0):  # a hung sweep keeps its session
            try:
                self._sessions.close()
            finally:
                self._lock.release()

    def collect(self) -> list[Family]:
        snapshot = self.sampler.snapshot()
        served = self._served(snapshot)
        hung = self.hung(time.monotonic())
        if hung is not None:
            self._once.warning("NVML hung: the nvml collector fails until the call returns",
                               self._sessions.calls.current_call)
            raise NvmlHung(hung, served)
        if snapshot.error is not None:
            raise StaleData(f"the last NVML sweep failed: {snapshot.error}", served)
        if self._sessions.absent is not None:
            raise Absent(self._sessions.absent, served)  # a CPU node: no failure, logged once by the scraper
        if self.sampler.first_pending():
            raise Pending("the first NVML sweep since start-up is still running", served)
        return served

    @staticmethod
    def _served(snapshot: Snapshot[list[Family]]) -> list[Family]:
        """The last sweep's families with their age; nothing when there are no GPUs or no sweep yet."""
        if not snapshot.value or snapshot.taken_at is None:
            return []
        return [*snapshot.value, AGE.family([AGE.sample("", max(0.0, time.time() - snapshot.taken_at))])]

    def hung(self, now: float) -> str | None:
        """Why the data is stale, when a sweep or the Xid wait has been inside NVML too long."""
        started = self._sweep_started
        if started is not None and now - started > self._hang_timeout:
            call = self._sessions.calls.current_call
            return f"an NVML sweep has been running for {now - started:.1f}s (in {call or 'nvml'})"
        session = self._sessions.session
        listener = session.listener if session is not None else None
        waiting = listener.waiting_since if listener is not None else None
        if waiting is not None and now - waiting > self._hang_timeout + self.xid_wait_ms / 1000:
            return f"nvmlEventSetWait has not returned for {now - waiting:.1f}s"
        return None

    # -- one sweep, on the sampler's thread --

    def sweep(self) -> list[Family]:
        """Read what is due and render the families scrapes serve until the next sweep."""
        with self._lock:
            if self._stopped:
                return []
            self._sweep_started = time.monotonic()
            try:
                now = self._sweep_started
                if self._sessions.manage(now):
                    self._next_slow = now  # a new session reads everything at once
                session = self._sessions.session
                if session is not None:
                    slow = now >= self._next_slow
                    if slow:
                        self._next_slow = now + self._slow_interval
                    for gpu in session.gpus:
                        self._reader.read(gpu, slow)
                    self.ledger.advance(self._ledger_readings(session), now)
                    if slow:
                        self.context.gpu_processes.update_sweep(
                            (((pid, start), gpu.uuid, gpu.used.get(pid)) for gpu in session.gpus
                             if gpu.up for pid, start in gpu.started.items()), self._cuda_order(session))
                        self.context.pods.set_mig_parents(
                            {mig: gpu.uuid for gpu in session.gpus if gpu.up for mig in gpu.mig_uuids})
                return self._render()
            finally:
                self._sweep_started = None
                self._sessions.calls.current_call = ""

    def _ledger_readings(self, session: Session) -> list[DeviceReading]:
        """Each GPU's busy and SM-active counters, whether NVML lists a compute process on it and the named
        pods of those it keeps; a GPU in MIG mode is its MIG devices (no busy reading of their own; NVML lists
        their processes on the GPU), so that no second of it is counted twice."""
        readings: list[DeviceReading] = []
        for gpu in session.gpus:
            if gpu.mig_uuids:
                readings.extend(DeviceReading(mig, None, None, False) for mig in sorted(gpu.mig_uuids))
                continue
            busy = gpu.busy.seconds if gpu.up and gpu.busy.last_seen_us is not None else None
            sm_active = gpu.gpm_totals.get(nv.GPM_METRIC_SM_UTIL) if gpu.up and gpu.gpm is not None else None
            pods = self.context.pods
            named = {pods.of_process(ref.pod_uid, gpu.uuid) for ref in gpu.pods.values() if ref is not None}
            readings.append(DeviceReading(gpu.uuid, busy, sm_active, bool(gpu.started),
                                          frozenset(name[:2] for name in named if name is not None)))
        return readings

    @staticmethod
    def _cuda_order(session: Session) -> tuple[str, ...]:
        """Every GPU's UUID in NVML index order, what a process's CUDA ordinals are mapped onto
        (exporter.engines.placement: CUDA enumerates in PCI bus order, as NVML does, on a node of one GPU
        model); () where CUDA's order cannot be told from NVML's: an index whose handle NVML refused (is it
        among CUDA's devices?), or a GPU in MIG mode (CUDA enumerates its MIG devices instead)."""
        if session.missing or any(gpu.mig_uuids for gpu in session.gpus):
            return ()
        return tuple(gpu.uuid for gpu in sorted(session.gpus, key=lambda gpu: gpu.index))

    # -- rendering, once per sweep --

    def _render(self) -> list[Family]:
        lines: dict[Desc, list[str]] = {desc: [] for desc in DESCS}
        session = self._sessions.session
        if session is not None:
            lines[COUNT].append(COUNT.sample("", session.count))
            for index in session.missing:
                lines[UP].append(UP.sample(label_string({"gpu": str(index), "uuid": ""}), 0))
        with self._xid_lock:
            for gpu in sorted(self._sessions.gpus.values(), key=lambda g: (g.index, g.uuid)):
                self._render_gpu(gpu, lines)
        families = [Family(desc, samples) for desc, samples in lines.items() if samples]
        return families + [family for family in self.ledger.families() if family.samples]

    @staticmethod
    def _render_gpu(gpu: Gpu, lines: dict[Desc, list[str]]) -> None:
        up = gpu.handle is not None and gpu.up
        lines[UP].append(UP.sample(gpu.labels, 1 if up else 0))
        lines[INFO_DESC].append(INFO_DESC.sample(gpu.info_labels, 1))
        for code, (count, seen) in gpu.xid.items():  # events already seen stay true when the GPU is down
            labels = gpu.label((("xid", code),))
            lines[XID].append(XID.sample(labels, count))
            lines[XID_LAST].append(XID_LAST.sample(labels, seen))
        for (call, error), count in gpu.errors.items():
            lines[NVML_ERRORS].append(NVML_ERRORS.sample(gpu.label((("call", call), ("error", error))), count))
        if up:
            for desc, labels, value in (*gpu.static, *gpu.fast, *gpu.slow):
                lines[desc].append(desc.sample(labels, value))


