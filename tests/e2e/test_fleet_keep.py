"""deploy/victoriametrics/fleet-keep.yml in the real relabelers, in a cell's layout: one vmagent, which the
cell's scrapes and vmalerts write to, sends everything to the cell's victoria-metrics and, through the file
(``-remoteWrite.urlRelabelConfig``), only the Fleet board's series to the central one; promtool accepts the
file as a remote_write entry's write_relabel_configs."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml

from deploy import fleet_view
from deploy.local.stack import serve, stop
from tests.conftest import REPO, free_port
from tests.e2e.test_prometheus_rules_dashboards import grafana_substitute
from tests.e2e.test_storm_page import get_json
from tests.e2e.test_victoriametrics import RECORDING, VMALERT, Node, Recording, scrape_config, serve_node
from tests.unit.test_fleet_view import every_series_name

VICTORIA_METRICS = shutil.which("victoria-metrics")
VMAGENT = shutil.which("vmagent")  # (test_victoriametrics' VMALERT: the same lookup)
PROMTOOL = shutil.which("promtool")


def start_victoriametrics(directory: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    return serve("victoria-metrics", [str(VICTORIA_METRICS), f"-storageDataPath={directory}",
                                      f"-httpListenAddr=127.0.0.1:{port}", "-search.latencyOffset=0s",
                                      "-search.disableCache"], port, "/health")


def names_stored(url: str, expected: int, timeout_s: float = 30) -> list[str]:
    """The metric names a victoria-metrics holds, once ``expected`` have arrived (or ``timeout_s`` passed)."""
    query = urllib.parse.urlencode({"match[]": '{__name__=~".+"}'})
    deadline = time.monotonic() + timeout_s
    while True:
        urllib.request.urlopen(f"{url}/internal/force_flush").read()
        with urllib.request.urlopen(f"{url}/api/v1/label/__name__/values?{query}") as response:
            names = sorted(json.load(response)["data"])
        if len(names) >= expected or time.monotonic() > deadline:
            return names
        time.sleep(0.3)


def start_cell(tmp_path: Path, processes: list, *vmagent_flags: str) -> tuple[str, str, str]:
    """The cell's victoria-metrics, the central one, and the cell's vmagent writing everything to the cell's
    and fleet-keep.yml's series to the central one; the urls of the three (cell, central, vmagent).  The
    central url comes first: -remoteWrite.urlRelabelConfig pairs with the urls in order, and an empty value
    for the cell's is dropped, not kept as "none" (the keep-list would filter the cell's store)."""
    cell, cell_url = start_victoriametrics(tmp_path / "cell")
    processes.append(cell)
    central, central_url = start_victoriametrics(tmp_path / "central")
    processes.append(central)
    port = free_port()
    agent, agent_url = serve("vmagent", [
        str(VMAGENT), f"-httpListenAddr=127.0.0.1:{port}", f"-remoteWrite.tmpDataPath={tmp_path / 'vmagent'}",
        f"-remoteWrite.url={central_url}/api/v1/write", f"-remoteWrite.urlRelabelConfig={fleet_view.PATH}",
        f"-remoteWrite.url={cell_url}/api/v1/write", *vmagent_flags], port, "/health")
    processes.append(agent)
    return cell_url, central_url, agent_url


@pytest.mark.skipif(VICTORIA_METRICS is None or VMAGENT is None,
                    reason="not installed: victoria-metrics, vmagent (Debian's victoria-metrics)")
def test_a_cells_vmagent_sends_the_central_store_the_fleet_boards_series_and_the_cell_everything(tmp_path) -> None:
    processes: list = []
    try:
        cell_url, central_url, agent_url = start_cell(tmp_path, processes, "-remoteWrite.flushInterval=100ms")
        names = every_series_name()
        lines = "".join(f'{name}{{instance="n1",job="gpuio"}} 1\n' for name in names)
        urllib.request.urlopen(urllib.request.Request(f"{agent_url}/api/v1/import/prometheus",
                                                      data=lines.encode())).read()
        (step,) = yaml.safe_load(Path(fleet_view.PATH).read_text())
        kept = step["regex"].split("|")
        in_cell, in_central = names_stored(cell_url, len(names)), names_stored(central_url, len(kept))
    finally:
        for process in reversed(processes):
            stop(process)
    assert in_cell == names
    assert in_central == kept, (sorted(set(in_central) - set(kept)), sorted(set(kept) - set(in_central)))
    assert len(names) > 10 * len(kept)  # what a cell does not forward: the rest, many times more


@pytest.mark.skipif(PROMTOOL is None, reason="not installed: promtool (Debian package prometheus)")
def test_promtool_accepts_it_as_write_relabel_configs(tmp_path: Path) -> None:
    steps = yaml.safe_load(Path(fleet_view.PATH).read_text())
    config = {"remote_write": [{"url": "http://central.example:8428/api/v1/write", "write_relabel_configs": steps}]}
    path = tmp_path / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    result = subprocess.run([PROMTOOL, "check", "config", str(path)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def fleet_panel_queries() -> list[tuple[str, str, bool]]:
    """(panel [refId], expr as Grafana sends it for every node, instant?) of every query of the Fleet board."""
    board = json.loads((Path(REPO) / "dashboards" / fleet_view.FLEET_BOARD).read_text())
    return [(f"{panel['title']} [{target['refId']}]", grafana_substitute(target["expr"], ".+"),
             bool(target.get("instant")))
            for panel in [p for top in board["panels"] for p in (top, *top.get("panels", []))]
            for target in panel.get("targets", [])]


def answer(url: str, expr: str, instant: bool, at: float) -> list:
    """A query's result, each series as its labels and its values: comparable between two stores."""
    if instant:
        params = {"query": expr, "time": f"{at:.0f}", "nocache": "1"}
        result = get_json(f"{url}/api/v1/query", **params)["data"]["result"]
        return sorted((sorted(s["metric"].items()), [s["value"]]) for s in result)
    params = {"query": expr, "start": f"{at - 30:.0f}", "end": f"{at:.0f}", "step": "5", "nocache": "1"}
    result = get_json(f"{url}/api/v1/query_range", **params)["data"]["result"]
    return sorted((sorted(s["metric"].items()), s["values"]) for s in result)


@pytest.mark.skipif(None in (VICTORIA_METRICS, VMAGENT, VMALERT),
                    reason="not installed: victoria-metrics, vmagent, vmalert (Debian's victoria-metrics)")
def test_the_fleet_board_answers_from_the_central_store_as_from_the_cell(tmp_path: Path) -> None:
    """A cell: a node scraped by the cell's vmagent, vmalert on vmalert's copy of the rules writing through it;
    every Fleet board query answers the same from the central store, which got only fleet-keep.yml's series,
    as from the cell's, which got everything."""
    processes: list = []
    node_port = free_port()
    server = serve_node(Node(Recording(RECORDING), storm=False), "127.0.0.1", node_port)
    try:
        cell_url, central_url, agent_url = start_cell(
            tmp_path, processes, f"-promscrape.config={scrape_config(tmp_path, [f'127.0.0.1:{node_port}'])}",
            "-remoteWrite.flushInterval=1s")
        port = free_port()
        alert, _ = serve("vmalert", [
            str(VMALERT), f"-rule={Path(fleet_view.PATH).parent / 'rules' / '*.yml'}",
            f"-httpListenAddr=127.0.0.1:{port}",
            f"-datasource.url={cell_url}", f"-remoteRead.url={cell_url}", f"-remoteWrite.url={agent_url}",
            "-remoteWrite.flushInterval=1s", "-notifier.url=http://127.0.0.1:1", "-evaluationInterval=1s"],
            port, "/health")
        processes.append(alert)
        recorded = "instance_device:gpuio_disk_await_seconds:max_rate1m"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not get_json(f"{central_url}/api/v1/query", query=recorded,
                                                              nocache="1")["data"]["result"]:
            time.sleep(1)
        time.sleep(6)  # a few more scrapes and evaluations in both stores
        at = time.time() - 5
        for url in (cell_url, central_url):
            urllib.request.urlopen(f"{url}/internal/force_flush").read()
        answers = [(title, answer(cell_url, expr, instant, at), answer(central_url, expr, instant, at))
                   for title, expr, instant in fleet_panel_queries()]
    finally:
        for process in reversed(processes):
            stop(process)
        server.shutdown()
    differ = [title for title, in_cell, in_central in answers if in_cell != in_central]
    assert differ == [], differ
    answered = [title for title, in_cell, _ in answers if in_cell]
    print(f"\n{len(answered)} of {len(answers)} Fleet board queries answered alike from both stores: {answered}")
    assert len(answered) >= 4, answered  # the node's disks and engines on the board, not only empty panels
