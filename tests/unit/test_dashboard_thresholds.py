"""The limits drawn on the boards are the limits the alerts fire on.

Each threshold on a panel (its default or a series' override) must be a number that the rules Prometheus
loads (deploy/prometheus/rules/*.yml) compare against, in the chain of an alert the panel's description
names: the alert's own expression and every recording rule it reads, transitively.  The boards take
the numbers from the one rules config (deploy/prometheus/config.py, itself reading exporter/thresholds.py);
this test reads the generated rule files instead, so a number typed into a board, or a config change
that reaches one side only, fails here.
"""

from __future__ import annotations

import glob
import json
import os
import re
from pathlib import Path

import pytest
import yaml

pytest.importorskip("grafana_foundation_sdk", reason="grafana-foundation-sdk (Python 3.11+) is not installed")

from deploy.grafana import boards  # noqa: E402
from deploy.prometheus.config import DEFAULT  # noqa: E402
from tests.conftest import REPO  # noqa: E402

BOARDS = {os.path.basename(path): json.loads(text) for path, text in boards.rendered().items()}
RULES = [rule for path in sorted(glob.glob(os.path.join(REPO, "deploy", "prometheus", "rules", "*.yml")))
         for group in yaml.safe_load(Path(path).read_text(encoding="utf-8"))["groups"] for rule in group["rules"]]
RECORDED: dict[str, list[str]] = {}
ALERTS: dict[str, list[str]] = {}
for _rule in RULES:
    (RECORDED if "record" in _rule else ALERTS).setdefault(_rule.get("record") or _rule["alert"], []).append(
        _rule["expr"])
# A number right after a comparison: `x < 0.3`, `>= on (instance) 0.25`, `> bool 60`.
COMPARED = re.compile(r"(?:[<>]=?|==|!=)\s*(?:bool\s+)?(?:on\s*\([^)]*\)\s*)?(-?[0-9]+(?:\.[0-9]+)?(?:e-?[0-9]+)?)\b")
RECORDING_NAME = re.compile(r"\b[a-z_]+:[a-z0-9_]+:[a-z0-9_]+\b")
# Ratios to a recorded per-class limit (await over its class's limit) are coloured at 1, the limit itself.
CLASS_LIMITS = ("instance_device:gpuio_disk_await_limit_seconds:class", "instance_device:gpuio_disk_queue_limit:class")


def chain(alert: str) -> list[str]:
    """The alert's expressions and those of every recording rule they read, transitively."""
    exprs, todo, seen = [], list(ALERTS[alert]), set()
    while todo:
        expr = todo.pop()
        exprs.append(expr)
        for name in set(RECORDING_NAME.findall(expr)) - seen:
            seen.add(name)
            todo.extend(RECORDED.get(name, []))
    return exprs


def compared(alert: str) -> set[float]:
    return {float(number) for expr in chain(alert) for number in COMPARED.findall(expr)}


def panels(board: dict) -> list[dict]:
    out = []
    for panel in board["panels"]:
        out.append(panel)
        out.extend(panel.get("panels", []))
    return out


def limits(panel: dict) -> list[float]:
    """Every threshold step with a value (the base step has none) on the panel, defaults and overrides."""
    configs = [panel.get("fieldConfig", {}).get("defaults", {}).get("thresholds")]
    for field in panel.get("fieldConfig", {}).get("overrides", []):
        configs += [prop["value"] for prop in field["properties"] if prop["id"] == "thresholds"]
    return [step["value"] for config in configs if config for step in config["steps"] if step["value"] is not None]


def counts_things(panel: dict) -> bool:
    """A count of engines, disks or nodes in an alert's state: red from one on ("any")."""
    unit = panel.get("fieldConfig", {}).get("defaults", {}).get("unit")
    exprs = [target.get("expr", "") for target in panel.get("targets", [])]
    return unit == "short" and bool(exprs) and all(re.search(r"\b(count|sum)\b", expr) for expr in exprs)


def limited_panels() -> list[tuple[str, dict]]:
    return [(name, panel) for name, board in sorted(BOARDS.items()) for panel in panels(board) if limits(panel)]


def test_every_limit_on_a_board_is_a_limit_of_an_alert_the_panel_names() -> None:
    wrong = []
    for name, panel in limited_panels():
        named = [alert for alert in ALERTS if re.search(rf"\b{alert}\b", panel.get("description", ""))]
        exprs = " ".join(target.get("expr", "") for target in panel.get("targets", []))
        allowed = set().union(*(compared(alert) for alert in named)) if named else set()
        if any(limit in exprs for limit in CLASS_LIMITS) or counts_things(panel):
            allowed.add(1.0)
        for value in limits(panel):
            if not named or value not in allowed:
                wrong.append(f"{name} / {panel['title']}: {value} (alerts named: {named or 'none'}; "
                             f"their limits: {sorted(allowed)})")
    assert wrong == []


def test_the_alert_limits_on_call_reads_are_on_the_boards() -> None:
    """The limits of the starvation and storm alerts, and of the staleness alerts that blind them."""
    drawn = {value for _, panel in limited_panels() for value in limits(panel)}
    expected = {DEFAULT.GPU_BUSY_LOW, DEFAULT.IO_PRESSURE_SOME, DEFAULT.IO_PRESSURE_FULL,
                DEFAULT.ENGINE_POOL_WAIT_SECONDS,
                DEFAULT.ENGINE_LOAD_SLOW_SECONDS, DEFAULT.GPU_STALE_AFTER_SECONDS, DEFAULT.SMART_STALE_AFTER_SECONDS,
                DEFAULT.GPU_THROTTLE_RATIO}
    assert expected - drawn == set()


def test_a_limit_typed_into_a_board_is_caught() -> None:
    """The check above is not vacuous: GPU busy coloured at 27 % (the rules say 30 %) is reported."""
    board = next(board for board in BOARDS.values() if any("GPU busy" in p["title"] and limits(p)
                                                           for p in panels(board)))
    panel = next(p for p in panels(board) if "GPU busy" in p["title"] and limits(p))
    named = [alert for alert in ALERTS if re.search(rf"\b{alert}\b", panel["description"])]
    assert named and DEFAULT.GPU_BUSY_LOW in set().union(*(compared(alert) for alert in named))
    assert 0.27 not in set().union(*(compared(alert) for alert in named))
