"""Shared pieces of gpuio's dashboards: datasource, variables, selectors, panels, links, JSON output.

Every board is built from one ``Config`` (deploy/prometheus/config.py, the config of the rules too):
the helpers that write a selector or a threshold take it as their first argument, so a variant of the
config reaches the panels exactly as it reaches the alerts.  Recording-rule names come from
``names(config)`` (deploy/prometheus/sources/names.py), the names the rules record under that config.
"""

from __future__ import annotations

import json
from collections.abc import Iterable

from grafana_foundation_sdk.builders import dashboard as db
from grafana_foundation_sdk.builders import prometheus, stat, statetimeline, table, timeseries
from grafana_foundation_sdk.builders.common import (
    GraphThresholdsStyleConfig,
    ReduceDataOptions,
    VizLegendOptions,
    VizTooltipOptions,
)
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.common import (
    BigValueColorMode,
    BigValueGraphMode,
    GraphTresholdsStyleMode,
    LegendDisplayMode,
    LegendPlacement,
    SortOrder,
    TooltipDisplayMode,
    VisibilityMode,
)
from grafana_foundation_sdk.models.dashboard import (
    DashboardCursorSync,
    DashboardLinkType,
    DataSourceRef,
    DataTransformerConfig,
    DynamicConfigValue,
    FieldColorModeId,
    MatcherConfig,
    Threshold,
    ThresholdsMode,
    ValueMap,
    ValueMappingResult,
    VariableHide,
    VariableOption,
    VariableRefresh,
    VariableSort,
)
from grafana_foundation_sdk.models.prometheus import PromQueryFormat

from ...prometheus.config import DASHBOARD_TAG, DASHBOARD_TITLES, Config
from ...prometheus.sources.names import names

DATASOURCE = DataSourceRef(type_val="prometheus", uid="${datasource}")
# The label that names a Prometheus (or a cluster) where one Grafana looks at several, the mixins'
# convention: set as an external label, or added by the federation or remote-write that gathers them.
# A matcher `cluster=~".*"` also matches series that have no such label, so one Prometheus needs nothing.
CLUSTER_LABEL = "cluster"
CLUSTER = f'{CLUSTER_LABEL}=~"$cluster"'
# Every panel query: gpuio's job, the chosen cluster and node.  `$__rate_interval` in every rate():
# Grafana makes it at least four scrape intervals, so a rate() never sees fewer than two samples.
RATE = "$__rate_interval"
DEVICE = 'device=~"$device"'


def sel(config: Config, *matchers: str) -> str:
    """``{job="gpuio",cluster=~"$cluster",instance=~"$instance",...}``: the chosen node, plus ``matchers``."""
    return config.selector(CLUSTER, f'{config.NODE_LABEL}=~"$instance"', *matchers)


def dev(config: Config, *matchers: str) -> str:
    """``sel`` narrowed to the devices chosen in $device."""
    return sel(config, DEVICE, *matchers)


def rate(metric: str, selector: str) -> str:
    return f"rate({metric}{selector}[{RATE}])"


def guarded_ratio(numerator: str, denominator: str, selector: str) -> str:
    """rate(numerator) / rate(denominator), no series where the denominator did not move (no NaN)."""
    return f"{rate(numerator, selector)}\n/\n({rate(denominator, selector)} > 0)"


# The disk counters come from gpuio's diskstats collector or, where it is off beside a node_exporter
# (node_exporter mode, docs/deploy.md), from node_exporter's twins of the same node, whatever its job:
# the boards need no setting for either, and show gpuio's where both exist.
def disk_series(config: Config, name: str, device: bool = True, rated: bool = True) -> str:
    """gpuio_disk_<name>, or node_disk_<name> for the nodes and devices gpuio serves none of; rate()d
    where ``rated``.  ``device``: only the devices chosen in $device (else all of the node's)."""
    mine = dev(config) if device else sel(config)
    theirs = "{" + ",".join((CLUSTER, f'{config.NODE_LABEL}=~"$instance"', *((DEVICE,) if device else ()))) + "}"

    def series(metric: str, selector: str) -> str:
        return rate(metric, selector) if rated else metric + selector

    return (f"{series('gpuio_disk_' + name, mine)}\nor on ({CLUSTER_LABEL}, {config.NODE_LABEL}, device)\n"
            f"{series('node_disk_' + name, theirs)}")


def disk_ratio(config: Config, numerator: str, denominator: str, device: bool = True) -> str:
    """rate(numerator) / rate(denominator) of two disk counters (``disk_series``), no series where the
    denominator did not move."""
    return f"(\n{disk_series(config, numerator, device)}\n)\n/\n((\n{disk_series(config, denominator, device)}\n) > 0)"


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


# --- colours, thresholds, value mappings ------------------------------------------------------------
OK, INFO, WARN, BAD, UNKNOWN = "green", "blue", "orange", "red", "purple"


def limit(value: float, below: bool = False) -> db.ThresholdsConfig:
    """Green on one side of an alert's limit, red from it on (red *under* it when ``below``).  Pass the
    number the rule uses (deploy/prometheus/config.py): tests/unit/test_dashboard_thresholds.py checks
    that each board's limit is a constant of the alert its panel names."""
    steps = [Threshold(None, BAD), Threshold(value, OK)] if below else [Threshold(None, OK), Threshold(value, BAD)]
    return db.ThresholdsConfig().mode(ThresholdsMode.ABSOLUTE).steps(steps)


def no_limit() -> db.ThresholdsConfig:
    return db.ThresholdsConfig().mode(ThresholdsMode.ABSOLUTE).steps([Threshold(None, OK)])


def states(*values: tuple[float, str, str]) -> list:
    """A value mapping of a state series: (value, text, colour) for each value it takes."""
    return [ValueMap({f"{value:g}": ValueMappingResult(text=text, color=color, index=index)
                      for index, (value, text, color) in enumerate(values)})]


UP = states((0, "down", BAD), (1, "up", OK))


def state_set(config: Config, metric: str, selector: str, by: str,
              values: list[tuple[str, str]]) -> tuple[str, list]:
    """A state-set family (one series per state, 1 for the current one) as one series per ``by`` whose
    value codes the current state (1, 2, ... in the order of ``values``: (state, colour)), and the value
    mapping that names and colours the codes."""
    terms = [f'{code} * {metric}{selector[:-1]},state="{state}"}}' for code, (state, _) in enumerate(values, 1)]
    expr = f"max by ({config.NODE_LABEL}, {by}) (\n  " + "\n  or ".join(terms) + "\n) > 0"
    return expr, states(*((code, state, colour) for code, (state, colour) in enumerate(values, 1)))


# gpuio_scrape_collector_state, its states and their colours (exporter/scrape docs).
COLLECTOR_STATES = [("ok", OK), ("absent", INFO), ("pending", INFO), ("stale", WARN), ("failing", BAD)]


def collector_states(config: Config, width: int = 12, height: int = 6) -> statetimeline.Panel:
    expr, mappings = state_set(config, "gpuio_scrape_collector_state", sel(config), "collector", COLLECTOR_STATES)
    return timeline("Collectors", "State of each collector at each scrape: ok; absent (no such source on this "
                    "node: not a failure); pending (its first background read has not finished); stale (its "
                    "background data is older than it should be: values shown are old); failing (it failed in "
                    "this scrape; GpuioCollectorFailing fires when most scrapes fail). A hole: no scrape.",
                    query(expr, "{{collector}}"), mappings=mappings, width=width, height=height)
PASSED = states((0, "FAILED", BAD), (1, "passed", OK))


def threshold_lines(panel: timeseries.Panel, thresholds: db.ThresholdsConfig) -> timeseries.Panel:
    """A time series with its limit drawn as a dashed line and the area past it shaded."""
    return (panel.thresholds(thresholds).color_scheme(db.FieldColor().mode(FieldColorModeId.PALETTE_CLASSIC))
            .thresholds_style(GraphThresholdsStyleConfig().mode(GraphTresholdsStyleMode.DASHED_AND_AREA)))


def series_limits(panel: timeseries.Panel, limits: dict[str, db.ThresholdsConfig]) -> timeseries.Panel:
    """A time series whose series (by display name) each have their own limit, drawn as a dashed line."""
    panel = panel.color_scheme(db.FieldColor().mode(FieldColorModeId.PALETTE_CLASSIC))
    for name, thresholds in limits.items():
        matcher, properties = override(name, thresholds=thresholds.build(),
                                       custom_thresholdsStyle={"mode": GraphTresholdsStyleMode.DASHED.value})
        panel = panel.with_override(matcher, properties)
    return panel


def timeline(title: str, description: str, *targets: prometheus.Dataquery, mappings: list,
             width: int = 12, height: int = 8, thresholds: db.ThresholdsConfig | None = None) -> statetimeline.Panel:
    """A state timeline: one lane per series, each value coloured by ``mappings`` (else ``thresholds``)."""
    panel = (statetimeline.Panel().title(title).description(description).datasource(DATASOURCE).span(width)
             .height(height).mappings(mappings).show_value(VisibilityMode.NEVER).merge_values(True).row_height(0.9)
             .legend(VizLegendOptions().display_mode(LegendDisplayMode.LIST).placement(LegendPlacement.BOTTOM)
                     .show_legend(True))
             .tooltip(VizTooltipOptions().mode(TooltipDisplayMode.SINGLE).sort(SortOrder.NONE))
             .color_scheme(db.FieldColor().mode(FieldColorModeId.THRESHOLDS if thresholds else FieldColorModeId.FIXED))
             .thresholds(thresholds or no_limit()).fill_opacity(80).line_width(0))
    for ref, target in zip("ABCDEFGH", targets, strict=False):
        panel = panel.with_target(target.ref_id(ref))
    return panel


def big_number(title: str, description: str, expr: str, unit: str, thresholds: db.ThresholdsConfig,
               mappings: list | None = None, width: int = 4, height: int = 4, legend: str = "") -> stat.Panel:
    """A stat: the last value of each series, its background coloured by ``thresholds`` or ``mappings``."""
    return (stat.Panel().title(title).description(description).datasource(DATASOURCE).unit(unit).span(width)
            .height(height).with_target(query(expr, legend)).thresholds(thresholds).mappings(mappings or [])
            .color_scheme(db.FieldColor().mode(FieldColorModeId.THRESHOLDS)).color_mode(BigValueColorMode.BACKGROUND)
            .graph_mode(BigValueGraphMode.AREA)
            .reduce_options(ReduceDataOptions().calcs(["lastNotNull"]).values(False)))


def override(field: str, **properties: object) -> tuple[MatcherConfig, list[DynamicConfigValue]]:
    """Properties for the field (a table column, a series) named ``field``, or matching ``/regex/``."""
    matcher = "byRegexp" if len(field) > 1 and field.startswith("/") and field.endswith("/") else "byName"
    return (MatcherConfig(id_val=matcher, options=field),
            [DynamicConfigValue(id_val=key.replace("_", "."), value=value) for key, value in properties.items()])


def datasource_variable() -> db.DatasourceVariable:
    return db.DatasourceVariable("datasource").label("Data source").type("prometheus")


def cluster_variable(config: Config) -> db.QueryVariable:
    """The cluster (or Prometheus) to look at.  Hidden: with one Prometheus it has one value or none, and
    "All" (``.*``) matches series without the label; where one Grafana sees several, un-hide it in
    Grafana's variable settings, or generate with ``--set MULTI_CLUSTER=true``)."""
    variable = (db.QueryVariable("cluster").label("Cluster").datasource(DATASOURCE)
                .query(f"label_values(gpuio_scrape_collector_success{{{config.SELECTOR}}}, {CLUSTER_LABEL})")
                .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED).sort(VariableSort.ALPHABETICAL_ASC)
                .include_all(True).all_value(".*"))
    return variable if config.MULTI_CLUSTER else variable.hide(VariableHide.HIDE_VARIABLE)


def node_variable(config: Config) -> db.QueryVariable:
    # gpuio_scrape_collector_success exists on every gpuio target, whatever collectors run.
    return (db.QueryVariable("instance").label("Node").datasource(DATASOURCE)
            .query(f"label_values(gpuio_scrape_collector_success{{{config.SELECTOR},{CLUSTER}}}, {config.NODE_LABEL})")
            .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED).sort(VariableSort.ALPHABETICAL_ASC))


def device_variable(config: Config) -> db.QueryVariable:
    return (db.QueryVariable("device").label("Device").datasource(DATASOURCE)
            # The recorded class exists whichever exporter reads the disks (node_exporter mode).
            .query(f"label_values({names(config).DISK_CLASS}{sel(config)}, device)")
            .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED).sort(VariableSort.ALPHABETICAL_ASC)
            .multi(True).include_all(True).all_value(".+"))


def multi_variable(config: Config, name: str, label: str, metric: str, all_value: str = ".*") -> db.QueryVariable:
    """A multi-value variable over the values of label ``name`` on ``metric`` of the chosen node."""
    return (db.QueryVariable(name).label(label).datasource(DATASOURCE)
            .query(f"label_values({metric}{sel(config)}, {name})")
            .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED).sort(VariableSort.NUMERICAL_ASC)
            .multi(True).include_all(True).all_value(all_value))


# The gpu and engine variables, and the matchers that apply them (Starvation, GPU, Engines boards).
GPU = 'gpu=~"$gpu"'
ENGINE = 'engine=~"$engine"'


def pods_of(config: Config, metric: str, on: str, pod_info: str) -> str:
    """``metric`` of the chosen node, narrowed to the chosen namespace and pod where ``pod_info`` (the
    kubelet's or the processes' word on which pod holds what) names any: a node outside Kubernetes, or
    one where the pod collector does not run, keeps all of them."""
    node, label = sel(config), config.NODE_LABEL
    return (f"({metric}{node} and on ({label}, {on}) {pod_info}{sel(config, NAMESPACE, POD)})"
            f" or ({metric}{node} unless on ({label}) {pod_info}{node})")


NAMESPACE = 'namespace=~"$namespace"'
POD = 'pod=~"$pod"'
GPU_PODS = "gpuio_gpu_pod_info"
ENGINE_PODS = "gpuio_engine_pod_info"


def namespace_variable(config: Config, pod_info: str) -> db.QueryVariable:
    """Kubernetes namespaces of the pods on the node (empty, "All", outside Kubernetes)."""
    return multi_variable(config, "namespace", "Namespace", pod_info)


def pod_variable(config: Config, pod_info: str) -> db.QueryVariable:
    return (multi_variable(config, "pod", "Pod", pod_info)
            .query(f"label_values({pod_info}{sel(config, NAMESPACE)}, pod)").sort(VariableSort.ALPHABETICAL_ASC))


def gpu_variable(config: Config, by_pod: bool = False) -> db.QueryVariable:
    variable = multi_variable(config, "gpu", "GPU", "gpuio_gpu_info")
    if by_pod:
        # label_values() takes a series selector only: a query over an expression goes through query_result()
        variable = (variable.query(f"query_result({pods_of(config, 'gpuio_gpu_info', 'uuid', GPU_PODS)})")
                    .regex('/\\bgpu="([^"]+)"/'))
    return variable


def engine_variable(config: Config, by_pod: bool = False) -> db.QueryVariable:
    variable = multi_variable(config, "engine", "Engine", "gpuio_engine_info")
    if by_pod:
        variable = (variable.query(f"query_result({pods_of(config, 'gpuio_engine_info', 'engine', ENGINE_PODS)})")
                    .regex('/\\bengine="([^"]+)"/'))
    return variable


def histogram_quantile(config: Config, q: float, histogram: str, selector: str, by: str = "engine") -> str:
    """The q-quantile of a histogram family per ``by`` (and node), over $__rate_interval."""
    return (f"histogram_quantile({q:g}, sum by ({config.NODE_LABEL}, {by}, le) "
            f"({rate(histogram + '_bucket', selector)}))")


def section(dashboard: db.Dashboard, title: str, panels: list) -> db.Dashboard:
    """A row titled ``title`` followed by its panels."""
    dashboard = dashboard.with_row(db.Row(title))
    for panel in panels:
        dashboard = dashboard.with_panel(panel)
    return dashboard


def board(uid: str, description: str, title: str = "") -> db.Dashboard:
    """A gpuio dashboard with its uid, title, tags, time settings and links to the other boards."""
    return (db.Dashboard(title or DASHBOARD_TITLES[uid]).uid(uid).description(description).tags([DASHBOARD_TAG])
            .editable().tooltip(DashboardCursorSync.CROSSHAIR).refresh("30s").time("now-3h", "now")
            .timezone("browser")
            .link(db.DashboardLink("gpuio").type(DashboardLinkType.DASHBOARDS).tags([DASHBOARD_TAG])
                  .as_dropdown(True).include_vars(True).keep_time(True)))


def alerts_annotation(config: Config) -> db.AnnotationQuery:
    """Firing alerts of the node as annotations on every graph (Prometheus' ALERTS series)."""
    return (db.AnnotationQuery().name("Firing alerts").datasource(DATASOURCE).enable(True).icon_color("red")
            .expr(f'ALERTS{{alertstate="firing",{config.NODE_LABEL}=~"$instance"}}'))


def engine_loads_annotation(selector: str) -> db.AnnotationQuery:
    """A mark where an engine finished loading (its last-load timestamp changed)."""
    return (db.AnnotationQuery().name("Engine loads").datasource(DATASOURCE).enable(True).icon_color("blue")
            .expr(f"changes(gpuio_engine_last_load_timestamp_seconds{selector}[2m]) > 0"))


def assemble(config: Config, uid: str, description: str, sections: Iterable[tuple[str, list]],
             variables: Iterable[db.QueryVariable] = (),
             annotations: Iterable[db.AnnotationQuery] = (), title: str = "", all_nodes: bool = False) -> db.Dashboard:
    """A gpuio board: datasource, cluster and node variables (one node, or any and all with ``all_nodes``),
    then ``variables``; firing alerts, then ``annotations``; then each (row title, panels) of ``sections``."""
    nodes = node_variable(config)
    if all_nodes:
        nodes = nodes.multi(True).include_all(True).all_value(".+").current(
            VariableOption(selected=True, text="All", value="$__all"))
    dashboard = (board(uid, description, title).with_variable(datasource_variable())
                 .with_variable(cluster_variable(config)).with_variable(nodes))
    for variable in variables:
        dashboard = dashboard.with_variable(variable)
    dashboard = dashboard.annotation(alerts_annotation(config))
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
    for panel in model.get("panels", []):
        # The heatmap's tooltip changed shape in Grafana 11 (`show` became `mode`): each version's schema
        # rejects the other's, and both default it, so the boards leave it to the Grafana that loads them.
        if panel.get("type") == "heatmap":
            panel.get("options", {}).pop("tooltip", None)
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
