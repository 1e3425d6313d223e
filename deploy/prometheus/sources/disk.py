"""Block devices (diskstats collector): rates, awaits and queue sizes per device, each device's class
limits and calm baseline, and DiskIOStorm (a ticket for the storm, a page while it hurts serving)."""

from __future__ import annotations

from collections.abc import Callable

from ...exporter_modules import thresholds
from ..config import CRITICAL, DEVICE_NAME_CLASSES, DISK_CLASSES, DISK_IO_UID, WARNING, Config
from .base import (
    LOAD_REASONS,
    Rule,
    alert,
    board,
    disk_info,
    disk_rate,
    engine_disks,
    fill,
    held_through_gaps,
    indent,
    learned,
    record,
)
from .names import names
from .pressure import io_pressure_high
from .templates import (
    COUNT,
    device_figure,
    engines_on,
    gpus_on,
    label_of,
    node_figure,
    query_figure,
    starved_count,
    starved_on,
    storage_args,
    top_io_cgroups,
    waiting_to_load,
)


def recording_rules(config: Config) -> list[Rule]:
    """Each device's rates, awaits and saturation now (raw series and the class limits)."""
    recorded = names(config)
    guard = f"{config.AWAIT_MIN_IOPS:g}"
    # An idle device's awaits have no value: dividing by (ops > 0) yields no series, never NaN.
    return [
        record(recorded.READS, disk_rate(config, "reads_completed_total")),
        record(recorded.WRITES, disk_rate(config, "writes_completed_total")),
        record(recorded.READ_BYTES, disk_rate(config, "read_bytes_total")),
        record(recorded.WRITTEN_BYTES, disk_rate(config, "written_bytes_total")),
        record(recorded.READ_AWAIT, f"{disk_rate(config, 'read_time_seconds_total')}\n/\n"
                                    f"({disk_rate(config, 'reads_completed_total')} > 0)"),
        record(recorded.WRITE_AWAIT, f"{disk_rate(config, 'write_time_seconds_total')}\n/\n"
                                     f"({disk_rate(config, 'writes_completed_total')} > 0)"),
        record(recorded.QUEUE, disk_rate(config, "io_time_weighted_seconds_total")),
        record(recorded.UTIL, disk_rate(config, "io_time_seconds_total")),
        # The await the alerts judge: the slower direction among those that completed at least
        # AWAIT_MIN_IOPS requests a second (one slow read on an idle disk is no evidence).
        record(recorded.AWAIT, "max without (direction) (\n"
                               f"  {direction(recorded.READ_AWAIT, recorded.READS, guard, 'read')}\n"
                               "  or\n"
                               f"  {direction(recorded.WRITE_AWAIT, recorded.WRITES, guard, 'write')}\n"
                               ")"),
        # Saturated, as `gpuio top` flags it (thresholds.disk_flags): slow for its class, and a deep
        # queue or IO pressure.  The value is the await; devices that are not saturated have no series.
        record(recorded.SATURATED, f"({recorded.AWAIT} >= {recorded.TO_LIMIT} {recorded.AWAIT_LIMIT})\n"
                                   f"and {recorded.ON_DEVICE}\n"
                                   f"({recorded.QUEUE} >= {recorded.TO_LIMIT} {recorded.QUEUE_LIMIT})\n"
                                   f"or\n"
                                   f"({recorded.AWAIT} >= {recorded.TO_LIMIT} {recorded.AWAIT_LIMIT})\n"
                                   f"and {recorded.ON_NODE}\n"
                                   f"(\n{indent(io_pressure_high(config, no_psi_counts=False))}\n)"),
    ]


def baseline_rules(config: Config) -> list[Rule]:
    """Each device's calm normal: medians over BASELINE_WINDOW of its calm evaluations, held."""
    recorded = names(config)
    return [
        # The device's own normal, from calm evaluations only: a storm never feeds its baseline.
        record(recorded.CALM_AWAIT, f"{recorded.AWAIT} unless {recorded.ON_DEVICE} {recorded.SATURATED}"),
        record(recorded.CALM_QUEUE, f"{recorded.QUEUE} unless {recorded.ON_DEVICE} {recorded.SATURATED}"),
        # No median for a device with calm evidence in less than BASELINE_MIN_COVERAGE of the window's
        # evaluations (QUEUE has a sample at every evaluation, so its count is the number of
        # evaluations at any interval): the alerts then fall back to the class limits.
        record(recorded.AWAIT_LEARNED, learned(config, recorded.CALM_AWAIT, recorded.QUEUE)),
        record(recorded.QUEUE_LEARNED, learned(config, recorded.CALM_QUEUE, recorded.QUEUE)),
        # Held through a storm: the last calm median, for up to BASELINE_HOLD.
        record(recorded.AWAIT_BASELINE, f"last_over_time({recorded.AWAIT_LEARNED}[{config.BASELINE_HOLD}])"),
        record(recorded.QUEUE_BASELINE, f"last_over_time({recorded.QUEUE_LEARNED}[{config.BASELINE_HOLD}])"),
    ]


def storm_rules(config: Config) -> list[Rule]:
    # The storm (DiskIOStorm's condition before its `for`; value: the await).
    return [record(names(config).STORM, storm_expr(config))]


def class_rules(config: Config) -> list[Rule]:
    """Each device's class (exporter/thresholds.py disk_class) and its limits, one series per device:
    NVMe and network block devices by name, then solid state where sysfs says rotational=0, and
    rotational otherwise (an unknown device gets the lenient limits).  `or` keeps the first match.
    They read nothing but the devices' identity: a group of their own, evaluated beside the chain."""
    recorded = names(config)
    return [
        record(recorded.DISK_CLASS,
               class_expr(config, lambda name, disks: f'label_replace({disks}, "class", "{name}", "", "")')),
        record(recorded.AWAIT_LIMIT,
               class_expr(config, lambda name, disks: f"{DISK_CLASSES[name].await_seconds:g} * {disks}")),
        record(recorded.QUEUE_LIMIT,
               class_expr(config, lambda name, disks: f"{DISK_CLASSES[name].queue_size:g} * {disks}")),
    ]


def direction(await_rule: str, ops_rule: str, guard: str, name: str) -> str:
    """An await where its direction completed at least ``guard`` requests/s, labelled direction=name."""
    return f'label_replace({await_rule} and ({ops_rule} >= {guard}), "direction", "{name}", "", "")'


def class_expr(config: Config, shape: Callable[[str, str], str]) -> str:
    """One term per device class, ``shape(class, its devices)``, joined by ``or``."""
    by = f"max by (job, {config.NODE_LABEL}, device)"
    selectors: list[tuple[str, tuple[str, ...]]] = [(name, (f'device=~"{pattern}"',))
                                                    for name, pattern in DEVICE_NAME_CLASSES]
    selectors += [(thresholds.SOLID_STATE, ('rotational="0"',)), (thresholds.ROTATIONAL, ())]
    return "\nor\n".join(shape(name, f"{by} ({disk_info(config, *matchers)})") for name, matchers in selectors)


def storm_expr(config: Config) -> str:
    recorded = names(config)
    factor = f"{config.STORM_BASELINE_FACTOR:g}"
    return "\n".join([
        f"({recorded.AWAIT} >= {recorded.TO_LIMIT} {recorded.AWAIT_LIMIT})",
        f"and {recorded.ON_DEVICE}",
        f"({recorded.QUEUE} >= {recorded.TO_LIMIT} {recorded.QUEUE_LIMIT})",
        "# far above its calm normal, or it has none (idle until now, or never calm)",
        f"and {recorded.ON_DEVICE}",
        "(",
        f"  {recorded.AWAIT} >= {factor} * {recorded.AWAIT_BASELINE}",
        "  or",
        f"  ({recorded.AWAIT} unless {recorded.ON_DEVICE} {recorded.AWAIT_BASELINE})",
        ")",
        f"and {recorded.ON_DEVICE}",
        "(",
        f"  {recorded.QUEUE} >= {factor} * {recorded.QUEUE_BASELINE}",
        "  or",
        f"  ({recorded.QUEUE} unless {recorded.ON_DEVICE} {recorded.QUEUE_BASELINE})",
        ")",
        f"and {recorded.ON_NODE}",
        f"(\n{indent(io_pressure_high(config, no_psi_counts=True))}\n)",
    ])


def disk_victims(config: Config) -> str:
    """Per disk: who the storm hurts.  Engines on it whose loads are waited for (loading or crash-looping
    on a device that is not busy serving), engines on it starving their GPUs, or engines on it queueing
    requests while all of the node's tasks stall on IO (PSI full).  A load beside a busy generation of
    the same engine (a blue/green or rolling reload) hurts nobody yet."""
    recorded = names(config)
    per_disk = f"count by (job, {config.NODE_LABEL}, device)"
    return "\n".join([
        f"{per_disk} ({engine_disks(config)} and on ({config.NODE_LABEL}, engine) {recorded.LOADS_WAITED_FOR})",
        f"or {recorded.ON_DEVICE}",
        f'{per_disk} ({recorded.STARVED}{{device!=""}})',
        f"or {recorded.ON_DEVICE}",
        "(",
        f"  {per_disk} ({engine_disks(config)}",
        f'    and on ({config.NODE_LABEL}, engine) {recorded.WORK_WAITING}{{reason!~"{LOAD_REASONS}"}})',
        f"  and {recorded.ON_NODE} ({recorded.IO_FULL} >= {config.STORM_PAGE_IO_FULL:g})",
        ")",
    ])


def page_rules(config: Config) -> list[Rule]:
    """DiskIOStorm's paging condition, recorded (after the starvation rules it reads) so that the alert can
    hold it through a scrape gap.  Value: the await."""
    recorded = names(config)
    return [record(recorded.STORM_PAGE,
                   f"{recorded.STORM}\nand {recorded.ON_DEVICE}\n(\n{indent(disk_victims(config))}\n)")]


def alerts(config: Config) -> list[Rule]:
    recorded = names(config)
    two_decimals = 'printf "%.2f"'
    baseline = device_figure(config, recorded.AWAIT_BASELINE, "humanizeDuration", "none: no calm evidence")
    loads = fill("sum(increase(gpuio_engine_load_read_seconds_count{${node}='%s'}[${window}]) "
                 "and on (${node}, engine) gpuio_engine_physical_device_info{${node}='%s',physical_device='%s'})",
                 node=config.NODE_LABEL, window=config.STORM_ENGINE_LOADS_WINDOW)
    engine_loads = query_figure(loads, storage_args(config, "device"), COUNT, "0")
    disk_class = label_of(recorded.DISK_CLASS, "class", (config.NODE_LABEL, "device"), "?")
    figures = fill(
        "Requests on {{ $labels.device }} (${disk_class}) at ${node} wait {{ $value | humanizeDuration }} "
        "(its calm median: ${baseline}) with ${queue} requests queued (calm median ${queue_baseline}); "
        "tasks on the node waited on IO ${io_some} of the time (all of them at once: ${io_full}).",
        disk_class=disk_class, node=recorded.NODE, baseline=baseline,
        queue=device_figure(config, recorded.QUEUE, two_decimals),
        queue_baseline=device_figure(config, recorded.QUEUE_BASELINE, two_decimals, "none"),
        io_some=node_figure(config, recorded.IO_SOME, "humanizePercentage", "n/a (no PSI)"),
        io_full=node_figure(config, recorded.IO_FULL, "humanizePercentage", "n/a"))
    loads_waiting = device_figure(config, "gpuio_disk_engine_loads_in_progress", COUNT, "0")
    oldest = device_figure(config, "gpuio_disk_engine_load_oldest_in_progress_seconds", "humanizeDuration", "-")
    info = "gpuio_engine_physical_device_info"
    this_disk = board(DISK_IO_UID, device="{{ $labels.device }}")
    culprits = top_io_cgroups(config)
    return [
        alert(
            config, "DiskIOStorm", held_through_gaps(config, recorded.STORM, "DiskIOStorm", WARNING), config.STORM_FOR,
            WARNING,
            fill("IO storm on {{ $labels.device }} at ${node}: requests wait {{ $value | humanizeDuration }}, "
                 "far above its normal.", node=recorded.NODE),
            f"{figures} Engine loads from this disk that finished in the last {config.STORM_ENGINE_LOADS_WINDOW}: "
            f"{engine_loads}. This ticket is the storm itself; it pages (the same alert, severity critical) "
            f"while engine loads wait on the disk or engines on it starve their GPUs.{culprits}",
            this_disk),
        alert(
            config, "DiskIOStorm", held_through_gaps(config, recorded.STORM_PAGE, "DiskIOStorm", CRITICAL),
            config.STORM_PAGE_FOR, CRITICAL,
            fill("IO storm on {{ $labels.device }} at ${node} hurts serving: ${waiting} engine(s) waiting to load, "
                 "${starved} engine(s) starving their GPU.",
                 node=recorded.NODE, waiting=waiting_to_load(config, info, "physical_device", "device"),
                 starved=starved_count(config, "device")),
            fill("${figures} Engine loads waiting on this disk: ${loads_waiting} (oldest in progress for ${oldest}). "
                 "Starved engines: ${starved}. Engines with files on {{ $labels.device }}: ${engines}on GPUs: "
                 "${gpus}. Loads that finished in the last ${window}: ${engine_loads}.${culprits}",
                 figures=figures, loads_waiting=loads_waiting, oldest=oldest, starved=starved_on(config, "device"),
                 engines=engines_on(config, info, "physical_device", "device"),
                 gpus=gpus_on(config, info, "physical_device", "device"), window=config.STORM_ENGINE_LOADS_WINDOW,
                 engine_loads=engine_loads, culprits=culprits),
            this_disk),
    ]
