"""deploy/victoriametrics/fleet-keep.yml in the real relabelers: victoria-metrics, given it as its ingestion
relabeling (the same code as vmagent's -remoteWrite.urlRelabelConfig), stores the Fleet board's series and
drops every other series a node sends and its rules record; promtool accepts it as a remote_write entry's
write_relabel_configs."""

from __future__ import annotations

import json
import shutil
import subprocess
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml

from deploy import fleet_view
from deploy.local.stack import serve, stop
from deploy.prometheus.sources import rule_files
from exporter import catalogue
from tests.conftest import free_port

VICTORIA_METRICS = shutil.which("victoria-metrics")
PROMTOOL = shutil.which("promtool")


def every_series_name() -> list[str]:
    """One name for every family gpuio serves (as its samples are named) and every series its rules record."""
    recorded = {rule["record"] for content in rule_files().values() for group in content["groups"]
                for rule in group["rules"] if "record" in rule}
    served = set()
    for name in catalogue.names():
        histogram = catalogue.by_name(name).kind == "histogram"  # a counter's name ends in _total already
        served |= {f"{name}_bucket", f"{name}_sum", f"{name}_count"} if histogram else {name}
    return sorted(recorded | served)


@pytest.mark.skipif(VICTORIA_METRICS is None, reason="not installed: victoria-metrics (Debian's victoria-metrics)")
def test_victoriametrics_keeps_the_fleet_boards_series_and_drops_the_rest(tmp_path: Path) -> None:
    port = free_port()
    process, url = serve("victoria-metrics", [
        str(VICTORIA_METRICS), f"-storageDataPath={tmp_path / 'data'}", f"-httpListenAddr=127.0.0.1:{port}",
        f"-relabelConfig={fleet_view.PATH}", "-search.latencyOffset=0s", "-search.disableCache"], port, "/health")
    try:
        names = every_series_name()
        lines = "".join(f'{name}{{instance="n1",job="gpuio"}} 1\n' for name in names)
        urllib.request.urlopen(urllib.request.Request(f"{url}/api/v1/import/prometheus", data=lines.encode())).read()
        urllib.request.urlopen(f"{url}/internal/force_flush").read()
        query = urllib.parse.urlencode({"match[]": '{__name__=~".+"}'})
        with urllib.request.urlopen(f"{url}/api/v1/label/__name__/values?{query}") as response:
            stored = json.load(response)["data"]
    finally:
        stop(process)
    (step,) = yaml.safe_load(Path(fleet_view.PATH).read_text())
    kept = step["regex"].split("|")
    assert sorted(stored) == kept, (sorted(set(stored) - set(kept)), sorted(set(kept) - set(stored)))
    assert len(names) > 10 * len(kept)  # what a cell does not forward: the rest, many times more


@pytest.mark.skipif(PROMTOOL is None, reason="not installed: promtool (Debian package prometheus)")
def test_promtool_accepts_it_as_write_relabel_configs(tmp_path: Path) -> None:
    steps = yaml.safe_load(Path(fleet_view.PATH).read_text())
    config = {"remote_write": [{"url": "http://central.example:8428/api/v1/write", "write_relabel_configs": steps}]}
    path = tmp_path / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    result = subprocess.run([PROMTOOL, "check", "config", str(path)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
