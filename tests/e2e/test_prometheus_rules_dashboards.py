"""Every rule and every dashboard query, run by a real Prometheus against a real gpuio-exporter.

Setup: the exporter (this machine's /proc and /sys, default collectors plus smart) and Debian's
``prometheus`` started with deploy/prometheus/prometheus.yml, changed only where a test must: 1 s
scrape and evaluation intervals, the exporter's port as the target, rule files by absolute path, no
Alertmanager.  A thread writes (with fsync) and reads (O_DIRECT) a small file on the disk under the
repository, so the disks have completions to compute awaits from.  An inference process (the gpuio
library, a generic loader standing in for TensorRT) loads an engine file from that disk every
second and runs inferences through a pool, with per-layer times, into the exporter's spool; smart
polls the replaying smartctl (tests/fixtures/smartctl: two NVMe disks and a SATA disk behind a
MegaRAID controller).  No GPU here: the GPU panels are run, not expected to return data.

Checked, through Prometheus' HTTP API once a few scrapes are in:

* every rule of deploy/prometheus/rules/*.yml is healthy after its first evaluations, and its
  expression runs through /api/v1/query without error;
* every panel query, annotation and variable query of every dashboards/*.json runs without error
  (Grafana's variables replaced by what Grafana would send: ``$__rate_interval`` is 4 scrape
  intervals, ``$instance`` the exporter's node, ``$device`` etc. the "All" value);
* every panel whose gpuio families the exporter serves here returns data: the PromQL is not only
  valid but names series that exist and joins them right (MAY_BE_EMPTY lists the panels that are
  rightly empty on a healthy node).

All of it twice: as shipped, and in node_exporter mode (a real node_exporter reads the disks, the
exporter runs with --no-collector.diskstats, Prometheus loads deploy/prometheus/rules-node-exporter):
the same rules are healthy, and the same panels have data.
"""

from __future__ import annotations

import functools
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import yaml

from deploy.prometheus.config import GPUIO, NODE_EXPORTER
from deploy.prometheus.generate import NODE_EXPORTER_RULES_DIR, RULES_DIR
from tests.conftest import REPO, ExporterProcess, parse_samples
from tests.e2e.test_rules_node_exporter import DISKSTATS
from tests.fixtures.smartctl.fake import LISTINGS, FakeSmartctl
from tests.peers import NODE_EXPORTER_BINARY, PROMETHEUS, start_node_exporter, start_prometheus
from tests.peers import stop as stop_process

pytestmark = pytest.mark.e2e

RULE_FILES = {GPUIO: sorted(glob.glob(os.path.join(RULES_DIR, "*.yml"))),
              NODE_EXPORTER: sorted(glob.glob(os.path.join(NODE_EXPORTER_RULES_DIR, "*.yml")))}
DASHBOARDS = sorted(glob.glob(os.path.join(REPO, "dashboards", "*.json")))
SCRAPES = 6  # samples per series before querying: a 4 s $__rate_interval then always holds 4 or more
RATE_INTERVAL = "4s"
# Rightly empty on a healthy node: no disk saturated, no NVMe critical warning bit set, no alert firing.
# Panels that show only what is wrong or active now: empty on a healthy node (no reason holds a busy GPU's
# clocks at one instant of a 50 % duty cycle on the H100, for one).
MAY_BE_EMPTY = {"Saturated disks", "NVMe critical warnings", "Firing alerts", "Work waiting",
                "Clock event reasons active now", "Nodes ranked by storm", "Cold starts by node and engine"}
GPUIO_NAME = re.compile(r"(?<![:\w])gpuio_[a-z_]+")
RECORDED_NAME = re.compile(r"\b[a-z_]+:gpuio_[a-z0-9_]+:[a-z0-9_]+")
SMART_HOST = os.path.join(LISTINGS, "linux_multiple_devices")  # nvme0, nvme1, bus/0 (sat+megaraid,60)
INFERENCE = """
import hashlib, sys, time
sys.path.insert(0, sys.argv[1])
import gpuio
gpuio.configure(sys.argv[2])
deserialize = lambda data: hashlib.sha256(data).hexdigest()
metrics = gpuio.load(sys.argv[3], deserialize).metrics
pool = gpuio.EnginePool(metrics, create=object, size=2, warmup=lambda context: time.sleep(0.005))
layers = {"conv1": 0.002, "conv2": 0.001, "fc": 0.0005}
while True:
    deadline = time.monotonic() + 1
    while time.monotonic() < deadline:
        pool.run(lambda context: time.sleep(0.002), batch_size=4)
        metrics.add_layer_times(layers)
    gpuio.load(sys.argv[3], deserialize)  # a reload every second: loads in every window
"""


class Prometheus:
    def __init__(self, base: str) -> None:
        self.base = base

    def get(self, path: str, **params: str) -> dict:
        url = f"{self.base}{path}?{urllib.parse.urlencode(params)}" if params else self.base + path
        try:
            with urllib.request.urlopen(url, timeout=10) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as error:  # 400/422 carry the PromQL error as JSON
            return json.loads(error.read())

    def query(self, expr: str) -> dict:
        return self.get("/api/v1/query", query=expr)


def disk_load(directory: str, stop: threading.Event) -> None:
    """Small synchronous writes and direct reads until ``stop``: completions for r_await and w_await."""
    path = os.path.join(directory, "load")
    block = os.urandom(1 << 20)
    with open(path, "wb") as handle:
        handle.write(block)
        handle.flush()
        os.fsync(handle.fileno())
    while not stop.is_set():
        with open(path, "r+b") as handle:
            handle.write(block[: 64 << 10])
            handle.flush()
            os.fsync(handle.fileno())
        # O_DIRECT skips the page cache, so the read reaches the disk; dd aligns its buffer for us.
        subprocess.run(["dd", f"if={path}", "of=/dev/null", "bs=64k", "count=16", "iflag=direct"],
                       capture_output=True, check=False)
        stop.wait(0.05)


@dataclass
class Setup:
    api: Prometheus
    instance: str  # the node as Prometheus names it
    served: set[str]  # the gpuio families served (in node_exporter mode: the disk ones by node_exporter)
    rule_files: list[str]


@pytest.fixture(scope="module", params=[GPUIO, NODE_EXPORTER])
def prometheus(request, tmp_path_factory) -> Iterator[Setup]:
    """One exporter and one Prometheus for the whole module (each takes a few seconds to fill), per mode."""
    if not PROMETHEUS:
        pytest.skip("prometheus is not installed (Debian package prometheus; make system-deps)")
    mode = request.param
    if mode == NODE_EXPORTER and not NODE_EXPORTER_BINARY:
        pytest.skip("node_exporter is not installed (Debian package prometheus-node-exporter)")
    tmp_path = tmp_path_factory.mktemp("prometheus")
    load_dir = tempfile.mkdtemp(prefix=".e2e-disk-load-", dir=REPO)  # a real disk, unlike a tmpfs /tmp
    spool = os.path.join(load_dir, "spool")
    os.mkdir(spool)
    engine = os.path.join(load_dir, "resnet50.engine")
    with open(engine, "wb") as handle:
        handle.write(os.urandom(4 << 20))
    fake = FakeSmartctl(str(tmp_path / "smartctl"), [SMART_HOST])
    stop = threading.Event()
    loader = threading.Thread(target=disk_load, args=(load_dir, stop), daemon=True)
    loader.start()
    inference = subprocess.Popen([sys.executable, "-c", INFERENCE, REPO, spool, engine])
    flags = [f"--collector.engines.spool-dir={spool}", f"--collector.engines.path={load_dir}/*.engine",
             "--collector.smart", f"--smartctl.path={fake.path}"]
    target = ExporterProcess([*flags, "--no-collector.diskstats"] if mode == NODE_EXPORTER else flags)
    process = node_exporter = None
    try:
        target.start()
        if mode == NODE_EXPORTER:
            node_exporter, node_exporter_address = start_node_exporter()
        process, base = start_prometheus(tmp_path, RULE_FILES[mode], target.port,
                                         node_exporter=node_exporter_address if node_exporter else None)
        api = Prometheus(base)
        wait_for_scrapes(api, process)
        # the node as Prometheus names it (the example config relabels instance to the host)
        (sample,) = api.query('up{job="gpuio"}')["data"]["result"]
        served = served_names(target)
        if node_exporter:
            assert not served & DISKSTATS, "gpuio serves disk series with its diskstats collector off"
            served |= {name.replace("node_disk_", "gpuio_disk_", 1) for name, _ in parse_samples(
                urllib.request.urlopen(f"http://{node_exporter_address}/metrics", timeout=10).read().decode())
                if name.replace("node_disk_", "gpuio_disk_", 1) in DISKSTATS}
        yield Setup(api, sample["metric"]["instance"], served, RULE_FILES[mode])
    finally:
        stop.set()
        inference.kill()
        inference.wait()
        loader.join(timeout=10)
        for server in (process, node_exporter):
            if server:
                stop_process(server)
        target.stop()
        shutil.rmtree(load_dir, ignore_errors=True)


def served_names(target: ExporterProcess) -> set[str]:
    """Sample names the exporter serves once smart has polled and the inference process has reported."""
    deadline = time.monotonic() + 20
    while True:
        names = {name for name, _ in parse_samples(target.scrape())}
        if {"gpuio_smart_health_passed", "gpuio_engine_layer_seconds_total"} <= names or time.monotonic() > deadline:
            return names
        time.sleep(0.2)


def wait_for_scrapes(api: Prometheus, process: subprocess.Popen) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"prometheus exited: {process.stdout.read() if process.stdout else ''}")
        try:
            result = api.query(f'count_over_time(up{{job="gpuio"}}[1m]) >= {SCRAPES} and up{{job="gpuio"}} == 1')
            if result.get("status") == "success" and result["data"]["result"]:
                return
        except OSError:
            pass
        time.sleep(0.25)
    raise RuntimeError(f"no {SCRAPES} successful scrapes of the exporter in 30 s")


def grafana_substitute(expr: str, instance: str) -> str:
    """What Grafana sends for ``expr`` with every variable on "All" and one node chosen."""
    for name, value in (("$__rate_interval", RATE_INTERVAL), ("$__range", "1m"), ("$instance", instance),
                        ("$device", ".+"), ("$cluster", ".*"), ("$namespace", ".*"), ("$pod", ".*"), ("$gpu", ".*"),
                        ("$engine", ".*")):
        expr = expr.replace(name, value)
    assert "$" not in expr.replace("$1", ""), f"a variable the test does not know: {expr}"
    return expr


@functools.cache
def recorded_inputs() -> dict[str, set[str]]:
    """Each recording rule -> the raw gpuio names it is computed from (through other recorded ones), as
    the shipped rules compute it (node_exporter mode reads the twins of the same families)."""
    exprs: dict[str, list[str]] = {}
    for rule in rules(RULE_FILES[GPUIO]):
        if "record" in rule:
            exprs.setdefault(rule["record"], []).append(rule["expr"])

    def inputs(name: str, seen: frozenset[str]) -> set[str]:
        out: set[str] = set()
        for expr in exprs.get(name, []):
            out |= set(GPUIO_NAME.findall(expr))
            for other in set(RECORDED_NAME.findall(expr)) - seen - {name}:
                out |= inputs(other, seen | {name})
        return out

    return {name: inputs(name, frozenset()) for name in exprs}


def expects_data(exprs: list[str], served: set[str]) -> bool:
    """A panel must return data when it queries gpuio's series, raw or recorded, and every raw series
    they come from is served here (no GPU in CI, no PSI on some kernels, no SCSI disk replayed)."""
    text = " ".join(exprs)
    needed = set(GPUIO_NAME.findall(text))
    recorded = set(RECORDED_NAME.findall(text))
    inputs = recorded_inputs()
    for name in recorded:
        needed |= inputs[name]
    return bool(needed) and needed <= served


def panels(dashboard: dict) -> Iterator[dict]:
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])


def rules(rule_files: list[str]) -> Iterator[dict]:
    for path in rule_files:
        with open(path) as handle:
            for group in yaml.safe_load(handle)["groups"]:
                yield from group["rules"]


def slow_groups(rule_files: list[str]) -> set[str]:
    """The groups with an interval of their own (gpuio.gpu.tickets: 5 minutes): Prometheus first evaluates
    them up to that long after it starts; their expressions are run below all the same."""
    found = set()
    for path in rule_files:
        with open(path) as handle:
            found |= {group["name"] for group in yaml.safe_load(handle)["groups"] if "interval" in group}
    return found


def test_rules_are_healthy_and_run(prometheus: Setup) -> None:
    api = prometheus.api
    expected = {rule.get("record") or rule.get("alert") for rule in rules(prometheus.rule_files)}
    slow = slow_groups(prometheus.rule_files)
    deadline = time.monotonic() + 10
    while True:  # every rule evaluated at least once (but the slow groups')
        groups = list(api.get("/api/v1/rules")["data"]["groups"])
        loaded = [rule for group in groups for rule in group["rules"]]
        if all(rule["lastEvaluation"] > "2000" for group in groups if group["name"] not in slow
               for rule in group["rules"]) or time.monotonic() > deadline:
            break
        time.sleep(0.25)
    assert {rule["name"] for rule in loaded} == expected
    assert slow == {"gpuio.gpu.tickets"}  # the one group with an interval of its own
    unhealthy = {rule["name"]: rule.get("lastError") for group in groups for rule in group["rules"]
                 if rule["health"] != "ok" and not (group["name"] in slow and rule["health"] == "unknown")}
    assert unhealthy == {}
    for rule in rules(prometheus.rule_files):
        result = api.query(rule["expr"])
        assert result["status"] == "success", (rule.get("record") or rule.get("alert"), result)
    # The per-device iostat rules and the class limits exist for every device of this machine.
    for name in ("instance_device:gpuio_disk_reads_completed:rate1m", "instance_device:gpuio_disk_queue_limit:class",
                 "instance_device:gpuio_disk_calm_io_time_weighted_seconds:median1h_held6h"):
        assert api.query(name)["data"]["result"], name
        # gpuio's job whichever exporter read the disks: every board and alert selects it
        assert {series["metric"]["job"] for series in api.query(name)["data"]["result"]} == {"gpuio"}, name


@pytest.mark.parametrize("path", DASHBOARDS, ids=os.path.basename)
def test_dashboard_queries_run_and_panels_have_data(prometheus: Setup, path: str) -> None:
    api, instance, served = prometheus.api, prometheus.instance, prometheus.served
    with open(path) as handle:
        dashboard = json.load(handle)
    empty, expected, titles = [], [], []
    for panel in panels(dashboard):
        exprs = [target["expr"] for target in panel.get("targets", [])]
        if exprs:
            titles.append(panel["title"])
        found = 0
        for expr in exprs:
            result = api.query(grafana_substitute(expr, instance))
            assert result["status"] == "success", (panel["title"], expr, result)
            found += len(result["data"]["result"])
        if expects_data(exprs, served) and panel["title"] not in MAY_BE_EMPTY:
            expected.append(panel["title"])
            if not found:
                empty.append(panel["title"])
                for expr in exprs:  # what Prometheus holds of the families it reads, to tell why
                    for family in sorted(set(re.findall(r"gpuio_[a-z_]+", expr))):
                        held = api.query(f"count_over_time({family}[5m])")["data"]["result"]
                        print(f"  empty panel {panel['title']!r}: {family}: {len(held)} series, samples "
                              f"{[series['value'][1] for series in held][:5]}")
    print(f"\n{os.path.basename(path)}: {len(titles)} panels queried, {len(expected)} expected to have data: "
          f"{len(expected) - len(empty)} have; not expected: {sorted(set(titles) - set(expected))}")
    assert empty == [], "panels without data although the exporter serves what they query"
    for annotation in dashboard["annotations"]["list"]:
        result = api.query(grafana_substitute(annotation["expr"], instance))
        assert result["status"] == "success", (annotation["name"], result)
    for variable in dashboard["templating"]["list"]:
        if variable["type"] != "query":
            continue
        if variable["query"].startswith("query_result("):
            # query_result(<expr>) with a regex: Grafana runs the instant query, the regex picks each value
            expr = variable["query"].removeprefix("query_result(").removesuffix(")")
            result = api.query(grafana_substitute(expr, instance))
            assert result["status"] == "success", (variable["name"], result)
            pattern = re.compile(variable["regex"].strip("/"))
            values = {match.group(1) for series in result["data"]["result"]
                      for match in [pattern.search(json.dumps(series["metric"], separators=(",", ":"))
                                                   .replace('":"', '="'))] if match}
            # the GPUs or engines it lists, where the exporter serves them (no pods here: all of them)
            if re.search(r"gpuio_[a-z_]+", expr).group(0) in served:  # type: ignore[union-attr]
                assert values, f"variable {variable['name']} has no values"
            continue
        # label_values(<series selector>, <label>): Grafana asks for the label's values over the selector
        selector, label = variable["query"].removeprefix("label_values(").removesuffix(")").rsplit(", ", 1)
        result = api.get(f"/api/v1/label/{label}/values", **{"match[]": grafana_substitute(selector, instance)})
        assert result["status"] == "success", (variable["name"], result)
        if variable["name"] in ("instance", "device"):
            assert result["data"], f"variable {variable['name']} has no values"
        if variable["name"] == "instance":
            assert instance in result["data"]
