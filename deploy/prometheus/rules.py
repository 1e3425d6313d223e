"""gpuio's recording rules and alerts, as data built from config.py.

``python -m deploy.prometheus.generate`` writes them to rules/<source>.yml.  One file per metric
source (disk, gpu, engines, smart, exporter), each holding that source's recording group and alert
group.  Recording rules are named ``level:metric:operations``
(https://prometheus.io/docs/practices/rules/): ``instance_device:gpuio_disk_reads_completed:rate1m`` is
the per-second rate over RATE_WINDOW of gpuio_disk_reads_completed_total, one series per node and
device.  Rules in a group run in order at one timestamp, so a rule may use the ones above it.
"""

from __future__ import annotations

from typing import Any

from . import config as c

Rule = dict[str, Any]
W = c.RATE_WINDOW
ON_DEVICE = f"on ({c.NODE_LABEL}, device)"
ON_NODE = f"on ({c.NODE_LABEL})"
# Comparing with a per-device limit: group_left keeps every label of the left side (with a plain
# `on`, a one-to-one comparison would keep only the `on` labels and drop job and target labels).
TO_LIMIT = f"{ON_DEVICE} group_left ()"

# Recording-rule names, used by the alerts below and by the dashboards.
READS = f"instance_device:gpuio_disk_reads_completed:rate{W}"
WRITES = f"instance_device:gpuio_disk_writes_completed:rate{W}"
READ_BYTES = f"instance_device:gpuio_disk_read_bytes:rate{W}"
WRITTEN_BYTES = f"instance_device:gpuio_disk_written_bytes:rate{W}"
READ_AWAIT = f"instance_device:gpuio_disk_read_await_seconds:rate{W}"
WRITE_AWAIT = f"instance_device:gpuio_disk_write_await_seconds:rate{W}"
QUEUE = f"instance_device:gpuio_disk_io_time_weighted_seconds:rate{W}"  # aqu-sz
UTIL = f"instance_device:gpuio_disk_io_time_seconds:rate{W}"  # %util / 100
AWAIT = f"instance_device:gpuio_disk_await_seconds:max_rate{W}"
AWAIT_BASELINE = f"instance_device:gpuio_disk_await_seconds:median{c.BASELINE_WINDOW}"
QUEUE_BASELINE = f"instance_device:gpuio_disk_io_time_weighted_seconds:median{c.BASELINE_WINDOW}"
AWAIT_LIMIT = "instance_device:gpuio_disk_await_limit_seconds:class"
QUEUE_LIMIT = "instance_device:gpuio_disk_queue_limit:class"
SATURATED = f"instance_device:gpuio_disk_saturated_await_seconds:max_rate{W}"
GPU_BUSY = f"instance_gpu:gpuio_gpu_busy_seconds:rate{W}"
ENGINE_GPU_BUSY = f"instance_engine_gpu:gpuio_gpu_busy_seconds:rate{W}"
ENGINE_DISK_SATURATED = f"instance_engine:gpuio_disk_saturated_await_seconds:max_rate{W}"
ENGINE_IN_FLIGHT = f"instance_engine:gpuio_engine_inferences_in_flight:avg_over_time{W}"
ENGINE_POOL_WAIT = f"instance_engine:gpuio_engine_pool_wait_seconds:mean_rate{W}"
ENGINE_LATENCY = f"instance_engine_quantile:gpuio_engine_inference_seconds:histogram_quantile_rate{W}"
# quantile_over_time keeps the quantile="0.99" label: it compares one to one with the p99 above.
ENGINE_LATENCY_BASELINE = f"instance_engine_quantile:gpuio_engine_inference_seconds:median{c.BASELINE_WINDOW}"
ENGINE_LOAD = f"instance_engine:gpuio_engine_load_seconds:mean{c.ENGINE_LOAD_WINDOW}"
ENGINE_LOAD_READ = f"instance_engine:gpuio_engine_load_read_seconds:mean{c.ENGINE_LOAD_WINDOW}"
ENGINE_LOAD_THROUGHPUT = f"instance_engine:gpuio_engine_load_read_bytes_per_second:rate{c.ENGINE_LOAD_WINDOW}"
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
        # The device's own normal: medians over BASELINE_WINDOW.  No await baseline exists for a device
        # that had a judged await in less than BASELINE_MIN_COVERAGE of the window's evaluations (QUEUE
        # has a sample at every evaluation, so its count is the number of evaluations at any interval);
        # the alerts then fall back to the class limits.
        record(AWAIT_BASELINE, f"quantile_over_time(0.5, {AWAIT}[{c.BASELINE_WINDOW}])\n"
                               f"and\n"
                               f"count_over_time({AWAIT}[{c.BASELINE_WINDOW}])\n"
                               f"  >= {c.BASELINE_MIN_COVERAGE:g} * count_over_time({QUEUE}[{c.BASELINE_WINDOW}])"),
        record(QUEUE_BASELINE, f"quantile_over_time(0.5, {QUEUE}[{c.BASELINE_WINDOW}])"),
        # Class limits (exporter/thresholds.py) as series, one per device: solid state where sysfs says
        # rotational=0, rotational otherwise (an unknown device gets the lenient limits).
        record(AWAIT_LIMIT, class_limit(c.SOLID_STATE.await_seconds, c.ROTATIONAL.await_seconds)),
        record(QUEUE_LIMIT, class_limit(c.SOLID_STATE.queue_size, c.ROTATIONAL.queue_size)),
        # Saturated, as `gpuio top` flags it (thresholds.disk_flags): slow for its class, and a deep
        # queue or IO pressure.  The value is the await; devices that are not saturated have no series.
        record(SATURATED, f"({AWAIT} >= {TO_LIMIT} {AWAIT_LIMIT})\n"
                          f"and {ON_DEVICE}\n"
                          f"({QUEUE} >= {TO_LIMIT} {QUEUE_LIMIT})\n"
                          f"or\n"
                          f"({AWAIT} >= {TO_LIMIT} {AWAIT_LIMIT})\n"
                          f"and {ON_NODE}\n"
                          f"(\n{indent(io_pressure_high(no_psi_counts=False))}\n)"),
    ]


def direction(await_rule: str, ops_rule: str, guard: str, name: str) -> str:
    """An await where its direction completed at least ``guard`` requests/s, labelled direction=name."""
    return f'label_replace({await_rule} and ({ops_rule} >= {guard}), "direction", "{name}", "", "")'


def class_limit(solid_state: float, rotational: float) -> str:
    by = f"max by (job, {c.NODE_LABEL}, device)"
    solid = c.selector('rotational="0"')
    return (f"{solid_state:g} * {by} (gpuio_disk_info{solid})\n"
            f"or\n"
            f"{rotational:g} * {by} (gpuio_disk_info{c.selector()})")


def disk_io_storm() -> Rule:
    k = f"{c.STORM_BASELINE_FACTOR:g}"
    expr = "\n".join([
        f"({AWAIT} >= {TO_LIMIT} {AWAIT_LIMIT})",
        f"and {ON_DEVICE}",
        f"({QUEUE} >= {TO_LIMIT} {QUEUE_LIMIT})",
        f"and {ON_DEVICE}",
        "(",
        f"  {AWAIT} >= {k} * {AWAIT_BASELINE}",
        "  or",
        f"  ({AWAIT} unless {AWAIT_BASELINE})",
        ")",
        f"and {ON_DEVICE}",
        f"({QUEUE} >= {k} * {QUEUE_BASELINE})",
        f"and {ON_NODE}",
        f"(\n{indent(io_pressure_high(no_psi_counts=True))}\n)",
    ])
    node = f"$labels.{c.NODE_LABEL}"
    two_decimals = 'printf "%.2f"'
    baseline = device_figure(AWAIT_BASELINE, "humanizeDuration", "none, it was idle")
    loads = (f"sum(increase(gpuio_engine_load_read_seconds_count{{{c.NODE_LABEL}='%s'}}"
             f"[{c.STORM_ENGINE_LOADS_WINDOW}]) and on ({c.NODE_LABEL}, engine) "
             f"gpuio_engine_physical_device_info{{{c.NODE_LABEL}='%s',physical_device='%s'}})")
    engine_loads = (f'{{{{ with printf "{loads}" {node} {node} $labels.device | query }}}}'
                    f'{{{{ . | first | value | printf "%.0f" }}}}{{{{ else }}}}0{{{{ end }}}}')
    return {
        "alert": "DiskIOStorm",
        "expr": expr,
        "for": c.STORM_FOR,
        "labels": {"severity": c.WARNING},
        "annotations": {
            "summary": f"IO storm on {{{{ $labels.device }}}} at {{{{ {node} }}}}: requests wait "
                       f"{{{{ $value | humanizeDuration }}}}, far above its normal.",
            "description": (
                f"Requests on {{{{ $labels.device }}}} at {{{{ {node} }}}} wait {{{{ $value | humanizeDuration }}}} "
                f"(its {c.BASELINE_WINDOW} median: {baseline}) "
                f"with {device_figure(QUEUE, two_decimals)} requests queued "
                f"(median {device_figure(QUEUE_BASELINE, two_decimals)}); "
                f"tasks on the node waited on IO {node_figure(IO_SOME, 'humanizePercentage', 'n/a (no PSI)')} "
                f"of the time. Engine loads from this disk that finished in the last "
                f"{c.STORM_ENGINE_LOADS_WINDOW}: {engine_loads}. Engine loads and data reads from this disk are "
                f"slowed; a GPU fed from it may be starved."
            ),
            "runbook_url": runbook("DiskIOStorm"),
            "dashboard_url": c.dashboard_url(c.DISK_IO_UID, instance=f"{{{{ {node} }}}}",
                                             device="{{ $labels.device }}"),
        },
    }


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
    return [record(GPU_BUSY, rate("gpuio_gpu_busy_seconds_total"))]


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
        alert("GpuioGPUDataStale", f"gpuio_gpu_snapshot_age_seconds{sel} > {c.GPU_STALE_AFTER_SECONDS}",
              c.GPU_STALE_FOR, c.WARNING,
              f"GPU data of gpuio at {NODE} is stale.",
              f"The NVML snapshot gpuio-exporter serves at {NODE} is {{{{ $value | humanizeDuration }}}} old: "
              f"NVML calls are slow or hanging. GPU alerts for this node see old values.", gpu_board()),
        node_gpu_starved(),
    ]


def node_gpu_starved() -> Rule:
    expr = "\n".join([
        f"({GPU_BUSY} < {c.GPU_BUSY_LOW:g})",
        "# the GPU has work: compute processes hold it",
        f"and on ({c.NODE_LABEL}, gpu) (gpuio_gpu_processes{c.selector()} > 0)",
        "# and a disk of the node is saturated",
        f"and on ({c.NODE_LABEL}) count by ({c.NODE_LABEL}) ({SATURATED})",
        "# GPUs whose engines report are judged by GPUStarvedByDiskIO instead",
        f"unless on ({c.NODE_LABEL}, uuid)",
        f'  label_replace(gpuio_engine_info{WITH_GPU}, "uuid", "$1", "gpu_uuid", "(.+)")',
    ])
    disks = (f'{{{{ range printf "{SATURATED}{{{c.NODE_LABEL}=\'%s\'}}" $labels.{c.NODE_LABEL} | query }}}}'
             f"{{{{ .Labels.device }}}} (await {{{{ .Value | humanizeDuration }}}}) {{{{ end }}}}")
    return alert(
        "NodeGPUStarvedByIO", expr, c.NODE_STARVED_FOR, c.WARNING,
        f"{GPU_NAME} at {NODE} is mostly idle while a disk of the node is saturated.",
        f"{GPU_NAME} at {NODE} is busy {{{{ $value | humanizePercentage }}}} of the time although compute "
        f"processes hold it, while these disks are saturated: {disks}- its data loader is probably "
        f"waiting on IO. No engine reports for this GPU, so this is the node-level guess.",
        starvation_board(gpu="{{ $labels.gpu }}"))


def engine_recording_rules() -> list[Rule]:
    sel = c.selector()
    lw = c.ENGINE_LOAD_WINDOW

    def increase(metric: str) -> str:
        return f"increase({metric}{sel}[{lw}])"

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
    rules = [
        # Each engine file's GPU and its busy ratio (one series per engine, path and GPU).
        record(ENGINE_GPU_BUSY, busy),
        # The worst saturated disk under each engine file, named in `device`; none while no disk is.
        record(ENGINE_DISK_SATURATED, disk),
        record(ENGINE_IN_FLIGHT, f"avg_over_time(gpuio_engine_inferences_in_flight{sel}[{W}])"),
        record(ENGINE_POOL_WAIT, f"{rate('gpuio_engine_pool_wait_seconds_sum')}\n/\n"
                                 f"({rate('gpuio_engine_pool_wait_seconds_count')} > 0)"),
    ]
    for q in (0.5, 0.95, 0.99):
        rule = record(ENGINE_LATENCY, f"histogram_quantile({q:g}, sum by (job, {c.NODE_LABEL}, engine, le) "
                                      f"({rate('gpuio_engine_inference_seconds_bucket')}))")
        rule["labels"] = {"quantile": f"{q:g}"}
        rules.append(rule)
    rules += [
        record(ENGINE_LATENCY_BASELINE, f'quantile_over_time(0.5, {ENGINE_LATENCY}{{quantile="0.99"}}'
                                        f"[{c.BASELINE_WINDOW}])"),
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
    return rules


def engine_alerts() -> list[Rule]:
    sel = c.selector()
    engine_labels = (c.NODE_LABEL, "engine")
    waiting = "\n".join([
        f"  {ENGINE_IN_FLIGHT} > 0",
        "  or",
        f"  {ENGINE_POOL_WAIT} >= {c.ENGINE_POOL_WAIT_SECONDS:g}",
        "  or",
        f'  {ENGINE_LATENCY}{{quantile="0.99"}}',
        f"    >= {c.ENGINE_LATENCY_FACTOR:g} * {ENGINE_LATENCY_BASELINE}",
    ])
    starved = "\n".join([
        f"({ENGINE_GPU_BUSY} < {c.GPU_BUSY_LOW:g})",
        f"+ on ({c.NODE_LABEL}, engine, path) group_left (device)",
        f"  (0 * {ENGINE_DISK_SATURATED})",
        f"and on ({c.NODE_LABEL}, engine)",
        f"(\n{waiting}\n)",
    ])
    device_labels = (c.NODE_LABEL, "device")
    w = c.SPOOL_ERRORS_WINDOW
    spool = "\n".join([
        f"gpuio_engine_spool_errors_total{sel} - gpuio_engine_spool_errors_total{sel} offset {w} > 0",
        "or",
        "# a reason seen for the first time: its series starts at 1",
        f"(gpuio_engine_spool_errors_total{sel} unless gpuio_engine_spool_errors_total{sel} offset {w})",
    ])
    return [
        alert(
            "GPUStarvedByDiskIO", starved, c.STARVED_FOR, c.CRITICAL,
            f"Engine {{{{ $labels.engine }}}} on GPU {{{{ $labels.gpu }}}} at {NODE} is starved by "
            f"{{{{ $labels.device }}}}.",
            f"GPU {{{{ $labels.gpu }}}} ({{{{ $labels.uuid }}}}) at {NODE} is busy only "
            f"{{{{ $value | humanizePercentage }}}} while work waits for engine {{{{ $labels.engine }}}} "
            f"(in flight: {figure(ENGINE_IN_FLIGHT, engine_labels, ONE_DECIMAL, '0')}, pool wait: "
            f"{figure(ENGINE_POOL_WAIT, engine_labels, 'humanizeDuration', 'none')}), and the disk under "
            f"{{{{ $labels.path }}}}, {{{{ $labels.device }}}}, is saturated: await "
            f"{figure(AWAIT, device_labels, 'humanizeDuration', '?')}, "
            f"{figure(QUEUE, device_labels, ONE_DECIMAL, '?')} requests queued.",
            starvation_board(gpu="{{ $labels.gpu }}", engine="{{ $labels.engine }}")),
        alert(
            "EngineColdStartSlow", f"{ENGINE_LOAD} > {c.ENGINE_LOAD_SLOW_SECONDS:g}", None, c.WARNING,
            f"Engine {{{{ $labels.engine }}}} at {NODE} takes {{{{ $value | humanizeDuration }}}} to load.",
            f"Loads of engine {{{{ $labels.engine }}}} at {NODE} that finished in the last "
            f"{c.ENGINE_LOAD_WINDOW} took {{{{ $value | humanizeDuration }}}} each on average (over "
            f"{c.ENGINE_LOAD_SLOW_SECONDS:g}s); reading the file took "
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


def rule_files() -> dict[str, dict[str, Any]]:
    """rules/<name>.yml -> its content."""
    return {
        "disk": {"groups": [
            {"name": "gpuio.disk.rules", "rules": disk_recording_rules()},
            {"name": "gpuio.disk.alerts", "rules": [disk_io_storm()]},
        ]},
        "gpu": {"groups": [
            {"name": "gpuio.gpu.rules", "rules": gpu_recording_rules()},
            {"name": "gpuio.gpu.alerts", "rules": gpu_alerts()},
        ]},
        "engines": {"groups": [
            {"name": "gpuio.engines.rules", "rules": engine_recording_rules()},
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
