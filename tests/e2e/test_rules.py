"""The rules through promtool: check rules and config, the promtool unit tests, and the saturated rule
against gpuio top."""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess

import pytest
import yaml

from deploy.prometheus import rules as r
from exporter import thresholds
from tests.conftest import REPO
from tests.unit.test_rules import RULE_FILES, RULES_DIR, TEST_FILES

pytestmark = pytest.mark.e2e

PROMTOOL = shutil.which("promtool")

needs_promtool = pytest.mark.skipif(not PROMTOOL, reason="promtool is not installed (Debian package prometheus)")


def promtool(*args: str) -> subprocess.CompletedProcess:
    assert PROMTOOL
    return subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=120, cwd=REPO)


@needs_promtool
def test_promtool_check_rules() -> None:
    result = promtool("check", "rules", *RULE_FILES)
    assert result.returncode == 0, result.stdout + result.stderr


@needs_promtool
def test_promtool_check_example_prometheus_config() -> None:
    result = promtool("check", "config", os.path.join("deploy", "prometheus", "prometheus.yml"))
    assert result.returncode == 0, result.stdout + result.stderr


@needs_promtool
@pytest.mark.parametrize("path", TEST_FILES, ids=os.path.basename)
def test_promtool_unit_tests(path: str) -> None:
    result = promtool("test", "rules", path)
    assert result.returncode == 0, result.stdout + result.stderr


@needs_promtool
def test_saturated_rule_agrees_with_gpuio_top(tmp_path) -> None:
    """The SATURATED recording rule flags exactly the devices exporter/thresholds.disk_flags flags.

    One node per case: every combination of class (SATA SSD, HDD, NVMe, network block device), request
    rate (under and over the IOPS guard), await and queue size (under, between and over the class
    limits) and IO pressure (none, low, some high, full high), as steady counters; promtool evaluates
    the rule, Python the function.
    """
    # (device name, rotational): SATA SSD, HDD, NVMe and a Ceph RBD volume (classes by name first)
    devices = (("sda", "0"), ("sdb", "1"), ("nvme0n1", "0"), ("rbd0", "0"))
    cases = list(itertools.product(devices, (2.0, 50.0), (0.003, 0.007, 0.02, 0.08, 0.15), (2.0, 10.0, 20.0, 40.0),
                                   (None, (0.1, 0.01), (0.5, 0.0), (0.1, 0.2))))
    series, expected = [], []
    for index, ((name, rotational), iops, wait, queue, psi) in enumerate(cases):
        node = f'job="gpuio",instance="case-{index}"'
        device = f'{node},device="{name}"'
        series += [
            {"series": f'gpuio_disk_info{{{device},rotational="{rotational}"}}', "values": "1x8"},
            {"series": f"gpuio_disk_reads_completed_total{{{device}}}", "values": f"0+{iops * 15:g}x8"},
            {"series": f"gpuio_disk_read_time_seconds_total{{{device}}}", "values": f"0+{iops * wait * 15:g}x8"},
            {"series": f"gpuio_disk_io_time_weighted_seconds_total{{{device}}}", "values": f"0+{queue * 15:g}x8"},
        ]
        if psi is not None:
            series += [
                {"series": f"gpuio_pressure_io_waiting_seconds_total{{{node}}}", "values": f"0+{psi[0] * 15:g}x8"},
                {"series": f"gpuio_pressure_io_stalled_seconds_total{{{node}}}", "values": f"0+{psi[1] * 15:g}x8"},
            ]
        pressure = psi is not None and thresholds.DEFAULT.io_pressure_high(*psi)
        if thresholds.SATURATED in thresholds.DEFAULT.disk_flags(rotational, iops, None, wait, None, queue,
                                                                 pressure, device=name):
            expected.append({"labels": f'{{instance="case-{index}"}}', "value": 1})
    assert 0 < len(expected) < len(cases)
    test = {
        "rule_files": [os.path.join(RULES_DIR, "starvation.yml")],
        "evaluation_interval": "15s",
        "tests": [{"interval": "15s", "input_series": series, "promql_expr_test": [
            {"expr": f"count by (instance) ({r.NAMES.SATURATED})", "eval_time": "2m", "exp_samples": expected}]}],
    }
    path = tmp_path / "saturated.yml"
    path.write_text(yaml.safe_dump(test))
    result = promtool("test", "rules", str(path))
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr
