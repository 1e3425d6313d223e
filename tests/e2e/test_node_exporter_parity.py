"""Parity: Debian's prometheus-node-exporter on the same fixture procfs, every shared device and metric equal.

For each kernel tree, node_exporter (only its diskstats and pressure collectors) and gpuio-exporter are
started on the same --path.procfs/--path.sysfs and scraped over HTTP.  Then:

* both name the same devices, and exactly the devices of the fixture's /proc/diskstats that the device
  exclude regex lets through (gpuio's default, handed to node_exporter explicitly: Debian 1.5's default
  predates zram in it);
* for every ``gpuio_disk_<suffix>`` of diskstats.DESCS, ``node_disk_<suffix>`` has the same series and
  the same float64 value (``==``, not approx); a series is present in both or in neither, and each
  device has as many series as its diskstats line has fields (11, 15 or 17);
* every ``node_pressure_*`` series equals its ``gpuio_pressure_*`` twin; gpuio's only extra pressure
  series are the ones node_exporter 1.5 does not export (irq).

node_disk_info is not compared: node_exporter fills its labels from udev, gpuio from sysfs.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families

from exporter.collectors.diskstats import DEFAULT_EXCLUDE, DESCS
from tests.conftest import KERNELS, REPO, Samples, free_port, parse_samples, root

pytestmark = pytest.mark.e2e

NODE_EXPORTER = shutil.which("prometheus-node-exporter") or shutil.which("node_exporter")
SUFFIXES = tuple(desc.name.removeprefix("gpuio_disk_") for desc in DESCS)
SERIES_PER_LINE = {11: 11, 15: 15, 17: 17}  # stats on a diskstats line -> series exported for the device
# gpuio exports this; node_exporter 1.5 does not know it yet (irq since 6.1).
GPUIO_ONLY_PRESSURE = {"irq_stalled_seconds_total"}
# Floors on the number of compared samples (disk + pressure): the test cannot pass by comparing nothing.
MIN_COMPARED = {"linux-4.14": 99, "linux-5.4": 110, "linux-6.8": 124}


def expected_devices(procfs: str) -> dict[str, int]:
    """Device -> number of series it should have, read from the fixture independently of both exporters."""
    exclude = re.compile(DEFAULT_EXCLUDE)
    expected: dict[str, int] = {}
    with open(os.path.join(procfs, "diskstats")) as handle:
        for line in handle:
            parts = line.split()
            if len(parts) < 3 or exclude.search(parts[2]):
                continue
            expected[parts[2]] = SERIES_PER_LINE[len(parts) - 3]
    return expected


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as response:
        assert response.status == 200
        return response.read().decode()


@pytest.fixture
def node_exporter() -> Iterator[callable]:
    """``node_exporter(procfs, sysfs)`` starts Debian's node_exporter and returns its /metrics URL."""
    if NODE_EXPORTER is None:
        pytest.skip("prometheus-node-exporter is not installed (CI installs it: make system-deps)")
    started: list[subprocess.Popen] = []

    def start(procfs: str, sysfs: str) -> str:
        port = free_port()
        process = subprocess.Popen(
            [NODE_EXPORTER, "--collector.disable-defaults", "--collector.diskstats", "--collector.pressure",
             f"--path.procfs={procfs}", f"--path.sysfs={sysfs}", f"--web.listen-address=127.0.0.1:{port}",
             f"--collector.diskstats.device-exclude={DEFAULT_EXCLUDE}",
             # A path that does not exist: the host's /run/udev/data must not leak into the run.
             f"--path.udev.data={os.path.join(os.path.dirname(procfs), 'run', 'udev', 'data')}"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
        )
        started.append(process)
        url = f"http://127.0.0.1:{port}/metrics"
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"node_exporter exited {process.returncode}: {process.stdout.read()}")
            try:
                scrape(url)
                return url
            except (OSError, urllib.error.URLError):
                time.sleep(0.05)
        raise RuntimeError("node_exporter did not answer /metrics in 20 s")

    yield start
    for process in started:
        if process.poll() is None:
            process.terminate()
            try:
                process.communicate(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.communicate()


def family_types(text: str, prefix: str) -> dict[str, str]:
    """Family name without ``prefix`` -> its TYPE, for the families under ``prefix``."""
    return {f.name[len(prefix):]: f.type for f in text_string_to_metric_families(text) if f.name.startswith(prefix)}


def disk_series(samples: Samples, prefix: str) -> dict[tuple[str, str], float]:
    """(suffix, device) -> value of the diskstats counters and gauges (not *_info) under ``prefix``."""
    found: dict[tuple[str, str], float] = {}
    for (name, labels), value in samples.items():
        suffix = name[len(prefix):]
        if name.startswith(prefix) and suffix in SUFFIXES:
            assert dict(labels).keys() == {"device"}, (name, labels)
            found[(suffix, dict(labels)["device"])] = value
    return found


def pressure_series(samples: Samples, prefix: str) -> dict[str, float]:
    found = {}
    for (name, labels), value in samples.items():
        if name.startswith(prefix):
            assert not labels, (name, labels)
            found[name[len(prefix):]] = value
    return found


@pytest.mark.parametrize("kernel", KERNELS)
def test_diskstats_and_pressure_equal_node_exporter(kernel, exporter, node_exporter) -> None:
    procfs, sysfs = root(kernel)
    node_text = scrape(node_exporter(procfs, sysfs))
    gpuio_text = exporter(f"--path.procfs={procfs}", f"--path.sysfs={sysfs}").scrape()
    node, gpuio = parse_samples(node_text), parse_samples(gpuio_text)

    # Both collectors worked on both sides (a failed collector would make the comparison vacuous).
    for collector in ("diskstats", "pressure"):
        assert gpuio[("gpuio_scrape_collector_success", frozenset({("collector", collector)}))] == 1
    assert node[("node_scrape_collector_success", frozenset({("collector", "diskstats")}))] == 1

    # --- diskstats ------------------------------------------------------------------------------
    node_disk = disk_series(node, "node_disk_")
    gpuio_disk = disk_series(gpuio, "gpuio_disk_")
    expected = expected_devices(procfs)

    node_devices = {device for _, device in node_disk}
    gpuio_devices = {device for _, device in gpuio_disk}
    assert gpuio_devices == node_devices, (
        f"only gpuio: {sorted(gpuio_devices - node_devices)}, "
        f"only node_exporter: {sorted(node_devices - gpuio_devices)}"
    )
    assert gpuio_devices == set(expected), "devices differ from the fixture's diskstats after the exclude regex"
    # node_disk_info names the same devices as the counters (its labels are not compared).
    node_info = {dict(labels)["device"] for name, labels in node if name == "node_disk_info"}
    gpuio_info = {dict(labels)["device"] for name, labels in gpuio if name == "gpuio_disk_info"}
    assert gpuio_info == node_info == set(expected)

    # Present/absent together, and as many series per device as its line has fields.
    assert set(gpuio_disk) == set(node_disk), (
        f"only gpuio: {sorted(set(gpuio_disk) - set(node_disk))}, "
        f"only node_exporter: {sorted(set(node_disk) - set(gpuio_disk))}"
    )
    for device, series in expected.items():
        present = [suffix for suffix in SUFFIXES if (suffix, device) in gpuio_disk]
        assert present == list(SUFFIXES[:series]), f"{device}: expected the first {series} fields, got {present}"

    mismatches = [
        f"{suffix}{{device={device!r}}}: gpuio {gpuio_disk[(suffix, device)]!r} != node {value!r}"
        for (suffix, device), value in sorted(node_disk.items())
        if gpuio_disk[(suffix, device)] != value
    ]
    assert not mismatches, "\n".join(mismatches)

    # --- pressure -------------------------------------------------------------------------------
    node_pressure = pressure_series(node, "node_pressure_")
    gpuio_pressure = pressure_series(gpuio, "gpuio_pressure_")
    has_psi = os.path.isdir(os.path.join(procfs, "pressure"))
    assert bool(node_pressure) == has_psi and bool(gpuio_pressure) == has_psi
    missing = set(node_pressure) - set(gpuio_pressure)
    assert not missing, f"node_exporter has pressure series gpuio lacks: {sorted(missing)}"
    assert set(gpuio_pressure) - set(node_pressure) <= GPUIO_ONLY_PRESSURE
    mismatches = [
        f"pressure {suffix}: gpuio {gpuio_pressure[suffix]!r} != node {value!r}"
        for suffix, value in sorted(node_pressure.items())
        if gpuio_pressure[suffix] != value
    ]
    assert not mismatches, "\n".join(mismatches)

    # --- the shared families have the same TYPE -------------------------------------------------
    for area in ("disk_", "pressure_") if has_psi else ("disk_",):
        node_types, gpuio_types = family_types(node_text, "node_" + area), family_types(gpuio_text, "gpuio_" + area)
        shared = set(node_types) & set(gpuio_types)
        assert len(shared) >= (11 if area == "disk_" else 5), (area, shared)
        assert {n: gpuio_types[n] for n in shared} == {n: node_types[n] for n in shared}

    # --- not vacuous ----------------------------------------------------------------------------
    compared = len(node_disk) + len(node_pressure)
    assert len(node_disk) == sum(expected.values())
    assert compared >= MIN_COMPARED[kernel], f"only {compared} samples compared"
