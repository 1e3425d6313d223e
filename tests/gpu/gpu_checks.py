"""The nvml collector on a real NVIDIA GPU (issue 3): every value against nvidia-smi, and the counters
against workloads whose truth is known.

The unit tests run the collector on a fake NVML (CI has no GPU); these checks run the same collector,
in-process, on the real driver through exporter.host.nvml_device.PyNvml.  The GPU machine has PyTorch,
nvidia-ml-py and prometheus-client but neither pytest nor the web stack, so this module needs neither:
``python tests/gpu/run_gpu_checks.py`` runs it as a script, ``pytest -m gpu tests/gpu`` through pytest.

Tolerances, stated once:

- nvidia-smi is run between two sweeps of the collector ("the same second": ~0.1-0.3 s apart) and a
  value passes when it matches the sweep before or the one after within its tolerance: identity,
  limits, link, ECC, remapped rows, MIG mode and clock event reasons exactly; memory within 2 MiB
  (nvidia-smi prints whole MiB); temperatures 1 C; power 5 W or 5 %; clocks 1 %; utilisation 5 points;
  clock event counters 1 ms + 1 % (nvidia-smi prints microseconds).
- energy: the counter's rate over ~5 s equals the mean of the power gauge within 10 % + 5 W.
- busy: a kernel loop busy 2.5 s of every 5 s moves ``rate(gpuio_gpu_busy_seconds_total)`` over each
  15 s window to 0.5 +/- 0.1, while the utilisation gauge, read at the same 15 s instants (which fall in
  the busy phase), reads near 100 %: a 15 s scrape of the gauge cannot tell the duty cycle.
- processes: the PyTorch worker is listed with its pid and memory (nvidia-smi's used_memory, 1 MiB).
- PCIe (GPM, Hopper+): 4 GiB host-to-device moves the receive counter by 1.0-1.2 x 4 GiB (TLP headers
  add ~8 %), 2 GiB device-to-host the transmit counter by 1.0-1.2 x 2 GiB, read 0.3 s after each copy.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
if REPO not in sys.path:
    sys.path.insert(0, REPO)
LIBRARY = os.path.join(REPO, "exporter", "instrument")  # gpuio, the instrumentation library, from this checkout
sys.path.insert(0, LIBRARY)
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, (LIBRARY, os.environ.get("PYTHONPATH"))))

MIB = 1024 * 1024
GIB = 1024 * MIB
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def unavailable() -> str | None:
    """Why these checks cannot run here, or None."""
    if shutil.which("nvidia-smi") is None:
        return "no nvidia-smi on this machine"
    from exporter.host.nvml_device import NVMLError, PyNvml

    try:
        nvml = PyNvml()
        nvml.init()
        count = nvml.device_count()
        nvml.shutdown()
    except NVMLError as exc:
        return f"NVML does not initialise: {exc}"
    return None if count else "NVML sees no GPU"


def collector(**options: float) -> Any:
    """The collector on the real NVML; by default every sweep reads everything (the slow fields too)."""
    from exporter.collectors.nvml import NvmlCollector
    from exporter.context import Context
    from exporter.host.nvml_device import PyNvml

    settings = {"interval": 1.0, "slow-interval": 1e-9, "hang-timeout": 10.0, "reinit-interval": 30.0,
                "max-processes": 64}
    settings.update({key.replace("_", "-"): value for key, value in options.items()})
    return NvmlCollector(Context(), settings, nvml=PyNvml())


def read(instance: Any, sweep: bool = True) -> Samples:
    from prometheus_client.parser import text_string_to_metric_families

    from exporter.exposition import render

    if sweep:
        instance.sampler.sample_now()
    samples: Samples = {}
    for family in text_string_to_metric_families(render(instance.collect())):
        for sample in family.samples:
            samples[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return samples


def find(samples: Samples, name: str, **labels: str) -> float | None:
    for (sample_name, sample_labels), value in samples.items():
        if sample_name == name and set(labels.items()) <= sample_labels:
            return value
    return None


def smi(query: str, fields: list[str]) -> list[dict[str, str]]:
    output = subprocess.run(["nvidia-smi", f"--query-{query}={','.join(fields)}", "--format=csv,noheader,nounits"],
                            capture_output=True, text=True, check=True, timeout=30).stdout
    return [dict(zip(fields, (cell.strip() for cell in line.split(",")), strict=True))
            for line in output.splitlines() if line.strip()]


def not_available(text: str) -> bool:
    return text.startswith("[") or text in ("N/A", "")


@dataclass(frozen=True)
class Compare:
    """One nvidia-smi field against one of our series: smi's text to our unit, and the tolerance."""

    field: str
    metric: str
    labels: tuple[tuple[str, str], ...] = ()
    convert: Callable[[str], float] = float
    tolerance: Callable[[float], float] = lambda value: 0.0


def mib(text: str) -> float:
    return float(text) * MIB


def active(text: str) -> float:
    return {"Active": 1.0, "Not Active": 0.0, "Yes": 1.0, "No": 0.0, "Enabled": 1.0, "Disabled": 0.0}[text]


def reason(name: str) -> Compare:
    return Compare(f"clocks_event_reasons.{name}", "gpuio_gpu_clocks_event_reason_active", (("reason", name),),
                   active)


def counter(name: str) -> Compare:
    return Compare(f"clocks_event_reasons_counters.{name}", "gpuio_gpu_clocks_event_seconds_total",
                   (("reason", name),), lambda text: float(text) / 1e6, lambda value: 1e-3 + 0.01 * value)


COMPARISONS = (
    Compare("memory.total", "gpuio_gpu_memory_total_bytes", (), mib, lambda _: 2 * MIB),
    Compare("memory.reserved", "gpuio_gpu_memory_reserved_bytes", (), mib, lambda _: 2 * MIB),
    Compare("memory.used", "gpuio_gpu_memory_used_bytes", (), mib, lambda _: 2 * MIB),
    Compare("memory.free", "gpuio_gpu_memory_free_bytes", (), mib, lambda _: 2 * MIB),
    Compare("temperature.gpu", "gpuio_gpu_temperature_celsius", (), float, lambda _: 1.0),
    Compare("temperature.memory", "gpuio_gpu_memory_temperature_celsius", (), float, lambda _: 1.0),
    Compare("power.draw", "gpuio_gpu_power_watts", (), float, lambda value: max(5.0, 0.05 * value)),
    Compare("enforced.power.limit", "gpuio_gpu_power_limit_watts", (), float, lambda _: 0.01),
    Compare("clocks.sm", "gpuio_gpu_sm_clock_hertz", (), lambda t: float(t) * 1e6, lambda value: 0.01 * value),
    Compare("clocks.mem", "gpuio_gpu_memory_clock_hertz", (), lambda t: float(t) * 1e6, lambda value: 0.01 * value),
    Compare("clocks.max.sm", "gpuio_gpu_sm_clock_max_hertz", (), lambda t: float(t) * 1e6),
    Compare("clocks.max.mem", "gpuio_gpu_memory_clock_max_hertz", (), lambda t: float(t) * 1e6),
    Compare("pcie.link.gen.current", "gpuio_gpu_pcie_link_generation"),
    Compare("pcie.link.gen.max", "gpuio_gpu_pcie_link_generation_max"),
    Compare("pcie.link.width.current", "gpuio_gpu_pcie_link_width"),
    Compare("pcie.link.width.max", "gpuio_gpu_pcie_link_width_max"),
    Compare("utilization.gpu", "gpuio_gpu_utilization_ratio", (), lambda t: float(t) / 100, lambda _: 0.05),
    Compare("utilization.memory", "gpuio_gpu_memory_utilization_ratio", (), lambda t: float(t) / 100,
            lambda _: 0.05),
    *(reason(name) for name in ("gpu_idle", "applications_clocks_setting", "sw_power_cap", "hw_slowdown",
                                "hw_thermal_slowdown", "hw_power_brake_slowdown", "sw_thermal_slowdown",
                                "sync_boost")),
    *(counter(name) for name in ("sw_power_cap", "sync_boost", "sw_thermal_slowdown", "hw_thermal_slowdown",
                                 "hw_power_brake_slowdown")),
    Compare("ecc.errors.corrected.volatile.total", "gpuio_gpu_ecc_errors_total", (("error", "corrected"),)),
    Compare("ecc.errors.uncorrected.volatile.total", "gpuio_gpu_ecc_errors_total", (("error", "uncorrected"),)),
    Compare("ecc.errors.corrected.aggregate.total", "gpuio_gpu_ecc_aggregate_errors_total",
            (("error", "corrected"),)),
    Compare("ecc.errors.uncorrected.aggregate.total", "gpuio_gpu_ecc_aggregate_errors_total",
            (("error", "uncorrected"),)),
    Compare("remapped_rows.correctable", "gpuio_gpu_remapped_rows", (("cause", "correctable"),)),
    Compare("remapped_rows.uncorrectable", "gpuio_gpu_remapped_rows", (("cause", "uncorrectable"),)),
    Compare("remapped_rows.pending", "gpuio_gpu_remapped_rows_pending", (), active),
    Compare("remapped_rows.failure", "gpuio_gpu_remapped_rows_failure", (), active),
    Compare("mig.mode.current", "gpuio_gpu_mig_enabled", (), active),
)
IDENTITY = {"uuid": "uuid", "name": "name", "pci.bus_id": "pci_bus_id", "serial": "serial",
            "driver_version": "driver_version"}


class CheckFailed(AssertionError):
    pass


def compare_one(spec: Compare, text: str, before: float | None, after: float | None) -> tuple[bool, str]:
    """(passed, line) for one field of one GPU."""
    if not_available(text):  # nvidia-smi has no value: ours must be absent too, or is reported for a look
        return True, f"{spec.field:45} smi {text:>14}  ours {before!s:>14}  (no value from nvidia-smi)"
    want = spec.convert(text)
    got = [value for value in (before, after) if value is not None]
    if not got:
        return False, f"{spec.field:45} smi {want:>14g}  ours ABSENT"
    tolerance = spec.tolerance(want)
    best = min(got, key=lambda value: abs(value - want))
    ok = abs(best - want) <= tolerance
    return ok, f"{spec.field:45} smi {want:>14g}  ours {best:>14g}  tol {tolerance:g}  {'ok' if ok else 'MISMATCH'}"


def check_matches_nvidia_smi() -> list[str]:
    """Every per-GPU value with an nvidia-smi field, read within the same second."""
    instance = collector()
    fields = ["index", *IDENTITY, "count", *(spec.field for spec in COMPARISONS)]
    try:
        read(instance)  # the first sweep only sets baselines
        before = read(instance)
        rows = smi("gpu", fields)
        after = read(instance)
    finally:
        instance.stop()
    lines, failures = [], []
    for row in rows:
        gpu = {"gpu": row["index"]}
        lines.append(f"GPU {row['index']} ({row['name']}, {row['uuid']})")
        for smi_field, label in IDENTITY.items():
            info = next((dict(labels) for (name, labels), _ in before.items()
                         if name == "gpuio_gpu_info" and ("gpu", row["index"]) in labels), {})
            if info.get(label) != row[smi_field]:
                failures.append(f"GPU {row['index']} {smi_field}: smi {row[smi_field]!r}, ours {info.get(label)!r}")
        if find(before, "gpuio_gpu_devices") != float(row["count"]):
            failures.append(f"count: smi {row['count']}, ours {find(before, 'gpuio_gpu_devices')}")
        for spec in COMPARISONS:
            labels = {**gpu, **dict(spec.labels)}
            ok, line = compare_one(spec, row[spec.field], find(before, spec.metric, **labels),
                                   find(after, spec.metric, **labels))
            lines.append("  " + line)
            if not ok:
                failures.append(f"GPU {row['index']} {line}")
    if failures:
        raise CheckFailed("\n".join(lines + ["FAILED:"] + failures))
    return lines


def check_replays_match_nvidia_smi_q() -> list[str]:
    instance = collector()
    try:
        samples = read(instance)
        text = subprocess.run(["nvidia-smi", "-q"], capture_output=True, text=True, check=True, timeout=60).stdout
    finally:
        instance.stop()
    replays = [float(value) for value in re.findall(r"Replays Since Reset\s*:\s*(\d+)", text)]
    ours = [find(samples, "gpuio_gpu_pcie_replays_total", gpu=str(index)) for index in range(len(replays))]
    if ours != replays:
        raise CheckFailed(f"PCIe replays: nvidia-smi -q {replays}, ours {ours}")
    return [f"PCIe replays per GPU: nvidia-smi -q {replays}, ours {ours}"]


def check_energy_counter_matches_power() -> list[str]:
    """Joules: the counter's rate against the mean of the power gauge over the same ~5 s."""
    instance = collector()
    try:
        first = read(instance)
        started, powers = time.monotonic(), []
        while time.monotonic() - started < 5.0:
            time.sleep(0.25)
            last = read(instance)
            powers.append(find(last, "gpuio_gpu_power_watts", gpu="0"))
        elapsed = time.monotonic() - started
    finally:
        instance.stop()
    first_energy, last_energy = find(first, "gpuio_gpu_energy_joules_total", gpu="0"), \
        find(last, "gpuio_gpu_energy_joules_total", gpu="0")
    if first_energy is None or last_energy is None or None in powers:
        raise CheckFailed("no energy or power series on GPU 0")
    rate, mean = (last_energy - first_energy) / elapsed, sum(p for p in powers if p) / len(powers)
    line = f"GPU 0 energy rate {rate:.1f} W over {elapsed:.1f} s, mean power gauge {mean:.1f} W"
    if abs(rate - mean) > 0.1 * mean + 5:
        raise CheckFailed(line)
    return [line]


class Worker:
    """tests/gpu/gpu_worker.py as a child process (CUDA devices in NVML's PCI order)."""

    def __init__(self, *args: str) -> None:
        env = {**os.environ, "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
        self.process = subprocess.Popen([sys.executable, os.path.join(HERE, "gpu_worker.py"), *args], env=env,
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
        self.pid = int(self.expect("ready").split()[1])
        self.expect("armed")

    def expect(self, word: str) -> str:
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line.startswith(word):
            raise CheckFailed(f"worker said {line!r}, expected {word!r} (exit {self.process.poll()})")
        return line

    def send(self, line: str) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(line + "\n")
        self.process.stdin.flush()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(10)


def gpu_of(samples: Samples, pid: int) -> str | None:
    for (name, labels), _ in samples.items():
        if name == "gpuio_gpu_process_memory_used_bytes" and ("pid", str(pid)) in labels:
            return dict(labels)["gpu"]
    return None


def check_busy_counter_and_processes() -> list[str]:
    """A 50 % duty cycle (2.5 s of kernels every 5 s) against the busy counter and the gauge, 15 s apart.

    The collector runs as in production: its own thread, 1 s interval, slow fields every 10 s.  Every
    15 s "scrape" falls 2 s into a busy phase, as a scrape synchronised with a periodic job would.
    """
    period, windows, lines = 5.0, 3, []
    instance = collector(slow_interval=10.0)
    instance.start()
    worker = Worker("duty", str(period), "0.5", str(15.0 * windows + 3.0))
    try:
        start = time.time() + 1.0
        worker.send(repr(start))
        scrapes = []
        for window in range(windows + 1):
            time.sleep(max(0.0, start + 2.0 + 15.0 * window - time.time()))
            scrapes.append((time.time(), read(instance, sweep=False)))
            if window == 1:
                lines += check_worker_listed(worker.pid, scrapes[-1][1])
        gpu = gpu_of(scrapes[1][1], worker.pid) or "0"
    finally:
        worker.stop()
        instance.stop()
    failures = []
    for (t0, s0), (t1, s1) in zip(scrapes, scrapes[1:], strict=False):
        busy0, busy1 = find(s0, "gpuio_gpu_busy_seconds_total", gpu=gpu), find(s1, "gpuio_gpu_busy_seconds_total",
                                                                               gpu=gpu)
        gauge = find(s1, "gpuio_gpu_utilization_ratio", gpu=gpu)
        if busy0 is None or busy1 is None or gauge is None:
            raise CheckFailed("no busy counter or utilisation gauge")
        rate = (busy1 - busy0) / (t1 - t0)
        lines.append(f"GPU {gpu} window {t1 - t0:.1f} s: busy counter rate {rate:.3f} (truth 0.5), "
                     f"utilisation gauge at the scrape {gauge:.2f}")
        if abs(rate - 0.5) > 0.1:
            failures.append(f"busy rate {rate:.3f} outside 0.5 +/- 0.1")
        if gauge < 0.8:
            failures.append(f"gauge {gauge:.2f}: expected it to read the busy phase (~1.0)")
    if failures:
        raise CheckFailed("\n".join(lines + ["FAILED:"] + failures))
    return lines


def check_worker_listed(pid: int, samples: Samples) -> list[str]:
    """The PyTorch worker in our process list, with the memory nvidia-smi reports for it."""
    apps = {int(row["pid"]): row for row in smi("compute-apps", ["pid", "process_name", "used_memory", "gpu_uuid"])}
    ours = {dict(labels)["pid"]: (dict(labels), value) for (name, labels), value in samples.items()
            if name == "gpuio_gpu_process_memory_used_bytes"}
    if str(pid) not in ours or pid not in apps:
        raise CheckFailed(f"worker {pid} listed: ours {sorted(ours)}, nvidia-smi {sorted(apps)}")
    labels, used = ours[str(pid)]
    smi_used = float(apps[pid]["used_memory"]) * MIB
    line = (f"process {pid} {labels['process_name']!r} on GPU {labels['gpu']}: {used / MIB:.0f} MiB, nvidia-smi "
            f"{apps[pid]['used_memory']} MiB ({apps[pid]['process_name']})")
    if abs(used - smi_used) > MIB or used < 2 * GIB or labels["uuid"] != apps[pid]["gpu_uuid"]:
        raise CheckFailed(line)
    return [line]


def check_pcie_byte_counters() -> list[str]:
    """Known transfers against the GPM-based PCIe counters (Hopper and newer).

    The counters measure from a baseline sample, with an error of at most GPM's 0.1 s refresh over the
    baseline's age (exporter/collectors/nvml.py, Gpm): the transfers start 5 s after the baseline, and
    each is read 0.3 s after it ends, past GPM's next refresh.
    """
    instance = collector()
    worker = Worker("copy")
    try:
        read(instance)  # the GPM baseline
        time.sleep(5.0)
        base = read(instance)
        gpu = gpu_of(base, worker.pid) or "0"
        if find(base, "gpuio_gpu_pcie_receive_bytes_total", gpu=gpu) is None:
            return [f"GPU {gpu} has no GPM (before Hopper): no PCIe byte series, as documented"]
        worker.send("go")
        worker.expect("h2d")
        time.sleep(0.3)
        after_h2d = read(instance)
        worker.send("next")
        worker.expect("d2h")
        time.sleep(0.3)
        after_d2h = read(instance)
    finally:
        worker.stop()
        instance.stop()

    def delta(name: str, a: Samples, b: Samples) -> float:
        return (find(b, name, gpu=gpu) or 0.0) - (find(a, name, gpu=gpu) or 0.0)

    received = delta("gpuio_gpu_pcie_receive_bytes_total", base, after_h2d)
    sent = delta("gpuio_gpu_pcie_transmit_bytes_total", after_h2d, after_d2h)
    lines = [f"GPU {gpu}: 4 GiB host->device moved receive by {received / GIB:.3f} GiB ({received / (4 * GIB):.3f}x)",
             f"GPU {gpu}: 2 GiB device->host moved transmit by {sent / GIB:.3f} GiB ({sent / (2 * GIB):.3f}x)"]
    if not (1.0 <= received / (4 * GIB) <= 1.2 and 1.0 <= sent / (2 * GIB) <= 1.2):
        raise CheckFailed("\n".join(lines))
    return lines


def check_xid_listener_waits() -> list[str]:
    """The Xid listener registers and waits on the real driver (an Xid cannot be raised safely on purpose)."""
    instance = collector()
    try:
        read(instance)
        time.sleep(1.5)
        alive = any(t.name == "gpuio-nvml-xid" and t.is_alive() for t in threading.enumerate())
        hung = instance.hung(time.monotonic())
        xids = {key: value for key, value in read(instance).items() if key[0] == "gpuio_gpu_xid_errors_total"}
    finally:
        instance.stop()
    if not alive or hung:
        raise CheckFailed(f"listener alive {alive}, hung {hung}")
    return [f"Xid listener waiting; Xid counts seen: {xids or 'none'}"]


NOBODY_READ = """
import json, sys
sys.path.insert(0, {repo!r})
from tests.gpu import gpu_checks
instance = gpu_checks.collector()
samples = gpu_checks.read(instance)
instance.stop()
print(json.dumps(sorted({{name for name, _ in samples if name.startswith("gpuio_gpu_")}})))
"""


def check_as_nobody() -> list[str]:
    """Least privilege: the collector as nobody (uid/gid 65534, no groups, no capabilities, no_new_privs)
    reads every GPU family it reads as the user running the checks (NVML opens /dev/nvidia*, 0666)."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        return ["not run: needs root and setpriv to switch to nobody"]
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    code = NOBODY_READ.format(repo=repo)
    mine = set(json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                         check=True, cwd="/").stdout))
    nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--inh-caps=-all",
              "--bounding-set=-all", "--no-new-privs"]
    result = subprocess.run([*nobody, sys.executable, "-c", code], capture_output=True, text=True, cwd="/",
                            env={**os.environ, "HOME": "/nonexistent"})
    assert result.returncode == 0, result.stderr[-2000:]
    theirs = set(json.loads(result.stdout))
    assert "gpuio_gpu_up" in theirs and theirs == mine, f"missing as nobody: {sorted(mine - theirs)}"
    return [f"as nobody without capabilities: all {len(theirs)} gpuio_gpu_* families, as as root"]


@dataclass(frozen=True)
class Check:
    name: str
    run: Callable[[], list[str]]


CHECKS = (
    Check("matches_nvidia_smi", check_matches_nvidia_smi),
    Check("replays_match_nvidia_smi_q", check_replays_match_nvidia_smi_q),
    Check("energy_counter_matches_power", check_energy_counter_matches_power),
    Check("busy_counter_and_processes", check_busy_counter_and_processes),
    Check("pcie_byte_counters", check_pcie_byte_counters),
    Check("xid_listener_waits", check_xid_listener_waits),
    Check("as_nobody", check_as_nobody),
)
