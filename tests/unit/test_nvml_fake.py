"""A fake NVML behind exporter.host.nvml_device.Nvml, for CI machines that have no GPU (and the tests of the fake).

A fake is only acceptable where the real thing cannot exist here (../shared/DESIGN.md): CI and
laptops have no NVIDIA GPU or driver.  So the fake follows what NVML does, as documented in nvml.h and
as measured on an H100 with driver 580 (tests/gpu runs the same collector on the real thing):

- errors are pynvml's own exception classes, raised where NVML raises them: GpuIsLost on every call to
  a lost GPU and from nvmlDeviceGetHandleByIndex, Uninitialized after nvmlShutdown, DriverNotLoaded
  from nvmlInit without a driver, FunctionNotFound for a function the installed driver lacks,
  NotSupported for a feature the GPU lacks, InvalidArgument for MIG ids on a non-MIG handle;
- nvmlDeviceGetSamples returns the samples newer than the timestamp given (microseconds since the
  epoch), at most BUFFER of them, and raises NotFound when there is none;
- nvmlDeviceGetFieldValues reports a refused field in that field's return code, not as a raised error;
- GPM metrics are averages (percent, or MiB/s) between two samples; a sample holds the counters of
  GPM's last internal refresh (every 100 ms, nvml.h; measured: samples 0.04-0.54 s apart are off by up
  to 0.06 s), so the time NVML divides by is not the time between the two calls; GPM's byte counters
  do not wrap; the SM metrics (SM activity, occupancy, tensor and FP pipes) are shares of elapsed SM
  *cycles*, so time at a low SM clock weighs less (DCGM documents SM activity as "the ratio of cycles";
  measured on an H100: averaged over a stretch of idle at 345 MHz and work at 1980 MHz, SM activity x
  the stretch's length exceeded the time the SMs worked), while DRAM and the byte rates are per time;
  a metric the GPU lacks fails alone (its own return code); nvmlGpmMigSampleGet samples
  one GPU instance of a GPU in MIG mode (NotFound for an instance that does not exist);
- nvmlDeviceGetNvLinkState answers per link, InvalidArgument past the last link, NotSupported on a
  GPU without NVLink;
- nvmlDeviceGetProcessUtilization returns one sample per process that had non-zero utilisation in
  NVML's *last* sample period (nvml.h), with that period's figures and timestamp, if newer than the
  timestamp given; NotFound otherwise.  Not an average since that timestamp: measured on an H100, two
  processes taking turns (60 % and 20 % of every second) and a call 5 s after the previous one
  answered only the process that ran in the last period (and with 70 ms turns each 200 ms period
  named one of them);
- nvmlEventSetWait returns queued events one at a time and raises Timeout when none comes in time;
- on a GPU in MIG mode, utilisation (samples and rates) is NotSupported; MIG slots may be empty (NotFound).
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import pytest

from exporter.host.nvml_device import Event, ProcessInfo, ProcessUtilization, bindings

pynvml = bindings()  # loaded as the exporter loads it (its errors under nvml_device.NVMLError)

BUFFER = 120  # samples NVML keeps per type (about 20 s on an H100, which takes 5-6 a second)
MIB = 1024 * 1024


def error(code: int) -> Exception:
    return pynvml.NVMLError(code)


# GPM metrics an H100 SXM answers (nvidia-ml-py ids): SM, occupancy, tensor (any, DFMA, HMMA, IMMA),
# DRAM, FP64/32/16, PCIe, NVDEC 0-6, NVJPG 0-6, NVOFA 0, NVLink totals (per link: FakeGpu.nvlinks).
H100_GPM = frozenset({2, 3, 5, 6, 7, 9, 10, 11, 12, 13, 20, 21, *range(30, 37), *range(40, 47), 50, 60, 61})


# GPM metrics NVML computes per elapsed SM cycle: SM activity, occupancy, tensor (any, DFMA, HMMA, IMMA),
# FP64/32/16 pipes.
SM_CYCLE_METRICS = frozenset({2, 3, 5, 6, 7, 9, 11, 12, 13})


class GpmCounters:
    """What GPM integrates: per metric, NVML's unit x seconds (percent-seconds, or MiB), over time; for
    the SM metrics, unit x SM cycles, with the elapsed cycles at the SM clock of the moment."""

    def __init__(self, clock_mhz: float = 1980.0) -> None:
        self.history: list[tuple[float, dict[int, float]]] = [(0.0, {})]
        self.clock: list[tuple[float, float]] = [(time.monotonic(), clock_mhz)]  # (from when, SM clock MHz)

    def set_clock(self, mhz: float) -> None:
        """The SM clock moves now (on an H100: 345 MHz idle, 1980 MHz under load)."""
        self.clock.append((time.monotonic(), mhz))

    def add(self, amounts: dict[int, float]) -> None:
        """``amounts`` more of each metric now: ``{2: 50 * 2.0}`` is 2 s with half the SMs busy (at the
        SM clock of now: that many cycles)."""
        totals = dict(self.history[-1][1])
        clock = self.clock[-1][1]
        for metric, amount in amounts.items():
            totals[metric] = totals.get(metric, 0.0) + amount * (clock if metric in SM_CYCLE_METRICS else 1.0)
        self.history.append((time.monotonic(), totals))

    def cycles(self, at: float) -> float:
        """Elapsed SM cycles (millions) from the first clock entry to ``at``."""
        total = 0.0
        for (start, mhz), (end, _) in zip(self.clock, [*self.clock[1:], (at, 0.0)], strict=True):
            total += mhz * max(0.0, min(end, at) - start)
        return total

    def snapshot(self, refresh: float) -> tuple[float, dict[int, float], float]:
        """The counters as of GPM's last internal refresh, when that was, and the SM cycles by then."""
        tick = time.monotonic() // refresh * refresh
        return tick, [entry for entry in self.history if entry[0] <= tick][-1][1], self.cycles(tick)


@dataclass
class FakeMig:
    uuid: str
    gpu_instance: int
    compute_instance: int
    name: str = "NVIDIA H100 80GB HBM3 MIG 1g.10gb"
    memory: tuple[int, int, int, int] = (10 * 1024**3, 0, 9 * 1024**3, 1024**3)  # total, reserved, free, used
    gpm_counters: GpmCounters = field(default_factory=GpmCounters)


@dataclass
class FakeGpu:
    """One GPU's state; tests change it between sweeps.  Values are in NVML's units (mW, mJ, MHz, ns)."""

    uuid: str
    name: str = "NVIDIA H100 80GB HBM3"
    pci_bus_id: str = "00000000:00:06.0"
    serial: str = "1752624002237"
    minor: int = 0
    memory: tuple[int, int, int, int] = (85520809984, 503316480, 80000000000, 5017493504)
    temperature: int = 35
    power_mw: int = 120593
    limit_mw: int = 700000
    clocks_mhz: dict[int, int] = field(default_factory=lambda: {1: 1980, 2: 2619})
    max_clocks_mhz: dict[int, int] = field(default_factory=lambda: {1: 1980, 2: 2619})
    link: tuple[int, int] = (5, 16)  # generation, width now
    max_link: tuple[int, int] = (5, 16)
    reasons: int = 0x1  # gpu_idle
    supported_reasons: int = 0x1FF
    utilization: tuple[int, int] = (0, 0)  # percent: gpu, memory
    samples: list[tuple[int, float]] = field(default_factory=list)
    fields: dict[int, int | float] = field(default_factory=lambda: {82: 36, 74: 0, 76: 0, 269: 0, 270: 0, 271: 0})
    energy_mj: int = 2074432
    replays: int = 0
    ecc: dict[tuple[int, int], int] = field(default_factory=lambda: {(0, 0): 0, (1, 0): 0, (0, 1): 0, (1, 1): 0})
    remapped: tuple[int, int, int, int] = (0, 0, 0, 0)
    processes: list[ProcessInfo] = field(default_factory=list)
    process_names: dict[int, str] = field(default_factory=dict)
    gpm_counters: GpmCounters = field(default_factory=GpmCounters)
    gpm: bool = True
    gpm_metrics: frozenset[int] = H100_GPM
    gpm_refresh: float = 0.1  # seconds between GPM's internal refreshes
    nvlinks: int = 0  # active NVLink links (0: a PCIe card, no NVLink at all)
    process_samples: list[tuple[int, dict[int, tuple[int, int]]]] = field(default_factory=list)  # ts, pid -> sm, mem
    mig_mode: tuple[int, int] = (0, 0)
    mig: list[FakeMig | None] = field(default_factory=list)
    unsupported: set[str] = field(default_factory=set)  # methods this GPU answers NotSupported
    errors: dict[str, int] = field(default_factory=dict)  # method -> NVML return code it fails with
    lost: bool = False  # fell off the bus: GpuIsLost everywhere
    present: bool = True  # enumerated by the next nvmlInit

    def move_pcie(self, tx: int = 0, rx: int = 0) -> None:
        """``tx``/``rx`` more bytes cross the PCIe link now."""
        self.gpm_counters.add({20: tx / MIB, 21: rx / MIB})

    def add_process_samples(self, start_us: int, count: int, shares: dict[int, tuple[int, int]],
                            period_us: int = 166_667) -> int:
        """``count`` per-process samples ``period_us`` apart, each process at (SM %, memory %)."""
        for offset in range(count):
            self.process_samples.append((start_us + offset * period_us, dict(shares)))
        del self.process_samples[:-BUFFER]
        return start_us + count * period_us

    def add_samples(self, start_us: int, values: Sequence[float], period_us: int = 200_000) -> int:
        """Append utilisation samples ``period_us`` apart from ``start_us``; returns the next timestamp."""
        for offset, value in enumerate(values):
            self.samples.append((start_us + offset * period_us, value))
        del self.samples[:-BUFFER]
        return start_us + len(values) * period_us


@dataclass(frozen=True)
class Handle:
    gpu: FakeGpu
    session: int
    mig: FakeMig | None = None


@dataclass
class GpmSample:
    taken: float = 0.0
    counters: dict[int, float] = field(default_factory=dict)
    cycles: float = 0.0  # elapsed SM cycles (millions) by ``taken``
    metrics: frozenset[int] = frozenset()  # what the sampled GPU (or instance) answers


class EventSet:
    def __init__(self) -> None:
        self.queue: queue.Queue[Event] = queue.Queue()
        self.gpus: list[FakeGpu] = []


class FakeNvml:
    """exporter.host.nvml_device.Nvml on FakeGpu objects, with NVML's semantics (module docstring)."""

    def __init__(self, gpus: list[FakeGpu], missing: set[str] | frozenset[str] = frozenset(),
                 driver_version: str = "580.159.04", cuda_version: int = 13000) -> None:
        self.gpus = gpus
        self.missing = set(missing)  # functions the "installed driver" lacks: FunctionNotFound
        self.driver_version = driver_version
        self.cuda_version = cuda_version
        self.library = True
        self.driver_loaded = True
        self.initialized = 0
        self.session = 0
        self.calls: dict[str, int] = {}
        self.hang: dict[str, threading.Event] = {}  # method -> blocks until the event is set
        self.event_sets: list[EventSet] = []
        self._ids = itertools.count()

    # -- gates: every call passes one --

    def _enter(self, method: str) -> None:
        self.calls[method] = self.calls.get(method, 0) + 1
        if method in self.missing:
            raise error(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
        blocker = self.hang.get(method)
        if blocker is not None:
            blocker.wait()
        if not self.initialized:
            raise error(pynvml.NVML_ERROR_UNINITIALIZED)

    def _device(self, method: str, handle: Handle) -> FakeGpu:
        self._enter(method)
        if handle.session != self.session:
            raise error(pynvml.NVML_ERROR_UNINITIALIZED)  # a handle from before nvmlShutdown
        gpu = handle.gpu
        if gpu.lost:
            raise error(pynvml.NVML_ERROR_GPU_IS_LOST)
        if method in gpu.errors:
            raise error(gpu.errors[method])
        if method in gpu.unsupported:
            raise error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return gpu

    def _parent(self, method: str, handle: Handle) -> FakeGpu:
        """A call NVML answers for a whole GPU only (MIG mode hides utilisation)."""
        gpu = self._device(method, handle)
        if handle.mig is not None or (gpu.mig_mode[0] and method in ("device_samples", "device_utilization_rates")):
            raise error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return gpu

    def _visible(self) -> list[FakeGpu]:
        return [gpu for gpu in self.gpus if gpu.present]

    # -- session --

    def init(self) -> None:
        self.calls["init"] = self.calls.get("init", 0) + 1
        if not self.library:
            raise error(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)
        if not self.driver_loaded:
            raise error(pynvml.NVML_ERROR_DRIVER_NOT_LOADED)
        if not self.initialized:
            self.session += 1  # a real (first) initialisation: handles from before are dead
        self.initialized += 1

    def shutdown(self) -> None:
        self._enter("shutdown")
        self.initialized -= 1

    def system_driver_version(self) -> str:
        self._enter("system_driver_version")
        return self.driver_version

    def system_cuda_driver_version(self) -> int:
        self._enter("system_cuda_driver_version")
        return self.cuda_version

    def system_process_name(self, pid: int) -> str:
        self._enter("system_process_name")
        for gpu in self.gpus:
            if pid in gpu.process_names:
                return gpu.process_names[pid]
        raise error(pynvml.NVML_ERROR_NOT_FOUND)

    def device_count(self) -> int:
        self._enter("device_count")
        return len(self._visible())

    def device_handle_by_index(self, index: int) -> Handle:
        self._enter("device_handle_by_index")
        visible = self._visible()
        if index >= len(visible):
            raise error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if visible[index].lost:
            raise error(pynvml.NVML_ERROR_GPU_IS_LOST)
        return Handle(visible[index], self.session)

    def handle_key(self, handle: Handle) -> Hashable:
        return id(handle.gpu) if handle.mig is None else id(handle.mig)

    # -- identity and limits --

    def device_uuid(self, handle: Handle) -> str:
        gpu = self._device("device_uuid", handle)
        return handle.mig.uuid if handle.mig else gpu.uuid

    def device_name(self, handle: Handle) -> str:
        gpu = self._device("device_name", handle)
        return handle.mig.name if handle.mig else gpu.name

    def device_pci_bus_id(self, handle: Handle) -> str:
        return self._device("device_pci_bus_id", handle).pci_bus_id

    def device_serial(self, handle: Handle) -> str:
        return self._device("device_serial", handle).serial

    def device_minor_number(self, handle: Handle) -> int:
        return self._device("device_minor_number", handle).minor

    def device_max_clock_info(self, handle: Handle, clock: int) -> int:
        return self._device("device_max_clock_info", handle).max_clocks_mhz[clock]

    def device_max_pcie_link_generation(self, handle: Handle) -> int:
        return self._device("device_max_pcie_link_generation", handle).max_link[0]

    def device_max_pcie_link_width(self, handle: Handle) -> int:
        return self._device("device_max_pcie_link_width", handle).max_link[1]

    def device_supported_clocks_event_reasons(self, handle: Handle) -> int:
        return self._device("device_supported_clocks_event_reasons", handle).supported_reasons

    def device_mig_mode(self, handle: Handle) -> tuple[int, int]:
        return self._device("device_mig_mode", handle).mig_mode

    def device_nvlink_state(self, handle: Handle, link: int) -> bool:
        gpu = self._device("device_nvlink_state", handle)
        if not gpu.nvlinks:
            raise error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        if link >= gpu.nvlinks:
            raise error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return True

    # -- every interval --

    def device_samples(self, handle: Handle, sampling_type: int, last_seen_us: int) -> list[tuple[int, float]]:
        gpu = self._parent("device_samples", handle)
        newer = [sample for sample in gpu.samples if sample[0] > last_seen_us]
        if not newer:
            raise error(pynvml.NVML_ERROR_NOT_FOUND)
        return newer

    def device_utilization_rates(self, handle: Handle) -> tuple[int, int]:
        return self._parent("device_utilization_rates", handle).utilization

    def device_memory_info_v2(self, handle: Handle) -> tuple[int, int, int, int]:
        gpu = self._device("device_memory_info_v2", handle)
        return handle.mig.memory if handle.mig else gpu.memory

    def device_memory_info(self, handle: Handle) -> tuple[int, int, int]:
        gpu = self._device("device_memory_info", handle)
        total, reserved, free, used = handle.mig.memory if handle.mig else gpu.memory
        return total, free, used + reserved  # v1 counts the reserved memory as used

    def device_temperature(self, handle: Handle, sensor: int) -> int:
        return self._device("device_temperature", handle).temperature

    def device_power_usage(self, handle: Handle) -> int:
        return self._device("device_power_usage", handle).power_mw

    def device_enforced_power_limit(self, handle: Handle) -> int:
        return self._device("device_enforced_power_limit", handle).limit_mw

    def device_clock_info(self, handle: Handle, clock: int) -> int:
        return self._device("device_clock_info", handle).clocks_mhz[clock]

    def device_curr_pcie_link_generation(self, handle: Handle) -> int:
        return self._device("device_curr_pcie_link_generation", handle).link[0]

    def device_curr_pcie_link_width(self, handle: Handle) -> int:
        return self._device("device_curr_pcie_link_width", handle).link[1]

    def device_current_clocks_event_reasons(self, handle: Handle) -> int:
        return self._device("device_current_clocks_event_reasons", handle).reasons

    def device_current_clocks_throttle_reasons(self, handle: Handle) -> int:
        return self._device("device_current_clocks_throttle_reasons", handle).reasons

    def gpm_query_device_support(self, handle: Handle) -> bool:
        return self._device("gpm_query_device_support", handle).gpm

    def gpm_sample_alloc(self) -> GpmSample:
        self._enter("gpm_sample_alloc")
        return GpmSample()

    def gpm_sample_free(self, sample: GpmSample) -> None:
        self._enter("gpm_sample_free")

    def gpm_sample_get(self, handle: Handle, sample: GpmSample) -> GpmSample:
        gpu = self._device("gpm_sample_get", handle)
        if not gpu.gpm:
            raise error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        sample.taken, sample.counters, sample.cycles = gpu.gpm_counters.snapshot(gpu.gpm_refresh)
        links = {metric for link in range(gpu.nvlinks) for metric in (62 + 2 * link, 63 + 2 * link)}
        sample.metrics = gpu.gpm_metrics | links
        return sample

    def gpm_mig_sample_get(self, handle: Handle, gpu_instance: int, sample: GpmSample) -> GpmSample:
        gpu = self._device("gpm_mig_sample_get", handle)
        if not gpu.gpm:
            raise error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        if not gpu.mig_mode[0]:
            raise error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        mig = next((m for m in gpu.mig if m is not None and m.gpu_instance == gpu_instance), None)
        if mig is None:
            raise error(pynvml.NVML_ERROR_NOT_FOUND)
        sample.taken, sample.counters, sample.cycles = mig.gpm_counters.snapshot(gpu.gpm_refresh)
        sample.metrics = frozenset({2, 3, 5, 10})
        return sample

    def gpm_metrics_get(self, first: GpmSample, second: GpmSample,
                        metrics: Sequence[int]) -> dict[int, float | Exception]:
        self._enter("gpm_metrics_get")
        result: dict[int, float | Exception] = {}
        for metric in metrics:
            per = second.cycles - first.cycles if metric in SM_CYCLE_METRICS else second.taken - first.taken
            if metric not in second.metrics:
                result[metric] = error(pynvml.NVML_ERROR_NOT_SUPPORTED)
            elif per <= 0:  # both samples from the same refresh
                result[metric] = 0.0
            else:
                result[metric] = (second.counters.get(metric, 0.0) - first.counters.get(metric, 0.0)) / per
        return result

    # -- every slow interval --

    def device_field_values(self, handle: Handle, field_ids: Sequence[int]) -> dict[int, int | float | Exception]:
        gpu = self._device("device_field_values", handle)
        return {f: gpu.fields[f] if f in gpu.fields else error(pynvml.NVML_ERROR_NOT_SUPPORTED) for f in field_ids}

    def device_total_energy_consumption(self, handle: Handle) -> int:
        return self._device("device_total_energy_consumption", handle).energy_mj

    def device_pcie_replay_counter(self, handle: Handle) -> int:
        return self._device("device_pcie_replay_counter", handle).replays

    def device_total_ecc_errors(self, handle: Handle, error_type: int, counter_type: int) -> int:
        return self._device("device_total_ecc_errors", handle).ecc[(error_type, counter_type)]

    def device_remapped_rows(self, handle: Handle) -> tuple[int, int, int, int]:
        return self._device("device_remapped_rows", handle).remapped

    def device_compute_running_processes(self, handle: Handle) -> list[ProcessInfo]:
        return list(self._device("device_compute_running_processes", handle).processes)

    def device_process_utilization(self, handle: Handle, last_seen_us: int) -> list[ProcessUtilization]:
        gpu = self._device("device_process_utilization", handle)
        last = gpu.process_samples[-1] if gpu.process_samples else None
        if last is None or last[0] <= last_seen_us:
            raise error(pynvml.NVML_ERROR_NOT_FOUND)
        timestamp, shares = last
        ran = [(pid, sm, memory) for pid, (sm, memory) in sorted(shares.items()) if sm or memory]
        if not ran:
            raise error(pynvml.NVML_ERROR_NOT_FOUND)
        return [ProcessUtilization(pid, timestamp, sm, memory) for pid, sm, memory in ran]

    def device_max_mig_device_count(self, handle: Handle) -> int:
        return len(self._device("device_max_mig_device_count", handle).mig)

    def device_mig_device_handle_by_index(self, handle: Handle, index: int) -> Handle:
        gpu = self._device("device_mig_device_handle_by_index", handle)
        if not gpu.mig_mode[0]:
            raise error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        device = gpu.mig[index]
        if device is None:
            raise error(pynvml.NVML_ERROR_NOT_FOUND)
        return Handle(gpu, handle.session, device)

    def device_gpu_instance_id(self, handle: Handle) -> int:
        self._device("device_gpu_instance_id", handle)
        if handle.mig is None:
            raise error(pynvml.NVML_ERROR_INVALID_ARGUMENT)  # as measured on an H100 without MIG
        return handle.mig.gpu_instance

    def device_compute_instance_id(self, handle: Handle) -> int:
        self._device("device_compute_instance_id", handle)
        if handle.mig is None:
            raise error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return handle.mig.compute_instance

    # -- Xid events --

    def event_set_create(self) -> EventSet:
        self._enter("event_set_create")
        event_set = EventSet()
        self.event_sets.append(event_set)
        return event_set

    def device_register_events(self, handle: Handle, event_types: int, event_set: EventSet) -> None:
        event_set.gpus.append(self._device("device_register_events", handle))

    def event_set_wait(self, event_set: EventSet, timeout_ms: int) -> Event:
        self._enter("event_set_wait")
        try:
            return event_set.queue.get(timeout=timeout_ms / 1000)
        except queue.Empty:
            raise error(pynvml.NVML_ERROR_TIMEOUT) from None

    def event_set_free(self, event_set: EventSet) -> None:
        self._enter("event_set_free")
        self.event_sets.remove(event_set)

    def xid(self, gpu: FakeGpu, code: int) -> None:
        """The driver reports Xid ``code`` on ``gpu``: every event set registered for it gets the event."""
        for event_set in self.event_sets:
            if any(registered is gpu for registered in event_set.gpus):
                event_set.queue.put(Event(id(gpu), pynvml.nvmlEventTypeXidCriticalError, code))


def h100s(count: int) -> list[FakeGpu]:
    return [FakeGpu(f"GPU-{index:08d}-aaaa-bbbb-cccc-dddddddddddd", minor=index,
                    pci_bus_id=f"00000000:{index + 6:02X}:00.0") for index in range(count)]


# -- the fake's own semantics, where the collector's tests lean on them --


def test_samples_newer_than_the_timestamp_else_not_found() -> None:
    fake = FakeNvml(h100s(1))
    fake.init()
    handle = fake.device_handle_by_index(0)
    fake.gpus[0].add_samples(1_000_000, [10, 20, 30])
    assert fake.device_samples(handle, 1, 0) == [(1_000_000, 10), (1_200_000, 20), (1_400_000, 30)]
    assert fake.device_samples(handle, 1, 1_200_000) == [(1_400_000, 30)]
    with pytest.raises(pynvml.NVMLError_NotFound):
        fake.device_samples(handle, 1, 1_400_000)


def test_lost_gpu_missing_function_and_stale_handles() -> None:
    fake = FakeNvml(h100s(2), missing={"device_memory_info_v2"})
    fake.init()
    first, second = fake.device_handle_by_index(0), fake.device_handle_by_index(1)
    with pytest.raises(pynvml.NVMLError_FunctionNotFound):
        fake.device_memory_info_v2(first)
    fake.gpus[1].lost = True
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        fake.device_power_usage(second)
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        fake.device_handle_by_index(1)
    fake.shutdown()
    fake.init()
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        fake.device_power_usage(first)  # a handle from the previous session


def test_event_wait_times_out_when_idle_and_delivers_xids() -> None:
    fake = FakeNvml(h100s(1))
    fake.init()
    event_set = fake.event_set_create()
    fake.device_register_events(fake.device_handle_by_index(0), pynvml.nvmlEventTypeXidCriticalError, event_set)
    with pytest.raises(pynvml.NVMLError_Timeout):
        fake.event_set_wait(event_set, 10)
    fake.xid(fake.gpus[0], 79)
    assert fake.event_set_wait(event_set, 10).data == 79


def test_gpm_rates_are_averages_between_two_refreshes() -> None:
    fake = FakeNvml(h100s(1))
    fake.init()
    handle, gpu = fake.device_handle_by_index(0), fake.gpus[0]
    gpu.gpm_refresh = 0.05
    first, second = fake.gpm_sample_get(handle, GpmSample()), GpmSample()
    time.sleep(0.06)
    gpu.move_pcie(rx=64 * MIB)
    fake.gpm_sample_get(handle, second)
    assert fake.gpm_metrics_get(first, second, [21])[21] == 0.0  # moved after the last refresh: not seen yet
    time.sleep(0.06)
    fake.gpm_sample_get(handle, second)
    rate = fake.gpm_metrics_get(first, second, [21])[21]
    assert isinstance(rate, float) and 64 / (second.taken - first.taken) == pytest.approx(rate)
    assert round((second.taken - first.taken) / 0.05) * 0.05 == pytest.approx(second.taken - first.taken)


def test_gpm_sm_ratios_are_per_sm_cycle_and_dram_per_second() -> None:
    """Over idle at 345 MHz then work at 1980 MHz, SM activity (per cycle) reads far above the share of
    time the SMs worked; DRAM (per second) reads that share."""
    fake = FakeNvml(h100s(1))
    fake.init()
    handle, gpu = fake.device_handle_by_index(0), fake.gpus[0]
    gpu.gpm_refresh = 0.01
    gpu.gpm_counters.set_clock(345)
    first, second = fake.gpm_sample_get(handle, GpmSample()), GpmSample()
    time.sleep(0.1)
    gpu.gpm_counters.set_clock(1980)
    time.sleep(0.1)
    gpu.gpm_counters.add({2: 100 * 0.1, 10: 100 * 0.1})  # the last 0.1 s: every SM and the DRAM busy
    time.sleep(0.02)
    fake.gpm_sample_get(handle, second)
    rates = fake.gpm_metrics_get(first, second, [2, 10])
    seconds = second.taken - first.taken
    assert rates[10] == pytest.approx(100 * 0.1 / seconds)
    assert rates[2] == pytest.approx(100 * 0.1 * 1980 / (second.cycles - first.cycles))
    assert rates[2] > 1.5 * rates[10]
