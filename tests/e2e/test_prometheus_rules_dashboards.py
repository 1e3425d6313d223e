"""Every rule and every dashboard query, run by a real Prometheus against a real gpuio-exporter.

Setup: the exporter (conftest ``exporter`` fixture, this machine's /proc and /sys, default
collectors) and Debian's ``prometheus`` started with deploy/prometheus/prometheus.yml, changed only
where a test must: 1 s scrape and evaluation intervals, the exporter's port as the target, rule
files by absolute path, no Alertmanager.  A thread writes (with fsync) and reads (O_DIRECT) a small
file on the disk under the repository, so the disks have completions to compute awaits from.

Checked, through Prometheus' HTTP API once a few scrapes are in:

* every rule of deploy/prometheus/rules/*.yml is healthy after its first evaluations, and its
  expression runs through /api/v1/query without error;
* every panel query, annotation and variable query of every dashboards/*.json runs without error
  (Grafana's variables replaced by what Grafana would send: ``$__rate_interval`` is 4 scrape
  intervals, ``$instance`` the exporter's node, ``$device`` etc. the "All" value);
* every disk and pressure panel returns data: the PromQL is not only valid but names series that
  exist (pressure only where the kernel has /proc/pressure).  "Saturated disks" may rightly be empty.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator

import pytest
import yaml

from tests.conftest import REPO, ExporterProcess
from tests.peers import PROMETHEUS, start_prometheus
from tests.peers import stop as stop_process

pytestmark = pytest.mark.e2e

RULE_FILES = sorted(glob.glob(os.path.join(REPO, "deploy", "prometheus", "rules", "*.yml")))
DASHBOARDS = sorted(glob.glob(os.path.join(REPO, "dashboards", "*.json")))
SCRAPES = 6  # samples per series before querying: a 4 s $__rate_interval then always holds 4 or more
RATE_INTERVAL = "4s"
MAY_BE_EMPTY = {"Saturated disks"}  # empty while no disk is saturated: the healthy case
DISK_METRICS = ("gpuio_disk_", "instance_device:gpuio_disk_")
PRESSURE_METRICS = ("gpuio_pressure_", "instance:gpuio_pressure_")


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


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory) -> Iterator[tuple[Prometheus, str]]:
    """One exporter and one Prometheus for the whole module (each takes a few seconds to fill)."""
    if not PROMETHEUS:
        pytest.skip("prometheus is not installed (Debian package prometheus; make system-deps)")
    tmp_path = tmp_path_factory.mktemp("prometheus")
    target = ExporterProcess().start()
    try:
        process, base = start_prometheus(tmp_path, RULE_FILES, target.port)
    except BaseException:
        target.stop()
        raise
    api = Prometheus(base)
    load_dir = tempfile.mkdtemp(prefix=".e2e-disk-load-", dir=REPO)  # a real disk, unlike a tmpfs /tmp
    stop = threading.Event()
    loader = threading.Thread(target=disk_load, args=(load_dir, stop), daemon=True)
    loader.start()
    try:
        wait_for_scrapes(api, process)
        # the node as Prometheus names it (the example config relabels instance to the host)
        (sample,) = api.query('up{job="gpuio"}')["data"]["result"]
        yield api, sample["metric"]["instance"]
    finally:
        stop.set()
        loader.join(timeout=10)
        shutil.rmtree(load_dir, ignore_errors=True)
        stop_process(process)
        target.stop()


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
    for name, value in (("$__rate_interval", RATE_INTERVAL), ("$instance", instance), ("$device", ".+"),
                        ("$gpu", ".*"), ("$engine", ".*")):
        expr = expr.replace(name, value)
    assert "$" not in expr.replace("$1", ""), f"a variable the test does not know: {expr}"
    return expr


def panels(dashboard: dict) -> Iterator[dict]:
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])


def rules() -> Iterator[dict]:
    for path in RULE_FILES:
        with open(path) as handle:
            for group in yaml.safe_load(handle)["groups"]:
                yield from group["rules"]


def test_rules_are_healthy_and_run(prometheus) -> None:
    api, _ = prometheus
    expected = {rule.get("record") or rule.get("alert") for rule in rules()}
    deadline = time.monotonic() + 10
    while True:  # every rule evaluated at least once
        loaded = [rule for group in api.get("/api/v1/rules")["data"]["groups"] for rule in group["rules"]]
        if all(rule["lastEvaluation"] > "2000" for rule in loaded) or time.monotonic() > deadline:
            break
        time.sleep(0.25)
    assert {rule["name"] for rule in loaded} == expected
    unhealthy = {rule["name"]: rule.get("lastError") for rule in loaded if rule["health"] != "ok"}
    assert unhealthy == {}
    for rule in rules():
        result = api.query(rule["expr"])
        assert result["status"] == "success", (rule.get("record") or rule.get("alert"), result)
    # The per-device iostat rules and the class limits exist for every device of this machine.
    for name in ("instance_device:gpuio_disk_reads_completed:rate1m", "instance_device:gpuio_disk_queue_limit:class",
                 "instance_device:gpuio_disk_io_time_weighted_seconds:median1h"):
        assert api.query(name)["data"]["result"], name


@pytest.mark.parametrize("path", DASHBOARDS, ids=os.path.basename)
def test_dashboard_queries_run_and_disk_panels_have_data(prometheus, path: str) -> None:
    api, instance = prometheus
    with open(path) as handle:
        dashboard = json.load(handle)
    has_psi = os.path.exists("/proc/pressure/io")
    empty = []
    for panel in panels(dashboard):
        exprs = [target["expr"] for target in panel.get("targets", [])]
        found = 0
        for expr in exprs:
            result = api.query(grafana_substitute(expr, instance))
            assert result["status"] == "success", (panel["title"], expr, result)
            found += len(result["data"]["result"])
        disk = any(metric in expr for expr in exprs for metric in DISK_METRICS)
        pressure = any(metric in expr for expr in exprs for metric in PRESSURE_METRICS)
        if (disk or (pressure and has_psi)) and panel["title"] not in MAY_BE_EMPTY and not found:
            empty.append(panel["title"])
    assert empty == [], "disk or pressure panels without data"
    for annotation in dashboard["annotations"]["list"]:
        result = api.query(grafana_substitute(annotation["expr"], instance))
        assert result["status"] == "success", (annotation["name"], result)
    for variable in dashboard["templating"]["list"]:
        if variable["type"] != "query":
            continue
        # label_values(<series selector>, <label>): Grafana asks for the label's values over the selector
        selector, label = variable["query"].removeprefix("label_values(").removesuffix(")").rsplit(", ", 1)
        result = api.get(f"/api/v1/label/{label}/values", **{"match[]": grafana_substitute(selector, instance)})
        assert result["status"] == "success", (variable["name"], result)
        if variable["name"] in ("instance", "device"):
            assert result["data"], f"variable {variable['name']} has no values"
        if variable["name"] == "instance":
            assert instance in result["data"]
