"""One threshold set once reaches everything that judges by it: the rule that fires, the panel's line, the
runbook on-call reads, and `gpuio top` on the node.

Set through the commands a user runs (``python -m deploy.generate --set NAME=VALUE --out DIR`` and
``gpuio top --set NAME=VALUE``), then read back from what they wrote: the rule files, the boards' JSON and
the runbooks' Markdown.  The new number must be there and the default must be gone where the knob is
meant, so a generator that kept a default of its own fails here.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

pytest.importorskip("grafana_foundation_sdk", reason="grafana-foundation-sdk (Python 3.11+) is not installed")

from deploy import generate  # noqa: E402
from deploy.prometheus import config  # noqa: E402
from exporter import thresholds  # noqa: E402


def rule_exprs(out: Path) -> list[str]:
    return [rule["expr"] for path in sorted(out.glob("*.yml"))
            for group in yaml.safe_load(path.read_text())["groups"] for rule in group["rules"]]


def panel(out: Path, board: str, title: str) -> dict:
    model = json.loads((out / "dashboards" / f"{board}.json").read_text())
    panels = [inner for outer in model["panels"] for inner in (outer, *outer.get("panels", []))]
    (found,) = [candidate for candidate in panels if candidate.get("title") == title]
    return found


def override_limits(found: dict, series: str) -> list[float]:
    """The threshold steps with a value that the panel draws for the series named ``series``."""
    for override in found["fieldConfig"]["overrides"]:
        if override["matcher"]["options"] == series:
            (steps,) = [prop["value"]["steps"] for prop in override["properties"] if prop["id"] == "thresholds"]
            return [step["value"] for step in steps if step["value"] is not None]
    raise AssertionError(f"no override for {series!r} in {found['title']!r}")


def generated(tmp_path: Path, *settings: str) -> Path:
    out = tmp_path / "site"
    args = [arg for setting in settings for arg in ("--set", setting)]
    assert generate.main([*args, "--out", str(out)], environ={}) == 0
    return out


def test_io_pressure_full_reaches_rule_panel_runbook_and_top(tmp_path) -> None:
    assert config.DEFAULT.IO_PRESSURE_FULL == 0.1  # the default this test moves away from
    out = generated(tmp_path, "IO_PRESSURE_FULL=0.22")
    stalled = " ".join(expr for expr in rule_exprs(out) if "gpuio_pressure_io_stalled_seconds:rate1m >=" in expr)
    # STORM_PAGE_IO_FULL (0.25, the page's own knob) is compared on the same series and stays
    compared = set(re.findall(r"stalled_seconds:rate1m >= ([0-9.]+)", stalled))
    assert compared == {"0.22", str(config.DEFAULT.STORM_PAGE_IO_FULL)}
    pressure = panel(out, "gpuio-disk-io", "IO pressure (PSI)")
    assert override_limits(pressure, "io full") == [0.22]
    assert "22% full" in pressure["description"] and "10% full" not in pressure["description"]
    runbook = (out / "runbooks" / "MountIOStorm.md").read_text()
    assert '22 % ("full")' in runbook and '10 % ("full")' not in runbook
    top = thresholds.DEFAULT.with_overrides(["IO_PRESSURE_FULL=0.22"])
    assert top == config.Config(IO_PRESSURE_FULL=0.22).thresholds
    assert top.io_pressure_high(0.0, 0.2) is False and thresholds.DEFAULT.io_pressure_high(0.0, 0.2) is True


def test_gpu_busy_low_reaches_rule_panel_runbook_and_top(tmp_path) -> None:
    assert config.DEFAULT.GPU_BUSY_LOW == 0.3
    out = generated(tmp_path, "GPU_BUSY_LOW=0.15")
    busy = [expr for expr in rule_exprs(out) if "gpuio_gpu_busy_seconds:rate1m <" in expr]
    assert busy and all(re.search(r"busy_seconds:rate1m < 0\.15\b", expr) for expr in busy)
    activity = panel(out, "gpuio-starvation", "GPU busy vs. SM and tensor activity")
    assert override_limits(activity, "/ busy$/") == [0.15]
    assert "under 15% busy" in activity["description"] and "30%" not in activity["description"]
    runbook = (out / "runbooks" / "NodeGPUStarvedByIO.md").read_text()
    assert "than 15 % of the time" in runbook and "than 30 % of the time" not in runbook
    top = thresholds.DEFAULT.with_overrides(["GPU_BUSY_LOW=0.15"])
    assert top.gpu_idle(0.2) is False and thresholds.DEFAULT.gpu_idle(0.2) is True


def test_every_threshold_top_judges_by_is_a_knob_of_the_rules_with_the_same_default() -> None:
    """`gpuio top --set NAME` and `python -m deploy.generate --set NAME` mean the same number."""
    assert config.DEFAULT.thresholds == thresholds.DEFAULT
    assert {field for field in thresholds.Thresholds.__dataclass_fields__} <= config.KNOBS


def test_a_switch_of_the_boards_is_a_knob_too(tmp_path) -> None:
    """MULTI_CLUSTER shows every board's Cluster variable (hidden by default: one Prometheus)."""
    def cluster_hidden(out: Path) -> set[bool]:
        return {variable.get("hide") == 2 for path in sorted((out / "dashboards").glob("*.json"))
                for variable in json.loads(path.read_text())["templating"]["list"] if variable["name"] == "cluster"}

    assert cluster_hidden(generated(tmp_path / "default")) == {True}
    assert cluster_hidden(generated(tmp_path / "several", "MULTI_CLUSTER=true")) == {False}
