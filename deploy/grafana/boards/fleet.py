"""gpuio / Fleet: which nodes starve and storm, and where engines cold-start, across the fleet.

The storms gpuio pages on hit many nodes at once (a deploy wave across a cluster, a shared model store
slowing down): this board looks across every node of the chosen cluster (all nodes by default) where the
Starvation board looks at one.  Top: how many engines on how many nodes are starved now, how many disks
storm, how many loads run; then the nodes ranked by starvation and by storm (click one for its
Starvation board), a heat map of disk saturation across the nodes over time, which engines cold-start
where, and how long a cold start would take now across the fleet; last, where the GPU-hours of the board's
time range went (the GPU-time ledger: serving, loading, starved, held but idle, idle), by namespace and
fleet-wide.

Every expression reads recording rules or per-node sums that stay cheap at a thousand nodes: see
docs/performance.md ("Fleet scale") for the measured query times.
"""

from __future__ import annotations

from typing import TypeVar

from grafana_foundation_sdk.builders import bargauge, heatmap, prometheus, table, timeseries
from grafana_foundation_sdk.builders import dashboard as db
from grafana_foundation_sdk.builders.common import ReduceDataOptions, StackingConfig
from grafana_foundation_sdk.models.common import (
    AxisPlacement,
    BarGaugeDisplayMode,
    BarGaugeValueMode,
    StackingMode,
    VisibilityMode,
    VizOrientation,
)
from grafana_foundation_sdk.models.dashboard import DataTransformerConfig, FieldColorModeId
from grafana_foundation_sdk.models.heatmap import HeatmapColorMode, HeatmapColorScale

from ...prometheus.config import STARVATION_UID, Config
from ...prometheus.sources.names import names
from .common import (
    BAD,
    DATASOURCE,
    INFO,
    OK,
    WARN,
    assemble,
    big_number,
    graph,
    limit,
    no_limit,
    override,
    query,
    rate,
    sel,
    table_query,
    threshold_lines,
)

FLEET_UID = "gpuio-fleet"
FLEET_TITLE = "gpuio / Fleet"


def starved_engines(config: Config) -> str:
    """Engines on GPUs starved now (GPUStarvedByDiskIO's condition, before its `for`), per node."""
    return f"count by ({config.NODE_LABEL}) ({names(config).STARVED}{sel(config)})"


def storm_loads(config: Config) -> str:
    """Engine loads waiting on a storming disk (DiskIOStorm's judgement), per node."""
    node, selector = config.NODE_LABEL, sel(config)
    return (f"sum by ({node}) (gpuio_disk_engine_loads_in_progress{selector} "
            f"and on ({node}, device) {names(config).STORM}{selector})")


def saturation(config: Config) -> str:
    """Per node, the worst disk's judged await as a share of its class's limit (1: at the limit)."""
    node, selector, recorded = config.NODE_LABEL, sel(config), names(config)
    return f"max by ({node}) ({recorded.AWAIT}{selector} / on ({node}, device) {recorded.AWAIT_LIMIT}{selector})"


def cold_loads(config: Config) -> str:
    """Cold loads (most of the file read from the device) finished per minute, per node and engine: from
    the recorded per-engine rate, not a rate over every engine's load counters of every node."""
    return f"60 * sum by ({config.NODE_LABEL}, engine) ({names(config).ENGINE_COLD_LOADS}{sel(config)}) > 0"


def ranking(config: Config, title: str, description: str, expr: str, unit: str,
            thresholds: db.ThresholdsConfig) -> bargauge.Panel:
    """Nodes as bars, worst first (top 20), each linking to its Starvation board."""
    node = config.NODE_LABEL
    link = {"title": "Starvation board of ${__field.labels." + node + "}",
            "url": f"/d/{STARVATION_UID}/{STARVATION_UID}?${{__url_time_range}}&var-datasource=${{datasource}}"
                   f"&var-cluster=${{cluster}}&var-instance=${{__field.labels.{node}}}"}
    matcher, properties = override("/.*/", links=[link])
    return (bargauge.Panel().title(title).description(description).datasource(DATASOURCE).unit(unit)
            .span(12).height(8)
            .with_target(prometheus.Dataquery().expr(f"topk(20, {expr})").legend_format("{{" + node + "}}").ref_id("A")
                         .instant())
            .thresholds(thresholds).color_scheme(db.FieldColor().mode(FieldColorModeId.THRESHOLDS))
            .display_mode(BarGaugeDisplayMode.GRADIENT).value_mode(BarGaugeValueMode.COLOR)
            .orientation(VizOrientation.HORIZONTAL).show_unfilled(True).min_viz_height(16).min_viz_width(0)
            .reduce_options(ReduceDataOptions().calcs(["lastNotNull"]).values(False))
            .with_override(matcher, properties).min(0))


def saturation_heatmap(config: Config) -> heatmap.Panel:
    return (heatmap.Panel().title("Disk saturation across nodes").datasource(DATASOURCE).span(24).height(10)
            .description(
                "One row per node, one cell per time step: the worst disk's judged await (r_await or w_await, "
                "with enough requests to judge) as a share of its class's limit (NVMe 5 ms, SSD 10 ms, HDD "
                "50 ms, network block devices 100 ms). Dark: far under its limit; 100 % and more: slow for its "
                "class. A column lit across many nodes is a fleet-wide storm (a shared model store, a deploy "
                "wave); one row lit is one node's disk. Slow alone is not saturated: DiskIOStorm also needs "
                "a deep queue or IO pressure. No cell: the node's disks completed too few requests to judge.")
            .with_target(query(saturation(config), "{{" + config.NODE_LABEL + "}}"))
            .calculate(False).unit("percentunit")
            .color(heatmap.HeatmapColorOptions().mode(HeatmapColorMode.SCHEME).scheme("Oranges")
                   .scale(HeatmapColorScale.EXPONENTIAL).exponent(0.5).steps(32).reverse(False)
                   .min(0).max(2))
            .y_axis(heatmap.YAxisConfig().axis_placement(AxisPlacement.LEFT).reverse(False))
            .cell_gap(1).show_value(VisibilityMode.NEVER)
            .show_legend().exemplars_color("rgba(255,0,255,0.7)")
            .filter_values(heatmap.FilterValueRange().le(1e-9)))


def top_row(config: Config) -> list:
    recorded = names(config)
    return [
        big_number("Engines starved now", "Engines on GPUs whose GPUStarvedByDiskIO condition holds now "
                   f"(paging after {config.STARVED_FOR}), across the chosen nodes. 0 is green; it counts engine x "
                   "GPU pairs, not alerts that paged.", f"sum({starved_engines(config)}) or vector(0)", "short",
                   limit(1), width=6),
        big_number("Nodes with a starved engine", "Nodes with at least one engine whose GPUStarvedByDiskIO "
                   "condition holds now (see the ranking below).", f"count({starved_engines(config)}) or vector(0)",
                   "short", limit(1), width=6),
        big_number("Disks storming", "Disks DiskIOStorm judges in a storm now: saturated for their class and "
                   f"at least {config.STORM_BASELINE_FACTOR:g}x their own calm normal.",
                   f"count({recorded.STORM}{sel(config)}) or vector(0)", "short", limit(1), width=6),
        big_number("Engine loads in progress", "Loads (read + deserialize) started and not finished across "
                   "the chosen nodes: a cold-start wave while it happens. Many loads on few disks is a storm in "
                   "the making; many loads spread thin is a deploy going well.",
                   f"sum(gpuio_engine_loads_in_progress{sel(config)}) or vector(0)", "short",
                   no_limit(), width=6),
    ]


def rankings(config: Config) -> list:
    return [
        ranking(config, "Nodes ranked by starvation", "Engines starved now per node (GPUStarvedByDiskIO's condition), "
                "the 20 worst. Click a bar for the node's Starvation board.", starved_engines(config), "short",
                limit(1)),
        ranking(config, "Nodes ranked by storm", "Engine loads waiting on a disk in a storm (DiskIOStorm's "
                "judgement), per node, the 20 worst: the nodes a cold-start storm hurts most. Click a bar for the "
                "node's Starvation board.", storm_loads(config), "short", limit(1)),
    ]


def cold_start_panels(config: Config) -> list:
    predicted = f"gpuio_engine_predicted_cold_start_seconds{sel(config)}"
    return [
        graph("Cold starts by node and engine", "Loads that were cold (at least 80 % of the engine file read "
              "from the device, or not cached when the load began) per minute, by node and engine: which "
              "engines cold-start where. A cold start is not a fault; many at once on one disk is a storm.",
              "short", query(cold_loads(config), "{{" + config.NODE_LABEL + "}} {{engine}}"), width=12),
        threshold_lines(graph(
            "Predicted cold start: fleet median and worst node, by engine",
            "How long a load of each engine would take now (its file's bytes not in the page cache over the "
            "read throughput of past cold loads, plus the median deserialize), across the chosen nodes: the "
            f"median node and the worst one. EngineColdStartSlow fires when the loads that finished took "
            f"more than {config.ENGINE_LOAD_SLOW_SECONDS:g} s (the red line); a prediction over it says where the "
            "next restart will be slow, it is not an alert.", "s",
            query(f"quantile by (engine) (0.5, {predicted})", "{{engine}} median"),
            query(f"max by (engine) ({predicted})", "{{engine}} worst node"), width=12),
            limit(config.ENGINE_LOAD_SLOW_SECONDS)),
    ]


def cold_start_table(config: Config) -> list:
    predicted = f"gpuio_engine_predicted_cold_start_seconds{sel(config)}"
    exclude = {"Time": True}
    panel = (table.Panel().title("Engines: where they cold-start and how long it would take")
             .description("Per engine across the chosen nodes: nodes that report it, cold loads per minute now, "
                          "and the predicted cold start on the median and on the worst node (red from "
                          f"EngineColdStartSlow's {config.ENGINE_LOAD_SLOW_SECONDS:g} s).")
             .datasource(DATASOURCE).span(24).height(8).frame_index(0).show_header(True)
             .with_target(table_query(f"count by (engine) (group by ({config.NODE_LABEL}, engine) "
                                      f"(gpuio_engine_info{sel(config)}))", "A"))
             .with_target(table_query(f"sum by (engine) ({cold_loads(config)})", "B"))
             .with_target(table_query(f"quantile by (engine) (0.5, {predicted})", "C"))
             .with_target(table_query(f"max by (engine) ({predicted})", "D"))
             .with_transformation(DataTransformerConfig(id_val="merge", options={}))
             .with_transformation(DataTransformerConfig(id_val="organize", options={
                 "excludeByName": exclude,
                 "renameByName": {"Value #A": "nodes", "Value #B": "cold loads / min",
                                  "Value #C": "predicted (median node)", "Value #D": "predicted (worst node)"}})))
    for column in ("predicted (median node)", "predicted (worst node)"):
        matcher, properties = override(column, unit="s", thresholds=limit(config.ENGINE_LOAD_SLOW_SECONDS).build(),
                                       custom_cellOptions={"type": "color-background"})
        panel = panel.with_override(matcher, properties)
    return [panel]


# The GPU-time ledger's states (exporter/collectors/nvml_ledger.py STATES) and their colours: the pod series
# have all but idle.
GPU_TIME_STATES = {"serving": OK, "loading": INFO, "starved": BAD, "allocated_idle": WARN, "idle": "#808080"}
# Hours of GPU (or MIG device) time: Grafana's hour unit would write 36 of them as "1.50 day".
GPU_HOURS = "suffix: GPU-h"
# Over the board's whole time range, not a rate window: what the range cost, whatever its length.
RANGE = "$__range"


def gpu_hours(config: Config, metric: str, by: str) -> str:
    """GPU-hours of ``metric`` (a GPU-time ledger counter) per ``by`` over the board's time range, largest first."""
    return f"sort_desc(sum by ({by}) (increase({metric}{sel(config)}[{RANGE}])) / 3600)"


Colourable = TypeVar("Colourable", bargauge.Panel, timeseries.Panel)


def state_colours(panel: Colourable) -> Colourable:
    """Each series coloured by the ledger state its name ends with ("ml serving", "idle")."""
    for state, colour in GPU_TIME_STATES.items():
        matcher, properties = override(f"/(^| ){state}$/", color={"mode": "fixed", "fixedColor": colour})
        panel = panel.with_override(matcher, properties)
    return panel


def hours_bars(title: str, description: str, expr: str, legend: str, width: int) -> bargauge.Panel:
    """One bar per series of an instant query of GPU-hours over the board's time range."""
    panel = (bargauge.Panel().title(title).description(description).datasource(DATASOURCE).unit(GPU_HOURS)
             .span(width).height(10).decimals(1)
             .with_target(prometheus.Dataquery().expr(expr).legend_format(legend).ref_id("A").instant())
             .thresholds(no_limit()).color_scheme(db.FieldColor().mode(FieldColorModeId.FIXED).fixed_color(INFO))
             .display_mode(BarGaugeDisplayMode.GRADIENT).value_mode(BarGaugeValueMode.COLOR)
             .orientation(VizOrientation.HORIZONTAL).show_unfilled(True).min_viz_height(16).min_viz_width(0)
             .reduce_options(ReduceDataOptions().calcs(["lastNotNull"]).values(False)).min(0))
    return state_colours(panel)


def gpu_time_panels(config: Config) -> list:
    """Where the GPU-hours went: the GPU-time ledger (docs/gpu.md, "GPU time") over the board's time range."""
    states = ("serving (an engine had requests in flight), loading (a load in progress, nothing in flight), "
              "starved (work waiting while the device lost its activity and a disk under the engine's files was "
              "saturated), allocated_idle (held by a pod or a process, no engine work)")
    idle_alert = (f"GPUAllocatedIdle opens a ticket for a device held with no engine work, and mostly idle, for "
                  f"{config.GPU_ALLOCATED_IDLE_RATIO:.0%} of {config.GPU_ALLOCATED_IDLE_WINDOW}.")
    by_state = graph(
        "GPUs by state", "How many GPUs and MIG devices were in each state of the GPU-time ledger at each moment, "
        f"stacked: {states}, idle (nobody holds it). The stack's height is the devices gpuio sees; its area is "
        "GPU-hours (the bars above add it up over the time range). An orange band that stays is capacity paid for "
        f"and unused. {idle_alert}", "short",
        query(f"sum by (state) ({rate('gpuio_gpu_time_seconds_total', sel(config))})", "{{state}}"),
        width=24)
    by_state = by_state.stacking(StackingConfig().mode(StackingMode.NORMAL)).fill_opacity(60)
    return [
        hours_bars("GPU-hours by state, by namespace",
                   "GPU-hours over the board's time range per Kubernetes namespace and state, from the pods' share of "
                   f"the GPU-time ledger (gpuio_pod_gpu_time_seconds_total): {states}. Two pods time-slicing a GPU "
                   "each count their own hours. Largest first: a long orange bar is a namespace holding GPUs it does "
                   f"not use. Empty without the pods collector, or outside Kubernetes. {idle_alert}",
                   gpu_hours(config, "gpuio_pod_gpu_time_seconds_total", "namespace, state"),
                   "{{namespace}} {{state}}", width=12),
        hours_bars("GPU-hours by state, fleet-wide",
                   "GPU-hours over the board's time range of every GPU and MIG device of the chosen nodes, by state "
                   f"of the GPU-time ledger (gpuio_gpu_time_seconds_total): {states}, idle (nobody holds it: free "
                   "capacity). The states of a device add up to the time the exporter watched it, so the bars add up "
                   "to the fleet's GPU-hours seen.",
                   gpu_hours(config, "gpuio_gpu_time_seconds_total", "state"), "{{state}}", width=12),
        state_colours(by_state),
    ]


def build(config: Config) -> db.Dashboard:
    sections = (("Now", top_row(config)), ("Nodes", rankings(config)), ("Disks", [saturation_heatmap(config)]),
                ("Cold starts", cold_start_panels(config) + cold_start_table(config)),
                ("GPU time", gpu_time_panels(config)))
    return assemble(config, FLEET_UID, "Every node of a cluster: starvation and storms ranked by node, disk saturation "
                    "across nodes over time, where engines cold-start and how long a cold start would take, and where "
                    "the GPU-hours went.", sections, title=FLEET_TITLE, all_nodes=True)


