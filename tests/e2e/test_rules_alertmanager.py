"""Alertmanager's routing through amtool: the config, and where each alert and severity goes."""

from __future__ import annotations

import subprocess

import pytest

from deploy.prometheus import config as c
from deploy.prometheus import rules as r
from tests.unit.test_rules_alertmanager import AMTOOL, CONFIG

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(not AMTOOL, reason="amtool is not installed (Debian package prometheus-alertmanager)"),
]

RECEIVER_OF = {c.CRITICAL: "page", c.WARNING: "ticket", c.INFO: "null"}


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
                    f"severity={severity}", f"{c.DEFAULT.NODE_LABEL}=gpu-a:9817")
    assert result.returncode == 0, result.stdout + result.stderr
