"""Shared pieces of gpuio's dashboards: datasource, variables, selectors, panels, links, JSON output.

Selectors, dashboard uids and titles come from deploy/prometheus/config.py (the one config of rules,
alerts and dashboards); recording-rule names from deploy/prometheus/rules.py.
"""

from __future__ import annotations

import json
from collections.abc import Iterable

from grafana_foundation_sdk.builders import dashboard as db
from grafana_foundation_sdk.builders import prometheus, stat, table, timeseries
from grafana_foundation_sdk.builders.common import VizLegendOptions, VizTooltipOptions
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.common import LegendDisplayMode, LegendPlacement, SortOrder, TooltipDisplayMode
from grafana_foundation_sdk.models.dashboard import (
    DashboardCursorSync,
    DashboardLinkType,
    DataSourceRef,
    DataTransformerConfig,
    VariableHide,
    VariableRefresh,
    VariableSort,
)
from grafana_foundation_sdk.models.prometheus import PromQueryFormat

from deploy.prometheus import config as c

DATASOURCE = DataSourceRef(type_val="prometheus", uid="${datasource}")
# Every panel query: gpuio's job, the chosen node.  `$__rate_interval` in every rate(): Grafana makes it
# at least four scrape intervals, so a rate() never sees fewer than two samples.
NODE = f'{c.SELECTOR},{c.NODE_LABEL}=~"$instance"'
DEVICE = f'{NODE},device=~"$device"'
RATE = "$__rate_interval"


def sel(*matchers: str) -> str:
    return "{" + ",".join((NODE, *matchers)) + "}"


def dev(*matchers: str) -> str:
    return "{" + ",".join((DEVICE, *matchers)) + "}"


def rate(metric: str, selector: str) -> str:
    return f"rate({metric}{selector}[{RATE}])"


def guarded_ratio(numerator: str, denominator: str, selector: str) -> str:
    """rate(numerator) / rate(denominator), no series where the denominator did not move (no NaN)."""
    return f"{rate(numerator, selector)}\n/\n({rate(denominator, selector)} > 0)"


def query(expr: str, legend: str = "", ref: str = "A") -> prometheus.Dataquery:
    return prometheus.Dataquery().expr(expr).legend_format(legend or "__auto").ref_id(ref).range()


def table_query(expr: str, ref: str = "A") -> prometheus.Dataquery:
    return prometheus.Dataquery().expr(expr).ref_id(ref).instant().format(PromQueryFormat.TABLE)


def _legend() -> VizLegendOptions:
    return (VizLegendOptions().display_mode(LegendDisplayMode.TABLE).placement(LegendPlacement.BOTTOM)
            .show_legend(True).calcs(["mean", "max", "lastNotNull"]))


def graph(title: str, description: str, unit: str, *targets: prometheus.Dataquery,
          width: int = 12, height: int = 8, max_value: float | None = None) -> timeseries.Panel:
    panel = (timeseries.Panel().title(title).description(description).datasource(DATASOURCE).unit(unit)
             .span(width).height(height).legend(_legend())
             .tooltip(VizTooltipOptions().mode(TooltipDisplayMode.MULTI).sort(SortOrder.DESCENDING))
             .fill_opacity(10).line_width(1).span_nulls(False).min(0))
    if max_value is not None:
        panel = panel.max(max_value)
    for ref, target in zip("ABCDEFGH", targets, strict=False):
        panel = panel.with_target(target.ref_id(ref))
    return panel


def value_table(title: str, description: str, expr: str, hide: list[str], width: int = 24,
                height: int = 8) -> table.Panel:
    """An instant query shown as a table, one row per series, its labels as columns."""
    exclude = {name: True for name in ["Time", "Value", "__name__", *hide]}
    return (table.Panel().title(title).description(description).datasource(DATASOURCE).span(width).height(height)
            .frame_index(0).show_header(True)
            .with_target(table_query(expr))
            .with_transformation(DataTransformerConfig(id_val="organize", options={"excludeByName": exclude})))


def single_stat(title: str, description: str, expr: str, unit: str, width: int = 6, height: int = 4) -> stat.Panel:
    return (stat.Panel().title(title).description(description).datasource(DATASOURCE).unit(unit)
            .span(width).height(height).with_target(query(expr)))


def datasource_variable() -> db.DatasourceVariable:
    return db.DatasourceVariable("datasource").label("Data source").type("prometheus")


def node_variable() -> db.QueryVariable:
    # gpuio_scrape_collector_success exists on every gpuio target, whatever collectors run.
    return (db.QueryVariable("instance").label("Node").datasource(DATASOURCE)
            .query(f"label_values(gpuio_scrape_collector_success{{{c.SELECTOR}}}, {c.NODE_LABEL})")
            .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED).sort(VariableSort.ALPHABETICAL_ASC))


def device_variable() -> db.QueryVariable:
    return (db.QueryVariable("device").label("Device").datasource(DATASOURCE)
            .query(f"label_values(gpuio_disk_info{{{NODE}}}, device)")
            .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED).sort(VariableSort.ALPHABETICAL_ASC)
            .multi(True).include_all(True).all_value(".+"))


def multi_variable(name: str, label: str, metric: str, all_value: str = ".*") -> db.QueryVariable:
    """A multi-value variable over the values of label ``name`` on ``metric`` of the chosen node."""
    return (db.QueryVariable(name).label(label).datasource(DATASOURCE)
            .query(f"label_values({metric}{{{NODE}}}, {name})")
            .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED).sort(VariableSort.NUMERICAL_ASC)
            .multi(True).include_all(True).all_value(all_value))


# The gpu and engine variables, and the matchers that apply them (Starvation, GPU, Engines boards).
GPU = 'gpu=~"$gpu"'
ENGINE = 'engine=~"$engine"'


def gpu_variable() -> db.QueryVariable:
    return multi_variable("gpu", "GPU", "gpuio_gpu_info")


def engine_variable() -> db.QueryVariable:
    return multi_variable("engine", "Engine", "gpuio_engine_info")


def histogram_quantile(q: float, histogram: str, selector: str, by: str = "engine") -> str:
    """The q-quantile of a histogram family per ``by`` (and node), over $__rate_interval."""
    return (f"histogram_quantile({q:g}, sum by ({c.NODE_LABEL}, {by}, le) "
            f"({rate(histogram + '_bucket', selector)}))")


def section(dashboard: db.Dashboard, title: str, panels: list) -> db.Dashboard:
    """A row titled ``title`` followed by its panels."""
    dashboard = dashboard.with_row(db.Row(title))
    for panel in panels:
        dashboard = dashboard.with_panel(panel)
    return dashboard


def hidden(variable: db.QueryVariable) -> db.QueryVariable:
    return variable.hide(VariableHide.HIDE_VARIABLE)


def board(uid: str, description: str) -> db.Dashboard:
    """A gpuio dashboard with its uid, title, tags, time settings and links to the other boards."""
    return (db.Dashboard(c.DASHBOARD_TITLES[uid]).uid(uid).description(description).tags([c.DASHBOARD_TAG])
            .editable().tooltip(DashboardCursorSync.CROSSHAIR).refresh("30s").time("now-3h", "now")
            .timezone("browser")
            .link(db.DashboardLink("gpuio").type(DashboardLinkType.DASHBOARDS).tags([c.DASHBOARD_TAG])
                  .as_dropdown(True).include_vars(True).keep_time(True)))


def alerts_annotation() -> db.AnnotationQuery:
    """Firing alerts of the node as annotations on every graph (Prometheus' ALERTS series)."""
    return (db.AnnotationQuery().name("Firing alerts").datasource(DATASOURCE).enable(True).icon_color("red")
            .expr(f'ALERTS{{alertstate="firing",{c.NODE_LABEL}=~"$instance"}}'))


def engine_loads_annotation(selector: str) -> db.AnnotationQuery:
    """A mark where an engine finished loading (its last-load timestamp changed)."""
    return (db.AnnotationQuery().name("Engine loads").datasource(DATASOURCE).enable(True).icon_color("blue")
            .expr(f"changes(gpuio_engine_last_load_timestamp_seconds{selector}[2m]) > 0"))


def assemble(uid: str, description: str, sections: Iterable[tuple[str, list]],
             variables: Iterable[db.QueryVariable] = (),
             annotations: Iterable[db.AnnotationQuery] = ()) -> db.Dashboard:
    """A gpuio board: datasource and node variables, then ``variables``; firing alerts, then
    ``annotations``; then each (row title, panels) of ``sections``."""
    dashboard = board(uid, description).with_variable(datasource_variable()).with_variable(node_variable())
    for variable in variables:
        dashboard = dashboard.with_variable(variable)
    dashboard = dashboard.annotation(alerts_annotation())
    for annotation in annotations:
        dashboard = dashboard.annotation(annotation)
    for title, panels in sections:
        dashboard = section(dashboard, title, panels)
    return dashboard


# Fields the SDK writes on every variable that Grafana's schema knows only on interval variables (auto*)
# or not at all (id), and the dashboard's `style`, which Grafana dropped in 9 (schema 36 still had it).
_NOT_IN_GRAFANAS_SCHEMA = {"variable": ("auto", "auto_count", "auto_min", "id"), "dashboard": ("style",)}


def _drop_fields_grafana_does_not_know(model: dict) -> None:
    for name in _NOT_IN_GRAFANAS_SCHEMA["dashboard"]:
        model.pop(name, None)
    for variable in model.get("templating", {}).get("list", []):
        if variable.get("type") != "interval":
            for name in _NOT_IN_GRAFANAS_SCHEMA["variable"]:
                variable.pop(name, None)


def render(dashboard: db.Dashboard) -> str:
    """Stable JSON text: panels numbered in order, keys sorted, a trailing newline; only fields Grafana's
    dashboard schema knows (tests/unit/test_dashboard_schema.py checks it against @grafana/schema)."""
    model = json.loads(JSONEncoder(sort_keys=True).encode(dashboard.build()))
    _drop_fields_grafana_does_not_know(model)
    number = 1
    for panel in model.get("panels", []):
        panel["id"] = number
        number += 1
        for inner in panel.get("panels", []):
            inner["id"] = number
            number += 1
    return json.dumps(model, indent=2, sort_keys=True) + "\n"
