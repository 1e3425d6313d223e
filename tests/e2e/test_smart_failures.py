"""smart: disks and smartctls that misbehave.  A sleeping disk is never woken; a hung, failing or garbled
smartctl costs its own disk only its freshness, never a scrape or another disk its values.

The smartctl is the replaying fake of tests/fixtures/smartctl/fake.py (its docstring says why); the
misbehaviours are its, chosen per device.  Timings are not asserted: what is checked is that a
scrape returns while a smartctl is still hanging, and what it reports.
"""

from __future__ import annotations

import logging
import os
import subprocess
import threading
import time

from exporter.collect import Scraper
from exporter.collectors.smart import PollResult
from exporter.exposition import render
from exporter.host.smartctl import Processes, Runner
from tests.conftest import parse_samples
from tests.fixtures.smartctl.fake import LISTINGS, SINGLE, FakeSmartctl
from tests.fixtures.smartctl.harness import collector, make_sysfs, state, sweep, value

HOST = os.path.join(LISTINGS, "linux_multiple_devices")  # scan: nvme0, nvme1, bus/0 (sat+megaraid,60)
SAS = os.path.join(SINGLE, "sas_hdd_0_issue_51")  # /dev/sdc: pySMART adds four probes to its --all
MEGARAID = "bus/0:sat+megaraid,60"


def fake(tmp_path, behaviours=None, data=(HOST,), **kwargs) -> FakeSmartctl:
    return FakeSmartctl(str(tmp_path / "fake"), list(data), behaviours, **kwargs)


def sysfs(tmp_path) -> str:
    return make_sysfs(str(tmp_path / "sys"), nvme={"nvme0": ["nvme0n1"], "nvme1": ["nvme1n1"]})


# --- the power-mode check --------------------------------------------------------------------------


def test_every_smartctl_run_carries_the_power_mode_check(tmp_path) -> None:
    """The scan, every device's --all, pySMART's own probes (-l sataphy/sasphy/background) and -d test."""
    smartctl = fake(tmp_path, data=(HOST, SAS, os.path.join(SINGLE, "nvme_0")))
    sweep(collector(sysfs(tmp_path), smartctl.path))  # scan
    sweep(collector(sysfs(tmp_path), smartctl.path, "devices=/dev/sdc;scsi /dev/nvme0"))  # probes, -d test
    calls = smartctl.calls()
    kinds = {" ".join(call[2:4]) for call in calls}
    assert {"--scan-open", "-d nvme", "-d sat+megaraid,60", "-d scsi", "-d sat", "-d test"} <= kinds
    assert any("sasphy" in call for call in calls) and any("background" in call for call in calls)
    assert [call for call in calls if call[:2] != ["-n", "standby"]] == []


def test_the_configured_power_mode_is_the_one_passed(tmp_path) -> None:
    smartctl = fake(tmp_path)
    sweep(collector(sysfs(tmp_path), smartctl.path, "powermode-check=idle"))
    assert {tuple(call[:2]) for call in smartctl.calls()} == {("-n", "idle")}


def test_a_sleeping_disk_is_left_asleep_and_keeps_its_last_values(tmp_path) -> None:
    smartctl = fake(tmp_path)
    smart = collector(sysfs(tmp_path), smartctl.path)
    awake = sweep(smart)
    smartctl.configure([HOST], [("nvme1$", "asleep")])
    asleep = sweep(smart)
    assert state(asleep, "nvme1n1") == "asleep" and state(asleep, "nvme0n1") == "ok"
    for name in ("gpuio_smart_temperature_celsius", "gpuio_smart_last_success_timestamp_seconds",
                 "gpuio_smart_nvme_error_log_entries_total"):
        assert value(asleep, name, device="nvme1n1") == value(awake, name, device="nvme1n1") is not None
    assert value(asleep, "gpuio_smart_last_success_timestamp_seconds", device="nvme0n1") > value(
        awake, "gpuio_smart_last_success_timestamp_seconds", device="nvme0n1")


def test_with_the_check_off_a_sleeping_disk_is_read(tmp_path) -> None:
    """``never``: the operator's choice to spin disks up; the fake answers as a woken disk would."""
    smartctl = fake(tmp_path, [("nvme1$", "asleep")])
    found = sweep(collector(sysfs(tmp_path), smartctl.path, "powermode-check=never"))
    assert state(found, "nvme1n1") == "ok"


# --- a smartctl that hangs, fails or prints garbage ------------------------------------------------


def test_a_hung_smartctl_is_killed_at_the_deadline_and_holds_up_no_other_disk(tmp_path) -> None:
    smartctl = fake(tmp_path)
    smart = collector(sysfs(tmp_path), smartctl.path, "timeout=1s")
    before = sweep(smart)
    smartctl.configure([HOST], [("nvme0$", "hang")], hang_seconds=60)
    after = sweep(smart)
    assert state(after, "nvme0n1") == "timeout"
    assert state(after, "nvme1n1") == "ok" and state(after, MEGARAID) == "ok"
    assert value(after, "gpuio_smart_temperature_celsius", device="nvme0n1") == value(
        before, "gpuio_smart_temperature_celsius", device="nvme0n1")
    assert value(after, "gpuio_smart_last_success_timestamp_seconds", device="nvme0n1") == value(
        before, "gpuio_smart_last_success_timestamp_seconds", device="nvme0n1")
    assert smartctl.running() == []  # killed, not left sleeping


def test_a_failing_smartctl_makes_its_disk_stale_not_empty(tmp_path) -> None:
    smartctl = fake(tmp_path)
    smart = collector(sysfs(tmp_path), smartctl.path)
    before = sweep(smart)
    smartctl.configure([HOST], [("nvme1$", "fail"), ("bus/0$", "garbage")])
    after = sweep(smart)
    assert state(after, "nvme1n1") == "error" and state(after, MEGARAID) == "error"
    assert state(after, "nvme0n1") == "ok"
    assert smart._records[next(t for t in smart._records if t.path == "/dev/nvme1")].detail == (
        "exit status 2: Smartctl open device: /dev/nvme1 failed: No such device")
    for device in ("nvme1n1", MEGARAID):
        assert value(after, "gpuio_smart_health_passed", device=device) == 1
        assert value(after, "gpuio_smart_last_success_timestamp_seconds", device=device) == value(
            before, "gpuio_smart_last_success_timestamp_seconds", device=device)


def test_garbage_from_the_first_poll_is_an_error_not_an_unsupported_disk(tmp_path) -> None:
    smartctl = fake(tmp_path, [("nvme0$", "garbage")])
    found = sweep(collector(sysfs(tmp_path), smartctl.path))
    assert state(found, "nvme0n1") == "error"
    assert value(found, "gpuio_smart_last_success_timestamp_seconds", device="nvme0n1") is None


def test_a_disk_whose_smartctl_is_still_stuck_is_not_polled_again(tmp_path) -> None:
    """A SIGKILLed smartctl in uninterruptible sleep lives on until its IO returns; a test cannot put a
    process into D state, so a running ``sleep`` stands in for it."""
    smartctl = fake(tmp_path)
    smart = collector(sysfs(tmp_path), smartctl.path)
    sweep(smart)
    target = next(t for t in smart._records if t.path == "/dev/nvme1")
    stuck = subprocess.Popen(["sleep", "30"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        smart._record(target, PollResult("timeout", "killed", 1.0, stuck=stuck))
        calls = len(smartctl.calls())
        found = sweep(smart)
        assert "/dev/nvme1" not in [call[-1] for call in smartctl.calls()[calls:]]
        assert state(found, "nvme1n1") == "timeout"
    finally:
        stuck.kill()
        stuck.wait()
    found = sweep(smart)
    assert state(found, "nvme1n1") == "ok"


def test_one_deadline_covers_all_of_a_polls_smartctl_runs(tmp_path) -> None:
    """pySMART runs a SAS disk's smartctl several times; the budget is per disk, not per run."""
    smartctl = FakeSmartctl(str(tmp_path), [SAS], [("-l sasphy", "hang")])
    found = sweep(collector(str(tmp_path), smartctl.path, "devices=/dev/sdc;scsi", "timeout=1s"))
    assert state(found, "sdc") == "timeout"
    after_hang = smartctl.calls()[[i for i, c in enumerate(smartctl.calls()) if "sasphy" in c][0] + 1:]
    assert after_hang == []  # the probes pySMART would still make are not run once time is up


def test_runner_kills_the_whole_process_group(tmp_path) -> None:
    script = tmp_path / "smartctl"
    script.write_text("#!/bin/sh\nsleep 60 &\necho $! > '%s'\nwait\n" % (tmp_path / "child"))
    script.chmod(0o755)
    runner = Runner(str(script), "standby", 1.0, Processes())
    try:
        runner.call(["--scan-open"])
        raise AssertionError("a hung smartctl returned")
    except Exception as exc:
        assert getattr(exc, "state", None) == "timeout"
    child = int((tmp_path / "child").read_text())
    time.sleep(0.1)
    try:
        with open(f"/proc/{child}/stat") as handle:
            assert handle.read().rsplit(")", 1)[1].split()[0] == "Z"  # dead, waiting for init to reap it
    except FileNotFoundError:
        pass  # dead and reaped


# --- the scan --------------------------------------------------------------------------------------


def test_a_failed_scan_keeps_polling_the_disks_found_before(tmp_path, caplog) -> None:
    smartctl = fake(tmp_path)
    smart = collector(sysfs(tmp_path), smartctl.path)
    sweep(smart)
    smartctl.configure([HOST], [("--scan-open", "garbage")])
    with caplog.at_level(logging.WARNING):
        found = sweep(smart)
        sweep(smart)
    assert {state(found, d) for d in ("nvme0n1", "nvme1n1", MEGARAID)} == {"ok"}
    assert [r.getMessage() for r in caplog.records] == [
        "smartctl --scan-open failed; polling the disks it found before"]  # once, not every sweep


def test_a_first_scan_that_fails_fails_the_collector_not_the_scrape(tmp_path) -> None:
    smartctl = fake(tmp_path, [("--scan-open", "hang")])
    smart = collector(sysfs(tmp_path), smartctl.path, "timeout=1s")
    smart.sampler.sample_now()
    found = parse_samples(render(Scraper([smart], 2.0, "").scrape_sync()))
    assert value(found, "gpuio_scrape_collector_success", collector="smart") == 0


def test_no_smartctl_is_no_data_and_success(tmp_path) -> None:
    smart = collector(sysfs(tmp_path), "gpuio-test-no-such-smartctl")
    smart.sampler.sample_now()
    families = Scraper([smart], 2.0, "").scrape_sync()
    found = parse_samples(render(families))
    assert value(found, "gpuio_scrape_collector_success", collector="smart") == 1
    assert [name for name, _ in found if name.startswith("gpuio_smart_")] == []


def test_no_permission_is_said_once_and_shown_by_a_metric(tmp_path, caplog) -> None:
    smartctl = fake(tmp_path, [("/dev/", "denied")])
    smart = collector(sysfs(tmp_path), smartctl.path)
    with caplog.at_level(logging.WARNING):
        found = sweep(smart)
        sweep(smart)
    assert value(found, "gpuio_smart_permission_denied") == 1
    assert {state(found, d) for d in ("nvme0n1", "nvme1n1", MEGARAID)} == {"permission_denied"}
    errors = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(errors) == 1 and "CAP_SYS_RAWIO" in errors[0].getMessage()


def test_scan_open_failures_are_not_polled(tmp_path) -> None:
    scan = ["/dev/nvme0 -d nvme # /dev/nvme0, NVMe device",
            "# /dev/sdb -d sat # /dev/sdb [SAT], ATA device open failed: Permission denied"]
    smartctl = FakeSmartctl(str(tmp_path / "fake"), [HOST], scan=scan)
    found = sweep(collector(sysfs(tmp_path), smartctl.path))
    assert state(found, "nvme0n1") == "ok" and state(found, "sdb") == "permission_denied"
    assert value(found, "gpuio_smart_permission_denied") == 1
    assert "/dev/sdb" not in [call[-1] for call in smartctl.calls()]


# --- scrapes never wait ----------------------------------------------------------------------------


def test_a_scrape_during_a_hung_poll_serves_the_last_sweep(tmp_path) -> None:
    smartctl = fake(tmp_path)
    smart = collector(sysfs(tmp_path), smartctl.path, "timeout=20s")
    sweep(smart)
    polls = len(smartctl.calls())
    smartctl.configure([HOST], [("nvme0$", "hang")], hang_seconds=20)
    background = threading.Thread(target=smart.sampler.sample_now, daemon=True)
    background.start()
    while not any(call[-1] == "/dev/nvme0" for call in smartctl.calls()[polls:]):
        time.sleep(0.01)  # the second sweep is now waiting on the hung smartctl
    found = parse_samples(render(Scraper([smart], 2.0, "").scrape_sync()))
    assert background.is_alive()
    assert value(found, "gpuio_scrape_collector_success", collector="smart") == 1
    assert state(found, "nvme0n1") == "ok"  # the last completed sweep's answer
    assert smartctl.running("/dev/nvme0")  # the hung smartctl, still there
    smart.stop()  # ends the hung smartctl, as the exporter does when it stops
    background.join(10)
    assert not background.is_alive() and smartctl.running() == []


def test_a_disk_that_falls_asleep_during_a_poll_keeps_its_last_complete_reading(tmp_path) -> None:
    """pySMART swallows a failed probe and goes on; a probe answered "asleep" still makes the poll asleep,
    and the disk is not asked again in that poll."""
    smartctl = FakeSmartctl(str(tmp_path), [SAS], [("-l sasphy", "asleep")])
    found = sweep(collector(str(tmp_path), smartctl.path, "devices=/dev/sdc;scsi"))
    assert state(found, "sdc") == "asleep"
    calls = smartctl.calls()
    assert "sasphy" in calls[-1]


def test_disks_are_polled_in_parallel_up_to_the_bound(tmp_path) -> None:
    smartctl = fake(tmp_path, [("/dev/", "hang")], hang_seconds=60)
    smart = collector(sysfs(tmp_path), smartctl.path, "timeout=1s", "concurrency=2")
    background = threading.Thread(target=smart.sampler.sample_now, daemon=True)
    background.start()
    most = 0
    while background.is_alive():
        most = max(most, len(smartctl.running()))
        time.sleep(0.02)
    assert most == 2  # three hung disks, two at a time
    assert {state(parse_samples(render(smart.collect())), d) for d in ("nvme0n1", "nvme1n1", MEGARAID)} == {
        "timeout"}


def test_a_disk_keeps_its_values_when_its_label_changes(tmp_path) -> None:
    """The record follows smartctl's address (/dev/nvme0), not the label: here the namespace appears in
    sysfs only after the first sweep, and the next poll fails."""
    smartctl = fake(tmp_path)
    bare = str(tmp_path / "sys")
    smart = collector(bare, smartctl.path)
    before = sweep(smart)
    assert state(before, "nvme0") == "ok"
    make_sysfs(bare, nvme={"nvme0": ["nvme0n1"]})
    smartctl.configure([HOST], [("nvme0$", "fail")])
    after = sweep(smart)
    assert state(after, "nvme0n1") == "error"
    assert value(after, "gpuio_smart_temperature_celsius", device="nvme0n1") == value(
        before, "gpuio_smart_temperature_celsius", device="nvme0")


def test_a_smartctl_that_cannot_be_started_is_an_error_that_names_it(tmp_path) -> None:
    broken = tmp_path / "smartctl"
    broken.write_text("#!/nonexistent/interpreter\n")
    broken.chmod(0o755)
    smart = collector(str(tmp_path), str(broken))
    snapshot = smart.sampler.sample_now()
    assert snapshot.error == (f"RuntimeError: smartctl --scan-open failed: cannot run {broken}: "
                              "No such file or directory")


def test_no_new_scan_while_the_last_one_is_stuck(tmp_path) -> None:
    """--scan-open opens every disk, and opening a dead one can hang in the kernel: while that scan's
    smartctl lives on (a running ``sleep`` stands in for it), the disks found before are polled and no
    scan is started to pile up behind it."""
    smartctl = fake(tmp_path)
    smart = collector(sysfs(tmp_path), smartctl.path)
    sweep(smart)
    stuck = subprocess.Popen(["sleep", "30"])
    try:
        smart._scan_stuck = stuck
        calls = len(smartctl.calls())
        found = sweep(smart)
        assert ["--scan-open"] not in [call[2:] for call in smartctl.calls()[calls:]]
        assert {state(found, d) for d in ("nvme0n1", "nvme1n1", MEGARAID)} == {"ok"}
    finally:
        stuck.kill()
        stuck.wait()
    calls = len(smartctl.calls())
    sweep(smart)
    assert ["--scan-open"] in [call[2:] for call in smartctl.calls()[calls:]]
