"""Network and FUSE mounts (mountstats collector, engine files on mounts): NFS round trips, "this
mount is slow", and MountIOStorm."""

from __future__ import annotations

from ..config import CRITICAL, STARVATION_UID, WARNING, Config
from .base import Rule, alert, board, engine_mounts, fill, held_through_gaps, indent, record
from .names import names
from .pressure import io_pressure_high
from .templates import (
    COUNT,
    engines_on,
    figure,
    gpus_on,
    label_of,
    node_figure,
    starved_count,
    starved_on,
    waiting_to_load,
)


def recording_rules(config: Config) -> list[Rule]:
    recorded = names(config)
    sel = config.selector()
    read = config.selector('operation="READ"')
    window = config.RATE_WINDOW
    rtt = "\n".join([
        f"max by (job, {config.NODE_LABEL}, mountpoint) (",
        f"  rate(gpuio_mountstats_nfs_operations_response_time_seconds_total{read}[{window}])",
        "  /",
        f"  (rate(gpuio_mountstats_nfs_operations_requests_total{read}[{window}]) >= {config.AWAIT_MIN_IOPS:g})",
        ")",
    ])
    slow = "\n".join([
        "(",
        f"  {recorded.NFS_READ_RTT} >= {config.NFS_READ_RTT_SLOW_SECONDS:g}",
        "  or",
        f"  max by (job, {config.NODE_LABEL}, mountpoint) (gpuio_mount_engine_load_oldest_in_progress_seconds{sel})",
        f"    >= {config.ENGINE_LOAD_SLOW_SECONDS:g}",
        ")",
        "# network and FUSE mounts only",
        f"and on ({config.NODE_LABEL}, mountpoint) gpuio_mount_info{sel}",
        f"and {recorded.ON_NODE}",
        f"(\n{indent(io_pressure_high(config, no_psi_counts=True))}\n)",
    ])
    return [
        # Mean round trip of an NFS READ per mount (node_exporter's mountstats semantics): requests
        # under AWAIT_MIN_IOPS a second give no series.
        record(recorded.NFS_READ_RTT, rtt),
        record(recorded.NFS_READ_BYTES, f"sum by (job, {config.NODE_LABEL}, mountpoint) "
                                        f"(rate(gpuio_mountstats_nfs_read_bytes_total{sel}[{window}]))"),
        # A slow network mount: READs with a slow round trip, or an engine load on it crawling for longer
        # than ENGINE_LOAD_SLOW_SECONDS, while the node stalls on IO.  Value: the RTT or the load's age.
        record(recorded.MOUNT_SLOW, slow),
    ]


def mount_victims(config: Config) -> str:
    """Per mount: engines on it whose loads are waited for (loading or crash-looping on a device that is not
    busy serving), or engines on it starving their GPUs."""
    recorded = names(config)
    per_mount = f"count by (job, {config.NODE_LABEL}, mountpoint)"
    return "\n".join([
        f"{per_mount} ({engine_mounts(config)} and on ({config.NODE_LABEL}, engine) {recorded.LOADS_WAITED_FOR})",
        f"or on ({config.NODE_LABEL}, mountpoint)",
        f'{per_mount} ({recorded.STARVED}{{mountpoint!=""}})',
    ])


def page_rules(config: Config) -> list[Rule]:
    """MountIOStorm's paging condition, recorded after the starvation rules it reads.  Value: as MOUNT_SLOW."""
    recorded = names(config)
    victims = indent(mount_victims(config))
    return [record(recorded.MOUNT_STORM_PAGE,
                   f"{recorded.MOUNT_SLOW}\nand on ({config.NODE_LABEL}, mountpoint)\n(\n{victims}\n)")]


def alerts(config: Config) -> list[Rule]:
    recorded = names(config)
    mount = (config.NODE_LABEL, "mountpoint")
    info = "gpuio_engine_mount_info"
    loads_waiting = figure("gpuio_mount_engine_loads_in_progress", mount, COUNT, "0")
    oldest = figure("gpuio_mount_engine_load_oldest_in_progress_seconds", mount, "humanizeDuration", "-")
    fstype = label_of("gpuio_mount_info", "fstype", mount, "?")
    source = label_of("gpuio_mount_info", "source", mount, "?")
    figures = fill(
        "The ${fstype} mount {{ $labels.mountpoint }} (${source}) at ${node} is slow: NFS READ round trip ${rtt}, "
        "reading ${read}B/s; the oldest engine load in progress on it started ${oldest} ago; tasks on the node "
        "waited on IO ${io_some} of the time.",
        fstype=fstype, source=source, node=recorded.NODE, oldest=oldest,
        rtt=figure(recorded.NFS_READ_RTT, mount, "humanizeDuration", "n/a (not NFS, or idle)"),
        read=figure(recorded.NFS_READ_BYTES, mount, "humanize1024", "n/a"),
        io_some=node_figure(config, recorded.IO_SOME, "humanizePercentage", "n/a (no PSI)"))
    on_call = board(STARVATION_UID)
    return [
        alert(config, "MountIOStorm", held_through_gaps(config, recorded.MOUNT_SLOW, "MountIOStorm", WARNING),
              config.STORM_FOR, WARNING,
              fill("Network storage {{ $labels.mountpoint }} at ${node} is slow.", node=recorded.NODE),
              f"{figures} This ticket is the slow mount itself; it pages (the same alert, severity critical) "
              f"while engine loads wait on it or engines on it starve their GPUs.", on_call),
        alert(config, "MountIOStorm", held_through_gaps(config, recorded.MOUNT_STORM_PAGE, "MountIOStorm", CRITICAL),
              config.STORM_PAGE_FOR, CRITICAL,
              fill("Network storage {{ $labels.mountpoint }} at ${node} is slow and hurts serving: ${waiting} "
                   "engine(s) waiting to load, ${starved} engine(s) starving their GPU.", node=recorded.NODE,
                   waiting=waiting_to_load(config, info, "mountpoint", "mountpoint"),
                   starved=starved_count(config, "mountpoint")),
              f"{figures} Engine loads waiting on it: {loads_waiting}. Starved engines: "
              f"{starved_on(config, 'mountpoint')}. Engines with files on it: "
              f"{engines_on(config, info, 'mountpoint', 'mountpoint')}"
              f"on GPUs: {gpus_on(config, info, 'mountpoint', 'mountpoint')}.", on_call),
    ]
