"""The smart collector running smartctl (a script that replays recorded output)."""

from __future__ import annotations

import json
import os
import re

import pytest

from exporter.collectors.smart import (
    DESCS,
    device_labels,
)
from exporter.exposition import render
from tests.conftest import catalogued, undeclared
from tests.fixtures.smartctl.fake import DERIVED, LISTINGS, SINGLE, FakeSmartctl
from tests.fixtures.smartctl.harness import collector, info, make_sysfs, state, sweep, value

pytestmark = pytest.mark.e2e

# (case, smartctl device, -d type, device label, expected info labels, expected values); the values
# were read from the recording by hand.
REPRESENTATIVE = {
    "SATA HDD (SAT, via /dev/sg2)": ("sat_hdd_0_issue70", "/dev/sg2", "sat", "sdb", {
        "model": "ST2000NM000A-2J2100", "serial": "WS10SM2A", "firmware": "TN03", "interface": "ata",
        "rotational": "1"}, {
        "gpuio_smart_health_passed": 1, "gpuio_smart_temperature_celsius": 31,
        "gpuio_smart_capacity_bytes": 2_000_398_934_016, "gpuio_smart_power_on_seconds_total": 1380 * 3600,
        "gpuio_smart_power_cycles_total": 39, "gpuio_smart_ata_reallocated_sectors_total": 0,
        ("gpuio_smart_ata_attribute", "1", "Raw_Read_Error_Rate", "normalized"): 82,
        ("gpuio_smart_ata_attribute", "1", "Raw_Read_Error_Rate", "threshold"): 44,
        ("gpuio_smart_ata_attribute", "3", "Spin_Up_Time", "normalized"): 96,
        ("gpuio_smart_ata_attribute", "3", "Spin_Up_Time", "threshold"): None,  # 000: never fails
        ("gpuio_smart_ata_attribute", "1", "Raw_Read_Error_Rate", "raw"): 148350832,
        ("gpuio_smart_ata_attribute", "242", "Total_LBAs_Read", "raw"): 13287203134,
    }),
    "SATA SSD": ("sat_ssd_0_issue_65", "/dev/sda", "sat", "sda", {
        "model": "HS-SSD-C100 120G", "interface": "ata", "rotational": "0"}, {
        "gpuio_smart_health_passed": 1, "gpuio_smart_capacity_bytes": 120_034_123_776,
    }),
    "NVMe": ("nvme_0", "/dev/nvme0", "nvme", "nvme0n1", {
        "model": "KBG30ZMV256G TOSHIBA", "firmware": "ADHA0101", "interface": "nvme", "rotational": "0"}, {
        "gpuio_smart_health_passed": 1, "gpuio_smart_temperature_celsius": 42,
        "gpuio_smart_capacity_bytes": 256_060_514_304, "gpuio_smart_nvme_endurance_used_ratio": 0.28,
        "gpuio_smart_nvme_available_spare_ratio": 1.0, "gpuio_smart_nvme_available_spare_threshold_ratio": 0.1,
        "gpuio_smart_nvme_read_bytes_total": 29_426_647 * 512_000,
        "gpuio_smart_nvme_written_bytes_total": 24_664_736 * 512_000,
        "gpuio_smart_power_cycles_total": 997, "gpuio_smart_power_on_seconds_total": 5809 * 3600,
        "gpuio_smart_nvme_unsafe_shutdowns_total": 67, "gpuio_smart_nvme_media_errors_total": 0,
        "gpuio_smart_nvme_error_log_entries_total": 1356,
        ("gpuio_smart_nvme_critical_warning", "available_spare"): 0,
    }),
    "SAS HDD": ("sas_hdd_0_issue_51", "/dev/sdc", "scsi", "sdc", {
        "model": "HUH721212AL4204", "serial": "8DG3J2ZD", "firmware": "C3D0", "interface": "scsi",
        "rotational": "1"}, {
        "gpuio_smart_health_passed": 1, "gpuio_smart_temperature_celsius": 32,
        "gpuio_smart_capacity_bytes": 12_000_138_625_024, "gpuio_smart_scsi_grown_defects_total": 0,
        ("gpuio_smart_scsi_uncorrected_errors_total", "read"): 0,
        # from the "-l background" probe pySMART adds: "Accumulated power on time, hours:minutes 3687:00"
        "gpuio_smart_power_on_seconds_total": 3687 * 3600,
    }),
    "USB bridge (ASMedia, NVMe behind it)": ("nvme_usb_asmedia_issue_97", "/dev/sda", "sntasmedia", "sda", {
        "model": "Samsung Portable SSD T7", "serial": "S7MNNS0Y828393V", "interface": "nvme"}, {
        "gpuio_smart_health_passed": 1, "gpuio_smart_temperature_celsius": 29,
        "gpuio_smart_nvme_read_bytes_total": 111_357 * 512_000, "gpuio_smart_nvme_unsafe_shutdowns_total": 10,
        "gpuio_smart_power_on_seconds_total": 9 * 3600, "gpuio_smart_power_cycles_total": 11,
    }),
    "MegaRAID, SATA disk behind it": ("megaraid_ph_sata_hdd_1_issue_56", "/dev/bus/0", "sat+megaraid,60",
                                      "bus/0:sat+megaraid,60", {
        "model": "INTEL SSDSC2KB480G8", "serial": "PHYF110005YA480BGN", "interface": "ata"}, {
        "gpuio_smart_health_passed": 1, "gpuio_smart_temperature_celsius": 19,
        "gpuio_smart_power_on_seconds_total": 4742 * 3600, "gpuio_smart_power_cycles_total": 861,
        ("gpuio_smart_ata_attribute", "174", "Unsafe_Shutdown_Count", "raw"): 705,
    }),
    "MegaRAID, SAS disk behind it": ("megaraid_ph_sas_hdd_0", "/dev/bus/7", "megaraid,44", "bus/7:megaraid,44", {
        "model": "HUS726040AL5210", "interface": "scsi", "rotational": "1"}, {
        "gpuio_smart_health_passed": 1, "gpuio_smart_temperature_celsius": 40,
        "gpuio_smart_capacity_bytes": 4_000_787_030_016,
    }),
}
EXTRA_LABELS = {"gpuio_smart_ata_attribute": ("id", "name", "value_type"),
                "gpuio_smart_scsi_uncorrected_errors_total": ("operation",),
                "gpuio_smart_nvme_critical_warning": ("warning",)}


def expected_key(device: str, key: str | tuple[str, ...]) -> tuple[str, dict[str, str]]:
    if isinstance(key, str):
        return key, {"device": device}
    name, *extra = key
    return name, {"device": device, **dict(zip(EXTRA_LABELS[name], extra, strict=True))}


@pytest.mark.parametrize("kind", REPRESENTATIVE)
def test_representative_drives(tmp_path, kind) -> None:
    case, path, device_type, device, identity, expected = REPRESENTATIVE[kind]
    sysfs = make_sysfs(str(tmp_path / "sys"), nvme={"nvme0": ["nvme0n1"]}, sg={"sg2": "sdb"})
    fake = FakeSmartctl(str(tmp_path), [os.path.join(SINGLE, case)])
    found = sweep(collector(sysfs, fake.path, f"devices={path};{device_type}"))
    assert state(found, device) == "ok"
    assert info(found, device) | identity == info(found, device)
    assert info(found, device)["type"] == device_type and info(found, device)["smartctl_device"] == path
    for key, number in expected.items():
        name, labels = expected_key(device, key)
        if number is None:
            assert value(found, name, **labels) is None, (name, labels)
        else:
            assert value(found, name, **labels) == pytest.approx(number), (name, labels)


def test_failing_ata_disk_exports_each_counter_under_its_own_name(tmp_path) -> None:
    fake = FakeSmartctl(str(tmp_path), [os.path.join(DERIVED, "failing_sat_hdd")])
    found = sweep(collector(str(tmp_path), fake.path, "devices=/dev/sda;sat"))
    assert state(found, "sda") == "ok"  # the poll worked; the disk is what failed
    assert value(found, "gpuio_smart_health_passed", device="sda") == 0
    assert value(found, "gpuio_smart_ata_reallocated_sectors_total", device="sda") == 312
    assert value(found, "gpuio_smart_ata_reported_uncorrectable_errors_total", device="sda") == 17
    assert value(found, "gpuio_smart_ata_pending_sectors", device="sda") == 24
    assert value(found, "gpuio_smart_ata_offline_uncorrectable_sectors", device="sda") == 8
    assert value(found, "gpuio_smart_ata_udma_crc_errors_total", device="sda") == 3
    assert value(found, "gpuio_smart_ata_attribute", device="sda", id="5", name="Reallocated_Sector_Ct",
                 value_type="normalized") == 63


def test_failing_nvme_disk_sets_its_warning_bits(tmp_path) -> None:
    fake = FakeSmartctl(str(tmp_path), [os.path.join(DERIVED, "failing_nvme")])
    found = sweep(collector(str(tmp_path), fake.path, "devices=/dev/nvme0;nvme"))
    assert value(found, "gpuio_smart_health_passed", device="nvme0") == 0
    bits = {dict(labels)["warning"]: number for (name, labels), number in found.items()
            if name == "gpuio_smart_nvme_critical_warning"}
    assert bits == {"available_spare": 1, "temperature": 0, "reliability": 1, "read_only": 0,
                    "volatile_memory_backup": 0, "persistent_memory_region": 0}  # 0x05
    assert value(found, "gpuio_smart_nvme_endurance_used_ratio", device="nvme0") == pytest.approx(1.03)
    assert value(found, "gpuio_smart_nvme_available_spare_ratio", device="nvme0") == pytest.approx(0.05)
    assert value(found, "gpuio_smart_nvme_media_errors_total", device="nvme0") == 7


ANSWER = re.compile(r"_-d_(?P<type>[^_]+)_--all_(?P<path>_dev_\S+)$")


def recorded_devices() -> list[tuple[str, str, str]]:
    """(case directory, path, type) of every recorded ``smartctl -d TYPE --all /dev/...``."""
    found = []
    for base in (SINGLE, LISTINGS):
        for case in sorted(os.listdir(base)):
            for name in sorted(os.listdir(os.path.join(base, case))):
                match = ANSWER.match(name)
                if match:
                    found.append((os.path.join(base, case), match["path"].replace("_", "/"), match["type"]))
    return found


UNSUPPORTED = {"megaraid_vd_0", "unsupported_0"}  # RAID virtual disks: "SMART support is: Unavailable"


def test_every_recording_parses_or_is_reported_unsupported(tmp_path) -> None:
    devices = recorded_devices()
    assert len(devices) >= 35
    for index, (case, path, device_type) in enumerate(devices):
        fake = FakeSmartctl(str(tmp_path / str(index)), [case])
        found = sweep(collector(str(tmp_path), fake.path, f"devices={path};{device_type}"))
        device = device_labels(path, device_type, str(tmp_path))[0]
        expected = "unsupported" if os.path.basename(case) in UNSUPPORTED else "ok"
        assert state(found, device) == expected, case
        check_against_py_smart(case, found, device, expected)


def check_against_py_smart(case: str, found: dict, device: str, expected: str) -> None:
    """Identity and health agree with what py-SMART's authors recorded as the right parse (device.json)."""
    with open(os.path.join(case, "device.json")) as handle:
        recorded = json.load(handle).get("values")
    if recorded is None:  # a listing's device.json holds only a count
        return
    assert info(found, device)["model"] == (recorded.get("model") or "")
    assert info(found, device)["serial"] == (recorded.get("serial") or "")
    health = value(found, "gpuio_smart_health_passed", device=device)
    assert health == ({"PASS": 1, "WARN": 1, "FAIL": 0}.get(recorded.get("assessment")))
    if expected == "ok" and recorded.get("temperature") is not None:
        assert value(found, "gpuio_smart_temperature_celsius", device=device) == recorded["temperature"]


def host(tmp_path, behaviours=None) -> FakeSmartctl:
    """A host whose scan lists three disks: the linux_multiple_devices recording (real)."""
    return FakeSmartctl(str(tmp_path / "fake"), [os.path.join(LISTINGS, "linux_multiple_devices")], behaviours)


def polled(fake: FakeSmartctl) -> list[str]:
    """The devices smartctl was asked about (pySMART reads some twice: its probes end in another --all)."""
    return sorted({call[-1] for call in fake.calls() if "--all" in call})


def test_include_and_exclude_match_the_label_or_the_smartctl_name(tmp_path) -> None:
    sysfs = make_sysfs(str(tmp_path / "sys"), nvme={"nvme0": ["nvme0n1"], "nvme1": ["nvme1n1"]})
    fake = host(tmp_path)
    found = sweep(collector(sysfs, fake.path, "device-exclude=^nvme1n1$|megaraid"))
    assert polled(fake) == ["/dev/nvme0"]
    assert {dict(labels)["device"] for name, labels in found if name == "gpuio_smart_device_state"} == {"nvme0n1"}
    fake = host(tmp_path / "again")
    sweep(collector(sysfs, fake.path, "device-include=^bus/0$"))
    assert polled(fake) == ["/dev/bus/0"]


def test_devices_beyond_the_cap_are_counted_not_polled(tmp_path) -> None:
    fake = host(tmp_path)
    found = sweep(collector(str(tmp_path), fake.path, "max-devices=2"))
    assert polled(fake) == ["/dev/nvme0", "/dev/nvme1"]
    assert value(found, "gpuio_smart_devices_dropped") == 1


def test_a_device_type_pysmart_cannot_drive_is_unsupported_not_polled(tmp_path) -> None:
    scan = ["/dev/sdb -d usbjmicron,0 # /dev/sdb [USB JMicron], ATA device"]
    fake = FakeSmartctl(str(tmp_path), [], scan=scan)
    found = sweep(collector(str(tmp_path), fake.path))
    assert state(found, "sdb") == "unsupported"
    assert [call[2:] for call in fake.calls()] == [["--scan-open"]]


def test_a_device_without_a_type_is_typed_by_smartctl(tmp_path) -> None:
    fake = FakeSmartctl(str(tmp_path), [os.path.join(SINGLE, "nvme_0")])
    found = sweep(collector(str(tmp_path), fake.path, "devices=/dev/nvme0"))
    assert [call for call in fake.calls() if "test" in call] == [["-n", "standby", "-d", "test", "/dev/nvme0"]]
    assert state(found, "nvme0") == "ok" and info(found, "nvme0")["model"] == "KBG30ZMV256G TOSHIBA"


def test_every_family_is_served_as_declared(tmp_path) -> None:
    """A failing NVMe disk, a failing ATA disk and a SCSI disk polled together: every family the collector
    serves is in the catalogue (docs/metrics.md) with its declared type, labels and label values."""
    cases = [os.path.join(DERIVED, "failing_nvme"), os.path.join(DERIVED, "failing_sat_hdd"),
             os.path.join(SINGLE, "sas_hdd_0_issue_51")]
    smart = collector(str(tmp_path), FakeSmartctl(str(tmp_path), cases).path,
                      "devices=/dev/nvme0;nvme /dev/sda;sat /dev/sdc;scsi")
    smart.sampler.sample_now()
    text = render(smart.collect())
    for family in ("nvme_critical_warning", "ata_attribute", "scsi_uncorrected_errors_total"):
        assert f"gpuio_smart_{family}{{" in text
    assert undeclared(text) == []
    assert {desc.name for desc in DESCS} <= catalogued()
