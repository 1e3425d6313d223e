"""Starvation: the engine -> GPU -> storage joins, "work waits for this engine on this GPU", and the
alerts built on them (GPUStarvedByDiskIO per engine, NodeGPUStarvedByIO for GPUs no engine reports on)."""

from __future__ import annotations

from ..config import CRITICAL, STARVATION_UID, WARNING, Config
from .base import Rule, alert, board, rate, reason, record
from .names import names
from .templates import COUNT, GPU_NAME, ONE_DECIMAL, engine_gpu_figure, figure, node_figure


def recording_rules(c: Config) -> list[Rule]:
    n = names(c)
    sel = c.selector()
    per_gpu = f"job, {c.NODE_LABEL}, engine, gpu_uuid"

    busy = "\n".join([
        f"max by (job, {c.NODE_LABEL}, engine, path, gpu, uuid) (",
        f'  label_replace(gpuio_engine_info{n.WITH_GPU}, "uuid", "$1", "gpu_uuid", "(.+)")',
        f"  * on ({c.NODE_LABEL}, uuid) group_left (gpu)",
        f"  {n.GPU_BUSY}",
        ")",
    ])
    disk = "\n".join([
        f"topk by (job, {c.NODE_LABEL}, engine, path) (1,",
        f"  max by (job, {c.NODE_LABEL}, engine, path, device) (",
        f'    label_replace(gpuio_engine_physical_device_info{sel}, "device", "$1", "physical_device", "(.+)")',
        f"    * on ({c.NODE_LABEL}, device) group_left ()",
        f"    {n.SATURATED}",
        "  )",
        ")",
    ])
    mount = "\n".join([
        f"topk by (job, {c.NODE_LABEL}, engine, path) (1,",
        f"  max by (job, {c.NODE_LABEL}, engine, path, mountpoint) (",
        f"    gpuio_engine_mount_info{sel}",
        f"    * on ({c.NODE_LABEL}, mountpoint) group_left ()",
        f"    {n.MOUNT_SLOW}",
        "  )",
        ")",
    ])
    storage_slow = f"({n.ENGINE_DISK_SATURATED} or {n.ENGINE_MOUNT_SLOW})"
    rules = [
        # Each engine file's GPU and its busy ratio (one series per engine, path and GPU).
        record(n.ENGINE_GPU_BUSY, busy),
        # The worst saturated disk under each engine file, named in `device`; none while no disk is.
        record(n.ENGINE_DISK_SATURATED, disk),
        # The slow network or FUSE mount under each engine file, named in `mountpoint`.
        record(n.ENGINE_MOUNT_SLOW, mount),
        # Per engine and GPU (the writer's GPU, gpu_uuid): one replica's queue is not another's.
        record(n.ENGINE_IN_FLIGHT, f"avg_over_time(gpuio_engine_inferences_in_flight{sel}[{n.W}])"),
        record(n.ENGINE_POOL_WAIT, f"{rate(c, 'gpuio_engine_pool_wait_seconds_sum')}\n/\n"
                                   f"({rate(c, 'gpuio_engine_pool_wait_seconds_count')} > 0)"),
    ]
    rules.append(record(n.ENGINE_LATENCY_BUCKETS,
                        f"sum by ({per_gpu}, le) ({rate(c, 'gpuio_engine_inference_seconds_bucket')})"))
    for q in (0.5, 0.95, 0.99):
        rule = record(n.ENGINE_LATENCY, f"histogram_quantile({q:g}, {n.ENGINE_LATENCY_BUCKETS})")
        rule["labels"] = {"quantile": f"{q:g}"}
        rules.append(rule)
    p99 = f'max without (quantile) ({n.ENGINE_LATENCY}{{quantile="0.99"}})'
    rules += [
        # The engine's normal p99, from evaluations in which its storage was not slow (held like the
        # disk baselines): a storm never becomes the latency it is compared with.
        record(n.ENGINE_LATENCY_CALM, f"{p99}\nunless on ({c.NODE_LABEL}, engine)\n{storage_slow}"),
        record(n.ENGINE_LATENCY_LEARNED, learned_from(c, n.ENGINE_LATENCY_CALM, p99)),
        record(n.ENGINE_LATENCY_BASELINE, f"last_over_time({n.ENGINE_LATENCY_LEARNED}[{c.BASELINE_HOLD}])"),
        # Work queueing for an engine on one GPU, one series per reason.  Never "a request is in
        # flight": a spare replica serving a request now and then is idle, not starved.
        record(n.WORK_WAITING, "\nor\n".join([
            reason(f"{n.ENGINE_POOL_WAIT} >= {c.ENGINE_POOL_WAIT_SECONDS:g}", "pool wait"),
            reason(f"{n.ENGINE_IN_FLIGHT}\n  >= on ({c.NODE_LABEL}, engine, gpu_uuid)\n"
                   f"(gpuio_engine_pool_contexts{sel} > 0)", "in flight >= contexts"),
            reason(f"{p99}\n  >= on ({c.NODE_LABEL}, engine, gpu_uuid) "
                   f"({c.ENGINE_LATENCY_FACTOR:g} * {n.ENGINE_LATENCY_BASELINE})",
                   f"p99 latency >= {c.ENGINE_LATENCY_FACTOR:g}x its normal"),
            reason(f"gpuio_engine_loads_in_progress{sel} > 0", "loading"),
        ])),
        # Starved: the engine's GPU mostly idle, work waiting for the engine on that GPU, its storage
        # saturated (a disk, named in `device`) or slow (a network mount, named in `mountpoint`), and
        # the node's GPU data fresh.  Value: the GPU's activity (GPU_IDLE).  GPUStarvedByDiskIO is this for `for`.
        record(n.STARVED, "\n".join([
            "(",
            f"  (0 * {n.ENGINE_GPU_BUSY} + on ({c.NODE_LABEL}, uuid) group_left () {n.GPU_IDLE})",
            f"  + on ({c.NODE_LABEL}, engine, path) group_left (device) (0 * {n.ENGINE_DISK_SATURATED})",
            "  or",
            f"  (0 * {n.ENGINE_GPU_BUSY} + on ({c.NODE_LABEL}, uuid) group_left () {n.GPU_IDLE})",
            f"  + on ({c.NODE_LABEL}, engine, path) group_left (mountpoint) (0 * {n.ENGINE_MOUNT_SLOW})",
            ")",
            f"and on ({c.NODE_LABEL}, engine, uuid)",
            f'  label_replace({n.WORK_WAITING}, "uuid", "$1", "gpu_uuid", "(.+)")',
            f"unless on ({c.NODE_LABEL}) {n.GPU_STALE}",
        ])),
    ]
    return rules


def learned_from(c: Config, calm: str, every: str) -> str:
    """The median of ``calm`` over BASELINE_WINDOW where it covers enough of ``every``'s evaluations."""
    n = names(c)
    return (f"quantile_over_time(0.5, {calm}[{n.B}])\n"
            f"and\n"
            f"count_over_time({calm}[{n.B}])\n"
            f"  >= {c.BASELINE_MIN_COVERAGE:g} * count_over_time(({every})[{n.B}:])")


def alerts(c: Config) -> list[Rule]:
    return [starved_alert(c), node_gpu_starved(c)]


def starved_alert(c: Config) -> Rule:
    n = names(c)
    node = f"$labels.{c.NODE_LABEL}"
    device_labels = (c.NODE_LABEL, "device")
    reasons = (f'{{{{ range printf "{n.WORK_WAITING}{{{c.NODE_LABEL}=\'%s\',engine=\'%s\',gpu_uuid=\'%s\'}}" '
               f'{node} $labels.engine $labels.uuid | query | sortByLabel "reason" }}}}{{{{ .Labels.reason }}}}; '
               f"{{{{ end }}}}")
    mount = (c.NODE_LABEL, "mountpoint")
    oldest = figure("gpuio_mount_engine_load_oldest_in_progress_seconds", mount, "humanizeDuration", "none")
    storage = ("{{ if $labels.device }}the disk under {{ $labels.path }}, {{ $labels.device }}, is saturated: "
               f"await {figure(n.AWAIT, device_labels, 'humanizeDuration', '?')}, "
               f"{figure(n.QUEUE, device_labels, ONE_DECIMAL, '?')} requests queued"
               "{{ else }}the network mount under {{ $labels.path }}, {{ $labels.mountpoint }}, is slow: "
               f"NFS READ round trip {figure(n.NFS_READ_RTT, mount, 'humanizeDuration', 'n/a')}, "
               f"oldest engine load in progress {oldest}"
               f"{{{{ end }}}}; IO pressure on the node "
               f"{node_figure(c, n.IO_SOME, 'humanizePercentage', 'n/a (no PSI)')}")
    return alert(
        c, "GPUStarvedByDiskIO", n.STARVED, c.STARVED_FOR, CRITICAL,
        f"Engine {{{{ $labels.engine }}}} on GPU {{{{ $labels.gpu }}}} at {n.NODE} is starved by "
        f"{{{{ $labels.device }}}}{{{{ $labels.mountpoint }}}}.",
        f"GPU {{{{ $labels.gpu }}}} ({{{{ $labels.uuid }}}}) at {n.NODE} is active only "
        f"{{{{ $value | humanizePercentage }}}} (NVML busy, or SM activity where GPM measures it) while work "
        f"queues for engine {{{{ $labels.engine }}}} on it "
        f"({reasons}in flight: {engine_gpu_figure(c, n.ENGINE_IN_FLIGHT, ONE_DECIMAL, '0')}, contexts: "
        f"{engine_gpu_figure(c, 'gpuio_engine_pool_contexts', COUNT, 'n/a')}, pool wait: "
        f"{engine_gpu_figure(c, n.ENGINE_POOL_WAIT, 'humanizeDuration', 'none')}, loads in progress: "
        f"{engine_gpu_figure(c, 'gpuio_engine_loads_in_progress', COUNT, '0')}), and {storage}.",
        board(STARVATION_UID, gpu="{{ $labels.gpu }}", engine="{{ $labels.engine }}"))


def node_gpu_starved(c: Config) -> Rule:
    n = names(c)
    expr = "\n".join([
        n.GPU_IDLE,
        "# the GPU has work: compute processes hold it",
        f"and on ({c.NODE_LABEL}, gpu) (gpuio_gpu_processes{c.selector()} > 0)",
        "# and a disk of the node is saturated",
        f"and on ({c.NODE_LABEL}) count by ({c.NODE_LABEL}) ({n.SATURATED})",
        "# GPUs whose engines report are judged by GPUStarvedByDiskIO instead",
        f"unless on ({c.NODE_LABEL}, uuid)",
        f'  label_replace(gpuio_engine_info{n.WITH_GPU}, "uuid", "$1", "gpu_uuid", "(.+)")',
        "# a frozen or failing NVML reading is no evidence of an idle GPU",
        f"unless on ({c.NODE_LABEL}) {n.GPU_STALE}",
    ])
    disks = (f'{{{{ range printf "{n.SATURATED}{{{c.NODE_LABEL}=\'%s\'}}" $labels.{c.NODE_LABEL} | query }}}}'
             f"{{{{ .Labels.device }}}} (await {{{{ .Value | humanizeDuration }}}}) {{{{ end }}}}")
    return alert(
        c, "NodeGPUStarvedByIO", expr, c.NODE_STARVED_FOR, WARNING,
        f"{GPU_NAME} at {n.NODE} is mostly idle while a disk of the node is saturated.",
        f"{GPU_NAME} at {n.NODE} is active only {{{{ $value | humanizePercentage }}}} (NVML busy, or SM activity "
        f"where GPM measures it) although compute "
        f"processes hold it, while these disks are saturated: {disks}- its data loader is probably "
        f"waiting on IO. No engine reports for this GPU, so this is the node-level guess.",
        board(STARVATION_UID, gpu="{{ $labels.gpu }}"))
