"""GPM activity, per-process utilisation and their cost on a real Hopper GPU: loads of known shape, the
collector's counters read around each, printed side by side with NVML's busy counter.

    PYTHONPATH=. python3 tests/gpu/gpm_check.py          # exit 1 on a failed check, 2 without GPM

What each load must show (the collector's counters over a window inside the load):

- ``duty``: bf16 matmuls 50 % of every second: busy and SM activity both about 0.5 (SM activity a bit
  under busy: a matmul does not keep every SM busy from its first to its last cycle).
- ``spin``: one thread block spinning (torch.cuda._sleep): NVML busy about 1.0, SM activity about one
  SM's share (1/132 on an H100 SXM): "utilised" with no SM working.
- ``bf16``: bf16 matmuls back to back: tensor-pipe activity high.
- ``fp32add``: an FP32 elementwise add over 1 GiB: SM activity high, tensor activity about 0.
- ``copy``: device-to-device copies: DRAM bandwidth utilisation high; printed beside the bytes the copy
  moved per second (read + write) and the card's peak (memory clock x bus width).
- ``two processes``: one process busy 60 % of every 1.7 s, another 20 % in the gap: each process's
  busy counter reads its own share.  NVML answers per-process utilisation for its last sample period
  only (200 ms on the H100), and names one process per period (measured: two processes taking 70 ms
  turns, each period named one of them, with the whole GPU's utilisation), so the collector's figure
  is a sample held over each interval: right for turns longer than a period, on average.  The cycle is
  out of step with the sweep (a load in step with it aliases), the check sweeps every 0.5 s for 15 s,
  and the tolerance is the larger of 0.12 and 2.5 standard errors of that many samples.  It also prints
  NVML's raw answers polled every 25 ms for a second, and one answer 15 s after the previous call.

It also prints what nvmlGpmMetricsGet costs per number of metrics, which metrics this GPU answers, and
the NVLink links that are up: the figures behind the collector's cadence and metric set.
"""

from __future__ import annotations

import contextlib
import math
import os
import subprocess
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, REPO)
LIBRARY = os.path.join(REPO, "exporter", "instrument")  # gpuio, the instrumentation library the exporter imports
sys.path.insert(0, LIBRARY)

from exporter.collectors import nvml as NVML  # noqa: E402
from exporter.context import Context  # noqa: E402  (after the path is set)
from exporter.exposition import render  # noqa: E402
from exporter.host.nvml_device import NVMLError, ProcessUtilization, PyNvml, error_name  # noqa: E402

WORKER = r"""
import sys, time, torch
mode, duration = sys.argv[1], float(sys.argv[2])
phases = [float(value) for value in sys.argv[3:5]] or [0.0, 1.0]
period, start_at, stop_at = 1.0, phases[0], phases[1]
torch.cuda.init()
if mode == "share":
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)  # ~0.2 ms: a turn ends on time
    b = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    step = lambda: a @ b
    period = 1.7
elif mode in ("duty", "bf16"):
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    step = lambda: a @ b
elif mode == "spin":
    step = lambda: torch.cuda._sleep(50_000_000)  # one block, one thread: ~25 ms at 2 GHz
elif mode == "fp32add":
    x = torch.ones(1 << 28, device="cuda")  # 1 GiB
    y, z = torch.ones_like(x), torch.empty_like(x)
    step = lambda: torch.add(x, y, out=z)
elif mode == "copy":
    src = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    step = lambda: dst.copy_(src)
step(); torch.cuda.synchronize()
print("start", flush=True)
began, steps = time.time(), 0
while (now := time.time()) < began + duration:
    phase = now % period / period  # on the wall clock: two workers' phases line up
    if mode in ("duty", "share") and not (start_at <= phase < stop_at):
        time.sleep(0.002)
        continue
    step(); steps += 1
    if mode in ("duty", "share"):
        torch.cuda.synchronize()  # keep the busy part inside its phase
    elif steps % 8 == 0:
        torch.cuda.synchronize()
torch.cuda.synchronize()
print(f"done {steps} {time.time() - began:.3f}", flush=True)
"""

ROWS = (  # column, family, labels
    ("SM act", "gpuio_gpu_sm_active_seconds_total", {}),
    ("occup", "gpuio_gpu_sm_occupancy_seconds_total", {}),
    ("tensor", "gpuio_gpu_pipe_active_seconds_total", {"pipe": "tensor"}),
    ("hmma", "gpuio_gpu_pipe_active_seconds_total", {"pipe": "tensor_hmma"}),
    ("fp32", "gpuio_gpu_pipe_active_seconds_total", {"pipe": "fp32"}),
    ("DRAM", "gpuio_gpu_dram_active_seconds_total", {}),
)


def samples(collector: Any) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    from prometheus_client.parser import text_string_to_metric_families

    collector.sampler.sample_now()
    found = {}
    for family in text_string_to_metric_families(render(collector.collect())):
        for sample in family.samples:
            found[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return found


def pick(found: dict, name: str, **labels: str) -> float | None:
    values = [v for (n, ls), v in found.items() if n == name and set(labels.items()) <= ls]
    return sum(values) if values else None


def rates(before: dict, after: dict, seconds: float, names: list[tuple[str, dict[str, str]]]) -> list[float | None]:
    result = []
    for name, labels in names:
        a, b = pick(before, name, **labels), pick(after, name, **labels)
        result.append(None if a is None or b is None else (b - a) / seconds)
    return result


def worker(mode: str, duration: float, *phase: float) -> subprocess.Popen:
    process = subprocess.Popen([sys.executable, "-c", WORKER, mode, str(duration), *map(str, phase)],
                               stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None
    line = process.stdout.readline()
    assert line.startswith("start"), f"worker {mode} did not start: {line!r}"
    return process


def finish(process: subprocess.Popen) -> str:
    out, _ = process.communicate(timeout=60)
    return out.strip()


def cost_table(nvml: PyNvml, handle: Any) -> list[str]:
    """CPU of nvmlGpmSampleGet and of nvmlGpmMetricsGet by number of metrics; which metrics answer."""
    lines = []
    first, second = nvml.gpm_sample_alloc(), nvml.gpm_sample_alloc()
    nvml.gpm_sample_get(handle, first)
    time.sleep(0.25)
    started = time.thread_time()
    for _ in range(50):
        nvml.gpm_sample_get(handle, second)
    lines.append(f"nvmlGpmSampleGet: {(time.thread_time() - started) / 50 * 1e6:.0f} us CPU")
    every = sorted({m.metric for m in NVML.GPM_METRICS} | {m.metric for m in NVML.NVLINK_TOTALS}
                   | {m.metric for link in range(18) for m in NVML.nvlink_link_metrics(link)})
    answers = nvml.gpm_metrics_get(first, second, every)
    refused = {m: error_name(v) for m, v in answers.items() if isinstance(v, Exception)}
    lines.append(f"metrics answered: {sorted(m for m in answers if m not in refused)}; refused: {refused}")
    fast = [m.metric for m in NVML.GPM_METRICS[:6]]  # SM, occupancy, tensor, DRAM, PCIe tx/rx
    for count, chosen in (("1", fast[:1]), ("core", fast), ("all asked", every)):
        started, wall = time.thread_time(), time.perf_counter()
        for _ in range(20):
            nvml.gpm_metrics_get(first, second, chosen)
        lines.append(f"nvmlGpmMetricsGet of {len(chosen):2d} metrics ({count}): "
                     f"{(time.thread_time() - started) / 20 * 1e3:.3f} ms CPU, "
                     f"{(time.perf_counter() - wall) / 20 * 1e3:.3f} ms wall")
    links = []
    for link in range(18):
        try:
            links.append(f"{link}:{'up' if nvml.device_nvlink_state(handle, link) else 'down'}")
        except NVMLError as exc:
            links.append(f"{link}:{error_name(exc)}")
            break
    lines.append(f"NVLink links: {' '.join(links)}")
    started = time.thread_time()
    for _ in range(20):
        with contextlib.suppress(NVMLError):  # NotFound: nothing ran in the last second
            nvml.device_process_utilization(handle, int(time.time() * 1e6) - 1_000_000)
    lines.append(f"nvmlDeviceGetProcessUtilization: {(time.thread_time() - started) / 20 * 1e6:.0f} us CPU")
    nvml.gpm_sample_free(first)
    nvml.gpm_sample_free(second)
    return lines


def peak_dram_bytes_per_second(handle: Any) -> float | None:
    import pynvml

    try:
        width = pynvml.nvmlDeviceGetMemoryBusWidth(handle)
        clock = pynvml.nvmlDeviceGetMaxClockInfo(handle, pynvml.NVML_CLOCK_MEM)
    except pynvml.NVMLError:
        return None
    return width / 8 * clock * 1e6 * 2  # double data rate


def main() -> int:
    nvml = PyNvml()
    nvml.init()
    handle = nvml.device_handle_by_index(0)
    if not nvml.gpm_query_device_support(handle):
        print("SKIPPED: GPU 0 has no GPM")
        return 2
    print(f"GPU 0: {nvml.device_name(handle)}, driver {nvml.system_driver_version()}")
    failures: list[str] = []
    try:
        print(*cost_table(nvml, handle), sep="\n")
    except Exception as exc:  # the figures below still count
        failures.append(f"cost table: {exc!r}")
    options = {"interval": 1.0, "slow-interval": 1e-9, "hang-timeout": 30.0, "reinit-interval": 30.0,
               "max-processes": 64}
    collector = NVML.NvmlCollector(Context(), options, nvml=PyNvml())
    samples(collector)  # the session, the baselines
    gpu = {"gpu": "0"}
    columns = [("gpuio_gpu_busy_seconds_total", gpu)] + [(name, {**gpu, **labels}) for _, name, labels in ROWS]
    print(f"\n{'load':10} {'busy':>6} " + " ".join(f"{title:>7}" for title, _, _ in ROWS) + "   (ratios over 4 s)")
    measured: dict[str, list[float | None]] = {}
    for load in ("duty", "spin", "bf16", "fp32add", "copy"):
        process = worker(load, 6.5, *((0.0, 0.5) if load == "duty" else ()))
        time.sleep(1.0)
        before, t0 = samples(collector), time.monotonic()
        time.sleep(4.0)
        after, t1 = samples(collector), time.monotonic()
        done = finish(process)
        measured[load] = rates(before, after, t1 - t0, columns)
        cells = " ".join("    n/a" if v is None else f"{v:7.3f}" for v in measured[load][1:])
        busy = measured[load][0]
        print(f"{load:10} {'n/a' if busy is None else f'{busy:6.3f}'} {cells}   worker: {done}")
        if load == "copy":
            steps, seconds = done.split()[1:3]
            moved = 2 * (2 << 30) * int(steps) / float(seconds)  # each copy reads and writes 2 GiB
            peak = peak_dram_bytes_per_second(handle)
            print(f"{'':10} copy moved {moved / 1e9:.0f} GB/s (read + write); card peak "
                  f"{'n/a' if peak is None else f'{peak / 1e9:.0f} GB/s'}: "
                  f"{'' if peak is None else f'{moved / peak:.2f} of peak'}; DRAM counter {measured[load][6]}")
    spin = measured["spin"]
    print(f"spin: NVML busy {spin[0]}, SM activity {spin[1]} (one SM of 132: {1 / 132:.4f})")

    def ratio(load: str, column: int) -> float:  # n/a reads as NaN: every comparison with it fails
        found = measured[load][column]
        return math.nan if found is None else found

    one_sm = 1 / 132  # one thread block on one SM of an H100 SXM's 132
    expect = [
        ("duty: SM activity about 0.5", lambda: 0.3 <= ratio("duty", 1) <= 0.65),
        ("duty: busy about 0.5", lambda: 0.35 <= ratio("duty", 0) <= 0.65),
        ("spin: busy near 1", lambda: ratio("spin", 0) >= 0.8),
        ("spin: SM activity near one SM's share", lambda: one_sm / 3 <= ratio("spin", 1) <= 0.05),
        ("bf16: tensor activity high", lambda: ratio("bf16", 3) >= 0.6),
        ("fp32add: tensor near 0", lambda: 0 <= ratio("fp32add", 3) <= 0.05),
        ("fp32add: SM high", lambda: ratio("fp32add", 1) >= 0.8),
        ("copy: DRAM utilisation high", lambda: ratio("copy", 6) >= 0.5),
        *((f"{load}: every activity ratio within 0-1", lambda load=load: all(
            -0.01 <= ratio(load, column) <= 1.02 for column in range(1, len(columns))))
          for load in measured),
    ]
    for name, ok in expect:
        if not ok():
            failures.append(name)
    try:
        failures += two_processes(collector, nvml, handle)
    except Exception as exc:
        failures.append(f"two processes: {exc!r}")
    collector.stop()
    for failure in failures:
        print("FAIL", failure)
    print("PASS gpm" if not failures else f"{len(failures)} GPM check(s) failed")
    return 1 if failures else 0


def two_processes(collector: Any, nvml: PyNvml, handle: Any) -> list[str]:
    """Two PyTorch processes sharing the GPU 60/20 in 1.7 s turns: each one's busy counter reads its share."""
    # Long enough to outlive the window: each worker's clock starts when it is ready (the second one
    # a few seconds after the first), and a worker that has exited is no longer listed by NVML.
    first = worker("share", 45.0, 0.0, 0.6)
    second = worker("share", 45.0, 0.6, 0.8)
    time.sleep(2.0)
    collector.sampler.sample_now()  # lists the two processes
    raw_stream(nvml, handle)
    before, t0 = samples(collector), time.monotonic()
    listed = sorted({dict(ls)["pid"] for (n, ls) in before if n == "gpuio_gpu_process_memory_used_bytes"})
    called = time.time()
    sweeps = 30
    for _ in range(sweeps):
        time.sleep(0.5)
        samples(collector)
    after, t1 = samples(collector), time.monotonic()
    late = _utilisation(nvml, handle, int(called * 1e6))
    print(f"one raw answer {time.time() - called:.1f} s after the previous call: "
          + ("; ".join(f"pid {u.pid} sm {u.sm} mem {u.memory} ts -{(time.time() * 1e6 - u.timestamp_us) / 1e3:.0f} ms"
                       for u in late) or "NotFound"))
    failures = [f"worker {process.pid} exited before the window ended" for process in (first, second)
                if process.poll() is not None]
    for process in (first, second):
        process.terminate()
    outputs = {process.pid: f"{finish(process) or 'stopped'} (rc {process.returncode})" for process in (first, second)}
    print(f"\nper process (share of the GPU each one's kernels ran, over {t1 - t0:.1f} s); NVML lists pids {listed}:")
    for process, share in ((first, 0.6), (second, 0.2)):
        pid = {"pid": str(process.pid)}
        rate = rates(before, after, t1 - t0, [("gpuio_gpu_process_sm_busy_seconds_total", pid)])[0]
        memory = rates(before, after, t1 - t0, [("gpuio_gpu_process_memory_busy_seconds_total", pid)])[0]
        print(f"  pid {process.pid}: share {share:.1f}; collector SM busy {'n/a' if rate is None else f'{rate:.3f}'}, "
              f"memory busy {'n/a' if memory is None else f'{memory:.3f}'}   worker: {outputs[process.pid]}")
        tolerance = max(0.12, 2.5 * math.sqrt(share * (1 - share) / sweeps))  # a sample per sweep
        if rate is None or abs(rate - share) > tolerance:
            failures.append(f"process {process.pid} at share {share} read {rate} (tolerance {tolerance:.2f})")
    return failures


def raw_stream(nvml: PyNvml, handle: Any) -> None:
    """NVML's per-process answers polled every 25 ms for a second, each asking for samples newer than
    the newest seen: how many samples per process an answer holds, and how far apart periods are."""
    newest, answers, stamps = int(time.time() * 1e6), [], set()
    for _ in range(40):
        time.sleep(0.025)
        answer = _utilisation(nvml, handle, newest)
        if answer:
            newest = max(newest, *(u.timestamp_us for u in answer))
            stamps |= {u.timestamp_us for u in answer}
            answers.append(answer)
    per_pid = max((sum(1 for u in answer if u.pid == pid) for answer in answers for pid in {u.pid for u in answer}),
                  default=0)
    ordered = sorted(stamps)
    gaps = [(b - a) / 1e3 for a, b in zip(ordered, ordered[1:], strict=False)]
    print(f"\nraw nvmlDeviceGetProcessUtilization polled every 25 ms for 1 s: {len(answers)} answers, "
          f"{len(stamps)} distinct sample times, at most {per_pid} sample(s) per process per answer, "
          f"periods {sorted(gaps)[len(gaps) // 2] if gaps else 'n/a'} ms apart (median)")
    for answer in answers[:8]:
        print("   " + "; ".join(f"pid {u.pid} ts {u.timestamp_us % 10_000_000 / 1e3:.0f} ms sm {u.sm} mem {u.memory}"
                              for u in answer))


def _utilisation(nvml: PyNvml, handle: Any, last_seen_us: int) -> list[ProcessUtilization]:
    try:
        return nvml.device_process_utilization(handle, last_seen_us)
    except NVMLError:
        return []


if __name__ == "__main__":
    sys.exit(main())
