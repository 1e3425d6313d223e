"""GPUs (nvml collector): busy ratio, "the GPU data is stale", and the GPU hardware alerts."""

from __future__ import annotations

from ..config import CRITICAL, GPU_UID, WARNING, Config
from .base import Rule, alert, board, fill, rate, reason, record
from .names import names
from .templates import COUNT, GPU_NAME, figure, node_figure, query_figure


def recording_rules(config: Config) -> list[Rule]:
    recorded = names(config)
    sel = config.selector()
    stale = "\n".join([
        f"max by (job, {config.NODE_LABEL}) (max_over_time(gpuio_gpu_snapshot_age_seconds{sel}[{config.RATE_WINDOW}]))",
        f"  > {config.GPU_STALE_AFTER_SECONDS}",
        "or",
        f"max by (job, {config.NODE_LABEL}) (",
        f"  1 - min_over_time({recorded.NVML_SUCCESS}[{config.RATE_WINDOW}]) > 0",
        ")",
    ])
    mig = "\n".join([
        f"max by (job, {config.NODE_LABEL}, gpu, uuid, gpu_instance) (",
        "  label_replace(",
        f"    gpuio_gpu_mig_device_info{sel}",
        f"    * on ({config.NODE_LABEL}, uuid, gpu_instance) group_left ()",
        f"    {rate(config, 'gpuio_gpu_mig_sm_active_seconds_total')},",
        '    "uuid", "$1", "mig_uuid", "(.+)"',
        "  )",
        ")",
    ])
    return [
        record(recorded.GPU_BUSY, rate(config, "gpuio_gpu_busy_seconds_total")),
        # What each device engines run on does, one series per GPU and per MIG device (``uuid``: what the
        # engines report): SM activity where GPM measures it (busy reads 100 % with one block spinning),
        # else NVML busy; a MIG device has only its GPU instance's SM activity (NVML has no busy for it).
        # A GPU lost within the rate window (fallen off the bus, Xid 79, reset) does nothing until its counters
        # have a rate again: 0, so that an engine waiting for it through the reset stays one judgement
        # (GPULost pages for the GPU itself).
        # SM activity, once for the two rules below: GPM's where it measures it, else dcgm-exporter's.
        record(recorded.GPU_SM_ACTIVE,
               f'{rate(config, "gpuio_gpu_sm_active_seconds_total")}\nor\n{dcgm_sm_active(config)}'),
        record(recorded.GPU_ACTIVITY, f"{recorded.GPU_SM_ACTIVE}\nor\n{recorded.GPU_BUSY}\nor\n{mig}\n"
                                      f"or\n0 * (min_over_time(gpuio_gpu_up{sel}[{config.RATE_WINDOW}]) == 0)"),
        # Mostly idle: NVML busy low, or few SMs working where GPM (or dcgm-exporter) measures it (busy reads
        # 100 % while one thread spins or weights cross PCIe).  Value: the busy ratio, else the SM activity.
        record(recorded.GPU_IDLE, f"{recorded.GPU_BUSY} < {config.GPU_BUSY_LOW:g}\nor\n"
                                  f"{recorded.GPU_SM_ACTIVE} < {config.GPU_SM_ACTIVE_LOW:g}"),
        # Nodes whose GPU readings are not to be trusted: the NVML snapshot was older than
        # GPU_STALE_AFTER_SECONDS, or the nvml collector failed, at some scrape within RATE_WINDOW
        # (a frozen busy counter reads as an idle GPU).  No starvation alert judges their GPUs.
        # Value: the age, or the share of failed scrapes.
        record(recorded.GPU_STALE, stale),
    ]


def dcgm_sm_active(config: Config) -> str:
    """dcgm-exporter's SM activity of each whole GPU (not a MIG instance: GPU_I_ID set) over the rate window,
    labelled like gpuio's busy series of the GPU with that UUID (GPU UUIDs are unique, so dcgm-exporter's own
    node label never matters).  DCGM serves a gauge averaged over its watch period; its average over the
    window is the same idea as GPM's rate, which comes first where both exist (GPU_SM_ACTIVE's ``or``)."""
    recorded = names(config)
    dcgm = config.DCGM_SELECTOR + ',GPU_I_ID=""'
    return "\n".join([
        f"({recorded.GPU_BUSY} * 0) + on (uuid) group_left ()",
        "max by (uuid) (",
        fill('  label_replace(avg_over_time(DCGM_FI_PROF_SM_ACTIVE{${dcgm}}[${window}]), "uuid", "$1", "UUID", "(.+)")',
             dcgm=dcgm, window=config.RATE_WINDOW),
        ")",
    ])


def alerts(config: Config) -> list[Rule]:
    recorded = names(config)
    sel = config.selector()
    reasons = "|".join(config.GPU_THROTTLE_REASONS)
    throttling = config.selector(f'reason=~"{reasons}"')
    throttled = "\n".join([
        f"rate(gpuio_gpu_clocks_event_seconds_total{throttling}[{config.GPU_THROTTLE_WINDOW}])"
        f" > {config.GPU_THROTTLE_RATIO:g}",
        "or",
        "# reasons (or GPUs) without a violation counter: the sampled reason itself",
        f"(gpuio_gpu_clocks_event_reason_active{throttling} == 1",
        f"  unless on ({config.NODE_LABEL}, gpu, reason) gpuio_gpu_clocks_event_seconds_total{sel})",
    ])
    degraded = "\n".join([
        f"gpuio_gpu_pcie_link_width{sel} < gpuio_gpu_pcie_link_width_max{sel}",
        "or",
        f"(gpuio_gpu_pcie_link_generation{sel} < gpuio_gpu_pcie_link_generation_max{sel})",
        f"  and on ({config.NODE_LABEL}, gpu) {recorded.GPU_BUSY} >= {config.PCIE_GENERATION_BUSY:g}",
    ])
    application_xids = "|".join(config.XID_APPLICATION)
    not_application = config.selector(f'xid!~"{application_xids}"')
    xid = f"time() - gpuio_gpu_xid_last_timestamp_seconds{not_application} < {config.XID_RECENT_SECONDS}"
    ecc_window = config.GPU_ECC_WINDOW
    uncorrected = "gpuio_gpu_ecc_errors_total" + config.selector('error="uncorrected"')
    ecc = "\nor\n".join([
        reason(f"{uncorrected} > min_over_time({uncorrected}[{ecc_window}])",
               f"uncorrectable ECC errors in the last {ecc_window}"),
        reason(f"gpuio_gpu_remapped_rows_pending{sel} == 1", "a row remap waits for a GPU reset"),
        reason(f"gpuio_gpu_remapped_rows_failure{sel} == 1", "a row remap failed"),
    ])
    width = figure("gpuio_gpu_pcie_link_width", recorded.GPU_LABELS, COUNT, "?")
    width_max = figure("gpuio_gpu_pcie_link_width_max", recorded.GPU_LABELS, COUNT, "?")
    gen = figure("gpuio_gpu_pcie_link_generation", recorded.GPU_LABELS, COUNT, "?")
    gen_max = figure("gpuio_gpu_pcie_link_generation_max", recorded.GPU_LABELS, COUNT, "?")
    xid_count = figure("gpuio_gpu_xid_errors_total", (*recorded.GPU_LABELS, "xid"), COUNT, "?")
    this_gpu = board(GPU_UID, gpu="{{ $labels.gpu }}")
    missing = fill("{{ $value | ${count} }}", count=COUNT)
    return [
        alert(config, "GPULost", f"gpuio_gpu_up{sel} == 0", config.GPU_LOST_FOR, CRITICAL,
              f"{GPU_NAME} at {recorded.NODE} is lost.",
              f"{GPU_NAME} at {recorded.NODE} does not answer NVML: it is lost, needs a reset, or fell off the bus "
              f"(Xid 79). Its work has stopped; anything scheduled on it fails or waits.", this_gpu),
        alert(config, "GPUMissing",
              f"max_over_time(gpuio_gpu_devices{sel}[{config.GPU_MISSING_WINDOW}]) - gpuio_gpu_devices{sel} > 0",
              config.GPU_LOST_FOR, CRITICAL,
              f"{missing} GPU(s) missing at {recorded.NODE}.",
              f"NVML at {recorded.NODE} enumerates {node_figure(config, 'gpuio_gpu_devices', COUNT, '?')} GPU(s), "
              f"{missing} fewer "
              f"than in the last {config.GPU_MISSING_WINDOW}: a GPU fell off the bus, or the driver has not seen it "
              f"since a restart, so no gpuio_gpu_up series is left to go to 0. Work scheduled for it fails or "
              f"waits. After a planned removal, silence this for {config.GPU_MISSING_WINDOW}.", board(GPU_UID)),
        alert(config, "GPUThrottled", throttled, config.GPU_THROTTLE_FOR, WARNING,
              fill("${gpu} at ${node} is throttled: {{ $labels.reason }}.", gpu=GPU_NAME, node=recorded.NODE),
              fill("Clocks of ${gpu} at ${node} are held down by {{ $labels.reason }} (share of the last ${window}: "
                   "{{ $value | humanizePercentage }}; 1 = active now where the GPU has no counter). Work on it runs "
                   "slower; this is heat or power delivery, not the disk.",
                   gpu=GPU_NAME, node=recorded.NODE, window=config.GPU_THROTTLE_WINDOW), this_gpu),
        alert(config, "GPUPCIeLinkDegraded", degraded, config.PCIE_DEGRADED_FOR, WARNING,
              f"PCIe link of {GPU_NAME} at {recorded.NODE} is degraded.",
              f"The PCIe link of {GPU_NAME} at {recorded.NODE} runs at x{width} of x{width_max}, Gen {gen} of "
              f"Gen {gen_max} (generation judged only while the GPU is busy: it downshifts when idle). "
              f"Host-to-GPU copies (engine loads, inputs) are slower.", this_gpu),
        alert(config, "GPUXidError", xid, None, WARNING,
              fill("Xid {{ $labels.xid }} on ${gpu} at ${node}.", gpu=GPU_NAME, node=recorded.NODE),
              fill("${gpu} at ${node} reported Xid {{ $labels.xid }} {{ $value | humanizeDuration }} ago "
                   "(${count} since the exporter started). Xids ${application} (application faults) do not alert.",
                   gpu=GPU_NAME, node=recorded.NODE, count=xid_count,
                   application=", ".join(config.XID_APPLICATION)), this_gpu),
        alert(config, "GPUECCUncorrectable", ecc, None, WARNING,
              fill("${gpu} at ${node}: {{ $labels.reason }}.", gpu=GPU_NAME, node=recorded.NODE),
              fill('Memory of ${gpu} at ${node}: {{ $labels.reason }} (now {{ $value | printf "%.4g" }}). '
                   "Work on it may have been killed or computed on bad memory; drain it and reset it.",
                   gpu=GPU_NAME, node=recorded.NODE), this_gpu),
    ]


def tickets(config: Config) -> list[Rule]:
    """The GPU-time ledger's ticket, in a group of its own evaluated every GPU_ALLOCATED_IDLE_EVAL_INTERVAL:
    its rates span GPU_ALLOCATED_IDLE_WINDOW (hours of samples for every GPU of the fleet), and an answer a
    few minutes late costs nothing."""
    recorded = names(config)
    return [
        # The GPU-time ledger has no `gpu` index label (a MIG device has none): named by UUID, the board by node.
        alert(config, "GPUAllocatedIdle", allocated_idle_expr(config), config.GPU_ALLOCATED_IDLE_FOR, WARNING,
              fill("{{ $labels.uuid }} at ${node} is held but idle.", node=recorded.NODE),
              fill("{{ $labels.uuid }} at ${node} sat allocated with no engine work for {{ $value | humanizePercentage "
                   "}} of the last ${window}: a pod holds it (the kubelet's pod resources) or NVML lists a compute "
                   "process on it, no engine had requests in flight or a load on it, and the device itself was "
                   "mostly idle (busy under ${busy_low}, a MIG device's SM activity under ${sm_low}). Held by: "
                   "${pods}. Nothing else can be scheduled on it while it is held: a cost, not an outage.",
                   node=recorded.NODE, window=config.GPU_ALLOCATED_IDLE_WINDOW, pods=pods_holding_idle(config),
                   busy_low=f"{config.GPU_BUSY_LOW:.0%}", sm_low=f"{config.GPU_SM_ACTIVE_LOW:.0%}"),
              board(GPU_UID)),
    ]


ALLOCATED_IDLE = 'state="allocated_idle"'


def allocated_idle_expr(config: Config) -> str:
    """GPUAllocatedIdle: a device (GPU or MIG device, by ``uuid``) in the GPU-time ledger's allocated_idle state
    (held by a pod or a process, no engine work) for at least GPU_ALLOCATED_IDLE_RATIO of the window, its value
    that share.  rate() counts across an exporter restart (the ledger's counters start again from 0).

    allocated_idle says only that no engine gpuio follows had work there: a training job, or a server without
    gpuio's library, keeps a GPU busy in that state.  So the device itself must have been mostly idle over the
    window too (the starvation rules' idle: NVML busy under GPU_BUSY_LOW; a MIG device, which has no busy of its
    own, its GPU instance's SM activity under GPU_SM_ACTIVE_LOW); a device with no such reading is judged by the
    ledger alone."""
    window, node = config.GPU_ALLOCATED_IDLE_WINDOW, config.NODE_LABEL
    sel = config.selector()
    held = f"rate(gpuio_gpu_time_seconds_total{config.selector(ALLOCATED_IDLE)}[{window}])"
    return "\n".join([
        f"{held} >= {config.GPU_ALLOCATED_IDLE_RATIO:g}",
        "# unless the device itself worked: a process gpuio follows no engine of (a training job) keeps it busy",
        f"unless on ({node}, uuid) (",
        f"  rate(gpuio_gpu_busy_seconds_total{sel}[{window}]) >= {config.GPU_BUSY_LOW:g}",
        "  or",
        "  label_replace(",
        f"    gpuio_gpu_mig_device_info{sel}",
        f"    * on ({node}, uuid, gpu_instance) group_left ()",
        f"    rate(gpuio_gpu_mig_sm_active_seconds_total{sel}[{window}]),",
        '    "uuid", "$1", "mig_uuid", "(.+)"',
        f"  ) >= {config.GPU_SM_ACTIVE_LOW:g}",
        ")",
    ])


def pods_holding_idle(config: Config) -> str:
    """An alert template naming the pods that held the alert's device (labels: node, uuid) with no engine work
    over GPU_ALLOCATED_IDLE_WINDOW, each with its share of the window; else says that no pod is known."""
    query = fill("sum by (namespace, pod) (rate(gpuio_pod_gpu_time_seconds_total{${node}='%s',uuid='%s',"
                 "state='allocated_idle'}[${window}])) > 0",
                 node=config.NODE_LABEL, window=config.GPU_ALLOCATED_IDLE_WINDOW)
    return fill('{{ with printf "${query}" $labels.${node} $labels.uuid | query | sortByLabel "pod" }}'
                "{{ range $index, $pod := . }}{{ if $index }}, {{ end }}{{ $pod.Labels.namespace }}/"
                "{{ $pod.Labels.pod }} ({{ $pod.Value | humanizePercentage }}){{ end }}"
                "{{ else }}no pod known (a process outside Kubernetes, or no pods collector: nvidia-smi lists "
                "the processes){{ end }}", query=query, node=config.NODE_LABEL)


def nvml_success_now(config: Config) -> str:
    """An alert template: whether the nvml collector of the alert's node succeeded at its last scrape."""
    query = fill("gpuio_scrape_collector_success{collector='nvml',${node}='%s'}", node=config.NODE_LABEL)
    return query_figure(query, f"$labels.{config.NODE_LABEL}", COUNT, "none")


def data_stale_alert(config: Config) -> Rule:
    """GpuioGPUDataStale (in the starvation group: it and the starvation alerts judge the same node)."""
    recorded = names(config)
    return alert(
        config, "GpuioGPUDataStale", recorded.GPU_STALE, config.GPU_STALE_FOR, WARNING,
        f"GPU data of gpuio at {recorded.NODE} is stale or failing.",
        fill("The NVML snapshot gpuio-exporter serves at ${node} is ${age} old (stale after ${stale_after}s), or "
             "its nvml collector failed (success now: ${success}): NVML calls are slow, hanging or failing, and a "
             "frozen busy counter reads as an idle GPU. No starvation alert judges this node's GPUs until the "
             "data is fresh again.",
             node=recorded.NODE, age=node_figure(config, "gpuio_gpu_snapshot_age_seconds", "humanizeDuration", "?"),
             stale_after=config.GPU_STALE_AFTER_SECONDS, success=nvml_success_now(config)),
        board(GPU_UID))
