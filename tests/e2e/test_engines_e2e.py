"""An engine load from a real disk, as the exporter shows it: disk seconds and bytes, device, residency.

Setup: a 256 MiB backing file written in full (a sparse file's holes never reach a disk), attached
with ``losetup --direct-io=on`` so every read of the loop device goes to the disk underneath,
formatted ext4 and mounted.  A 64 MiB "engine" is written there, synced, and evicted from the page
cache (POSIX_FADV_DONTNEED; cachestat confirms 0 %).

A real inference process (a subprocess importing gpuio) loads it through the generic
loader path, warms a pool and serves a few inferences; the real exporter (HTTP) serves the engines
collector and diskstats for the loop device.  The test checks that the load's bytes are the file's,
that the loop device really read at least that much during the load (the disk did the work), that
the engine's device is the loop device and its residency went from 0 to 1.  A second load, with half
of the file evicted on purpose right before it, reads that half from the disk and the rest from the
page cache: the load's own device reads (/proc/thread-self/io) are the bytes cachestat found missing
just before it, whatever the machine's memory pressure did in between.  No timing is compared.
Finally the process is SIGKILLed: its counters stay.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable, Iterator

import pytest

from exporter.host import pagecache
from tests.conftest import REPO, ExporterProcess, Samples, parse_samples

pytestmark = [pytest.mark.e2e, pytest.mark.root]

BACKING_MIB = 256
ENGINE_MIB = 64


@pytest.fixture
def loop_mount() -> Iterator[tuple[str, str]]:
    """``(loop device name, mount point)`` of a fresh ext4 on a direct-IO loop device."""
    if os.geteuid() != 0:
        pytest.skip("loop devices need root")
    if shutil.which("losetup") is None or shutil.which("mkfs.ext4") is None:
        pytest.skip("losetup and mkfs.ext4 are needed")
    work = tempfile.mkdtemp(prefix="gpuio-engines-e2e-")
    backing = os.path.join(work, "backing.img")
    with open(backing, "wb") as handle:
        block = b"\0" * (1 << 20)
        for _ in range(BACKING_MIB):
            handle.write(block)
        os.fsync(handle.fileno())
    device = subprocess.run(["losetup", "--find", "--show", "--direct-io=on", backing], check=True,
                            capture_output=True, text=True).stdout.strip()
    mount_point = os.path.join(work, "mnt")
    os.mkdir(mount_point)
    try:
        subprocess.run(["mkfs.ext4", "-q", "-E", "lazy_itable_init=0,lazy_journal_init=0", device], check=True)
        subprocess.run(["mount", device, mount_point], check=True)
        yield os.path.basename(device), mount_point
    finally:
        subprocess.run(["umount", mount_point], check=False)
        subprocess.run(["losetup", "-d", device], check=False)
        shutil.rmtree(work, ignore_errors=True)


INFERENCE = textwrap.dedent("""
    import hashlib, json, os, sys, time
    sys.path.insert(0, {repo!r})
    import gpuio
    from exporter.host import pagecache

    gpuio.configure({spool!r})

    def device_read_bytes():
        # What this thread made the block layer read (the kernel's per-task IO accounting): page-cache
        # hits do not count, so around a load it is the bytes that came off the disk.
        with open("/proc/thread-self/io") as handle:
            return int(next(line for line in handle if line.startswith("read_bytes:")).split()[1])

    def load():
        # The part of the file the page cache lacks, right before the load: what it may have to read.
        uncached = os.stat({engine!r}).st_size - pagecache.residency({engine!r}).cached_bytes
        before = device_read_bytes()
        loaded = gpuio.load({engine!r}, lambda data: hashlib.sha256(data).hexdigest())
        print(json.dumps({{"read_seconds": loaded.read_seconds, "bytes": loaded.bytes_read,
                           "deserialize_seconds": loaded.deserialize_seconds,
                           "uncached_bytes": uncached, "device_bytes": device_read_bytes() - before}}), flush=True)
        return loaded

    loaded = load()
    pool = gpuio.EnginePool(loaded.metrics, create=object, size=2, warmup=lambda c: time.sleep(0.01))
    for _ in range(20):
        pool.run(lambda context: time.sleep(0.002), batch_size=4)
    print("ready", flush=True)
    for line in sys.stdin:
        if line.strip() == "reload":
            load()
""")

# What a load may read beyond the bytes the page cache lacked: readahead past a missing page's
# neighbours and the filesystem's metadata.  Small next to the 32 MiB the warm load must read.
DEVICE_SLACK = 2 << 20


def assert_read_only_what_was_missing(load: dict, what: str) -> None:
    """The load's own device reads are the non-resident part of the file, to within DEVICE_SLACK: the
    cached part came from the page cache, the missing part from the disk (so the counter is live)."""
    low, high = load["uncached_bytes"] - DEVICE_SLACK, load["uncached_bytes"] + DEVICE_SLACK
    assert low <= load["device_bytes"] <= high, (
        f"{what}: read {load['device_bytes']} bytes from the device, {load['uncached_bytes']} were not cached")


def wait_for(scrape: Callable[[], Samples], condition: Callable[[Samples], bool], timeout: float = 10.0) -> Samples:
    deadline = time.monotonic() + timeout
    while True:
        samples = scrape()
        if condition(samples) or time.monotonic() > deadline:
            return samples
        time.sleep(0.1)


def test_engine_load_from_a_real_disk(loop_mount, tmp_path) -> None:
    loop, mount_point = loop_mount
    engine_path = os.path.join(mount_point, "detector.engine")
    with open(engine_path, "wb") as handle:
        handle.write(os.urandom(ENGINE_MIB << 20))
        os.fsync(handle.fileno())
    fd = os.open(engine_path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
    assert pagecache.residency(engine_path).cached_bytes == 0
    spool = tmp_path / "spool"
    spool.mkdir()
    exporter = ExporterProcess([
        f"--collector.engines.spool-dir={spool}", f"--collector.engines.path={mount_point}/*.engine",
        "--collector.engines.residency-interval=200ms", f"--collector.diskstats.device-include=^{loop}$",
    ]).start()
    try:
        run_scenario(exporter, loop, engine_path, str(spool))
    finally:
        exporter.stop()


def run_scenario(exporter: ExporterProcess, loop: str, engine_path: str, spool: str) -> None:
    def scrape() -> Samples:
        return parse_samples(exporter.scrape())

    file_labels = frozenset({("engine", "detector"), ("path", engine_path)})
    engine = frozenset({("engine", "detector")})
    on_gpu = frozenset({("engine", "detector"), ("gpu_uuid", "")})  # the process names no GPU here
    disk = frozenset({("device", loop)})
    before = wait_for(scrape, lambda s: ("gpuio_engine_file_cached_ratio", file_labels) in s)
    assert before[("gpuio_engine_file_cached_ratio", file_labels)] == 0.0
    disk_before = before[("gpuio_disk_read_bytes_total", disk)]

    process = subprocess.Popen([sys.executable, "-c", INFERENCE.format(repo=REPO, spool=spool, engine=engine_path)],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert process.stdin is not None and process.stdout is not None
    try:
        cold = json.loads(process.stdout.readline())
        assert process.stdout.readline().strip() == "ready"
        after = wait_for(scrape, lambda s: s.get(("gpuio_engine_file_cached_ratio", file_labels)) == 1.0
                         and s.get(("gpuio_engine_processes", engine | {("source", "spool")})) == 1)
        disk_read = after[("gpuio_disk_read_bytes_total", disk)] - disk_before
        print(f"\ncold load of {ENGINE_MIB} MiB from {loop} (direct IO): read {cold['read_seconds']:.3f} s "
              f"({ENGINE_MIB / cold['read_seconds']:.0f} MiB/s), deserialize {cold['deserialize_seconds']:.3f} s; "
              f"{loop} read {disk_read / 2**20:.1f} MiB meanwhile")
        assert cold["bytes"] == ENGINE_MIB << 20
        assert after[("gpuio_engine_load_read_bytes_total", engine)] == ENGINE_MIB << 20
        assert after[("gpuio_engine_load_read_seconds_sum", engine)] == pytest.approx(cold["read_seconds"])
        assert after[("gpuio_engine_load_read_seconds_count", engine)] == 1
        assert disk_read >= ENGINE_MIB << 20, "the load must have come off the disk"
        assert_read_only_what_was_missing(cold, "cold load")
        assert after[("gpuio_engine_inference_seconds_count", on_gpu)] == 20
        assert after[("gpuio_engine_pool_contexts", on_gpu)] == 2
        assert after[("gpuio_engine_warmup_seconds_count", engine)] == 2
        info = [dict(labels) for name, labels in after
                if name == "gpuio_engine_info" and ("runtime", "generic") in labels]
        assert [(i["device"], i["path"]) for i in info] == [(loop, engine_path)]
        physical = {dict(labels)["physical_device"] for name, labels in after
                    if name == "gpuio_engine_physical_device_info" and ("path", engine_path) in labels}
        assert physical == {loop}

        # The warm load.  Whatever the machine's memory pressure did to the page cache since the cold load
        # (a memory cgroup may evict a file within minutes), the file is made resident again here and then
        # half of it is evicted on purpose: the load must read that half from the disk and the other half
        # from the page cache, as measured by the kernel's counters right before and during the load.
        with open(engine_path, "rb", buffering=0) as handle:
            while handle.read(4 << 20):
                pass
            half = (ENGINE_MIB << 20) // 2
            os.posix_fadvise(handle.fileno(), half, half, os.POSIX_FADV_DONTNEED)
        before_warm = scrape()
        process.stdin.write("reload\n")
        process.stdin.flush()
        warm = json.loads(process.stdout.readline())
        again = wait_for(scrape, lambda s: s.get(("gpuio_engine_load_read_seconds_count", engine)) == 2)
        disk_read_warm = (again[("gpuio_disk_read_bytes_total", disk)]
                          - before_warm[("gpuio_disk_read_bytes_total", disk)])
        print(f"warm load: {warm['uncached_bytes'] / 2**20:.1f} of {ENGINE_MIB} MiB not cached right before it; "
              f"it read {warm['device_bytes'] / 2**20:.1f} MiB from the device; {loop} read "
              f"{disk_read_warm / 2**20:.1f} MiB")
        assert warm["uncached_bytes"] <= (ENGINE_MIB << 20) * 3 // 4, "the half made resident a moment ago is gone"
        assert_read_only_what_was_missing(warm, "warm load")
        assert disk_read_warm <= warm["uncached_bytes"] + DEVICE_SLACK  # nobody else read the cached half either
        assert again[("gpuio_engine_load_read_bytes_total", engine)] == 2 * (ENGINE_MIB << 20)
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait()
    gone = wait_for(scrape, lambda s: s.get(("gpuio_engine_processes", engine | {("source", "spool")})) == 0)
    assert gone[("gpuio_engine_load_read_bytes_total", engine)] == 2 * (ENGINE_MIB << 20)  # folded, not lost
    assert gone[("gpuio_engine_inference_seconds_count", on_gpu)] == 20
    assert gone[("gpuio_engine_spool_folded_processes_total", frozenset())] == 1
    assert os.listdir(spool) == []


LOADING = textwrap.dedent("""
    import sys
    sys.path.insert(0, {repo!r})
    import gpuio
    gpuio.configure({spool!r})
    with gpuio.LoadTimer("detector", {engine!r}, gpu_uuid="GPU-e2e0") as timer:
        with open({engine!r}, "rb", buffering=0) as handle:
            half = handle.read({half})
            timer.add_bytes(len(half))
            print("half", flush=True)
            sys.stdin.readline()  # blocked mid-read until the test says go
            rest = handle.read()
            timer.add_bytes(len(rest))
    print("loaded", flush=True)
    sys.stdin.readline()
""")


def test_a_load_in_progress_is_seen_while_it_happens(loop_mount, tmp_path) -> None:
    """A real process blocked half-way through reading its engine from a real disk: the exporter shows
    one load in progress for the engine and GPU, on the loop device and on its mount point, its bytes
    so far and an age that grows, and the engine's info (disk, GPU) already; after the load, zeros."""
    loop, mount_point = loop_mount
    engine_path = os.path.join(mount_point, "detector.engine")
    with open(engine_path, "wb") as handle:
        handle.write(os.urandom(8 << 20))
        os.fsync(handle.fileno())
    spool = tmp_path / "spool"
    spool.mkdir()
    exporter = ExporterProcess([f"--collector.engines.spool-dir={spool}",
                                f"--collector.diskstats.device-include=^{loop}$"]).start()
    script = LOADING.format(repo=REPO, spool=str(spool), engine=engine_path, half=4 << 20)
    process = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               text=True)
    assert process.stdin is not None and process.stdout is not None

    def scrape() -> Samples:
        return parse_samples(exporter.scrape())

    pair = frozenset({("engine", "detector"), ("gpu_uuid", "GPU-e2e0")})
    disk, mount = frozenset({("device", loop)}), frozenset({("mountpoint", mount_point)})
    try:
        assert process.stdout.readline().strip() == "half"
        first = scrape()
        assert first[("gpuio_engine_loads_in_progress", pair)] == 1
        assert first[("gpuio_engine_load_in_progress_read_bytes", pair)] == 4 << 20
        assert first[("gpuio_disk_engine_loads_in_progress", disk)] == 1
        assert first[("gpuio_mount_engine_loads_in_progress", mount)] == 1
        info = [dict(labels) for name, labels in first if name == "gpuio_engine_info"]
        assert [(i["device"], i["gpu_uuid"], i["path"]) for i in info] == [(loop, "GPU-e2e0", engine_path)]
        mounts = [dict(labels) for name, labels in first if name == "gpuio_engine_mount_info"]
        assert [(m["mountpoint"], m["fstype"], m["source"]) for m in mounts] == [
            (mount_point, "ext4", f"/dev/{loop}")]
        time.sleep(1.5)
        second = scrape()
        grown = (second[("gpuio_engine_load_oldest_in_progress_seconds", pair)]
                 - first[("gpuio_engine_load_oldest_in_progress_seconds", pair)])
        print(f"\noldest load in progress: {first[('gpuio_engine_load_oldest_in_progress_seconds', pair)]:.2f} s, "
              f"then {second[('gpuio_engine_load_oldest_in_progress_seconds', pair)]:.2f} s")
        assert grown >= 1.4
        assert second[("gpuio_disk_engine_load_oldest_in_progress_seconds", disk)] >= 1.4
        assert second[("gpuio_mount_engine_load_oldest_in_progress_seconds", mount)] >= 1.4

        process.stdin.write("go\n")
        process.stdin.flush()
        assert process.stdout.readline().strip() == "loaded"
        done = scrape()
        for name, labels in (("gpuio_engine_loads_in_progress", pair),
                             ("gpuio_engine_load_in_progress_read_bytes", pair),
                             ("gpuio_engine_load_oldest_in_progress_seconds", pair),
                             ("gpuio_disk_engine_loads_in_progress", disk),
                             ("gpuio_disk_engine_load_oldest_in_progress_seconds", disk),
                             ("gpuio_mount_engine_loads_in_progress", mount)):
            assert done[(name, labels)] == 0, name
        assert done[("gpuio_engine_load_read_bytes_total", frozenset({("engine", "detector")}))] == 8 << 20
    finally:
        process.kill()
        process.wait()
        exporter.stop()


SERVING = textwrap.dedent("""
    import sys
    sys.path.insert(0, {repo!r})
    import gpuio
    gpuio.configure({spool!r})
    metrics = gpuio.engine("ranker")
    metrics.set_info({engine!r}, {device}, {uuid!r})
    pool = gpuio.EnginePool(metrics, create=object, size=2)
    if {busy}:
        with pool.acquire(), metrics.infer():
            print("ready", flush=True)
            sys.stdin.readline()
    print("ready", flush=True)
    sys.stdin.readline()
""")


def test_two_replicas_of_one_engine_on_two_gpus_are_judged_apart(tmp_path) -> None:
    """Two real processes serve one engine, on GPU 0 (a request in flight) and GPU 1 (a drained spare):
    the spare's in-flight series is 0, not the busy replica's 1."""
    engine_path = str(tmp_path / "ranker.engine")
    with open(engine_path, "wb") as handle:
        handle.write(b"\0" * 4096)
    spool = tmp_path / "spool"
    spool.mkdir()
    exporter = ExporterProcess([f"--collector.engines.spool-dir={spool}"]).start()
    processes = [subprocess.Popen([sys.executable, "-c", SERVING.format(repo=REPO, spool=str(spool), engine=engine_path,
                                                                          device=device, uuid=uuid, busy=busy)],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                 for device, uuid, busy in ((0, "GPU-busy", True), (1, "GPU-spare", False))]
    try:
        for process in processes:
            assert process.stdout is not None and process.stdout.readline().strip() == "ready"
        samples = parse_samples(exporter.scrape())
        in_flight = {dict(labels)["gpu_uuid"]: value for (name, labels), value in samples.items()
                     if name == "gpuio_engine_inferences_in_flight"}
        idle = {dict(labels)["gpu_uuid"]: value for (name, labels), value in samples.items()
                if name == "gpuio_engine_pool_idle_contexts"}
        assert in_flight == {"GPU-busy": 1, "GPU-spare": 0}
        assert idle == {"GPU-busy": 1, "GPU-spare": 2}
    finally:
        for process in processes:
            process.kill()
            process.wait()
        exporter.stop()
