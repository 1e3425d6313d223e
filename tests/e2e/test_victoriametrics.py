"""VictoriaMetrics as the scale-out path, end to end: cold-start storms on simulated nodes, scraped by two
vmagent shards into victoria-metrics and evaluated by two vmalert shards of the nodes, page on-call through
Alertmanager as they do through Prometheus, naming the disk, the engines and their GPUs; each vmalert
pages its own nodes and only them, each storm once; calm nodes beside them page nobody.

What runs, all on loopback:

* sixteen simulated nodes, each an HTTP server on a loopback address of its own (127.0.0.2-17: the scrape
  config names nodes by host, as in production).  One node of each vmalert shard replays, second by
  second, a real storm recorded by tests/e2e/test_storm_page.py (deploy/prometheus/tests/recorded/
  cold-start-storm.json: fio and six processes cold-loading engines through the library, on a direct-IO
  loop device): 42 s calm, then the storm, held at its recorded rates until it has paged, then calm
  again.  The calm nodes serve that recording's calm phase (counters at its mean rates);
* Debian's victoria-metrics, two vmagent and two vmalert with the flags of the services of
  deploy/victoriametrics/docker-compose.yml, changed only where the test must: loopback addresses and
  temporary directories, 1 s scrapes and evaluations, and the rules of the 1 s timeline the recording was
  made with (test_storm_page.VARIANT: every expression the production one, windows and ``for`` shrunk) as
  ``gpuio generate --vmalert-shards 2`` writes them: vmalert's folded copy once per shard, and the scrape
  configuration that labels each node's shard; victoria-metrics with ``-search.latencyOffset=0s`` (by
  default it hides the last 30 s from queries, which at 1 s evaluations would hide the storm for 30
  evaluations);
* Debian's prometheus scraping the same nodes with the same rules (deploy/prometheus/prometheus.yml,
  1 s intervals), for the comparison;
* one Alertmanager per path, deploy/alertmanager/alertmanager.yml with the test's timers, posting to one
  webhook receiver that notes which path paged when.

The latency of each path (storm start -> paging webhook) is printed: vmalert's copy folds each group's
chain of recording rules (deploy/victoriametrics/vmalert.py), so its page comes after as many evaluations
as Prometheus' does, plus each group boundary's write to victoria-metrics and read back.
"""

from __future__ import annotations

import json
import shutil
import socket
import threading
import time
import urllib.parse
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

from deploy.victoriametrics.vmalert import SHARD_LABEL
from tests.conftest import REPO, free_port
from tests.e2e.test_storm_page import generate_variant_rules, get_json
from tests.peers import (
    ALERTMANAGER,
    PROMETHEUS,
    Webhook,
    serve,
    start_alertmanager,
    start_prometheus,
    start_webhook,
    stop,
)

pytestmark = pytest.mark.e2e

VICTORIA_METRICS = shutil.which("victoria-metrics")
VMAGENT = shutil.which("vmagent")
VMALERT = shutil.which("vmalert")
COMPOSE = Path(REPO) / "deploy" / "victoriametrics" / "docker-compose.yml"
SCRAPE = Path(REPO) / "deploy" / "victoriametrics" / "scrape.yml"
RECORDING = Path(REPO) / "deploy" / "prometheus" / "tests" / "recorded" / "cold-start-storm.json"
# Sixteen nodes: vmagent shards the scraping by a hash that takes the target's port, which changes run to
# run; with four nodes one vmagent got none in 1 of 8 runs, with sixteen in about 1 of 30,000.  The vmalert
# shards hash the node's name alone (instance), so which node is whose is the same every run.
NODES = tuple(f"127.0.0.{n}" for n in range(2, 18))
SHARDS = 2
PAGE_BOUND_S = {"prometheus": 45, "vmalert": 45}  # storm start -> paging webhook
GROUP_INTERVAL = "20s"


# --- the simulated nodes ---------------------------------------------------------------------------------

class Recording:
    """The recorded storm: per series, its samples by second; the calm phase is [first, storm start)."""

    def __init__(self, path: Path) -> None:
        recording = json.loads(path.read_text())
        self.storm_start = recording["storm_start_seconds"]
        self.end = recording["seconds"]
        self.series = [(s["labels"]["__name__"], {k: v for k, v in s["labels"].items() if k != "__name__"},
                        {int(t): float(v) for t, v in s["values"]}) for s in recording["series"]]
        self.start = min(min(values) for _, _, values in self.series)
        self.calm_s = self.storm_start - self.start  # seconds of calm before the storm

    @staticmethod
    def counter(name: str) -> bool:
        return name.endswith(("_total", "_count", "_sum"))

    def calm_rate(self, values: dict[int, float]) -> float:
        first, last = self.start, self.storm_start - 1
        return (values[last] - values[first]) / (last - first)

    def calm(self, values: dict[int, float], name: str, elapsed: float, base: float | None = None,
             since: float = 0.0) -> float | None:
        """The calm phase, endless: a counter grows at its calm mean rate (from ``base`` at ``since``), a
        gauge cycles through its calm samples."""
        if self.counter(name):
            if self.start not in values or self.storm_start - 1 not in values:
                return None
            origin = values[self.start] if base is None else base
            return origin + self.calm_rate(values) * (elapsed - since)
        return values.get(self.start + int(elapsed) % self.calm_s)

    def held(self, values: dict[int, float], name: str, position: float) -> float | None:
        """Past the recording's end: the storm held at its last 20 s's rates (gauges at their last value)."""
        if self.end not in values:
            return None
        if not self.counter(name):
            return values[self.end]
        window = 20
        rate = (values[self.end] - values.get(self.end - window, values[self.end])) / window
        return values[self.end] + rate * (position - self.end)


class Node:
    """One simulated node's /metrics: calm, or the recorded storm, and calm again once ``calm_again``."""

    def __init__(self, recording: Recording, storm: bool) -> None:
        self.recording, self.storm = recording, storm
        self.started = time.monotonic()
        self.started_unix = time.time()
        self.storm_ended: float | None = None  # elapsed seconds at calm_again()
        self.last: dict[int, float] = {}  # the values served last, per series: where calm resumes from

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def storm_started_at(self) -> float:
        """Monotonic time at which the storm begins."""
        return self.started + self.recording.calm_s

    def calm_again(self) -> None:
        self.storm_ended = self.elapsed()

    def value(self, index: int, name: str, values: dict[int, float], elapsed: float) -> float | None:
        r = self.recording
        if not self.storm:
            return r.calm(values, name, elapsed)
        if self.storm_ended is not None and elapsed >= self.storm_ended:
            return r.calm(values, name, elapsed, base=self.last.get(index), since=self.storm_ended)
        position = r.start + elapsed
        if position <= r.end:
            return values.get(int(position))
        return r.held(values, name, position)

    def text(self) -> str:
        elapsed = self.elapsed()
        lines = [f"process_start_time_seconds {self.started_unix:.3f}"]
        for index, (name, labels, values) in enumerate(self.recording.series):
            value = self.value(index, name, values, elapsed)
            if value is None:
                continue
            if self.storm_ended is None or elapsed < self.storm_ended:
                self.last[index] = value
            rendered = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
            lines.append(f"{name}{{{rendered}}} {value!r}")
        return "\n".join(lines) + "\n"


def serve_node(node: Node, address: str, port: int) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            body = node.text().encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer((address, port), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


# --- the VictoriaMetrics services, as deploy/victoriametrics/docker-compose.yml runs them ----------------

def compose_command(service: str, replacements: dict[str, str], extra: tuple[str, ...] = ()) -> list[str]:
    """The service's flags from the compose file, each container address and path replaced by its local
    twin (a flag's prefix -> its new value), plus ``extra``; every replacement must find its flag."""
    with open(COMPOSE) as handle:
        command = list(yaml.safe_load(handle)["services"][service]["command"])
    unused = set(replacements)
    for index, flag in enumerate(command):
        for prefix, value in replacements.items():
            if flag.startswith(prefix):
                command[index] = prefix + value
                unused.discard(prefix)
    assert not unused, f"{service}: the compose file has no {sorted(unused)}"
    return [*command, *extra]


def scrape_config(directory: Path, targets: list[str], source: Path = SCRAPE) -> Path:
    """``source`` (deploy/victoriametrics/scrape.yml, or its sharded copy) with the simulated nodes as
    targets, scraped every second."""
    config = yaml.safe_load(source.read_text())
    config["global"]["scrape_interval"] = "1s"
    (job,) = config["scrape_configs"]
    job["static_configs"] = [{"targets": targets}]
    path = directory / "scrape.yml"
    path.write_text(yaml.safe_dump(config))
    return path


class Paths:
    """Both paths up: the VictoriaMetrics services and Prometheus, each with its Alertmanager."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.processes: list = []
        self.urls: dict[str, str] = {}

    def start(self, name: str, command: list[str], port: int, ready: str = "/health") -> str:
        process, url = serve(name, command, port, ready)
        self.processes.append(process)
        self.urls[name] = url
        return url

    def victoriametrics(self, scrape: Path, shard_rules: list[Path], alertmanager: str) -> None:
        """victoria-metrics, the vmagents scraping with ``scrape`` and one vmalert per folder of ``shard_rules``."""
        port = free_port()
        storage = self.start("victoria-metrics", [VICTORIA_METRICS, *compose_command("victoria-metrics", {
            "-storageDataPath=": str(self.tmp / "vm-data"), "-httpListenAddr=": f"127.0.0.1:{port}"},
            ("-search.latencyOffset=0s", "-search.disableCache"))], port)
        for member in (0, 1):
            port = free_port()
            self.start(f"vmagent-{member}", [VMAGENT, *compose_command(f"vmagent-{member}", {
                "-promscrape.config=": str(scrape), "-remoteWrite.url=": f"{storage}/api/v1/write",
                "-remoteWrite.tmpDataPath=": str(self.tmp / f"vmagent-{member}"),
                "-httpListenAddr=": f"127.0.0.1:{port}"}, ("-remoteWrite.flushInterval=1s",))], port)
        for shard, rules in enumerate(shard_rules):
            port = free_port()
            self.start(f"vmalert-{shard}", [VMALERT, *compose_command("vmalert", {
                "-rule=": str(rules / "*.yml"), "-datasource.url=": storage, "-remoteWrite.url=": storage,
                "-remoteRead.url=": storage, "-notifier.url=": alertmanager, "-evaluationInterval=": "1s",
                "-httpListenAddr=": f"127.0.0.1:{port}"}, ("-remoteWrite.flushInterval=1s",))], port)

    def prometheus(self, targets: list[str], rules: list[str], alertmanager: str) -> None:
        process, self.urls["prometheus"] = start_prometheus(self.tmp, rules, targets, alertmanager)
        self.processes.append(process)

    def stop(self) -> None:
        for process in reversed(self.processes):
            stop(process)


def shard_of_each_node(tmp: Path, scrape: Path) -> dict[str, str]:
    """instance -> its vmalert shard, as vmagent's relabeling labels it (a vmagent that reads the sharded
    scrape configuration, asked for its targets before anything is served, then stopped)."""
    port = free_port()
    process, url = serve("vmagent-probe", [VMAGENT, f"-promscrape.config={scrape}", "-remoteWrite.url=http://127.0.0.1:1",
                                           f"-remoteWrite.tmpDataPath={tmp / 'vmagent-probe'}",
                                           f"-httpListenAddr=127.0.0.1:{port}"], port, "/health")
    try:
        deadline = time.monotonic() + 30
        while True:
            targets = get_json(url + "/api/v1/targets")["data"]["activeTargets"]
            if len(targets) == len(NODES) or time.monotonic() > deadline:
                return {t["labels"]["instance"]: t["labels"][SHARD_LABEL] for t in targets}
            time.sleep(0.2)
    finally:
        stop(process)


def loopback_addresses_work() -> bool:
    with socket.socket() as probe:
        try:
            probe.bind((NODES[0], 0))
        except OSError:
            return False
    return True


class Fleet:
    """What the test looks at: both paths, the nodes, each node's vmalert shard and the storm nodes."""

    def __init__(self, paths: Paths, nodes: dict[str, Node], shards: dict[str, str]) -> None:
        self.paths, self.nodes, self.shards = paths, nodes, shards
        self.storm_nodes = [address for address, node in nodes.items() if node.storm]
        self.calm_nodes = [address for address, node in nodes.items() if not node.storm]


@pytest.fixture(scope="module")
def storm(tmp_path_factory) -> Iterator[Fleet]:
    missing = [name for name, path in (("victoria-metrics", VICTORIA_METRICS), ("vmagent", VMAGENT),
                                       ("vmalert", VMALERT), ("prometheus", PROMETHEUS),
                                       ("prometheus-alertmanager", ALERTMANAGER)) if not path]
    if missing:
        pytest.skip(f"not installed: {', '.join(missing)} (Debian packages victoria-metrics, prometheus, "
                    "prometheus-alertmanager)")
    if not loopback_addresses_work():
        pytest.skip("no loopback addresses beyond 127.0.0.1 here")
    tmp = tmp_path_factory.mktemp("victoriametrics")
    receiver = start_webhook()
    hook = receiver.server_port
    rules = generate_variant_rules(tmp / "rules", vmalert_shards=SHARDS)
    port = free_port()
    targets = [f"{address}:{port}" for address in NODES]
    scrape = scrape_config(tmp, targets, tmp / "rules" / "vmalert" / "scrape.yml")
    shards = shard_of_each_node(tmp, scrape)
    assert sorted(shards) == sorted(NODES) and set(shards.values()) == {str(k) for k in range(SHARDS)}, shards
    storming = {min(a for a in NODES if shards[a] == str(k)) for k in range(SHARDS)}  # one node of each shard
    recording = Recording(RECORDING)
    nodes = {address: Node(recording, storm=address in storming) for address in NODES}
    servers = [serve_node(node, address, port) for address, node in nodes.items()]
    paths = Paths(tmp)
    managers = []
    try:
        for name in ("prometheus", "vmalert"):
            (tmp / name).mkdir()
            # each path's Alertmanager posts to /<path>/<receiver>
            manager, url = start_alertmanager(tmp / name, hook, GROUP_INTERVAL, path_prefix=f"/{name}")
            managers.append(manager)
            paths.urls[f"alertmanager-{name}"] = url
        shard_rules = [tmp / "rules" / "vmalert" / f"shard-{k}" for k in range(SHARDS)]
        paths.victoriametrics(scrape, shard_rules, paths.urls["alertmanager-vmalert"])
        paths.prometheus(targets, rules, paths.urls["alertmanager-prometheus"])
        yield Fleet(paths, nodes, shards)
    finally:
        paths.stop()
        for manager in managers:
            stop(manager)
        for server in (*servers, receiver):
            server.shutdown()


def pages(path: str) -> list[tuple[float, dict]]:
    """Paging notifications of one path, with their DiskIOStorm alerts, in arrival order."""
    out = []
    for arrived, body in Webhook.received:
        if body["path"] == f"/{path}/page":
            out += [(arrived, alert) for alert in body["alerts"] if alert["labels"]["alertname"] == "DiskIOStorm"]
    return out


def test_storms_page_through_vmalert_shards_as_through_prometheus_and_calm_nodes_page_nobody(storm) -> None:
    fleet = storm
    started = min(fleet.nodes[a].storm_started_at() for a in fleet.storm_nodes)
    deadline = started + max(PAGE_BOUND_S.values())
    first: dict[str, dict[str, float]] = {path: {} for path in PAGE_BOUND_S}  # path -> storm node -> latency
    while time.monotonic() < deadline and any(len(first[p]) < len(fleet.storm_nodes) for p in PAGE_BOUND_S):
        for path in PAGE_BOUND_S:
            for arrived, alert in pages(path):
                if alert["status"] == "firing":
                    first[path].setdefault(alert["labels"]["instance"], arrived - started)
        time.sleep(0.5)
    for node in fleet.nodes.values():
        node.calm_again()
    slowest = {path: max(first[path].values(), default=float("nan")) for path in PAGE_BOUND_S}
    print("\nstorm start -> paging webhook, the later of the two storms: " + ", ".join(
        f"{path} {slowest[path]:.1f} s" for path in PAGE_BOUND_S) + f" (vmalert/prometheus "
        f"{slowest['vmalert'] / slowest['prometheus']:.2f})")
    for path, bound in PAGE_BOUND_S.items():
        assert sorted(first[path]) == sorted(fleet.storm_nodes), (path, first, Webhook.received[-3:])
        assert slowest[path] <= bound, (path, first)
        for address in fleet.storm_nodes:
            firing = [alert for _, alert in pages(path) if alert["status"] == "firing"
                      and alert["labels"]["instance"] == address]
            # one page per storm: one alert (the same labels in every notification), from its own shard
            assert len({tuple(sorted(a["labels"].items())) for a in firing}) == 1, (path, address, firing)
            labels, annotations = firing[0]["labels"], firing[0]["annotations"]
            text = annotations["summary"] + annotations["description"]
            assert labels["device"] == "loop0" and labels["severity"] == "critical", labels
            assert labels.get(SHARD_LABEL) == (fleet.shards[address] if path == "vmalert" else None), labels
            assert "engine(s) waiting to load" in text and "ranker-0" in text and "GPU-e2e0000" in text, text
    # The calm nodes: no notification of any receiver, on either path.
    noisy = [(body["path"], a["labels"]) for _, body in Webhook.received for a in body["alerts"]
             if a["labels"].get("instance") in fleet.calm_nodes]
    assert noisy == []


def test_each_vmalert_shard_judges_its_own_nodes_and_only_them(storm) -> None:
    """Every alert a shard's vmalert holds, and every series it recorded, is of its own nodes and carries its
    shard; every node's recorded series come from its shard alone."""
    fleet = storm
    storage = fleet.paths.urls["victoria-metrics"]
    for shard in range(SHARDS):
        own = {a for a, k in fleet.shards.items() if k == str(shard)}
        alerts = get_json(fleet.paths.urls[f"vmalert-{shard}"] + "/api/v1/alerts")["data"]["alerts"]
        assert {a["labels"]["instance"] for a in alerts if a["labels"]["alertname"] == "DiskIOStorm"} \
            == own & set(fleet.storm_nodes), alerts
        assert all(a["labels"]["instance"] in own and a["labels"][SHARD_LABEL] == str(shard) for a in alerts), alerts
    recorded = get_json(storage + "/api/v1/query?query=" + urllib.parse.quote(
        'group by (instance, shard) ({__name__=~"instance[a-z_]*:.+:.+"})'))["data"]["result"]
    pairs = {(r["metric"].get("instance"), r["metric"].get(SHARD_LABEL)) for r in recorded}
    assert pairs == set(fleet.shards.items()), pairs


def test_both_vmagents_scrape_a_share_of_the_nodes(storm) -> None:
    """Each vmagent holds a share of the nodes, together all of them once."""
    shares = []
    for member in (0, 1):
        targets = get_json(storm.paths.urls[f"vmagent-{member}"] + "/api/v1/targets")["data"]["activeTargets"]
        shares.append({t["labels"]["instance"] for t in targets})
    assert all(shares) and not shares[0] & shares[1] and shares[0] | shares[1] == set(NODES), shares
