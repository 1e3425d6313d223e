"""gpuio / Disk health: SMART of the disks of one node (the smart collector).

What DiskHealthDegrading judges, as it moves: ATA reallocated, pending and uncorrectable sectors,
NVMe spare against its threshold, endurance used, media errors and critical warnings, SCSI grown
defects and uncorrected errors; then temperature, age and traffic, and whether the values are fresh
(the last poll of each disk, a sleeping disk that was left asleep, permission problems).

SMART counts are shown as values, not rates: a disk with 100 reallocated sectors from its first year
is not news, a step up today is.  Values change once per poll (every 5 minutes by default).
"""

from __future__ import annotations

from grafana_foundation_sdk.builders import dashboard as db

from ...prometheus.config import DISK_HEALTH_UID, Config
from .common import (
    BAD,
    INFO,
    OK,
    PASSED,
    WARN,
    assemble,
    graph,
    limit,
    multi_variable,
    query,
    rate,
    sel,
    state_set,
    threshold_lines,
    timeline,
    value_table,
)

DEVICE = 'device=~"$device"'
PER_DEVICE = "{{device}}"


def poll_outcome(config: Config) -> tuple[str, list]:
    """The outcome of each disk's last SMART poll as one coded series per device, and its value mapping."""
    return state_set(config, "gpuio_smart_device_state", sel(config, DEVICE), "device",
                     [("ok", OK), ("asleep", INFO), ("unsupported", INFO), ("permission_denied", WARN),
                      ("timeout", BAD), ("error", BAD)])


def overview_panels(config: Config) -> list:
    d = sel(config, DEVICE)
    outcome, outcome_mappings = poll_outcome(config)
    return [
        value_table("Disks", "Identity of each disk as smartctl reports it (gpuio_smart_device_info); device joins "
                    "the Disk IO board. rotational 0 is solid state.", f"gpuio_smart_device_info{d}", ["job"],
                    height=6),
        timeline("SMART overall health", "passed: the disk's self-assessment passed and no attribute is failing "
                 "now. FAILED: the drive itself predicts failure (DiskHealthDegrading fires). It is the drive's "
                 "own verdict, not a prediction by gpuio: a passed disk may still be growing bad sectors (see "
                 "below). A hole: no SMART values (asleep, unsupported or the poll failing: see the next panel).",
                 query(f"gpuio_smart_health_passed{d}", PER_DEVICE), mappings=PASSED),
        timeline("Last poll outcome", "Each disk's last poll: ok; asleep (left asleep by the power-mode check, "
                 "keeping its last values); unsupported (no SMART on this device: not a fault); "
                 "permission_denied, timeout, error (the values shown are old; GpuioSmartDataStale fires after "
                 f"{config.SMART_STALE_FOR}).", query(outcome, PER_DEVICE), mappings=outcome_mappings),
    ]


def ata_panels(config: Config) -> list:
    d = sel(config, DEVICE)
    return [
        graph("Sectors: reallocated, pending, offline uncorrectable",
              f"ATA attributes 5, 197 and 198. Growth within {config.SMART_GROWTH_WINDOW} fires DiskHealthDegrading: "
              f"a disk that remaps sectors retries its reads first, and await climbs long before it fails.", "short",
              query(f"gpuio_smart_ata_reallocated_sectors_total{d}", f"{PER_DEVICE} reallocated"),
              query(f"gpuio_smart_ata_pending_sectors{d}", f"{PER_DEVICE} pending"),
              query(f"gpuio_smart_ata_offline_uncorrectable_sectors{d}", f"{PER_DEVICE} offline uncorrectable")),
        graph("Errors: reported uncorrectable, UDMA CRC", "ATA attributes 187 (errors ECC could not correct) and "
              "199 (CRC errors on the link: a cable or backplane, not the media).", "short",
              query(f"gpuio_smart_ata_reported_uncorrectable_errors_total{d}", f"{PER_DEVICE} uncorrectable"),
              query(f"gpuio_smart_ata_udma_crc_errors_total{d}", f"{PER_DEVICE} UDMA CRC")),
        value_table("ATA attributes (raw)", "Every ATA SMART attribute's raw value, for what the panels above "
                    "leave out.", "gpuio_smart_ata_attribute" + sel(config, DEVICE, 'value_type="raw"'),
                    ["job", "value_type"]),
    ]


def nvme_panels(config: Config) -> list:
    d = sel(config, DEVICE)
    return [
        graph("NVMe available spare vs. threshold",
              f"Spare capacity left, and the threshold under which the drive sets its critical warning. "
              f"DiskHealthDegrading warns below {config.NVME_SPARE_WARN_FACTOR:g}x the threshold.", "percentunit",
              query(f"gpuio_smart_nvme_available_spare_ratio{d}", f"{PER_DEVICE} spare"),
              query(f"gpuio_smart_nvme_available_spare_threshold_ratio{d}", f"{PER_DEVICE} threshold"),
              max_value=1),
        graph("NVMe endurance used", "Share of the rated write endurance consumed (Percentage Used; may exceed "
              "100 %).", "percentunit", query(f"gpuio_smart_nvme_endurance_used_ratio{d}", PER_DEVICE)),
        graph("NVMe media errors, error-log entries, unsafe shutdowns", "Unrecovered data integrity errors "
              "(growth fires DiskHealthDegrading), error information log entries and unsafe shutdowns over "
              "the controller's life.", "short",
              query(f"gpuio_smart_nvme_media_errors_total{d}", f"{PER_DEVICE} media errors"),
              query(f"gpuio_smart_nvme_error_log_entries_total{d}", f"{PER_DEVICE} error-log entries"),
              query(f"gpuio_smart_nvme_unsafe_shutdowns_total{d}", f"{PER_DEVICE} unsafe shutdowns")),
        graph("NVMe critical warnings", "Critical warning bits set now (1), by warning: any of them fires "
              "DiskHealthDegrading.", "short",
              query(f"gpuio_smart_nvme_critical_warning{d} == 1", f"{PER_DEVICE} {{{{warning}}}}")),
    ]


def scsi_panels(config: Config) -> list:
    d = sel(config, DEVICE)
    return [
        graph("SCSI grown defects and uncorrected errors", "Blocks reassigned since manufacture (grown defect "
              "list) and errors the disk could not correct, by operation.", "short",
              query(f"gpuio_smart_scsi_grown_defects_total{d}", f"{PER_DEVICE} grown defects"),
              query(f"gpuio_smart_scsi_uncorrected_errors_total{d}", f"{PER_DEVICE} uncorrected {{{{operation}}}}"),
              width=24),
    ]


def wear_panels(config: Config) -> list:
    d = sel(config, DEVICE)
    return [
        graph("Temperature", "Disk temperature at the last poll.", "celsius",
              query(f"gpuio_smart_temperature_celsius{d}", PER_DEVICE)),
        graph("Power-on time", "Age of the disk: time it has been powered on.", "s",
              query(f"gpuio_smart_power_on_seconds_total{d}", PER_DEVICE), width=6),
        graph("Power cycles", "Power on/off cycles of the disk.", "short",
              query(f"gpuio_smart_power_cycles_total{d}", PER_DEVICE), width=6),
        graph("NVMe host traffic (SMART)", "Bytes read and written by the host as the NVMe drive counts them "
              "(it counts 512,000-byte units: a coarse check of the Disk IO board).", "binBps",
              query(rate("gpuio_smart_nvme_read_bytes_total", d), f"{PER_DEVICE} read"),
              query(rate("gpuio_smart_nvme_written_bytes_total", d), f"{PER_DEVICE} written")),
    ]


def freshness_panels(config: Config) -> list:
    d = sel(config, DEVICE)
    return [
        threshold_lines(
            graph("Age of the SMART values", f"Seconds since each disk's values were last read. Over "
                  f"{config.SMART_STALE_AFTER_SECONDS} s (the red line; and the disk not asleep) GpuioSmartDataStale "
                  f"fires: the health alerts are blind for that disk. A sleeping disk's age grows by design.", "s",
                  query(f"time() - gpuio_smart_last_success_timestamp_seconds{d}", PER_DEVICE)),
            limit(config.SMART_STALE_AFTER_SECONDS)),
        graph("Poll duration", "How long the last poll of each disk took, all its smartctl runs together "
              "(each run has its own timeout).", "s",
              query(f"gpuio_smart_poll_duration_seconds{d}", PER_DEVICE)),
        graph("Permission denied, disks not polled", "1: smartctl could not open a disk for lack of privileges "
              "(CAP_SYS_RAWIO and CAP_SYS_ADMIN, see docs/smart.md); disks left out by "
              "--collector.smart.max-devices.", "short",
              query(f"gpuio_smart_permission_denied{sel(config)}", "permission denied"),
              query(f"gpuio_smart_devices_dropped{sel(config)}", "disks not polled")),
    ]


def build(config: Config) -> db.Dashboard:
    return assemble(config, DISK_HEALTH_UID, "SMART health of the disks of a node: sectors, spare, media errors, wear, "
                    "temperature, and how fresh the values are.",
                    (("Overview", overview_panels(config)), ("ATA", ata_panels(config)), ("NVMe", nvme_panels(config)),
                     ("SCSI", scsi_panels(config)), ("Temperature, age, traffic", wear_panels(config)),
                     ("Freshness", freshness_panels(config))),
                    variables=[multi_variable(config, "device", "Disk", "gpuio_smart_device_info", all_value=".+")])
