"""smart, end to end: the real exporter over HTTP, with the replaying smartctl and with the real one.

With the fake (tests/fixtures/smartctl/fake.py: no machine here has the disks it replays), the
exporter finds disks by ``--scan-open``, polls them in the background and serves them; a hung
smartctl leaves scrapes answering within the collector budget, and stopping the exporter ends it.
With the real smartctl (Debian smartmontools): the scan of this machine, and, as ``nobody``, a disk
that cannot be opened, which must be said once in the log and by ``gpuio_smart_permission_denied``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator

import pytest

from tests.conftest import LIBRARY, REPO, free_port, parse_samples
from tests.fixtures.smartctl.fake import LISTINGS, FakeSmartctl
from tests.fixtures.smartctl.harness import make_sysfs, state, value

pytestmark = pytest.mark.e2e


@pytest.fixture
def smart_env() -> Iterator[dict[str, str]]:
    """Environment for an exporter started by hand (some tests run it as ``nobody``): the repo on
    PYTHONPATH, so the package imports whoever runs it."""
    yield {**os.environ, "PYTHONPATH": os.pathsep.join((REPO, LIBRARY))}


HOST = os.path.join(LISTINGS, "linux_multiple_devices")  # nvme0, nvme1, bus/0 (sat+megaraid,60)
ONLY_SMART = ("--collector.disable-defaults", "--collector.smart")
SMARTCTL = shutil.which("smartctl") or shutil.which("smartctl", path="/usr/sbin:/sbin")


def wait_for(server, condition, seconds: float = 20.0) -> dict:
    """Scrape until ``condition(samples)`` holds; the samples of that scrape."""
    deadline = time.monotonic() + seconds
    while True:
        samples = parse_samples(server.scrape())
        if condition(samples) or time.monotonic() > deadline:
            return samples
        time.sleep(0.1)


def polled(samples: dict) -> bool:
    return any(name == "gpuio_smart_device_state" for name, _ in samples)


def test_disks_found_by_the_scan_are_served_over_http(exporter, smart_env, tmp_path) -> None:
    sysfs = make_sysfs(str(tmp_path / "sys"), nvme={"nvme0": ["nvme0n1"], "nvme1": ["nvme1n1"]})
    fake = FakeSmartctl(str(tmp_path / "fake"), [HOST])
    server = exporter(*ONLY_SMART, f"--path.sysfs={sysfs}", f"--smartctl.path={fake.path}",
                      env=smart_env)
    samples = wait_for(server, polled)
    assert value(samples, "gpuio_scrape_collector_success", collector="smart") == 1
    assert {state(samples, d) for d in ("nvme0n1", "nvme1n1", "bus/0:sat+megaraid,60")} == {"ok"}
    # linux_multiple_devices/_-d_nvme_--all__dev_nvme1: "Temperature: 46 Celsius", "Error Information
    # Log Entries: 197", "Data Units Written: 36 848 011"; the megaraid disk: "194 Temperature_Celsius ... 19"
    assert value(samples, "gpuio_smart_temperature_celsius", device="nvme1n1") == 46
    assert value(samples, "gpuio_smart_nvme_error_log_entries_total", device="nvme1n1") == 197
    assert value(samples, "gpuio_smart_nvme_written_bytes_total", device="nvme1n1") == 36_848_011 * 512_000
    assert value(samples, "gpuio_smart_temperature_celsius", device="bus/0:sat+megaraid,60") == 19
    assert {tuple(call[:2]) for call in fake.calls()} == {("-n", "standby")}
    if shutil.which("promtool"):
        check = subprocess.run(["promtool", "check", "metrics"], input=server.scrape(), capture_output=True,
                               text=True)
        assert check.returncode == 0, check.stdout + check.stderr


def test_a_hung_smartctl_never_holds_up_a_scrape_and_dies_with_the_exporter(exporter, smart_env, tmp_path) -> None:
    sysfs = make_sysfs(str(tmp_path / "sys"), nvme={"nvme0": ["nvme0n1"], "nvme1": ["nvme1n1"]})
    fake = FakeSmartctl(str(tmp_path / "fake"), [HOST], [("nvme0$", "hang")], hang_seconds=120)
    server = exporter(*ONLY_SMART, f"--path.sysfs={sysfs}", f"--smartctl.path={fake.path}",
                      "--collector.smart.timeout=60s", "--collector.timeout=2s", env=smart_env)
    while not fake.running("/dev/nvme0"):
        time.sleep(0.02)  # the first sweep is now waiting on the hung smartctl of nvme0
    samples = parse_samples(server.scrape())
    assert fake.running("/dev/nvme0")
    assert value(samples, "gpuio_scrape_collector_success", collector="smart") == 1  # within the 2 s budget
    assert not polled(samples)  # no sweep has finished yet: nothing to serve, nothing made up
    log = server.stop()
    assert fake.running() == [], log


def test_the_real_smartctl_scan_of_this_machine(exporter, smart_env) -> None:
    if SMARTCTL is None:
        pytest.skip("smartctl is not installed (Debian package smartmontools)")
    server = exporter(*ONLY_SMART, f"--smartctl.path={SMARTCTL}", env=smart_env)
    samples = wait_for(server, lambda s: value(s, "gpuio_smart_permission_denied") is not None)
    assert value(samples, "gpuio_scrape_collector_success", collector="smart") == 1
    assert value(samples, "gpuio_smart_permission_denied") is not None  # a sweep ran to its end


def a_disk() -> str | None:
    """A whole disk of this machine (not loop, ram, zram, dm or md)."""
    for name in sorted(os.listdir("/sys/block")):
        if not name.startswith(("loop", "ram", "zram", "dm-", "md", "sr", "fd")):
            return f"/dev/{name}"
    return None


@pytest.mark.root
def test_the_real_smartctl_without_permission_is_said_once(smart_env) -> None:
    if os.geteuid() != 0 or shutil.which("setpriv") is None or SMARTCTL is None:
        pytest.skip("needs root (to drop to nobody), setpriv and smartctl")
    disk = a_disk()
    if disk is None:
        pytest.skip("no disk in /sys/block")
    port = free_port()
    command = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--inh-caps=-all",
               "--bounding-set=-all", "--no-new-privs", sys.executable, "-m", "exporter",
               f"--web.listen-address=127.0.0.1:{port}", *ONLY_SMART, f"--smartctl.path={SMARTCTL}",
               f"--collector.smart.devices={disk};sat", "--collector.smart.interval=1s"]
    process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env=smart_env)
    try:
        samples: dict = {}
        deadline = time.monotonic() + 20
        while value(samples, "gpuio_smart_permission_denied") is None and time.monotonic() < deadline:
            time.sleep(0.2)
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
                    samples = parse_samples(response.read().decode())
            except OSError:
                continue
        time.sleep(2.5)  # two more sweeps at the 1 s interval: the log line must not repeat
    finally:
        process.terminate()
        output, _ = process.communicate(timeout=10)
    device = disk[len("/dev/"):]
    assert value(samples, "gpuio_smart_permission_denied") == 1, output
    assert state(samples, device) == "permission_denied"
    lines = [line for line in output.splitlines() if "no permission to open disks" in line]
    assert len(lines) == 1, output
    assert "CAP_SYS_RAWIO" in lines[0] and "Permission denied" in lines[0]


# --- a smartctl that leaves processes behind, or writes without end ---------------------------------


def alive(pid: int) -> bool:
    """Whether a process lives (a zombie is dead: it waits only to be reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_processes_a_smartctl_wrapper_starts_outside_its_session_die_each_sweep_and_at_stop(
        exporter, smart_env, tmp_path) -> None:
    """A --smartctl.path wrapper that setsid's two sleepers per run, one holding smartctl's stdout open
    (the poll times out) and one with its output elsewhere (the poll ends at once), and a third that
    exits at once, then exits: no sleeper may outlive its sweep, nor the exporter, and the one that
    exited is reaped (it is the exporter's child now), not left a zombie."""
    pids = tmp_path / "pids"
    quick = tmp_path / "quick"
    wrapper = tmp_path / "smartctl"
    wrapper.write_text(f"#!/bin/sh\nsetsid sleep 300 &\necho $! >> {pids}\n"
                       f"setsid sleep 300 </dev/null >/dev/null 2>&1 &\necho $! >> {pids}\n"
                       f"setsid true </dev/null >/dev/null 2>&1 &\necho $! >> {quick}\n")
    wrapper.chmod(0o755)
    server = exporter(*ONLY_SMART, f"--smartctl.path={wrapper}", "--collector.smart.interval=200ms",
                      "--collector.smart.timeout=500ms", env=smart_env)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and (not pids.exists() or len(pids.read_text().split()) < 16):
        time.sleep(0.1)
    started = [int(pid) for pid in pids.read_text().split()]
    time.sleep(1.0)  # the sweep in flight ends (its timeout, then the clean-up)
    left = [pid for pid in started if alive(pid)]
    killed = value(parse_samples(server.scrape()), "gpuio_smart_stray_processes_killed_total")
    zombies = [pid for pid in map(int, quick.read_text().split()) if os.path.exists(f"/proc/{pid}")]
    log = server.stop()
    time.sleep(0.2)
    survivors = [pid for pid in [int(pid) for pid in pids.read_text().split()] if alive(pid)]
    print(f"wrapper sleepers started: {len(started)}; alive while the exporter ran: {len(left)}; "
          f"alive after it stopped: {len(survivors)}; exited ones not reaped: {len(zombies)}")
    signal_all(survivors)
    assert len(started) >= 16
    assert len(zombies) <= 1  # at most the one of the sweep in flight
    assert killed is not None and killed >= len(started) - 2  # visible in metrics, not only in the log
    assert len(left) <= 2, "sleepers outlived their sweep"  # at most the pair of the sweep in flight now
    assert survivors == [], log


def signal_all(pids: list[int]) -> None:
    import signal

    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def peak_rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as handle:
        for line in handle:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


def test_a_smartctl_that_writes_without_end_is_cut_off_and_memory_stays_bounded(
        exporter, smart_env, tmp_path) -> None:
    """50 MB of output per run (the attack used 400 MB): read up to the 4 MiB bound, then killed,
    reported as an error, and the exporter's peak RSS grows by a few MiB, not by the output."""
    wrapper = tmp_path / "smartctl"
    wrapper.write_text("#!/bin/sh\nhead -c 50000000 /dev/zero | tr '\\0' 'x'\n")
    wrapper.chmod(0o755)
    server = exporter(*ONLY_SMART, f"--smartctl.path={wrapper}", "--collector.smart.interval=1h",
                      "--collector.smart.timeout=30s", env=smart_env)
    assert server.process is not None
    before = peak_rss_bytes(server.process.pid)
    samples = wait_for(server, lambda s: value(s, "gpuio_scrape_collector_success", collector="smart") == 0,
                       seconds=60)
    after = peak_rss_bytes(server.process.pid)
    print(f"peak RSS: {before / 2**20:.1f} MiB at start, {after / 2**20:.1f} MiB after 50 MB of smartctl output")
    assert value(samples, "gpuio_scrape_collector_success", collector="smart") == 0
    log = server.stop()
    assert "output too large" in log
    assert after - before < 32 * 2**20, f"peak RSS grew by {(after - before) / 2**20:.0f} MiB"
