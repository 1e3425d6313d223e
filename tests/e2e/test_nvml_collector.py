"""The real exporter without NVML, and promtool check metrics on the nvml collector's output."""

from __future__ import annotations

import os
import shutil
import subprocess
import time

import pytest

from tests.conftest import REPO, parse_samples
from tests.unit.test_nvml_collector import everything, value

pytestmark = pytest.mark.e2e


@pytest.mark.e2e
def test_no_nvml_through_the_real_exporter(exporter, tmp_path) -> None:
    """The real server process on this GPU-less machine: nvml succeeds and serves no GPU series.

    ``sitecustomize`` imports the nvml module, which registers the collector, as the import line in
    exporter/collectors/__init__.py does once it is added (then it is redundant and harmless).
    """
    if shutil.which("nvidia-smi"):
        pytest.skip("this machine has an NVIDIA driver")
    (tmp_path / "sitecustomize.py").write_text("import exporter.collectors.nvml  # noqa: F401\n")
    path = os.pathsep.join([str(tmp_path), REPO, os.environ.get("PYTHONPATH", "")])
    server = exporter("--collector.disable-defaults", "--collector.nvml", "--collector.nvml.interval=50ms",
                      env={"PYTHONPATH": path})
    time.sleep(0.3)
    samples = parse_samples(server.scrape())
    assert value(samples, "gpuio_scrape_collector_success", collector="nvml") == 1
    assert not any(name.startswith("gpuio_gpu_") for name, _ in samples)
    assert "NVML not available: no GPUs here" in server.stop()


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool (Debian prometheus) not installed")
def test_promtool_check_metrics_is_clean() -> None:
    result = subprocess.run(["promtool", "check", "metrics"], input=everything(), capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
