"""deploy/alertmanager/alertmanager.yml, checked by Debian's amtool: valid, and routing as documented.

``amtool config routes test`` walks the real routing tree of the file; inhibition is not part of
routing, so tests/e2e/test_alertmanager_routing.py checks it on a running Alertmanager.
"""

from __future__ import annotations

import os
import re
import shutil

import pytest
import yaml

from deploy.prometheus import config as c
from deploy.prometheus import rules as r
from tests.conftest import REPO

AMTOOL = shutil.which("amtool")
pytestmark = pytest.mark.skipif(not AMTOOL, reason="amtool is not installed (Debian package prometheus-alertmanager)")
CONFIG = os.path.join(REPO, "deploy", "alertmanager", "alertmanager.yml")
# Alert names the inhibit rules may name besides gpuio's own: common node-down alerts of other mixins.
OTHER_ALERTS = {"NodeDown", "InstanceDown"}


def test_groups_by_node_and_alert() -> None:
    with open(CONFIG) as handle:
        config = yaml.safe_load(handle)
    assert config["route"]["group_by"] == [c.DEFAULT.NODE_LABEL, "alertname"]
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
    assert len(stale) == 1 and stale[0]["equal"] == [c.DEFAULT.NODE_LABEL]
    held = set(re.fullmatch(r'alertname=~"([^"]+)"', stale[0]["target_matchers"][0]).group(1).split("|"))
    assert held == {"GPUStarvedByDiskIO", "NodeGPUStarvedByIO"}


def test_inhibit_rules_name_known_alerts_and_match_on_the_node() -> None:
    with open(CONFIG) as handle:
        config = yaml.safe_load(handle)
    known = {alert["alert"] for alert in r.alerts()} | OTHER_ALERTS
    named = set()
    for rule in config["inhibit_rules"]:
        assert c.DEFAULT.NODE_LABEL in rule["equal"]
        for matcher in rule["source_matchers"] + rule["target_matchers"]:
            found = re.fullmatch(r'alertname=~?"([^"]+)"', matcher)
            if found:
                named |= set(found.group(1).split("|"))
    assert named - known == set()
    # while the exporter is down, every other gpuio alert of the node is held back (stale data)
    exporter_down = next(rule for rule in config["inhibit_rules"] if "GpuioExporterDown" in rule["source_matchers"][0])
    held = set(re.fullmatch(r'alertname=~"([^"]+)"', exporter_down["target_matchers"][0]).group(1).split("|"))
    assert held == {alert["alert"] for alert in r.alerts()} - {"GpuioExporterDown"}
