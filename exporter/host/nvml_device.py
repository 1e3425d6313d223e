"""The narrow hardware interface of the nvml collector (issue 3), and its real implementation on pynvml.

Why an interface: CI machines and laptops have no GPU, so the collector's logic (units, lost GPUs,
old drivers, MIG, Xid, the busy-time integral) is tested against a fake that implements :class:`Nvml`
and follows NVML's documented and measured behaviour (tests/unit/test_nvml_fake.py).  On a GPU machine
the same collector runs on :class:`PyNvml` (tests/gpu/).

The interface is one method per NVML function the collector calls, named after it
(``nvmlDeviceGetPowerUsage`` is ``device_power_usage``).  Methods return NVML's raw units (milliwatts,
millijoules, MHz, nanoseconds) and raise NVML's own exceptions (``pynvml.NVMLError`` subclasses), so
that every decision — which unit, which fallback on an old driver, which error means "absent" and which
"GPU lost" — lives in the collector, where the fake can exercise it.  :class:`PyNvml` only converts
ctypes structures to plain values.

CPU per call measured on an H100, driver 580 (bench/nvml_bench.py prints these): most getters 2-20 us
(utilisation rates ~75 us, the memory clock ~60 us); nvmlDeviceGetSamples ~2.7 ms whatever it returns;
GPM sample + PCIe metrics ~0.07 ms; the five violation fields ~0.9 ms; total energy ~4 ms; the PCIe
replay counter ~0.25 ms; nvmlInit ~11 ms.
"""

from __future__ import annotations

import ctypes
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

# Return codes from nvml.h (a stable ABI), so that classification works without the bindings.
SUCCESS = 0
ERROR_UNINITIALIZED = 1
ERROR_INVALID_ARGUMENT = 2
ERROR_NOT_SUPPORTED = 3
ERROR_NO_PERMISSION = 4
ERROR_NOT_FOUND = 6
ERROR_INSUFFICIENT_SIZE = 7
ERROR_DRIVER_NOT_LOADED = 9
ERROR_TIMEOUT = 10
ERROR_LIBRARY_NOT_FOUND = 12
ERROR_FUNCTION_NOT_FOUND = 13
ERROR_GPU_IS_LOST = 15
ERROR_RESET_REQUIRED = 16
ERROR_LIB_RM_VERSION_MISMATCH = 18
ERROR_NO_DATA = 21
ERROR_ARGUMENT_VERSION_MISMATCH = 25
ERROR_UNKNOWN = 999

# What an error means for the series behind the call (the collector acts on these).
UNSUPPORTED = frozenset({ERROR_NOT_SUPPORTED, ERROR_FUNCTION_NOT_FOUND, ERROR_INVALID_ARGUMENT, ERROR_NOT_FOUND,
                         ERROR_NO_PERMISSION, ERROR_NO_DATA, ERROR_ARGUMENT_VERSION_MISMATCH})  # series absent
LOST = frozenset({ERROR_GPU_IS_LOST, ERROR_UNKNOWN, ERROR_RESET_REQUIRED})  # this GPU is down
SESSION = frozenset({ERROR_UNINITIALIZED, ERROR_DRIVER_NOT_LOADED, ERROR_LIB_RM_VERSION_MISMATCH,
                     ERROR_LIBRARY_NOT_FOUND})  # every GPU is down until NVML is initialised again
# Anything else (Timeout, IrqIssue, ...) is a failed reading: absent this time, retried next time.

# Enumerations from nvml.h used by the collector.
CLOCK_SM = 1
CLOCK_MEM = 2
TEMPERATURE_GPU = 0
MEMORY_ERROR_CORRECTED = 0
MEMORY_ERROR_UNCORRECTED = 1
VOLATILE_ECC = 0
AGGREGATE_ECC = 1
GPU_UTILIZATION_SAMPLES = 1
EVENT_TYPE_XID_CRITICAL_ERROR = 0x8
# NVML_GPM_METRIC_* (nvml.h): each one NVML averages between two GPM samples, in percent 0-100 or MiB/s.
GPM_METRIC_SM_UTIL = 2  # percent of SMs busy (an SM is busy while at least one warp is resident on it)
GPM_METRIC_SM_OCCUPANCY = 3  # percent of the warps an SM can hold that are resident
GPM_METRIC_ANY_TENSOR_UTIL = 5  # percent of time the SMs' tensor pipes did any work
GPM_METRIC_DFMA_TENSOR_UTIL = 6
GPM_METRIC_HMMA_TENSOR_UTIL = 7
GPM_METRIC_IMMA_TENSOR_UTIL = 9
GPM_METRIC_DRAM_BW_UTIL = 10  # percent of the theoretical peak DRAM bandwidth used
GPM_METRIC_FP64_UTIL = 11  # non-tensor FP64 math
GPM_METRIC_FP32_UTIL = 12
GPM_METRIC_FP16_UTIL = 13
GPM_METRIC_PCIE_TX_PER_SEC = 20  # MiB/s
GPM_METRIC_PCIE_RX_PER_SEC = 21
GPM_METRIC_NVDEC_0_UTIL = 30  # .. 37: NVDEC 0-7, percent
GPM_METRIC_NVJPG_0_UTIL = 40  # .. 47: NVJPG 0-7
GPM_METRIC_NVOFA_0_UTIL = 50  # .. 51: NVOFA 0-1
GPM_METRIC_NVLINK_TOTAL_RX_PER_SEC = 60  # MiB/s over all links
GPM_METRIC_NVLINK_TOTAL_TX_PER_SEC = 61
GPM_METRIC_NVLINK_L0_RX_PER_SEC = 62  # link N: rx 62 + 2N, tx 63 + 2N, N = 0..17
NVLINK_LINKS = 18
VALUE_TYPE_DOUBLE = 0
VALUE_TYPE_UNSIGNED_INT = 1
VALUE_TYPE_UNSIGNED_LONG = 2
VALUE_TYPE_UNSIGNED_LONG_LONG = 3
VALUE_TYPE_SIGNED_LONG_LONG = 4
VALUE_TYPE_SIGNED_INT = 5
VALUE_TYPE_UNSIGNED_SHORT = 6

class NVMLError(Exception):
    """What every NVML failure raises: once the bindings are loaded, pynvml's own ``NVMLError`` is made a
    subclass of this one (see :func:`bindings`), so ``except NVMLError`` catches what they raise."""

    __slots__ = ()  # no layout of its own: pynvml's class can take it as its base
    value = ERROR_LIBRARY_NOT_FOUND


_pynvml: Any = None


def bindings() -> Any:
    """nvidia-ml-py's ``pynvml`` module, imported on first use (None where it is not installed).

    Not at import: the module costs ~3 MiB of RSS, and this module is imported (the nvml collector
    registers its flags) also where the collector is off."""
    global _pynvml
    if _pynvml is None:
        try:  # nvidia-ml-py: NVIDIA's bindings (the deprecated `pynvml` distribution only pulls it in)
            import pynvml
        except ImportError:  # no bindings: the collector treats it as "no GPUs here"
            return None
        if not issubclass(pynvml.NVMLError, NVMLError):
            pynvml.NVMLError.__bases__ = (NVMLError,)
        _pynvml = pynvml
    return _pynvml


def nvml_error(code: int) -> Exception:
    """NVML's exception for a return code (``NVMLError_GpuIsLost`` for 15), as pynvml raises it."""
    pynvml = bindings()
    if pynvml is None:
        error = NVMLError()
        error.value = code  # type: ignore[misc]
        return error
    return pynvml.NVMLError(code)  # type: ignore[no-any-return]


def error_code(exc: BaseException) -> int:
    return int(getattr(exc, "value", ERROR_UNKNOWN))


def error_name(exc: BaseException) -> str:
    """``GpuIsLost`` for NVMLError_GpuIsLost: a short, bounded label value."""
    name = type(exc).__name__
    return name.split("_", 1)[1] if name.startswith("NVMLError_") else f"Code{error_code(exc)}"


@dataclass(frozen=True)
class ProcessInfo:
    pid: int
    used_memory: int | None  # bytes; None where NVML cannot say (MIG without privileges, WDDM)


@dataclass(frozen=True)
class ProcessUtilization:
    """One process's utilisation over the period since the ``last_seen_us`` asked for (percent)."""

    pid: int
    timestamp_us: int  # the newest sample it covers, microseconds since the epoch
    sm: int  # percent of the period in which a kernel of this process ran
    memory: int  # percent of the period in which this process read or wrote device memory


@dataclass(frozen=True)
class Event:
    device: Hashable  # :meth:`Nvml.handle_key` of the device that raised it
    event_type: int
    data: int  # the Xid code for EVENT_TYPE_XID_CRITICAL_ERROR


class Nvml(Protocol):
    """The NVML functions the collector uses; see the module docstring for the conventions."""

    def init(self) -> None: ...
    def shutdown(self) -> None: ...
    def system_driver_version(self) -> str: ...
    def system_cuda_driver_version(self) -> int: ...  # 13000 is CUDA 13.0
    def system_process_name(self, pid: int) -> str: ...
    def device_count(self) -> int: ...
    def device_handle_by_index(self, index: int) -> Any: ...
    def handle_key(self, handle: Any) -> Hashable: ...  # equal for two handles of one device

    # identity and limits, read once per NVML session
    def device_uuid(self, handle: Any) -> str: ...
    def device_name(self, handle: Any) -> str: ...
    def device_pci_bus_id(self, handle: Any) -> str: ...
    def device_serial(self, handle: Any) -> str: ...
    def device_minor_number(self, handle: Any) -> int: ...
    def device_max_clock_info(self, handle: Any, clock: int) -> int: ...  # MHz
    def device_max_pcie_link_generation(self, handle: Any) -> int: ...
    def device_max_pcie_link_width(self, handle: Any) -> int: ...
    def device_supported_clocks_event_reasons(self, handle: Any) -> int: ...  # bit mask
    def device_mig_mode(self, handle: Any) -> tuple[int, int]: ...  # current, pending
    def device_nvlink_state(self, handle: Any, link: int) -> bool: ...  # InvalidArgument past the last link

    # every interval
    def device_samples(self, handle: Any, sampling_type: int, last_seen_us: int) -> list[tuple[int, float]]:
        """``(timestamp us, value)`` newer than ``last_seen_us``; NVMLError_NotFound when there is none."""
        ...

    def device_utilization_rates(self, handle: Any) -> tuple[int, int]: ...  # percent: gpu, memory
    def device_memory_info_v2(self, handle: Any) -> tuple[int, int, int, int]: ...  # total, reserved, free, used
    def device_memory_info(self, handle: Any) -> tuple[int, int, int]: ...  # total, free, used (bytes)
    def device_temperature(self, handle: Any, sensor: int) -> int: ...  # celsius
    def device_power_usage(self, handle: Any) -> int: ...  # mW
    def device_enforced_power_limit(self, handle: Any) -> int: ...  # mW
    def device_clock_info(self, handle: Any, clock: int) -> int: ...  # MHz
    def device_curr_pcie_link_generation(self, handle: Any) -> int: ...
    def device_curr_pcie_link_width(self, handle: Any) -> int: ...
    def device_current_clocks_event_reasons(self, handle: Any) -> int: ...  # bit mask, driver >= 535
    def device_current_clocks_throttle_reasons(self, handle: Any) -> int: ...  # the same, older name
    def gpm_query_device_support(self, handle: Any) -> bool: ...  # Hopper and newer
    def gpm_sample_alloc(self) -> Any: ...
    def gpm_sample_free(self, sample: Any) -> None: ...
    def gpm_sample_get(self, handle: Any, sample: Any) -> Any: ...  # returns the sample, filled
    def gpm_mig_sample_get(self, handle: Any, gpu_instance: int, sample: Any) -> Any: ...  # one GPU instance
    def gpm_metrics_get(self, first: Any, second: Any, metrics: Sequence[int]) -> dict[int, float | Exception]:
        """Each metric averaged between two samples; a metric NVML refused maps to its exception."""
        ...

    # every slow interval
    def device_field_values(self, handle: Any, field_ids: Sequence[int]) -> dict[int, int | float | Exception]:
        """One value per field id, decoded by the value type NVML reports; a refused field maps to its exception."""
        ...

    def device_total_energy_consumption(self, handle: Any) -> int: ...  # mJ since the driver loaded
    def device_pcie_replay_counter(self, handle: Any) -> int: ...
    def device_total_ecc_errors(self, handle: Any, error_type: int, counter_type: int) -> int: ...
    def device_remapped_rows(self, handle: Any) -> tuple[int, int, int, int]: ...  # corr, unc, pending, failure
    def device_compute_running_processes(self, handle: Any) -> list[ProcessInfo]: ...
    def device_process_utilization(self, handle: Any, last_seen_us: int) -> list[ProcessUtilization]:
        """Per process, its utilisation since ``last_seen_us``; NVMLError_NotFound when no sample is newer."""
        ...

    def device_max_mig_device_count(self, handle: Any) -> int: ...
    def device_mig_device_handle_by_index(self, handle: Any, index: int) -> Any: ...  # NotFound: empty slot
    def device_gpu_instance_id(self, handle: Any) -> int: ...
    def device_compute_instance_id(self, handle: Any) -> int: ...

    # Xid events (a listener thread waits on the set)
    def event_set_create(self) -> Any: ...
    def device_register_events(self, handle: Any, event_types: int, event_set: Any) -> None: ...
    def event_set_wait(self, event_set: Any, timeout_ms: int) -> Event: ...  # NVMLError_Timeout when idle
    def event_set_free(self, event_set: Any) -> None: ...


def field_value(value: Any) -> int | float:
    """The number in a ``c_nvmlFieldValue_t`` (or ``c_nvmlSample_t``) union, by NVML's value type.

    Why by type: NVML reports 32-bit counters (the PCIe byte counters, fields 197/198, are 32-bit and
    wrap every 4 GiB) and 64-bit ones (energy) through the same union; reading the wrong member reads
    garbage or a truncated number.
    """
    kind, union = value
    if kind == VALUE_TYPE_DOUBLE:
        return float(union.dVal)
    member = {VALUE_TYPE_UNSIGNED_INT: "uiVal", VALUE_TYPE_UNSIGNED_LONG: "ulVal",
              VALUE_TYPE_UNSIGNED_LONG_LONG: "ullVal", VALUE_TYPE_SIGNED_LONG_LONG: "sllVal",
              VALUE_TYPE_SIGNED_INT: "siVal", VALUE_TYPE_UNSIGNED_SHORT: "usVal"}.get(kind, "ullVal")
    return int(getattr(union, member))


def decode_field_values(values: Any) -> dict[int, int | float | Exception]:
    """``nvmlDeviceGetFieldValues``' array as ``{field id: value or NVML's exception for that field}``."""
    decoded: dict[int, int | float | Exception] = {}
    for value in values:
        if value.nvmlReturn != SUCCESS:
            decoded[int(value.fieldId)] = nvml_error(int(value.nvmlReturn))
        else:
            decoded[int(value.fieldId)] = field_value((int(value.valueType), value.value))
    return decoded


def decode_samples(value_type: int, samples: Any) -> list[tuple[int, float]]:
    return [(int(sample.timeStamp), float(field_value((value_type, sample.sampleValue)))) for sample in samples]


class PyNvml:
    """:class:`Nvml` on NVIDIA's bindings: conversions only, no decisions (those are the collector's)."""

    def __init__(self) -> None:
        pynvml = bindings()
        if pynvml is None:
            raise nvml_error(ERROR_LIBRARY_NOT_FOUND)
        self._n = pynvml

    def init(self) -> None:
        self._n.nvmlInit()

    def shutdown(self) -> None:
        self._n.nvmlShutdown()

    def system_driver_version(self) -> str:
        return str(self._n.nvmlSystemGetDriverVersion())

    def system_cuda_driver_version(self) -> int:
        return int(self._n.nvmlSystemGetCudaDriverVersion())

    def system_process_name(self, pid: int) -> str:
        return str(self._n.nvmlSystemGetProcessName(pid))

    def device_count(self) -> int:
        return int(self._n.nvmlDeviceGetCount())

    def device_handle_by_index(self, index: int) -> Any:
        return self._n.nvmlDeviceGetHandleByIndex(index)

    def handle_key(self, handle: Any) -> Hashable:
        # Two handle objects of one device hold the same pointer (event data carries a fresh one).
        return ctypes.cast(handle, ctypes.c_void_p).value

    def device_uuid(self, handle: Any) -> str:
        return str(self._n.nvmlDeviceGetUUID(handle))

    def device_name(self, handle: Any) -> str:
        return str(self._n.nvmlDeviceGetName(handle))

    def device_pci_bus_id(self, handle: Any) -> str:
        bus_id = self._n.nvmlDeviceGetPciInfo(handle).busId
        return bus_id.decode() if isinstance(bus_id, bytes) else str(bus_id)

    def device_serial(self, handle: Any) -> str:
        return str(self._n.nvmlDeviceGetSerial(handle))

    def device_minor_number(self, handle: Any) -> int:
        return int(self._n.nvmlDeviceGetMinorNumber(handle))

    def device_max_clock_info(self, handle: Any, clock: int) -> int:
        return int(self._n.nvmlDeviceGetMaxClockInfo(handle, clock))

    def device_max_pcie_link_generation(self, handle: Any) -> int:
        return int(self._n.nvmlDeviceGetMaxPcieLinkGeneration(handle))

    def device_max_pcie_link_width(self, handle: Any) -> int:
        return int(self._n.nvmlDeviceGetMaxPcieLinkWidth(handle))

    def device_supported_clocks_event_reasons(self, handle: Any) -> int:
        return int(self._n.nvmlDeviceGetSupportedClocksEventReasons(handle))

    def device_mig_mode(self, handle: Any) -> tuple[int, int]:
        current, pending = self._n.nvmlDeviceGetMigMode(handle)
        return int(current), int(pending)

    def device_nvlink_state(self, handle: Any, link: int) -> bool:
        return bool(self._n.nvmlDeviceGetNvLinkState(handle, link))

    def device_samples(self, handle: Any, sampling_type: int, last_seen_us: int) -> list[tuple[int, float]]:
        value_type, samples = self._n.nvmlDeviceGetSamples(handle, sampling_type, last_seen_us)
        return decode_samples(int(value_type), samples)

    def device_utilization_rates(self, handle: Any) -> tuple[int, int]:
        rates = self._n.nvmlDeviceGetUtilizationRates(handle)
        return int(rates.gpu), int(rates.memory)

    def device_memory_info_v2(self, handle: Any) -> tuple[int, int, int, int]:
        info = self._n.nvmlDeviceGetMemoryInfo(handle, version=self._n.nvmlMemory_v2)
        return int(info.total), int(info.reserved), int(info.free), int(info.used)

    def device_memory_info(self, handle: Any) -> tuple[int, int, int]:
        info = self._n.nvmlDeviceGetMemoryInfo(handle)
        return int(info.total), int(info.free), int(info.used)

    def device_temperature(self, handle: Any, sensor: int) -> int:
        return int(self._n.nvmlDeviceGetTemperature(handle, sensor))

    def device_power_usage(self, handle: Any) -> int:
        return int(self._n.nvmlDeviceGetPowerUsage(handle))

    def device_enforced_power_limit(self, handle: Any) -> int:
        return int(self._n.nvmlDeviceGetEnforcedPowerLimit(handle))

    def device_clock_info(self, handle: Any, clock: int) -> int:
        return int(self._n.nvmlDeviceGetClockInfo(handle, clock))

    def device_curr_pcie_link_generation(self, handle: Any) -> int:
        return int(self._n.nvmlDeviceGetCurrPcieLinkGeneration(handle))

    def device_curr_pcie_link_width(self, handle: Any) -> int:
        return int(self._n.nvmlDeviceGetCurrPcieLinkWidth(handle))

    def device_current_clocks_event_reasons(self, handle: Any) -> int:
        return int(self._n.nvmlDeviceGetCurrentClocksEventReasons(handle))

    def device_current_clocks_throttle_reasons(self, handle: Any) -> int:
        return int(self._n.nvmlDeviceGetCurrentClocksThrottleReasons(handle))

    def gpm_query_device_support(self, handle: Any) -> bool:
        return bool(self._n.nvmlGpmQueryDeviceSupport(handle).isSupportedDevice)

    def gpm_sample_alloc(self) -> Any:
        return self._n.nvmlGpmSampleAlloc()

    def gpm_sample_free(self, sample: Any) -> None:
        self._n.nvmlGpmSampleFree(sample)

    def gpm_sample_get(self, handle: Any, sample: Any) -> Any:
        return self._n.nvmlGpmSampleGet(handle, sample)

    def gpm_mig_sample_get(self, handle: Any, gpu_instance: int, sample: Any) -> Any:
        return self._n.nvmlGpmMigSampleGet(handle, gpu_instance, sample)

    def gpm_metrics_get(self, first: Any, second: Any, metrics: Sequence[int]) -> dict[int, float | Exception]:
        request = self._n.c_nvmlGpmMetricsGet_t()
        request.version = self._n.NVML_GPM_METRICS_GET_VERSION
        request.numMetrics = len(metrics)
        request.sample1, request.sample2 = first, second
        for index, metric in enumerate(metrics):
            request.metrics[index].metricId = metric
        self._n.nvmlGpmMetricsGet(request)
        result: dict[int, float | Exception] = {}
        for index in range(len(metrics)):
            metric = request.metrics[index]
            ok = metric.nvmlReturn == SUCCESS
            result[int(metric.metricId)] = float(metric.value) if ok else nvml_error(int(metric.nvmlReturn))
        return result

    def device_field_values(self, handle: Any, field_ids: Sequence[int]) -> dict[int, int | float | Exception]:
        return decode_field_values(self._n.nvmlDeviceGetFieldValues(handle, list(field_ids)))

    def device_total_energy_consumption(self, handle: Any) -> int:
        return int(self._n.nvmlDeviceGetTotalEnergyConsumption(handle))

    def device_pcie_replay_counter(self, handle: Any) -> int:
        return int(self._n.nvmlDeviceGetPcieReplayCounter(handle))

    def device_total_ecc_errors(self, handle: Any, error_type: int, counter_type: int) -> int:
        return int(self._n.nvmlDeviceGetTotalEccErrors(handle, error_type, counter_type))

    def device_remapped_rows(self, handle: Any) -> tuple[int, int, int, int]:
        corr, unc, pending, failure = self._n.nvmlDeviceGetRemappedRows(handle)
        return int(corr), int(unc), int(pending), int(failure)

    def device_compute_running_processes(self, handle: Any) -> list[ProcessInfo]:
        # _v3 (driver >= 510) and _v2 fill the same structure; the unversioned wrapper would turn a
        # missing _v3 into NVMLLibraryMismatchError instead of trying _v2.
        try:
            processes = self._n.nvmlDeviceGetComputeRunningProcesses_v3(handle)
        except self._n.NVMLError_FunctionNotFound:
            processes = self._n.nvmlDeviceGetComputeRunningProcesses_v2(handle)
        return [ProcessInfo(int(p.pid), None if p.usedGpuMemory is None else int(p.usedGpuMemory))
                for p in processes]

    def device_process_utilization(self, handle: Any, last_seen_us: int) -> list[ProcessUtilization]:
        try:
            samples = self._n.nvmlDeviceGetProcessUtilization(handle, last_seen_us)
        except self._n.NVMLError as exc:
            if error_code(exc) == SUCCESS:  # the bindings raise the sizing call's SUCCESS: no process to report
                return []
            raise
        return [ProcessUtilization(int(s.pid), int(s.timeStamp), int(s.smUtil), int(s.memUtil)) for s in samples]

    def device_max_mig_device_count(self, handle: Any) -> int:
        return int(self._n.nvmlDeviceGetMaxMigDeviceCount(handle))

    def device_mig_device_handle_by_index(self, handle: Any, index: int) -> Any:
        return self._n.nvmlDeviceGetMigDeviceHandleByIndex(handle, index)

    def device_gpu_instance_id(self, handle: Any) -> int:
        return int(self._n.nvmlDeviceGetGpuInstanceId(handle))

    def device_compute_instance_id(self, handle: Any) -> int:
        return int(self._n.nvmlDeviceGetComputeInstanceId(handle))

    def event_set_create(self) -> Any:
        return self._n.nvmlEventSetCreate()

    def device_register_events(self, handle: Any, event_types: int, event_set: Any) -> None:
        self._n.nvmlDeviceRegisterEvents(handle, event_types, event_set)

    def event_set_wait(self, event_set: Any, timeout_ms: int) -> Event:
        data = self._n.nvmlEventSetWait_v2(event_set, timeout_ms)
        return Event(self.handle_key(data.device), int(data.eventType), int(data.eventData))

    def event_set_free(self, event_set: Any) -> None:
        self._n.nvmlEventSetFree(event_set)
