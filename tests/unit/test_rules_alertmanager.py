"""deploy/alertmanager/alertmanager.yml, checked by Debian's amtool: valid, and routing as documented.

``amtool config routes test`` walks the real routing tree of the file; inhibition is not part of
routing, so tests/e2e/test_alertmanager_routing.py checks it on a running Alertmanager.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest
import yaml

from deploy.prometheus import config as c
from deploy.prometheus import rules as r
from tests.conftest import REPO

AMTOOL = shutil.which("amtool")
pytestmark = pytest.mark.skipif(not AMTOOL, reason="amtool is not installed (Debian package prometheus-alertmanager)")
CONFIG = os.path.join(REPO, "deploy", "alertmanager", "alertmanager.yml")
RECEIVER_OF = {c.CRITICAL: "page", c.WARNING: "ticket", c.INFO: "null"}
# Alert names the inhibit rules may name besides gpuio's own: common node-down alerts of other mixins.
OTHER_ALERTS = {"NodeDown", "InstanceDown"}


def amtool(*args: str) -> subprocess.CompletedProcess:
    assert AMTOOL
    return subprocess.run([AMTOOL, *args], capture_output=True, text=True, timeout=60)


def route(*labels: str) -> str:
    result = amtool("config", "routes", "test", f"--config.file={CONFIG}", *labels)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def test_amtool_check_config() -> None:
    result = amtool("check-config", CONFIG)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


@pytest.mark.parametrize(("labels", "receiver"), [
    (("severity=critical", "alertname=GPUStarvedByDiskIO", "instance=gpu-a"), "page"),
    (("severity=warning", "alertname=DiskIOStorm", "instance=gpu-a", "device=nvme0n1"), "ticket"),
    # the storm that hurts serving (loads waiting, engines starved) pages; the same storm without a victim
    # above is a ticket
    (("severity=critical", "alertname=DiskIOStorm", "instance=gpu-a", "device=nvme0n1"), "page"),
    (("severity=critical", "alertname=MountIOStorm", "instance=gpu-a", "mountpoint=/mnt/models"), "page"),
    (("severity=warning", "alertname=GpuioGPUDataStale", "instance=gpu-a"), "ticket"),
    (("severity=info", "alertname=Anything"), "null"),
    (("alertname=SomeoneElsesAlert",), "ticket"),  # no severity: a ticket, never silence
])
def test_routes_by_severity(labels: tuple[str, ...], receiver: str) -> None:
    assert route(*labels) == receiver


@pytest.mark.parametrize("alert", r.alerts(), ids=lambda alert: alert["alert"])
def test_every_gpuio_alert_reaches_the_receiver_of_its_severity(alert: dict) -> None:
    severity = alert["labels"]["severity"]
    result = amtool("config", "routes", "test", f"--config.file={CONFIG}",
                    f"--verify.receivers={RECEIVER_OF[severity]}", f"alertname={alert['alert']}",
                    f"severity={severity}", f"{c.NODE_LABEL}=gpu-a:9817")
    assert result.returncode == 0, result.stdout + result.stderr


def test_groups_by_node_and_alert() -> None:
    with open(CONFIG) as handle:
        config = yaml.safe_load(handle)
    assert config["route"]["group_by"] == [c.NODE_LABEL, "alertname"]
    for child in config["route"]["routes"]:
        assert "group_by" not in child, "a child route would regroup"


def test_storms_come_in_both_severities() -> None:
    """A storm with a victim pages, the same storm without one opens a ticket: both rules exist."""
    severities = {(alert["alert"], alert["labels"]["severity"]) for alert in r.alerts()}
    for name in ("DiskIOStorm", "MountIOStorm"):
        assert {(name, c.CRITICAL), (name, c.WARNING)} <= severities


def test_stale_gpu_data_holds_back_starvation() -> None:
    with open(CONFIG) as handle:
        config = yaml.safe_load(handle)
    stale = [rule for rule in config["inhibit_rules"] if rule["source_matchers"] == ['alertname="GpuioGPUDataStale"']]
    assert len(stale) == 1 and stale[0]["equal"] == [c.NODE_LABEL]
    held = set(re.fullmatch(r'alertname=~"([^"]+)"', stale[0]["target_matchers"][0]).group(1).split("|"))
    assert held == {"GPUStarvedByDiskIO", "NodeGPUStarvedByIO"}


def test_inhibit_rules_name_known_alerts_and_match_on_the_node() -> None:
    with open(CONFIG) as handle:
        config = yaml.safe_load(handle)
    known = {alert["alert"] for alert in r.alerts()} | OTHER_ALERTS
    named = set()
    for rule in config["inhibit_rules"]:
        assert c.NODE_LABEL in rule["equal"]
        for matcher in rule["source_matchers"] + rule["target_matchers"]:
            found = re.fullmatch(r'alertname=~?"([^"]+)"', matcher)
            if found:
                named |= set(found.group(1).split("|"))
    assert named - known == set()
    # while the exporter is down, every other gpuio alert of the node is held back (stale data)
    exporter_down = next(rule for rule in config["inhibit_rules"] if "GpuioExporterDown" in rule["source_matchers"][0])
    held = set(re.fullmatch(r'alertname=~"([^"]+)"', exporter_down["target_matchers"][0]).group(1).split("|"))
    assert held == {alert["alert"] for alert in r.alerts()} - {"GpuioExporterDown"}
