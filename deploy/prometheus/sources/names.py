"""The names every rule source shares, for one config: recording rules (they carry the config's
windows, ``:rate1m``), the joins on a node or device, and label templates.

Recording rules are named ``level:metric:operations`` (https://prometheus.io/docs/practices/rules/):
``instance_device:gpuio_disk_reads_completed:rate1m`` is the per-second rate over RATE_WINDOW of
gpuio_disk_reads_completed_total, one series per node and device.  The dashboards use these names too
(``deploy.prometheus.rules.READS`` is the name under the default config).
"""

from __future__ import annotations

import dataclasses
import functools

from ..config import Config


@functools.cache
def names(config: Config) -> Names:
    return Names(config)


@dataclasses.dataclass(frozen=True)
class Names:
    config: Config

    # --- joins ---------------------------------------------------------------------------------------------
    @property
    def ON_DEVICE(self) -> str:
        return f"on ({self.config.NODE_LABEL}, device)"

    @property
    def ON_NODE(self) -> str:
        return f"on ({self.config.NODE_LABEL})"

    # Comparing with a per-device limit: group_left keeps every label of the left side (with a plain
    # `on`, a one-to-one comparison would keep only the `on` labels and drop job and target labels).
    @property
    def TO_LIMIT(self) -> str:
        return f"{self.ON_DEVICE} group_left ()"

    # --- recording-rule names, used by the alerts and by the dashboards ---------------------------------
    @property
    def READS(self) -> str:
        return f"instance_device:gpuio_disk_reads_completed:rate{self.config.RATE_WINDOW}"

    @property
    def WRITES(self) -> str:
        return f"instance_device:gpuio_disk_writes_completed:rate{self.config.RATE_WINDOW}"

    @property
    def READ_BYTES(self) -> str:
        return f"instance_device:gpuio_disk_read_bytes:rate{self.config.RATE_WINDOW}"

    @property
    def WRITTEN_BYTES(self) -> str:
        return f"instance_device:gpuio_disk_written_bytes:rate{self.config.RATE_WINDOW}"

    @property
    def READ_AWAIT(self) -> str:
        return f"instance_device:gpuio_disk_read_await_seconds:rate{self.config.RATE_WINDOW}"

    @property
    def WRITE_AWAIT(self) -> str:
        return f"instance_device:gpuio_disk_write_await_seconds:rate{self.config.RATE_WINDOW}"

    # aqu-sz
    @property
    def QUEUE(self) -> str:
        return f"instance_device:gpuio_disk_io_time_weighted_seconds:rate{self.config.RATE_WINDOW}"

    # %util / 100
    @property
    def UTIL(self) -> str:
        return f"instance_device:gpuio_disk_io_time_seconds:rate{self.config.RATE_WINDOW}"

    @property
    def AWAIT(self) -> str:
        return f"instance_device:gpuio_disk_await_seconds:max_rate{self.config.RATE_WINDOW}"

    @property
    def DISK_CLASS(self) -> str:
        return "instance_device:gpuio_disk_class:info"

    @property
    def AWAIT_LIMIT(self) -> str:
        return "instance_device:gpuio_disk_await_limit_seconds:class"

    @property
    def QUEUE_LIMIT(self) -> str:
        return "instance_device:gpuio_disk_queue_limit:class"

    @property
    def SATURATED(self) -> str:
        return f"instance_device:gpuio_disk_saturated_await_seconds:max_rate{self.config.RATE_WINDOW}"

    # The calm evaluations (device not saturated), their medians over BASELINE_WINDOW (while there is
    # enough calm evidence), and the baselines the storm alert compares with (the last median, held).
    @property
    def CALM_AWAIT(self) -> str:
        return f"instance_device:gpuio_disk_calm_await_seconds:max_rate{self.config.RATE_WINDOW}"

    @property
    def CALM_QUEUE(self) -> str:
        return f"instance_device:gpuio_disk_calm_io_time_weighted_seconds:rate{self.config.RATE_WINDOW}"

    @property
    def AWAIT_LEARNED(self) -> str:
        return f"instance_device:gpuio_disk_calm_await_seconds:median{self.config.BASELINE_WINDOW}"

    @property
    def QUEUE_LEARNED(self) -> str:
        return f"instance_device:gpuio_disk_calm_io_time_weighted_seconds:median{self.config.BASELINE_WINDOW}"

    @property
    def AWAIT_BASELINE(self) -> str:
        return ("instance_device:gpuio_disk_calm_await_seconds:"
                f"median{self.config.BASELINE_WINDOW}_held{self.config.BASELINE_HOLD}")

    @property
    def QUEUE_BASELINE(self) -> str:
        return ("instance_device:gpuio_disk_calm_io_time_weighted_seconds:"
                f"median{self.config.BASELINE_WINDOW}_held{self.config.BASELINE_HOLD}")

    @property
    def STORM(self) -> str:
        return f"instance_device:gpuio_disk_storm_await_seconds:max_rate{self.config.RATE_WINDOW}"

    # The storm while it hurts serving: DiskIOStorm's paging condition.
    @property
    def STORM_PAGE(self) -> str:
        return f"instance_device:gpuio_disk_storm_page_await_seconds:max_rate{self.config.RATE_WINDOW}"

    @property
    def GPU_BUSY(self) -> str:
        return f"instance_gpu:gpuio_gpu_busy_seconds:rate{self.config.RATE_WINDOW}"

    # Share of a whole GPU's SMs at work: GPM's, else dcgm-exporter's where a GPU has no GPM; no series where
    # neither measures it.
    @property
    def GPU_SM_ACTIVE(self) -> str:
        return f"instance_gpu:gpuio_gpu_sm_active:rate{self.config.RATE_WINDOW}"

    # GPUs judged mostly idle, valued with the ratio that judged them: NVML busy, else SM activity (GPM).
    @property
    def GPU_IDLE(self) -> str:
        return f"instance_gpu:gpuio_gpu_idle_activity:rate{self.config.RATE_WINDOW}"

    # What each device an engine can run on does: a whole GPU (SM activity where GPM measures it, else NVML
    # busy) or a MIG device (its GPU instance's SM activity, ``uuid`` the MIG UUID engines report).
    @property
    def GPU_ACTIVITY(self) -> str:
        return f"instance_gpu:gpuio_gpu_activity:rate{self.config.RATE_WINDOW}"

    # Its activity in the node's calm evaluations (no disk saturated or far above its own await, no slow mount,
    # IO pressure "full" low, GPU data fresh), the median, held.
    @property
    def GPU_CALM_ACTIVITY(self) -> str:
        return f"instance_gpu:gpuio_gpu_calm_activity:rate{self.config.RATE_WINDOW}"

    @property
    def GPU_ACTIVITY_LEARNED(self) -> str:
        return f"instance_gpu:gpuio_gpu_calm_activity:median{self.config.BASELINE_WINDOW}"

    @property
    def GPU_ACTIVITY_BASELINE(self) -> str:
        return ("instance_gpu:gpuio_gpu_calm_activity:"
                f"median{self.config.BASELINE_WINDOW}_held{self.config.BASELINE_HOLD}")

    # Devices that lost their work: mostly idle, or far below their calm normal.  Value: the activity.
    @property
    def GPU_ACTIVITY_LOST(self) -> str:
        return f"instance_gpu:gpuio_gpu_activity_lost:rate{self.config.RATE_WINDOW}"

    # Nodes whose exporter has been up without a break for GAP_SETTLE: their rate windows hold no gap.
    @property
    def SCRAPES_UNBROKEN(self) -> str:
        return f"instance:gpuio_exporter_up:unbroken{self.config.GAP_SETTLE}"

    @property
    def GPU_STALE(self) -> str:
        return f"instance:gpuio_gpu_data_stale:max{self.config.RATE_WINDOW}"

    @property
    def NVML_SUCCESS(self) -> str:
        return 'gpuio_scrape_collector_success{collector="nvml",' + self.config.SELECTOR + "}"

    # Each engine file's device (GPU or MIG device) and its activity; the engine's file and GPU are held for
    # ENGINE_HOLD after its last process, so a crash loop's restarts do not break the join.
    @property
    def ENGINE_GPU_ACTIVITY(self) -> str:
        return f"instance_engine_gpu:gpuio_gpu_activity:rate{self.config.RATE_WINDOW}"

    @property
    def ENGINE_DISK_SATURATED(self) -> str:
        return f"instance_engine:gpuio_disk_saturated_await_seconds:max_rate{self.config.RATE_WINDOW}"

    @property
    def ENGINE_MOUNT_SLOW(self) -> str:
        return f"instance_engine:gpuio_mount_slow:max_rate{self.config.RATE_WINDOW}"

    @property
    def ENGINE_IN_FLIGHT(self) -> str:
        return f"instance_engine_gpu:gpuio_engine_inferences_in_flight:avg_over_time{self.config.RATE_WINDOW}"

    @property
    def ENGINE_POOL_WAIT(self) -> str:
        return f"instance_engine_gpu:gpuio_engine_pool_wait_seconds:mean_rate{self.config.RATE_WINDOW}"

    # The bucket rates the latency quantiles read: one rate() of every bucket series per evaluation,
    # not one per quantile (at fleet scale those three rate()s were the slowest rules).
    @property
    def ENGINE_LATENCY_BUCKETS(self) -> str:
        return f"instance_engine_gpu_le:gpuio_engine_inference_seconds_bucket:rate{self.config.RATE_WINDOW}"

    @property
    def ENGINE_LATENCY(self) -> str:
        return ("instance_engine_gpu_quantile:gpuio_engine_inference_seconds:"
                f"histogram_quantile_rate{self.config.RATE_WINDOW}")

    # The p99 of the evaluations in which the engine's storage was not saturated, its median, held.
    @property
    def ENGINE_LATENCY_CALM(self) -> str:
        return ("instance_engine_gpu:gpuio_engine_inference_calm_p99_seconds:"
                f"histogram_quantile_rate{self.config.RATE_WINDOW}")

    @property
    def ENGINE_LATENCY_LEARNED(self) -> str:
        return f"instance_engine_gpu:gpuio_engine_inference_calm_p99_seconds:median{self.config.BASELINE_WINDOW}"

    @property
    def ENGINE_LATENCY_BASELINE(self) -> str:
        return ("instance_engine_gpu:gpuio_engine_inference_calm_p99_seconds:"
                f"median{self.config.BASELINE_WINDOW}_held{self.config.BASELINE_HOLD}")

    @property
    def ENGINE_LOADS_ABANDONED(self) -> str:
        return f"instance_engine_gpu:gpuio_engine_loads_abandoned:increase{self.config.LOAD_CRASH_LOOP_WINDOW}"

    # Engines loading (or crash-looping) on a device that is not busy serving: what a storm page counts.
    @property
    def LOADS_WAITED_FOR(self) -> str:
        return f"instance_engine_gpu:gpuio_engine_loads_waited_for:rate{self.config.RATE_WINDOW}"

    @property
    def WORK_WAITING(self) -> str:
        return f"instance_engine_gpu:gpuio_engine_work_waiting:rate{self.config.RATE_WINDOW}"

    @property
    def STARVED(self) -> str:
        return f"instance_engine_gpu:gpuio_engine_starved_gpu_busy:rate{self.config.RATE_WINDOW}"

    # The 1-minute rates of the load histograms, recorded only in the minutes in which a load finished:
    # the 15-minute means below are sums over time of these.
    @property
    def ENGINE_LOADS_FINISHED(self) -> str:
        return f"instance_engine:gpuio_engine_load_read_seconds_count:rate{self.config.RATE_WINDOW}"

    @property
    def ENGINE_LOAD_SECONDS_RATE(self) -> str:
        return f"instance_engine:gpuio_engine_load_seconds_sum:rate{self.config.RATE_WINDOW}"

    @property
    def ENGINE_LOAD_READ_SECONDS_RATE(self) -> str:
        return f"instance_engine:gpuio_engine_load_read_seconds_sum:rate{self.config.RATE_WINDOW}"

    @property
    def ENGINE_LOAD_READ_BYTES_RATE(self) -> str:
        return f"instance_engine:gpuio_engine_load_read_bytes:rate{self.config.RATE_WINDOW}"

    # Cold loads finished per second, per node and engine (only where there were some): the Fleet board.
    @property
    def ENGINE_COLD_LOADS(self) -> str:
        return f"instance_engine:gpuio_engine_cold_loads:rate{self.config.RATE_WINDOW}"

    # EngineColdStartSlow's condition.
    @property
    def ENGINE_LOAD_SLOW(self) -> str:
        return f"instance_engine:gpuio_engine_load_slow_seconds:max{self.config.LOAD_CRASH_LOOP_WINDOW}"

    @property
    def ENGINE_LOAD(self) -> str:
        return f"instance_engine:gpuio_engine_load_seconds:mean{self.config.ENGINE_LOAD_WINDOW}"

    @property
    def ENGINE_LOAD_READ(self) -> str:
        return f"instance_engine:gpuio_engine_load_read_seconds:mean{self.config.ENGINE_LOAD_WINDOW}"

    @property
    def ENGINE_LOAD_THROUGHPUT(self) -> str:
        return f"instance_engine:gpuio_engine_load_read_bytes_per_second:rate{self.config.ENGINE_LOAD_WINDOW}"

    @property
    def NFS_READ_RTT(self) -> str:
        return f"instance_mountpoint:gpuio_mountstats_nfs_read_rtt_seconds:mean_rate{self.config.RATE_WINDOW}"

    @property
    def NFS_READ_BYTES(self) -> str:
        return f"instance_mountpoint:gpuio_mountstats_nfs_read_bytes:rate{self.config.RATE_WINDOW}"

    @property
    def MOUNT_SLOW(self) -> str:
        return f"instance_mountpoint:gpuio_mount_slow:max_rate{self.config.RATE_WINDOW}"

    @property
    def MOUNT_STORM_PAGE(self) -> str:
        return f"instance_mountpoint:gpuio_mount_slow_page:max_rate{self.config.RATE_WINDOW}"

    @property
    def IO_SOME(self) -> str:
        return f"instance:gpuio_pressure_io_waiting_seconds:rate{self.config.RATE_WINDOW}"

    @property
    def IO_FULL(self) -> str:
        return f"instance:gpuio_pressure_io_stalled_seconds:rate{self.config.RATE_WINDOW}"

    # --- alert templates and selectors every source uses -------------------------------------------------
    # The alert's node, as a template.
    @property
    def NODE(self) -> str:
        return "{{ $labels." + self.config.NODE_LABEL + " }}"

    @property
    def WITH_GPU(self) -> str:
        return self.config.selector('gpu_uuid!=""')

    @property
    def GPU_LABELS(self) -> tuple[str, str]:
        return (self.config.NODE_LABEL, "gpu")
