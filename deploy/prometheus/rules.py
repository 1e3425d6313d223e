"""gpuio's recording rules and alerts, as data built from config.py.

``python -m deploy.prometheus.generate`` writes them to rules/<name>.yml: starvation.yml (disk, IO
pressure, GPU busy, network mounts, engines' queueing, and the storm and starvation alerts built on
them, in one group: see rule_files), gpu.yml (GPU hardware), engines.yml (cold starts, spool errors),
smart.yml, exporter.yml.  Recording rules are named ``level:metric:operations``
(https://prometheus.io/docs/practices/rules/): ``instance_device:gpuio_disk_reads_completed:rate1m`` is
the per-second rate over RATE_WINDOW of gpuio_disk_reads_completed_total, one series per node and
device.  Rules in a group run in order at one timestamp, so a rule may use the ones above it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from exporter import thresholds

from . import config as c

Rule = dict[str, Any]
W = c.RATE_WINDOW
ON_DEVICE = f"on ({c.NODE_LABEL}, device)"
ON_NODE = f"on ({c.NODE_LABEL})"
# Comparing with a per-device limit: group_left keeps every label of the left side (with a plain
# `on`, a one-to-one comparison would keep only the `on` labels and drop job and target labels).
TO_LIMIT = f"{ON_DEVICE} group_left ()"

# Recording-rule names, used by the alerts below and by the dashboards.
B = c.BASELINE_WINDOW
READS = f"instance_device:gpuio_disk_reads_completed:rate{W}"
WRITES = f"instance_device:gpuio_disk_writes_completed:rate{W}"
READ_BYTES = f"instance_device:gpuio_disk_read_bytes:rate{W}"
WRITTEN_BYTES = f"instance_device:gpuio_disk_written_bytes:rate{W}"
READ_AWAIT = f"instance_device:gpuio_disk_read_await_seconds:rate{W}"
WRITE_AWAIT = f"instance_device:gpuio_disk_write_await_seconds:rate{W}"
QUEUE = f"instance_device:gpuio_disk_io_time_weighted_seconds:rate{W}"  # aqu-sz
UTIL = f"instance_device:gpuio_disk_io_time_seconds:rate{W}"  # %util / 100
AWAIT = f"instance_device:gpuio_disk_await_seconds:max_rate{W}"
DISK_CLASS = "instance_device:gpuio_disk_class:info"
AWAIT_LIMIT = "instance_device:gpuio_disk_await_limit_seconds:class"
QUEUE_LIMIT = "instance_device:gpuio_disk_queue_limit:class"
SATURATED = f"instance_device:gpuio_disk_saturated_await_seconds:max_rate{W}"
# The calm evaluations (device not saturated), their medians over BASELINE_WINDOW (while there is
# enough calm evidence), and the baselines the storm alert compares with (the last median, held).
CALM_AWAIT = f"instance_device:gpuio_disk_calm_await_seconds:max_rate{W}"
CALM_QUEUE = f"instance_device:gpuio_disk_calm_io_time_weighted_seconds:rate{W}"
AWAIT_LEARNED = f"instance_device:gpuio_disk_calm_await_seconds:median{B}"
QUEUE_LEARNED = f"instance_device:gpuio_disk_calm_io_time_weighted_seconds:median{B}"
AWAIT_BASELINE = f"instance_device:gpuio_disk_calm_await_seconds:median{B}_held{c.BASELINE_HOLD}"
QUEUE_BASELINE = f"instance_device:gpuio_disk_calm_io_time_weighted_seconds:median{B}_held{c.BASELINE_HOLD}"
STORM = f"instance_device:gpuio_disk_storm_await_seconds:max_rate{W}"
GPU_BUSY = f"instance_gpu:gpuio_gpu_busy_seconds:rate{W}"
# GPUs judged mostly idle, valued with the ratio that judged them: NVML busy, else SM activity (GPM).
GPU_IDLE = f"instance_gpu:gpuio_gpu_idle_activity:rate{W}"
GPU_STALE = f"instance:gpuio_gpu_data_stale:max{W}"
NVML_SUCCESS = 'gpuio_scrape_collector_success{collector="nvml",' + c.SELECTOR + "}"
NVML_SUCCESS_NOW = (f'{{{{ with printf "gpuio_scrape_collector_success{{collector=\'nvml\',{c.NODE_LABEL}=\'%s\'}}" '
                    f'$labels.{c.NODE_LABEL} | query }}}}{{{{ . | first | value | printf "%.0f" }}}}{{{{ else }}}}none'
                    f"{{{{ end }}}}")
ENGINE_GPU_BUSY = f"instance_engine_gpu:gpuio_gpu_busy_seconds:rate{W}"
ENGINE_DISK_SATURATED = f"instance_engine:gpuio_disk_saturated_await_seconds:max_rate{W}"
ENGINE_MOUNT_SLOW = f"instance_engine:gpuio_mount_slow:max_rate{W}"
ENGINE_IN_FLIGHT = f"instance_engine_gpu:gpuio_engine_inferences_in_flight:avg_over_time{W}"
ENGINE_POOL_WAIT = f"instance_engine_gpu:gpuio_engine_pool_wait_seconds:mean_rate{W}"
ENGINE_LATENCY = f"instance_engine_gpu_quantile:gpuio_engine_inference_seconds:histogram_quantile_rate{W}"
# The p99 of the evaluations in which the engine's storage was not saturated, its median, held.
ENGINE_LATENCY_CALM = f"instance_engine_gpu:gpuio_engine_inference_calm_p99_seconds:histogram_quantile_rate{W}"
ENGINE_LATENCY_LEARNED = f"instance_engine_gpu:gpuio_engine_inference_calm_p99_seconds:median{B}"
ENGINE_LATENCY_BASELINE = f"instance_engine_gpu:gpuio_engine_inference_calm_p99_seconds:median{B}_held{c.BASELINE_HOLD}"
WORK_WAITING = f"instance_engine_gpu:gpuio_engine_work_waiting:rate{W}"
STARVED = f"instance_engine_gpu:gpuio_engine_starved_gpu_busy:rate{W}"
ENGINE_LOAD = f"instance_engine:gpuio_engine_load_seconds:mean{c.ENGINE_LOAD_WINDOW}"
ENGINE_LOAD_READ = f"instance_engine:gpuio_engine_load_read_seconds:mean{c.ENGINE_LOAD_WINDOW}"
ENGINE_LOAD_THROUGHPUT = f"instance_engine:gpuio_engine_load_read_bytes_per_second:rate{c.ENGINE_LOAD_WINDOW}"
NFS_READ_RTT = f"instance_mountpoint:gpuio_mountstats_nfs_read_rtt_seconds:mean_rate{W}"
NFS_READ_BYTES = f"instance_mountpoint:gpuio_mountstats_nfs_read_bytes:rate{W}"
MOUNT_SLOW = f"instance_mountpoint:gpuio_mount_slow:max_rate{W}"
IO_SOME = f"instance:gpuio_pressure_io_waiting_seconds:rate{W}"
IO_FULL = f"instance:gpuio_pressure_io_stalled_seconds:rate{W}"


def rate(metric: str, *matchers: str) -> str:
    return f"rate({metric}{c.selector(*matchers)}[{W}])"


def record(name: str, expr: str) -> Rule:
    return {"record": name, "expr": expr}


def runbook(alert: str) -> str:
    return c.RUNBOOK_URL.format(alert=alert)


def figure(metric: str, labels: tuple[str, ...], fmt: str, missing: str = "none") -> str:
    """An alert template that prints one series' current value, picked by the alert's own labels."""
    matchers = ",".join(f"{label}='%s'" for label in labels)
    args = " ".join(f"$labels.{label}" for label in labels)
    return (f'{{{{ with printf "{metric}{{{matchers}}}" {args} | query }}}}'
            f"{{{{ . | first | value | {fmt} }}}}{{{{ else }}}}{missing}{{{{ end }}}}")


def node_figure(metric: str, fmt: str, missing: str = "none") -> str:
    return figure(metric, (c.NODE_LABEL,), fmt, missing)


def device_figure(metric: str, fmt: str, missing: str = "none") -> str:
    return figure(metric, (c.NODE_LABEL, "device"), fmt, missing)


def io_pressure_high(no_psi_counts: bool) -> str:
    """Per node: IO pressure at or above the limits (exporter/thresholds.py io_pressure_high).

    With ``no_psi_counts``, a node whose kernel exports no IO PSI at all (before 4.20, or RHEL/Rocky
    8-9 unless booted with psi=1) counts too: an alert that requires pressure must not go silent for
    good there, and the disk figures alone decide.
    """
    parts = [f"{IO_SOME} >= {c.IO_PRESSURE_SOME:g}", f"{IO_FULL} >= {c.IO_PRESSURE_FULL:g}"]
    if no_psi_counts:
        parts.append(f"(count by ({c.NODE_LABEL}) (gpuio_disk_info{c.selector()}) unless {ON_NODE} {IO_SOME})")
    return "\nor\n".join(parts)


def indent(text: str, spaces: int = 2) -> str:
    return "\n".join(" " * spaces + line if line else line for line in text.splitlines())


def disk_recording_rules() -> list[Rule]:
    guard = f"{c.AWAIT_MIN_IOPS:g}"
    # An idle device's awaits have no value: dividing by (ops > 0) yields no series, never NaN.
    return [
        record(IO_SOME, rate("gpuio_pressure_io_waiting_seconds_total")),
        record(IO_FULL, rate("gpuio_pressure_io_stalled_seconds_total")),
        record(READS, rate("gpuio_disk_reads_completed_total")),
        record(WRITES, rate("gpuio_disk_writes_completed_total")),
        record(READ_BYTES, rate("gpuio_disk_read_bytes_total")),
        record(WRITTEN_BYTES, rate("gpuio_disk_written_bytes_total")),
        record(READ_AWAIT, f"{rate('gpuio_disk_read_time_seconds_total')}\n/\n"
                           f"({rate('gpuio_disk_reads_completed_total')} > 0)"),
        record(WRITE_AWAIT, f"{rate('gpuio_disk_write_time_seconds_total')}\n/\n"
                            f"({rate('gpuio_disk_writes_completed_total')} > 0)"),
        record(QUEUE, rate("gpuio_disk_io_time_weighted_seconds_total")),
        record(UTIL, rate("gpuio_disk_io_time_seconds_total")),
        # The await the alerts judge: the slower direction among those that completed at least
        # AWAIT_MIN_IOPS requests a second (one slow read on an idle disk is no evidence).
        record(AWAIT, "max without (direction) (\n"
                      f"  {direction(READ_AWAIT, READS, guard, 'read')}\n"
                      "  or\n"
                      f"  {direction(WRITE_AWAIT, WRITES, guard, 'write')}\n"
                      ")"),
        # Each device's class (exporter/thresholds.py disk_class) and its limits, one series per device:
        # NVMe and network block devices by name, then solid state where sysfs says rotational=0, and
        # rotational otherwise (an unknown device gets the lenient limits).  `or` keeps the first match.
        record(DISK_CLASS, class_expr(lambda name: f'label_replace({{}}, "class", "{name}", "", "")')),
        record(AWAIT_LIMIT, class_expr(lambda name: f"{c.DISK_CLASSES[name].await_seconds:g} * {{}}")),
        record(QUEUE_LIMIT, class_expr(lambda name: f"{c.DISK_CLASSES[name].queue_size:g} * {{}}")),
        # Saturated, as `gpuio top` flags it (thresholds.disk_flags): slow for its class, and a deep
        # queue or IO pressure.  The value is the await; devices that are not saturated have no series.
        record(SATURATED, f"({AWAIT} >= {TO_LIMIT} {AWAIT_LIMIT})\n"
                          f"and {ON_DEVICE}\n"
                          f"({QUEUE} >= {TO_LIMIT} {QUEUE_LIMIT})\n"
                          f"or\n"
                          f"({AWAIT} >= {TO_LIMIT} {AWAIT_LIMIT})\n"
                          f"and {ON_NODE}\n"
                          f"(\n{indent(io_pressure_high(no_psi_counts=False))}\n)"),
        # The device's own normal, from calm evaluations only: a storm never feeds its baseline.
        record(CALM_AWAIT, f"{AWAIT} unless {ON_DEVICE} {SATURATED}"),
        record(CALM_QUEUE, f"{QUEUE} unless {ON_DEVICE} {SATURATED}"),
        # No median for a device with calm evidence in less than BASELINE_MIN_COVERAGE of the window's
        # evaluations (QUEUE has a sample at every evaluation, so its count is the number of
        # evaluations at any interval): the alerts then fall back to the class limits.
        record(AWAIT_LEARNED, learned(CALM_AWAIT)),
        record(QUEUE_LEARNED, learned(CALM_QUEUE)),
        # Held through a storm: the last calm median, for up to BASELINE_HOLD.
        record(AWAIT_BASELINE, f"last_over_time({AWAIT_LEARNED}[{c.BASELINE_HOLD}])"),
        record(QUEUE_BASELINE, f"last_over_time({QUEUE_LEARNED}[{c.BASELINE_HOLD}])"),
        # The storm (DiskIOStorm's condition before its `for`; value: the await).
        record(STORM, storm_expr()),
    ]


def learned(calm: str) -> str:
    return (f"quantile_over_time(0.5, {calm}[{B}])\n"
            f"and\n"
            f"count_over_time({calm}[{B}])\n"
            f"  >= {c.BASELINE_MIN_COVERAGE:g} * count_over_time({QUEUE}[{B}])")


def direction(await_rule: str, ops_rule: str, guard: str, name: str) -> str:
    """An await where its direction completed at least ``guard`` requests/s, labelled direction=name."""
    return f'label_replace({await_rule} and ({ops_rule} >= {guard}), "direction", "{name}", "", "")'


def class_expr(shape: Callable[[str], str]) -> str:
    """One term per device class, ``shape(class)`` applied to that class's devices, joined by ``or``."""
    by = f"max by (job, {c.NODE_LABEL}, device)"
    selectors = [(name, c.selector(f'device=~"{pattern}"')) for name, pattern in c.DEVICE_NAME_CLASSES]
    selectors += [(thresholds.SOLID_STATE, c.selector('rotational="0"')), (thresholds.ROTATIONAL, c.selector())]
    return "\nor\n".join(shape(name).format(f"{by} (gpuio_disk_info{sel})") for name, sel in selectors)


def storm_expr() -> str:
    k = f"{c.STORM_BASELINE_FACTOR:g}"
    return "\n".join([
        f"({AWAIT} >= {TO_LIMIT} {AWAIT_LIMIT})",
        f"and {ON_DEVICE}",
        f"({QUEUE} >= {TO_LIMIT} {QUEUE_LIMIT})",
        "# far above its calm normal, or it has none (idle until now, or never calm)",
        f"and {ON_DEVICE}",
        "(",
        f"  {AWAIT} >= {k} * {AWAIT_BASELINE}",
        "  or",
        f"  ({AWAIT} unless {ON_DEVICE} {AWAIT_BASELINE})",
        ")",
        f"and {ON_DEVICE}",
        "(",
        f"  {QUEUE} >= {k} * {QUEUE_BASELINE}",
        "  or",
        f"  ({QUEUE} unless {ON_DEVICE} {QUEUE_BASELINE})",
        ")",
        f"and {ON_NODE}",
        f"(\n{indent(io_pressure_high(no_psi_counts=True))}\n)",
    ])


def disk_victims() -> str:
    """Per disk: who the storm hurts.  Engine loads in progress from it, engines on it starving their
    GPUs, or engines on it queueing work while all of the node's tasks stall on IO (PSI full)."""
    sel = c.selector()
    on_disk = f'label_replace(gpuio_engine_physical_device_info{sel}, "device", "$1", "physical_device", "(.+)")'
    return "\n".join([
        f"gpuio_disk_engine_loads_in_progress{sel} > 0",
        f"or {ON_DEVICE}",
        f'count by (job, {c.NODE_LABEL}, device) ({STARVED}{{device!=""}})',
        f"or {ON_DEVICE}",
        "(",
        f"  count by (job, {c.NODE_LABEL}, device) ({on_disk} and on ({c.NODE_LABEL}, engine) {WORK_WAITING})",
        f"  and {ON_NODE} ({IO_FULL} >= {c.STORM_PAGE_IO_FULL:g})",
        ")",
    ])


def engines_on(info: str, label: str, value_label: str) -> str:
    """An alert template listing the engines whose files are on the alert's disk or mount."""
    node = f"$labels.{c.NODE_LABEL}"
    return (f'{{{{ range printf "count by (engine) ({info}{{{c.NODE_LABEL}=\'%s\',{label}=\'%s\'}})" '
            f"{node} $labels.{value_label} | query | sortByLabel \"engine\" }}}}{{{{ .Labels.engine }}}} "
            f"{{{{ else }}}}none {{{{ end }}}}")


def gpus_on(info: str, label: str, value_label: str) -> str:
    """An alert template listing the GPUs of the engines whose files are on the alert's disk or mount: by
    NVML index and UUID where the node's GPU data joins, else by the UUID the engines' processes report."""
    node = f"$labels.{c.NODE_LABEL}"
    on_storage = f"on ({c.NODE_LABEL}, engine, path) {info}{{{c.NODE_LABEL}='%s',{label}='%s'}}"
    by_nvml = f"count by (gpu, uuid) ({ENGINE_GPU_BUSY}{{{c.NODE_LABEL}='%s'}} and {on_storage})"
    by_writer = f"count by (gpu_uuid) (gpuio_engine_info{{{c.NODE_LABEL}='%s',gpu_uuid!=''}} and {on_storage})"
    args = f"{node} {node} $labels.{value_label}"
    return (f'{{{{ range printf "{by_nvml}" {args} | query | sortByLabel "gpu" }}}}'
            f"GPU {{{{ .Labels.gpu }}}} ({{{{ .Labels.uuid }}}}) {{{{ else }}}}"
            f'{{{{ range printf "{by_writer}" {args} | query | sortByLabel "gpu_uuid" }}}}'
            f"{{{{ .Labels.gpu_uuid }}}} {{{{ else }}}}none known {{{{ end }}}}{{{{ end }}}}")


def starved_count(label: str) -> str:
    node = f"$labels.{c.NODE_LABEL}"
    return (f'{{{{ with printf "count({STARVED}{{{c.NODE_LABEL}=\'%s\',{label}=\'%s\'}})" {node} $labels.{label} '
            f'| query }}}}{{{{ . | first | value | printf "%.0f" }}}}{{{{ else }}}}0{{{{ end }}}}')


def starved_on(label: str) -> str:
    node = f"$labels.{c.NODE_LABEL}"
    return (f'{{{{ range printf "{STARVED}{{{c.NODE_LABEL}=\'%s\',{label}=\'%s\'}}" {node} $labels.{label} '
            f'| query | sortByLabel "gpu" }}}}{{{{ .Labels.engine }}}} on GPU {{{{ .Labels.gpu }}}} (busy '
            f"{{{{ .Value | humanizePercentage }}}}) {{{{ else }}}}none {{{{ end }}}}")


def disk_alerts() -> list[Rule]:
    node = f"$labels.{c.NODE_LABEL}"
    two_decimals = 'printf "%.2f"'
    baseline = device_figure(AWAIT_BASELINE, "humanizeDuration", "none: no calm evidence")
    loads = (f"sum(increase(gpuio_engine_load_read_seconds_count{{{c.NODE_LABEL}='%s'}}"
             f"[{c.STORM_ENGINE_LOADS_WINDOW}]) and on ({c.NODE_LABEL}, engine) "
             f"gpuio_engine_physical_device_info{{{c.NODE_LABEL}='%s',physical_device='%s'}})")
    engine_loads = (f'{{{{ with printf "{loads}" {node} {node} $labels.device | query }}}}'
                    f'{{{{ . | first | value | printf "%.0f" }}}}{{{{ else }}}}0{{{{ end }}}}')
    disk_class = label_of(DISK_CLASS, "class", (c.NODE_LABEL, "device"), "?")
    figures = (f"Requests on {{{{ $labels.device }}}} ({disk_class}) at {{{{ {node} }}}} wait "
               f"{{{{ $value | humanizeDuration }}}} (its calm median: {baseline}) "
               f"with {device_figure(QUEUE, two_decimals)} requests queued "
               f"(calm median {device_figure(QUEUE_BASELINE, two_decimals, 'none')}); "
               f"tasks on the node waited on IO {node_figure(IO_SOME, 'humanizePercentage', 'n/a (no PSI)')} "
               f"of the time (all of them at once: {node_figure(IO_FULL, 'humanizePercentage', 'n/a')}).")
    loads_waiting = device_figure("gpuio_disk_engine_loads_in_progress", COUNT, "0")
    oldest = device_figure("gpuio_disk_engine_load_oldest_in_progress_seconds", "humanizeDuration", "-")
    info = "gpuio_engine_physical_device_info"
    board = c.dashboard_url(c.DISK_IO_UID, instance=f"{{{{ {node} }}}}", device="{{ $labels.device }}")
    return [
        alert(
            "DiskIOStorm", STORM, c.STORM_FOR, c.WARNING,
            f"IO storm on {{{{ $labels.device }}}} at {{{{ {node} }}}}: requests wait "
            f"{{{{ $value | humanizeDuration }}}}, far above its normal.",
            f"{figures} Engine loads from this disk that finished in the last {c.STORM_ENGINE_LOADS_WINDOW}: "
            f"{engine_loads}. This ticket is the storm itself; it pages (the same alert, severity critical) "
            f"while engine loads wait on the disk or engines on it starve their GPUs.",
            board),
        alert(
            "DiskIOStorm", f"{STORM}\nand {ON_DEVICE}\n(\n{indent(disk_victims())}\n)", c.STORM_PAGE_FOR,
            c.CRITICAL,
            f"IO storm on {{{{ $labels.device }}}} at {{{{ {node} }}}} hurts serving: {loads_waiting} engine "
            f"load(s) waiting, {starved_count('device')} engine(s) starving their GPU.",
            f"{figures} Engine loads waiting on this disk: {loads_waiting} (oldest in progress for {oldest}). "
            f"Starved engines: {starved_on('device')}. Engines with files on {{{{ $labels.device }}}}: "
            f"{engines_on(info, 'physical_device', 'device')}on GPUs: "
            f"{gpus_on(info, 'physical_device', 'device')}. Loads that finished in the last "
            f"{c.STORM_ENGINE_LOADS_WINDOW}: {engine_loads}.",
            board),
    ]


def exporter_alerts() -> list[Rule]:
    node = f"$labels.{c.NODE_LABEL}"
    failing = (
        f"1 - avg_over_time(gpuio_scrape_collector_success{c.selector()}[{c.COLLECTOR_FAILING_WINDOW}])"
        f" > {c.COLLECTOR_FAILING_RATIO:g}"
    )
    return [
        {
            "alert": "GpuioExporterDown",
            "expr": f"up{c.selector()} == 0",
            "for": c.EXPORTER_DOWN_FOR,
            "labels": {"severity": c.WARNING},
            "annotations": {
                "summary": f"gpuio-exporter on {{{{ {node} }}}} cannot be scraped.",
                "description": (
                    f"Prometheus has failed to scrape gpuio-exporter at {{{{ {node} }}}} (job {{{{ $labels.job }}}}) "
                    f"for {c.EXPORTER_DOWN_FOR}: the exporter, its node or the network to it is down. "
                    f"Until it is back, no disk, GPU or engine alert can fire for this node."
                ),
                "runbook_url": runbook("GpuioExporterDown"),
                "dashboard_url": c.dashboard_url(c.STARVATION_UID, instance=f"{{{{ {node} }}}}"),
            },
        },
        {
            "alert": "GpuioCollectorFailing",
            "expr": failing,
            "for": c.COLLECTOR_FAILING_FOR,
            "labels": {"severity": c.WARNING},
            "annotations": {
                "summary": f"gpuio collector {{{{ $labels.collector }}}} is failing on {{{{ {node} }}}}.",
                "description": (
                    f"The {{{{ $labels.collector }}}} collector of gpuio-exporter at {{{{ {node} }}}} failed in "
                    f"{{{{ $value | humanizePercentage }}}} of its scrapes over the last {c.COLLECTOR_FAILING_WINDOW}. "
                    f"Its series are missing or stale, and the alerts built on them cannot fire. "
                    f"The exporter's landing page (/) and its log show the error."
                ),
                "runbook_url": runbook("GpuioCollectorFailing"),
                "dashboard_url": c.dashboard_url(c.STARVATION_UID, instance=f"{{{{ {node} }}}}"),
            },
        },
    ]


def reason(expr: str, text: str, source_label: str = "", regex: str = "") -> str:
    """``expr`` with a ``reason`` label saying which condition it is (``$1``: a capture of source_label)."""
    return f'label_replace(\n{indent(expr)},\n  "reason", "{text}", "{source_label}", "{regex}"\n)'


def label_of(metric: str, label: str, labels: tuple[str, ...], missing: str = "", condition: str = "") -> str:
    """An alert template that prints a label of the first series of ``metric`` picked by the alert's labels."""
    matchers = ",".join(f"{name}='%s'" for name in labels)
    args = " ".join(f"$labels.{name}" for name in labels)
    return (f'{{{{ with printf "{metric}{{{matchers}}}{condition}" {args} | query }}}}'
            f'{{{{ with first . }}}}{{{{ label "{label}" . }}}}{{{{ end }}}}{{{{ else }}}}{missing}{{{{ end }}}}')


def smart_alerts() -> list[Rule]:
    node = f"$labels.{c.NODE_LABEL}"
    device = (c.NODE_LABEL, "device")
    g = c.SMART_GROWTH_WINDOW
    sel = c.selector()

    def grew(metric: str) -> str:
        # Above its lowest value of the window: the value is the count itself (not an extrapolated
        # increase), and a replaced disk that starts again from 0 is not "growth".
        return f"{metric}{sel} > min_over_time({metric}{sel}[{g}])"

    spare = "gpuio_smart_nvme_available_spare"
    factor = f"{c.NVME_SPARE_WARN_FACTOR:g}"
    conditions = [
        reason(f"gpuio_smart_health_passed{sel} == 0", "SMART overall health: FAILED"),
        reason(grew("gpuio_smart_ata_reallocated_sectors_total"), f"reallocated sectors grew in {g}"),
        reason(grew("gpuio_smart_ata_pending_sectors"), f"pending sectors grew in {g}"),
        reason(grew("gpuio_smart_ata_reported_uncorrectable_errors_total"),
               f"reported uncorrectable errors grew in {g}"),
        reason(grew("gpuio_smart_ata_offline_uncorrectable_sectors"),
               f"offline uncorrectable sectors grew in {g}"),
        reason(f"{spare}_ratio{sel} < {factor} * {spare}_threshold_ratio{sel}",
               f"NVMe available spare below {factor}x its threshold"),
        reason(f"gpuio_smart_nvme_critical_warning{sel} == 1", "NVMe critical warning: $1", "warning", "(.+)"),
        reason(grew("gpuio_smart_nvme_media_errors_total"), f"NVMe media errors grew in {g}"),
        reason(grew("gpuio_smart_scsi_grown_defects_total"), f"SCSI grown defects grew in {g}"),
        reason(grew("gpuio_smart_scsi_uncorrected_errors_total"), f"SCSI uncorrected $1 errors grew in {g}",
               "operation", "(.+)"),
    ]
    model = label_of("gpuio_smart_device_info", "model", device, "?")
    serial = label_of("gpuio_smart_device_info", "serial", device, "?")
    asleep = c.selector('state="asleep"')
    failing = c.selector('state=~"timeout|error|permission_denied"')
    stale = "\n".join([
        "(",
        f"  time() - gpuio_smart_last_success_timestamp_seconds{sel} > {c.SMART_STALE_AFTER_SECONDS}",
        f"  unless {ON_DEVICE}",
        f"  gpuio_smart_device_state{asleep} == 1",
        ")",
        "or",
        f"max without (state) (gpuio_smart_device_state{failing} == 1)",
    ])
    links = {
        "dashboard_url": c.dashboard_url(c.DISK_HEALTH_UID, instance=f"{{{{ {node} }}}}",
                                         device="{{ $labels.device }}"),
    }
    return [
        {
            "alert": "DiskHealthDegrading",
            "expr": "\nor\n".join(conditions),
            "for": c.SMART_HEALTH_FOR,
            "labels": {"severity": c.WARNING},
            "annotations": {
                "summary": f"Disk {{{{ $labels.device }}}} at {{{{ {node} }}}} is degrading: {{{{ $labels.reason }}}}.",
                "description": (
                    f"SMART of {{{{ $labels.device }}}} (model {model}, serial {serial}) at {{{{ {node} }}}}: "
                    f"{{{{ $labels.reason }}}} (now {{{{ $value | printf \"%.4g\" }}}}). A disk that remaps sectors "
                    f"or logs media errors retries its reads first: await rises and IO storms follow long before "
                    f"it fails. Plan its replacement and move engines and data off it."
                ),
                "runbook_url": runbook("DiskHealthDegrading"),
                **links,
            },
        },
        {
            "alert": "GpuioSmartDataStale",
            "expr": stale,
            "for": c.SMART_STALE_FOR,
            "labels": {"severity": c.WARNING},
            "annotations": {
                "summary": f"SMART data of {{{{ $labels.device }}}} at {{{{ {node} }}}} is stale.",
                "description": (
                    f"gpuio has not read the SMART values of {{{{ $labels.device }}}} at {{{{ {node} }}}} for "
                    + figure("time() - gpuio_smart_last_success_timestamp_seconds", device, "humanizeDuration",
                             "as long as it has run")
                    + "; last poll: "
                    + label_of("gpuio_smart_device_state", "state", device, "unknown", " == 1")
                    + ". DiskHealthDegrading cannot fire for this disk until it is read again."
                ),
                "runbook_url": runbook("GpuioSmartDataStale"),
                **links,
            },
        },
    ]


def alert(name: str, expr: str, duration: str | None, severity: str, summary: str, description: str,
          dashboard: str) -> Rule:
    rule: Rule = {"alert": name, "expr": expr}
    if duration:
        rule["for"] = duration
    rule["labels"] = {"severity": severity}
    rule["annotations"] = {"summary": summary, "description": description, "runbook_url": runbook(name),
                           "dashboard_url": dashboard}
    return rule


NODE = f"{{{{ $labels.{c.NODE_LABEL} }}}}"
ONE_DECIMAL = 'printf "%.1f"'
COUNT = 'printf "%.0f"'
WITH_GPU = c.selector('gpu_uuid!=""')
GPU_NAME = "GPU {{ $labels.gpu }} ({{ $labels.uuid }})"
GPU_LABELS = (c.NODE_LABEL, "gpu")


def starvation_board(**variables: str) -> str:
    return c.dashboard_url(c.STARVATION_UID, instance=NODE, **variables)


def gpu_board(**variables: str) -> str:
    return c.dashboard_url(c.GPU_UID, instance=NODE, **variables)


def engines_board(**variables: str) -> str:
    return c.dashboard_url(c.ENGINES_UID, instance=NODE, **variables)


def gpu_recording_rules() -> list[Rule]:
    sel = c.selector()
    stale = "\n".join([
        f"max by (job, {c.NODE_LABEL}) (max_over_time(gpuio_gpu_snapshot_age_seconds{sel}[{W}]))",
        f"  > {c.GPU_STALE_AFTER_SECONDS}",
        "or",
        f"max by (job, {c.NODE_LABEL}) (",
        f"  1 - min_over_time({NVML_SUCCESS}[{W}]) > 0",
        ")",
    ])
    return [
        record(GPU_BUSY, rate("gpuio_gpu_busy_seconds_total")),
        # Mostly idle: NVML busy low, or few SMs working where GPM measures it (busy reads 100 % while
        # one thread spins or weights cross PCIe).  Value: the busy ratio, else the SM activity.
        record(GPU_IDLE, f'{GPU_BUSY} < {c.GPU_BUSY_LOW:g}\nor\n'
                         f'{rate("gpuio_gpu_sm_active_seconds_total")} < {c.GPU_SM_ACTIVE_LOW:g}'),
        # Nodes whose GPU readings are not to be trusted: the NVML snapshot was older than
        # GPU_STALE_AFTER_SECONDS, or the nvml collector failed, at some scrape within RATE_WINDOW
        # (a frozen busy counter reads as an idle GPU).  No starvation alert judges their GPUs.
        # Value: the age, or the share of failed scrapes.
        record(GPU_STALE, stale),
    ]


def gpu_alerts() -> list[Rule]:
    sel = c.selector()
    reasons = "|".join(c.GPU_THROTTLE_REASONS)
    throttled = "\n".join([
        f"rate(gpuio_gpu_clocks_event_seconds_total{c.selector(f'reason=~{chr(34)}{reasons}{chr(34)}')}"
        f"[{c.GPU_THROTTLE_WINDOW}]) > {c.GPU_THROTTLE_RATIO:g}",
        "or",
        "# reasons (or GPUs) without a violation counter: the sampled reason itself",
        f"(gpuio_gpu_clocks_event_reason_active{c.selector(f'reason=~{chr(34)}{reasons}{chr(34)}')} == 1",
        f"  unless on ({c.NODE_LABEL}, gpu, reason) gpuio_gpu_clocks_event_seconds_total{sel})",
    ])
    degraded = "\n".join([
        f"gpuio_gpu_pcie_link_width{sel} < gpuio_gpu_pcie_link_width_max{sel}",
        "or",
        f"(gpuio_gpu_pcie_link_generation{sel} < gpuio_gpu_pcie_link_generation_max{sel})",
        f"  and on ({c.NODE_LABEL}, gpu) {GPU_BUSY} >= {c.PCIE_GENERATION_BUSY:g}",
    ])
    app_xids = "|".join(c.XID_APPLICATION)
    xid = (f"time() - gpuio_gpu_xid_last_timestamp_seconds{c.selector(f'xid!~{chr(34)}{app_xids}{chr(34)}')}"
           f" < {c.XID_RECENT_SECONDS}")
    ecc_window = c.GPU_ECC_WINDOW
    uncorrected = "gpuio_gpu_ecc_errors_total" + c.selector('error="uncorrected"')
    ecc = "\nor\n".join([
        reason(f"{uncorrected} > min_over_time({uncorrected}[{ecc_window}])",
               f"uncorrectable ECC errors in the last {ecc_window}"),
        reason(f"gpuio_gpu_remapped_rows_pending{sel} == 1", "a row remap waits for a GPU reset"),
        reason(f"gpuio_gpu_remapped_rows_failure{sel} == 1", "a row remap failed"),
    ])
    width = figure("gpuio_gpu_pcie_link_width", GPU_LABELS, "printf \"%.0f\"", "?")
    width_max = figure("gpuio_gpu_pcie_link_width_max", GPU_LABELS, "printf \"%.0f\"", "?")
    gen = figure("gpuio_gpu_pcie_link_generation", GPU_LABELS, "printf \"%.0f\"", "?")
    gen_max = figure("gpuio_gpu_pcie_link_generation_max", GPU_LABELS, "printf \"%.0f\"", "?")
    xid_count = figure("gpuio_gpu_xid_errors_total", (*GPU_LABELS, "xid"), "printf \"%.0f\"", "?")
    this_gpu = gpu_board(gpu="{{ $labels.gpu }}")
    missing = f"{{{{ $value | {COUNT} }}}}"
    return [
        alert("GPULost", f"gpuio_gpu_up{sel} == 0", c.GPU_LOST_FOR, c.CRITICAL,
              f"{GPU_NAME} at {NODE} is lost.",
              f"{GPU_NAME} at {NODE} does not answer NVML: it is lost, needs a reset, or fell off the bus "
              f"(Xid 79). Its work has stopped; anything scheduled on it fails or waits.", this_gpu),
        alert("GPUMissing",
              f"max_over_time(gpuio_gpu_devices{sel}[{c.GPU_MISSING_WINDOW}]) - gpuio_gpu_devices{sel} > 0",
              c.GPU_LOST_FOR, c.CRITICAL,
              f"{missing} GPU(s) missing at {NODE}.",
              f"NVML at {NODE} enumerates {node_figure('gpuio_gpu_devices', COUNT, '?')} GPU(s), {missing} fewer "
              f"than in the last {c.GPU_MISSING_WINDOW}: a GPU fell off the bus, or the driver has not seen it "
              f"since a restart, so no gpuio_gpu_up series is left to go to 0. Work scheduled for it fails or "
              f"waits. After a planned removal, silence this for {c.GPU_MISSING_WINDOW}.", gpu_board()),
        alert("GPUThrottled", throttled, c.GPU_THROTTLE_FOR, c.WARNING,
              f"{GPU_NAME} at {NODE} is throttled: {{{{ $labels.reason }}}}.",
              f"Clocks of {GPU_NAME} at {NODE} are held down by {{{{ $labels.reason }}}} "
              f"(share of the last {c.GPU_THROTTLE_WINDOW}: {{{{ $value | humanizePercentage }}}}; 1 = active now "
              f"where the GPU has no counter). Work on it runs slower; this is heat or power delivery, "
              f"not the disk.", this_gpu),
        alert("GPUPCIeLinkDegraded", degraded, c.PCIE_DEGRADED_FOR, c.WARNING,
              f"PCIe link of {GPU_NAME} at {NODE} is degraded.",
              f"The PCIe link of {GPU_NAME} at {NODE} runs at x{width} of x{width_max}, Gen {gen} of "
              f"Gen {gen_max} (generation judged only while the GPU is busy: it downshifts when idle). "
              f"Host-to-GPU copies (engine loads, inputs) are slower.", this_gpu),
        alert("GPUXidError", xid, None, c.WARNING,
              f"Xid {{{{ $labels.xid }}}} on {GPU_NAME} at {NODE}.",
              f"{GPU_NAME} at {NODE} reported Xid {{{{ $labels.xid }}}} {{{{ $value | humanizeDuration }}}} ago "
              f"({xid_count} since the exporter started). Xids {', '.join(c.XID_APPLICATION)} (application "
              f"faults) do not alert.", this_gpu),
        alert("GPUECCUncorrectable", ecc, None, c.WARNING,
              f"{GPU_NAME} at {NODE}: {{{{ $labels.reason }}}}.",
              f"Memory of {GPU_NAME} at {NODE}: {{{{ $labels.reason }}}} (now {{{{ $value | printf \"%.4g\" }}}}). "
              f"Work on it may have been killed or computed on bad memory; drain it and reset it.", this_gpu),
    ]


def gpu_data_stale() -> Rule:
    return (
alert("GpuioGPUDataStale", GPU_STALE, c.GPU_STALE_FOR, c.WARNING,
              f"GPU data of gpuio at {NODE} is stale or failing.",
              f"The NVML snapshot gpuio-exporter serves at {NODE} is "
              f"{node_figure('gpuio_gpu_snapshot_age_seconds', 'humanizeDuration', '?')} old (stale after "
              f"{c.GPU_STALE_AFTER_SECONDS}s), or its nvml collector failed (success now: "
              f"{NVML_SUCCESS_NOW}"
              f"): NVML calls are slow, hanging or failing, and a frozen busy counter reads as an idle GPU. No "
              f"starvation alert judges this node's GPUs until the data is fresh again.", gpu_board())
    )


def node_gpu_starved() -> Rule:
    expr = "\n".join([
        GPU_IDLE,
        "# the GPU has work: compute processes hold it",
        f"and on ({c.NODE_LABEL}, gpu) (gpuio_gpu_processes{c.selector()} > 0)",
        "# and a disk of the node is saturated",
        f"and on ({c.NODE_LABEL}) count by ({c.NODE_LABEL}) ({SATURATED})",
        "# GPUs whose engines report are judged by GPUStarvedByDiskIO instead",
        f"unless on ({c.NODE_LABEL}, uuid)",
        f'  label_replace(gpuio_engine_info{WITH_GPU}, "uuid", "$1", "gpu_uuid", "(.+)")',
        "# a frozen or failing NVML reading is no evidence of an idle GPU",
        f"unless on ({c.NODE_LABEL}) {GPU_STALE}",
    ])
    disks = (f'{{{{ range printf "{SATURATED}{{{c.NODE_LABEL}=\'%s\'}}" $labels.{c.NODE_LABEL} | query }}}}'
             f"{{{{ .Labels.device }}}} (await {{{{ .Value | humanizeDuration }}}}) {{{{ end }}}}")
    return alert(
        "NodeGPUStarvedByIO", expr, c.NODE_STARVED_FOR, c.WARNING,
        f"{GPU_NAME} at {NODE} is mostly idle while a disk of the node is saturated.",
        f"{GPU_NAME} at {NODE} is active only {{{{ $value | humanizePercentage }}}} (NVML busy, or SM activity "
        f"where GPM measures it) although compute "
        f"processes hold it, while these disks are saturated: {disks}- its data loader is probably "
        f"waiting on IO. No engine reports for this GPU, so this is the node-level guess.",
        starvation_board(gpu="{{ $labels.gpu }}"))


def engine_waiting_rules() -> list[Rule]:
    sel = c.selector()
    per_gpu = f"job, {c.NODE_LABEL}, engine, gpu_uuid"

    busy = "\n".join([
        f"max by (job, {c.NODE_LABEL}, engine, path, gpu, uuid) (",
        f'  label_replace(gpuio_engine_info{WITH_GPU}, "uuid", "$1", "gpu_uuid", "(.+)")',
        f"  * on ({c.NODE_LABEL}, uuid) group_left (gpu)",
        f"  {GPU_BUSY}",
        ")",
    ])
    disk = "\n".join([
        f"topk by (job, {c.NODE_LABEL}, engine, path) (1,",
        f"  max by (job, {c.NODE_LABEL}, engine, path, device) (",
        f'    label_replace(gpuio_engine_physical_device_info{sel}, "device", "$1", "physical_device", "(.+)")',
        f"    * on ({c.NODE_LABEL}, device) group_left ()",
        f"    {SATURATED}",
        "  )",
        ")",
    ])
    mount = "\n".join([
        f"topk by (job, {c.NODE_LABEL}, engine, path) (1,",
        f"  max by (job, {c.NODE_LABEL}, engine, path, mountpoint) (",
        f"    gpuio_engine_mount_info{sel}",
        f"    * on ({c.NODE_LABEL}, mountpoint) group_left ()",
        f"    {MOUNT_SLOW}",
        "  )",
        ")",
    ])
    storage_slow = f"({ENGINE_DISK_SATURATED} or {ENGINE_MOUNT_SLOW})"
    rules = [
        # Each engine file's GPU and its busy ratio (one series per engine, path and GPU).
        record(ENGINE_GPU_BUSY, busy),
        # The worst saturated disk under each engine file, named in `device`; none while no disk is.
        record(ENGINE_DISK_SATURATED, disk),
        # The slow network or FUSE mount under each engine file, named in `mountpoint`.
        record(ENGINE_MOUNT_SLOW, mount),
        # Per engine and GPU (the writer's GPU, gpu_uuid): one replica's queue is not another's.
        record(ENGINE_IN_FLIGHT, f"avg_over_time(gpuio_engine_inferences_in_flight{sel}[{W}])"),
        record(ENGINE_POOL_WAIT, f"{rate('gpuio_engine_pool_wait_seconds_sum')}\n/\n"
                                 f"({rate('gpuio_engine_pool_wait_seconds_count')} > 0)"),
    ]
    for q in (0.5, 0.95, 0.99):
        rule = record(ENGINE_LATENCY, f"histogram_quantile({q:g}, sum by ({per_gpu}, le) "
                                      f"({rate('gpuio_engine_inference_seconds_bucket')}))")
        rule["labels"] = {"quantile": f"{q:g}"}
        rules.append(rule)
    p99 = f'max without (quantile) ({ENGINE_LATENCY}{{quantile="0.99"}})'
    rules += [
        # The engine's normal p99, from evaluations in which its storage was not slow (held like the
        # disk baselines): a storm never becomes the latency it is compared with.
        record(ENGINE_LATENCY_CALM, f"{p99}\nunless on ({c.NODE_LABEL}, engine)\n{storage_slow}"),
        record(ENGINE_LATENCY_LEARNED, learned_from(ENGINE_LATENCY_CALM, p99)),
        record(ENGINE_LATENCY_BASELINE, f"last_over_time({ENGINE_LATENCY_LEARNED}[{c.BASELINE_HOLD}])"),
        # Work queueing for an engine on one GPU, one series per reason.  Never "a request is in
        # flight": a spare replica serving a request now and then is idle, not starved.
        record(WORK_WAITING, "\nor\n".join([
            reason(f"{ENGINE_POOL_WAIT} >= {c.ENGINE_POOL_WAIT_SECONDS:g}", "pool wait"),
            reason(f"{ENGINE_IN_FLIGHT}\n  >= on ({c.NODE_LABEL}, engine, gpu_uuid)\n"
                   f"(gpuio_engine_pool_contexts{sel} > 0)", "in flight >= contexts"),
            reason(f"{p99}\n  >= on ({c.NODE_LABEL}, engine, gpu_uuid) "
                   f"({c.ENGINE_LATENCY_FACTOR:g} * {ENGINE_LATENCY_BASELINE})",
                   f"p99 latency >= {c.ENGINE_LATENCY_FACTOR:g}x its normal"),
            reason(f"gpuio_engine_loads_in_progress{sel} > 0", "loading"),
        ])),
        # Starved: the engine's GPU mostly idle, work waiting for the engine on that GPU, its storage
        # saturated (a disk, named in `device`) or slow (a network mount, named in `mountpoint`), and
        # the node's GPU data fresh.  Value: the GPU's activity (GPU_IDLE).  GPUStarvedByDiskIO is this for `for`.
        record(STARVED, "\n".join([
            "(",
            f"  (0 * {ENGINE_GPU_BUSY} + on ({c.NODE_LABEL}, uuid) group_left () {GPU_IDLE})",
            f"  + on ({c.NODE_LABEL}, engine, path) group_left (device) (0 * {ENGINE_DISK_SATURATED})",
            "  or",
            f"  (0 * {ENGINE_GPU_BUSY} + on ({c.NODE_LABEL}, uuid) group_left () {GPU_IDLE})",
            f"  + on ({c.NODE_LABEL}, engine, path) group_left (mountpoint) (0 * {ENGINE_MOUNT_SLOW})",
            ")",
            f"and on ({c.NODE_LABEL}, engine, uuid)",
            f'  label_replace({WORK_WAITING}, "uuid", "$1", "gpu_uuid", "(.+)")',
            f"unless on ({c.NODE_LABEL}) {GPU_STALE}",
        ])),
    ]
    return rules


def engine_load_rules() -> list[Rule]:
    sel = c.selector()
    lw = c.ENGINE_LOAD_WINDOW

    def increase(metric: str) -> str:
        return f"increase({metric}{sel}[{lw}])"

    return [
        # Cold starts that finished in the window: mean seconds per load (read + deserialize), the
        # read (disk) part, and the read throughput.
        record(ENGINE_LOAD, f"({increase('gpuio_engine_load_read_seconds_sum')}\n"
                            f" + {increase('gpuio_engine_load_deserialize_seconds_sum')})\n"
                            f"/\n({increase('gpuio_engine_load_read_seconds_count')} > 0)"),
        record(ENGINE_LOAD_READ, f"{increase('gpuio_engine_load_read_seconds_sum')}\n"
                                 f"/\n({increase('gpuio_engine_load_read_seconds_count')} > 0)"),
        record(ENGINE_LOAD_THROUGHPUT, f"{increase('gpuio_engine_load_read_bytes_total')}\n"
                                       f"/\n({increase('gpuio_engine_load_read_seconds_sum')} > 0)"),
    ]


def learned_from(calm: str, every: str) -> str:
    """The median of ``calm`` over BASELINE_WINDOW where it covers enough of ``every``'s evaluations."""
    return (f"quantile_over_time(0.5, {calm}[{B}])\n"
            f"and\n"
            f"count_over_time({calm}[{B}])\n"
            f"  >= {c.BASELINE_MIN_COVERAGE:g} * count_over_time(({every})[{B}:])")


def engine_gpu_figure(metric: str, fmt: str, missing: str) -> str:
    """An alert template: ``metric`` of the alert's engine on the alert's GPU (labels engine, uuid)."""
    node = f"$labels.{c.NODE_LABEL}"
    return (f'{{{{ with printf "{metric}{{{c.NODE_LABEL}=\'%s\',engine=\'%s\',gpu_uuid=\'%s\'}}" {node} '
            f"$labels.engine $labels.uuid | query }}}}{{{{ . | first | value | {fmt} }}}}{{{{ else }}}}{missing}"
            f"{{{{ end }}}}")


def starved_alert() -> Rule:
    node = f"$labels.{c.NODE_LABEL}"
    device_labels = (c.NODE_LABEL, "device")
    reasons = (f'{{{{ range printf "{WORK_WAITING}{{{c.NODE_LABEL}=\'%s\',engine=\'%s\',gpu_uuid=\'%s\'}}" '
               f'{node} $labels.engine $labels.uuid | query | sortByLabel "reason" }}}}{{{{ .Labels.reason }}}}; '
               f"{{{{ end }}}}")
    mount = (c.NODE_LABEL, "mountpoint")
    oldest = figure("gpuio_mount_engine_load_oldest_in_progress_seconds", mount, "humanizeDuration", "none")
    storage = ("{{ if $labels.device }}the disk under {{ $labels.path }}, {{ $labels.device }}, is saturated: "
               f"await {figure(AWAIT, device_labels, 'humanizeDuration', '?')}, "
               f"{figure(QUEUE, device_labels, ONE_DECIMAL, '?')} requests queued"
               "{{ else }}the network mount under {{ $labels.path }}, {{ $labels.mountpoint }}, is slow: "
               f"NFS READ round trip {figure(NFS_READ_RTT, mount, 'humanizeDuration', 'n/a')}, "
               f"oldest engine load in progress {oldest}"
               f"{{{{ end }}}}; IO pressure on the node {node_figure(IO_SOME, 'humanizePercentage', 'n/a (no PSI)')}")
    return alert(
        "GPUStarvedByDiskIO", STARVED, c.STARVED_FOR, c.CRITICAL,
        f"Engine {{{{ $labels.engine }}}} on GPU {{{{ $labels.gpu }}}} at {NODE} is starved by "
        f"{{{{ $labels.device }}}}{{{{ $labels.mountpoint }}}}.",
        f"GPU {{{{ $labels.gpu }}}} ({{{{ $labels.uuid }}}}) at {NODE} is active only "
        f"{{{{ $value | humanizePercentage }}}} (NVML busy, or SM activity where GPM measures it) while work "
        f"queues for engine {{{{ $labels.engine }}}} on it "
        f"({reasons}in flight: {engine_gpu_figure(ENGINE_IN_FLIGHT, ONE_DECIMAL, '0')}, contexts: "
        f"{engine_gpu_figure('gpuio_engine_pool_contexts', COUNT, 'n/a')}, pool wait: "
        f"{engine_gpu_figure(ENGINE_POOL_WAIT, 'humanizeDuration', 'none')}, loads in progress: "
        f"{engine_gpu_figure('gpuio_engine_loads_in_progress', COUNT, '0')}), and {storage}.",
        starvation_board(gpu="{{ $labels.gpu }}", engine="{{ $labels.engine }}"))


def engine_alerts() -> list[Rule]:
    sel = c.selector()
    engine_labels = (c.NODE_LABEL, "engine")
    w = c.SPOOL_ERRORS_WINDOW
    spool = "\n".join([
        f"gpuio_engine_spool_errors_total{sel} - gpuio_engine_spool_errors_total{sel} offset {w} > 0",
        "or",
        "# a reason seen for the first time: its series starts at 1",
        f"(gpuio_engine_spool_errors_total{sel} unless gpuio_engine_spool_errors_total{sel} offset {w})",
    ])
    cold = "\n".join([
        f"{ENGINE_LOAD} > {c.ENGINE_LOAD_SLOW_SECONDS:g}",
        "or",
        "# a load still in progress for longer than that (the loads of a cold-start storm, while it lasts)",
        f"max by (job, {c.NODE_LABEL}, engine) (gpuio_engine_load_oldest_in_progress_seconds{sel})",
        f"  > {c.ENGINE_LOAD_SLOW_SECONDS:g}",
    ])
    return [
        alert(
            "EngineColdStartSlow", cold, None, c.WARNING,
            f"Engine {{{{ $labels.engine }}}} at {NODE} takes {{{{ $value | humanizeDuration }}}} to load.",
            f"Loads of engine {{{{ $labels.engine }}}} at {NODE} take {{{{ $value | humanizeDuration }}}} "
            f"(the mean of those that finished in the last {c.ENGINE_LOAD_WINDOW}, or the oldest still in "
            f"progress; over {c.ENGINE_LOAD_SLOW_SECONDS:g}s); reading the file took "
            f"{figure(ENGINE_LOAD_READ, engine_labels, 'humanizeDuration', '?')} of it, at "
            f"{figure(ENGINE_LOAD_THROUGHPUT, engine_labels, 'humanize1024', '?')}B/s. The rest is "
            f"deserialization. Until loads finish, the GPU behind them waits.",
            engines_board(engine="{{ $labels.engine }}")),
        alert(
            "GpuioEngineSpoolErrors", spool, None, c.WARNING,
            f"gpuio at {NODE} skips damaged engine spool files ({{{{ $labels.reason }}}}).",
            f"gpuio-exporter at {NODE} found {{{{ $value | printf \"%.0f\" }}}} more spool file(s) it could "
            f"not read in the last {w} (reason {{{{ $labels.reason }}}}): the engine metrics of those "
            f"inference processes are missing or incomplete.", engines_board()),
    ]


def mount_recording_rules() -> list[Rule]:
    sel = c.selector()
    read = c.selector('operation="READ"')
    rtt = "\n".join([
        f"max by (job, {c.NODE_LABEL}, mountpoint) (",
        f"  rate(gpuio_mountstats_nfs_operations_response_time_seconds_total{read}[{W}])",
        "  /",
        f"  (rate(gpuio_mountstats_nfs_operations_requests_total{read}[{W}]) >= {c.AWAIT_MIN_IOPS:g})",
        ")",
    ])
    slow = "\n".join([
        "(",
        f"  {NFS_READ_RTT} >= {c.NFS_READ_RTT_SLOW_SECONDS:g}",
        "  or",
        f"  max by (job, {c.NODE_LABEL}, mountpoint) (gpuio_mount_engine_load_oldest_in_progress_seconds{sel})",
        f"    >= {c.ENGINE_LOAD_SLOW_SECONDS:g}",
        ")",
        "# network and FUSE mounts only",
        f"and on ({c.NODE_LABEL}, mountpoint) gpuio_mount_info{sel}",
        f"and {ON_NODE}",
        f"(\n{indent(io_pressure_high(no_psi_counts=True))}\n)",
    ])
    return [
        # Mean round trip of an NFS READ per mount (node_exporter's mountstats semantics): requests
        # under AWAIT_MIN_IOPS a second give no series.
        record(NFS_READ_RTT, rtt),
        record(NFS_READ_BYTES, f"sum by (job, {c.NODE_LABEL}, mountpoint) "
                               f"(rate(gpuio_mountstats_nfs_read_bytes_total{sel}[{W}]))"),
        # A slow network mount: READs with a slow round trip, or an engine load on it crawling for longer
        # than ENGINE_LOAD_SLOW_SECONDS, while the node stalls on IO.  Value: the RTT or the load's age.
        record(MOUNT_SLOW, slow),
    ]


def mount_alerts() -> list[Rule]:
    node = f"$labels.{c.NODE_LABEL}"
    mount = (c.NODE_LABEL, "mountpoint")
    info = "gpuio_engine_mount_info"
    sel = c.selector()
    loads_waiting = figure("gpuio_mount_engine_loads_in_progress", mount, COUNT, "0")
    oldest = figure("gpuio_mount_engine_load_oldest_in_progress_seconds", mount, "humanizeDuration", "-")
    fstype = label_of("gpuio_mount_info", "fstype", mount, "?")
    source = label_of("gpuio_mount_info", "source", mount, "?")
    figures = (f"The {fstype} mount {{{{ $labels.mountpoint }}}} ({source}) at {{{{ {node} }}}} is slow: NFS READ "
               f"round trip {figure(NFS_READ_RTT, mount, 'humanizeDuration', 'n/a (not NFS, or idle)')}, reading "
               f"{figure(NFS_READ_BYTES, mount, 'humanize1024', 'n/a')}B/s; the oldest engine load in progress on "
               f"it started {oldest} ago; tasks on the node waited on IO "
               f"{node_figure(IO_SOME, 'humanizePercentage', 'n/a (no PSI)')} of the time.")
    victims = "\n".join([
        f"gpuio_mount_engine_loads_in_progress{sel} > 0",
        f"or on ({c.NODE_LABEL}, mountpoint)",
        f'count by (job, {c.NODE_LABEL}, mountpoint) ({STARVED}{{mountpoint!=""}})',
    ])
    board = starvation_board()
    return [
        alert("MountIOStorm", MOUNT_SLOW, c.STORM_FOR, c.WARNING,
              f"Network storage {{{{ $labels.mountpoint }}}} at {{{{ {node} }}}} is slow.",
              f"{figures} This ticket is the slow mount itself; it pages (the same alert, severity critical) "
              f"while engine loads wait on it or engines on it starve their GPUs.", board),
        alert("MountIOStorm", f"{MOUNT_SLOW}\nand on ({c.NODE_LABEL}, mountpoint)\n(\n{indent(victims)}\n)",
              c.STORM_PAGE_FOR, c.CRITICAL,
              f"Network storage {{{{ $labels.mountpoint }}}} at {{{{ {node} }}}} is slow and hurts serving: "
              f"{loads_waiting} engine load(s) waiting, {starved_count('mountpoint')} engine(s) starving their GPU.",
              f"{figures} Engine loads waiting on it: {loads_waiting}. Starved engines: "
              f"{starved_on('mountpoint')}. Engines with files on it: {engines_on(info, 'mountpoint', 'mountpoint')}"
              f"on GPUs: {gpus_on(info, 'mountpoint', 'mountpoint')}.", board),
    ]


def rule_files() -> dict[str, dict[str, Any]]:
    """rules/<name>.yml -> its content.

    starvation.yml is ONE group on purpose: the storm and starvation alerts chain recording rules of
    several sources (disk -> mount -> engine on its GPU -> storm victims), and only rules of one group
    run in a fixed order at one timestamp.  Split over groups, each link could see the previous
    evaluation of the one before (Prometheus runs groups independently): first firing would wobble by
    an evaluation per link, and promtool's tests with it.
    """
    return {
        "starvation": {"groups": [
            {"name": "gpuio.starvation", "rules": [
                *disk_recording_rules(), *gpu_recording_rules(), *mount_recording_rules(), *engine_waiting_rules(),
                *disk_alerts(), *mount_alerts(), starved_alert(), node_gpu_starved(), gpu_data_stale(),
            ]},
        ]},
        "gpu": {"groups": [
            {"name": "gpuio.gpu.alerts", "rules": gpu_alerts()},
        ]},
        "engines": {"groups": [
            {"name": "gpuio.engines.rules", "rules": engine_load_rules()},
            {"name": "gpuio.engines.alerts", "rules": engine_alerts()},
        ]},
        "smart": {"groups": [
            {"name": "gpuio.smart.alerts", "rules": smart_alerts()},
        ]},
        "exporter": {"groups": [
            {"name": "gpuio.exporter.alerts", "rules": exporter_alerts()},
        ]},
    }


def alerts() -> list[Rule]:
    return [rule for content in rule_files().values() for group in content["groups"]
            for rule in group["rules"] if "alert" in rule]
