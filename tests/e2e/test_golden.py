"""promtool check metrics on the golden files and on live output."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from exporter import collectors  # noqa: F401  (importing registers the collectors)
from tests.conftest import REPO
from tests.unit.test_golden import TREES, golden_path, scrape

pytestmark = pytest.mark.e2e

PROMTOOL = shutil.which("promtool")


def promtool_check(text: str) -> None:
    if PROMTOOL is None:
        pytest.skip("promtool is not installed (CI installs it: make system-deps)")
    result = subprocess.run([PROMTOOL, "check", "metrics"], input=text, capture_output=True, text=True,
                            timeout=60)
    output = (result.stdout + result.stderr).strip()
    assert result.returncode == 0 and not output, f"promtool check metrics exited {result.returncode}:\n{output}"


@pytest.mark.parametrize("tree", TREES)
def test_promtool_clean_on_golden_file(tree) -> None:
    path = golden_path(tree)
    if not os.path.exists(path):
        pytest.fail(f"{os.path.relpath(path, REPO)} is missing: run `make golden` to create it", pytrace=False)
    with open(path, encoding="utf-8") as handle:
        promtool_check(handle.read())


def test_promtool_clean_on_live_output() -> None:
    """This machine's real /proc and /sys, default flags, the exporter's own metrics included."""
    text = scrape([])
    assert "gpuio_exporter_build_info{" in text and "process_cpu_seconds_total " in text
    promtool_check(text)
