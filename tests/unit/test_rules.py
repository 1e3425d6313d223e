"""gpuio's Prometheus rules: generated files current, valid for promtool, unit-tested, complete.

The scenario tests themselves (each alert firing on its scenario, quiet on its look-alikes) live in
deploy/prometheus/tests/*.yml and run here through ``promtool test rules`` (Debian ``prometheus``).
"""

from __future__ import annotations

import dataclasses
import glob
import os
import re

import pytest
import yaml

from deploy.prometheus import config as c
from deploy.prometheus import generate, sources
from deploy.prometheus import rules as r
from deploy.prometheus.config import DEFAULT
from tests.conftest import REPO, catalogued

RULES_DIR = os.path.join(REPO, "deploy", "prometheus", "rules")
TESTS_DIR = os.path.join(REPO, "deploy", "prometheus", "tests")
RULE_FILES = sorted(glob.glob(os.path.join(RULES_DIR, "*.yml")))
TEST_FILES = sorted(glob.glob(os.path.join(TESTS_DIR, "*.yml")))
RECORD_NAME = re.compile(r"^[a-z]+(_[a-z]+)*:[a-z0-9_]+:[a-z0-9_]+$")  # level:metric:operations


def test_rule_files_match_their_source() -> None:
    """CI's drift check: the checked-in rules/*.yml are what config.py and sources/ generate."""
    assert generate.stale() == [], "run `make generate` and commit the result"


def test_default_links_are_paths_that_exist_not_a_guessed_host() -> None:
    """Without a configured wiki or Grafana, runbook_url is the runbook's path in this repository and
    dashboard_url the board's path on the user's Grafana: nothing points at a host gpuio made up."""
    for alert in r.alerts():
        runbook, board = alert["annotations"]["runbook_url"], alert["annotations"]["dashboard_url"]
        assert os.path.isfile(os.path.join(REPO, runbook)), runbook
        assert board.startswith("/d/"), board


def test_every_alert_takes_its_links_from_the_config() -> None:
    """One helper writes every alert: set the two bases once and all alerts of all sources follow."""
    mine = dataclasses.replace(c.DEFAULT, RUNBOOK_URL="https://wiki.example.com/ops/{alert}",
                               GRAFANA_URL="https://grafana.example.com/")
    alerts = sources.alerts(mine)
    assert len(alerts) == len(r.alerts()) > 0
    for alert in alerts:
        annotations = alert["annotations"]
        assert annotations["runbook_url"] == f"https://wiki.example.com/ops/{alert['alert']}"
        assert annotations["dashboard_url"].startswith("https://grafana.example.com/d/gpuio-")
    with pytest.raises(ValueError, match="alert"):
        dataclasses.replace(c.DEFAULT, RUNBOOK_URL="https://wiki.example.com/ops/")


def test_config_is_immutable_and_a_variant_leaves_the_default_alone() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        DEFAULT.STORM_FOR = "10s"  # type: ignore[misc]
    variant = dataclasses.replace(c.DEFAULT, STORM_FOR="10s", RATE_WINDOW="10s")
    storm = [a for a in sources.alerts(variant) if a["alert"] == "DiskIOStorm" and a["labels"]["severity"] == "warning"]
    assert storm[0]["for"] == "10s"
    assert storm[0]["expr"].startswith("instance_device:gpuio_disk_storm_await_seconds:max_rate10s\n")
    assert DEFAULT.STORM_FOR == "5m" and r.NAMES.STORM.endswith(":max_rate1m")


def test_recording_rule_names_follow_level_metric_operations() -> None:
    rules = [rule for group in all_groups() for rule in group["rules"] if "record" in rule]
    assert rules
    assert [rule["record"] for rule in rules if not RECORD_NAME.match(rule["record"])] == []
    # one name may hold several series sets told apart by labels (the latency quantiles), never twice the same
    keys = [(rule["record"], tuple(sorted(rule.get("labels", {}).items()))) for rule in rules]
    assert len(keys) == len(set(keys))


@pytest.mark.parametrize("alert", r.alerts(), ids=lambda alert: alert["alert"])
def test_alert_has_severity_summary_description_runbook_and_dashboard(alert: dict) -> None:
    name = alert["alert"]
    assert alert["labels"]["severity"] in c.SEVERITIES
    annotations = alert["annotations"]
    assert set(annotations) >= {"summary", "description", "runbook_url", "dashboard_url"}
    # summary and description name the objects: the node at least, from the alert's own labels
    for key in ("summary", "description"):
        assert f"$labels.{DEFAULT.NODE_LABEL}" in annotations[key], key
    assert annotations["runbook_url"] == f"docs/runbooks/{name}.md"
    runbook = os.path.join(REPO, "docs", "runbooks", f"{name}.md")
    assert os.path.isfile(runbook), f"{name} has no runbook at docs/runbooks/{name}.md"
    with open(runbook) as handle:
        text = handle.read()
    assert re.sub(r"\A<!--.*-->\n", "", text).startswith(f"# {name}\n")  # after the generated-file header
    uid = re.search(r"/d/([a-z0-9-]+)/", annotations["dashboard_url"])
    assert uid and uid.group(1) in c.DASHBOARD_TITLES
    assert os.path.isfile(os.path.join(REPO, "dashboards", f"{uid.group(1)}.json"))


def test_each_group_reads_only_the_groups_before_it() -> None:
    """Groups run concurrently, each reading the others' last results: the order in which they read each
    other has no cycle, and every group of the chain reads what the one before it records."""
    order = sources.evaluation_order()
    reads = sources.group_reads()
    assert sorted(order) == sorted(group["name"] for content in sources.rule_files().values()
                                   for group in content["groups"])
    for position, name in enumerate(order):
        assert reads[name] <= set(order[:position]), name
    chain = ["gpuio.inputs", "gpuio.baselines", "gpuio.starvation"]
    assert [name for name in order if name in chain] == chain


@pytest.mark.parametrize("path", TEST_FILES, ids=os.path.basename)
def test_promtool_tests_evaluate_the_groups_in_the_order_they_read_each_other(path: str) -> None:
    """Without group_eval_order promtool evaluates the groups in a random order at each timestamp, so a
    group reading another's result would see this evaluation's or the last one's by chance."""
    from deploy.prometheus.scenarios import evaluation_order_of

    with open(path, encoding="utf-8") as file:
        test = yaml.safe_load(file)
    order = evaluation_order_of(test["rule_files"])
    assert test.get("group_eval_order", order if len(order) < 2 else None) == order


def test_every_alert_has_a_firing_test_and_a_quiet_test() -> None:
    """For each alert and severity, deploy/prometheus/tests has a case where it fires and one where it must
    not: an alert_rule_test, or (the scenario suite) a check of the ALERTS series a node has firing."""
    fires: set[tuple[str, str]] = set()
    quiet: set[tuple[str, str]] = set()
    every = {(alert["alert"], alert["labels"]["severity"]) for alert in r.alerts()}
    for path in TEST_FILES:
        with open(path) as handle:
            for case in yaml.safe_load(handle)["tests"]:
                for check in case.get("alert_rule_test", []):
                    shown = {(check["alertname"], alert["exp_labels"]["severity"]) for alert in check["exp_alerts"]}
                    fires |= shown
                    quiet |= {key for key in every if key[0] == check["alertname"]} - shown
                for check in case.get("promql_expr_test", []):
                    if not check["expr"].startswith("ALERTS{"):
                        continue
                    shown = {(dict(re.findall(r'(\w+)="([^"]*)"', sample["labels"]))["alertname"],
                              dict(re.findall(r'(\w+)="([^"]*)"', sample["labels"]))["severity"])
                             for sample in check["exp_samples"]}
                    fires |= shown
                    asked = dict(re.findall(r'(\w+)="([^"]*)"', check["expr"]))
                    quiet |= {key for key in every if asked.get("alertname", key[0]) == key[0]
                              and asked.get("severity", key[1]) == key[1]} - shown
    assert every - fires == set(), "alerts never shown firing"
    assert every - quiet == set(), "alerts never shown quiet (a look-alike or a spike shorter than `for`)"


def test_alert_names_are_unique_per_severity() -> None:
    """One name may come in two severities (a storm: ticket without a victim, page with one), never twice
    in the same severity."""
    keys = [(alert["alert"], alert["labels"]["severity"]) for alert in r.alerts()]
    assert len(keys) == len(set(keys))


def test_runbook_index_lists_every_alert_with_its_severity() -> None:
    pages = {os.path.basename(path)[:-3] for path in glob.glob(os.path.join(REPO, "docs", "runbooks", "*.md"))}
    assert pages - {"README"} == {alert["alert"] for alert in r.alerts()}
    with open(os.path.join(REPO, "docs", "runbooks", "README.md")) as handle:
        index = {name: set(severities.split(", "))
                 for name, severities in re.findall(r"^\| (\w+) \| ([\w, ]+) \| \[", handle.read(), re.MULTILINE)}
    severities: dict[str, set[str]] = {}
    for alert in r.alerts():
        severities.setdefault(alert["alert"], set()).add(alert["labels"]["severity"])
    assert index == severities


def test_every_metric_used_is_documented() -> None:
    """Rules use only declared families (the catalogue; docs/metrics.md lists the same): a renamed metric fails
    here, not silently in production."""
    documented = catalogued()
    used = set()
    for group in all_groups():
        for rule in group["rules"]:
            text = rule["expr"] + " ".join(rule.get("annotations", {}).values())
            used |= {re.sub(r"_(bucket|sum|count)$", "", name) for name in re.findall(r"(?<![:\w])gpuio_[a-z_]+", text)}
    assert used - documented == set()


def all_groups() -> list[dict]:
    groups = []
    for path in RULE_FILES:
        with open(path) as handle:
            groups += yaml.safe_load(handle)["groups"]
    return groups


def pct(ratio: float) -> str:
    return f"{ratio * 100:g} %"


def ms(seconds: float) -> str:
    return f"{seconds * 1000:g} ms"


RUNBOOK_FIGURES = {
    "DiskIOStorm": [ms(c.SOLID_STATE.await_seconds), ms(c.ROTATIONAL.await_seconds),
                    f"solid state {c.SOLID_STATE.queue_size:g}, rotational {c.ROTATIONAL.queue_size:g}",
                    f"{DEFAULT.STORM_BASELINE_FACTOR:g}x", pct(DEFAULT.IO_PRESSURE_SOME), pct(DEFAULT.IO_PRESSURE_FULL),
                    f"{DEFAULT.AWAIT_MIN_IOPS:g} requests/s", f"for {DEFAULT.STORM_FOR.removesuffix('m')} minutes",
                    f"NVMe {ms(c.NVME.await_seconds)}", f"network block devices {ms(c.NETWORK.await_seconds)}",
                    f"NVMe {c.NVME.queue_size:g}", f"network block devices {c.NETWORK.queue_size:g}",
                    f"for {DEFAULT.STORM_PAGE_FOR.removesuffix('m')} minutes", pct(DEFAULT.STORM_PAGE_IO_FULL),
                    f"held for {DEFAULT.BASELINE_HOLD.removesuffix('h')} hours"],
    "GPUStarvedByDiskIO": [pct(DEFAULT.GPU_BUSY_LOW), ms(DEFAULT.ENGINE_POOL_WAIT_SECONDS),
                           f"{DEFAULT.ENGINE_LATENCY_FACTOR:g}x",
                           ms(c.SOLID_STATE.await_seconds), ms(c.ROTATIONAL.await_seconds),
                           f"NVMe {ms(c.NVME.await_seconds)}", f"network block devices {ms(c.NETWORK.await_seconds)}",
                           ms(DEFAULT.NFS_READ_RTT_SLOW_SECONDS), f"{DEFAULT.ENGINE_LOAD_SLOW_SECONDS:g} s",
                           f"older than {DEFAULT.GPU_STALE_AFTER_SECONDS} s"],
    "MountIOStorm": [ms(DEFAULT.NFS_READ_RTT_SLOW_SECONDS), f"{DEFAULT.ENGINE_LOAD_SLOW_SECONDS:g} s",
                     pct(DEFAULT.IO_PRESSURE_SOME),
                     pct(DEFAULT.IO_PRESSURE_FULL), f"{DEFAULT.AWAIT_MIN_IOPS:g} READs/s",
                     f"for {DEFAULT.STORM_PAGE_FOR.removesuffix('m')} minutes",
                     f"for {DEFAULT.STORM_FOR.removesuffix('m')} minutes"],
    "GpuioGPUDataStale": [f"older than {DEFAULT.GPU_STALE_AFTER_SECONDS} s",
                          f"For {DEFAULT.GPU_STALE_FOR.removesuffix('m')} minutes"],
    "NodeGPUStarvedByIO": [pct(DEFAULT.GPU_BUSY_LOW)],
    "EngineColdStartSlow": [f"{DEFAULT.ENGINE_LOAD_SLOW_SECONDS:g} s",
                            f"{DEFAULT.ENGINE_LOAD_WINDOW.removesuffix('m')} minutes"],
    "GPUThrottled": [pct(DEFAULT.GPU_THROTTLE_RATIO), *DEFAULT.GPU_THROTTLE_REASONS],
    "GPUPCIeLinkDegraded": [pct(DEFAULT.PCIE_GENERATION_BUSY)],
    "GPUXidError": list(DEFAULT.XID_APPLICATION),
    "GPUAllocatedIdle": [f"{pct(DEFAULT.GPU_ALLOCATED_IDLE_RATIO)} of the last "
                         f"{DEFAULT.GPU_ALLOCATED_IDLE_WINDOW.removesuffix('h')} hours",
                         f"for {DEFAULT.GPU_ALLOCATED_IDLE_FOR.removesuffix('m')} minutes on end",
                         f"busy under {pct(DEFAULT.GPU_BUSY_LOW)}",
                         f"SM activity under {pct(DEFAULT.GPU_SM_ACTIVE_LOW)}"],
}


@pytest.mark.parametrize("alert", sorted(RUNBOOK_FIGURES))
def test_runbook_quotes_the_thresholds_in_force(alert: str) -> None:
    """A runbook that says "10 ms" while config.py says otherwise misleads at 3 a.m.: keep them in step."""
    with open(os.path.join(REPO, "docs", "runbooks", f"{alert}.md")) as handle:
        text = handle.read()
    assert [figure for figure in RUNBOOK_FIGURES[alert] if figure not in text] == []
