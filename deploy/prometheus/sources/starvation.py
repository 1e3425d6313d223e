"""Starvation: the engine -> GPU -> storage joins, "work waits for this engine on this GPU", and the
alerts built on them (GPUStarvedByDiskIO per engine, NodeGPUStarvedByIO for GPUs no engine reports on)."""

from __future__ import annotations

from ..config import CRITICAL, STARVATION_UID, WARNING, Config
from .base import (
    CRASH_LOOPING,
    LOAD_REASONS,
    LOADING,
    Rule,
    alert,
    board,
    engine_devices,
    engine_disks,
    engine_mounts,
    fill,
    held_through_gaps,
    learned,
    rate,
    reason,
    record,
)
from .names import names
from .templates import COUNT, DEVICE_NAME, GPU_NAME, ONE_DECIMAL, engine_gpu_figure, figure, node_figure


def input_rules(c: Config) -> list[Rule]:
    """What each engine on each GPU does now (in flight, pool wait, loads abandoned: raw series), and the
    device and storage under it (the engine joins)."""
    n = names(c)
    sel = c.selector()
    return [
        *engine_join_rules(c),
        record(n.ENGINE_IN_FLIGHT, f"avg_over_time(gpuio_engine_inferences_in_flight{sel}[{n.W}])"),
        record(n.ENGINE_POOL_WAIT, f"{rate(c, 'gpuio_engine_pool_wait_seconds_sum')}\n/\n"
                                   f"({rate(c, 'gpuio_engine_pool_wait_seconds_count')} > 0)"),
        # Loads of each engine on each GPU abandoned within LOAD_CRASH_LOOP_WINDOW (processes that exited
        # while loading), where there were some.
        record(n.ENGINE_LOADS_ABANDONED, f"increase({abandoned(c)}[{c.LOAD_CRASH_LOOP_WINDOW}]) > 0"),
    ]


def abandoned(c: Config) -> str:
    return f"gpuio_engine_loads_abandoned_total{c.selector()}"


def baseline_rules(c: Config) -> list[Rule]:
    """The calm normals: each GPU's activity and each engine's p99 latency."""
    return [*gpu_calm_rules(c), *latency_rules(c)]


def recording_rules(c: Config) -> list[Rule]:
    """What the alerts judge: GPUs that lost their work, engines' storage and work waiting, starved."""
    return [gpu_lost_rule(c), *waiting_rules(c)]


def gpu_calm_rules(c: Config) -> list[Rule]:
    """Each device's calm activity and its normal."""
    n = names(c)
    # Not calm: a saturated disk or slow mount, a disk far above its own calm await or all of the node's
    # tasks stalling on IO (a storm that no class limit calls saturated still takes the GPU's work: on an
    # H200's virtio disk, which sysfs calls rotational, await 0.8 -> 16 ms, PSI full 0.82, SM activity
    # 0.76 -> 0.24), or GPU data that cannot be trusted.  A busy node's own reads (PSI full ~0.1) are calm.
    storming = "\n".join([
        "(",
        f"  {n.SATURATED} or {n.MOUNT_SLOW} or {n.GPU_STALE}",
        f"  or {n.AWAIT} >= {c.STORM_BASELINE_FACTOR:g} * {n.AWAIT_BASELINE}",
        f"  or {n.IO_FULL} >= {c.STORM_PAGE_IO_FULL:g}",
        ")",
    ])
    return [
        # The activity of the evaluations in which no disk of the node was saturated, no mount slow, IO
        # pressure low and the GPU data fresh: a storm never becomes the activity it is compared with.
        record(n.GPU_CALM_ACTIVITY, f"{n.GPU_ACTIVITY}\nunless on ({c.NODE_LABEL}) {storming}"),
        record(n.GPU_ACTIVITY_LEARNED, learned(c, n.GPU_CALM_ACTIVITY, n.GPU_ACTIVITY)),
        record(n.GPU_ACTIVITY_BASELINE, f"last_over_time({n.GPU_ACTIVITY_LEARNED}[{c.BASELINE_HOLD}])"),
    ]


def gpu_lost_rule(c: Config) -> Rule:
    """Lost its work: below GPU_ACTIVITY_DROP of its calm normal, or mostly idle (the absolute floors
    alone decide for a device with no calm normal).  Value: the activity."""
    n = names(c)
    lost = "\n".join([
        f"{n.GPU_ACTIVITY} < {c.GPU_ACTIVITY_DROP:g} * {n.GPU_ACTIVITY_BASELINE}",
        "or",
        "# mostly idle: whole GPUs by NVML busy or SM activity, MIG devices by their SM activity",
        f"{n.GPU_ACTIVITY} and on ({c.NODE_LABEL}, uuid) {n.GPU_IDLE}",
        "or",
        f'{n.GPU_ACTIVITY}{{gpu_instance!=""}} < {c.GPU_SM_ACTIVE_LOW:g}',
    ])
    return record(n.GPU_ACTIVITY_LOST, lost)


def engine_join_rules(c: Config) -> list[Rule]:
    """engine -> device (GPU or MIG device) and its activity; engine -> the saturated disk or slow mount."""
    n = names(c)
    activity = "\n".join([
        f"max by (job, {c.NODE_LABEL}, engine, path, gpu, uuid, gpu_instance) (",
        f"  {engine_devices(c)}",
        f"  * on ({c.NODE_LABEL}, uuid) group_left (gpu, gpu_instance)",
        f"  {n.GPU_ACTIVITY}",
        ")",
    ])
    disk = "\n".join([
        f"topk by (job, {c.NODE_LABEL}, engine, path) (1,",
        f"  max by (job, {c.NODE_LABEL}, engine, path, device) (",
        f"    {engine_disks(c)}",
        f"    * on ({c.NODE_LABEL}, device) group_left ()",
        f"    {n.SATURATED}",
        "  )",
        ")",
    ])
    mount = "\n".join([
        f"topk by (job, {c.NODE_LABEL}, engine, path) (1,",
        f"  max by (job, {c.NODE_LABEL}, engine, path, mountpoint) (",
        f"    {engine_mounts(c)}",
        f"    * on ({c.NODE_LABEL}, mountpoint) group_left ()",
        f"    {n.MOUNT_SLOW}",
        "  )",
        ")",
    ])
    return [
        # Each engine file's device and its activity (one series per engine, path and device).
        record(n.ENGINE_GPU_ACTIVITY, activity),
        # The worst saturated disk under each engine file, named in `device`; none while no disk is.
        record(n.ENGINE_DISK_SATURATED, disk),
        # The slow network or FUSE mount under each engine file, named in `mountpoint`.
        record(n.ENGINE_MOUNT_SLOW, mount),
    ]


def latency_rules(c: Config) -> list[Rule]:
    """Per engine and GPU (the writer's GPU, gpu_uuid: one replica's queue is not another's): the engine's
    calm p99."""
    n = names(c)
    storage_slow = f"({n.ENGINE_DISK_SATURATED} or {n.ENGINE_MOUNT_SLOW})"
    return [
        # The engine's normal p99, from evaluations in which its storage was not slow (held like the
        # disk baselines): a storm never becomes the latency it is compared with.
        record(n.ENGINE_LATENCY_CALM, f"{p99(c)}\nunless on ({c.NODE_LABEL}, engine)\n{storage_slow}"),
        record(n.ENGINE_LATENCY_LEARNED, learned(c, n.ENGINE_LATENCY_CALM, p99(c), subquery=True)),
        record(n.ENGINE_LATENCY_BASELINE, f"last_over_time({n.ENGINE_LATENCY_LEARNED}[{c.BASELINE_HOLD}])"),
    ]


def bucket_rules(c: Config) -> list[Rule]:
    """The rate of every inference-latency bucket per engine and GPU, once for the three quantiles: the
    costliest rule at fleet scale (every bucket of every engine)."""
    per_gpu = f"job, {c.NODE_LABEL}, engine, gpu_uuid"
    return [record(names(c).ENGINE_LATENCY_BUCKETS,
                   f"sum by ({per_gpu}, le) ({rate(c, 'gpuio_engine_inference_seconds_bucket')})")]


def quantile_rules(c: Config) -> list[Rule]:
    """Latency quantiles per engine and GPU from the bucket rates (the calm p99 reads the 0.99)."""
    n = names(c)
    rules = []
    for q in (0.5, 0.95, 0.99):
        rule = record(n.ENGINE_LATENCY, f"histogram_quantile({q:g}, {n.ENGINE_LATENCY_BUCKETS})")
        rule["labels"] = {"quantile": f"{q:g}"}
        rules.append(rule)
    return rules


def p99(c: Config) -> str:
    return f'max without (quantile) ({names(c).ENGINE_LATENCY}{{quantile="0.99"}})'


def waiting_rules(c: Config) -> list[Rule]:
    """Work waiting per engine and GPU, by reason; loads waited for; starved."""
    n = names(c)
    sel = c.selector()
    # "loads abandoned": at least two loads died unfinished in LOAD_CRASH_LOOP_WINDOW (increase() of a
    # counter stepping by one reads ~1.0 per load: 1.5 means two), or one did within LOAD_RESTART_GRACE
    # (the first attempts of a crash loop restart within seconds), or one did and the engine's GPU is lost
    # (its process died with the GPU; the load starts again after the reset).
    lost_gpus = f'label_replace(gpuio_gpu_up{sel} == 0, "gpu_uuid", "$1", "uuid", "(.+)")'
    crash_looping = (f"{n.ENGINE_LOADS_ABANDONED} >= 1.5\n  or\n"
                     f"  increase({abandoned(c)}[{c.LOAD_RESTART_GRACE}]) > 0\n  or\n"
                     f"  {n.ENGINE_LOADS_ABANDONED} and on ({c.NODE_LABEL}, gpu_uuid) {lost_gpus}")
    waiting = "\nor\n".join([
        reason(f"{n.ENGINE_POOL_WAIT} >= {c.ENGINE_POOL_WAIT_SECONDS:g}", "pool wait"),
        reason(f"{n.ENGINE_IN_FLIGHT}\n  >= on ({c.NODE_LABEL}, engine, gpu_uuid)\n"
               f"(gpuio_engine_pool_contexts{sel} > 0)", "in flight >= contexts"),
        reason(f"{p99(c)}\n  >= on ({c.NODE_LABEL}, engine, gpu_uuid) "
               f"({c.ENGINE_LATENCY_FACTOR:g} * {n.ENGINE_LATENCY_BASELINE})",
               f"p99 latency >= {c.ENGINE_LATENCY_FACTOR:g}x its normal"),
        reason(f"gpuio_engine_loads_in_progress{sel} > 0", LOADING),
        reason(crash_looping, CRASH_LOOPING),
    ])
    loads = f'max without (reason) ({n.WORK_WAITING}{{reason=~"{LOAD_REASONS}"}})'
    busy = f"({n.GPU_ACTIVITY} unless on ({c.NODE_LABEL}, uuid) {n.GPU_ACTIVITY_LOST})"

    def starved_by(storage: str, label: str) -> str:
        """The device's activity, where it lost its work, on the engine files over ``storage`` (named in ``label``)."""
        return "\n".join([
            f"  (0 * {n.ENGINE_GPU_ACTIVITY} + on ({c.NODE_LABEL}, uuid) group_left () {n.GPU_ACTIVITY_LOST})",
            f"  + on ({c.NODE_LABEL}, engine, path) group_left ({label}) (0 * {storage})",
        ])
    return [
        # Work queueing for an engine on one GPU, one series per reason.  Never "a request is in
        # flight": a spare replica serving a request now and then is idle, not starved.
        record(n.WORK_WAITING, waiting),
        # Engines whose loads are waited for: loading or crash-looping on a device that is not busy
        # serving (or is unknown).  A new generation loading beside the old one on a busy GPU (a
        # blue/green or rolling reload) is not: nobody waits for it.
        record(n.LOADS_WAITED_FOR, f'label_replace({loads}, "uuid", "$1", "gpu_uuid", "(.+)")\n'
                                   f"unless on ({c.NODE_LABEL}, uuid) {busy}"),
        # Starved: the engine's device lost its work, work waits for the engine on that device, its
        # storage is saturated (a disk, named in `device`) or slow (a network mount, named in
        # `mountpoint`), and the node's GPU data is fresh.  Value: the device's activity.
        # GPUStarvedByDiskIO is this for `for`.
        record(n.STARVED, "\n".join([
            "(",
            starved_by(n.ENGINE_DISK_SATURATED, "device"),
            "  or",
            starved_by(n.ENGINE_MOUNT_SLOW, "mountpoint"),
            ")",
            f"and on ({c.NODE_LABEL}, engine, uuid)",
            f'  label_replace({n.WORK_WAITING}, "uuid", "$1", "gpu_uuid", "(.+)")',
            f"unless on ({c.NODE_LABEL}) {n.GPU_STALE}",
        ])),
    ]


def alerts(c: Config) -> list[Rule]:
    return [starved_alert(c), node_gpu_starved(c)]


def starved_alert(c: Config) -> Rule:
    n = names(c)
    device_labels = (c.NODE_LABEL, "device")
    waiting = fill("${work_waiting}{${node}='%s',engine='%s',gpu_uuid='%s'}",
                   work_waiting=n.WORK_WAITING, node=c.NODE_LABEL)
    reasons = fill('{{ range printf "${waiting}" $labels.${node} $labels.engine $labels.uuid | query '
                   '| sortByLabel "reason" }}{{ .Labels.reason }}; {{ end }}', waiting=waiting, node=c.NODE_LABEL)
    mount = (c.NODE_LABEL, "mountpoint")
    oldest = figure("gpuio_mount_engine_load_oldest_in_progress_seconds", mount, "humanizeDuration", "none")
    storage = fill(
        "{{ if $labels.device }}the disk under {{ $labels.path }}, {{ $labels.device }}, is saturated: "
        "await ${disk_await}, ${queue} requests queued"
        "{{ else }}the network mount under {{ $labels.path }}, {{ $labels.mountpoint }}, is slow: "
        "NFS READ round trip ${rtt}, oldest engine load in progress ${oldest}{{ end }}; "
        "IO pressure on the node ${io_some}",
        disk_await=figure(n.AWAIT, device_labels, "humanizeDuration", "?"),
        queue=figure(n.QUEUE, device_labels, ONE_DECIMAL, "?"),
        rtt=figure(n.NFS_READ_RTT, mount, "humanizeDuration", "n/a"), oldest=oldest,
        io_some=node_figure(c, n.IO_SOME, "humanizePercentage", "n/a (no PSI)"))
    calm = figure(n.GPU_ACTIVITY_BASELINE, (c.NODE_LABEL, "uuid"), "humanizePercentage", "none learned")
    return alert(
        c, "GPUStarvedByDiskIO", held_through_gaps(c, n.STARVED, "GPUStarvedByDiskIO", CRITICAL), c.STARVED_FOR,
        CRITICAL,
        fill("Engine {{ $labels.engine }} on ${device} at ${node} is starved by "
             "{{ $labels.device }}{{ $labels.mountpoint }}.", device=DEVICE_NAME, node=n.NODE),
        fill("${device} ({{ $labels.uuid }}) at ${node} is active only {{ $value | humanizePercentage }} "
             "(SM activity where GPM measures it, else NVML busy; its calm normal: ${calm}) while work queues "
             "for engine {{ $labels.engine }} on it (${reasons}in flight: ${in_flight}, contexts: ${contexts}, "
             "pool wait: ${pool_wait}, loads in progress: ${loading}, loads abandoned in the last ${window}: "
             "${abandoned}), and ${storage}.",
             device=DEVICE_NAME, node=n.NODE, calm=calm, reasons=reasons,
             in_flight=engine_gpu_figure(c, n.ENGINE_IN_FLIGHT, ONE_DECIMAL, "0"),
             contexts=engine_gpu_figure(c, "gpuio_engine_pool_contexts", COUNT, "n/a"),
             pool_wait=engine_gpu_figure(c, n.ENGINE_POOL_WAIT, "humanizeDuration", "none"),
             loading=engine_gpu_figure(c, "gpuio_engine_loads_in_progress", COUNT, "0"),
             window=c.LOAD_CRASH_LOOP_WINDOW,
             abandoned=engine_gpu_figure(c, n.ENGINE_LOADS_ABANDONED, COUNT, "0"), storage=storage),
        board(STARVATION_UID, gpu="{{ $labels.gpu }}", engine="{{ $labels.engine }}"))


def node_gpu_starved(c: Config) -> Rule:
    n = names(c)
    engines_on = engine_devices(c)
    mig_engines_on = (f"gpuio_gpu_mig_device_info{c.selector()}\n    and on ({c.NODE_LABEL}, mig_uuid) "
                      f'label_replace({engines_on}, "mig_uuid", "$1", "uuid", "(.+)")')
    expr = "\n".join([
        n.GPU_IDLE,
        "# the GPU has work: compute processes hold it",
        f"and on ({c.NODE_LABEL}, gpu) (gpuio_gpu_processes{c.selector()} > 0)",
        "# and a disk of the node is saturated",
        f"and on ({c.NODE_LABEL}) count by ({c.NODE_LABEL}) ({n.SATURATED})",
        "# GPUs whose engines report (on the GPU or one of its MIG devices) are judged by GPUStarvedByDiskIO",
        f"unless on ({c.NODE_LABEL}, uuid)",
        "(",
        f"  {engines_on}",
        "  or",
        f"  {mig_engines_on}",
        ")",
        "# a frozen or failing NVML reading is no evidence of an idle GPU",
        f"unless on ({c.NODE_LABEL}) {n.GPU_STALE}",
    ])
    saturated = fill("${saturated}{${node}='%s'}", saturated=n.SATURATED, node=c.NODE_LABEL)
    disks = fill('{{ range printf "${saturated}" $labels.${node} | query }}'
                 "{{ .Labels.device }} (await {{ .Value | humanizeDuration }}) {{ end }}",
                 saturated=saturated, node=c.NODE_LABEL)
    return alert(
        c, "NodeGPUStarvedByIO", expr, c.NODE_STARVED_FOR, WARNING,
        f"{GPU_NAME} at {n.NODE} is mostly idle while a disk of the node is saturated.",
        fill("${gpu} at ${node} is active only {{ $value | humanizePercentage }} (NVML busy, or SM activity "
             "where GPM measures it) although compute processes hold it, while these disks are saturated: "
             "${disks}- its data loader is probably waiting on IO. No engine reports for this GPU, so this is "
             "the node-level guess.", gpu=GPU_NAME, node=n.NODE, disks=disks),
        board(STARVATION_UID, gpu="{{ $labels.gpu }}"))
