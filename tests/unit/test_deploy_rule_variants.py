"""``python -m deploy.prometheus.generate --set NAME=VALUE --out DIR``: rule variants for end-to-end tests.

The production files stay byte-identical (the drift check in test_rules.py covers that; here: a
variant rendered in-process leaves config.py and rules.py as they were), a variant changes what it
was asked to and nothing else, promtool accepts it, and bad overrides are refused with a message
that names the knob and what would be accepted.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import yaml

from deploy.prometheus import config, generate, rules
from tests.conftest import REPO

PROMTOOL = shutil.which("promtool")
VARIANT = {"RATE_WINDOW": "10s", "BASELINE_WINDOW": "2m", "STORM_FOR": "10s"}


def disk_rules(files: dict[str, str]) -> list[dict]:
    (disk,) = [text for path, text in files.items() if path.endswith("starvation.yml")]
    return [rule for group in yaml.safe_load(disk)["groups"] for rule in group["rules"]]


def storm(files: dict[str, str], severity: str = "warning") -> dict:
    return next(rule for rule in disk_rules(files)
                if rule.get("alert") == "DiskIOStorm" and rule["labels"]["severity"] == severity)


def test_variant_changes_only_the_knobs_and_leaves_production_as_it_was(tmp_path) -> None:
    production = generate.rendered()
    variant = generate.rendered(VARIANT, str(tmp_path))
    assert generate.rendered() == production, "config.py / rules.py not restored after the variant"
    assert config.STORM_FOR == "5m" and rules.W == "1m"
    alert = storm(variant)
    assert alert["for"] == "10s"
    assert alert["expr"] == "instance_device:gpuio_disk_storm_await_seconds:max_rate10s"
    # the storm's recording rule and the calm baselines it compares with, renamed and rewindowed alike
    recorded = {rule["record"]: rule["expr"] for rule in disk_rules(variant) if "record" in rule}
    assert "instance_device:gpuio_disk_calm_await_seconds:median2m_held6h" in recorded[alert["expr"]]
    production_storm = {rule["record"]: rule["expr"] for rule in disk_rules(production) if "record" in rule}[
        "instance_device:gpuio_disk_storm_await_seconds:max_rate1m"]
    assert production_storm.replace("rate1m", "rate10s").replace("median1h", "median2m") == recorded[alert["expr"]]
    assert storm(variant, "critical")["for"] == config.STORM_PAGE_FOR
    assert all("VARIANT, not for production: RATE_WINDOW=10s BASELINE_WINDOW=2m STORM_FOR=10s" in text
               for text in variant.values())
    assert sorted(os.path.basename(p) for p in variant) == sorted(os.path.basename(p) for p in production)


def test_cli_writes_a_variant_elsewhere_that_promtool_accepts(tmp_path) -> None:
    sets = [arg for name, value in VARIANT.items() for arg in ("--set", f"{name}={value}")]
    result = subprocess.run([sys.executable, "-m", "deploy.prometheus.generate", *sets, "--out", str(tmp_path)],
                            cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    files = sorted(str(p) for p in tmp_path.glob("*.yml"))
    assert len(files) == len(generate.rendered())
    assert generate.stale() == []
    if PROMTOOL:
        check = subprocess.run([PROMTOOL, "check", "rules", *files], capture_output=True, text=True, timeout=60)
        assert check.returncode == 0, check.stdout + check.stderr


@pytest.mark.parametrize(("args", "message"), [
    (["--set", "STORM_FOR=5 minutes", "--out", "x"], "expected a Prometheus duration"),
    (["--set", "NO_SUCH_KNOB=1", "--out", "x"], "a knob of deploy/prometheus/config.py"),
    (["--set", "STORM_BASELINE_FACTOR=four", "--out", "x"], "expected a float"),
    (["--set", "SOLID_STATE=1", "--out", "x"], "only numbers, durations and text"),
    (["--set", "STORM_FOR=10s"], "give --out DIR"),
    (["--set", "STORM_FOR=10s", "--out", "deploy/prometheus/rules"], "never rules/"),
    (["--set", "STORM_FOR=10s", "--check"], "no --check"),
])
def test_bad_overrides_are_refused(args: list[str], message: str) -> None:
    result = subprocess.run([sys.executable, "-m", "deploy.prometheus.generate", *args], cwd=REPO,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert generate.stale() == []
