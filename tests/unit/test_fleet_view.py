"""deploy/fleet_view.py: the series the Fleet board reads, read off its queries, are what a cell forwards
(fleet-keep.yml).  That victoria-metrics' and Prometheus' relabeling accept the file and keep exactly those:
tests/e2e/test_fleet_keep.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from deploy import fleet_view
from deploy.prometheus.sources import rule_files
from exporter import catalogue


def test_a_querys_series_are_its_selectors_names_and_nothing_else() -> None:
    expr = ('sum by (namespace, state) (increase(a_seconds_total{job="gpuio",cluster=~"$cluster"}[$__range]))'
            ' / on (instance) group_left (engine) topk(5, b:c:rate1m offset 5m) > bool 0.5'
            ' and label_replace(count(c_info), "dst", "$1", "src", "(.+)") unless vector(0)'
            ' or sum(rate(d_bucket{le="+Inf"}[5m])) without (le) or time() > ${threshold}')
    assert fleet_view.series_read(expr) == {"a_seconds_total", "b:c:rate1m", "c_info", "d_bucket"}
    assert fleet_view.series_read('x @ ${__to:date:seconds} # y\n atan2 {__name__="z"} limit 3') == {"x", "z"}
    with pytest.raises(ValueError, match="pattern of names"):
        fleet_view.series_read('{__name__=~"gpuio_.+"}')


def test_a_boards_annotations_and_variables_read_series_too() -> None:
    board = {"panels": [{"panels": [{"targets": [{"expr": "x_total"}]}]}],
             "annotations": {"list": [{"expr": 'ALERTS{alertstate="firing"}'}, {"builtIn": 1}]},
             "templating": {"list": [
                 {"type": "query", "query": {"query": 'label_values(up_info{job="gpuio",a=~"$a"}, instance)'}},
                 {"type": "query", "query": "label_values(cluster)"},
                 {"type": "query", "query": "query_result(count by (b) (b_total))"},
                 {"type": "datasource", "query": "prometheus"}]}}
    assert {name for expr in fleet_view.board_queries(board) for name in fleet_view.series_read(expr)} == \
        {"x_total", "ALERTS", "up_info", "b_total"}


def every_series_name() -> list[str]:
    """One name for every family gpuio serves (as its samples are named), every series its rules record,
    and ALERTS (what the rule engine writes of the alerts)."""
    recorded = {rule["record"] for content in rule_files().values() for group in content["groups"]
                for rule in group["rules"] if "record" in rule}
    served = set()
    for name in catalogue.names():
        histogram = catalogue.by_name(name).kind == "histogram"  # a counter's name ends in _total already
        served |= {f"{name}_bucket", f"{name}_sum", f"{name}_count"} if histogram else {name}
    return sorted(recorded | served | {"ALERTS"})


def test_the_shipped_keep_list_names_only_series_gpuio_serves_or_records() -> None:
    """Every name kept is a family the exporter serves, a series gpuio's rules record, or ALERTS: a label or
    a function read as a series would be a name nothing sends."""
    (step,) = yaml.safe_load(Path(fleet_view.PATH).read_text())
    kept = step["regex"].split("|")
    assert step["action"] == "keep" and step["source_labels"] == ["__name__"]
    assert kept and not set(kept) - set(every_series_name())
    # what the Fleet board's GPU-time row, its node variables and its alert annotation read is among them
    assert {"gpuio_gpu_time_seconds_total", "gpuio_pod_gpu_time_seconds_total",
            "gpuio_scrape_collector_success", "ALERTS"} <= set(kept)
