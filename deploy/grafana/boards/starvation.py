"""gpuio / Starvation (on-call): is this node's GPU idle because a disk cannot keep up?

Read it top to bottom at 3 a.m.  The top row answers in one look: one lane per engine on each GPU,
coloured by the state the starvation alert judges (ok, loading, waiting for disk, starved, stale data),
the alerts pending and firing, and a table that draws the join the alert makes: engine -> pod -> GPU ->
disk and mount, with the GPU's activity against its calm normal, the disk's await and queue against its class limits, IO
pressure, loads in progress and page-cache residency, each cell coloured by the alerts' limits and each
engine and disk linking to its own board.  Below: GPU and disks on one time axis, then the engines.

The states are computed from the same recording rules the alerts fire on (deploy/prometheus), so the
board and the page cannot disagree: "starved" is GPUStarvedByDiskIO's expression before its `for`.
"""

from __future__ import annotations

from grafana_foundation_sdk.builders import dashboard as db
from grafana_foundation_sdk.builders import table
from grafana_foundation_sdk.models.dashboard import DataTransformerConfig

from ...prometheus.config import DISK_IO_UID, ENGINES_UID, STARVATION_UID, Config
from ...prometheus.sources.base import CRASH_LOOPING
from ...prometheus.sources.names import names
from .common import (
    BAD,
    CLUSTER,
    DATASOURCE,
    ENGINE,
    GPU,
    INFO,
    OK,
    UNKNOWN,
    UP,
    WARN,
    assemble,
    collector_states,
    disk_ratio,
    disk_series,
    engine_loads_annotation,
    engine_variable,
    gpu_variable,
    graph,
    guarded_ratio,
    histogram_quantile,
    limit,
    override,
    query,
    rate,
    sel,
    series_limits,
    states,
    table_query,
    threshold_lines,
    timeline,
    value_table,
)

# --- the join, per engine on a GPU --------------------------------------------------------------------


def row_key(config: Config) -> str:
    """The labels of one row of the join: an engine on a GPU of a node."""
    return f"{config.NODE_LABEL}, engine, gpu_uuid"


# The state of an engine on a GPU, worst first.  Codes, names and colours of the state timeline.
STARVATION_STATES = ((0, "ok", OK), (1, "loading", INFO), (2, "waiting for disk", WARN), (3, "starved", BAD),
                     (4, "stale data", UNKNOWN))


def _as(config: Config, code: int, name: str, expr: str) -> str:
    """``code`` for each engine x GPU of ``expr``, with a label of its own so that ``or`` keeps it."""
    key = row_key(config)
    return f'label_replace({code} * group by ({key}) ({expr}), "state", "{name}", "", "")'


def engine_gpu_state(config: Config, engines: str = "") -> str:
    """One series per engine on a GPU of the chosen node, its value the state code (STARVATION_STATES):
    ok: the engine is loaded on the GPU; loading: a load of it is in progress (or its loads are abandoned
    again and again: a crash loop, between attempts too); waiting for disk: work
    waits on it (pool wait, in flight >= contexts, p99 over its normal, a load) while the disk or
    network mount under its file is saturated; starved: GPUStarvedByDiskIO's condition holds (the GPU
    is also mostly idle); stale data: the node's GPU data is stale, so none of the above can be judged."""
    key = row_key(config)
    recorded = names(config)
    s = sel(config, *([engines] if engines else []))
    loaded = f'gpuio_engine_info{s[:-1]},gpu_uuid!=""}}'
    storage = f"({recorded.ENGINE_DISK_SATURATED}{sel(config)} or {recorded.ENGINE_MOUNT_SLOW}{sel(config)})"
    return "\n or ".join([
        f"max by ({key}) (\n 0 * group by ({key}) ({loaded})",
        _as(config, 1, "loading", f"gpuio_engine_loads_in_progress{s} > 0 or "
                                  f'{recorded.WORK_WAITING}{s[:-1]},reason="{CRASH_LOOPING}"}}'),
        _as(config, 2, "waiting", f"{recorded.WORK_WAITING}{s} and on ({config.NODE_LABEL}, engine) {storage}"),
        _as(config, 3, "starved", f'label_replace({recorded.STARVED}{s}, "gpu_uuid", "$1", "uuid", "(.+)")'),
        _as(config, 4, "stale", f"{loaded} and on ({config.NODE_LABEL}) {recorded.GPU_STALE}{sel(config)}"),
    ]) + "\n)"


def engine_rows(config: Config, engines: str) -> str:
    """One series (value 1) per engine on a GPU, pod and mount: labels instance, engine, gpu_uuid, device
    (the block device of the engine file), mountpoint, namespace, pod.  An engine with no pod (outside
    Kubernetes) or no mount known keeps its row, without those labels."""
    key = row_key(config)
    s = sel(config, engines)
    # one engine file per engine on a GPU (a name loaded from two paths on one GPU shows one of them)
    files = f'topk by ({key}) (1, gpuio_engine_info{s[:-1]},gpu_uuid!=""}})'
    mounts = f"gpuio_engine_mount_info{sel(config)}"
    with_mount = (f"({files} * on ({config.NODE_LABEL}, engine, path) group_left (mountpoint) {mounts}"
                  f" or {files} unless on ({config.NODE_LABEL}, engine, path) {mounts})")
    pods = f"group by ({key}, namespace, pod) (gpuio_engine_pod_info{sel(config)})"
    return (f"group by ({key}, device, mountpoint, namespace, pod) (\n"
            f"  {pods} * on ({key}) group_left (device, mountpoint) {with_mount}\n"
            f"  or {with_mount} unless on ({key}) {pods}\n)")


def per_row(rows: str, value: str, on: str) -> str:
    """``value`` (one series per ``on``) on every table row: all columns share the rows' labels."""
    return f"{rows}\n* on ({on}) group_left ()\n{value}"


def _engine_file_max(config: Config, value: str) -> str:
    """The max of a per-device recorded value over the whole disks under each engine file, per engine x GPU."""
    key = row_key(config)
    node = config.NODE_LABEL
    disks = f'label_replace(gpuio_engine_physical_device_info{sel(config)}, "device", "$1", "physical_device", "(.+)")'
    files = f'gpuio_engine_info{sel(config)[:-1]},gpu_uuid!=""}}'
    per_file = f"max by ({node}, engine, path) ({disks} * on ({node}, device) group_left () {value})"
    return f"max by ({key}) ({files} * on ({node}, engine, path) group_left () {per_file})"


def join_columns(config: Config, engines: str) -> list[tuple[str, str]]:
    """(column, expression) of the join table; every expression carries the rows' labels."""
    key = row_key(config)
    recorded = names(config)
    rows = engine_rows(config, engines)
    activity = f"label_replace({recorded.ENGINE_GPU_ACTIVITY}{sel(config)}, \"gpu_uuid\", \"$1\", \"uuid\", \"(.+)\")"
    of_calm = (f"max by ({key}) ({activity} / on ({config.NODE_LABEL}, uuid) group_left () "
               f"{recorded.GPU_ACTIVITY_BASELINE}{sel(config)})")
    node, selector = config.NODE_LABEL, sel(config)
    await_ratio = _engine_file_max(
        config, f"({recorded.AWAIT}{selector} / on ({node}, device) {recorded.AWAIT_LIMIT}{selector})")
    queue_ratio = _engine_file_max(
        config, f"({recorded.QUEUE}{selector} / on ({node}, device) {recorded.QUEUE_LIMIT}{selector})")
    cached = (f"max by ({key}) (gpuio_engine_info{selector[:-1]},gpu_uuid!=\"\"}} * on ({node}, engine, path) "
              f"group_left () gpuio_engine_file_cached_ratio{sel(config)})")
    return [
        ("state", per_row(rows, engine_gpu_state(config, engines), key)),
        ("GPU activity", per_row(rows, f"max by ({key}) ({activity})", key)),
        ("of its calm", per_row(rows, of_calm, key)),
        ("await / limit", per_row(rows, await_ratio, key)),
        ("queue / limit", per_row(rows, queue_ratio, key)),
        ("IO pressure", per_row(rows, f"{recorded.IO_SOME}{sel(config)}", on=config.NODE_LABEL)),
        ("pool wait", per_row(rows, f"max by ({key}) ({recorded.ENGINE_POOL_WAIT}{sel(config)})", key)),
        ("loads", per_row(rows, f"sum by ({key}) (gpuio_engine_loads_in_progress{sel(config)})", key)),
        ("cached", per_row(rows, cached, key)),
    ]


def board_link(config: Config, title: str, uid: str, variables: str) -> dict:
    """A data link to another gpuio board keeping the time range, the datasource, cluster and node."""
    return {"title": title, "targetBlank": False,
            "url": f"/d/{uid}/{uid}?${{__url_time_range}}&var-datasource=${{datasource}}&var-cluster=${{cluster}}"
                   f"&var-instance=${{__data.fields.{config.NODE_LABEL}}}&{variables}"}


def join_table(config: Config) -> table.Panel:
    columns = join_columns(config, ENGINE)
    state_names = states(*STARVATION_STATES)
    panel = (table.Panel().title("Who starves whom: engine -> pod -> GPU -> disk")
             .description(
                 "One row per engine on a GPU (and pod, where the pods report it): the join GPUStarvedByDiskIO "
                 "makes. GPU activity (SM activity where GPM measures it, else NVML busy; a MIG device's GPU "
                 f"instance) red under {config.GPU_SM_ACTIVE_LOW:.0%}, and as a share of its calm normal red under "
                 f"{config.GPU_ACTIVITY_DROP:.0%}: the GPU lost its work; await and "
                 "queue as a share of the disk class's limit "
                 "(red from 100 %: the disk is slow, or deeply queued, for its class; the worst of the whole "
                 "disks under the engine file); IO pressure red from the node's limit (it is the node's, not "
                 "the disk's); pool wait red where it counts as work waiting. A red cell alone is not "
                 "starvation: the state column is, and it needs the GPU idle, work waiting and the storage "
                 "saturated at once. loads: loads in progress; cached: share of the engine file in the page "
                 "cache (1: a restart reads nothing from the disk). Click an engine or a disk for its board.")
             .datasource(DATASOURCE).span(24).height(8).frame_index(0).show_header(True))
    for ref, (_, expr) in zip("ABCDEFGHI", columns, strict=True):
        panel = panel.with_target(table_query(expr, ref))
    names = {f"Value #{ref}": column for ref, (column, _) in zip("ABCDEFGHI", columns, strict=True)}
    panel = (panel.with_transformation(DataTransformerConfig(id_val="merge", options={}))
             .with_transformation(DataTransformerConfig(id_val="organize", options={
                 "excludeByName": {"Time": True},
                 "indexByName": {name: i for i, name in enumerate(
                     ["engine", "namespace", "pod", "gpu_uuid", "device", "mountpoint", config.NODE_LABEL,
                      *names])},
                 "renameByName": names})))
    cell = {"type": "color-background"}
    for column, props in (
        ("state", {"mappings": state_names, "custom_cellOptions": cell}),
        ("GPU activity", {"unit": "percentunit", "thresholds": limit(config.GPU_SM_ACTIVE_LOW, below=True).build(),
                          "custom_cellOptions": cell}),
        ("of its calm", {"unit": "percentunit", "thresholds": limit(config.GPU_ACTIVITY_DROP, below=True).build(),
                         "custom_cellOptions": cell}),
        ("await / limit", {"unit": "percentunit", "thresholds": limit(1.0).build(), "custom_cellOptions": cell}),
        ("queue / limit", {"unit": "percentunit", "thresholds": limit(1.0).build(), "custom_cellOptions": cell}),
        ("IO pressure", {"unit": "percentunit", "thresholds": limit(config.IO_PRESSURE_SOME).build(),
                         "custom_cellOptions": cell}),
        ("pool wait", {"unit": "s", "thresholds": limit(config.ENGINE_POOL_WAIT_SECONDS).build(),
                       "custom_cellOptions": cell}),
        ("cached", {"unit": "percentunit"}),
        ("engine", {"links": [board_link(config, "Engine ${__value.raw}", ENGINES_UID,
                                         "var-engine=${__value.raw}")]}),
        ("device", {"links": [board_link(config, "Disk ${__value.raw}", DISK_IO_UID, "var-device=${__value.raw}")]}),
    ):
        matcher, properties = override(column, **props)
        panel = panel.with_override(matcher, properties)
    return panel


ALERT_STATES = states((1, "pending", WARN), (2, "firing", BAD))


def alerts_table(config: Config) -> table.Panel:
    """Pending and firing alerts of the node: pending is what will page if it holds for its `for`."""
    expr = (f'ALERTS{{alertstate=~"pending|firing",{CLUSTER},{config.NODE_LABEL}=~"$instance"}}')
    exclude = {name: True for name in ("Time", "__name__", "job", "Value")}
    matcher, properties = override("alertstate", custom_cellOptions={"type": "color-background"},
                                   mappings=[{"type": "value", "options": {
                                       "pending": {"text": "pending", "color": WARN, "index": 0},
                                       "firing": {"text": "firing", "color": BAD, "index": 1}}}])
    return (table.Panel().title("Alerts: pending and firing")
            .description("Alerts of this node that hold now (Prometheus' ALERTS series), pending ones too: a "
                         "pending alert has its condition true and waits out its `for` (a storm pages "
                         f"{config.STORM_PAGE_FOR} after it is seen, starvation {config.STARVED_FOR}). Silenced or "
                         "inhibited alerts are listed too: Alertmanager, not Prometheus, holds them back.")
            .datasource(DATASOURCE).span(12).height(8).frame_index(0).show_header(True)
            .with_target(table_query(expr))
            .with_transformation(DataTransformerConfig(id_val="organize", options={"excludeByName": exclude}))
            .with_override(matcher, properties))


def top_row(config: Config) -> list:
    state = timeline(
        "Engine x GPU: ok, loading, waiting for disk, starved, stale data",
        "One lane per engine on each GPU of the node. ok: loaded, nothing waits on storage; loading: a load "
        "is in progress, or its loads die unfinished again and again (a crash loop); waiting for disk: work "
        "waits on the engine while the disk or network mount under its file is saturated (DiskIOStorm's "
        f"judgement); starved: the GPU also lost its work (mostly idle, or under {config.GPU_ACTIVITY_DROP:.0%} of "
        f"its calm activity), GPUStarvedByDiskIO's condition (it pages after {config.STARVED_FOR}); stale "
        "data: the node's GPU data is stale, nothing can be judged (GpuioGPUDataStale). The colours are the "
        "alerts' own recording rules, so the board and the page agree. A hole: the engine was not loaded.",
        query(engine_gpu_state(config, ENGINE), "{{engine}} on {{gpu_uuid}}"),
        mappings=states(*STARVATION_STATES), width=12, height=8)
    return [state, alerts_table(config), join_table(config)]


def gpu_panels(config: Config) -> list:
    return [
        series_limits(graph(
            "GPU busy vs. SM and tensor activity",
            f"Busy: share of time a kernel ran (NVML, integrated from its samples). SM active: share of SMs with "
            f"a warp resident; tensor: share of time the tensor pipes worked; DRAM: share of peak memory "
            f"bandwidth (GPM, Hopper and newer). Busy reads 100 % while an engine's weights cross PCIe with no "
            f"SM running: GPUStarvedByDiskIO counts a GPU as idle under {config.GPU_BUSY_LOW:.0%} busy or under "
            f"{config.GPU_SM_ACTIVE_LOW:.0%} SM active (the dashed lines), or as having lost its work under "
            f"{config.GPU_ACTIVITY_DROP:.0%} of its calm activity, with work waiting on saturated storage; idle "
            "with nothing waiting is an idle GPU, not a starved one.", "percentunit",
            query(rate("gpuio_gpu_busy_seconds_total", sel(config, GPU)), "GPU {{gpu}} busy"),
            query(rate("gpuio_gpu_sm_active_seconds_total", sel(config, GPU)), "GPU {{gpu}} SM active"),
            query(rate("gpuio_gpu_pipe_active_seconds_total", sel(config, GPU, 'pipe="tensor"')), "GPU {{gpu}} tensor"),
            query(rate("gpuio_gpu_dram_active_seconds_total", sel(config, GPU)), "GPU {{gpu}} DRAM"), max_value=1),
            {"/ busy$/": limit(config.GPU_BUSY_LOW, below=True),
             "/ SM active$/": limit(config.GPU_SM_ACTIVE_LOW, below=True)}),
        timeline("GPU up", f"up while the GPU answers NVML; down: lost, reset required or gone from the bus "
                 f"(GPULost fires after {config.GPU_LOST_FOR}).",
                 query(f"gpuio_gpu_up{sel(config, GPU)}", "GPU {{gpu}}"),
                 mappings=UP, height=6),
        graph("Bytes in: disks vs. PCIe and NVLink", "Read throughput of the node's disks beside the bytes the "
              "GPUs receive over PCIe (host to GPU: engine weights, inputs) and NVLink (GPM, Hopper and newer). "
              "A load that crawls off a disk shows as disk reads and PCIe receive both low while the GPU waits.",
              "binBps",
              query(disk_series(config, "read_bytes_total", device=False), "disk {{device}} read"),
              query(rate("gpuio_gpu_pcie_receive_bytes_total", sel(config, GPU)), "GPU {{gpu}} PCIe receive"),
              query(rate("gpuio_gpu_nvlink_receive_bytes_total", sel(config, GPU)), "GPU {{gpu}} NVLink receive")),
        collector_states(config, height=6),
    ]


def disk_panels(config: Config) -> list:
    recorded = names(config)
    node_disks = sel(config)
    return [
        graph("Disk await (r_await, w_await)", "Mean time per request of the node's disks. No line: the device "
              "completed nothing.", "s",
              query(disk_ratio(config, "read_time_seconds_total", "reads_completed_total", device=False),
                    "{{device}} r_await"),
              query(disk_ratio(config, "write_time_seconds_total", "writes_completed_total", device=False),
                    "{{device}} w_await")),
        graph("Disk queue size (aqu-sz)", "Requests in flight or queued per device.", "short",
              query(disk_series(config, "io_time_weighted_seconds_total", device=False), "{{device}}")),
        series_limits(graph(
            "IO pressure (PSI)", f"Share of time tasks waited on IO (some) or all stalled on it (full). From "
            f"{config.IO_PRESSURE_SOME:.0%} some or {config.IO_PRESSURE_FULL:.0%} full (the dashed lines) a slow "
            "disk counts "
            "as saturated (DiskIOStorm, GPUStarvedByDiskIO). The node's pressure, not one disk's.", "percentunit",
            query(rate("gpuio_pressure_io_waiting_seconds_total", node_disks), "io some"),
            query(rate("gpuio_pressure_io_stalled_seconds_total", node_disks), "io full"), max_value=1),
            {"io some": limit(config.IO_PRESSURE_SOME), "io full": limit(config.IO_PRESSURE_FULL)}),
        graph("Saturated disks", "Disks slow for their class with a deep queue or IO pressure (what `gpuio top` "
              "flags 'saturated'); the line is the await. Empty is good.", "s",
              query(f"{recorded.SATURATED}{node_disks}", "{{device}}")),
    ]


def engine_panels(config: Config) -> list:
    recorded = names(config)
    engines = sel(config, ENGINE)

    def quantile(q: float) -> str:
        return histogram_quantile(config, q, "gpuio_engine_inference_seconds", engines)

    return [
        graph("Inference latency (p50, p95, p99)", "End-to-end inference latency per engine, from the "
              "engines' histograms.", "s",
              query(quantile(0.5), "{{engine}} p50"), query(quantile(0.95), "{{engine}} p95"),
              query(quantile(0.99), "{{engine}} p99")),
        graph("Inferences in flight", "Inferences running now, per engine and GPU. A request in flight is not "
              "work waiting; as many in flight as the pool has contexts is.", "short",
              query(f"gpuio_engine_inferences_in_flight{engines}", "{{engine}} {{gpu_uuid}}"),
              query(f"gpuio_engine_pool_contexts{engines}", "{{engine}} {{gpu_uuid}} contexts")),
        graph("Work waiting", "Why work queues for an engine on a GPU (pool wait, in flight >= contexts, p99 "
              "latency over its calm normal, a load in progress): what GPUStarvedByDiskIO needs besides an idle "
              "GPU and slow storage. Empty is good.", "short",
              query(f"{recorded.WORK_WAITING}{engines}", "{{engine}} {{gpu_uuid}}: {{reason}}")),
        graph("Engine loads in progress", "Loads started and not finished, per disk and per mount point: a "
              "cold-start storm while it happens. DiskIOStorm / MountIOStorm page when loads wait on "
              "storage that is saturated.", "short",
              query(f"gpuio_disk_engine_loads_in_progress{sel(config)}", "disk {{device}}"),
              query(f"gpuio_mount_engine_loads_in_progress{sel(config)}", "mount {{mountpoint}}")),
        graph("Network storage: NFS READ round trip", f"Mean round trip of an NFS READ per mount (mountstats); "
              f"{config.NFS_READ_RTT_SLOW_SECONDS * 1000:g} ms or more under IO pressure is a slow mount.", "s",
              query(f"{recorded.NFS_READ_RTT}{sel(config)}", "{{mountpoint}}")),
        threshold_lines(graph(
            "Engine cold starts", f"Mean load time (read + deserialize) and its read part, of the loads that "
            f"finished in the last {config.ENGINE_LOAD_WINDOW} (recording rules); EngineColdStartSlow fires above "
            f"{config.ENGINE_LOAD_SLOW_SECONDS:g} s (the red line).", "s",
            query(f"{recorded.ENGINE_LOAD}{engines}", "{{engine}} load"),
            query(f"{recorded.ENGINE_LOAD_READ}{engines}", "{{engine}} read")),
            limit(config.ENGINE_LOAD_SLOW_SECONDS)),
        graph("Pool wait (mean)", "Mean time a request waited for a free execution context in the engine "
              "pool. No line: no request acquired a context.", "s",
              query(guarded_ratio("gpuio_engine_pool_wait_seconds_sum", "gpuio_engine_pool_wait_seconds_count",
                                  engines), "{{engine}}")),
        graph("Engine pods stalled on IO", "Share of time in which some task of an engine's pod waited on IO "
              "(its cgroup's io.pressure some, cgroup v2, the cgroup_io collector), for the pods whose engines "
              "this node serves: a storm's victims.", "percentunit",
              query(engine_pods_stalled(config), "{{namespace}}/{{pod}}"), max_value=1),
        value_table("Engines on this node", "Each engine file a live process loaded: its block device and its GPU "
                    "(gpuio_engine_info), the join the starvation alerts use.",
                    f"gpuio_engine_info{engines}", ["job"], width=12),
    ]


def engine_pods_stalled(config: Config) -> str:
    """IO pressure (some) of each cgroup of a pod that serves engines, the pod's worst one, named by the
    engines' pod info (the cgroup_io collector's cgroups carry the pod UID the kubelet's path names)."""
    node, in_a_pod = config.NODE_LABEL, sel(config, 'pod_uid!=""')
    waiting = f"rate(gpuio_cgroup_io_pressure_waiting_seconds_total{sel(config)}[$__rate_interval])"
    of_pods = f"{waiting} * on ({node}, cgroup) group_left (pod_uid) gpuio_cgroup_info{in_a_pod}"
    pods = f"max by ({node}, pod_uid, namespace, pod) (gpuio_engine_pod_info{in_a_pod})"
    return f"max by (namespace, pod) ({of_pods} * on ({node}, pod_uid) group_left (namespace, pod) {pods})"


def build(config: Config) -> db.Dashboard:
    busy, up, bytes_in, collectors = gpu_panels(config)
    await_, queue, pressure, saturated = disk_panels(config)
    # GPU on the left, its disks on the right, one shared crosshair: is the GPU idle while a disk is slow?
    sections = (("Now: which engine on which GPU is starved by which disk", top_row(config)),
                ("GPU vs. disks", [busy, await_, bytes_in, queue, up, pressure, collectors, saturated]),
                ("Engines", engine_panels(config)))
    return assemble(config, STARVATION_UID, "Is a GPU idle because a disk cannot keep up? Engine x GPU states, the "
                    "engine -> pod -> GPU -> disk join with the alerts' limits, then GPU, disks, IO pressure and "
                    "engines of one node on one time axis.", sections,
                    variables=[gpu_variable(config), engine_variable(config)],
                    annotations=[engine_loads_annotation(sel(config, ENGINE))])


__all__ = ["build", "engine_gpu_state", "join_columns", "STARVATION_STATES"]
