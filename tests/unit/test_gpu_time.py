"""The GPU-time ledger: what engines do on each GPU (the engine service's work measurement, from a spool
the real library writes), which disks are saturated (the real /proc/diskstats parser on recorded
files), and the ledger that turns them and each GPU's activity into seconds per state, per GPU and per
pod, through the nvml collector on the fake NVML (CI has no GPU; tests/gpu/gpu_time_check.py runs it on a
real one)."""

from __future__ import annotations

import os

import pytest

import gpuio
from exporter.collectors.nvml_ledger import (
    ALLOCATED_IDLE,
    IDLE,
    LOADING,
    MAX_PODS_PER_DEVICE,
    SERVING,
    STARVED,
    STATES,
    WORK_MAX_AGE,
    DeviceReading,
    GpuLedger,
)
from exporter.context import Context, DeviceWork
from exporter.exposition import render
from exporter.host.diskstats import SaturatedDisks
from exporter.pods.podresources import DeviceOwner
from tests.conftest import engines_collector, parse_samples
from tests.unit.test_nvml_collector import make, value
from tests.unit.test_nvml_fake import FakeNvml, h100s

GPU_A, GPU_B = "GPU-aaaaaaaa-0000-0000-0000-000000000001", "GPU-bbbbbbbb-0000-0000-0000-000000000002"


@pytest.fixture
def library(tmp_path, monkeypatch):
    """The instrumentation library writing to a spool in this process, as a pod's process would."""
    monkeypatch.setenv("POD_NAMESPACE", "serving")
    monkeypatch.setenv("POD_NAME", "detector-0")
    monkeypatch.setenv("CONTAINER_NAME", "server")
    spool = str(tmp_path / "spool")
    os.makedirs(spool)
    gpuio.close()
    gpuio.configure(spool)
    yield spool
    gpuio.close()
    gpuio.configure(None)


# --- the engine service's measurement of work ------------------------------------------------------


def test_the_engine_service_measures_requests_in_flight_and_loads_per_gpu(library, tmp_path) -> None:
    model = tmp_path / "detector.plan"
    model.write_bytes(b"x" * 4096)
    serving = gpuio.engine("detector")
    serving.set_info(str(model), gpu_uuid=GPU_A)
    loading = gpuio.engine("ranker")
    collector = engines_collector(library)
    with serving.infer(), serving.infer(), loading.loading(str(model), gpu_uuid=GPU_B):
        assert collector.service.measure_work() == 2
        work = collector.context.gpu_work
        assert work.get(GPU_A) == DeviceWork(in_flight=2.0, pods={("serving", "detector-0"): SERVING})
        assert work.get(GPU_B) == DeviceWork(loading=1.0, pods={("serving", "detector-0"): LOADING})
    collector.service.measure_work()  # the requests ended and the load finished
    assert collector.context.gpu_work.get(GPU_A) is None and collector.context.gpu_work.get(GPU_B) is None
    assert collector.context.gpu_work.measured_at() is not None


def test_a_pool_with_every_context_busy_is_work_waiting(library) -> None:
    metrics = gpuio.engine("detector")
    metrics.set_info(__file__, gpu_uuid=GPU_A)
    metrics.pool_contexts.set(2)
    collector = engines_collector(library)
    with metrics.infer():
        collector.service.measure_work()
        assert collector.context.gpu_work.get(GPU_A).waiting is False  # one of two contexts busy: no queue
        with metrics.infer():
            collector.service.measure_work()
            assert collector.context.gpu_work.get(GPU_A).waiting is True


# --- saturated disks, judged as gpuio top and the rules judge them -----------------------------------

DISKSTATS = "   8       0 sda {reads} 0 {sectors} {read_ms} 0 0 0 0 {in_flight} {io_ms} {weighted_ms} 0 0 0 0 0 0\n"


def write_host(root, reads: int, read_ms: int, weighted_ms: int, stall_us: int, rotational: str = "1") -> None:
    (root / "proc" / "pressure").mkdir(parents=True, exist_ok=True)
    (root / "proc" / "diskstats").write_text(DISKSTATS.format(reads=reads, sectors=reads * 8, read_ms=read_ms,
                                                              in_flight=4, io_ms=read_ms, weighted_ms=weighted_ms))
    (root / "proc" / "pressure" / "io").write_text(f"some avg10=0.00 avg60=0.00 avg300=0.00 total={stall_us}\n"
                                                   f"full avg10=0.00 avg60=0.00 avg300=0.00 total={stall_us}\n")
    (root / "sys" / "block" / "sda" / "queue").mkdir(parents=True, exist_ok=True)
    (root / "sys" / "block" / "sda" / "queue" / "rotational").write_text(rotational + "\n")


def test_a_slow_disk_with_a_deep_queue_is_saturated_and_a_busy_fast_one_is_not(tmp_path) -> None:
    write_host(tmp_path, reads=1000, read_ms=1000, weighted_ms=1000, stall_us=0)
    disks = SaturatedDisks(str(tmp_path / "proc"), str(tmp_path / "sys"))
    assert disks.judge({"sda"}, now=100.0) == frozenset()  # the first call is the baseline
    # 1 s later: 200 reads of 80 ms each (a spinning disk's limit is 50 ms) and a queue of 16 (limit 4).
    write_host(tmp_path, reads=1200, read_ms=17000, weighted_ms=17000, stall_us=0)
    assert disks.judge({"sda"}, now=101.0) == {"sda"}
    # Then 2,000 reads of 1 ms with a queue of 2: busy, not saturated.
    write_host(tmp_path, reads=3200, read_ms=19000, weighted_ms=19000, stall_us=0)
    assert disks.judge({"sda"}, now=102.0) == frozenset()


def test_a_slow_disk_is_saturated_with_the_nodes_io_pressure_instead_of_a_deep_queue(tmp_path) -> None:
    write_host(tmp_path, reads=0, read_ms=0, weighted_ms=0, stall_us=0)
    disks = SaturatedDisks(str(tmp_path / "proc"), str(tmp_path / "sys"))
    disks.judge({"sda"}, now=0.0)
    write_host(tmp_path, reads=100, read_ms=8000, weighted_ms=2000, stall_us=0)  # slow, queue of 2: no pressure
    assert disks.judge({"sda"}, now=1.0) == frozenset()
    write_host(tmp_path, reads=200, read_ms=16000, weighted_ms=4000, stall_us=500_000)  # half the second stalled
    assert disks.judge({"sda"}, now=2.0) == {"sda"}


def test_an_unreadable_diskstats_saturates_nothing(tmp_path) -> None:
    disks = SaturatedDisks(str(tmp_path / "no-proc"), str(tmp_path / "no-sys"))
    assert disks.judge({"sda"}, now=0.0) == frozenset() and disks.judge({"sda"}, now=1.0) == frozenset()


# --- the ledger -------------------------------------------------------------------------------------


class Clock:
    """The sweeps' monotonic clock, and the engine work measured just before each sweep."""

    def __init__(self, context: Context) -> None:
        self.context, self.now = context, 1000.0

    def sweep(self, ledger: GpuLedger, seconds: float, readings: list[DeviceReading],
              work: dict[str, DeviceWork] | None = None) -> None:
        self.now += seconds
        if work is not None:
            self.context.gpu_work.update(work, self.now)
        ledger.advance(readings, self.now)


def owner(namespace: str, pod: str, uuid: str) -> DeviceOwner:
    """A container the kubelet gave GPU ``uuid`` (pod resources' List, the device plugin's resource)."""
    return DeviceOwner(namespace, pod, "server", "nvidia.com/gpu", uuid, uuid, "")


def reading(uuid: str, busy: float, processes: bool = False) -> DeviceReading:
    return DeviceReading(uuid, busy, None, processes)


def seconds(ledger: GpuLedger, uuid: str) -> dict[str, float]:
    samples = parse_samples(render(ledger.families()))
    return {state: value(samples, "gpuio_gpu_time_seconds_total", uuid=uuid, state=state) for state in STATES}


def test_every_second_of_a_gpu_goes_to_one_state_and_they_add_up_to_the_wall_time() -> None:
    context = Context()
    ledger, clock = GpuLedger(lambda: context), Clock(context)
    busy = 0.0
    clock.sweep(ledger, 0, [reading(GPU_A, busy)], {})  # first seen: the baseline
    for _ in range(10):  # serving
        busy += 0.9
        clock.sweep(ledger, 1.0, [reading(GPU_A, busy, processes=True)], {GPU_A: DeviceWork(in_flight=3)})
    for _ in range(5):  # loading
        clock.sweep(ledger, 1.0, [reading(GPU_A, busy, processes=True)], {GPU_A: DeviceWork(loading=1)})
    for _ in range(7):  # a process holds it, nothing to do
        clock.sweep(ledger, 1.0, [reading(GPU_A, busy, processes=True)], {})
    for _ in range(3):  # the process exited
        clock.sweep(ledger, 1.0, [reading(GPU_A, busy)], {})
    assert seconds(ledger, GPU_A) == {SERVING: 10.0, LOADING: 5.0, STARVED: 0.0, ALLOCATED_IDLE: 7.0, IDLE: 3.0}


def test_starved_is_waiting_work_on_a_gpu_without_activity_over_a_saturated_disk_and_nothing_less() -> None:
    context = Context()
    ledger, clock = GpuLedger(lambda: context), Clock(context)
    clock.sweep(ledger, 0, [reading(GPU_A, 0.0)], {})
    storm = DeviceWork(in_flight=8, waiting=True, disk_saturated=True)
    clock.sweep(ledger, 2.0, [reading(GPU_A, 0.1)], {GPU_A: storm})  # 5 % busy: starved
    clock.sweep(ledger, 2.0, [reading(GPU_A, 1.9)], {GPU_A: storm})  # 90 % busy: the GPU works, serving
    clock.sweep(ledger, 2.0, [reading(GPU_A, 1.9)], {GPU_A: DeviceWork(in_flight=8, waiting=True)})  # disk fine
    clock.sweep(ledger, 2.0, [reading(GPU_A, 1.9)], {GPU_A: DeviceWork(in_flight=1, disk_saturated=True)})  # no queue
    clock.sweep(ledger, 2.0, [DeviceReading(GPU_A, None, None, False)], {GPU_A: storm})  # no activity reading
    assert seconds(ledger, GPU_A)[STARVED] == 2.0 and seconds(ledger, GPU_A)[SERVING] == 8.0


def test_a_pod_holding_a_gpu_with_nothing_running_is_allocated_idle_and_each_pod_has_its_own_state() -> None:
    context = Context()
    context.pods.update_owners([owner("serving", "idle-0", GPU_A),
                                owner("serving", "busy-0", GPU_A)])
    ledger, clock = GpuLedger(lambda: context), Clock(context)
    clock.sweep(ledger, 0, [reading(GPU_A, 0.0), reading(GPU_B, 0.0)], {})
    work = {GPU_A: DeviceWork(in_flight=1, pods={("serving", "busy-0"): SERVING})}
    for _ in range(4):
        clock.sweep(ledger, 1.5, [reading(GPU_A, 0.0), reading(GPU_B, 0.0)], work)
    samples = parse_samples(render(ledger.families()))
    pod = "gpuio_pod_gpu_time_seconds_total"
    assert value(samples, pod, namespace="serving", pod="busy-0", uuid=GPU_A, state=SERVING) == 6.0
    assert value(samples, pod, namespace="serving", pod="idle-0", uuid=GPU_A, state=ALLOCATED_IDLE) == 6.0
    assert value(samples, pod, namespace="serving", pod="idle-0", uuid=GPU_A, state=SERVING) == 0.0
    assert seconds(ledger, GPU_A)[SERVING] == 6.0 and seconds(ledger, GPU_B)[IDLE] == 6.0


def test_pods_past_the_cap_are_counted_as_left_out_seconds() -> None:
    context = Context()
    context.pods.update_owners([owner("batch", f"job-{index:02}", GPU_A)
                                for index in range(MAX_PODS_PER_DEVICE + 4)])
    ledger, clock = GpuLedger(lambda: context), Clock(context)
    clock.sweep(ledger, 0, [reading(GPU_A, 0.0)], {})
    clock.sweep(ledger, 2.0, [reading(GPU_A, 0.0)], {})
    samples = parse_samples(render(ledger.families()))
    pods = {labels for (name, labels), _ in samples.items() if name == "gpuio_pod_gpu_time_seconds_total"}
    assert len({dict(labels)["pod"] for labels in pods}) == MAX_PODS_PER_DEVICE
    assert value(samples, "gpuio_pod_gpu_time_left_out_seconds_total", uuid=GPU_A) == 8.0


def test_engine_work_measured_too_long_ago_is_not_work_now() -> None:
    """The engines collector stopped measuring (turned off, its thread stuck): a GPU is not serving for
    ever on its last word."""
    context = Context()
    ledger, clock = GpuLedger(lambda: context), Clock(context)
    clock.sweep(ledger, 0, [reading(GPU_A, 0.0, processes=True)], {GPU_A: DeviceWork(in_flight=1)})
    clock.sweep(ledger, 1.0, [reading(GPU_A, 0.0, processes=True)])
    clock.sweep(ledger, WORK_MAX_AGE + 1, [reading(GPU_A, 0.0, processes=True)])
    assert seconds(ledger, GPU_A)[SERVING] == 1.0 and seconds(ledger, GPU_A)[ALLOCATED_IDLE] == WORK_MAX_AGE + 1


def test_the_nvml_collector_serves_the_ledger_with_states_adding_up_to_the_time_between_its_sweeps() -> None:
    fake = FakeNvml(h100s(2))
    collector = make(fake)
    collector.context.gpu_work.update({fake.gpus[0].uuid: DeviceWork(in_flight=1)}, 0.0)
    collector.sampler.sample_now()
    first = collector.ledger._last[fake.gpus[0].uuid][0]
    collector.context.gpu_work.update({fake.gpus[0].uuid: DeviceWork(in_flight=1)}, first)
    collector.sampler.sample_now()
    last = collector.ledger._last[fake.gpus[0].uuid][0]
    samples = parse_samples(render(collector.collect()))
    for gpu, busiest in ((fake.gpus[0], SERVING), (fake.gpus[1], IDLE)):
        states = {state: value(samples, "gpuio_gpu_time_seconds_total", uuid=gpu.uuid, state=state)
                  for state in STATES}
        assert sum(states.values()) == pytest.approx(last - first)
        assert states[busiest] == pytest.approx(last - first)


def test_a_gpu_in_mig_mode_is_accounted_as_its_mig_devices_and_a_pod_holding_one_once() -> None:
    """No second counted twice: the GPU's own series stop when it is cut into MIG devices, and the pod the
    kubelet gave a MIG device is accounted on that device alone."""
    from tests.unit.test_nvml_fake import FakeGpu, FakeMig

    mig = FakeGpu("GPU-M", mig_mode=(1, 0), mig=[FakeMig("MIG-a", 1, 0), FakeMig("MIG-b", 2, 0)])
    collector = make(FakeNvml([mig]))
    collector.context.pods.update_owners([owner("research", "notebook", "MIG-a")])
    for _ in range(3):
        collector.sampler.sample_now()
    samples = parse_samples(render(collector.collect()))
    devices = {dict(labels)["uuid"] for (name, labels), _ in samples.items() if name == "gpuio_gpu_time_seconds_total"}
    assert devices == {"MIG-a", "MIG-b"}
    assert value(samples, "gpuio_gpu_time_seconds_total", uuid="MIG-a", state=ALLOCATED_IDLE) > 0
    assert value(samples, "gpuio_gpu_time_seconds_total", uuid="MIG-b", state=IDLE) > 0
    pods = {(dict(labels)["uuid"], dict(labels)["state"]) for (name, labels), seconds in samples.items()
            if name == "gpuio_pod_gpu_time_seconds_total" and seconds > 0}
    assert pods == {("MIG-a", ALLOCATED_IDLE)}


def test_a_pod_whose_process_holds_a_gpu_is_accounted_without_the_kubelet() -> None:
    """A process with a CUDA context on the GPU, in a pod its cgroup names (the nvml collector's process
    pods): that pod holds the GPU, allocated_idle while no engine has work there."""
    context = Context()
    ledger, clock = GpuLedger(lambda: context), Clock(context)
    held = DeviceReading(GPU_A, 0.0, None, True, frozenset({("batch", "trainer-0")}))
    clock.sweep(ledger, 0, [held], {})
    clock.sweep(ledger, 3.0, [held], {})
    samples = parse_samples(render(ledger.families()))
    assert value(samples, "gpuio_pod_gpu_time_seconds_total", namespace="batch", pod="trainer-0", uuid=GPU_A,
                 state=ALLOCATED_IDLE) == 3.0
