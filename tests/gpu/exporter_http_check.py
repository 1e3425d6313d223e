"""The whole exporter on a GPU machine, over HTTP, as nobody without capabilities.

Starts ``python -m exporter`` under ``setpriv`` (uid/gid 65534, no groups, no capabilities,
no_new_privs) with every default collector on this machine's real /proc, /sys and GPUs; checks that
diskstats, pressure, nvml and engines succeed and that every GPU is up with its busy counter; times 300
scrapes (p50/p99); prints ``gpuio top --once --url`` against it.  Without root it runs as the current
user.  Exit 1 on a failed check.

    PYTHONPATH=. python3 tests/gpu/exporter_http_check.py
"""

from __future__ import annotations

import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)
LIBRARY = os.path.join(REPO, "exporter", "instrument")  # gpuio, the instrumentation library, from this checkout
sys.path.insert(0, LIBRARY)
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, (LIBRARY, os.environ.get("PYTHONPATH"))))

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.read().decode()


def main() -> int:
    port = free_port()
    spool = tempfile.mkdtemp(prefix="gpuio-spool-")
    os.chmod(spool, 0o1777)
    prefix = []
    if os.geteuid() == 0 and shutil.which("setpriv"):
        prefix = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--inh-caps=-all",
                  "--bounding-set=-all", "--no-new-privs"]
    command = [*prefix, sys.executable, "-m", "exporter", f"--web.listen-address=127.0.0.1:{port}",
               f"--collector.engines.spool-dir={spool}"]
    environment = {**os.environ, "HOME": "/nonexistent"}
    process = subprocess.Popen(command, cwd=REPO, env=environment, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}/metrics"
    failures = []
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                text = scrape(url)
                if "gpuio_gpu_busy_seconds_total{" in text:
                    break
            except OSError:
                pass
            if process.poll() is not None or time.monotonic() > deadline:
                print(process.stdout.read() if process.stdout and process.poll() is not None else "")
                print("FAIL exporter did not serve GPU series in 30 s")
                return 1
            time.sleep(0.2)
        time.sleep(2)
        samples = {}
        for family in text_string_to_metric_families(scrape(url)):
            for sample in family.samples:
                samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
        success = {dict(labels)["collector"]: value for (name, labels), value in samples.items()
                   if name == "gpuio_scrape_collector_success"}
        up = [value for (name, _), value in samples.items() if name == "gpuio_gpu_up"]
        gpu_series = sum(1 for name, _ in samples if name.startswith("gpuio_gpu_"))
        print(f"running as {'nobody, no capabilities' if prefix else f'uid {os.geteuid()}'}; collectors: {success}")
        print(f"GPUs up: {up}; gpuio_gpu_* series: {gpu_series}")
        for name in ("diskstats", "pressure", "nvml", "engines"):
            if success.get(name) != 1:
                failures.append(f"collector {name} success {success.get(name)}")
        if not up or not all(value == 1 for value in up):
            failures.append("not every GPU is up")
        failures += gpm_families(samples)
        latencies = []
        for _ in range(300):
            started = time.perf_counter()
            scrape(url)
            latencies.append((time.perf_counter() - started) * 1000)
        latencies.sort()
        print(f"300 scrapes over HTTP: p50 {statistics.median(latencies):.2f} ms, "
              f"p99 {latencies[int(len(latencies) * 0.99) - 1]:.2f} ms, max {latencies[-1]:.2f} ms")
        failures += engine_gpu_from_nvml(url, spool, prefix)
        tools = "import sys; from exporter.cli import tools_main; tools_main(sys.argv[1:])"
        top = subprocess.run([sys.executable, "-c", tools, "top", "--once", f"--url={url}"],
                             capture_output=True, text=True, cwd=REPO, env={**os.environ, "COLUMNS": "100"})
        print(top.stdout or top.stderr)
        if top.returncode != 0 or "no gpuio_gpu_* series" in top.stdout:
            failures.append("gpuio top --url shows no GPU row of an exporter that serves them")
    finally:
        process.terminate()
        output, _ = process.communicate(timeout=15)
        shutil.rmtree(spool, ignore_errors=True)
    errors = [line for line in output.splitlines() if "level=error" in line and "smart" not in line]
    if errors:
        failures.append(f"exporter logged errors: {errors[:3]}")
    for failure in failures:
        print("FAIL", failure)
    print("PASS exporter over HTTP" if not failures else "")
    return 1 if failures else 0


GPM_FAMILIES = ("gpuio_gpu_sm_active_seconds_total", "gpuio_gpu_sm_occupancy_seconds_total",
                "gpuio_gpu_pipe_active_seconds_total", "gpuio_gpu_dram_active_seconds_total",
                "gpuio_gpu_pcie_receive_bytes_total")


def gpm_families(samples: dict) -> list[str]:
    """Every GPU with GPM serves the activity families (as nobody: GPM needs no privilege)."""
    supported = {dict(labels)["uuid"]: value for (name, labels), value in samples.items()
                 if name == "gpuio_gpu_gpm_supported"}
    print(f"GPM supported: {supported}")
    failures = []
    for uuid, value in supported.items():
        served = {name for name, labels in samples if dict(labels).get("uuid") == uuid}
        missing = [name for name in GPM_FAMILIES if name not in served]
        pipes = sorted(dict(labels)["pipe"] for name, labels in samples
                       if name == "gpuio_gpu_pipe_active_seconds_total" and dict(labels).get("uuid") == uuid)
        print(f"GPU {uuid}: GPM families served: {[n for n in GPM_FAMILIES if n in served]}; pipes {pipes}")
        if value == 1 and missing:
            failures.append(f"GPU {uuid} has GPM but not {missing}")
    return failures


# A PyTorch process that loads a model through the generic loader without naming its GPU: the exporter
# must take the GPU from NVML's process list (slow fields: within ~10 s).
SILENT_WRITER = """
import os, sys, time, torch
sys.path.insert(0, sys.argv[1])
import gpuio
gpuio.configure(sys.argv[2])
held = torch.ones(1 << 20, device="cuda")  # a CUDA context: NVML lists this process
path = os.path.join(sys.argv[2], "..", "silent-model.bin")
with open(path, "wb") as handle:
    handle.write(os.urandom(1 << 20))
gpuio.load(path, bytes, name="silent")
print("loaded", flush=True)
time.sleep(60)
"""


# Samples by their own names: prometheus_client's parser names a counter's *family* without "_total".
def engine_gpu_from_nvml(url: str, spool: str, prefix: list[str]) -> list[str]:
    writer = subprocess.Popen([sys.executable, "-c", SILENT_WRITER, REPO, spool], stdout=subprocess.PIPE, text=True)
    try:
        writer.stdout.readline()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            samples = [(sample.name, sample.labels) for family in text_string_to_metric_families(scrape(url))
                       for sample in family.samples]
            info = [labels for name, labels in samples
                    if name == "gpuio_engine_info" and labels.get("engine") == "silent"]
            gpus = {labels["uuid"] for name, labels in samples if name == "gpuio_gpu_info"}
            if info and info[0].get("gpu_uuid"):
                print(f"engine 'silent' (no GPU recorded by its process {writer.pid}): gpu_uuid "
                      f"{info[0]['gpu_uuid']} from NVML's process list; GPUs {sorted(gpus)}")
                failures = [] if info[0]["gpu_uuid"] in gpus else ["engine's gpu_uuid is no GPU of gpuio_gpu_info"]
                return failures + process_join(url, samples, writer.pid, prefix)
            time.sleep(0.5)
        return ["engine 'silent' got no gpu_uuid from NVML's process list in 30 s"]
    finally:
        writer.kill()
        writer.wait()


def process_join(url: str, samples: list, pid: int, prefix: list[str]) -> list[str]:
    """The engine's writer by pid (gpuio_engine_process_info) and its own GPU busy series, joined on pid.

    The nvml collector lists processes every slow interval (10 s) and serves their busy series from the
    sweep that lists them; the engines collector may see the pid a moment before the nvml snapshot of
    that sweep is served, so this looks again for up to two sweeps before judging."""
    deadline = time.monotonic() + 3.0
    while True:
        engines = [labels.get("engine") for name, labels in samples
                   if name == "gpuio_engine_process_info" and labels.get("pid") == str(pid)]
        busy = [labels for name, labels in samples
                if name == "gpuio_gpu_process_sm_busy_seconds_total" and labels.get("pid") == str(pid)]
        if (engines == ["silent"] and busy) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
        samples = [(sample.name, sample.labels) for family in text_string_to_metric_families(scrape(url))
                   for sample in family.samples]
    print(f"pid {pid}: gpuio_engine_process_info engines {engines}; per-process SM busy series {busy}")
    if engines == ["silent"] and busy:
        return []
    listed = sorted(labels.get("pid") for name, labels in samples if name == "gpuio_gpu_process_memory_used_bytes")
    with_busy = sorted(labels.get("pid") for name, labels in samples
                       if name == "gpuio_gpu_process_sm_busy_seconds_total")
    errors = [(labels, name) for name, labels in samples if name == "gpuio_gpu_nvml_errors_total"]
    print(f"processes listed {listed}; with a busy series {with_busy}; NVML errors {errors}")
    print(f"nvmlDeviceGetProcessUtilization as the exporter's user: {direct_process_utilization(prefix)}")
    return [f"engine 'silent' not joined to its process's GPU series: {engines}, {busy}"]


def direct_process_utilization(prefix: list[str]) -> str:
    """What NVML answers the exporter's user (nobody, no capabilities) when asked directly."""
    probe = ("import pynvml as n; n.nvmlInit(); h = n.nvmlDeviceGetHandleByIndex(0)\n"
             "try:\n    print([(s.pid, s.smUtil) for s in n.nvmlDeviceGetProcessUtilization(h, 0)])\n"
             "except n.NVMLError as e:\n    print(type(e).__name__, e)")
    done = subprocess.run([*prefix, sys.executable, "-c", probe], capture_output=True, text=True, timeout=30,
                          env={**os.environ, "HOME": "/nonexistent"})
    return (done.stdout + done.stderr).strip()[-300:]


if __name__ == "__main__":
    sys.exit(main())
