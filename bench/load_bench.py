"""Load: many concurrent scrapers against one gpuio-exporter on loopback, for minutes.

Each scraper is a keep-alive HTTP/1.1 connection that sends what Prometheus sends (OpenMetrics
Accept header, gzip) and, by default, the next request as soon as the answer is in (a closed loop:
the exporter is kept saturated, the worst case; ``--interval 1`` paces each scraper at 1 scrape/s
like a Prometheus with a 1 s scrape interval).  Every answer is checked: HTTP 200, gzip that
decompresses, both collectors reporting success 1, and the OpenMetrics ``# EOF`` at the end.
Anything else is an error (503 included: the exporter runs with ``--web.max-requests`` equal to the
number of scrapers, so none may be shed).  The exporter reads this machine's real /proc and /sys.

While it runs, the exporter's RSS, open file descriptors and threads are sampled every 5 s.

Printed: scrapes, errors, throughput, latency p50/p90/p99/p99.9/max, CPU per 1,000 scrapes, and
RSS/fd/thread at the end of warm-up (the first 10 % of the run, at least 30 s) and at the end, with
the RSS slope over the rest of the run.

    .venv/bin/python bench/load_bench.py                  # 50 scrapers, 10 minutes
    .venv/bin/python bench/load_bench.py --duration 60    # a quick run
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
LIBRARY = os.path.join(REPO, "exporter", "instrument")  # gpuio, the instrumentation library, from this checkout
sys.path.insert(0, LIBRARY)
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, (LIBRARY, os.environ.get("PYTHONPATH"))))
PROMETHEUS_ACCEPT = (
    "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,"
    "text/plain;version=0.0.4;q=0.5,*/*;q=0.1"
)
EXPECTED = (b'gpuio_scrape_collector_success{collector="diskstats"} 1\n',
            b'gpuio_scrape_collector_success{collector="pressure"} 1\n')


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def process_figures(pid: int) -> dict[str, float]:
    """RSS (bytes), open fds, threads and CPU seconds of a process, from /proc."""
    figures: dict[str, float] = {}
    with open(f"/proc/{pid}/status") as handle:
        for line in handle:
            if line.startswith("VmRSS:"):
                figures["rss"] = int(line.split()[1]) * 1024
            elif line.startswith("Threads:"):
                figures["threads"] = int(line.split()[1])
    figures["fds"] = len(os.listdir(f"/proc/{pid}/fd"))
    with open(f"/proc/{pid}/stat") as handle:
        stat = handle.read().rsplit(")", 1)[1].split()
    figures["cpu"] = (int(stat[11]) + int(stat[12])) / os.sysconf("SC_CLK_TCK")
    return figures


def start_exporter(args: list[str]) -> tuple[subprocess.Popen, int]:
    port = free_port()
    command = [sys.executable, "-m", "exporter", f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn", *args]
    process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"exporter exited: {process.stderr.read() if process.stderr else ''}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5) as sock:
                sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                if sock.recv(100).startswith(b"HTTP/1.1 200"):
                    return process, port
        except OSError:
            pass
        time.sleep(0.1)
    process.kill()
    raise SystemExit("exporter did not start")


@dataclass
class Results:
    latencies: list[float] = field(default_factory=list)
    errors: dict[str, int] = field(default_factory=dict)
    samples: list[tuple[float, dict[str, float]]] = field(default_factory=list)

    def error(self, kind: str) -> None:
        self.errors[kind] = self.errors.get(kind, 0) + 1


REQUEST = (f"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nAccept: {PROMETHEUS_ACCEPT}\r\n"
           "Accept-Encoding: gzip\r\nUser-Agent: gpuio-load-bench\r\n\r\n").encode()


async def scrape_once(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> str | None:
    """One request on the connection; None if the answer is good, else what was wrong."""
    writer.write(REQUEST)
    head = await reader.readuntil(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in header_lines if ": " in line)
    headers = {key.lower(): value for key, value in headers.items()}
    body = await reader.readexactly(int(headers.get("content-length", "0")))
    if not status_line.startswith("HTTP/1.1 200"):
        return f"status {status_line[9:12]}"
    if headers.get("content-encoding") != "gzip":
        return "not gzip"
    text = gzip.decompress(body)
    if not all(line in text for line in EXPECTED):
        return "a collector failed"
    if not text.endswith(b"# EOF\n"):
        return "no # EOF"
    return None


async def scraper(port: int, stop_at: float, interval: float, results: Results) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        while time.monotonic() < stop_at:
            started = time.perf_counter()
            try:
                problem = await asyncio.wait_for(scrape_once(reader, writer), timeout=30)
            except (OSError, asyncio.IncompleteReadError, asyncio.TimeoutError, ValueError) as exc:
                results.error(type(exc).__name__)
                writer.close()
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                continue
            results.latencies.append(time.perf_counter() - started)
            if problem:
                results.error(problem)
            if interval:
                await asyncio.sleep(max(0.0, interval - (time.perf_counter() - started)))
    finally:
        writer.close()


async def sampler(pid: int, stop_at: float, results: Results, every: float) -> None:
    start = time.monotonic()
    while True:
        results.samples.append((time.monotonic() - start, process_figures(pid)))
        if time.monotonic() >= stop_at:
            return
        await asyncio.sleep(min(every, max(0.0, stop_at - time.monotonic())))


def percentile(ordered: list[float], fraction: float) -> float:
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def slope_per_minute(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of (seconds, value), per minute."""
    if len(points) < 2:
        return 0.0
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    denominator = sum((x - mean_x) ** 2 for x in xs)
    if denominator == 0:
        return 0.0
    return sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / denominator * 60


async def run(args: argparse.Namespace, pid: int, port: int) -> Results:
    results = Results()
    stop_at = time.monotonic() + args.duration
    tasks = [asyncio.create_task(scraper(port, stop_at, args.interval, results)) for _ in range(args.scrapers)]
    tasks.append(asyncio.create_task(sampler(pid, stop_at, results, args.sample_every)))
    await asyncio.gather(*tasks)
    return results


def report(args: argparse.Namespace, results: Results, cpu: float) -> dict[str, object]:
    ordered = sorted(results.latencies)
    scrapes = len(ordered)
    warmup = max(30.0, args.duration * 0.1)
    after = [(t, s) for t, s in results.samples if t >= warmup] or results.samples[-1:]
    first, last = after[0][1], results.samples[-1][1]
    summary: dict[str, object] = {
        "scrapers": args.scrapers, "duration_s": args.duration, "interval_s": args.interval,
        "scrapes": scrapes, "errors": sum(results.errors.values()), "error_kinds": results.errors,
        "scrapes_per_s": scrapes / args.duration,
        "latency_ms": {name: percentile(ordered, q) * 1e3 for name, q in
                       (("p50", 0.5), ("p90", 0.9), ("p99", 0.99), ("p99.9", 0.999))} | {"max": ordered[-1] * 1e3},
        "cpu_s_per_1000": cpu / scrapes * 1000 if scrapes else 0.0,
        "rss_mib": {"start": results.samples[0][1]["rss"] / 2**20, "after_warmup": first["rss"] / 2**20,
                    "end": last["rss"] / 2**20, "max_after_warmup": max(s["rss"] for _, s in after) / 2**20,
                    "slope_kib_per_min": slope_per_minute([(t, s["rss"] / 1024) for t, s in after])},
        "fds": {"after_warmup": first["fds"], "end": last["fds"], "max": max(s["fds"] for _, s in after)},
        "threads": {"after_warmup": first["threads"], "end": last["threads"],
                    "max": max(s["threads"] for _, s in after)},
    }
    latency = summary["latency_ms"]
    rss, fds, threads = summary["rss_mib"], summary["fds"], summary["threads"]
    assert isinstance(latency, dict) and isinstance(rss, dict) and isinstance(fds, dict) and isinstance(threads, dict)
    print(f"\n== {args.scrapers} scrapers x {args.duration:.0f} s, interval {args.interval or 'none (closed loop)'} ==")
    print(f"scrapes {scrapes}  errors {summary['errors']} {results.errors or ''}  "
          f"throughput {scrapes / args.duration:.0f}/s  CPU {summary['cpu_s_per_1000']:.3f} s per 1000 scrapes")
    print("latency ms  " + "  ".join(f"{name} {value:.2f}" for name, value in latency.items()))
    print(f"RSS MiB     start {rss['start']:.1f}  after warm-up ({warmup:.0f} s) {rss['after_warmup']:.1f}  "
          f"end {rss['end']:.1f}  max {rss['max_after_warmup']:.1f}  slope {rss['slope_kib_per_min']:+.1f} KiB/min")
    print(f"fds         after warm-up {fds['after_warmup']}  end {fds['end']}  max {fds['max']}")
    print(f"threads     after warm-up {threads['after_warmup']}  end {threads['end']}  max {threads['max']}")
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scrapers", type=int, default=50)
    parser.add_argument("--duration", type=float, default=600.0, help="seconds (default 600)")
    parser.add_argument("--interval", type=float, default=0.0,
                        help="seconds between one scraper's requests; 0: the next as soon as the answer is in")
    parser.add_argument("--sample-every", type=float, default=5.0, help="seconds between RSS/fd/thread samples")
    parser.add_argument("--json", help="also write the figures here")
    parser.add_argument("exporter_args", nargs="*", help="more exporter flags, after --")
    args = parser.parse_args()
    process, port = start_exporter([f"--web.max-requests={args.scrapers}", *args.exporter_args])
    try:
        import uvloop

        cpu_before = process_figures(process.pid)["cpu"]
        results = uvloop.run(run(args, process.pid, port))
        cpu = process_figures(process.pid)["cpu"] - cpu_before
    finally:
        process.terminate()
        _, stderr = process.communicate(timeout=30)
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs; exporter pid {process.pid}")
    summary = report(args, results, cpu)
    if stderr.strip():
        print("exporter log (warn and above):\n" + stderr[-3000:])
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(summary | {"samples": results.samples}, handle, indent=1)
    if summary["errors"]:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
