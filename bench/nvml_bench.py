"""What the nvml collector costs: each NVML call group, the sampler's CPU at 1 Hz, the scrape's render per GPU.

Targets (issue 3): the GPU part of a scrape (rendering the snapshot) at most 0.1 ms per GPU; the sampler
at most 1 % of one core at 1 Hz per H100.  Peers measured in the same run: prometheus_client rendering
the very same samples (the render), and one ``nvidia-smi --query-gpu`` per second, which is what
nvidia_gpu_exporter runs per scrape (the sampler).

    python bench/nvml_bench.py            # the real NVML when this machine has one, else the fake
    python bench/nvml_bench.py --fake 8   # the fake NVML with 8 GPUs: only the render figures mean much

CPU time is the calling thread's (time.thread_time), so it is the collector's own cost, not the
machine's; "wall" includes time NVML spends waiting on the driver.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import resource
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
LIBRARY = os.path.join(REPO, "exporter", "instrument")  # gpuio, the instrumentation library, from this checkout
sys.path.insert(0, LIBRARY)
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, (LIBRARY, os.environ.get("PYTHONPATH"))))

from exporter.collectors import nvml as NVML  # noqa: E402
from exporter.context import Context  # noqa: E402  (after the path is set)
from exporter.exposition import render  # noqa: E402
from exporter.host.nvml_device import GPU_UTILIZATION_SAMPLES, NVMLError, PyNvml  # noqa: E402
from tests.gpu.gpu_checks import COMPARISONS  # noqa: E402


def cost(function: Callable[[], Any], repeat: int) -> tuple[float, float]:
    """Mean (wall, CPU) seconds of one call."""
    wall, cpu = time.perf_counter(), time.thread_time()
    for _ in range(repeat):
        function()
    return (time.perf_counter() - wall) / repeat, (time.thread_time() - cpu) / repeat


def call_groups(nvml: Any, handle: Any) -> list[tuple[str, str, Callable[[], Any]]]:
    """(cadence, name, one cycle of the group) as the collector calls them, on one GPU."""
    recent = max(ts for ts, _ in nvml.device_samples(handle, GPU_UTILIZATION_SAMPLES, 0))
    gpm = [nvml.gpm_sample_alloc(), nvml.gpm_sample_alloc()]
    nvml.gpm_sample_get(handle, gpm[0])

    def samples() -> None:
        with contextlib.suppress(NVMLError):  # NotFound: no sample in the last second
            nvml.device_samples(handle, GPU_UTILIZATION_SAMPLES, recent - 1_000_000)  # about one second's worth

    fast = [metric.metric for metric in NVML.GPM_METRICS[:6]]  # SM, occupancy, tensor, DRAM, PCIe tx/rx
    every = [metric.metric for metric in NVML.GPM_METRICS] + [metric.metric for metric in NVML.NVLINK_TOTALS]

    def gpm_cycle(metrics: list[int]) -> Callable[[], None]:
        def cycle() -> None:
            nvml.gpm_sample_get(handle, gpm[1])
            nvml.gpm_metrics_get(gpm[0], gpm[1], metrics)

        return cycle

    def process_utilization() -> None:
        with contextlib.suppress(NVMLError):  # NotFound: no process ran in the last second
            nvml.device_process_utilization(handle, int(time.time() * 1e6) - 1_000_000)

    def processes() -> None:
        for process in nvml.device_compute_running_processes(handle):
            nvml.system_process_name(process.pid)

    return [
        ("session", "identity: uuid, name, pci, serial, minor, limits (once per session)",
         lambda: (nvml.device_uuid(handle), nvml.device_name(handle), nvml.device_pci_bus_id(handle),
                  nvml.device_serial(handle), nvml.device_minor_number(handle), nvml.device_max_clock_info(handle, 1),
                  nvml.device_max_clock_info(handle, 2), nvml.device_max_pcie_link_generation(handle),
                  nvml.device_max_pcie_link_width(handle))),
        ("1 s", "utilisation samples (nvmlDeviceGetSamples)", samples),
        ("1 s", "utilisation rates", lambda: nvml.device_utilization_rates(handle)),
        ("1 s", "memory info v2", lambda: nvml.device_memory_info_v2(handle)),
        ("1 s", "temperature, power, limit, SM + memory clock, link gen + width",
         lambda: (nvml.device_temperature(handle, 0), nvml.device_power_usage(handle),
                  nvml.device_enforced_power_limit(handle), nvml.device_clock_info(handle, 1),
                  nvml.device_clock_info(handle, 2), nvml.device_curr_pcie_link_generation(handle),
                  nvml.device_curr_pcie_link_width(handle))),
        ("1 s", "memory temperature (field 82)", lambda: nvml.device_field_values(handle, [82])),
        ("1 s", "clock event reasons", lambda: nvml.device_current_clocks_event_reasons(handle)),
        ("-", f"GPM sample + {len(fast)} metrics (SM, occupancy, tensor, DRAM, PCIe): for comparison",
         gpm_cycle(fast)),
        ("1 s", f"GPM sample + {len(every)} metrics (all the collector asks: + pipes, media, NVLink)",
         gpm_cycle(every)),
        ("10 s", "total energy", lambda: nvml.device_total_energy_consumption(handle)),
        ("10 s", "violation counters (5 fields)", lambda: nvml.device_field_values(handle, [74, 76, 269, 270, 271])),
        ("10 s", "PCIe replay counter", lambda: nvml.device_pcie_replay_counter(handle)),
        ("10 s", "ECC (4 counters)",
         lambda: [nvml.device_total_ecc_errors(handle, kind, counter) for kind in (0, 1) for counter in (0, 1)]),
        ("10 s", "remapped rows", lambda: nvml.device_remapped_rows(handle)),
        ("10 s", "processes + names", processes),
        ("1 s", "per-process utilisation (nvmlDeviceGetProcessUtilization)", process_utilization),
        ("10 s", "MIG mode", lambda: nvml.device_mig_mode(handle)),
    ]


def bench_call_groups(nvml: Any, repeat: int) -> None:
    handle = nvml.device_handle_by_index(0)
    print(f"\nNVML call groups on GPU 0 ({nvml.device_name(handle)}, driver {nvml.system_driver_version()}),"
          f" mean of {repeat} cycles")
    print(f"{'cadence':>8}  {'group':64} {'wall us':>9} {'cpu us':>9}")
    per_second = 0.0
    for cadence, name, function in call_groups(nvml, handle):
        try:
            wall, cpu = cost(function, repeat)
        except NVMLError as exc:
            print(f"{cadence:>8}  {name:64} {'unsupported: ' + type(exc).__name__:>19}")
            continue
        per_second += cpu if cadence == "1 s" else cpu / 10 if cadence == "10 s" else 0.0
        print(f"{cadence:>8}  {name:64} {wall * 1e6:9.1f} {cpu * 1e6:9.1f}")
    print(f"NVML calls alone at 1 Hz (slow group every 10 s): {per_second * 1e3:.2f} ms CPU per second "
          f"= {per_second * 100:.2f} % of one core per GPU")


def thread_cpu(name: str) -> float:
    """CPU seconds of this process's thread called ``name`` (from /proc, so any thread can be read)."""
    for thread in threading.enumerate():
        if thread.name == name and thread.native_id is not None:
            with open(f"/proc/self/task/{thread.native_id}/stat") as handle:
                fields = handle.read().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return 0.0


def bench_sampler(collector: Any, sweeps: int, spacing: float, gpus: int) -> None:
    """The collector's own sweep, on this thread, spaced as its thread spaces them (slow group every 10th)."""
    collector.sampler.sample_now()  # session, identity, baselines
    listener_before, cpus = thread_cpu("gpuio-nvml-xid"), []
    started = time.monotonic()
    for _ in range(sweeps):
        time.sleep(spacing)
        cpu = time.thread_time()
        collector.sweep()
        cpus.append(time.thread_time() - cpu)
    listener = (thread_cpu("gpuio-nvml-xid") - listener_before) / (time.monotonic() - started)
    per_second = statistics.mean(cpus) + listener
    print(f"\nSampler: {sweeps} sweeps of {gpus} GPU(s), {spacing:g} s apart; CPU per sweep: median "
          f"{statistics.median(cpus) * 1e3:.2f} ms, max {max(cpus) * 1e3:.2f} ms (with the slow group), mean "
          f"{statistics.mean(cpus) * 1e3:.2f} ms; Xid listener thread {listener * 1e3:.3f} ms/s")
    print(f"Sampler at 1 Hz: {per_second * 1e3:.2f} ms CPU per second = {per_second * 100 / gpus:.2f} % of one core "
          f"per GPU (target <= 1 %)")


def bench_render(collector: Any, gpus: int, repeat: int) -> None:
    """collect() + render(): what a scrape spends on the GPU part, against prometheus_client on the same samples."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.core import Metric
    from prometheus_client.parser import text_string_to_metric_families

    text = render(collector.collect())
    wall, _ = cost(lambda: render(collector.collect()), repeat)
    families: list[Metric] = list(text_string_to_metric_families(text))

    class Same:
        def collect(self) -> list[Metric]:
            return families

    registry = CollectorRegistry()
    registry.register(Same())  # type: ignore[arg-type]
    peer, _ = cost(lambda: generate_latest(registry), max(1, repeat // 10))
    lines = sum(1 for line in text.splitlines() if not line.startswith("#"))
    print(f"\nRender: {lines} sample lines for {gpus} GPU(s); collect()+render() {wall * 1e6 / gpus:.1f} us per GPU "
          f"(target <= 100 us); prometheus_client on the same samples {peer * 1e6 / gpus:.1f} us per GPU "
          f"(gpuio takes {wall / peer:.4f} of the peer's time)")


def bench_nvidia_smi(runs: int) -> None:
    fields = ",".join(["index", "uuid", "name", *(spec.field for spec in COMPARISONS)])
    before, wall = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    for _ in range(runs):
        subprocess.run(["nvidia-smi", f"--query-gpu={fields}", "--format=csv"], capture_output=True, check=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime) / runs
    print(f"\nPeer: one nvidia-smi --query-gpu ({len(fields.split(','))} fields) takes "
          f"{(time.perf_counter() - wall) / runs * 1e3:.0f} ms and {cpu * 1e3:.0f} ms CPU: once a second that is "
          f"{cpu * 100:.1f} % of one core")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fake", type=int, metavar="GPUS", help="use the fake NVML with this many GPUs")
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()
    real = args.fake is None and _real_nvml()
    spacing = 0.5 if real else 0.01
    # the slow group once every 10 sweeps, as at the defaults (1 s and 10 s)
    options = {"interval": 1.0, "slow-interval": spacing * 9.5, "hang-timeout": 30.0, "reinit-interval": 30.0,
               "max-processes": 64}
    if real:
        nvml: Any = PyNvml()
        nvml.init()
        gpus = nvml.device_count()
        bench_call_groups(nvml, args.repeat)
    else:
        from tests.unit.test_nvml_fake import FakeNvml, h100s

        gpus = args.fake or 8
        nvml = FakeNvml(h100s(gpus))
        print(f"fake NVML with {gpus} GPUs: call costs are Python's, not the driver's")
    collector = NVML.NvmlCollector(Context(), options, nvml=nvml)
    try:
        bench_sampler(collector, 30 if real else 50, spacing, gpus)
        bench_render(collector, gpus, 2000)
    finally:
        collector.stop()
    if real:
        bench_nvidia_smi(5)


def _real_nvml() -> bool:
    try:
        nvml = PyNvml()
        nvml.init()
        nvml.shutdown()
        return True
    except NVMLError:
        return False


if __name__ == "__main__":
    main()
