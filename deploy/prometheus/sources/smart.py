"""Disk health (smart collector): DiskHealthDegrading and GpuioSmartDataStale."""

from __future__ import annotations

from ..config import DISK_HEALTH_UID, WARNING, Config
from .base import Rule, alert, board, fill, reason
from .names import names
from .templates import figure, label_of


def alerts(config: Config) -> list[Rule]:
    recorded = names(config)
    device = (config.NODE_LABEL, "device")
    growth_window = config.SMART_GROWTH_WINDOW
    sel = config.selector()

    def grew(metric: str) -> str:
        # Above its lowest value of the window: the value is the count itself (not an extrapolated
        # increase), and a replaced disk that starts again from 0 is not "growth".
        return f"{metric}{sel} > min_over_time({metric}{sel}[{growth_window}])"

    spare = "gpuio_smart_nvme_available_spare"
    factor = f"{config.NVME_SPARE_WARN_FACTOR:g}"
    conditions = [
        reason(f"gpuio_smart_health_passed{sel} == 0", "SMART overall health: FAILED"),
        reason(grew("gpuio_smart_ata_reallocated_sectors_total"), f"reallocated sectors grew in {growth_window}"),
        reason(grew("gpuio_smart_ata_pending_sectors"), f"pending sectors grew in {growth_window}"),
        reason(grew("gpuio_smart_ata_reported_uncorrectable_errors_total"),
               f"reported uncorrectable errors grew in {growth_window}"),
        reason(grew("gpuio_smart_ata_offline_uncorrectable_sectors"),
               f"offline uncorrectable sectors grew in {growth_window}"),
        reason(f"{spare}_ratio{sel} < {factor} * {spare}_threshold_ratio{sel}",
               f"NVMe available spare below {factor}x its threshold"),
        reason(f"gpuio_smart_nvme_critical_warning{sel} == 1", "NVMe critical warning: $1", "warning", "(.+)"),
        reason(grew("gpuio_smart_nvme_media_errors_total"), f"NVMe media errors grew in {growth_window}"),
        reason(grew("gpuio_smart_scsi_grown_defects_total"), f"SCSI grown defects grew in {growth_window}"),
        reason(grew("gpuio_smart_scsi_uncorrected_errors_total"), f"SCSI uncorrected $1 errors grew in {growth_window}",
               "operation", "(.+)"),
    ]
    model = label_of("gpuio_smart_device_info", "model", device, "?")
    serial = label_of("gpuio_smart_device_info", "serial", device, "?")
    asleep = config.selector('state="asleep"')
    failing = config.selector('state=~"timeout|error|permission_denied"')
    stale = "\n".join([
        "(",
        f"  time() - gpuio_smart_last_success_timestamp_seconds{sel} > {config.SMART_STALE_AFTER_SECONDS}",
        f"  unless {recorded.ON_DEVICE}",
        f"  gpuio_smart_device_state{asleep} == 1",
        ")",
        "or",
        f"max without (state) (gpuio_smart_device_state{failing} == 1)",
    ])
    this_disk = board(DISK_HEALTH_UID, device="{{ $labels.device }}")
    return [
        alert(
            config, "DiskHealthDegrading", "\nor\n".join(conditions), config.SMART_HEALTH_FOR, WARNING,
            fill("Disk {{ $labels.device }} at ${node} is degrading: {{ $labels.reason }}.", node=recorded.NODE),
            fill("SMART of {{ $labels.device }} (model ${model}, serial ${serial}) at ${node}: {{ $labels.reason }} "
                 '(now {{ $value | printf "%.4g" }}). A disk that remaps sectors or logs media errors retries its '
                 "reads first: await rises and IO storms follow long before it fails. Plan its replacement and "
                 "move engines and data off it.", model=model, serial=serial, node=recorded.NODE),
            this_disk),
        alert(
            config, "GpuioSmartDataStale", stale, config.SMART_STALE_FOR, WARNING,
            fill("SMART data of {{ $labels.device }} at ${node} is stale.", node=recorded.NODE),
            fill("gpuio has not read the SMART values of {{ $labels.device }} at ${node} for ${age}; last poll: "
                 "${state}. DiskHealthDegrading cannot fire for this disk until it is read again.", node=recorded.NODE,
                 age=figure("time() - gpuio_smart_last_success_timestamp_seconds", device, "humanizeDuration",
                            "as long as it has run"),
                 state=label_of("gpuio_smart_device_state", "state", device, "unknown", " == 1")),
            this_disk),
    ]
