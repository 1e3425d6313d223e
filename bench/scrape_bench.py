"""Scrape latency of gpuio-exporter against prometheus-node-exporter, measured in the same run.

Both exporters read the same generated procfs/sysfs (N whole disks with 20-field diskstats lines and
PSI files).  Before every scrape the client rewrites the diskstats file with new counter values
(untimed), so every device's line changes between scrapes, as on a busy node: no exporter can serve
a cached answer.  Each exporter gets keep-alive HTTP scrapes from one client, one at a time.

Both run the same collectors (diskstats and pressure; gpuio's others are switched off, as node_exporter's
are), so the comparison is of the same work.  The rounds of the two exporters are interleaved, so that
machine noise hits both alike; the p99 column also shows the lowest and highest p99 of the rounds.

Printed: p50/p99 latency per exporter and scrape mode, their ratio (gpuio / node_exporter, lower is
better), CPU seconds per 1,000 scrapes and RSS of each, at 10 and 100 devices; the RSS of gpuio with
its default collectors (NVML loaded where there is a GPU); then gpuio's time per scrape at 10, 100
and 1,000 devices, to show it grows linearly.

    make bench                 # or: .venv/bin/python bench/scrape_bench.py --scrapes 2000
"""

from __future__ import annotations

import argparse
import http.client
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
# The exporter of this checkout (and its instrumentation library), run by this Python.
EXPORTER_ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(
    filter(None, (REPO, os.path.join(REPO, "exporter", "instrument"), os.environ.get("PYTHONPATH"))))}
NODE_EXPORTER = shutil.which("prometheus-node-exporter") or shutil.which("node_exporter")
PROMETHEUS_ACCEPT = (
    "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,"
    "text/plain;version=0.0.4;q=0.5,*/*;q=0.1"
)
MODES = {
    "plain": {},
    "prometheus": {"Accept": PROMETHEUS_ACCEPT, "Accept-Encoding": "gzip"},
}


def device_names(count: int) -> list[str]:
    names = [f"nvme{i}n1" for i in range(count // 2)]
    names += [f"sd{chr(97 + i // 26) if i >= 26 else ''}{chr(97 + i % 26)}" for i in range(count - len(names))]
    return names


class Fixture:
    """A procfs/sysfs root with ``count`` disks whose diskstats change on every ``tick()``."""

    def __init__(self, root: str, count: int) -> None:
        self.proc = os.path.join(root, "proc")
        self.sys = os.path.join(root, "sys")
        self.names = device_names(count)
        self.generation = 0
        os.makedirs(os.path.join(self.proc, "pressure"), exist_ok=True)
        for resource in ("cpu", "io", "memory"):
            with open(os.path.join(self.proc, "pressure", resource), "w") as handle:
                handle.write("some avg10=1.00 avg60=0.50 avg300=0.10 total=123456789\n"
                             "full avg10=0.50 avg60=0.20 avg300=0.05 total=23456789\n")
        for index, name in enumerate(self.names):
            queue = os.path.join(self.sys, "block", name, "queue")
            os.makedirs(queue, exist_ok=True)
            with open(os.path.join(queue, "rotational"), "w") as handle:
                handle.write("0\n" if name.startswith("nvme") else "1\n")
            with open(os.path.join(self.sys, "block", name, "dev"), "w") as handle:
                handle.write(f"{259 if name.startswith('nvme') else 8}:{index}\n")
        self.tick()

    def tick(self) -> None:
        self.generation += 1
        g = self.generation
        lines = []
        for index, name in enumerate(self.names):
            major = 259 if name.startswith("nvme") else 8
            base = 1_000_000 * (index + 1) + 37 * g
            lines.append(
                f"{major:4d} {index:7d} {name} {base} {base // 7} {base * 8} {base // 3} {base // 2} {base // 9} "
                f"{base * 4} {base // 5} {g % 4} {base // 4} {base // 2} {base // 100} 0 {base} {base // 50} "
                f"{base // 1000} {base // 10}\n")
        temporary = os.path.join(self.proc, "diskstats.tmp")
        with open(temporary, "w") as handle:
            handle.write("".join(lines))
        os.replace(temporary, os.path.join(self.proc, "diskstats"))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class Exporter:
    name: str
    command: list[str]
    port: int
    process: subprocess.Popen | None = None

    def start(self) -> None:
        self.process = subprocess.Popen(self.command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                        env=EXPORTER_ENV, cwd=REPO)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"{self.name} did not start: {' '.join(self.command)}")

    def stop(self) -> None:
        if self.process:
            self.process.terminate()
            self.process.wait(10)

    def cpu_seconds(self) -> float:
        assert self.process
        with open(f"/proc/{self.process.pid}/stat") as handle:
            fields = handle.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def rss_bytes(self) -> int:
        assert self.process
        with open(f"/proc/{self.process.pid}/status") as handle:
            for line in handle:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        return 0


SAME_COLLECTORS = ("--collector.disable-defaults", "--collector.diskstats", "--collector.pressure")


def gpuio(fixture: Fixture, defaults: bool = False) -> Exporter:
    port = free_port()
    return Exporter("gpuio-defaults" if defaults else "gpuio-exporter", [sys.executable, "-m", "exporter",
                                       f"--web.listen-address=127.0.0.1:{port}", f"--path.procfs={fixture.proc}",
                                       f"--path.sysfs={fixture.sys}", "--log.level=error",
                                       *(() if defaults else SAME_COLLECTORS)], port)


def node_exporter(fixture: Fixture) -> Exporter:
    port = free_port()
    return Exporter("node_exporter", [NODE_EXPORTER or "node_exporter", "--collector.disable-defaults",
                                      "--collector.diskstats", "--collector.pressure",
                                      f"--web.listen-address=127.0.0.1:{port}", f"--path.procfs={fixture.proc}",
                                      f"--path.sysfs={fixture.sys}", "--log.level=error"], port)


def scrape_latencies(exporter: Exporter, fixture: Fixture, scrapes: int, headers: dict[str, str]) -> list[float]:
    connection = http.client.HTTPConnection("127.0.0.1", exporter.port, timeout=10)
    latencies = []
    for index in range(scrapes + 50):
        fixture.tick()
        start = time.perf_counter()
        connection.request("GET", "/metrics", headers=headers)
        response = connection.getresponse()
        body = response.read()
        elapsed = time.perf_counter() - start
        if response.status != 200 or not body:
            raise RuntimeError(f"{exporter.name}: HTTP {response.status}")
        if index >= 50:  # the first scrapes warm caches and connections
            latencies.append(elapsed)
    connection.close()
    return latencies


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def measure(exporter: Exporter, fixture: Fixture, scrapes: int, headers: dict[str, str]) -> dict[str, float]:
    cpu_before = exporter.cpu_seconds()
    latencies = scrape_latencies(exporter, fixture, scrapes, headers)
    cpu = exporter.cpu_seconds() - cpu_before
    return {"p50": percentile(latencies, 0.5), "p99": percentile(latencies, 0.99),
            "mean": statistics.fmean(latencies), "cpu_per_1000": cpu / (scrapes + 50) * 1000,
            "rss": exporter.rss_bytes()}


def compare(scrapes: int, devices: int, with_defaults: bool = False) -> None:
    print(f"\n== gpuio-exporter vs node_exporter: {devices} devices, {scrapes} keep-alive scrapes per mode ==")
    print(f"{'mode':<11}{'exporter':<16}{'p50 ms':>9}{'p99 ms':>9}{'CPU s/1000':>12}{'RSS MiB':>9}")
    with tempfile.TemporaryDirectory() as root:
        fixture = Fixture(root, devices)
        exporters = [gpuio(fixture), node_exporter(fixture)]
        if with_defaults:
            exporters.append(gpuio(fixture, defaults=True))
        for exporter in exporters:
            exporter.start()
        try:
            for mode, headers in MODES.items():
                # Interleave the exporters in rounds so that machine noise hits both alike.
                results: dict[str, list[dict[str, float]]] = {e.name: [] for e in exporters}
                for _ in range(4):
                    for exporter in exporters:
                        results[exporter.name].append(measure(exporter, fixture, scrapes // 4, headers))
                summary = {}
                for exporter in exporters:
                    rounds = results[exporter.name]
                    summary[exporter.name] = {key: statistics.median(r[key] for r in rounds) for key in rounds[0]}
                    s = summary[exporter.name]
                    spread = f"{min(r['p99'] for r in rounds) * 1e3:.2f}-{max(r['p99'] for r in rounds) * 1e3:.2f}"
                    print(f"{mode:<11}{exporter.name:<16}{s['p50'] * 1e3:>9.3f}{s['p99'] * 1e3:>9.3f}"
                          f"{s['cpu_per_1000']:>12.3f}{s['rss'] / 2**20:>9.1f}   (p99 of rounds {spread})")
                ours, theirs = summary["gpuio-exporter"], summary["node_exporter"]
                print(f"{mode:<11}{'ratio':<16}{ours['p50'] / theirs['p50']:>9.2f}{ours['p99'] / theirs['p99']:>9.2f}"
                      f"{ours['cpu_per_1000'] / theirs['cpu_per_1000']:>12.2f}{ours['rss'] / theirs['rss']:>9.2f}")
        finally:
            for exporter in exporters:
                exporter.stop()


def default_rss() -> None:
    """gpuio with its default collectors (NVML loaded where there is a GPU), after a few scrapes."""
    with tempfile.TemporaryDirectory() as root:
        fixture = Fixture(root, 10)
        exporter = gpuio(fixture, defaults=True)
        exporter.start()
        try:
            scrape_latencies(exporter, fixture, 20, {})
            time.sleep(2)  # a sampler's first sweep (nvml every second)
            scrape_latencies(exporter, fixture, 20, {})
            print(f"\nRSS of gpuio-exporter with its default collectors: {exporter.rss_bytes() / 2**20:.1f} MiB")
        finally:
            exporter.stop()


def scaling(scrapes: int) -> None:
    """Time per scrape at 10, 100, 1,000 devices; 'us/extra device' is the slope from the row above."""
    print(f"\n== time per scrape by device count ({scrapes} scrapes each, plain) ==")
    print(f"{'devices':>8}{'exporter':>16}{'p50 ms':>9}{'p99 ms':>9}{'us/extra device':>17}")
    previous: dict[str, tuple[int, float]] = {}
    for devices in (10, 100, 1000):
        with tempfile.TemporaryDirectory() as root:
            fixture = Fixture(root, devices)
            for exporter in (gpuio(fixture), node_exporter(fixture)):
                exporter.start()
                try:
                    result = measure(exporter, fixture, scrapes, {})
                finally:
                    exporter.stop()
                slope = ""
                if exporter.name in previous:
                    count, p50 = previous[exporter.name]
                    slope = f"{(result['p50'] - p50) * 1e6 / (devices - count):.1f}"
                previous[exporter.name] = (devices, result["p50"])
                print(f"{devices:>8}{exporter.name:>16}{result['p50'] * 1e3:>9.3f}{result['p99'] * 1e3:>9.3f}"
                      f"{slope:>17}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scrapes", type=int, default=2000)
    parser.add_argument("--devices", default="10,100", help="device counts to compare at (comma-separated)")
    parser.add_argument("--skip-scaling", action="store_true")
    parser.add_argument("--with-defaults", action="store_true",
                        help="also time gpuio with its default collectors (nvml, smart, engines, ...), interleaved")
    args = parser.parse_args()
    if NODE_EXPORTER is None:
        sys.exit("prometheus-node-exporter is not installed (make system-deps)")
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs, node_exporter at {NODE_EXPORTER}")
    for devices in args.devices.split(","):
        compare(args.scrapes, int(devices), args.with_defaults)
    default_rss()
    if not args.skip_scaling:
        scaling(max(200, args.scrapes // 4))


if __name__ == "__main__":
    main()
