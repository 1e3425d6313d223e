"""The nvml collector on a fake NVML (tests/unit/test_nvml_fake.py), because CI has no GPU.

The fake follows NVML's documented and measured semantics; tests/gpu/ runs the same collector on a
real H100 and compares it with nvidia-smi.  Sweeps are driven synchronously (``sample_now``) except
where the background threads are the point (the hang watchdog, Xid listener).
"""

from __future__ import annotations

import math
import re
import shutil
import threading
import time

import pytest

from exporter.collect import Absent, Scraper
from exporter.collectors.nvml import DESCS, NvmlCollector
from exporter.collectors.nvml_ledger import DESCS as LEDGER_DESCS
from exporter.context import Context
from exporter.exposition import render
from exporter.host.nvml_device import ProcessInfo, bindings
from exporter.pods.podresources import DeviceOwner
from tests.conftest import Samples, parse_samples, undeclared
from tests.unit.test_nvml_fake import FakeGpu, FakeMig, FakeNvml, h100s

pynvml = bindings()  # loaded as the exporter loads it (its errors under nvml_device.NVMLError)

GIB = 1024**3


def make(fake: FakeNvml, **options: float) -> NvmlCollector:
    """A collector on ``fake``; slow fields are read on every sweep unless a test says otherwise."""
    settings: dict[str, float] = {"interval": 60.0, "slow-interval": 1e-9, "hang-timeout": 10.0,
                                  "reinit-interval": 60.0, "max-processes": 64}
    settings.update({key.replace("_", "-"): value for key, value in options.items()})
    collector = NvmlCollector(Context(), settings, nvml=fake)
    collector.xid_wait_ms = 20  # a re-initialisation waits for the Xid listener's current wait to end
    return collector


def sweep(collector: NvmlCollector) -> Samples:
    collector.sampler.sample_now()
    return parse_samples(render(collector.collect()))


def value(samples: Samples, name: str, **labels: str) -> float:
    matches = [v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= ls]
    assert len(matches) == 1, f"{name}{labels}: {len(matches)} samples"
    return matches[0]


def has(samples: Samples, name: str, **labels: str) -> bool:
    return any(n == name and set(labels.items()) <= ls for (n, ls), _ in samples.items())


def scrape_success(collector: NvmlCollector) -> tuple[float, Samples]:
    """``gpuio_scrape_collector_success`` for nvml through the real Scraper, and all samples."""
    samples = parse_samples(render(Scraper([collector], 2.0, "").scrape_sync()))
    return value(samples, "gpuio_scrape_collector_success", collector="nvml"), samples


def sweep_and_scrape(collector: NvmlCollector) -> tuple[float, Samples]:
    collector.sampler.sample_now()
    return scrape_success(collector)


def test_every_value_in_base_units_with_identity_labels() -> None:
    gpu = FakeGpu("GPU-1", utilization=(37, 12), power_mw=120593, energy_mj=2074432, remapped=(2, 1, 1, 0),
                  reasons=0x1 | 0x4, ecc={(0, 0): 3, (1, 0): 0, (0, 1): 7, (1, 1): 1})
    gpu.fields[74] = 2_500_000_000  # ns of sw power capping
    gpu.processes = [ProcessInfo(4242, 1616904192)]
    gpu.process_names = {4242: "python3"}
    samples = sweep(make(FakeNvml([gpu])))
    g = {"gpu": "0", "uuid": "GPU-1"}
    expected = {
        "gpuio_gpu_devices": 1, "gpuio_gpu_up": 1, "gpuio_gpu_memory_total_bytes": 85520809984,
        "gpuio_gpu_memory_reserved_bytes": 503316480, "gpuio_gpu_memory_free_bytes": 80000000000,
        "gpuio_gpu_memory_used_bytes": 5017493504, "gpuio_gpu_temperature_celsius": 35,
        "gpuio_gpu_memory_temperature_celsius": 36, "gpuio_gpu_power_watts": 120.593,
        "gpuio_gpu_power_limit_watts": 700.0, "gpuio_gpu_energy_joules_total": 2074.432,
        "gpuio_gpu_sm_clock_hertz": 1.98e9, "gpuio_gpu_sm_clock_max_hertz": 1.98e9,
        "gpuio_gpu_memory_clock_hertz": 2.619e9, "gpuio_gpu_memory_clock_max_hertz": 2.619e9,
        "gpuio_gpu_pcie_link_generation": 5, "gpuio_gpu_pcie_link_generation_max": 5,
        "gpuio_gpu_pcie_link_width": 16, "gpuio_gpu_pcie_link_width_max": 16,
        "gpuio_gpu_utilization_ratio": 0.37, "gpuio_gpu_memory_utilization_ratio": 0.12,
        "gpuio_gpu_pcie_replays_total": 0, "gpuio_gpu_remapped_rows_pending": 1,
        "gpuio_gpu_remapped_rows_failure": 0, "gpuio_gpu_mig_enabled": 0, "gpuio_gpu_processes": 1,
        "gpuio_gpu_processes_dropped_total": 0,
    }
    for name, want in expected.items():
        assert value(samples, name, **(g if name != "gpuio_gpu_devices" else {})) == pytest.approx(want), name
    assert value(samples, "gpuio_gpu_clocks_event_seconds_total", reason="sw_power_cap") == 2.5
    assert value(samples, "gpuio_gpu_clocks_event_reason_active", reason="gpu_idle") == 1
    assert value(samples, "gpuio_gpu_clocks_event_reason_active", reason="sw_power_cap") == 1
    assert value(samples, "gpuio_gpu_clocks_event_reason_active", reason="hw_slowdown") == 0
    assert value(samples, "gpuio_gpu_ecc_errors_total", error="corrected") == 3
    assert value(samples, "gpuio_gpu_ecc_aggregate_errors_total", error="uncorrected") == 1
    assert value(samples, "gpuio_gpu_remapped_rows", cause="correctable") == 2
    assert value(samples, "gpuio_gpu_process_memory_used_bytes", pid="4242", process_name="python3") == 1616904192
    info = next(dict(ls) for (n, ls), _ in samples.items() if n == "gpuio_gpu_info")
    assert info == {**g, "name": "NVIDIA H100 80GB HBM3", "pci_bus_id": "00000000:00:06.0", "serial": "1752624002237",
                    "minor_number": "0", "driver_version": "580.159.04", "cuda_version": "13.0"}
    assert 0 <= value(samples, "gpuio_gpu_snapshot_age_seconds") < 1
    assert not has(samples, "gpuio_gpu_nvml_errors_total")


def test_busy_seconds_integrate_the_utilisation_samples() -> None:
    fake = FakeNvml(h100s(1))
    gpu, collector = fake.gpus[0], make(fake)
    now = gpu.add_samples(1_000_000, [100] * 30)  # history from before the exporter started: not counted
    assert value(sweep(collector), "gpuio_gpu_busy_seconds_total") == 0
    now = gpu.add_samples(now, [100, 0] * 5)  # 2 s at 50 % duty, 200 ms samples
    assert value(sweep(collector), "gpuio_gpu_busy_seconds_total") == pytest.approx(1.0)
    assert value(sweep(collector), "gpuio_gpu_busy_seconds_total") == pytest.approx(1.0)  # NotFound: nothing new
    gpu.add_samples(now + 5_000_000, [100])  # 5 s gap (samples lost): a sample covers at most ~1 s
    samples = sweep(collector)
    assert value(samples, "gpuio_gpu_busy_seconds_total") == pytest.approx(2.1)
    assert not has(samples, "gpuio_gpu_nvml_errors_total")


def test_pcie_bytes_from_gpm_converge_and_never_go_back() -> None:
    """GPM rates times the baseline's age: off by at most one GPM refresh over that age, and monotonic."""
    fake = FakeNvml(h100s(1))
    gpu = fake.gpus[0]
    gpu.gpm_refresh = 0.02
    collector = make(fake)
    assert value(sweep(collector), "gpuio_gpu_pcie_receive_bytes_total") == 0  # the baseline
    time.sleep(0.1)
    gpu.move_pcie(rx=4 * GIB + 12345, tx=3 * GIB)  # more than 2**32: the 32-bit field counters would wrap
    time.sleep(0.3)
    seen = []
    for _ in range(5):
        time.sleep(0.05)
        samples = sweep(collector)
        seen.append(value(samples, "gpuio_gpu_pcie_receive_bytes_total"))
        age = 0.4 + 0.05 * len(seen)  # the baseline's age, about
        assert seen[-1] == pytest.approx(4 * GIB + 12345, rel=0.02 / age + 0.02)
        assert value(samples, "gpuio_gpu_pcie_transmit_bytes_total") == pytest.approx(3 * GIB, rel=0.02 / age + 0.02)
    assert seen == sorted(seen)  # idle now: the estimate wobbles with the refresh, the counter does not go back


def test_a_lost_gpu_is_down_while_the_others_report_and_recovers_after_reinit() -> None:
    fake = FakeNvml(h100s(2))
    collector = make(fake, reinit_interval=0.05)
    first, second = ({"gpu": str(i), "uuid": fake.gpus[i].uuid} for i in range(2))
    fake.gpus[0].add_samples(1_000_000, [0])
    sweep(collector)
    fake.gpus[1].lost = True
    fake.gpus[0].add_samples(1_200_000, [100] * 5)
    success, samples = sweep_and_scrape(collector)
    assert success == 1
    assert value(samples, "gpuio_gpu_up", **first) == 1 and value(samples, "gpuio_gpu_up", **second) == 0
    assert has(samples, "gpuio_gpu_info", **second)  # still listed, with its identity
    assert not has(samples, "gpuio_gpu_power_watts", **second)  # no stale readings of a lost GPU
    assert value(samples, "gpuio_gpu_power_watts", **first) == pytest.approx(120.593)
    busy = value(samples, "gpuio_gpu_busy_seconds_total", **first)
    assert busy == pytest.approx(1.0)

    fake.gpus[1].lost = False  # the GPU came back (a reset, or a driver reload)
    time.sleep(0.06)
    samples = sweep(collector)
    assert fake.calls["init"] == 2
    assert value(samples, "gpuio_gpu_up", **second) == 1 and value(samples, "gpuio_gpu_up", **first) == 1
    assert value(samples, "gpuio_gpu_busy_seconds_total", **first) == pytest.approx(busy)  # no counter reset
    assert not has(samples, "gpuio_gpu_nvml_errors_total")


def test_an_unknown_error_takes_only_that_gpu_down() -> None:
    fake = FakeNvml(h100s(2))
    fake.gpus[0].errors["device_power_usage"] = pynvml.NVML_ERROR_UNKNOWN
    samples = sweep(make(fake))
    assert value(samples, "gpuio_gpu_up", gpu="0") == 0 and value(samples, "gpuio_gpu_up", gpu="1") == 1


def test_a_gpu_that_falls_off_the_bus_stays_listed_down() -> None:
    fake = FakeNvml(h100s(2))
    collector = make(fake, reinit_interval=0.01)
    lost = {"gpu": "1", "uuid": fake.gpus[1].uuid}
    sweep(collector)
    fake.gpus[1].lost = True
    sweep(collector)
    fake.gpus[1].present = False  # NVML no longer enumerates it
    time.sleep(0.02)
    samples = sweep(collector)
    assert value(samples, "gpuio_gpu_devices") == 1
    assert value(samples, "gpuio_gpu_up", **lost) == 0
    assert value(samples, "gpuio_gpu_up", gpu="0") == 1


def test_driver_unloaded_then_reloaded() -> None:
    fake = FakeNvml(h100s(1))
    collector = make(fake, reinit_interval=0.01)
    sweep(collector)
    fake.driver_loaded, fake.initialized = False, 0  # the module is gone: calls fail Uninitialized
    success, samples = sweep_and_scrape(collector)
    assert success == 1 and value(samples, "gpuio_gpu_up", gpu="0") == 0
    time.sleep(0.02)
    samples = sweep(collector)  # nvmlInit now fails DriverNotLoaded: the GPU we knew stays listed, down
    assert value(samples, "gpuio_gpu_up", gpu="0") == 0
    fake.driver_loaded = True
    time.sleep(0.02)
    assert value(sweep(collector), "gpuio_gpu_up", gpu="0") == 1


def test_a_failing_call_leaves_its_series_out_and_is_counted() -> None:
    fake = FakeNvml(h100s(1))
    fake.gpus[0].errors["device_temperature"] = pynvml.NVML_ERROR_TIMEOUT
    collector = make(fake)
    sweep(collector)
    samples = sweep(collector)
    assert value(samples, "gpuio_gpu_up") == 1
    assert not has(samples, "gpuio_gpu_temperature_celsius")
    assert value(samples, "gpuio_gpu_nvml_errors_total", call="temperature", error="Timeout") == 2


def test_old_driver_missing_functions_fall_back_or_leave_series_out() -> None:
    missing = {"device_memory_info_v2", "device_current_clocks_event_reasons", "device_supported_clocks_event_reasons",
               "gpm_query_device_support", "device_remapped_rows", "device_mig_mode",
               "device_total_energy_consumption"}
    fake = FakeNvml(h100s(1), missing=missing)
    fake.gpus[0].fields = {}  # fields an old driver does not know: refused per field
    collector = make(fake)
    sweep(collector)
    success, samples = sweep_and_scrape(collector)
    assert success == 1
    # nvmlDeviceGetMemoryInfo (v1) counts reserved memory as used and has no reserved figure
    assert value(samples, "gpuio_gpu_memory_used_bytes") == 5017493504 + 503316480
    assert not has(samples, "gpuio_gpu_memory_reserved_bytes")
    # nvmlDeviceGetCurrentClocksThrottleReasons, the name before driver 535, and every reason
    assert value(samples, "gpuio_gpu_clocks_event_reason_active", reason="gpu_idle") == 1
    assert len([n for n, _ in samples if n == "gpuio_gpu_clocks_event_reason_active"]) == 9
    for absent in ("gpuio_gpu_pcie_receive_bytes_total", "gpuio_gpu_remapped_rows", "gpuio_gpu_mig_enabled",
                   "gpuio_gpu_energy_joules_total", "gpuio_gpu_memory_temperature_celsius",
                   "gpuio_gpu_clocks_event_seconds_total", "gpuio_gpu_nvml_errors_total"):
        assert not has(samples, absent), absent
    assert value(samples, "gpuio_gpu_power_watts") == pytest.approx(120.593)
    assert fake.calls["device_memory_info_v2"] == 1  # an unsupported call is not retried every sweep


def test_mig_devices_report_memory_and_the_parent_has_no_utilisation() -> None:
    gpu = FakeGpu("GPU-M", mig_mode=(1, 1), mig=[FakeMig("MIG-a", 1, 0), None, FakeMig("MIG-b", 2, 0)])
    gpu.add_samples(1_000_000, [50] * 5)
    samples = sweep(make(FakeNvml([gpu])))
    assert value(samples, "gpuio_gpu_mig_enabled") == 1
    assert value(samples, "gpuio_gpu_mig_device_info", mig_uuid="MIG-b", gpu_instance="2",
                 compute_instance="0") == 1
    assert value(samples, "gpuio_gpu_mig_device_memory_total_bytes", mig_uuid="MIG-a") == 10 * GIB
    assert value(samples, "gpuio_gpu_mig_device_memory_used_bytes", mig_uuid="MIG-b") == GIB
    assert not has(samples, "gpuio_gpu_busy_seconds_total")
    assert not has(samples, "gpuio_gpu_utilization_ratio")
    assert value(samples, "gpuio_gpu_memory_total_bytes") == 85520809984
    assert not has(samples, "gpuio_gpu_nvml_errors_total")


def test_processes_are_capped_largest_first_and_drops_counted_once() -> None:
    fake = FakeNvml(h100s(1))
    gpu = fake.gpus[0]
    gpu.processes = [ProcessInfo(pid, pid * 1000) for pid in (101, 102, 103, 104)] + [ProcessInfo(105, None)]
    gpu.process_names = {pid: f"worker{pid}" for pid in range(101, 107)}
    collector = make(fake, max_processes=2)
    samples = sweep(collector)
    listed = {dict(ls)["pid"] for (n, ls), _ in samples.items() if n == "gpuio_gpu_process_memory_used_bytes"}
    assert listed == {"104", "103"}
    assert value(samples, "gpuio_gpu_processes") == 5
    assert value(samples, "gpuio_gpu_processes_dropped_total") == 3
    assert value(sweep(collector), "gpuio_gpu_processes_dropped_total") == 3  # the same ones: not again
    gpu.processes.append(ProcessInfo(106, 1))
    assert value(sweep(collector), "gpuio_gpu_processes_dropped_total") == 4
    gpu.processes = [ProcessInfo(105, None)]
    samples = sweep(collector)
    assert math.isnan(value(samples, "gpuio_gpu_process_memory_used_bytes", pid="105", process_name="worker105"))


def test_slow_fields_wait_for_their_interval() -> None:
    fake = FakeNvml(h100s(1))
    collector = make(fake, slow_interval=60.0)
    sweep(collector)
    fake.gpus[0].energy_mj += 5000
    fake.gpus[0].power_mw = 300000
    samples = sweep(collector)
    assert value(samples, "gpuio_gpu_power_watts") == 300.0
    assert value(samples, "gpuio_gpu_energy_joules_total") == pytest.approx(2074.432)  # the last slow reading
    assert fake.calls["device_total_energy_consumption"] == 1


def wait_for(condition, timeout: float = 3.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_xid_events_are_counted_per_gpu_and_code() -> None:
    fake = FakeNvml(h100s(2))
    fake.gpus[1].unsupported.add("device_register_events")
    collector = make(fake, interval=0.02)
    collector.start()
    try:
        wait_for(lambda: fake.event_sets and collector.sampler.snapshot().value)
        for code in (79, 79, 13):
            fake.xid(fake.gpus[0], code)
        wait_for(lambda: has(parse_samples(render(collector.collect())), "gpuio_gpu_xid_errors_total", xid="13"))
        samples = parse_samples(render(collector.collect()))
        assert value(samples, "gpuio_gpu_xid_errors_total", gpu="0", xid="79") == 2
        assert value(samples, "gpuio_gpu_xid_last_timestamp_seconds", gpu="0", xid="13") == pytest.approx(
            time.time(), abs=2)
        assert not has(samples, "gpuio_gpu_xid_errors_total", gpu="1")
    finally:
        collector.stop()
    assert fake.event_sets == [] and fake.initialized == 0  # the listener ended; NVML shut down


def test_a_hung_call_fails_the_collector_without_hanging_the_scrape() -> None:
    fake = FakeNvml(h100s(1))
    collector = make(fake, interval=0.02, hang_timeout=0.3)
    collector.start()
    try:
        wait_for(lambda: collector.sampler.snapshot().value)
        release = fake.hang["device_power_usage"] = threading.Event()
        wait_for(lambda: collector.hung(time.monotonic() + 1.0) is not None)  # a sweep is now stuck
        time.sleep(0.1)
        success, samples = scrape_success(collector)  # stale but within the timeout: served, with its age
        assert success == 1 and value(samples, "gpuio_gpu_snapshot_age_seconds") >= 0.1
        time.sleep(0.3)
        started = time.monotonic()
        success, samples = scrape_success(collector)
        assert time.monotonic() - started < 0.5
        # Past the timeout: the collector fails, and the last snapshot is still served with its age.
        assert success == 0 and has(samples, "gpuio_gpu_up")
        assert value(samples, "gpuio_gpu_snapshot_age_seconds") >= 0.4
        release.set()
        del fake.hang["device_power_usage"]
        wait_for(lambda: scrape_success(collector)[0] == 1)
    finally:
        collector.stop()


def test_no_nvml_on_this_machine_is_no_gpus_and_success() -> None:
    """The real bindings here: no libnvidia-ml (or no driver), so NVMLError_LibraryNotFound."""
    if shutil.which("nvidia-smi"):
        pytest.skip("this machine has an NVIDIA driver")
    collector = NvmlCollector(Context(), {})
    collector.sampler.sample_now()
    with pytest.raises(Absent, match="NVML not available: no GPUs here"):
        collector.collect()
    success, samples = scrape_success(collector)
    assert success == 1 and not any(name.startswith("gpuio_gpu_") for name, _ in samples)
    collector.stop()


def everything() -> str:
    """One scrape with every family the collector has: MIG, Xid, failing calls, a lost GPU, GPM, NVLink."""
    gpus = h100s(3) + [FakeGpu("GPU-M", mig_mode=(1, 0), mig=[FakeMig("MIG-a", 1, 0)], nvlinks=2)]
    gpus[0].processes, gpus[0].process_names = [ProcessInfo(7, 1), ProcessInfo(8, 2)], {7: "a", 8: "b"}
    gpus[1].errors["device_temperature"] = pynvml.NVML_ERROR_TIMEOUT
    gpus[0].add_samples(1, [1])
    gpus[0].add_process_samples(1, 2, {7: (50, 10)})
    fake = FakeNvml(gpus)
    collector = make(fake, max_processes=1)
    holder = DeviceOwner("ns", "pod", "c", "nvidia.com/gpu", gpus[1].uuid, gpus[1].uuid, "")
    collector.context.pods.update_owners([holder])
    collector.sampler.sample_now()  # opens the session and starts the Xid listener
    try:
        gpus[0].add_process_samples(400_000, 2, {7: (50, 10)})
        time.sleep(0.11)  # past GPM's refresh: the second sweep computes every GPM metric
        collector.sampler.sample_now()
        gpus[2].lost = True
        fake.xid(gpus[0], 79)
        wait_for(lambda: "gpuio_gpu_xid_errors_total{" in render(collector.sampler.sample_now().value or []))
        return render(collector.collect())
    finally:
        collector.stop()


def test_every_family_is_served_as_declared() -> None:
    """All of them at once (MIG, Xid, a lost GPU, processes): each in the catalogue (docs/metrics.md) with
    its declared type, label names and label values."""
    text = everything()
    assert len(set(re.findall(r"^# TYPE (\S+) ", text, re.MULTILINE))) == len(DESCS) + len(LEDGER_DESCS)
    assert undeclared(text) == []


def test_flags_and_environment_reach_the_collector() -> None:
    from exporter.config import ConfigError, parse_args

    config = parse_args(["--collector.nvml.interval=500ms"], environ={"GPUIO_COLLECTOR_NVML_MAX_PROCESSES": "8"})
    assert config.collector_options["nvml"] == {"interval": 0.5, "slow-interval": 10.0, "hang-timeout": 10.0,
                                                "reinit-interval": 30.0, "max-processes": 8}
    with pytest.raises(ConfigError, match="--collector.nvml.max-processes.*accepted: a whole number above zero"):
        parse_args(["--collector.nvml.max-processes=0"], environ={})


def write_stat(procfs, pid: int, start_ticks: int) -> None:
    """/proc/<pid>/stat as the kernel writes it, with ``start_ticks`` in field 22 (starttime)."""
    folder = procfs / str(pid)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "stat").write_text(f"{pid} (worker) S " + " ".join(["1"] * 18) + f" {start_ticks} 0 0\n")


def test_slow_sweeps_tell_the_engines_collector_which_gpu_each_process_is_on(tmp_path) -> None:
    procfs = tmp_path / "proc"
    for pid in (101, 102, 103, 201):
        write_stat(procfs, pid, 5000 + pid)
    fake = FakeNvml(h100s(2))
    fake.gpus[0].processes = [ProcessInfo(pid, GIB) for pid in (101, 102, 103, 999)]  # 999: no /proc entry
    fake.gpus[1].processes = [ProcessInfo(201, GIB)]
    collector = make(fake, max_processes=1)
    collector.context = Context(procfs=str(procfs))
    sweep(collector)
    table = collector.context.gpu_processes
    uuids = [gpu.uuid for gpu in fake.gpus]
    # every process, also those the series' cap leaves out; one whose start time is unknown is not listed
    assert [table.get(pid, 5000 + pid) for pid in (101, 102, 103, 201)] == [uuids[0]] * 3 + [uuids[1]]
    assert table.get(999, 0) is None and table.get(999, 5999) is None
    # 201 exited and its pid went to a process started later, which NVML lists on the other GPU
    write_stat(procfs, 201, 9000)
    fake.gpus[1].processes = []
    fake.gpus[0].processes.append(ProcessInfo(201, GIB))
    sweep(collector)
    assert table.get(201, 5201) is None and table.get(201, 9000) == uuids[0] and table.get(101, 5101) == uuids[0]


def test_a_process_on_several_gpus_is_listed_on_each_with_its_memory(tmp_path) -> None:
    """Issue 41: one Triton on every GPU is on none for get(), and on each (NVML index order, its used
    memory per GPU where NVML says it) for gpus_of() and memory_of(); ordered() is every GPU by index."""
    procfs = tmp_path / "proc"
    for pid in (101, 102):
        write_stat(procfs, pid, 5000 + pid)
    fake = FakeNvml(h100s(3))
    uuids = [gpu.uuid for gpu in fake.gpus]
    fake.gpus[2].processes = [ProcessInfo(101, 3 * GIB)]
    fake.gpus[0].processes = [ProcessInfo(101, GIB), ProcessInfo(102, 2 * GIB)]
    fake.gpus[1].processes = [ProcessInfo(101, None)]  # NVML cannot say (MIG without privileges, WDDM)
    collector = make(fake)
    collector.context = Context(procfs=str(procfs))
    sweep(collector)
    table = collector.context.gpu_processes
    assert table.get(101, 5101) is None and table.get(102, 5102) == uuids[0]
    assert table.gpus_of(101, 5101) == (uuids[0], uuids[1], uuids[2])
    assert table.gpus_of(102, 5102) == (uuids[0],) and table.gpus_of(999, 1) == ()
    assert table.memory_of(101, 5101) == {uuids[0]: GIB, uuids[2]: 3 * GIB}
    assert table.memory_of(101, 5100) == {}  # another process under that pid
    assert table.ordered() == tuple(uuids)
    assert table.processes() == {(101, 5101), (102, 5102)}
    # the next sweep replaces it whole: 101 exited
    for gpu in fake.gpus:
        gpu.processes = [p for p in gpu.processes if p.pid != 101]
    sweep(collector)
    assert table.gpus_of(101, 5101) == () and table.memory_of(101, 5101) == {} and table.get(102, 5102) == uuids[0]


def test_cuda_ordinals_are_not_mapped_on_a_node_in_mig_mode(tmp_path) -> None:
    """Under MIG, CUDA enumerates MIG devices, not NVML's GPUs: ordered() says it cannot tell (())."""
    fake = FakeNvml([*h100s(1), FakeGpu("GPU-M", mig_mode=(1, 1), mig=[FakeMig("MIG-a", 1, 0)])])
    collector = make(fake)
    collector.context = Context(procfs=str(tmp_path))
    sweep(collector)
    assert collector.context.gpu_processes.ordered() == ()


def test_a_recycled_pid_left_out_by_the_cap_is_counted_again(tmp_path) -> None:
    """gpuio_gpu_processes_dropped_total counts each process once, when first left out: a new process
    with an old pid is another process."""
    procfs = tmp_path / "proc"
    for pid in (101, 102):
        write_stat(procfs, pid, 100)
    fake = FakeNvml(h100s(1))
    fake.gpus[0].processes = [ProcessInfo(101, 2 * GIB), ProcessInfo(102, GIB)]
    collector = make(fake, max_processes=1)
    collector.context = Context(procfs=str(procfs))
    assert value(sweep(collector), "gpuio_gpu_processes_dropped_total") == 1
    assert value(sweep(collector), "gpuio_gpu_processes_dropped_total") == 1  # the same process: not again
    write_stat(procfs, 102, 700)  # 102 exited; a new process got its pid
    assert value(sweep(collector), "gpuio_gpu_processes_dropped_total") == 2


# -- GPM activity, MIG, per-process utilisation --

ACTIVITY = {  # fake GPM metric id -> (family, labels): the families computed from GPM
    2: ("gpuio_gpu_sm_active_seconds_total", {}),
    3: ("gpuio_gpu_sm_occupancy_seconds_total", {}),
    5: ("gpuio_gpu_pipe_active_seconds_total", {"pipe": "tensor"}),
    7: ("gpuio_gpu_pipe_active_seconds_total", {"pipe": "tensor_hmma"}),
    12: ("gpuio_gpu_pipe_active_seconds_total", {"pipe": "fp32"}),
    10: ("gpuio_gpu_dram_active_seconds_total", {}),
    31: ("gpuio_gpu_media_active_seconds_total", {"media": "nvdec", "media_index": "1"}),
}


def test_gpm_activity_is_counted_in_seconds_whenever_it_is_read() -> None:
    """An SM-active counter adds NVML's average over each window x the window: 0.25 s of work with 90 %
    of the SMs busy adds 0.225 SM-active seconds, read after one sweep or after five."""
    fake = FakeNvml(h100s(1))
    gpu = fake.gpus[0]
    gpu.gpm_refresh = 0.02
    collector = make(fake)
    samples = sweep(collector)  # the first sample: the fast counters start at 0
    assert value(samples, "gpuio_gpu_sm_active_seconds_total") == 0
    assert value(samples, "gpuio_gpu_gpm_supported") == 1
    time.sleep(0.3)
    work = {2: 90 * 0.25, 3: 14 * 0.25, 5: 94 * 0.25, 7: 94 * 0.25, 12: 1 * 0.25, 10: 26 * 0.25, 31: 50 * 0.25}
    gpu.gpm_counters.add(work)  # percent x seconds, as GPM integrates them
    time.sleep(0.05)
    seen = []
    for _ in range(5):
        samples = sweep(collector)
        for metric, (name, labels) in ACTIVITY.items():  # off by at most one refresh over the first window
            assert value(samples, name, **labels) == pytest.approx(work[metric] / 100, rel=0.02 / 0.35 + 0.02), name
        seen.append(value(samples, "gpuio_gpu_sm_active_seconds_total"))
        time.sleep(0.05)
    assert seen == sorted(seen)
    assert not has(samples, "gpuio_gpu_nvml_errors_total")


def test_sm_activity_is_counted_window_by_window_because_gpm_weighs_it_by_sm_cycles() -> None:
    """GPM's SM ratios are shares of elapsed SM cycles and the clock follows the load (H100: 345 MHz idle,
    1980 MHz busy).  An average since a long-lived baseline x its age then over-counts work after idle
    (measured: an FP32 add read 1.34 SM-active seconds per second) and under-counts light work after
    heavy (a spinning block read 0).  Window by window, each reads what the SMs did."""
    fake = FakeNvml(h100s(1))
    gpu = fake.gpus[0]
    gpu.gpm_refresh = 0.01
    gpu.gpm_counters.set_clock(345)
    collector = make(fake)
    sweep(collector)
    time.sleep(0.4)  # idle, at the idle clock
    gpu.gpm_counters.set_clock(1980)
    start = value(sweep(collector), "gpuio_gpu_sm_active_seconds_total")
    time.sleep(0.2)
    gpu.gpm_counters.add({2: 100 * 0.2})  # 0.2 s with every SM busy
    time.sleep(0.03)
    busy = value(sweep(collector), "gpuio_gpu_sm_active_seconds_total") - start
    assert busy == pytest.approx(0.2, rel=0.15)
    time.sleep(0.3)
    gpu.gpm_counters.add({2: 100 / 132 * 0.3})  # 0.3 s of one thread block spinning: 1 SM of 132
    time.sleep(0.03)
    spin = value(sweep(collector), "gpuio_gpu_sm_active_seconds_total") - start - busy
    assert spin == pytest.approx(0.3 / 132, rel=0.2)


def test_a_metric_the_gpu_lacks_is_absent_not_an_error_and_not_asked_again() -> None:
    fake = FakeNvml(h100s(1))
    gpu = fake.gpus[0]
    gpu.gpm_metrics = frozenset({2, 3, 5, 10, 20, 21})  # no per-kind tensor, pipe or media metrics
    gpu.gpm_refresh = 0.01
    collector = make(fake)
    sweep(collector)
    time.sleep(0.02)
    sweep(collector)
    asked = []
    real = fake.gpm_metrics_get
    fake.gpm_metrics_get = lambda first, second, metrics: asked.append(list(metrics)) or real(first, second, metrics)
    time.sleep(0.02)
    samples = sweep(collector)
    assert asked == [[2, 3, 5, 10], [20, 21]]  # the activity ratios, then the byte rates
    assert value(samples, "gpuio_gpu_pipe_active_seconds_total", pipe="tensor") >= 0
    assert not has(samples, "gpuio_gpu_pipe_active_seconds_total", pipe="fp32")
    assert not has(samples, "gpuio_gpu_media_active_seconds_total")
    assert not has(samples, "gpuio_gpu_nvml_errors_total")


def test_a_gpu_without_gpm_has_no_activity_families_a_support_gauge_and_no_noise(caplog) -> None:
    """Before Hopper (or GPM not supported): the families are absent, gpm_supported says why, nothing logged."""
    import logging

    old = FakeGpu("GPU-A100", name="NVIDIA A100-SXM4-80GB", gpm=False)
    fake = FakeNvml([old, *h100s(1)])
    fake.gpus[1].uuid = "GPU-H100"
    collector = make(fake)
    with caplog.at_level(logging.INFO, logger="gpuio.collector.nvml"):
        sweep(collector)
        time.sleep(0.11)
        success, samples = sweep_and_scrape(collector)
    assert success == 1
    assert value(samples, "gpuio_gpu_gpm_supported", uuid="GPU-A100") == 0
    assert value(samples, "gpuio_gpu_gpm_supported", uuid="GPU-H100") == 1
    for name in ("gpuio_gpu_sm_active_seconds_total", "gpuio_gpu_pipe_active_seconds_total",
                 "gpuio_gpu_dram_active_seconds_total", "gpuio_gpu_pcie_receive_bytes_total"):
        assert not has(samples, name, uuid="GPU-A100"), name
        assert has(samples, name, uuid="GPU-H100"), name
    assert not has(samples, "gpuio_gpu_nvml_errors_total")
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []


def test_nvlink_bytes_total_and_per_active_link_only_where_there_is_nvlink() -> None:
    sxm, pcie = FakeGpu("GPU-SXM", nvlinks=3), FakeGpu("GPU-PCIE")
    sxm.gpm_refresh = 0.01
    collector = make(FakeNvml([sxm, pcie]))
    sweep(collector)
    time.sleep(0.02)
    sxm.gpm_counters.add({60: 1024.0, 61: 512.0, 64: 1024.0})  # MiB: all links, and link 1's share
    time.sleep(0.05)
    samples = sweep(collector)
    assert value(samples, "gpuio_gpu_nvlink_receive_bytes_total", uuid="GPU-SXM") == pytest.approx(GIB, rel=0.3)
    assert value(samples, "gpuio_gpu_nvlink_transmit_bytes_total", uuid="GPU-SXM") == pytest.approx(GIB / 2, rel=0.3)
    links = {dict(ls)["link"] for (n, ls), _ in samples.items() if n == "gpuio_gpu_nvlink_link_receive_bytes_total"}
    assert links == {"0", "1", "2"}
    assert value(samples, "gpuio_gpu_nvlink_link_receive_bytes_total", link="1") == pytest.approx(GIB, rel=0.3)
    assert not has(samples, "gpuio_gpu_nvlink_receive_bytes_total", uuid="GPU-PCIE")
    assert has(samples, "gpuio_gpu_sm_active_seconds_total", uuid="GPU-PCIE")


def test_mig_gpu_instances_have_their_own_activity_counters() -> None:
    first, second = FakeMig("MIG-a", 1, 0), FakeMig("MIG-b", 2, 0)
    gpu = FakeGpu("GPU-M", mig_mode=(1, 1), mig=[first, None, second])
    gpu.gpm_refresh = 0.01
    collector = make(FakeNvml([gpu]))
    sweep(collector)
    time.sleep(0.02)
    time.sleep(0.1)
    first.gpm_counters.add({2: 80 * 0.1, 5: 60 * 0.1})  # instance 1 works for 0.1 s; instance 2 idles
    time.sleep(0.02)
    samples = sweep(collector)
    assert value(samples, "gpuio_gpu_mig_sm_active_seconds_total", gpu_instance="1") == pytest.approx(0.08, rel=0.3)
    assert value(samples, "gpuio_gpu_mig_pipe_active_seconds_total", gpu_instance="1",
                 pipe="tensor") == pytest.approx(0.06, rel=0.3)
    assert value(samples, "gpuio_gpu_mig_sm_active_seconds_total", gpu_instance="2") == 0
    assert has(samples, "gpuio_gpu_mig_dram_active_seconds_total", gpu_instance="2")
    assert has(samples, "gpuio_gpu_mig_device_info", mig_uuid="MIG-b", gpu_instance="2")  # the join to mig_uuid
    assert not has(samples, "gpuio_gpu_nvml_errors_total")
    gpu.mig = [first]  # instance 2 destroyed: its series go
    samples = sweep(collector)
    assert not has(samples, "gpuio_gpu_mig_sm_active_seconds_total", gpu_instance="2")


def now_us() -> int:
    return int(time.time() * 1e6)  # NVML stamps per-process samples with the wall clock


def timed_sweep(collector: NvmlCollector) -> tuple[Samples, float, float]:
    started = time.time()
    samples = sweep(collector)
    return samples, started, time.time()


def test_per_process_busy_holds_each_process_last_period_over_the_interval_for_the_listed_processes() -> None:
    """NVML answers each process's last sample period; the collector counts it over the time since its
    previous call, for the processes the list shows (cap 2: the third has no series)."""
    fake = FakeNvml(h100s(1))
    gpu = fake.gpus[0]
    gpu.processes = [ProcessInfo(101, 3 * GIB), ProcessInfo(102, 2 * GIB), ProcessInfo(103, GIB)]
    gpu.process_names = {101: "engine-a", 102: "engine-b", 103: "small"}
    collector = make(fake, max_processes=2)
    gpu.add_process_samples(now_us(), 1, {101: (100, 40)})  # before the exporter: not counted
    _, _, first_end = timed_sweep(collector)
    time.sleep(0.2)
    gpu.add_process_samples(now_us(), 1, {101: (75, 30), 102: (25, 5), 103: (10, 0)})
    samples, second_start, second_end = timed_sweep(collector)
    a = value(samples, "gpuio_gpu_process_sm_busy_seconds_total", pid="101", process_name="engine-a")
    assert 0.75 * (second_start - first_end) <= a <= 0.75 * (second_end - first_end + 0.01)
    assert value(samples, "gpuio_gpu_process_memory_busy_seconds_total", pid="101") == pytest.approx(a * 30 / 75)
    assert value(samples, "gpuio_gpu_process_sm_busy_seconds_total", pid="102") == pytest.approx(a / 3)
    assert not has(samples, "gpuio_gpu_process_sm_busy_seconds_total", pid="103")  # left out by the cap
    time.sleep(0.05)
    samples = sweep(collector)  # no newer period: NotFound, nothing ran, the counters hold
    assert value(samples, "gpuio_gpu_process_sm_busy_seconds_total", pid="101") == a
    assert not has(samples, "gpuio_gpu_nvml_errors_total")


def test_a_process_starting_after_idle_is_counted_from_the_previous_call_not_over_the_idle_stretch() -> None:
    """NotFound (nothing ran in NVML's last period) is an idle interval.  Holding the first busy period
    after it over the whole stretch since the last answer counted a process that had just started as
    busy through seconds of idle."""
    fake = FakeNvml(h100s(1))
    gpu = fake.gpus[0]
    gpu.processes = [ProcessInfo(101, GIB)]
    collector = make(fake)
    gpu.add_process_samples(now_us(), 1, {101: (100, 0)})
    sweep(collector)  # the baseline
    for _ in range(3):  # idle: three sweeps answered NotFound
        time.sleep(0.1)
        sweep(collector)
    _, idle_start, _ = timed_sweep(collector)
    time.sleep(0.1)
    gpu.add_process_samples(now_us(), 1, {101: (100, 0)})  # it runs now
    samples, _, end = timed_sweep(collector)
    assert value(samples, "gpuio_gpu_process_sm_busy_seconds_total", pid="101") <= end - idle_start


def test_per_process_series_stay_through_failed_calls_and_go_only_where_the_driver_lacks_the_call() -> None:
    """A refusal about the moment (Timeout, NoPermission) is counted and asked again, the series and
    their values kept (a flickering series breaks rate(), and one refusal must not remove the families
    until NVML restarts); NotSupported means this GPU or driver lacks it: absent, not zero."""
    fake = FakeNvml(h100s(1))
    gpu = fake.gpus[0]
    gpu.processes = [ProcessInfo(101, GIB)]
    collector = make(fake)
    gpu.errors["device_process_utilization"] = pynvml.NVML_ERROR_NO_PERMISSION
    samples = sweep(collector)
    assert value(samples, "gpuio_gpu_process_sm_busy_seconds_total", pid="101") == 0
    assert value(samples, "gpuio_gpu_nvml_errors_total", call="process_utilization", error="NoPermission") == 1
    del gpu.errors["device_process_utilization"]
    gpu.add_process_samples(now_us(), 1, {101: (50, 0)})
    sweep(collector)  # answered now: the baseline
    time.sleep(0.05)
    gpu.add_process_samples(now_us(), 1, {101: (50, 0)})
    before = value(sweep(collector), "gpuio_gpu_process_sm_busy_seconds_total", pid="101")
    assert before > 0
    gpu.errors["device_process_utilization"] = pynvml.NVML_ERROR_TIMEOUT
    samples = sweep(collector)
    assert value(samples, "gpuio_gpu_process_sm_busy_seconds_total", pid="101") == before
    assert value(samples, "gpuio_gpu_nvml_errors_total", call="process_utilization", error="Timeout") == 1
    gpu.errors["device_process_utilization"] = pynvml.NVML_ERROR_NOT_SUPPORTED
    samples = sweep(collector)
    assert not has(samples, "gpuio_gpu_process_sm_busy_seconds_total")
    assert has(samples, "gpuio_gpu_process_memory_used_bytes", pid="101")


def test_process_busy_skips_stale_and_garbage_samples() -> None:
    """NVML has been seen to return samples older than the timestamp passed and figures above 100 %
    (nvtop filters both): neither is counted; of several samples of one process the newest counts."""
    from exporter.collectors.nvml import ProcessBusy
    from exporter.host.nvml_device import ProcessUtilization

    busy = ProcessBusy(8)
    busy.feed([], 100.0)
    busy.feed([ProcessUtilization(1, 100_500_000, 50, 10)], 101.0)  # 1 s at 50 %
    assert busy.seconds[1] == pytest.approx([0.5, 0.1])
    busy.feed([ProcessUtilization(1, 100_500_000, 90, 0),  # the same period again
               ProcessUtilization(1, 99_000_000, 90, 0),  # older than the previous call
               ProcessUtilization(2, 101_500_000, 255, 0),  # garbage
               ProcessUtilization(3, 101_400_000, 20, 0), ProcessUtilization(3, 101_600_000, 40, 0)], 102.0)
    assert busy.seconds[1] == pytest.approx([0.5, 0.1])
    assert 2 not in busy.seconds
    assert busy.seconds[3] == pytest.approx([0.4, 0.0])


def test_activity_counters_carry_over_a_moved_baseline_and_a_new_nvml_session(monkeypatch) -> None:
    """The baseline moves every GPM_REBASE seconds and a re-initialised session starts a new one: the
    counters carry on from their totals (kept by UUID), never going back, never counting twice."""
    from exporter.collectors import nvml as module

    monkeypatch.setattr(module, "GPM_REBASE", 0.05)
    fake = FakeNvml(h100s(1))
    gpu = fake.gpus[0]
    gpu.gpm_refresh = 0.01
    collector = make(fake, reinit_interval=0.01)
    sweep(collector)
    done = 0.0
    for round_ in range(3):
        time.sleep(0.06)
        gpu.gpm_counters.add({2: 100 * 0.05, 21: 1024.0})  # 0.05 SM-active seconds and 1 GiB each round
        done += 0.05
        time.sleep(0.02)  # past GPM's refresh and past GPM_REBASE: the baseline moves at this sweep
        samples = sweep(collector)
        assert value(samples, "gpuio_gpu_sm_active_seconds_total") == pytest.approx(done, rel=0.2), round_
    before = value(samples, "gpuio_gpu_pcie_receive_bytes_total")
    assert before == pytest.approx(3 * GIB, rel=0.2)
    gpu.lost = True  # a lost GPU: a new NVML session after reinit-interval, new GPM buffers
    sweep(collector)
    gpu.lost = False
    time.sleep(0.02)
    sweep(collector)  # the new session's baseline
    time.sleep(0.06)
    gpu.gpm_counters.add({2: 100 * 0.05})
    time.sleep(0.02)
    samples = sweep(collector)
    assert fake.calls["init"] == 2
    assert value(samples, "gpuio_gpu_sm_active_seconds_total") == pytest.approx(done + 0.05, rel=0.2)
    assert value(samples, "gpuio_gpu_pcie_receive_bytes_total") >= before


def test_a_listed_process_gets_its_busy_seconds_whatever_else_ran() -> None:
    """Busy seconds are tracked for at most 4 x max-processes pids.  NVML answers for every process that
    ran; those that filled the table first (the answer's order) kept a listed process out, whose series
    then read 0 busy seconds for ever: an idle-looking process that was not idle.  The listed ones
    (largest memory first) are tracked first."""
    fake = FakeNvml(h100s(1))
    gpu = fake.gpus[0]
    gpu.processes = [ProcessInfo(pid, pid * GIB) for pid in range(101, 107)]  # 106 uses the most memory
    gpu.process_names = {pid: f"worker-{pid}" for pid in range(101, 107)}
    collector = make(fake, max_processes=1)  # lists 106 only; tracks 4 pids
    sweep(collector)  # the baseline
    time.sleep(0.2)
    gpu.add_process_samples(now_us(), 1, {pid: (50, 10) for pid in range(101, 107)})  # every one ran, at 50 %
    samples, started, ended = timed_sweep(collector)
    busy = value(samples, "gpuio_gpu_process_sm_busy_seconds_total", pid="106")
    assert 0.5 * 0.2 <= busy <= 0.5 * (ended - started + 0.2) + 0.05  # its half of the interval, not 0
