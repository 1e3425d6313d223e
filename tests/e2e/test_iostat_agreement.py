"""gpuio's disk counters, turned into rates, agree with ``iostat -x`` over the same seconds of real IO.

Setup: a 256 MiB backing file, written in full (a sparse file's holes never reach a disk), attached
with ``losetup --direct-io=on`` so the loop device passes every request to the disk underneath;
fio drives a steady, rate-limited mixed load on it (randrw 70/30, one job of 4 KiB requests and one
of 64 KiB requests, libaio, direct=1).  The exporter runs with ``--collector.diskstats.device-include=
^loopN$`` (loop devices are excluded by default).

Measurement, once the load has settled: scrape A, then ``iostat -x -y -d -o JSON loopN 4 1`` is
spawned (it reads the counters at once, sleeps 4 s, reads them again, prints and exits), then
scrape B as soon as iostat has exited.  From A and B the iostat -x figures are computed the way
sysstat 12.6 computes them (iostat.c write_ext_stat / rd_stats.c compute_ext_disk_stats):

    r/s     = Δreads / Δt                 w/s     = Δwrites / Δt
    rkB/s   = Δread_bytes / 1024 / Δt     wkB/s   = Δwritten_bytes / 1024 / Δt
    r_await = Δread_time / Δreads  (ms)   w_await = Δwrite_time / Δwrites  (ms)
    aqu-sz  = Δio_time_weighted / Δt      %util   = Δio_time / Δt * 100

where Δt is the time between the middles of the two HTTP scrapes (what Prometheus's scrape
timestamps approximate).

Tolerance: |gpuio - iostat| <= rel * |iostat| + floor, per figure (TOLERANCES below).  Both sides
difference the same kernel counters, so what separates them is only *when* each read them:

* Δt.  The exporter reads /proc/diskstats somewhere inside its HTTP request, so each scrape's
  instant is known to within half the request's duration (a few ms, printed); iostat measures its
  interval from /proc/uptime in 1/100 s, so its Δt is off by up to 10 ms.  On a 4 s window that is
  well under 1 % on every figure divided by Δt (rates, aqu-sz, %util).
* Window edges.  iostat's window starts a few ms after scrape A and ends a few ms before scrape B
  (bounds printed).  Under a steady, rate-limited load the IO in those slivers is the same rate
  as in the rest of the window, so it hardly moves the rates; for the awaits (ratios of two counts,
  no Δt) a 10 ms sliver holds 0.25 % of the requests, and only a latency spike on the disk
  underneath in exactly that sliver could move the mean by a few tenths of a percent more.
* iostat prints two decimals, so its figures are rounded by up to 0.005: the absolute floor covers
  that and keeps near-zero figures (an await of a few hundredths of a ms on a fast disk) from
  being judged relatively.

Hence 2 % on the rates (several times the Δt error above), 5 % on r_await, w_await, aqu-sz and
%util (which carry the edge effect on top, and %util the kernel's jiffy-granular io_ticks).  A unit
or scaling mistake in the exporter (sectors vs bytes, ms vs s) is off by 2x or more and fails by a
wide margin; even 1000-for-1024 in kB/s (2.4 %) fails the 2 %.  Preconditions assert that
the load really ran (so an all-zero agreement cannot pass) and that both windows' edges lie within
100 ms of each other.

Observed on a 2-core VM (virtio disk, 11 runs, 3 of them with both cores kept busy by two spinning
processes): edges within 4-44 ms, rates within 0.35 %, aqu-sz within 0.8 %, %util within 0.6 %,
awaits within 0.005 ms (iostat's rounding, up to 4.4 % of a 0.11 ms await; hence the floor).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time

import pytest

from tests.conftest import parse_samples
from tests.peers import direct_io_loop, stop

pytestmark = [pytest.mark.e2e, pytest.mark.root]

BACKING_MIB = 256
INTERVAL_S = 4  # iostat's interval (whole seconds: it sleeps with alarm())
SETTLE_S = 1.0  # fio's first second (ramp, first rate-limit adjustments) is left out
# fio rate limits (IOPS, read,write) per job; well under what the loop+vda stack sustains here
# (~30k IOPS unthrottled), so latency stays steady and two cores are left for exporter and iostat.
SMALL_RATE = "3000,1300"
LARGE_RATE = "150,60"
EXPECTED_READS_PER_S = 3150
EXPECTED_WRITES_PER_S = 1360

# figure: (relative tolerance, absolute floor in the figure's unit)
TOLERANCES: dict[str, tuple[float, float]] = {
    "r/s": (0.02, 0.5),
    "w/s": (0.02, 0.5),
    "rkB/s": (0.02, 2.0),
    "wkB/s": (0.02, 2.0),
    "r_await": (0.05, 0.02),
    "w_await": (0.05, 0.02),
    "aqu-sz": (0.05, 0.02),
    "util": (0.05, 0.5),
}
MAX_EDGE_MISMATCH_S = 0.100


def _require_tools() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root: losetup attaches a loop device")
    missing = [tool for tool in ("losetup", "fio", "iostat") if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"needs {', '.join(missing)} (Debian packages util-linux, fio, sysstat)")


def _sysfs_ios(device: str) -> int:
    with open(f"/sys/block/{device}/stat") as handle:
        fields = handle.read().split()
    return int(fields[0]) + int(fields[4])


def _timed_scrape(exporter) -> tuple[float, float, str]:
    start = time.monotonic()
    text = exporter.scrape()
    return start, time.monotonic(), text


def _counters(text: str, device: str) -> dict[str, float]:
    wanted = ("reads_completed", "read_bytes", "read_time_seconds", "writes_completed", "written_bytes",
              "write_time_seconds", "io_time_seconds", "io_time_weighted_seconds")
    samples = parse_samples(text)
    labels = frozenset({("device", device)})
    missing = [name for name in wanted if (f"gpuio_disk_{name}_total", labels) not in samples]
    assert not missing, f"{device} lacks {missing} in the scrape:\n{text[:2000]}"
    return {name: samples[(f"gpuio_disk_{name}_total", labels)] for name in wanted}


def iostat_figures(a: dict[str, float], b: dict[str, float], seconds: float) -> dict[str, float]:
    """iostat -x's figures from two gpuio scrapes ``seconds`` apart (sysstat 12.6 formulas)."""
    d = {name: b[name] - a[name] for name in a}
    return {
        "r/s": d["reads_completed"] / seconds,
        "w/s": d["writes_completed"] / seconds,
        "rkB/s": d["read_bytes"] / 1024 / seconds,
        "wkB/s": d["written_bytes"] / 1024 / seconds,
        "r_await": d["read_time_seconds"] * 1000 / d["reads_completed"] if d["reads_completed"] else 0.0,
        "w_await": d["write_time_seconds"] * 1000 / d["writes_completed"] if d["writes_completed"] else 0.0,
        "aqu-sz": d["io_time_weighted_seconds"] / seconds,
        "util": d["io_time_seconds"] / seconds * 100,
    }


def _iostat_report(output: str, device: str) -> dict[str, float]:
    hosts = json.loads(output)["sysstat"]["hosts"]
    reports = hosts[0]["statistics"]
    assert len(reports) == 1, f"expected one interval report from iostat -y, got {len(reports)}"
    disks = {disk["disk_device"]: disk for disk in reports[0]["disk"]}
    assert device in disks, f"iostat reported {sorted(disks)}, not {device}"
    return {name: float(disks[device][name]) for name in TOLERANCES}


def test_rates_agree_with_iostat_under_fio_load(exporter) -> None:
    _require_tools()
    workdir = tempfile.mkdtemp(prefix="gpuio-iostat-", dir="/var/tmp" if os.path.isdir("/var/tmp") else None)
    backing = os.path.join(workdir, "backing.img")
    loop: str | None = None
    fio: subprocess.Popen | None = None
    iostat: subprocess.Popen | None = None
    fio_log = None
    try:
        loop = direct_io_loop(backing, BACKING_MIB)
        device = os.path.basename(loop)
        with open(f"/sys/block/{device}/loop/dio") as handle:
            dio = handle.read().strip()

        server = exporter("--collector.disable-defaults", "--collector.diskstats",
                          f"--collector.diskstats.device-include=^{device}$")
        _counters(server.scrape(), device)  # warm-up: first-scrape work (sysfs metadata) out of the way

        fio_log = open(os.path.join(workdir, "fio.log"), "w+")  # noqa: SIM115 - closed in finally
        fio = subprocess.Popen(
            ["fio", f"--filename={loop}", "--direct=1", "--ioengine=libaio", "--rw=randrw", "--rwmixread=70",
             "--time_based", f"--runtime={int(SETTLE_S + INTERVAL_S + 15)}", "--norandommap",
             "--randrepeat=0", "--output-format=terse",
             "--name=small", "--bs=4k", "--iodepth=16", f"--rate_iops={SMALL_RATE}",
             "--name=large", "--bs=64k", "--iodepth=4", f"--rate_iops={LARGE_RATE}"],
            stdout=fio_log, stderr=subprocess.STDOUT,
        )
        baseline = _sysfs_ios(device)
        deadline = time.monotonic() + 15
        while _sysfs_ios(device) == baseline:
            if fio.poll() is not None:
                fio_log.seek(0)
                pytest.fail(f"fio exited with {fio.returncode} before doing IO:\n{fio_log.read()}")
            assert time.monotonic() < deadline, "fio did no IO on the loop device within 15 s"
            time.sleep(0.02)
        time.sleep(SETTLE_S)

        a_start, a_end, text_a = _timed_scrape(server)
        spawned = time.monotonic()
        iostat = subprocess.Popen(["iostat", "-x", "-y", "-d", "-o", "JSON", device, str(INTERVAL_S), "1"],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                  env={**os.environ, "LC_ALL": "C", "S_COLORS": "never"})
        output, errors = iostat.communicate(timeout=INTERVAL_S + 10)
        exited = time.monotonic()
        b_start, b_end, text_b = _timed_scrape(server)
        assert iostat.returncode == 0, f"iostat failed ({iostat.returncode}): {errors}"
        assert fio.poll() is None, "fio stopped before the measurement window ended"

        seconds = (b_start + b_end) / 2 - (a_start + a_end) / 2
        ours = iostat_figures(_counters(text_a, device), _counters(text_b, device), seconds)
        theirs = _iostat_report(output, device)

        # Where the two windows' edges can be.  iostat arms its alarm before its first read and reads
        # again when it fires, so its startup before the first read and its exit after the second are
        # each at most (its wall time - interval).
        overhead = (exited - spawned) - INTERVAL_S
        start_mismatch = (spawned - a_start) + max(overhead, 0.0)
        end_mismatch = (b_end - exited) + max(overhead, 0.0)
        print(f"\n{device}: backing {backing} ({BACKING_MIB} MiB, filled), direct IO {dio}, "
              f"fio rate_iops small(4k)={SMALL_RATE} large(64k)={LARGE_RATE}")
        print(f"gpuio window {seconds * 1000:.1f} ms (scrape A {1000 * (a_end - a_start):.1f} ms, "
              f"scrape B {1000 * (b_end - b_start):.1f} ms); iostat interval {INTERVAL_S * 1000} ms, "
              f"process overhead {overhead * 1000:.1f} ms")
        print(f"edge mismatch bounds: start <= {start_mismatch * 1000:.1f} ms "
              f"(iostat spawned {1000 * (spawned - a_end):.1f} ms after scrape A ended), "
              f"end <= {end_mismatch * 1000:.1f} ms "
              f"(scrape B started {1000 * (b_start - exited):.1f} ms after iostat exited)")
        print(f"{'figure':<8} {'gpuio':>12} {'iostat':>12} {'diff':>10} {'rel':>8} {'allowed':>10}")
        failures = []
        for name, (relative, floor) in TOLERANCES.items():
            difference = ours[name] - theirs[name]
            allowed = relative * abs(theirs[name]) + floor
            rel = difference / theirs[name] if theirs[name] else float("nan")
            print(f"{name:<8} {ours[name]:>12.3f} {theirs[name]:>12.2f} {difference:>+10.3f} "
                  f"{rel:>+8.2%} {allowed:>10.3f}")
            if abs(difference) > allowed:
                failures.append(f"{name}: gpuio {ours[name]:.3f} vs iostat {theirs[name]:.2f} "
                                f"(allowed ±{allowed:.3f})")

        # Preconditions for the comparison to mean anything.
        assert start_mismatch < MAX_EDGE_MISMATCH_S and end_mismatch < MAX_EDGE_MISMATCH_S, (
            f"windows not aligned: start {start_mismatch:.3f} s, end {end_mismatch:.3f} s apart")
        assert ours["r/s"] > 0.1 * EXPECTED_READS_PER_S and ours["w/s"] > 0.1 * EXPECTED_WRITES_PER_S, (
            f"fio's load did not reach the loop device: {ours}")
        assert ours["r_await"] > 0 and ours["w_await"] > 0 and ours["util"] > 0, ours
        assert not failures, "gpuio disagrees with iostat -x:\n" + "\n".join(failures)
    finally:
        stop(iostat, timeout=10)
        stop(fio, timeout=10)
        if fio_log is not None:
            fio_log.close()
        if loop:
            subprocess.run(["losetup", "--detach", loop], check=False)
        shutil.rmtree(workdir, ignore_errors=True)
