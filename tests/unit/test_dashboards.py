"""dashboards/*.json: current with the Python that generates them, and built the way gpuio's boards are.

The queries are run against a real Prometheus in tests/e2e/test_prometheus_rules_dashboards.py; here
they are parsed offline by promtool (as recording rules of a throw-away rule file).
"""

from __future__ import annotations

import json
import os
import re

import pytest

pytest.importorskip("grafana_foundation_sdk", reason="grafana-foundation-sdk (Python 3.11+) is not installed")

from deploy.generate import stale  # noqa: E402
from deploy.grafana import boards  # noqa: E402
from deploy.prometheus import config as c  # noqa: E402
from deploy.prometheus import rules as r  # noqa: E402
from tests.conftest import catalogued  # noqa: E402

BOARDS = {uid: json.loads(text) for uid, text in
          ((os.path.basename(path)[:-5], text) for path, text in boards.rendered().items())}
RANGE = re.compile(r"\[([^\]]+)\]")


def panels(board: dict) -> list[dict]:
    out = []
    for panel in board["panels"]:
        out.append(panel)
        out.extend(panel.get("panels", []))
    return out


def exprs(board: dict) -> list[str]:
    return [target["expr"] for panel in panels(board) for target in panel.get("targets", [])]


def test_checked_in_json_matches_the_generator() -> None:
    """CI's drift check: dashboards/*.json are exactly what `make generate` writes."""
    assert stale() == [], "run `make generate` and commit the result"


def test_generation_is_deterministic() -> None:
    assert boards.rendered() == boards.rendered()


@pytest.mark.parametrize("uid", sorted(BOARDS))
def test_board_identity_variables_and_links(uid: str) -> None:
    board = BOARDS[uid]
    assert board["uid"] == uid and uid in boards.TITLES
    assert board["title"] == boards.TITLES[uid]
    assert c.DASHBOARD_TAG in board["tags"]
    variables = {variable["name"]: variable for variable in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert variables["instance"]["type"] == "query"
    # links to the other gpuio boards (by tag), keeping time range and variables
    (link,) = board["links"]
    assert link["type"] == "dashboards" and link["tags"] == [c.DASHBOARD_TAG]
    assert link["includeVars"] and link["keepTime"]


@pytest.mark.parametrize("uid", sorted(BOARDS))
def test_panels_use_the_datasource_variable_the_node_and_rate_interval(uid: str) -> None:
    board = BOARDS[uid]
    ids = [panel["id"] for panel in panels(board)]
    assert len(ids) == len(set(ids))
    for panel in panels(board):
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel.get("description"), f"{panel['title']}: a panel says what it shows"
        refs = [target["refId"] for target in panel["targets"]]
        assert len(refs) == len(set(refs)) and all(refs)
        for target in panel["targets"]:
            expr = target["expr"]
            assert c.DEFAULT.SELECTOR in expr or expr.startswith("ALERTS{"), (panel["title"], expr)
            assert f'{c.DEFAULT.NODE_LABEL}=~"$instance"' in expr, (panel["title"], expr)
            # raw counters go through rate() over $__rate_interval, never a fixed window; a total over the board's
            # whole time range (an instant query's increase() over $__range: GPU-hours) is no fixed window either
            ranges = set(RANGE.findall(expr))
            if target.get("instant") and re.search(r"\bincrease\([^\[]*\[\$__range\]\)", expr):
                ranges -= {"$__range"}
            assert ranges <= {"$__rate_interval"}, (panel["title"], expr)


@pytest.mark.parametrize("uid", sorted(BOARDS))
def test_panels_fit_the_grid(uid: str) -> None:
    """Every panel inside Grafana's 24 columns (a panel past the edge is moved, and the layout with it)."""
    assert [panel["title"] for panel in panels(BOARDS[uid])
            if panel["gridPos"]["x"] + panel["gridPos"]["w"] > 24] == []


@pytest.mark.parametrize("uid", sorted(BOARDS))
def test_divisions_are_guarded(uid: str) -> None:
    """Every ``a / b`` divides by ``(b > 0)``: an idle device has no series rather than NaN."""
    for expr in exprs(BOARDS[uid]):
        for denominator in expr.split("\n/\n")[1:]:
            assert denominator.startswith("(") and " > 0)" in denominator, expr


def test_every_metric_used_is_documented() -> None:
    """Panels use only declared families (the catalogue; docs/metrics.md lists the same), and recording rules
    that deploy/prometheus defines."""
    documented = catalogued()
    recorded = {rule["record"] for content in r.rule_files().values() for group in content["groups"]
                for rule in group["rules"] if "record" in rule}
    for board in BOARDS.values():
        text = " ".join(exprs(board) + [annotation["expr"] for annotation in board["annotations"]["list"]])
        raw = {re.sub(r"_(bucket|sum|count)$", "", name) for name in re.findall(r"(?<![:\w])gpuio_[a-z_]+", text)}
        assert raw - documented == set()
        assert set(re.findall(r"\b[a-z_]+:[a-z0-9_]+:[a-z0-9_]+", text)) - recorded == set()


def test_buckets_are_read_only_of_the_histograms_served_with_buckets() -> None:
    """The exporter serves the buckets of DEFAULT_BUCKETED only (the other engine histograms as _count and
    _sum): every bucket a board, a rule or `gpuio top` reads is of one of those, and each of those is read."""
    from deploy.prometheus.generate import rendered
    from exporter.collectors.engines import DEFAULT_BUCKETED
    from exporter.tools.top import data, iostat
    texts = [expr for board in BOARDS.values() for expr in exprs(board)] + list(rendered().values())
    read = {name for text in texts for name in re.findall(r"(gpuio_engine_[a-z_]+)_bucket", text)}
    with open(iostat.__file__, encoding="utf-8") as source:
        top = re.findall(r"_bucket_increase\(\w+, \w+, (\w+)\)", source.read())
    assert top, "gpuio top reads a histogram's buckets through _bucket_increase()"
    read |= {getattr(data, constant) for constant in top}
    assert read == set(DEFAULT_BUCKETED)


def test_disk_io_board_has_the_iostat_figures() -> None:
    titles = " ".join(panel["title"] for panel in panels(BOARDS[c.DISK_IO_UID]))
    for figure in ("r/s", "w/s", "rkB/s", "wkB/s", "r_await", "w_await", "aqu-sz", "%util", "IO pressure"):
        assert figure in titles


