"""The compose files against the compose spec (check-jsonschema), promtool on the compose Prometheus
config, and the example receiver as a process."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.parse
import urllib.request

import pytest
import yaml

from tests.conftest import REPO, free_port
from tests.unit.test_deploy_compose import COMPOSE, GPU_OVERRIDE, compose, gpu_override, merged, unescape

pytestmark = pytest.mark.e2e

CHECK_JSONSCHEMA = shutil.which("check-jsonschema") or shutil.which(
    "check-jsonschema", path=os.path.dirname(sys.executable))
PROMTOOL = shutil.which("promtool")


def schema_errors(path: str) -> str | None:
    """None when ``path`` is valid for the Compose specification, else the validator's message."""
    result = subprocess.run([CHECK_JSONSCHEMA, "--builtin-schema", "vendor.compose-spec", path],
                            capture_output=True, text=True, timeout=120)
    return None if result.returncode == 0 else result.stdout + result.stderr


@pytest.mark.skipif(not CHECK_JSONSCHEMA, reason="pip install check-jsonschema (dev extras)")
def test_valid_against_the_compose_spec(tmp_path) -> None:
    assert schema_errors(COMPOSE) is None, schema_errors(COMPOSE)
    broken = compose()
    broken["services"]["gpuio-exporter"]["read_only"] = {"yes": True}
    path = tmp_path / "docker-compose.yml"
    path.write_text(yaml.safe_dump(broken))
    assert schema_errors(str(path)) is not None, "the schema accepted a mapping for a boolean: is it checking anything?"


@pytest.mark.skipif(not CHECK_JSONSCHEMA, reason="pip install check-jsonschema (dev extras)")
def test_gpu_override_is_valid_alone_and_merged(tmp_path) -> None:
    assert schema_errors(GPU_OVERRIDE) is None, schema_errors(GPU_OVERRIDE)
    path = tmp_path / "merged.yml"
    path.write_text(yaml.safe_dump(merged(compose(), gpu_override())))
    assert schema_errors(str(path)) is None, schema_errors(str(path))
    broken = gpu_override()
    broken["services"]["gpuio-exporter"]["deploy"]["resources"]["reservations"]["devices"][0]["gpus"] = "all"
    path.write_text(yaml.safe_dump(merged(compose(), broken)))
    assert schema_errors(str(path)) is not None, "the schema accepted an unknown key: is it checking anything?"


@pytest.mark.skipif(not PROMTOOL, reason="promtool is not installed (Debian package prometheus)")
def test_promtool_accepts_the_compose_prometheus_config(tmp_path) -> None:
    (tmp_path / "prometheus.yml").write_text(unescape(compose()["configs"]["prometheus"]["content"]))
    shutil.copytree(os.path.join(REPO, "deploy", "prometheus", "rules"), tmp_path / "rules")
    result = subprocess.run([PROMTOOL, "check", "config", str(tmp_path / "prometheus.yml")],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 5 rule files found" in result.stdout + result.stderr


def test_example_receiver_prints_each_alert_of_a_notification() -> None:
    command = compose()["services"]["alert-receiver"]["command"]
    assert command[:3] == ["python", "-u", "-c"]
    port = free_port()
    process = subprocess.Popen([sys.executable, *command[1:]], env={**os.environ, "PORT": str(port)},
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert "listening on port" in process.stdout.readline()
        notification = {"receiver": "ticket", "status": "firing", "alerts": [
            {"status": "firing", "labels": {"alertname": "DiskIOStorm", "severity": "warning",
                                            "instance": "gpu-a", "device": "nvme0n1"},
             "annotations": {"summary": "IO storm on nvme0n1 at gpu-a"}}]}
        deadline = time.monotonic() + 10
        while True:
            try:
                request = urllib.request.Request(f"http://127.0.0.1:{port}/ticket", json.dumps(notification).encode(),
                                                 {"Content-Type": "application/json"})
                with urllib.request.urlopen(request, timeout=5) as response:
                    assert response.status == 200
                break
            except OSError:
                assert time.monotonic() < deadline
                time.sleep(0.1)
        line = process.stdout.readline().strip()
        assert line == ("/ticket firing DiskIOStorm warning instance=gpu-a device=nvme0n1 - "
                        "IO storm on nvme0n1 at gpu-a"), line
    finally:
        process.terminate()
        process.wait(timeout=10)


@pytest.mark.skipif(not CHECK_JSONSCHEMA, reason="pip install check-jsonschema (dev extras)")
def test_victoriametrics_compose_is_valid_against_the_compose_spec() -> None:
    path = os.path.join(REPO, "deploy", "victoriametrics", "docker-compose.yml")
    assert schema_errors(path) is None, schema_errors(path)
