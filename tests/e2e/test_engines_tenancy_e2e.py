"""Issue 27, findings 3 and 6: one spool writer cannot take the node from the others.

* 3, slots: a writer with 3,000 busy engines held all 200 engine slots (``max-engines``); a real process's
  engine started later was never exported.  The slots are shared among writers now (``fair_share``).
* 3, devices: a flood of device numbers cost a read of the mount table and a walk of /sys/block each, all
  in the scrape.  One table and one index serve every look-up now, at most MAX_DEVICE_LOOKUPS a scrape,
  in the order the engines were chosen: another process's engine keeps its device.
* 6, a planted layer path: a writer names as its overlay layer directory a symlink, in a directory of its
  own, pointing into a mount that never answers (a dead NFS server, a FUSE daemon gone).  The exporter
  followed it by name in the scrape and waited for ever.  Writer paths are walked without following
  anything, in the background, now.

Real processes using the real library (the victim, the busy writer), the hostile writers' files written
with the library's own ``SpoolFile`` by this test process (any process may append any well-framed
record), the real exporter where the point is what /metrics serves.  Work is counted (audit hooks:
what the exporter opens and lists), never timed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator

import pytest

from exporter.collectors import engines
from exporter.context import Context
from exporter.engines.files import MAX_DEVICE_LOOKUPS
from exporter.exposition import render
from exporter.host.blockdev import PathDevices
from gpuio import spool as spool_format
from gpuio.metrics import EngineMetrics
from gpuio.spool import SpoolFile
from tests.conftest import REPO, ExporterProcess, engines_collector, parse_samples
from tests.unit.test_load_waterfall import HungFilesystem

pytestmark = [pytest.mark.e2e]

VICTIM = """
import sys
import gpuio
gpuio.configure({spool!r})
{work}
print("ready", flush=True)
sys.stdin.read()  # hold the spool file until the test closes stdin
"""
LOADS = 'gpuio.load({model!r}, bytes, name="victim")'


def start_victim(spool: str, work: str) -> subprocess.Popen:
    victim = subprocess.Popen([sys.executable, "-c", VICTIM.format(spool=spool, work=work)], cwd=REPO,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert victim.stdout is not None and victim.stdout.readline().strip() == "ready"
    return victim


def stop(process: subprocess.Popen) -> None:
    if process.stdin is not None:
        process.stdin.close()
    process.terminate()
    process.wait(10)


def engines_success(samples: dict) -> float | None:
    return samples.get(("gpuio_scrape_collector_success", frozenset({("collector", "engines")})))


def model_file(root: str) -> tuple[str, str]:
    """A model file on this machine's disk, and the block device the exporter should name for it."""
    model = os.path.join(root, "victim.plan")
    with open(model, "wb") as handle:
        handle.write(os.urandom(1 << 16))
    device = PathDevices().of_path(model).device
    assert device, "this test needs /var/tmp on a block device"
    return model, device


def devices_of(samples: dict, engine: str) -> list[str]:
    return [dict(labels)["device"] for name, labels in samples
            if name == "gpuio_engine_info" and dict(labels)["engine"] == engine]


@pytest.fixture
def root() -> Iterator[str]:
    directory = tempfile.mkdtemp(dir="/var/tmp")  # a real disk: files here have a real st_dev
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


# --- 3: the engine slots ---------------------------------------------------------------------------------

BUSY = """
import sys, threading, time
import gpuio
gpuio.configure({spool!r}, file_bytes=8 << 20)
engines = [gpuio.engine(f"junk-{{index:04d}}") for index in range({count})]
for engine in engines:
    engine.inference_seconds.observe(0.01)
print("ready", flush=True)
threading.Thread(target=lambda: (sys.stdin.read(), gpuio.close(), sys.exit()), daemon=True).start()
while True:  # every engine busy: its counters move between any two scrapes
    for engine in engines:
        engine.inference_seconds.observe(0.01)
    time.sleep(0.1)
"""


def test_a_writer_with_3000_busy_engines_leaves_a_slot_for_another_processes_engine(root: str) -> None:
    spool = os.path.join(root, "spool")
    os.mkdir(spool)
    model, device = model_file(root)
    busy = subprocess.Popen([sys.executable, "-c", BUSY.format(spool=spool, count=3000)], cwd=REPO,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    exporter = ExporterProcess([f"--collector.engines.spool-dir={spool}",
                                "--collector.engines.max-file-bytes=8388608"])
    victim = None
    try:
        assert busy.stdout is not None and busy.stdout.readline().strip() == "ready"
        exporter.start()
        for _ in range(2):  # the busy engines are seen moving: they rank first (moved recently)
            exporter.scrape()
        victim = start_victim(spool, LOADS.format(model=model))
        for _ in range(3):
            samples = parse_samples(exporter.scrape())
            exported = {dict(labels)["engine"] for name, labels in samples if name == "gpuio_engine_processes"}
            if "victim" in exported:
                break
        assert engines_success(samples) == 1
        assert "victim" in exported, "the busy writer held every engine slot"
        assert devices_of(samples, "victim") == [device]
        assert len(exported) == 200  # the busy writer keeps the other 199
        assert samples[("gpuio_engine_dropped_series_total", frozenset({("kind", "engine")}))] >= 1
    finally:
        if victim is not None:
            stop(victim)
        stop(busy)
        exporter.stop()


# --- 3: a flood of device numbers --------------------------------------------------------------------------


def _sysfs(root: str, numbers: dict[tuple[int, int], str]) -> str:
    """/sys/dev/block/MAJ:MIN links to /sys/block/<name>, as the kernel makes them."""
    sysfs = os.path.join(root, "sys")
    os.makedirs(os.path.join(sysfs, "dev", "block"))
    for (major, minor), name in numbers.items():
        os.makedirs(os.path.join(sysfs, "block", name), exist_ok=True)
        os.symlink(f"../../block/{name}", os.path.join(sysfs, "dev", "block", f"{major}:{minor}"))
    return sysfs


class Work:
    """What the exporter reads to resolve devices, counted by an audit hook (Python raises an audit event
    for every open() and os.listdir()): reads of the host's mount table, walks of /sys/block."""

    hooked = False
    current: Work | None = None

    def __init__(self, mountinfo: str, block: str) -> None:
        self.mountinfo, self.block = mountinfo, block
        self.mountinfo_reads = self.sysfs_walks = 0
        if not Work.hooked:  # an audit hook cannot be removed: one for the whole session, told what to count
            sys.addaudithook(Work._event)
            Work.hooked = True
        Work.current = self

    @staticmethod
    def _event(event: str, args: tuple) -> None:
        work = Work.current
        if work is None or not args:
            return
        if event == "open" and args[0] == work.mountinfo:
            work.mountinfo_reads += 1
        elif event == "os.listdir" and args[0] == work.block:
            work.sysfs_walks += 1

    def take(self) -> tuple[int, int]:
        counts = (self.mountinfo_reads, self.sysfs_walks)
        self.mountinfo_reads = self.sysfs_walks = 0
        return counts

    def stop(self) -> None:
        Work.current = None


JUNK_WRITERS = 8
JUNK_ENGINES = 50  # per writer: 400 engines, each naming a device number of its own


def test_a_flood_of_device_numbers_costs_a_bounded_scrape_and_never_the_victims_device(root: str) -> None:
    """400 engines of junk writers, each naming a device number of its own (every one a block device of
    this sysfs), beside a real process's engine loaded from a file on this disk.  Before: each number
    cost a read of the whole mount table and a walk of /sys/block, in the scrape (400 of each at the
    first scrape; with a big node's mount table, past the 2 s collector budget).  Now: one table and one
    index, at most MAX_DEVICE_LOOKUPS look-ups a scrape, the victim's first."""
    spool = os.path.join(root, "spool")
    os.mkdir(spool)
    model, _ = model_file(root)
    st = os.stat(model)
    victim_dev = (os.major(st.st_dev), os.minor(st.st_dev))
    junk_numbers = [(8, 1000 + index) for index in range(JUNK_WRITERS * JUNK_ENGINES)]
    sysfs = _sysfs(root, {victim_dev: "vda", **dict.fromkeys(junk_numbers, "sda")})
    procfs = os.path.join(root, "proc")
    os.makedirs(os.path.join(procfs, "1"))
    shutil.copy("/proc/self/mountinfo", os.path.join(procfs, "1", "mountinfo"))
    victim = start_victim(spool, LOADS.format(model=model))
    writers = []
    collector = engines.EnginesCollector(Context(procfs, sysfs, "/"), {"spool-dir": spool, "max-engines": 500})
    work = Work(os.path.join(procfs, "1", "mountinfo"), os.path.join(sysfs, "block"))
    try:
        for writer in range(JUNK_WRITERS):
            file = SpoolFile(spool, 1 << 20)
            writers.append(file)
            for index in range(JUNK_ENGINES):
                number = junk_numbers[writer * JUNK_ENGINES + index]
                metrics = EngineMetrics(f"junk-{writer}-{index:02d}", file)
                metrics.inference_seconds.observe(0.01)
                metrics._append_info(spool_format.pack_info(0, number, 7, 4096, 1, 1.0,
                                                            f"/models/junk-{number[1]}.plan", "", "tensorrt"))
        work.take()
        junk_with_device = []
        for _ in range(3):
            samples = parse_samples(render(collector.collect()))
            mountinfo_reads, sysfs_walks = work.take()
            devices = {dict(labels)["engine"]: dict(labels)["device"] for name, labels in samples
                       if name == "gpuio_engine_info"}
            assert devices["victim"] == "vda"
            assert len(devices) == 1 + JUNK_WRITERS * JUNK_ENGINES  # every engine is shown
            junk_with_device.append(sum(1 for engine, device in devices.items() if engine != "victim" and device))
            # The host's mount table: opened once, by the reader the device look-ups and the mount of each
            # file share, and not again while it does not change; sysfs's index of block devices once.
            # Before: 400 times each at the first scrape.
            assert mountinfo_reads <= 1 and sysfs_walks <= 1, (mountinfo_reads, sysfs_walks)
        # The budget of the first scrape went to the victim first, the rest of the junk came next scrape.
        assert junk_with_device == [MAX_DEVICE_LOOKUPS - 1] + [JUNK_WRITERS * JUNK_ENGINES] * 2
    finally:
        work.stop()
        stop(victim)
        for file in writers:
            file.close()


# --- 6: a planted layer path ---------------------------------------------------------------------------


def planted_writer(spool: str, root: str, target: str) -> SpoolFile:
    """A writer whose engine file is in its container image (a st_dev no host mount has) and whose MOUNT
    record names as the overlay layer directory a symlink in a directory of its own (its emptyDir)
    pointing at ``target``."""
    empty_dir = os.path.join(root, "pods", "7f3c", "volumes", "kubernetes.io~empty-dir", "scratch")
    os.makedirs(empty_dir)
    planted = os.path.join(empty_dir, "layer")
    os.symlink(target, planted)
    hostile = SpoolFile(spool)
    dev = (0, 4242)
    with hostile.lock:
        hostile.add_record(spool_format.KIND_ENGINE, "planted", spool_format.ENGINE_LAYOUT.size * 8)
        info = spool_format.pack_info(0, dev, 7, 4096, 1, 1.0, "/opt/model/planted.engine", "", "tensorrt")
        hostile.add_record(spool_format.KIND_INFO, "planted", len(info), info)
        mount = spool_format.pack_mount("/", "overlay", "overlay", planted)
        hostile.add_record(spool_format.KIND_MOUNT, f"planted\0{dev[0]}:{dev[1]}", len(mount), mount)
    return hostile


def test_a_layer_symlink_into_a_mount_that_never_answers_does_not_hold_the_scrape(root: str) -> None:
    spool = os.path.join(root, "spool")
    os.mkdir(spool)
    hung = HungFilesystem()
    hostile = planted_writer(spool, root, os.path.join(hung.mountpoint, "snapshots", "7", "fs"))
    model, device = model_file(root)
    victim = start_victim(spool, LOADS.format(model=model))
    exporter = ExporterProcess([f"--collector.engines.spool-dir={spool}"])
    try:
        exporter.start()
        for _ in range(3):  # and again: no collector thread left waiting on the mount
            samples = parse_samples(exporter.scrape())
            assert engines_success(samples) == 1, "the engines collector waited on the writer's path"
            assert devices_of(samples, "victim") == [device]
            assert devices_of(samples, "planted") == [""]
    finally:
        stop(victim)
        exporter.stop()
        hung.release()
        hostile.close()


def test_a_layer_symlink_into_a_mount_that_never_answers_in_a_one_shot_scrape(root: str) -> None:
    """Where the samplers do not run (``gpuio engines``), the layer walk is made in the scrape: it must
    not follow the planted link either."""
    spool = os.path.join(root, "spool")
    os.mkdir(spool)
    hung = HungFilesystem()
    hostile = planted_writer(spool, root, os.path.join(hung.mountpoint, "snapshots", "7", "fs"))
    model, device = model_file(root)
    victim = start_victim(spool, LOADS.format(model=model))
    try:
        collector = engines_collector(spool)
        scraped: list[str] = []
        scrape = threading.Thread(target=lambda: scraped.append(render(collector.collect())), daemon=True)
        scrape.start()
        scrape.join(20)  # not a timing: a scrape that follows the link waits until the mount is aborted
        hanging = scrape.is_alive()
    finally:
        hung.release()
        stop(victim)
        hostile.close()
    assert not hanging, "the scrape followed the writer's symlink into the hung mount"
    samples = parse_samples(scraped[0])
    assert devices_of(samples, "victim") == [device] and devices_of(samples, "planted") == [""]
