"""deploy/alertmanager/alertmanager.yml in a real Alertmanager: routing, grouping and inhibition.

Debian's ``prometheus-alertmanager`` runs the repository's file with three things changed, all
outside the routing tree and the inhibit rules: the webhook URLs point at a receiver in this test,
and group_wait/group_interval are 1 s so notifications come at once.  Alerts are posted through the
v2 API the way Prometheus sends them; the test then reads what each webhook received and what the
API says is inhibited.
"""

from __future__ import annotations

import json
import os
import time
import urllib.request
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone

import pytest

from tests.conftest import REPO
from tests.peers import ALERTMANAGER, Webhook, start_alertmanager, start_webhook, stop

pytestmark = pytest.mark.e2e

CONFIG = os.path.join(REPO, "deploy", "alertmanager", "alertmanager.yml")

ALERTS = {
    # gpu-a: a page, and two storms grouped into one ticket
    "a-starved": {"alertname": "GPUStarvedByDiskIO", "instance": "gpu-a", "gpu": "0", "severity": "critical"},
    "a-storm-0": {"alertname": "DiskIOStorm", "instance": "gpu-a", "device": "nvme0n1", "severity": "warning"},
    "a-storm-1": {"alertname": "DiskIOStorm", "instance": "gpu-a", "device": "nvme1n1", "severity": "warning"},
    # gpu-b: the exporter is down, so the node's storm and starvation are held back
    "b-down": {"alertname": "GpuioExporterDown", "instance": "gpu-b", "severity": "warning"},
    "b-storm": {"alertname": "DiskIOStorm", "instance": "gpu-b", "device": "nvme0n1", "severity": "warning"},
    "b-starved": {"alertname": "GPUStarvedByDiskIO", "instance": "gpu-b", "gpu": "0", "severity": "critical"},
    # gpu-c: GPU 1 is lost, so its starvation (engine-joined and node-level) is held back; GPU 2's is not
    "c-lost": {"alertname": "GPULost", "instance": "gpu-c", "gpu": "1", "severity": "critical"},
    "c-starved-1": {"alertname": "GPUStarvedByDiskIO", "instance": "gpu-c", "gpu": "1", "severity": "critical"},
    "c-node-starved-1": {"alertname": "NodeGPUStarvedByIO", "instance": "gpu-c", "gpu": "1", "severity": "warning"},
    "c-starved-2": {"alertname": "GPUStarvedByDiskIO", "instance": "gpu-c", "gpu": "2", "severity": "critical"},
    # gpu-d: the node itself is down (another job's alert, same instance): its GPU's starvation is held back
    "d-down": {"alertname": "NodeDown", "instance": "gpu-d", "severity": "critical"},
    "d-node-starved": {"alertname": "NodeGPUStarvedByIO", "instance": "gpu-d", "gpu": "0", "severity": "warning"},
    # gpu-e: NVML froze (stale GPU data): its starvation alerts are held back, the stale ticket is sent
    "e-stale": {"alertname": "GpuioGPUDataStale", "instance": "gpu-e", "severity": "warning"},
    "e-starved": {"alertname": "GPUStarvedByDiskIO", "instance": "gpu-e", "gpu": "0", "severity": "critical"},
    "e-node-starved": {"alertname": "NodeGPUStarvedByIO", "instance": "gpu-e", "gpu": "1", "severity": "warning"},
    # gpu-f: a storm that hurts serving pages; the ticket of the same disk is held back, the ticket of
    # another disk (no victim there) is not
    "f-storm-page": {"alertname": "DiskIOStorm", "instance": "gpu-f", "device": "nvme0n1", "severity": "critical"},
    "f-storm-ticket": {"alertname": "DiskIOStorm", "instance": "gpu-f", "device": "nvme0n1", "severity": "warning"},
    "f-other-ticket": {"alertname": "DiskIOStorm", "instance": "gpu-f", "device": "nvme1n1", "severity": "warning"},
    # gpu-g: engines on NFS: the mount's storm page
    "g-mount-page": {"alertname": "MountIOStorm", "instance": "gpu-g", "mountpoint": "/mnt/models",
                     "severity": "critical"},
    "g-mount-ticket": {"alertname": "MountIOStorm", "instance": "gpu-g", "mountpoint": "/mnt/models",
                       "severity": "warning"},
}
INHIBITED = {"b-storm", "b-starved", "c-starved-1", "c-node-starved-1", "d-node-starved", "e-starved",
             "e-node-starved", "f-storm-ticket", "g-mount-ticket"}
# receiver -> {(instance, alertname): the alerts of that notification group}
EXPECTED = {
    "page": {("gpu-a", "GPUStarvedByDiskIO"): {"a-starved"}, ("gpu-c", "GPULost"): {"c-lost"},
             ("gpu-c", "GPUStarvedByDiskIO"): {"c-starved-2"}, ("gpu-d", "NodeDown"): {"d-down"},
             ("gpu-f", "DiskIOStorm"): {"f-storm-page"}, ("gpu-g", "MountIOStorm"): {"g-mount-page"}},
    "ticket": {("gpu-a", "DiskIOStorm"): {"a-storm-0", "a-storm-1"}, ("gpu-b", "GpuioExporterDown"): {"b-down"},
               ("gpu-e", "GpuioGPUDataStale"): {"e-stale"}, ("gpu-f", "DiskIOStorm"): {"f-other-ticket"}},
}


@pytest.fixture
def alertmanager(tmp_path) -> Iterator[str]:
    if not ALERTMANAGER:
        pytest.skip("alertmanager is not installed (Debian package prometheus-alertmanager)")
    server = start_webhook()
    try:
        process, base = start_alertmanager(tmp_path, server.server_port)
    except BaseException:
        server.shutdown()
        raise
    try:
        yield base
    finally:
        stop(process)
        server.shutdown()


def post_alerts(base: str) -> None:
    now = datetime.now(timezone.utc)
    payload = [{"labels": {**labels, "key": key}, "annotations": {"summary": key},
                "startsAt": now.isoformat(), "endsAt": (now + timedelta(hours=1)).isoformat()}
               for key, labels in ALERTS.items()]
    request = urllib.request.Request(base + "/api/v2/alerts", data=json.dumps(payload).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(request, timeout=10) as response:
        assert response.status == 200


def notifications() -> dict[str, dict[tuple[str, str], set[str]]]:
    out: dict[str, dict[tuple[str, str], set[str]]] = {}
    for _, body in Webhook.received:
        group = (body["groupLabels"]["instance"], body["groupLabels"]["alertname"])
        keys = {alert["labels"]["key"] for alert in body["alerts"]}
        out.setdefault(body["receiver"], {}).setdefault(group, set()).update(keys)
        assert body["path"] == f"/{body['receiver']}"
    return out


def test_routing_grouping_and_inhibition(alertmanager: str) -> None:
    post_alerts(alertmanager)
    deadline = time.monotonic() + 15
    while notifications() != EXPECTED and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(2)  # several group intervals more: an inhibited alert must still not have been sent
    assert notifications() == EXPECTED
    with urllib.request.urlopen(alertmanager + "/api/v2/alerts", timeout=10) as response:
        alerts = json.loads(response.read())
    inhibited = {alert["labels"]["key"] for alert in alerts if alert["status"]["inhibitedBy"]}
    assert inhibited == INHIBITED
