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
    held,
    held_through_gaps,
    indent,
    learned,
    rate,
    reason,
    record,
)
from .names import names
from .templates import COUNT, DEVICE_NAME, GPU_NAME, ONE_DECIMAL, engine_gpu_figure, figure, node_figure


def input_rules(config: Config) -> list[Rule]:
    """What each engine on each GPU does now (in flight, pool wait, loads abandoned: raw series), and the
    device and storage under it (the engine joins)."""
    recorded = names(config)
    sel = config.selector()
    return [
        *engine_join_rules(config),
        record(recorded.ENGINE_IN_FLIGHT,
               f"avg_over_time(gpuio_engine_inferences_in_flight{sel}[{config.RATE_WINDOW}])"),
        record(recorded.ENGINE_POOL_WAIT, f"{rate(config, 'gpuio_engine_pool_wait_seconds_sum')}\n/\n"
                                          f"({rate(config, 'gpuio_engine_pool_wait_seconds_count')} > 0)"),
        # Loads of each engine on each GPU abandoned within LOAD_CRASH_LOOP_WINDOW (processes that exited
        # while loading), where there were some.
        record(recorded.ENGINE_LOADS_ABANDONED, f"increase({abandoned(config)}[{config.LOAD_CRASH_LOOP_WINDOW}]) > 0"),
    ]


def abandoned(config: Config) -> str:
    return f"gpuio_engine_loads_abandoned_total{config.selector()}"


def baseline_rules(config: Config) -> list[Rule]:
    """The calm normals: each GPU's activity and each engine's p99 latency."""
    return [*gpu_calm_rules(config), *latency_rules(config)]


def recording_rules(config: Config) -> list[Rule]:
    """What the alerts judge: GPUs that lost their work, engines' storage and work waiting, starved."""
    return [gpu_lost_rule(config), *waiting_rules(config)]


def gpu_calm_rules(config: Config) -> list[Rule]:
    """Each device's calm activity and its normal."""
    recorded = names(config)
    # Not calm: a saturated disk or slow mount, a disk far above its own calm await or all of the node's
    # tasks stalling on IO (a storm that no class limit calls saturated still takes the GPU's work: on an
    # H200's virtio disk, which sysfs calls rotational, await 0.8 -> 16 ms, PSI full 0.82, SM activity
    # 0.76 -> 0.24), or GPU data that cannot be trusted.  A busy node's own reads (PSI full ~0.1) are calm.
    storming = "\n".join([
        "(",
        f"  {recorded.SATURATED} or {recorded.MOUNT_SLOW} or {recorded.GPU_STALE}",
        f"  or {recorded.AWAIT} >= {config.STORM_BASELINE_FACTOR:g} * {recorded.AWAIT_BASELINE}",
        f"  or {recorded.IO_FULL} >= {config.STORM_PAGE_IO_FULL:g}",
        ")",
    ])
    return [
        # The activity of the evaluations in which no disk of the node was saturated, no mount slow, IO
        # pressure low and the GPU data fresh: a storm never becomes the activity it is compared with.
        record(recorded.GPU_CALM_ACTIVITY, f"{recorded.GPU_ACTIVITY}\nunless on ({config.NODE_LABEL}) {storming}"),
        record(recorded.GPU_ACTIVITY_LEARNED, learned(config, recorded.GPU_CALM_ACTIVITY, recorded.GPU_ACTIVITY)),
        record(recorded.GPU_ACTIVITY_BASELINE,
               f"last_over_time({recorded.GPU_ACTIVITY_LEARNED}[{config.BASELINE_HOLD}])"),
    ]


def gpu_lost_rule(config: Config) -> Rule:
    """Lost its work: below GPU_ACTIVITY_DROP of its calm normal, or mostly idle (the absolute floors
    alone decide for a device with no calm normal).  Value: the activity."""
    recorded = names(config)
    lost = "\n".join([
        f"{recorded.GPU_ACTIVITY} < {config.GPU_ACTIVITY_DROP:g} * {recorded.GPU_ACTIVITY_BASELINE}",
        "or",
        "# mostly idle: whole GPUs by NVML busy or SM activity, MIG devices by their SM activity",
        f"{recorded.GPU_ACTIVITY} and on ({config.NODE_LABEL}, uuid) {recorded.GPU_IDLE}",
        "or",
        f'{recorded.GPU_ACTIVITY}{{gpu_instance!=""}} < {config.GPU_SM_ACTIVE_LOW:g}',
    ])
    return record(recorded.GPU_ACTIVITY_LOST, lost)


def engine_join_rules(config: Config) -> list[Rule]:
    """engine -> device (GPU or MIG device) and its activity; engine -> the saturated disk or slow mount."""
    recorded = names(config)
    activity = "\n".join([
        f"max by (job, {config.NODE_LABEL}, engine, path, gpu, uuid, gpu_instance) (",
        f"  {engine_devices(config)}",
        f"  * on ({config.NODE_LABEL}, uuid) group_left (gpu, gpu_instance)",
        f"  {recorded.GPU_ACTIVITY}",
        ")",
    ])
    disk = "\n".join([
        f"topk by (job, {config.NODE_LABEL}, engine, path) (1,",
        f"  max by (job, {config.NODE_LABEL}, engine, path, device) (",
        f"    {engine_disks(config)}",
        f"    * on ({config.NODE_LABEL}, device) group_left ()",
        f"    {recorded.SATURATED}",
        "  )",
        ")",
    ])
    mount = "\n".join([
        f"topk by (job, {config.NODE_LABEL}, engine, path) (1,",
        f"  max by (job, {config.NODE_LABEL}, engine, path, mountpoint) (",
        f"    {engine_mounts(config)}",
        f"    * on ({config.NODE_LABEL}, mountpoint) group_left ()",
        f"    {recorded.MOUNT_SLOW}",
        "  )",
        ")",
    ])
    return [
        # Each engine file's device and its activity (one series per engine, path and device).
        record(recorded.ENGINE_GPU_ACTIVITY, activity),
        # The worst saturated disk under each engine file, named in `device`; none while no disk is.
        record(recorded.ENGINE_DISK_SATURATED, disk),
        # The slow network or FUSE mount under each engine file, named in `mountpoint`.
        record(recorded.ENGINE_MOUNT_SLOW, mount),
    ]


def latency_rules(config: Config) -> list[Rule]:
    """Per engine and GPU (the writer's GPU, gpu_uuid: one replica's queue is not another's): the engine's
    calm p99."""
    recorded = names(config)
    storage_slow = f"({recorded.ENGINE_DISK_SATURATED} or {recorded.ENGINE_MOUNT_SLOW})"
    return [
        # The engine's normal p99, from evaluations in which its storage was not slow (held like the
        # disk baselines): a storm never becomes the latency it is compared with.
        record(recorded.ENGINE_LATENCY_CALM, f"{p99(config)}\nunless on ({config.NODE_LABEL}, engine)\n{storage_slow}"),
        record(recorded.ENGINE_LATENCY_LEARNED,
               learned(config, recorded.ENGINE_LATENCY_CALM, p99(config), subquery=True)),
        record(recorded.ENGINE_LATENCY_BASELINE,
               f"last_over_time({recorded.ENGINE_LATENCY_LEARNED}[{config.BASELINE_HOLD}])"),
    ]


def bucket_rules(config: Config) -> list[Rule]:
    """The rate of every inference-latency bucket per engine and GPU, once for the three quantiles: the
    costliest rule at fleet scale (every bucket of every engine)."""
    per_gpu = f"job, {config.NODE_LABEL}, engine, gpu_uuid"
    return [record(names(config).ENGINE_LATENCY_BUCKETS,
                   f"sum by ({per_gpu}, le) ({rate(config, 'gpuio_engine_inference_seconds_bucket')})")]


def quantile_rules(config: Config) -> list[Rule]:
    """Latency quantiles per engine and GPU from the bucket rates (the calm p99 reads the 0.99)."""
    recorded = names(config)
    rules = []
    for q in (0.5, 0.95, 0.99):
        rule = record(recorded.ENGINE_LATENCY, f"histogram_quantile({q:g}, {recorded.ENGINE_LATENCY_BUCKETS})")
        rule["labels"] = {"quantile": f"{q:g}"}
        rules.append(rule)
    return rules


def p99(config: Config) -> str:
    return f'max without (quantile) ({names(config).ENGINE_LATENCY}{{quantile="0.99"}})'


def waiting_rules(config: Config) -> list[Rule]:
    """Work waiting per engine and GPU, by reason; loads waited for; starved."""
    recorded = names(config)
    sel = config.selector()
    # "loads abandoned": at least two loads died unfinished in LOAD_CRASH_LOOP_WINDOW (increase() of a
    # counter stepping by one reads ~1.0 per load: 1.5 means two), or one did within LOAD_RESTART_GRACE
    # (the first attempts of a crash loop restart within seconds), or one did and the engine's GPU is lost
    # (its process died with the GPU; the load starts again after the reset).
    lost_gpus = f'label_replace(gpuio_gpu_up{sel} == 0, "gpu_uuid", "$1", "uuid", "(.+)")'
    crash_looping = (f"{recorded.ENGINE_LOADS_ABANDONED} >= 1.5\n  or\n"
                     f"  increase({abandoned(config)}[{config.LOAD_RESTART_GRACE}]) > 0\n  or\n"
                     f"  {recorded.ENGINE_LOADS_ABANDONED} and on ({config.NODE_LABEL}, gpu_uuid) {lost_gpus}")
    waiting = "\nor\n".join([
        reason(f"{recorded.ENGINE_POOL_WAIT} >= {config.ENGINE_POOL_WAIT_SECONDS:g}", "pool wait"),
        reason(f"{recorded.ENGINE_IN_FLIGHT}\n  >= on ({config.NODE_LABEL}, engine, gpu_uuid)\n"
               f"(gpuio_engine_pool_contexts{sel} > 0)", "in flight >= contexts"),
        reason(f"{p99(config)}\n  >= on ({config.NODE_LABEL}, engine, gpu_uuid) "
               f"({config.ENGINE_LATENCY_FACTOR:g} * {recorded.ENGINE_LATENCY_BASELINE})",
               f"p99 latency >= {config.ENGINE_LATENCY_FACTOR:g}x its normal"),
        reason(f"gpuio_engine_loads_in_progress{sel} > 0", LOADING),
        reason(crash_looping, CRASH_LOOPING),
    ])
    loads = f'max without (reason) ({recorded.WORK_WAITING}{{reason=~"{LOAD_REASONS}"}})'
    busy = f"({recorded.GPU_ACTIVITY} unless on ({config.NODE_LABEL}, uuid) {recorded.GPU_ACTIVITY_LOST})"

    def starved_by(storage: str, label: str) -> str:
        """The device's activity, where it lost its work, on the engine files over ``storage`` (named in ``label``)."""
        return "\n".join([
            f"  (0 * {recorded.ENGINE_GPU_ACTIVITY}"
            f" + on ({config.NODE_LABEL}, uuid) group_left () {recorded.GPU_ACTIVITY_LOST})",
            f"  + on ({config.NODE_LABEL}, engine, path) group_left ({label}) (0 * {storage})",
        ])
    return [
        # Work queueing for an engine on one GPU, one series per reason.  Never "a request is in
        # flight": a spare replica serving a request now and then is idle, not starved.
        record(recorded.WORK_WAITING, waiting),
        # Engines whose loads are waited for: loading or crash-looping on a device that is not busy
        # serving (or is unknown).  A new generation loading beside the old one on a busy GPU (a
        # blue/green or rolling reload) is not: nobody waits for it.
        record(recorded.LOADS_WAITED_FOR, f'label_replace({loads}, "uuid", "$1", "gpu_uuid", "(.+)")\n'
                                          f"unless on ({config.NODE_LABEL}, uuid) {busy}"),
        # Starved: the engine's device lost its work, work waits for the engine on that device, its
        # storage is saturated (a disk, named in `device`) or slow (a network mount, named in
        # `mountpoint`), and the node's GPU data is fresh.  Value: the device's activity.  One series per
        # engine, device and storage, whatever the number of its files: a checkpoint of 100 shards (each
        # shard's path held for ENGINE_HOLD) or a model's old and new version is one engine starving one
        # device.  GPUStarvedByDiskIO is this for `for`.
        record(recorded.STARVED, "\n".join([
            "max without (path) (",
            "  (",
            indent(starved_by(recorded.ENGINE_DISK_SATURATED, "device")),
            "    or",
            indent(starved_by(recorded.ENGINE_MOUNT_SLOW, "mountpoint")),
            "  )",
            f"  and on ({config.NODE_LABEL}, engine, uuid)",
            f'    label_replace({recorded.WORK_WAITING}, "uuid", "$1", "gpu_uuid", "(.+)")',
            ")",
            f"unless on ({config.NODE_LABEL}) {recorded.GPU_STALE}",
        ])),
    ]


def alerts(config: Config) -> list[Rule]:
    return [starved_alert(config), node_gpu_starved(config)]


def starved_alert(config: Config) -> Rule:
    recorded = names(config)
    device_labels = (config.NODE_LABEL, "device")
    waiting = fill("${work_waiting}{${node}='%s',engine='%s',gpu_uuid='%s'}",
                   work_waiting=recorded.WORK_WAITING, node=config.NODE_LABEL)
    reasons = fill('{{ range printf "${waiting}" $labels.${node} $labels.engine $labels.uuid | query '
                   '| sortByLabel "reason" }}{{ .Labels.reason }}; {{ end }}', waiting=waiting, node=config.NODE_LABEL)
    mount = (config.NODE_LABEL, "mountpoint")
    oldest = figure("gpuio_mount_engine_load_oldest_in_progress_seconds", mount, "humanizeDuration", "none")
    storage = fill(
        "{{ if $labels.device }}the disk under its files, {{ $labels.device }}, is saturated: "
        "await ${disk_await}, ${queue} requests queued"
        "{{ else }}the network mount under its files, {{ $labels.mountpoint }}, is slow: "
        "NFS READ round trip ${rtt}, oldest engine load in progress ${oldest}{{ end }}; "
        "IO pressure on the node ${io_some}",
        disk_await=figure(recorded.AWAIT, device_labels, "humanizeDuration", "?"),
        queue=figure(recorded.QUEUE, device_labels, ONE_DECIMAL, "?"),
        rtt=figure(recorded.NFS_READ_RTT, mount, "humanizeDuration", "n/a"), oldest=oldest,
        io_some=node_figure(config, recorded.IO_SOME, "humanizePercentage", "n/a (no PSI)"))
    calm = figure(recorded.GPU_ACTIVITY_BASELINE, (config.NODE_LABEL, "uuid"), "humanizePercentage", "none learned")
    return alert(
        config, "GPUStarvedByDiskIO", held_through_gaps(config, recorded.STARVED, "GPUStarvedByDiskIO", CRITICAL),
        config.STARVED_FOR, CRITICAL,
        fill("Engine {{ $labels.engine }} on ${device} at ${node} is starved by "
             "{{ $labels.device }}{{ $labels.mountpoint }}.", device=DEVICE_NAME, node=recorded.NODE),
        fill("${device} ({{ $labels.uuid }}) at ${node} is active only {{ $value | humanizePercentage }} "
             "(SM activity where GPM measures it, else NVML busy; its calm normal: ${calm}) while work queues "
             "for engine {{ $labels.engine }} on it (${reasons}in flight: ${in_flight}, contexts: ${contexts}, "
             "pool wait: ${pool_wait}, loads in progress: ${loading}, loads abandoned in the last ${window}: "
             "${abandoned}), and ${storage}.",
             device=DEVICE_NAME, node=recorded.NODE, calm=calm, reasons=reasons,
             in_flight=engine_gpu_figure(config, recorded.ENGINE_IN_FLIGHT, ONE_DECIMAL, "0"),
             contexts=engine_gpu_figure(config, "gpuio_engine_pool_contexts", COUNT, "n/a"),
             pool_wait=engine_gpu_figure(config, recorded.ENGINE_POOL_WAIT, "humanizeDuration", "none"),
             loading=engine_gpu_figure(config, "gpuio_engine_loads_in_progress", COUNT, "0"),
             window=config.LOAD_CRASH_LOOP_WINDOW,
             abandoned=engine_gpu_figure(config, recorded.ENGINE_LOADS_ABANDONED, COUNT, "0"), storage=storage),
        board(STARVATION_UID, gpu="{{ $labels.gpu }}", engine="{{ $labels.engine }}"))


def node_gpu_starved(config: Config) -> Rule:
    recorded = names(config)
    engines_on = engine_devices(config)
    mig_engines_on = (f"gpuio_gpu_mig_device_info{config.selector()}\n    and on ({config.NODE_LABEL}, mig_uuid) "
                      f'label_replace({engines_on}, "mig_uuid", "$1", "uuid", "(.+)")')
    expr = "\n".join([
        recorded.GPU_IDLE,
        f"# the GPU has work: compute processes hold it, or did in the last {config.ENGINE_HOLD} (a crash-looping",
        "# process leaves the GPU without one between its attempts)",
        f"and on ({config.NODE_LABEL}, gpu) ({held(config, 'gpuio_gpu_processes' + config.selector(), 'max')} > 0)",
        "# and a disk of the node is saturated",
        f"and on ({config.NODE_LABEL}) count by ({config.NODE_LABEL}) ({recorded.SATURATED})",
        "# GPUs whose engines report (on the GPU or one of its MIG devices) are judged by GPUStarvedByDiskIO",
        f"unless on ({config.NODE_LABEL}, uuid)",
        "(",
        f"  {engines_on}",
        "  or",
        f"  {mig_engines_on}",
        ")",
        "# a frozen or failing NVML reading is no evidence of an idle GPU",
        f"unless on ({config.NODE_LABEL}) {recorded.GPU_STALE}",
    ])
    saturated = fill("${saturated}{${node}='%s'}", saturated=recorded.SATURATED, node=config.NODE_LABEL)
    disks = fill('{{ range printf "${saturated}" $labels.${node} | query }}'
                 "{{ .Labels.device }} (await {{ .Value | humanizeDuration }}) {{ end }}",
                 saturated=saturated, node=config.NODE_LABEL)
    return alert(
        config, "NodeGPUStarvedByIO", expr, config.NODE_STARVED_FOR, WARNING,
        f"{GPU_NAME} at {recorded.NODE} is mostly idle while a disk of the node is saturated.",
        fill("${gpu} at ${node} is active only {{ $value | humanizePercentage }} (NVML busy, or SM activity "
             "where GPM measures it) although compute processes hold it, while these disks are saturated: "
             "${disks}- its data loader is probably waiting on IO. No engine reports for this GPU, so this is "
             "the node-level guess.", gpu=GPU_NAME, node=recorded.NODE, disks=disks),
        board(STARVATION_UID, gpu="{{ $labels.gpu }}"))
