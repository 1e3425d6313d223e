"""smart: what the collector reads from real drives' smartctl outputs, replayed by a fake smartctl.

The outputs are real (tests/fixtures/smartctl/recordings, from py-SMART's dataset); the expected
values below were read off those files by hand, not produced by the code under test.  Two "derived"
recordings are real ones with failing values edited in (README.md there lists every edit), because
every real recording here is of a healthy disk, and zeros cannot show that attribute 197 is not
exported as 198.
"""

from __future__ import annotations

import os
import re

import pytest

from exporter.collectors.smart import (
    device_labels,
    nvme_namespaces,
    parse_scan,
    power_on_seconds,
    raw_number,
)
from exporter.config import ConfigError, parse_args
from exporter.host.smartctl import SmartctlError
from tests.fixtures.smartctl.fake import LISTINGS
from tests.fixtures.smartctl.harness import collector, make_sysfs

# --- the scan --------------------------------------------------------------------------------------


def read_listing(case: str) -> list[str]:
    with open(os.path.join(LISTINGS, case, "_--scan-open")) as handle:
        return handle.read().splitlines()


def test_real_scan_listings(tmp_path) -> None:
    sysfs = make_sysfs(str(tmp_path), nvme={"nvme0": ["nvme0n1"], "nvme1": ["nvme1n1", "nvme1n2"]})
    targets = parse_scan(read_listing("linux_multiple_devices"), sysfs)
    assert [(t.path, t.kind, t.devices, t.open_error) for t in targets] == [
        ("/dev/nvme0", "nvme", ("nvme0n1",), None),
        ("/dev/nvme1", "nvme", ("nvme1n1", "nvme1n2"), None),
        ("/dev/bus/0", "sat+megaraid,60", ("bus/0:sat+megaraid,60",), None),
    ]
    usb = parse_scan(read_listing("linux_usb_nvme_asmedia_issue_97"), sysfs)
    assert [(t.path, t.kind, t.devices) for t in usb] == [("/dev/sda", "sntasmedia", ("sda",))]


def test_scan_keeps_devices_it_could_not_open() -> None:
    # smartctl.cpp scan_devices(): "# %s -d %s # %s, %s device open failed: %s\n"
    lines = ["/dev/sda -d sat # /dev/sda [SAT], ATA device",
             "# /dev/sdb -d scsi # /dev/sdb, SCSI device open failed: Permission denied",
             "# /dev/nvme0 -d nvme # /dev/nvme0, NVMe device open failed: No such device", ""]
    targets = parse_scan(lines, "/nonexistent")
    assert [(t.path, t.open_error) for t in targets] == [
        ("/dev/sda", None), ("/dev/sdb", "Permission denied"), ("/dev/nvme0", "No such device")]


def test_scan_output_with_no_device_line_is_an_error_and_an_empty_one_is_no_devices() -> None:
    assert parse_scan([], "/nonexistent") == []
    with pytest.raises(SmartctlError, match="unrecognised --scan-open output: garbage"):
        parse_scan(["garbage", "more garbage"], "/nonexistent")


# --- the device label ------------------------------------------------------------------------------


def test_device_label_joins_diskstats_names(tmp_path) -> None:
    sysfs = make_sysfs(str(tmp_path), nvme={"nvme0": ["nvme0n1", "nvme0n10", "nvme0n2"], "nvme1": ["nvme1c1n1"],
                                            "nvme2": ["nvme2n1", "ng2n1"]}, sg={"sg2": "sdb"})
    assert device_labels("/dev/sda", "sat", sysfs) == ("sda",)
    assert device_labels("/dev/nvme0", "nvme", sysfs) == ("nvme0n1", "nvme0n2", "nvme0n10")
    # native multipath: the controller holds path nvme1c1n1; the block device is the head nvme1n1
    assert device_labels("/dev/nvme1", "nvme", sysfs) == ("nvme1n1",)
    assert device_labels("/dev/nvme2", "nvme", sysfs) == ("nvme2n1",)  # ng2n1 is a char device
    assert device_labels("/dev/nvme0n1", "nvme", sysfs) == ("nvme0n1",)
    assert device_labels("/dev/sg2", "sat", sysfs) == ("sdb",)
    assert device_labels("/dev/bus/0", "megaraid,16", sysfs) == ("bus/0:megaraid,16",)
    assert device_labels("/dev/sda", "sat+megaraid,3", sysfs) == ("sda:sat+megaraid,3",)


def test_device_label_without_sysfs_is_the_smartctl_name(tmp_path) -> None:
    assert nvme_namespaces(str(tmp_path), "nvme3") == []
    assert device_labels("/dev/nvme3", "nvme", str(tmp_path)) == ("nvme3",)
    assert device_labels("/dev/sg7", "sat", str(tmp_path)) == ("sg7",)


# --- raw values ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "raw", "seconds"), [
    ("Power_On_Hours", "1380", 1380 * 3600),
    ("Power_On_Hours", "12345 (152 21 0)", 12345 * 3600),
    ("Power_On_Hours", "23416h+42m+08.090s", 23416 * 3600 + 42 * 60 + 8.09),
    ("Power_On_Hours_and_Msec", "1022h+12m+07.460s", 1022 * 3600 + 12 * 60 + 7.46),
    ("Power_On_Minutes", "1064h+12m", 1064 * 3600 + 12 * 60),
    ("Power_On_Minutes", "63852", 63852 * 60),
    ("Power_On_Half_Minutes", "100", 100 * 30),
    ("Unknown_Attribute", "1380", None),
])
def test_power_on_time_in_the_unit_the_attribute_names(name, raw, seconds) -> None:
    if seconds is None:
        assert power_on_seconds(name, raw) is None
    else:
        assert power_on_seconds(name, raw) == pytest.approx(seconds)


def test_raw_values() -> None:
    assert raw_number("31 (Min/Max 25/32)") == 31
    assert raw_number("0x0000000a0001") == 0xA0001
    assert raw_number("-") is None


# --- a representative set of real drives -----------------------------------------------------------


# --- every recording -------------------------------------------------------------------------------


# --- which disks are polled ------------------------------------------------------------------------


# --- flags -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(("flag", "message"), [
    ("--collector.smart.powermode-check=sometimes",
     "invalid value 'sometimes' for --collector.smart.powermode-check: unknown choice; accepted: never, sleep, "
     "standby, idle"),
    ("--smartctl.path=/no/such/smartctl",
     "invalid value '/no/such/smartctl' for --smartctl.path: no executable file there"),
    ("--collector.smart.concurrency=0", "--collector.smart.concurrency: not a whole number of at least 1"),
    ("--collector.smart.timeout=soon", "--collector.smart.timeout: not a duration"),
    ("--collector.smart.devices=;sat", "--collector.smart.devices: entry ';sat' has no device path"),
])
def test_bad_flags_stop_start_up_naming_the_flag(flag, message) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_args([flag], environ={})


def test_include_and_exclude_together_are_refused(tmp_path) -> None:
    with pytest.raises(ConfigError, match="mutually exclusive"):
        collector(str(tmp_path), "smartctl", "device-include=a", "device-exclude=b")


def test_defaults_and_environment_twins() -> None:
    options = parse_args([], environ={"GPUIO_COLLECTOR_SMART_INTERVAL": "90s"}).collector_options["smart"]
    assert options["interval"] == 90.0
    assert (options["timeout"], options["powermode-check"], options["concurrency"]) == (30.0, "standby", 4)
    assert options["smartctl-path"] is None and options["devices"] is None


# --- docs ------------------------------------------------------------------------------------------


