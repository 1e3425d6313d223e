"""Fleet scale: gpuio's rules and boards on a simulated fleet, timed in a real Prometheus.

    python bench/fleet_bench.py                       # 100 nodes x 8 GPUs x 20 engines x 24 disks
    python bench/fleet_bench.py --nodes 1000 --history 16 --live 2 --samples 2 --query-runs 1
                                                      # the full fleet: ~4 M series, a host with 16 cores and
                                                      # 64 GiB; the history is written by --jobs processes

1. Writes OpenMetrics text of ``--nodes`` nodes, each with ``--gpus`` GPUs, ``--engines`` engines (each on
   one GPU, its file on the node's first NVMe disk, in one pod) and ``--disks`` disks, sampled every 15 s
   from ``--history`` minutes ago to ``--ahead`` minutes from now.  The families and label sets are the
   exporter's own (the engines' histograms with the instrumentation library's real bucket bounds); the
   values are a calm fleet in which ``--storm`` of the nodes are in a cold-start storm for the last 8
   minutes (their NVMe saturated, every engine loading from it, their GPUs idle), so that every rule has
   work to do.  Prints the series per node and per GPU, engine and disk (the cardinality budget).
2. Turns the text into TSDB blocks with ``promtool tsdb create-blocks-from openmetrics``.
3. Starts Prometheus on those blocks with gpuio's rules (deploy/prometheus/rules/*.yml, 15 s evaluations):
   since the samples reach into the future, the rules evaluate on live-looking data.  After a few
   evaluations it prints each group's and each rule's last evaluation time, slowest first.
4. Runs every panel query of every board (dashboards/*.json) the way Grafana sends it (one node chosen on
   the node boards, all nodes on the Fleet board; a range query over the history at a 15 s step for
   graphs, an instant query for tables and stats), three times, and prints the median wall time, slowest
   first.

Nothing here is asserted: the figures go in docs/performance.md ("Fleet scale").
"""

from __future__ import annotations

import argparse
import glob
import http.server
import json
import multiprocessing
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable

import yaml

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "exporter", "instrument"))

from deploy.prometheus.generate import dump  # noqa: E402
from deploy.prometheus.sources import rule_files  # noqa: E402
from deploy.victoriametrics import vmalert  # noqa: E402  (vmalert's copy of the rules, and its shards)
from exporter.collectors.engines import DEFAULT_BUCKETED  # noqa: E402  (which histograms keep their buckets)
from gpuio import spool  # noqa: E402  (the instrumentation library: the engines' real histogram layout)

STEP = 15
COLLECTORS = ("diskstats", "pressure", "nvml", "smart", "engines", "mountstats", "pods")
COLLECTOR_STATES = ("ok", "pending", "absent", "failing", "stale")
SMART_STATES = ("ok", "asleep", "timeout", "error", "permission_denied", "unsupported")
THROTTLE = ("hw_slowdown", "sw_thermal_slowdown", "hw_thermal_slowdown", "hw_power_brake_slowdown")
LOAD_CLASSES = ("cold", "warm", "partial")


Value = Callable[[float], float]  # the value at a sample index (0: the first sample of the history)


def labels(**pairs: str) -> str:
    return ",".join(f'{k}="{v}"' for k, v in pairs.items())


class Node:
    """One node's series: name{labels} -> a function of the sample index giving its value."""

    def __init__(self, index: int, gpus: int, engines: int, disks: int, storming: bool, storm_from: int,
                 calm_loads: float = 0.01, bucketed: tuple[str, ...] = DEFAULT_BUCKETED, up: bool = False,
                 shard: str = "") -> None:
        self.instance = f"node-{index:04d}:9817"
        self.shard = shard  # its vmalert shard's label (the scrape's relabeling, in production), or none
        self.calm_loads = calm_loads  # loads each engine finishes per second on a calm node
        self.bucketed = bucketed  # the engine histograms served with buckets (the others: _sum, _count)
        self.series: list[tuple[str, str, Value]] = []  # family, labels without job and instance, value
        self.counts = {"node": 0, "gpu": 0, "engine": 0, "disk": 0}
        self.storm_from = storm_from if storming else float("inf")
        self._node()
        self._disks(disks)
        uuids = self._gpus(gpus)
        self._engines(engines, uuids)
        if up:  # what a scrape would add, for a history that stands in for the scrapes (not counted)
            self.series.append(("up", "", self.gauge(1, 1)))

    def add(self, kind: str, family: str, value: Value, **pairs: str) -> None:
        self.series.append((family, labels(**pairs), value))
        self.counts[kind] += 1

    def counter(self, rate_calm: float, rate_storm: float) -> Value:
        """A counter growing at ``rate_calm`` per second, at ``rate_storm`` from the storm on."""
        begins = self.storm_from

        def value(i: float) -> float:
            return (rate_calm * min(i, begins) + rate_storm * max(0.0, i - begins)) * STEP
        return value

    def gauge(self, calm: float, storm_value: float) -> Value:
        begins = self.storm_from
        return lambda i: float(storm_value if i >= begins else calm)

    # --- the parts of a node ------------------------------------------------------------------------
    def _node(self) -> None:
        started = time.time() - 86400.0  # the exporter process, up for a day (the storm alerts' gap hold)
        self.add("node", "process_start_time_seconds", self.gauge(started, started))
        self.add("node", "gpuio_pressure_io_waiting_seconds_total", self.counter(0.02, 0.7))
        self.add("node", "gpuio_pressure_io_stalled_seconds_total", self.counter(0.0, 0.3))
        self.add("node", "gpuio_pressure_memory_waiting_seconds_total", self.counter(0.0, 0.0))
        self.add("node", "gpuio_pressure_cpu_waiting_seconds_total", self.counter(0.05, 0.05))
        self.add("node", "gpuio_gpu_snapshot_age_seconds", self.gauge(0.5, 0.5))
        self.add("node", "gpuio_mount_engine_loads_in_progress", self.gauge(0, 0), mountpoint="/models")
        for collector in COLLECTORS:
            self.add("node", "gpuio_scrape_collector_success", self.gauge(1, 1), collector=collector)
            self.add("node", "gpuio_scrape_collector_duration_seconds", self.gauge(0.001, 0.001),
                     collector=collector)
            for state in COLLECTOR_STATES:
                self.add("node", "gpuio_scrape_collector_state", self.gauge(state == "ok", state == "ok"),
                         collector=collector, state=state)

    def _disks(self, disks: int) -> None:
        for d in range(disks):
            device = f"nvme{d}n1"
            stormy = d == 0
            calm_reads, calm_await, calm_queue = 300.0, 0.0002, 0.1
            storm = (2000.0, 0.025, 60.0) if stormy else (calm_reads, calm_await, calm_queue)
            self.add("disk", "gpuio_disk_info", self.gauge(1, 1), device=device, major="259", minor=str(d),
                     rotational="0")
            self.add("disk", "gpuio_disk_reads_completed_total", self.counter(calm_reads, storm[0]), device=device)
            self.add("disk", "gpuio_disk_read_time_seconds_total",
                     self.counter(calm_reads * calm_await, storm[0] * storm[1]), device=device)
            self.add("disk", "gpuio_disk_writes_completed_total", self.counter(20, 20), device=device)
            self.add("disk", "gpuio_disk_write_time_seconds_total", self.counter(20 * 0.0001, 20 * 0.0001),
                     device=device)
            self.add("disk", "gpuio_disk_io_time_weighted_seconds_total", self.counter(calm_queue, storm[2]),
                     device=device)
            self.add("disk", "gpuio_disk_io_time_seconds_total", self.counter(0.1, 1.0 if stormy else 0.1),
                     device=device)
            self.add("disk", "gpuio_disk_read_bytes_total", self.counter(calm_reads * 131072, storm[0] * 131072),
                     device=device)
            self.add("disk", "gpuio_disk_written_bytes_total", self.counter(20 * 4096, 20 * 4096), device=device)
            if d == 0:  # served for the disks holding an engine file only: the engines' files are all here
                self.add("disk", "gpuio_disk_engine_loads_in_progress", self.gauge(0, 20 if stormy else 0),
                         device=device)
                self.add("disk", "gpuio_disk_engine_load_oldest_in_progress_seconds",
                         self.gauge(0, 90 if stormy else 0), device=device)
            self.add("disk", "gpuio_smart_health_passed", self.gauge(1, 1), device=device)
            self.add("disk", "gpuio_smart_last_success_timestamp_seconds", self.gauge(time.time(), time.time()),
                     device=device)
            for state in SMART_STATES:
                self.add("disk", "gpuio_smart_device_state", self.gauge(state == "ok", state == "ok"), device=device,
                         state=state)

    def _gpus(self, gpus: int) -> list[str]:
        uuids = []
        for g in range(gpus):
            uuid = f"GPU-{self.instance[5:9]}-{g:04d}"
            uuids.append(uuid)
            gpu = {"gpu": str(g), "uuid": uuid}
            self.add("gpu", "gpuio_gpu_info", self.gauge(1, 1), **gpu, name="NVIDIA H100 80GB HBM3")
            self.add("gpu", "gpuio_gpu_up", self.gauge(1, 1), **gpu)
            self.add("gpu", "gpuio_gpu_busy_seconds_total", self.counter(0.85, 0.03), **gpu)
            self.add("gpu", "gpuio_gpu_sm_active_seconds_total", self.counter(0.7, 0.01), **gpu)
            self.add("gpu", "gpuio_gpu_utilization_ratio", self.gauge(0.85, 0.03), **gpu)
            self.add("gpu", "gpuio_gpu_memory_used_bytes", self.gauge(6e10, 1e10), **gpu)
            self.add("gpu", "gpuio_gpu_memory_total_bytes", self.gauge(8.5e10, 8.5e10), **gpu)
            self.add("gpu", "gpuio_gpu_pcie_receive_bytes_total", self.counter(1e8, 2e9), **gpu)
            for reason in THROTTLE:
                self.add("gpu", "gpuio_gpu_clocks_event_seconds_total", self.counter(0, 0), **gpu, reason=reason)
        self.add("node", "gpuio_gpu_devices", self.gauge(gpus, gpus))
        return uuids

    def _engines(self, engines: int, uuids: list[str]) -> None:
        for e in range(engines):
            engine, uuid = f"model-{e:02d}", uuids[e % len(uuids)]
            path = f"/models/{engine}.plan"
            on = {"engine": engine, "gpu_uuid": uuid}
            self.add("engine", "gpuio_engine_info", self.gauge(1, 1), engine=engine, path=path, device="nvme0n1",
                     cuda_device=str(e % len(uuids)), gpu_uuid=uuid, runtime="tensorrt")
            self.add("engine", "gpuio_engine_physical_device_info", self.gauge(1, 1), engine=engine, path=path,
                     physical_device="nvme0n1")
            self.add("engine", "gpuio_engine_mount_info", self.gauge(1, 1), engine=engine, path=path,
                     mountpoint="/models", fstype="xfs", source="/dev/nvme0n1")
            self.add("engine", "gpuio_engine_pod_info", self.gauge(1, 1), **on, namespace="serving",
                     pod=f"{engine}-{self.instance[5:9]}", container="server", pod_uid=f"uid-{e}")
            self.add("engine", "gpuio_engine_loads_in_progress", self.gauge(0, 1), **on)
            # a storm's pods crash-loop: a load abandoned every 90 s
            self.add("engine", "gpuio_engine_loads_abandoned_total", self.counter(0, 1 / 90), **on)
            self.add("engine", "gpuio_engine_predicted_cold_start_seconds", self.gauge(8, 45), engine=engine)
            self.add("engine", "gpuio_engine_file_cached_ratio", self.gauge(1, 0.1), engine=engine, path=path)
            self.add("engine", "gpuio_engine_last_load_timestamp_seconds", self.gauge(1, 1), **on)
            for cls in LOAD_CLASSES:
                self.add("engine", "gpuio_engine_loads_total", self.counter(0, 0.01 if cls == "cold" else 0),
                         engine=engine, **{"class": cls})
            self._spool(on)

    def _spool(self, on: dict[str, str]) -> None:
        """The families a process reports through the library, with its bucket bounds."""
        for series in spool.ENGINE_SERIES:
            if series.type == spool.HISTOGRAM:
                calm_count, storm_count = (50.0, 2.0) if "inference" in series.name else (0.01, 0.01)
                if series.name.startswith("gpuio_engine_load_"):
                    calm_count = self.calm_loads
                typical = series.bounds[len(series.bounds) // 2]
                for bound in (*series.bounds, "+Inf") if series.name in self.bucketed else ():
                    share = 1.0 if bound == "+Inf" or bound >= typical else 0.0
                    self.add("engine", series.name + "_bucket", self.counter(calm_count * share, storm_count * share),
                             **on, le=str(bound))
                self.add("engine", series.name + "_sum", self.counter(calm_count * typical, storm_count * typical),
                         **on)
                self.add("engine", series.name + "_count", self.counter(calm_count, storm_count), **on)
            elif series.type == spool.COUNTER:
                self.add("engine", series.name, self.counter(1, 1), **on)
            else:
                calm, storm = (4, 4) if "contexts" in series.name else (1, 4)
                self.add("engine", series.name, self.gauge(calm, storm), **on)


def stormy(args: argparse.Namespace) -> int:
    return max(1, round(args.nodes * args.storm)) if args.storm else 0


def fleet(args: argparse.Namespace) -> list[Node]:
    storm_from = (args.history - 8) * 60 // STEP
    bucketed = tuple(s.name for s in spool.ENGINE_SERIES) if args.all_buckets else DEFAULT_BUCKETED
    # Nodes dealt to the vmalert shards in turn: in production the scrape's hashmod of the node's name,
    # which spreads them as evenly at this size.
    return [Node(n, args.gpus, args.engines, args.disks, n < stormy(args), storm_from, args.calm_loads, bucketed,
                 up=not args.live, shard=str(n % args.vmalert_shards) if args.vmalert_shards else "")
            for n in range(args.nodes)]


def write_openmetrics(path: str, nodes: list[Node], samples: int, start: float, milliseconds: bool = False) -> None:
    """The history: every series of every node, one sample every STEP seconds from ``start`` (OpenMetrics,
    timestamps in seconds; ``milliseconds``: the Prometheus text format VictoriaMetrics imports)."""
    scale = 1000 if milliseconds else 1
    stamps = [f"{(start + i * STEP) * scale:.0f}" for i in range(samples)]
    with open(path, "w", buffering=1 << 22) as out:
        for node in nodes:
            for family, pairs, value in node.series:
                shard = f',shard="{node.shard}"' if node.shard else ""
                name = f'{family}{{job="gpuio",instance="{node.instance}"{shard}' + (f",{pairs}}}" if pairs else "}")
                out.write("".join(f"{name} {value(i):.9g} {stamps[i]}\n" for i in range(samples)))
        if not milliseconds:
            out.write("# EOF\n")


_FLEET: list[Node] = []  # the nodes, for the forked writers (their value functions cannot be pickled)


def _write_blocks(job: tuple[int, int, str, str, int, float]) -> int:
    """One share of the nodes as OpenMetrics, turned into blocks in ``data`` and deleted: returns its size.
    Shares run in parallel, each its own promtool: their blocks overlap in time, which Prometheus merges."""
    first, last, work, data, samples, start = job
    text = os.path.join(work, f"fleet-{first}.om")
    write_openmetrics(text, _FLEET[first:last], samples, start)
    size = os.path.getsize(text)
    subprocess.run(["promtool", "tsdb", "create-blocks-from", "openmetrics", text, data], check=True,
                   stdout=subprocess.DEVNULL)
    os.remove(text)
    return size


def _import(job: tuple[int, int, str, str, int, float]) -> int:
    """One share of the nodes in the text format, imported into VictoriaMetrics at ``target`` (its import
    URL) and deleted: returns its size."""
    first, last, work, target, samples, start = job
    text = os.path.join(work, f"fleet-{first}.prom")
    write_openmetrics(text, _FLEET[first:last], samples, start, milliseconds=True)
    size = os.path.getsize(text)
    with open(text, "rb") as body:
        request = urllib.request.Request(target, data=body, method="POST",
                                         headers={"Content-Length": str(size), "Content-Type": "text/plain"})
        urllib.request.urlopen(request, timeout=3600).read()
    os.remove(text)
    return size


def write_history(nodes: list[Node], work: str, data: str, samples: int, start: float, jobs: int,
                  writer: Callable = _write_blocks) -> int:
    """The history of every node, written by ``jobs`` processes: as TSDB blocks in ``data`` (``writer``
    _write_blocks), or imported into VictoriaMetrics at the URL ``data`` (_import); returns the bytes of text
    written (never all on disk at once: each share is deleted once converted)."""
    _FLEET[:] = nodes
    shares = max(1, min(len(nodes), jobs * 4))  # several shares per process: the last ones finish together
    bounds = [len(nodes) * k // shares for k in range(shares + 1)]
    work_list = [(a, b, work, data, samples, start) for a, b in zip(bounds, bounds[1:], strict=False) if b > a]
    with multiprocessing.get_context("fork").Pool(jobs) as pool:
        return sum(pool.map(writer, work_list, chunksize=1))


class Exposition(http.server.BaseHTTPRequestHandler):
    """Serves each node's series as an exporter would, at the current time: /metrics?node=<index>."""

    nodes: list[Node] = []
    start = 0.0

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        node = self.nodes[int(urllib.parse.parse_qs(urllib.parse.urlparse(self.path).query)["node"][0])]
        i = (time.time() - self.start) / STEP
        body = "".join(f"{family}{{{pairs}}} {value(i):.9g}\n" if pairs else f"{family} {value(i):.9g}\n"
                       for family, pairs, value in node.series).encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def evaluations(base: str, samples: int) -> list[dict]:
    """The rule groups with each group's and rule's evaluation time averaged over ``samples`` evaluations
    (Prometheus reports the last one only: one sample is at the mercy of whatever else the machine did)."""
    seen: list[list[dict]] = []
    last = ""
    while len(seen) < samples:
        groups = get(base, "/api/v1/rules")["data"]["groups"]
        stamp = max(group["lastEvaluation"] for group in groups)
        if stamp != last:
            seen.append(groups)
            last = stamp
        time.sleep(STEP / 3)
    merged = seen[-1]
    for g, group in enumerate(merged):
        group["evaluationTime"] = statistics.mean(run[g]["evaluationTime"] for run in seen)
        for r, rule in enumerate(group["rules"]):
            rule["evaluationTime"] = statistics.mean(run[g]["rules"][r]["evaluationTime"] for run in seen)
    return merged


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def get(base: str, path: str, **params: str) -> dict:
    url = f"{base}{path}?{urllib.parse.urlencode(params)}"
    try:
        with urllib.request.urlopen(url, timeout=300) as response:
            return json.load(response)  # type: ignore[no-any-return]
    except urllib.error.HTTPError as error:
        raise RuntimeError(f"{params.get('query', path)}: HTTP {error.code}: {error.read()[:500]!r}") from None


def timed(base: str, path: str, runs: int = 3, **params: str) -> tuple[float, int]:
    times, count = [], 0
    for _ in range(runs):
        began = time.perf_counter()
        result = get(base, path, **params)
        times.append(time.perf_counter() - began)
        assert result["status"] == "success", result
        count = len(result["data"]["result"])
    return statistics.median(times), count


def substitute(expr: str, instance: str, range_s: int) -> str:
    for name, value in (("$__rate_interval", "1m"), ("$__range", f"{range_s}s"), ("$instance", instance),
                        ("$cluster", ".*"), ("$device", ".+"),
                        ("$gpu", ".*"), ("$engine", ".*"), ("$namespace", ".*"), ("$pod", ".*")):
        expr = expr.replace(name, value)
    return expr


def panel_queries(base: str, now: float, history_s: int, runs: int) -> list[tuple[float, int, str, str]]:
    rows = []
    for path in sorted(glob.glob(os.path.join(REPO, "dashboards", "*.json"))):
        with open(path) as handle:
            board = json.load(handle)
        instance = ".+" if board["uid"] == "gpuio-fleet" else "node-0000:9817"
        for panel in [p for top in board["panels"] for p in (top, *top.get("panels", []))]:
            for target in panel.get("targets", []):
                expr = substitute(target["expr"], instance, history_s)
                if target.get("instant") and not target.get("range"):
                    seconds, count = timed(base, "/api/v1/query", runs, query=expr, time=f"{now:.0f}")
                else:
                    seconds, count = timed(base, "/api/v1/query_range", runs, query=expr,
                                           start=f"{now - history_s:.0f}", end=f"{now:.0f}", step=str(STEP))
                rows.append((seconds, count, board["uid"], f"{panel['title']} [{target['refId']}]"))
    return sorted(rows, reverse=True)


def scrape_configs(nodes: list[Node], exporter: str) -> str:
    """The gpuio job over every simulated node (served at /metrics?node=N), named as the exporter's nodes."""
    targets = "".join(f"      - targets: ['{exporter}']\n        labels: {{node: '{n}', name: '{node.instance}'"
                      + (f", shard: '{node.shard}'" if node.shard else "") + "}\n" for n, node in enumerate(nodes))
    return ("scrape_configs:\n  - job_name: gpuio\n    static_configs:\n" + targets +
            "    relabel_configs:\n"
            "      - {source_labels: [node], target_label: __param_node}\n"
            "      - {source_labels: [name], target_label: instance}\n"
            "      - {regex: 'node|name', action: labeldrop}\n")


def rss_mib(processes: list[subprocess.Popen]) -> float:
    """Resident memory of ``processes`` together, MiB."""
    return sum(map(process_rss_mib, processes))


def process_rss_mib(process: subprocess.Popen) -> float:
    with open(f"/proc/{process.pid}/status") as handle:
        return next(int(line.split()[1]) for line in handle if line.startswith("VmRSS:")) / 1024


def memory_by_component(processes: list[subprocess.Popen]) -> str:
    """Resident memory of each kind of server (victoria-metrics, vmalert x N with its largest, ...)."""
    kinds: dict[str, list[float]] = {}
    for process in processes:
        kinds.setdefault(os.path.basename(str(process.args[0])), []).append(process_rss_mib(process))
    return ", ".join(f"{kind} {sum(sizes):,.0f} MiB" + (f" ({len(sizes)}, the largest {max(sizes):,.0f})"
                                                        if len(sizes) > 1 else "")
                     for kind, sizes in kinds.items())


def host_load() -> str:
    """The host's load average against its CPUs: whether the rules' queries had the cores they asked for."""
    one, five, _ = os.getloadavg()
    return f"load average {one:.1f} (1 min), {five:.1f} (5 min) on {os.cpu_count()} CPUs"


def serve_on_free_port(command: list[str], address_flag: str, ready: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    process = subprocess.Popen([*command, f"{address_flag}127.0.0.1:{port}"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            urllib.request.urlopen(base + ready, timeout=5).read()
            return process, base
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{command[0]} did not start") from None
            time.sleep(0.2)


class Backend:
    """Where the fleet's history and live scrapes go, and who evaluates the rules: ``base`` answers the
    Prometheus query API; ``processes`` are its servers."""

    name = ""
    tools: tuple[str, ...] = ()

    def __init__(self, work: str, rules: list[str]) -> None:
        self.work, self.rules = work, rules
        self.processes: list[subprocess.Popen] = []
        self.base = ""

    def history(self, nodes: list[Node], samples: int, start: float, jobs: int) -> int:
        """Store the fleet's history; the bytes of text it took."""
        raise NotImplementedError

    def live(self, scrape: str) -> None:
        """Start scraping (``scrape``: the scrape_configs section) and evaluating the rules."""
        raise NotImplementedError

    def evaluate(self) -> None:
        """Start evaluating the rules over the history alone (no scrapes: it reaches past now)."""
        raise NotImplementedError(f"{self.name} takes no samples ahead of now: run it with --live")

    def groups(self, samples: int) -> list[dict]:
        """The rule groups, each with its mean evaluation time over ``samples`` evaluations."""
        raise NotImplementedError

    def stop(self) -> None:
        for process in reversed(self.processes):
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=120)


class PrometheusBackend(Backend):
    name = "Prometheus"
    tools = ("promtool", "prometheus")

    def history(self, nodes: list[Node], samples: int, start: float, jobs: int) -> int:
        self.data = os.path.join(self.work, "data")
        return write_history(nodes, self.work, self.data, samples, start, jobs)

    def live(self, scrape: str) -> None:
        config = os.path.join(self.work, "prometheus.yml")
        with open(config, "w") as handle:
            handle.write(f"global:\n  evaluation_interval: {STEP}s\n  scrape_interval: {STEP}s\n"
                         "rule_files:\n" + "".join(f"  - {r}\n" for r in self.rules) + scrape)
        process, self.base = serve_on_free_port(
            ["prometheus", f"--config.file={config}", f"--storage.tsdb.path={self.data}",
             "--storage.tsdb.retention.time=30d", "--query.max-samples=200000000"], "--web.listen-address=", "/-/ready")
        self.processes.append(process)

    def groups(self, samples: int) -> list[dict]:
        return evaluations(self.base, samples)


class VictoriaMetricsBackend(Backend):
    """victoria-metrics (the history imported over HTTP), vmagent scraping, vmalert evaluating vmalert's copy
    of the rules (deploy/victoriametrics/vmalert.py) with the flags of deploy/victoriametrics/docker-compose.yml:
    one vmalert, or with ``shards`` one per shard of the nodes, each on its shard's copy."""

    name = "VictoriaMetrics"
    tools = ("victoria-metrics", "vmagent", "vmalert")

    def __init__(self, work: str, rules: list[str], shards: int = 0, unfolded: bool = False) -> None:
        super().__init__(work, rules)
        directory = os.path.join(work, "vmalert")
        self.rule_dirs = [os.path.join(directory, f"shard-{k}") for k in range(shards)] if shards else [directory]
        files = vmalert.rendered(directory=directory, node_exporter_directory=os.path.join(work, "vmalert-ne"),
                                 shards=shards)
        if unfolded:  # the peer: Prometheus' rule files as they are (each link of a chain one evaluation later)
            files = {os.path.join(place, f"{name}.yml"): dump(content)
                     for k, place in enumerate(self.rule_dirs)
                     for name, content in (vmalert.shard(rule_files(), k) if shards else rule_files()).items()}
        for path, text in files.items():
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w", encoding="utf-8") as handle:
                handle.write(text)
        self.vmalerts: list[str] = []
        self.before_measured: dict[str, float] = {}

    def history(self, nodes: list[Node], samples: int, start: float, jobs: int) -> int:
        process, self.base = serve_on_free_port(
            ["victoria-metrics", f"-storageDataPath={os.path.join(self.work, 'vm-data')}", "-retentionPeriod=30d",
             "-search.maxSamplesPerQuery=2000000000", "-search.maxUniqueTimeseries=100000000",
             "-search.maxQueryDuration=300s"],
            "-httpListenAddr=", "/health")
        self.processes.append(process)
        size = write_history(nodes, self.work, f"{self.base}/api/v1/import/prometheus", samples, start, jobs,
                             writer=_import)
        urllib.request.urlopen(f"{self.base}/internal/force_flush", timeout=600).read()
        return size

    def live(self, scrape: str) -> None:
        config = os.path.join(self.work, "scrape.yml")
        with open(config, "w") as handle:
            handle.write(f"global:\n  scrape_interval: {STEP}s\n" + scrape)
        agent, _ = serve_on_free_port(["vmagent", f"-promscrape.config={config}",
                                       f"-remoteWrite.url={self.base}/api/v1/write",
                                       f"-remoteWrite.tmpDataPath={os.path.join(self.work, 'vmagent')}"],
                                      "-httpListenAddr=", "/health")
        self.processes.append(agent)
        self.evaluate()

    def evaluate(self) -> None:
        for rules in self.rule_dirs:
            alert, url = serve_on_free_port(
                ["vmalert", f"-rule={os.path.join(rules, '*.yml')}",
                 f"-datasource.url={self.base}", f"-remoteWrite.url={self.base}", f"-remoteRead.url={self.base}",
                 "-remoteWrite.maxQueueSize=1000000", "-remoteWrite.maxBatchSize=10000", "-remoteWrite.concurrency=4",
                 "-notifier.url=http://127.0.0.1:1", f"-evaluationInterval={STEP}s"], "-httpListenAddr=", "/health")
            self.processes.append(alert)
            self.vmalerts.append(url)

    FAILURES = ("vmalert_remotewrite_dropped_rows_total", "vmalert_remotewrite_errors_total",
                "vmalert_execution_errors_total")  # vmalert 1.79's names

    def failures(self) -> dict[str, float]:
        """What went wrong over the measured evaluations (dropped results, failed writes, failed rules)."""
        return {name.removeprefix("vmalert_"): value - self.before_measured.get(name, 0.0)
                for name, value in self.counters().items()}

    @staticmethod
    def own_metrics(vmalert_url: str) -> str | None:
        """One vmalert's /metrics; None where it does not answer within a minute (an overloaded host)."""
        try:
            with urllib.request.urlopen(f"{vmalert_url}/metrics", timeout=60) as response:
                return response.read().decode()  # type: ignore[no-any-return]
        except OSError:
            return None

    def iterations(self, vmalert_url: str) -> dict[str, tuple[float, float, float]] | None:
        """group -> (seconds of all its finished evaluations, how many, how many missed) so far, from one
        vmalert's own metrics; None where it does not answer."""
        text = self.own_metrics(vmalert_url)
        if text is None:
            return None
        out: dict[str, list[float]] = {}
        for line in text.splitlines():
            name = line.split("{")[0]
            if name.startswith("vmalert_iteration_duration_seconds_") or name == "vmalert_iteration_missed_total":
                group = line.split('group="')[1].split('"')[0]
                slot = {"vmalert_iteration_duration_seconds_sum": 0, "vmalert_iteration_duration_seconds_count": 1,
                        "vmalert_iteration_missed_total": 2}[name]
                out.setdefault(group, [0.0, 0.0, 0.0])[slot] += float(line.rsplit(" ", 1)[1])
        return {group: (total, count, missed) for group, (total, count, missed) in out.items()}

    def groups(self, samples: int) -> list[dict]:
        """Each group's mean evaluation time over the next ``samples`` evaluations, per vmalert (no per-rule
        times: vmalert reports none), with its ``shard`` (None: one vmalert for all).  A group that finished
        no evaluation in the window counts the window, and says so; a vmalert that does not answer, too."""
        window = samples * STEP + STEP / 2
        before = [self.iterations(url) for url in self.vmalerts]
        self.before_measured = self.counters()
        time.sleep(window)
        after = [self.iterations(url) for url in self.vmalerts]
        sizes, slow = {}, set()  # slow: groups of an interval of their own, longer than the window
        for path in glob.glob(os.path.join(self.rule_dirs[0], "*.yml")):
            with open(path) as handle:
                for group in yaml.safe_load(handle)["groups"]:
                    sizes[group["name"]] = len(group["rules"])
                    if "interval" in group:
                        slow.add(group["name"])
        out = []
        for index, (earlier, later) in enumerate(zip(before, after, strict=True)):
            shard = index if len(self.vmalerts) > 1 else None
            suffix = "" if shard is None else f" [shard {shard}]"
            if earlier is None or later is None:
                out += [{"name": f"{group}{suffix} (vmalert did not answer)", "rules": [], "size": size,
                         "evaluationTime": window, "group": f"{group} (vmalert did not answer)", "shard": shard}
                        for group, size in sizes.items()]
                continue
            for group, (total, count, missed) in later.items():
                seconds, evaluations, missed_before = earlier.get(group, (0.0, 0.0, 0.0))
                finished = count - evaluations
                if not finished and group in slow:
                    continue  # not due in the window
                note = ("" if finished else " (no evaluation finished)") + \
                    (f" ({missed - missed_before:.0f} missed)" if missed > missed_before else "")
                out.append({"name": f"{group}{suffix}{note}", "rules": [], "size": sizes.get(group, 0),
                            "evaluationTime": (total - seconds) / finished if finished else window,
                            "group": group + note, "shard": shard})
        return out

    def counters(self) -> dict[str, float]:
        """Every vmalert's FAILURES counters, added up (the vmalerts that answer)."""
        out = dict.fromkeys(self.FAILURES, 0.0)
        for url in self.vmalerts:
            for line in (self.own_metrics(url) or "").splitlines():
                name = line.split("{")[0].split(" ")[0]
                if name in out:
                    out[name] += float(line.rsplit(" ", 1)[1])
        return out


BACKENDS = {"prometheus": PrometheusBackend, "victoriametrics": VictoriaMetricsBackend}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=100)
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--engines", type=int, default=20)
    parser.add_argument("--disks", type=int, default=24)
    parser.add_argument("--history", type=int, default=20, help="minutes of history written as blocks")
    parser.add_argument("--live", type=int, default=3, help="minutes of live scrapes before measuring (0: none, "
                        "the history reaches --ahead minutes past now: for fleets the bench's exposition server "
                        "cannot serve in time; VictoriaMetrics only)")
    parser.add_argument("--ahead", type=int, default=10, help="with --live 0: minutes of history past now")
    parser.add_argument("--samples", type=int, default=4, help="rule evaluations to average")
    parser.add_argument("--storm", type=float, default=0.05, help="share of nodes in a storm")
    parser.add_argument("--keep", help="keep the data here")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                        help="processes writing the history (default: one per CPU)")
    parser.add_argument("--query-runs", type=int, default=3, help="runs of each panel query (the median is shown)")
    parser.add_argument("--calm-loads", type=float, default=0.01,
                        help="loads each engine finishes per second on a calm node (0: engines load only in a storm)")
    parser.add_argument("--all-buckets", action="store_true",
                        help="every engine histogram with its buckets (--collector.engines.histogram-buckets=all)")
    parser.add_argument("--vmalert-shards", type=int, default=0, metavar="N",
                        help="with --backend victoriametrics: N vmalert processes, each evaluating its shard of the "
                             "nodes (gpuio generate --vmalert-shards); 0: one vmalert for all")
    parser.add_argument("--unfolded", action="store_true",
                        help="with --backend victoriametrics: vmalert on Prometheus' rule files as they are, not "
                             "vmalert's copy with each group's chain folded (the peer of the folding's cost)")
    parser.add_argument("--backend", choices=sorted(BACKENDS), default="prometheus",
                        help="prometheus (Debian's prometheus, promtool), or victoriametrics: victoria-metrics, "
                             "vmagent and vmalert (Debian's victoria-metrics)")
    args = parser.parse_args()
    work = args.keep or tempfile.mkdtemp(prefix="gpuio-fleet-")
    os.makedirs(work, exist_ok=True)
    rules = sorted(glob.glob(os.path.join(REPO, "deploy", "prometheus", "rules", "*.yml")))
    if args.vmalert_shards and args.backend != "victoriametrics":
        parser.error("--vmalert-shards shards vmalert: give --backend victoriametrics")
    backend = (VictoriaMetricsBackend(work, rules, args.vmalert_shards, args.unfolded)
               if args.backend == "victoriametrics"
               else PrometheusBackend(work, rules))
    for tool in backend.tools:
        if not shutil.which(tool):
            print(f"{tool} not found (Debian package {'prometheus' if 'prom' in tool else 'victoria-metrics'})",
                  file=sys.stderr)
            return 2
    start = (time.time() - args.history * 60) // STEP * STEP
    nodes = fleet(args)
    counts = nodes[0].counts
    per_node = sum(counts.values())
    print(f"fleet on {backend.name}: {args.nodes} nodes x {args.gpus} GPUs x {args.engines} engines x "
          f"{args.disks} disks, {per_node} series per node, {per_node * args.nodes:,} in all; {stormy(args)} nodes "
          "in a cold-start storm")
    print("series per node: " + ", ".join(f"{k} {v}" + (f" ({v / getattr(args, k + 's'):.0f} per {k})"
                                                         if k != "node" else "") for k, v in counts.items()))
    try:
        # the history; it ends a little before now, where the live scrapes take over (or past now)
        began = time.perf_counter()
        samples = (args.history + args.ahead) * 60 // STEP if not args.live else args.history * 60 // STEP - 4
        size = backend.history(nodes, samples, start, args.jobs)
        print(f"history: {samples * STEP // 60} min at {STEP} s, {size / 1e9:.1f} GB of text -> {backend.name} in "
              f"{time.perf_counter() - began:.0f} s ({args.jobs} processes)")
        server = None
        if args.live:
            # then live: each node served at /metrics?node=N, scraped every STEP seconds as an exporter would be
            Exposition.nodes, Exposition.start = nodes, start
            server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Exposition)
            threading.Thread(target=server.serve_forever, daemon=True).start()
            backend.live(scrape_configs(nodes, f"127.0.0.1:{server.server_address[1]}"))
            time.sleep(args.live * 60)
        else:
            backend.evaluate()
            time.sleep(2 * STEP)  # the first evaluations, before the ones measured
        groups = backend.groups(args.samples)
        base = backend.base
        up = get(base, "/api/v1/query", query='count(up{job="gpuio"} == 1)')["data"]["result"]
        scraped = (f"{up[0]['value'][1] if up else 0} of {args.nodes} nodes scraped for {args.live} min"
                   if args.live else f"no scrapes, {args.ahead} min of history past now")
        print(f"live: {scraped}; memory (RSS) of {backend.name}: {rss_mib(backend.processes):,.0f} MiB: "
              f"{memory_by_component(backend.processes)}")
        print(f"host, over the measured evaluations: {host_load()}")
        alerts = get(base, "/api/v1/query", query="count by (alertname, alertstate) (ALERTS)")["data"]["result"]
        print("alerts: " + (", ".join(f"{a['metric']['alertname']} {a['metric']['alertstate']} x{a['value'][1]}"
                                      for a in alerts) or "none"))
        print_groups(groups, args.samples)
        if args.vmalert_shards:
            print_shards(groups)
        if isinstance(backend, VictoriaMetricsBackend):
            print("vmalert, over the measured evaluations: " + ", ".join(
                f"{name} {value:,.0f}" for name, value in backend.failures().items()))
        print_recorded(base, nodes[:10])
        rows = panel_queries(base, time.time(), args.history * 60, args.query_runs)
        if server is not None:
            server.shutdown()
        print_panels(rows, args.query_runs)
    finally:
        backend.stop()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    return 0


def print_groups(groups: list[dict], samples: int) -> None:
    print(f"\n{'group / rule':<92} {'evaluation':>16}")
    rule_rows: list[tuple[float, str, str]] = []
    errors: dict[str, str] = {}
    print(f"(mean of the last {samples} evaluations)")
    for group in sorted(groups, key=lambda g: -g["evaluationTime"]):
        print(f"{group['name'] + ' (group, ' + str(group.get('size', len(group['rules']))) + ' rules)':<92} "
              f"{group['evaluationTime'] * 1000:>13.1f} ms")
        for rule in group["rules"]:
            name = rule["name"] + (" (alert)" if rule["type"] == "alerting" else "")
            rule_rows.append((rule["evaluationTime"], name, rule.get("health")))
            if rule.get("health") != "ok" and rule.get("lastError"):
                errors.setdefault(rule["lastError"][:200], name)
    for seconds, name, health in sorted(rule_rows, reverse=True)[:40]:
        print(f"  {name[:88]:<90} {seconds * 1000:>13.1f} ms" + ("" if health == "ok" else f" ({health})"))
    # The engine-load rules and the Fleet board are what the fleet-scale notes follow: always all of them.
    for seconds, name, _health in sorted(rule_rows, reverse=True)[40:]:
        if ":gpuio_engine_load" in name or ":gpuio_engine_cold_loads" in name:
            print(f"  {name[:88]:<90} {seconds * 1000:>13.1f} ms")
    for error, name in errors.items():
        print(f"  error ({name}): {error}")
    total = sum(group["evaluationTime"] for group in groups)
    print(f"  ... {len(rule_rows)} rules timed, groups together {total * 1000:.0f} ms per evaluation")


def print_recorded(base: str, sample: list[Node]) -> None:
    """The series the rules record at each evaluation, per node (counted on ``sample``), and the largest rule's
    share: what a vmalert's remote-write queue must hold (-remoteWrite.maxQueueSize)."""
    instances = "|".join(node.instance for node in sample)
    result = get(base, "/api/v1/query",
                 query=f'sort_desc(count by (__name__) ({{__name__=~".+:.+:.+",instance=~"{instances}"}}))')
    counts = [(int(r["value"][1]), r["metric"]["__name__"]) for r in result["data"]["result"]]
    if counts:
        total = sum(count for count, _ in counts)
        print(f"recorded series per evaluation: {total / len(sample):,.0f} per node; the largest rule "
              f"{counts[0][0] / len(sample):,.0f} per node ({counts[0][1]})")


def print_shards(groups: list[dict]) -> None:
    """The longest group of each vmalert shard: what must stay within the evaluation interval."""
    longest: dict[int, dict] = {}
    for group in groups:
        shard = group.get("shard")
        if shard is not None and (shard not in longest or group["evaluationTime"] > longest[shard]["evaluationTime"]):
            longest[shard] = group
    worst = max(longest.values(), key=lambda g: g["evaluationTime"])
    print("  longest group of each shard: " + ", ".join(f"{shard} {g['evaluationTime']:.1f} s"
                                                      for shard, g in sorted(longest.items()))
          + f"; the longest of all {worst['evaluationTime']:.1f} s ({worst['group']}), interval {STEP} s")


def print_panels(rows: list[tuple[float, int, str, str]], runs: int) -> None:
    print(f"\n{'board / panel [query]':<92} {'median of ' + str(runs):>12} {'series':>7}")
    for seconds, count, uid, title in rows[:25]:
        print(f"{uid + ' / ' + title:<92.92} {seconds * 1000:>9.1f} ms {count:>7}")
    for seconds, count, uid, title in rows[25:]:
        if uid == "gpuio-fleet":
            print(f"{uid + ' / ' + title:<92.92} {seconds * 1000:>9.1f} ms {count:>7}")
    fleet_board = [r[0] for r in rows if r[2] == "gpuio-fleet"]
    print(f"... {len(rows)} panel queries in all; median {statistics.median(r[0] for r in rows) * 1000:.1f} ms, "
          f"total {sum(r[0] for r in rows):.2f} s; the Fleet board's median "
          f"{statistics.median(fleet_board) * 1000 if fleet_board else float('nan'):.1f} ms")


if __name__ == "__main__":
    raise SystemExit(main())
