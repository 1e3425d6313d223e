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


def recording_rules(c: Config) -> list[Rule]:
    n = names(c)
    sel = c.selector()
    read = c.selector('operation="READ"')
    rtt = "\n".join([
        f"max by (job, {c.NODE_LABEL}, mountpoint) (",
        f"  rate(gpuio_mountstats_nfs_operations_response_time_seconds_total{read}[{n.W}])",
        "  /",
        f"  (rate(gpuio_mountstats_nfs_operations_requests_total{read}[{n.W}]) >= {c.AWAIT_MIN_IOPS:g})",
        ")",
    ])
    slow = "\n".join([
        "(",
        f"  {n.NFS_READ_RTT} >= {c.NFS_READ_RTT_SLOW_SECONDS:g}",
        "  or",
        f"  max by (job, {c.NODE_LABEL}, mountpoint) (gpuio_mount_engine_load_oldest_in_progress_seconds{sel})",
        f"    >= {c.ENGINE_LOAD_SLOW_SECONDS:g}",
        ")",
        "# network and FUSE mounts only",
        f"and on ({c.NODE_LABEL}, mountpoint) gpuio_mount_info{sel}",
        f"and {n.ON_NODE}",
        f"(\n{indent(io_pressure_high(c, no_psi_counts=True))}\n)",
    ])
    return [
        # Mean round trip of an NFS READ per mount (node_exporter's mountstats semantics): requests
        # under AWAIT_MIN_IOPS a second give no series.
        record(n.NFS_READ_RTT, rtt),
        record(n.NFS_READ_BYTES, f"sum by (job, {c.NODE_LABEL}, mountpoint) "
                                 f"(rate(gpuio_mountstats_nfs_read_bytes_total{sel}[{n.W}]))"),
        # A slow network mount: READs with a slow round trip, or an engine load on it crawling for longer
        # than ENGINE_LOAD_SLOW_SECONDS, while the node stalls on IO.  Value: the RTT or the load's age.
        record(n.MOUNT_SLOW, slow),
    ]


def mount_victims(c: Config) -> str:
    """Per mount: engines on it whose loads are waited for (loading or crash-looping on a device that is not
    busy serving), or engines on it starving their GPUs."""
    n = names(c)
    per_mount = f"count by (job, {c.NODE_LABEL}, mountpoint)"
    return "\n".join([
        f"{per_mount} ({engine_mounts(c)} and on ({c.NODE_LABEL}, engine) {n.LOADS_WAITED_FOR})",
        f"or on ({c.NODE_LABEL}, mountpoint)",
        f'{per_mount} ({n.STARVED}{{mountpoint!=""}})',
    ])


def page_rules(c: Config) -> list[Rule]:
    """MountIOStorm's paging condition, recorded after the starvation rules it reads.  Value: as MOUNT_SLOW."""
    n = names(c)
    return [record(n.MOUNT_STORM_PAGE,
                   f"{n.MOUNT_SLOW}\nand on ({c.NODE_LABEL}, mountpoint)\n(\n{indent(mount_victims(c))}\n)")]


def alerts(c: Config) -> list[Rule]:
    n = names(c)
    mount = (c.NODE_LABEL, "mountpoint")
    info = "gpuio_engine_mount_info"
    loads_waiting = figure("gpuio_mount_engine_loads_in_progress", mount, COUNT, "0")
    oldest = figure("gpuio_mount_engine_load_oldest_in_progress_seconds", mount, "humanizeDuration", "-")
    fstype = label_of("gpuio_mount_info", "fstype", mount, "?")
    source = label_of("gpuio_mount_info", "source", mount, "?")
    figures = fill(
        "The ${fstype} mount {{ $labels.mountpoint }} (${source}) at ${node} is slow: NFS READ round trip ${rtt}, "
        "reading ${read}B/s; the oldest engine load in progress on it started ${oldest} ago; tasks on the node "
        "waited on IO ${io_some} of the time.",
        fstype=fstype, source=source, node=n.NODE, oldest=oldest,
        rtt=figure(n.NFS_READ_RTT, mount, "humanizeDuration", "n/a (not NFS, or idle)"),
        read=figure(n.NFS_READ_BYTES, mount, "humanize1024", "n/a"),
        io_some=node_figure(c, n.IO_SOME, "humanizePercentage", "n/a (no PSI)"))
    on_call = board(STARVATION_UID)
    return [
        alert(c, "MountIOStorm", held_through_gaps(c, n.MOUNT_SLOW, "MountIOStorm", WARNING), c.STORM_FOR, WARNING,
              fill("Network storage {{ $labels.mountpoint }} at ${node} is slow.", node=n.NODE),
              f"{figures} This ticket is the slow mount itself; it pages (the same alert, severity critical) "
              f"while engine loads wait on it or engines on it starve their GPUs.", on_call),
        alert(c, "MountIOStorm", held_through_gaps(c, n.MOUNT_STORM_PAGE, "MountIOStorm", CRITICAL),
              c.STORM_PAGE_FOR, CRITICAL,
              fill("Network storage {{ $labels.mountpoint }} at ${node} is slow and hurts serving: ${waiting} "
                   "engine(s) waiting to load, ${starved} engine(s) starving their GPU.", node=n.NODE,
                   waiting=waiting_to_load(c, info, "mountpoint", "mountpoint"),
                   starved=starved_count(c, "mountpoint")),
              f"{figures} Engine loads waiting on it: {loads_waiting}. Starved engines: "
              f"{starved_on(c, 'mountpoint')}. Engines with files on it: "
              f"{engines_on(c, info, 'mountpoint', 'mountpoint')}"
              f"on GPUs: {gpus_on(c, info, 'mountpoint', 'mountpoint')}.", on_call),
    ]
