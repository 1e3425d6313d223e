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

The hardware sits behind :class:`exporter.nvml_device.Nvml`; tests run this module on a fake of it.
"""

from __future__ import annotations

import functools
import logging
import math
import threading
import time
from collections.abc import Callable, Collection, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from .. import nvml_device as nv
from .. import procstat
from ..abandonable import Unresponsive, proc_reads
from ..collect import Absent, Collector, Context, Pending, StaleData, register
from ..exposition import COUNTER, GAUGE, INFO, Desc, Family, label_string
from ..logsetup import LogOnce, fields
from ..nvml_device import Nvml, NVMLError, error_code, error_name
from ..options import Option, parse_count, parse_seconds
from ..pods import cgroup
from ..sampler import PeriodicSampler, Snapshot

log = logging.getLogger("gpuio.collector.nvml")
T = TypeVar("T")

MAX_SAMPLE_PERIOD_US = 1_100_000  # NVML samples utilisation every 1/6 s to 1 s, by product (+10 % jitter)
MIB = 1024 * 1024
XID_WAIT_MS = 500
GPM_REBASE = 600.0  # seconds a GPM baseline serves before the next one (see Gpm)
MAX_XID_CODES = 64

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
PERCENT = 0.01  # GPM percent -> ratio: a counter of seconds
MIB_PER_SECOND = MIB  # GPM MiB/s -> a counter of bytes
MAX_PROCESS_HOLD_S = 20.0  # longest gap one per-process sample is held over (a stalled sweep counts no more)


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

Reading = tuple[Desc, str, float]
MemoryDescs = tuple[Desc, "Desc | None", Desc, Desc]  # total, reserved, free, used
MEMORY_DESCS: MemoryDescs = (MEMORY_TOTAL, MEMORY_RESERVED, MEMORY_FREE, MEMORY_USED)
MIG_MEMORY_DESCS: MemoryDescs = (MIG_MEMORY_TOTAL, None, MIG_MEMORY_FREE, MIG_MEMORY_USED)  # v2's reserved: GPU-wide


class NvmlHung(StaleData):
    """An NVML call has not returned within the hang timeout: the collector fails, the last snapshot is served."""


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


@dataclass
class Session:
    """One nvmlInit .. nvmlShutdown: the GPUs it enumerated and the Xid listener on its event set."""

    count: int
    driver_version: str
    cuda_version: str
    gpus: list[Gpu] = field(default_factory=list)
    missing: list[int] = field(default_factory=list)  # indexes whose handle NVML refused (lost at start)
    event_set: Any = None
    listener: XidListener | None = None


class XidListener:
    """Blocks in nvmlEventSetWait on its own thread and counts Xid events per GPU and code.

    Why a thread: the wait is the only way to see every event as it happens (the set queues them); it
    returns NVMLError_Timeout every XID_WAIT_MS when idle, which is how it notices ``stop()``.
    """

    def __init__(self, nvml: Nvml, event_set: Any, by_key: dict[Hashable, Gpu], lock: threading.Lock,
                 wait_ms: int = XID_WAIT_MS) -> None:
        self._nvml = nvml
        self.wait_ms = wait_ms
        self._set = event_set
        self._by_key = by_key
        self._lock = lock
        self._stop = threading.Event()
        self._once = LogOnce(log)
        self.waiting_since: float | None = None
        self._thread = threading.Thread(target=self._run, name="gpuio-nvml-xid", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float) -> bool:
        """Ask the thread to end; True when it did within ``timeout`` (False: stuck inside NVML)."""
        self._stop.set()
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.waiting_since = time.monotonic()
            try:
                event = self._nvml.event_set_wait(self._set, self.wait_ms)
            except NVMLError as exc:
                if error_code(exc) != nv.ERROR_TIMEOUT:
                    self._once.warning("waiting for Xid events failed", error_name(exc))
                    self._stop.wait(1.0)  # a lost GPU can fail every wait at once: do not spin
                continue
            finally:
                self.waiting_since = None
            self._record(event.device, event.event_type, event.data)

    def _record(self, device: Hashable, event_type: int, code: int) -> None:
        gpu = self._by_key.get(device)
        if gpu is None or not event_type & nv.EVENT_TYPE_XID_CRITICAL_ERROR:
            return
        key = str(code)
        with self._lock:
            if key not in gpu.xid and len(gpu.xid) >= MAX_XID_CODES:
                key = "other"
            count, _ = gpu.xid.get(key, (0, 0.0))
            gpu.xid[key] = (count + 1, time.time())
        log.warning("Xid event", extra=fields(gpu=gpu.index, uuid=gpu.uuid, xid=code))


DURATION = "a duration above zero such as 500ms, 2s, 5m"


@register
class NvmlCollector(Collector):
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

    xid_wait_ms = XID_WAIT_MS  # how long each nvmlEventSetWait blocks; a re-init waits up to this long

    def __init__(self, context: Context, options: dict[str, Any], nvml: Nvml | None = None) -> None:
        super().__init__(context, options)
        self._nvml = nvml
        self._interval: float = self.settings["interval"]
        self._slow_interval: float = self.settings["slow-interval"]
        self._hang_timeout: float = self.settings["hang-timeout"]
        self._reinit_interval: float = self.settings["reinit-interval"]
        self._max_processes: int = self.settings["max-processes"]
        # A GPU process's start time, read where the wait can be abandoned (abandonable.proc_reads): a process
        # stuck in execve reads as start 0 ("not read") for a minute, and the sweep goes on.
        self._proc = proc_reads("nvml-proc")
        self._gpus: dict[str, Gpu] = {}
        self._session: Session | None = None
        self._retry_at = 0.0  # when to try nvmlInit again while there is no session
        self._reinit_at: float | None = None  # when to re-initialise a session with a lost GPU
        self._next_slow = 0.0
        self._lock = threading.Lock()  # one sweep at a time; stop() waits for it
        self._xid_lock = threading.Lock()
        self._sweep_started: float | None = None
        self._current_call = ""
        self._once = LogOnce(log)
        self._absent: str | None = None  # why there are no GPUs here (no driver, none found); None: some
        self._stopped = False
        self.sampler: PeriodicSampler[list[Family]] = PeriodicSampler("nvml", self._interval, self.sweep, log)

    # -- the scrape path: no NVML here --

    def start(self) -> None:
        self.sampler.start()

    def stop(self) -> None:
        self.sampler.stop()
        self._stopped = True  # a sweep already past the sampler's stop check must not open a new session
        if self._lock.acquire(timeout=self.xid_wait_ms / 1000 + 1.0):  # a hung sweep keeps its session
            try:
                self._close()
            finally:
                self._lock.release()

    def collect(self) -> list[Family]:
        snapshot = self.sampler.snapshot()
        served = self._served(snapshot)
        hung = self.hung(time.monotonic())
        if hung is not None:
            self._once.warning("NVML hung: the nvml collector fails until the call returns", self._current_call)
            raise NvmlHung(hung, served)
        if snapshot.error is not None:
            raise StaleData(f"the last NVML sweep failed: {snapshot.error}", served)
        if self._absent is not None:
            raise Absent(self._absent, served)  # a CPU node: no failure, logged once by the scraper
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
            return f"an NVML sweep has been running for {now - started:.1f}s (in {self._current_call or 'nvml'})"
        session = self._session
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
                self._manage_session(now)
                session = self._session
                if session is not None:
                    slow = now >= self._next_slow
                    if slow:
                        self._next_slow = now + self._slow_interval
                    for gpu in session.gpus:
                        self._read(gpu, slow)
                    if slow:
                        self.context.gpu_processes.update_sweep(
                            (((pid, start), gpu.uuid, gpu.used.get(pid)) for gpu in session.gpus
                             if gpu.up for pid, start in gpu.started.items()), self._cuda_order(session))
                        self.context.pods.set_mig_parents(
                            {mig: gpu.uuid for gpu in session.gpus if gpu.up for mig in gpu.mig_uuids})
                return self._render()
            finally:
                self._sweep_started = None
                self._current_call = ""

    @staticmethod
    def _cuda_order(session: Session) -> tuple[str, ...]:
        """Every GPU's UUID in NVML index order, what a process's CUDA ordinals are mapped onto
        (exporter.engines.placement: CUDA enumerates in PCI bus order, as NVML does, on a node of one GPU
        model); () where CUDA's order cannot be told from NVML's: an index whose handle NVML refused (is it
        among CUDA's devices?), or a GPU in MIG mode (CUDA enumerates its MIG devices instead)."""
        if session.missing or any(gpu.mig_uuids for gpu in session.gpus):
            return ()
        return tuple(gpu.uuid for gpu in sorted(session.gpus, key=lambda gpu: gpu.index))

    def _manage_session(self, now: float) -> None:
        if self._session is None:
            if now >= self._retry_at:
                self._open(now)
        elif self._reinit_at is not None and now >= self._reinit_at:
            log.info("re-initialising NVML", extra=fields(
                down=",".join(g.uuid for g in self._gpus.values() if not g.up) or "-"))
            self._close()
            self._open(now)

    def _open(self, now: float) -> None:
        self._reinit_at = None
        try:
            if self._nvml is None:
                self._nvml = nv.PyNvml()
            self._current_call = "init"
            self._nvml.init()
            session = self._start_session(self._nvml)
        except NVMLError as exc:
            self._no_nvml(exc)
            self._retry_at = now + self._reinit_interval
            return
        self._session = session
        self._absent = "NVML found no GPU" if session.count == 0 and not self._gpus else None
        self._next_slow = now
        self._start_listener(session)
        log.info("NVML session open", extra=fields(gpus=session.count, driver=session.driver_version))

    def _no_nvml(self, exc: Exception) -> None:
        if self._gpus:  # the driver went away under GPUs we had: they stay listed, up 0
            self._once.warning("NVML unavailable: GPUs reported down", error_name(exc))
        elif error_code(exc) in (nv.ERROR_LIBRARY_NOT_FOUND, nv.ERROR_DRIVER_NOT_LOADED):
            self._absent = f"NVML not available: no GPUs here ({error_name(exc)}: no NVIDIA driver or library)"
        else:
            self._once.warning("nvmlInit failed", error_name(exc))

    def _start_session(self, nvml: Nvml) -> Session:
        self._current_call = "device_count"
        try:
            count = nvml.device_count()
            driver = nvml.system_driver_version()
        except NVMLError:
            _quietly(nvml.shutdown)
            raise
        cuda = _try(nvml.system_cuda_driver_version)
        session = Session(count, driver, "" if cuda is None else f"{cuda // 1000}.{cuda % 1000 // 10}")
        for index in range(count):
            self._discover(nvml, session, index)
        return session

    def _discover(self, nvml: Nvml, session: Session, index: int) -> None:
        self._current_call = "device_handle_by_index"
        try:
            handle = nvml.device_handle_by_index(index)
            uuid = nvml.device_uuid(handle)
        except NVMLError as exc:
            log.warning("GPU not usable", extra=fields(gpu=index, err=error_name(exc)))
            if not any(g.index == index for g in self._gpus.values()):
                session.missing.append(index)
            if error_code(exc) in nv.LOST:
                self._schedule_reinit()
            return
        gpu = self._gpus.get(uuid) or Gpu(uuid, index)
        self._gpus[uuid] = gpu
        gpu.attach(index, handle)
        session.gpus.append(gpu)
        self._read_identity(nvml, session, gpu)
        gpu.static = self._scalars(gpu, STATIC)
        gpu.gpm = self._open_gpm(gpu)
        gpu.static.append((GPM_SUPPORTED, gpu.labels, 0 if gpu.gpm is None else 1))
        gpu.gpm_metrics = GPM_METRICS + self._nvlink_metrics(gpu) if gpu.gpm is not None else ()
        gpu.process_busy.limit = 4 * self._max_processes

    def _read_identity(self, nvml: Nvml, session: Session, gpu: Gpu) -> None:
        handle = gpu.handle
        minor = self._call(gpu, "minor_number", nvml.device_minor_number, handle)
        gpu.info_labels = label_string({
            "gpu": str(gpu.index), "uuid": gpu.uuid,
            "name": self._call(gpu, "name", nvml.device_name, handle) or "",
            "pci_bus_id": self._call(gpu, "pci_bus_id", nvml.device_pci_bus_id, handle) or "",
            "serial": self._call(gpu, "serial", nvml.device_serial, handle) or "",
            "minor_number": "" if minor is None else str(minor),
            "driver_version": session.driver_version, "cuda_version": session.cuda_version,
        })
        supported = self._call(gpu, "supported_clocks_event_reasons", nvml.device_supported_clocks_event_reasons,
                               handle)
        gpu.reasons_supported = 0x1FF if supported is None else supported

    def _open_gpm(self, gpu: Gpu) -> Gpm | None:
        nvml = self._nvml
        assert nvml is not None
        if not self._call(gpu, "gpm_query_device_support", nvml.gpm_query_device_support, gpu.handle):
            return None
        return self._gpm_buffers(gpu)

    def _gpm_buffers(self, gpu: Gpu) -> Gpm | None:
        nvml = self._nvml
        assert nvml is not None
        buffers = [self._call(gpu, "gpm_sample_alloc", nvml.gpm_sample_alloc) for _ in range(3)]
        if any(buffer is None for buffer in buffers):
            for buffer in buffers:
                if buffer is not None:
                    _quietly(nvml.gpm_sample_free, buffer)
            return None
        return Gpm((buffers[0], buffers[1], buffers[2]))

    def _nvlink_metrics(self, gpu: Gpu) -> tuple[GpmMetric, ...]:
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

    def _start_listener(self, session: Session) -> None:
        nvml = self._nvml
        assert nvml is not None
        if not session.gpus:
            return
        try:
            session.event_set = nvml.event_set_create()
        except NVMLError as exc:
            self._once.warning("no Xid events: nvmlEventSetCreate failed", error_name(exc))
            return
        by_key: dict[Hashable, Gpu] = {}
        for gpu in session.gpus:
            registered = self._call(gpu, "register_xid_events", _returns_true(nvml.device_register_events),
                                    gpu.handle, nv.EVENT_TYPE_XID_CRITICAL_ERROR, session.event_set)
            if registered:
                by_key[nvml.handle_key(gpu.handle)] = gpu
        session.listener = XidListener(nvml, session.event_set, by_key, self._xid_lock, self.xid_wait_ms)
        session.listener.start()

    def _close(self) -> None:
        session, self._session = self._session, None
        if session is None or self._nvml is None:
            return
        nvml = self._nvml
        if session.listener is not None and not session.listener.stop(self.xid_wait_ms / 1000 + 1.0):
            # Shutting NVML down under a thread still inside it is asking for a crash; leave it be.
            log.warning("Xid listener stuck in NVML: NVML is not shut down before re-initialising")
            self._detach(session)
            return
        if session.event_set is not None:
            _quietly(nvml.event_set_free, session.event_set)
        for gpu in session.gpus:
            for gpm in ([gpu.gpm] if gpu.gpm else []) + list(gpu.mig_gpm.values()):
                for buffer in gpm.buffers:
                    _quietly(nvml.gpm_sample_free, buffer)
        self._detach(session)
        _quietly(nvml.shutdown)

    @staticmethod
    def _detach(session: Session) -> None:
        for gpu in session.gpus:
            gpu.handle, gpu.up, gpu.gpm, gpu.mig_gpm = None, False, None, {}

    def _schedule_reinit(self) -> None:
        if self._reinit_at is None:
            self._reinit_at = time.monotonic() + self._reinit_interval

    # -- calls and what their errors mean --

    def _call(self, gpu: Gpu, call: str, function: Callable[..., T], *args: Any) -> T | None:
        """``function(*args)``, or None when the GPU is down, the call unsupported here, or it failed."""
        if not gpu.up or call in gpu.unsupported:
            return None
        self._current_call = call
        try:
            return function(*args)
        except NVMLError as exc:
            self._failed(gpu, call, exc)
            return None

    def _failed(self, gpu: Gpu, call: str, exc: Exception) -> None:
        code = error_code(exc)
        if code in nv.UNSUPPORTED:
            gpu.unsupported.add(call)  # until the next session: the driver will not change its mind
        elif code in nv.LOST:
            if gpu.up:
                log.warning("GPU lost", extra=fields(gpu=gpu.index, uuid=gpu.uuid, call=call, err=error_name(exc)))
            gpu.up = False
            self._schedule_reinit()
        elif code in nv.SESSION:
            log.warning("NVML session broken", extra=fields(call=call, err=error_name(exc)))
            for other in self._gpus.values():
                other.up = False
            self._schedule_reinit()
        else:
            self._count_failure(gpu, call, exc)

    def _count_failure(self, gpu: Gpu, call: str, exc: Exception) -> None:
        """A failed reading: counted in gpuio_gpu_nvml_errors_total, logged once, retried next time."""
        key = (call, error_name(exc))
        gpu.errors[key] = gpu.errors.get(key, 0) + 1
        self._once.warning("NVML call failed", f"{call}: {key[1]}", gpu=gpu.index, uuid=gpu.uuid)

    def _scalars(self, gpu: Gpu, catalog: tuple[Scalar, ...]) -> list[Reading]:
        assert self._nvml is not None
        readings: list[Reading] = []
        for scalar in catalog:
            value = self._call(gpu, scalar.call, getattr(self._nvml, scalar.method), gpu.handle, *scalar.args)
            if value is not None:
                scaled = value if scalar.scale is None else value * scalar.scale
                readings.append((scalar.desc, gpu.label(scalar.labels), scaled))
        return readings

    # -- reading one GPU --

    def _read(self, gpu: Gpu, slow: bool) -> None:
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
        readings += self._read_gpm(gpu)
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
        self._current_call = "samples"
        try:
            samples = self._nvml.device_samples(gpu.handle, nv.GPU_UTILIZATION_SAMPLES, gpu.busy.last_seen_us or 0)
        except NVMLError as exc:
            if error_code(exc) != nv.ERROR_NOT_FOUND:  # NotFound: no sample newer than the last one seen
                self._failed(gpu, "samples", exc)
                return []
            samples = []
        gpu.busy.feed(samples)
        return [(BUSY, gpu.labels, gpu.busy.seconds)]

    def _read_rates(self, gpu: Gpu) -> list[Reading]:
        assert self._nvml is not None
        rates = self._call(gpu, "utilization_rates", self._nvml.device_utilization_rates, gpu.handle)
        if rates is None:
            return []
        return [(UTILIZATION, gpu.labels, rates[0] / 100), (MEMORY_UTILIZATION, gpu.labels, rates[1] / 100)]

    def _read_memory(self, gpu: Gpu, handle: Any, labels: str, descs: MemoryDescs, prefix: str) -> list[Reading]:
        """total/reserved/free/used from nvmlDeviceGetMemoryInfo_v2, or total/free/used on a driver without it."""
        assert self._nvml is not None
        total, reserved, free, used = descs
        v2 = self._call(gpu, prefix + "memory_info_v2", self._nvml.device_memory_info_v2, handle)
        if v2 is not None:
            readings: list[Reading] = [(total, labels, v2[0]), (free, labels, v2[2]), (used, labels, v2[3])]
            return readings if reserved is None else [*readings, (reserved, labels, v2[1])]
        v1 = self._call(gpu, prefix + "memory_info", self._nvml.device_memory_info, handle)
        if v1 is None:
            return []
        return [(total, labels, v1[0]), (free, labels, v1[1]), (used, labels, v1[2])]

    def _read_memory_temperature(self, gpu: Gpu) -> list[Reading]:
        values = self._fields(gpu, "memory_temperature", (FIELD_MEMORY_TEMPERATURE,))
        value = values.get(FIELD_MEMORY_TEMPERATURE)
        return [] if value is None else [(MEMORY_TEMPERATURE, gpu.labels, value)]

    def _read_reasons(self, gpu: Gpu) -> list[Reading]:
        assert self._nvml is not None
        mask = self._call(gpu, "clocks_event_reasons", self._nvml.device_current_clocks_event_reasons, gpu.handle)
        if mask is None and "clocks_event_reasons" in gpu.unsupported:  # driver < 535 names it "throttle"
            mask = self._call(gpu, "clocks_throttle_reasons", self._nvml.device_current_clocks_throttle_reasons,
                              gpu.handle)
        if mask is None:
            return []
        return [(REASON, gpu.label((("reason", name),)), 1 if mask & bit else 0)
                for bit, name in EVENT_REASONS if gpu.reasons_supported & bit]

    def _read_gpm(self, gpu: Gpu) -> list[Reading]:
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
            if self._call(gpu, sample_call, sample_get, *where, first) is not None:
                for metric in metrics:  # served from the first sample on: rate() misses nothing of the first step
                    totals.setdefault(metric.metric, 0.0)
                gpm.baseline = gpm.previous = first
                gpm.since = gpm.previous_at = now
                gpm.carry = dict(totals)
            return
        due = [m for m in metrics if f"{prefix}gpm_metric_{m.metric}" not in gpu.unsupported]
        sample = gpm.spare()
        if not due or self._call(gpu, sample_call, sample_get, *where, sample) is None:
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
        values = self._call(gpu, "gpm_metrics_get", self._nvml.gpm_metrics_get, first, second,
                            [m.metric for m in metrics])
        if values is None:
            return None
        found: list[tuple[GpmMetric, float]] = []
        for metric in metrics:
            value = values.get(metric.metric)
            if isinstance(value, Exception):
                self._failed(gpu, f"{prefix}gpm_metric_{metric.metric}", value)
                if f"{prefix}gpm_metric_{metric.metric}" in gpu.unsupported:  # this GPU lacks it: absent
                    totals.pop(metric.metric, None)
            elif value is not None:
                found.append((metric, value))
        return found

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
        self._current_call = "process_utilization"
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
                self._count_failure(gpu, "process_utilization", exc)
            else:
                self._failed(gpu, "process_utilization", exc)
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
        values = self._call(gpu, call, self._nvml.device_field_values, gpu.handle, wanted) if wanted else None
        result: dict[int, int | float] = {}
        for field_id, value in (values or {}).items():
            if isinstance(value, Exception):
                self._failed(gpu, f"field_{field_id}", value)
            else:
                result[field_id] = value
        return result

    def _read_violations(self, gpu: Gpu) -> list[Reading]:
        values = self._fields(gpu, "violation_fields", tuple(f for f, _ in VIOLATION_FIELDS))
        return [(VIOLATION, gpu.label((("reason", reason),)), values[f] / 1e9)
                for f, reason in VIOLATION_FIELDS if f in values]

    def _read_remapped_rows(self, gpu: Gpu) -> list[Reading]:
        assert self._nvml is not None
        rows = self._call(gpu, "remapped_rows", self._nvml.device_remapped_rows, gpu.handle)
        if rows is None:
            return []
        correctable, uncorrectable, pending, failure = rows
        return [(REMAPPED, gpu.label((("cause", "correctable"),)), correctable),
                (REMAPPED, gpu.label((("cause", "uncorrectable"),)), uncorrectable),
                (REMAP_PENDING, gpu.labels, 1 if pending else 0), (REMAP_FAILURE, gpu.labels, 1 if failure else 0)]

    def _start_ticks(self, pid: int) -> int:
        try:
            return self._proc.call(pid, functools.partial(procstat.start_ticks, pid, self.context.procfs))
        except Unresponsive:
            return 0

    def _read_processes(self, gpu: Gpu) -> list[Reading]:
        assert self._nvml is not None
        processes = self._call(gpu, "compute_running_processes", self._nvml.device_compute_running_processes,
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
        gpu.pods = {p.pid: gpu.pods[p.pid] if p.pid in gpu.pods else cgroup.of_pid(p.pid, self.context.procfs,
                                                                                   sysfs=self.context.sysfs)
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
        named = self.context.pods.of_process(ref.pod_uid, gpu.uuid)
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
        mode = self._call(gpu, "mig_mode", self._nvml.device_mig_mode, gpu.handle)
        if mode is None:
            return []
        readings: list[Reading] = [(MIG_ENABLED, gpu.labels, 1 if mode[0] else 0)]
        if not mode[0]:
            return readings
        count = self._call(gpu, "max_mig_device_count", self._nvml.device_max_mig_device_count, gpu.handle) or 0
        instances: set[int] = set()
        for index in range(count):
            self._current_call = "mig_device_handle_by_index"
            try:
                handle = self._nvml.device_mig_device_handle_by_index(gpu.handle, index)
            except NVMLError as exc:
                if error_code(exc) == nv.ERROR_NOT_FOUND:  # an empty slot
                    continue
                self._failed(gpu, "mig_device_handle_by_index", exc)
                break
            readings += self._read_mig_device(gpu, handle, instances)
        return readings + self._read_mig_gpm(gpu, instances)

    def _read_mig_gpm(self, gpu: Gpu, instances: set[int]) -> list[Reading]:
        """GPM per MIG GPU instance (nvmlGpmMigSampleGet on the parent GPU), on the GPUs that have GPM."""
        nvml = self._nvml
        assert nvml is not None
        for gone in set(gpu.mig_gpm) - instances:  # an instance destroyed: its buffers go with it
            for buffer in gpu.mig_gpm.pop(gone).buffers:
                _quietly(nvml.gpm_sample_free, buffer)
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

    def _read_mig_device(self, gpu: Gpu, handle: Any, instances: set[int]) -> list[Reading]:
        assert self._nvml is not None
        nvml = self._nvml
        mig_uuid = self._call(gpu, "mig_uuid", nvml.device_uuid, handle)
        if mig_uuid is None:
            return []
        gpu.mig_uuids.add(mig_uuid)
        gpu_instance = self._call(gpu, "mig_gpu_instance_id", nvml.device_gpu_instance_id, handle)
        if gpu_instance is not None:
            instances.add(gpu_instance)
        compute_instance = self._call(gpu, "mig_compute_instance_id", nvml.device_compute_instance_id, handle)
        info = gpu.label((("mig_uuid", mig_uuid),
                          ("gpu_instance", "" if gpu_instance is None else str(gpu_instance)),
                          ("compute_instance", "" if compute_instance is None else str(compute_instance)),
                          ("name", self._call(gpu, "mig_name", nvml.device_name, handle) or "")))
        memory = self._read_memory(gpu, handle, gpu.label((("mig_uuid", mig_uuid),)), MIG_MEMORY_DESCS, "mig_")
        return [(MIG_INFO, info, 1), *memory]

    # -- rendering, once per sweep --

    def _render(self) -> list[Family]:
        lines: dict[Desc, list[str]] = {desc: [] for desc in DESCS}
        session = self._session
        if session is not None:
            lines[COUNT].append(COUNT.sample("", session.count))
            for index in session.missing:
                lines[UP].append(UP.sample(label_string({"gpu": str(index), "uuid": ""}), 0))
        with self._xid_lock:
            for gpu in sorted(self._gpus.values(), key=lambda g: (g.index, g.uuid)):
                self._render_gpu(gpu, lines)
        return [Family(desc, samples) for desc, samples in lines.items() if samples]

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


def _quietly(function: Callable[..., Any], *args: Any) -> None:
    """Tear-down calls: a GPU already lost or a session already gone must not stop the rest."""
    try:
        function(*args)
    except NVMLError as exc:
        log.debug("NVML tear-down call failed", extra=fields(call=function.__name__, err=error_name(exc)))


def _try(function: Callable[[], T]) -> T | None:
    try:
        return function()
    except NVMLError:
        return None


def _returns_true(function: Callable[..., Any]) -> Callable[..., bool]:
    """Calls whose success has no value (nvmlDeviceRegisterEvents) answer True, so None means failure."""

    def call(*args: Any) -> bool:
        function(*args)
        return True

    return call
