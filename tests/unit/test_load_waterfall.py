"""The waterfall of a load: phases, device vs page-cache bytes, class, residency at the start, the
writer's mount; the spool record, its reader, and the exporter's families and prediction.

Real files on this machine's disk (/var/tmp is ext4 on a virtio disk), evicted with posix_fadvise."""

from __future__ import annotations

import ctypes
import os
import shutil
import struct
import tempfile
import threading
from collections.abc import Iterator

import pytest

import gpuio
from exporter.engines import model, parse
from exporter.engines import spool as spool_source
from exporter.exposition import render
from gpuio import spool as spool_format
from gpuio import waterfall
from gpuio.spool import SpoolFile
from tests.conftest import engines_collector, evict

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures", "mounts", "writer")


@pytest.fixture
def model_file() -> Iterator[str]:
    directory = tempfile.mkdtemp(dir="/var/tmp")  # a real disk (pytest's tmp_path may be tmpfs elsewhere)
    path = os.path.join(directory, "waterfall.bin")
    with open(path, "wb") as handle:
        handle.write(os.urandom(8 << 20))
    yield path
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def spool() -> Iterator[str]:
    directory = tempfile.mkdtemp()
    gpuio.configure(spool_dir=directory)
    yield directory
    gpuio.close()


def test_classify_thresholds() -> None:
    assert waterfall.classify(100, 100, None) == "cold"
    assert waterfall.classify(100, 80, None) == "cold"
    assert waterfall.classify(100, 50, None) == "partial"
    assert waterfall.classify(100, 10, None) == "warm"
    assert waterfall.classify(100, 0, 0) == "cold"  # NFS: no device bytes, but nothing was cached
    assert waterfall.classify(100, 0, 100) == "warm"


def test_cold_then_warm_load_device_bytes_and_phases(model_file: str, spool: str) -> None:
    size = os.path.getsize(model_file)
    evict(model_file)
    cold = gpuio.load(model_file, bytes, name="wf").waterfall
    warm = gpuio.load(model_file, bytes, name="wf").waterfall
    assert cold is not None and warm is not None
    assert cold.load_class == "cold" and cold.device_bytes >= 0.9 * size
    assert cold.cached_start is not None and cold.cached_start.cached_bytes <= 0.1 * size
    assert warm.load_class == "warm" and warm.device_bytes <= 0.01 * size and warm.cache_bytes >= size
    for w in (cold, warm):
        assert set(w.phases) == {"open", "read", "deserialize"}
        assert sum(w.phases.values()) <= w.wall_seconds


def test_pool_phases_join_the_last_load(model_file: str, spool: str) -> None:
    loaded = gpuio.load(model_file, bytes, name="pooled")
    gpuio.EnginePool(loaded.metrics, create=lambda: 1, size=2, warmup=lambda c: None, warmup_iterations=3)
    last = loaded.metrics.last_waterfall()
    assert last["phase_context"] > 0 and last["last_context"] == last["phase_context"]
    assert last["last_first_inference"] > 0 and last["last_warmup"] > 0


def test_exporter_serves_the_waterfall_and_prediction(model_file: str, spool: str) -> None:
    evict(model_file)
    gpuio.load(model_file, bytes, name="served")
    gpuio.load(model_file, bytes, name="served")
    evict(model_file)
    collector = engines_collector(spool, path_include=(os.path.dirname(model_file),))
    collector.collect()
    collector.service.files_now()
    text = "".join(line for family in collector.collect() for line in family.samples)
    assert 'gpuio_engine_loads_total{engine="served",class="cold"} 1' in text
    assert 'gpuio_engine_loads_total{engine="served",class="warm"} 1' in text
    assert 'gpuio_engine_last_load_class_info{engine="served",class="warm"} 1' in text
    assert 'gpuio_engine_load_phase_seconds_total{engine="served",phase="read"}' in text
    assert 'gpuio_engine_load_source_read_bytes_total{engine="served",source="device"}' in text
    assert 'gpuio_engine_predicted_cold_start_seconds{engine="served"}' in text
    assert 'source="scan"' in text  # root: the exporter measured it itself


def test_prediction_adds_the_exact_mean_deserialize_time_not_a_bucket_median(model_file: str, spool: str) -> None:
    """Two loads that deserialize in about 0.26 s fall in the 0.25-0.5 s bucket, whose interpolated
    median is 0.375 s: the prediction must add what the loads took (their mean), as a cold load will."""
    import time

    def slow(data: bytes) -> int:
        time.sleep(0.26)
        return len(data)

    evict(model_file)
    loads = [gpuio.load(model_file, slow, name="timed").waterfall for _ in range(2)]
    evict(model_file)
    collector = engines_collector(spool, path_include=(os.path.dirname(model_file),))
    collector.collect()
    collector.service.files_now()
    totals = collector.service.totals_now()
    cold = totals.waterfalls["timed"]
    throughput = cold[spool_format.WATERFALL["cold_device_bytes"]] / cold[spool_format.WATERFALL["cold_read_seconds"]]
    deserialize = sum(w.phases["deserialize"] for w in loads if w is not None) / 2
    expected = os.path.getsize(model_file) / throughput + deserialize
    assert collector.service.predicted_cold_start(totals, "timed") == pytest.approx(expected, rel=0.01)


def test_torn_copy_keeps_the_last_good_load(model_file: str, spool: str) -> None:
    gpuio.load(model_file, bytes, name="torn")
    reader = spool_source.SpoolReader(spool)
    good = reader.read().waterfalls["torn"]
    metrics = gpuio.engine("torn")
    index = metrics._waterfall_index
    assert index is not None
    values = metrics._file.values
    values[index] += 1  # a writer between its first and last store
    values[index + spool_format.WATERFALL["last_start"]] = 12345.0
    torn = reader.read().waterfalls["torn"]
    assert torn[spool_format.WATERFALL["last_start"]] == good[spool_format.WATERFALL["last_start"]]


def test_reader_without_the_new_kinds_skips_them(model_file: str, spool: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """An exporter older than the library: the new records are skipped, what came before still counts."""
    gpuio.load(model_file, bytes, name="old")
    monkeypatch.setattr(parse, "KINDS", (spool_format.KIND_ENGINE, spool_format.KIND_ERROR, spool_format.KIND_LAYER,
                                         spool_format.KIND_INFO, spool_format.KIND_LOAD))
    path = gpuio.describe()["spool"]
    with open(path, "rb") as handle:
        parsed = parse.parse(handle.read())
    assert parsed.unknown_records >= 1 and not parsed.bad_record and "old" in parsed.engines


@pytest.mark.parametrize(("fixture", "dev", "path", "expected"), [
    ("containerd-overlay.mountinfo", (0, 347), "/opt/model/resnet.engine",
     waterfall.OwnMount("/", "overlay", "overlay",
                        "/var/lib/containerd/io.containerd.snapshotter.v1.overlayfs/snapshots/5344/fs")),
    ("csi-block-pvc.mountinfo", (259, 6), "/models/llm.plan",
     waterfall.OwnMount("/models", "ext4", "/dev/nvme2n1", "")),
    ("nfs.mountinfo", (0, 88), "/models/a.onnx",
     waterfall.OwnMount("/models", "nfs4", "10.0.4.20:/exports/models", "")),
    ("hostpath.mountinfo", (8, 17), "/models/b.pt", waterfall.OwnMount("/models", "xfs", "/dev/sdb1", "")),
])
def test_writer_mount_of_real_mountinfo_lines(fixture: str, dev: tuple[int, int], path: str,
                                              expected: waterfall.OwnMount) -> None:
    assert waterfall.mount_of(dev, path, os.path.join(FIXTURES, fixture)) == expected


def test_overlay_layer_resolves_to_the_disk_under_it(spool: str) -> None:
    """A file in a container image: the exporter cannot see it, the writer's overlay layer directory (a
    host path) leads to the block device (here a real directory on this machine's disk)."""
    layer = tempfile.mkdtemp(dir="/var/tmp")
    os.rmdir(layer)  # only its st_dev matters: the directory itself may go
    layer = os.path.dirname(layer)
    st = os.stat(layer)
    expected = model.WriterMount("/", "overlay", "overlay", layer)
    collector = engines_collector(spool)
    device, _ = collector.service.files.device_from_writer(expected)
    assert device and os.path.exists(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}")
    assert os.path.basename(os.readlink(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}")) == device
    files = collector.service.files
    assert files.device_from_writer(model.WriterMount("/", "overlay", "overlay", "/var/../etc")) == ("", [])
    assert files.device_from_writer(model.WriterMount("/models", "nfs4", "10.0.4.20:/x", "")) == ("", [])


def test_writer_records_its_mount_in_the_spool(model_file: str, spool: str) -> None:
    gpuio.load(model_file, bytes, name="mounted")
    totals = spool_source.SpoolReader(spool).read()
    st = os.stat(model_file)
    mount = totals.mounts[("mounted", (os.major(st.st_dev), os.minor(st.st_dev)))]
    assert mount.fstype == "ext4" and mount.mountpoint == "/"


HOST_MOUNTINFO = """\
22 1 254:0 / / rw,relatime shared:1 - ext4 /dev/vda rw
31 22 259:6 / /var/lib/kubelet/pods/0b7e/volumes/kubernetes.io~csi/pvc-41/mount ro,relatime - ext4 /dev/nvme2n1 ro
32 22 8:17 / /srv/models rw,relatime - xfs /dev/sdb1 rw,attr2,inode64
33 22 0:88 /exports/models /var/lib/kubelet/pods/0b7e/volumes/kubernetes.io~nfs/models ro,relatime - nfs4 \
10.0.4.20:/exports/models ro,vers=4.1,addr=10.0.4.20
"""


def _fixture_sysfs(root: str) -> str:
    """A sysfs with the block devices of the four cases (the overlay's layer lives on this machine's
    real disk, whose MAJ:MIN is linked to vda)."""
    layer_dev = os.stat(root).st_dev
    links = {"259:6": "nvme2n1", "8:17": "sdb/sdb1", f"{os.major(layer_dev)}:{os.minor(layer_dev)}": "vda"}
    for number, name in links.items():
        os.makedirs(os.path.join(root, "sys", "block", name), exist_ok=True)
        os.makedirs(os.path.join(root, "sys", "dev", "block"), exist_ok=True)
        os.symlink(f"../../block/{name}", os.path.join(root, "sys", "dev", "block", number))
    with open(os.path.join(root, "sys", "block", "sdb", "sdb1", "partition"), "w") as handle:
        handle.write("1\n")
    return os.path.join(root, "sys")


def test_the_join_engine_to_disk_for_image_pvc_hostpath_and_nfs(spool: str, request: pytest.FixtureRequest) -> None:
    """Four engines, one per kind of storage, each with the st_dev and mount line its writer records
    (tests/fixtures/mounts/writer): the image file's disk comes from the writer's overlay layer, the PVC's
    and the hostPath's from their st_dev, the NFS file's mount from the host's mount table."""
    from exporter.collectors.engines import EnginesCollector
    from exporter.context import Context

    root = tempfile.mkdtemp(dir="/var/tmp")
    request.addfinalizer(lambda: shutil.rmtree(root, ignore_errors=True))
    sysfs = _fixture_sysfs(root)
    os.makedirs(os.path.join(root, "proc", "1"))
    with open(os.path.join(root, "proc", "1", "mountinfo"), "w") as handle:
        handle.write(HOST_MOUNTINFO)
    layer = "/var/lib/containerd/io.containerd.snapshotter.v1.overlayfs/snapshots/5344/fs"
    os.makedirs(os.path.join(root, "rootfs", layer.lstrip("/")))
    cases = {  # engine: (fixture, st_dev, path)
        "image": ("containerd-overlay.mountinfo", (0, 347), "/opt/model/resnet.engine"),
        "pvc": ("csi-block-pvc.mountinfo", (259, 6), "/models/llm.plan"),
        "nfs": ("nfs.mountinfo", (0, 88), "/models/a.onnx"),
        "hostpath": ("hostpath.mountinfo", (8, 17), "/models/b.pt"),
    }
    for engine, (fixture, dev, path) in cases.items():
        metrics = gpuio.engine(engine)
        metrics._append_info(spool_format.pack_info(0, dev, 7, 1 << 20, 0, 1.0, path, "GPU-1", "generic"))
        own = waterfall.mount_of(dev, path, os.path.join(FIXTURES, fixture))
        assert own is not None
        if engine == "image":  # the layer as the exporter sees the host: under its --path.rootfs
            own = waterfall.OwnMount(own.mountpoint, own.fstype, own.source, layer)
        metrics.record_mount(dev, own.mountpoint, own.fstype, own.source, own.layer)
        metrics.load_read_bytes.inc(1)
    settings = {option.name: option.parse(option.default) if option.default is not None else None
                for option in EnginesCollector.options}
    settings["spool-dir"] = spool
    collector = EnginesCollector(Context(os.path.join(root, "proc"), sysfs, os.path.join(root, "rootfs")), settings)
    text = "".join(line for family in collector.collect() for line in family.samples)
    devices = {engine: line.split('device="')[1].split('"')[0] for engine in cases
               for line in text.splitlines() if line.startswith(f'gpuio_engine_info{{engine="{engine}"')}
    assert devices == {"image": "vda", "pvc": "nvme2n1", "hostpath": "sdb1", "nfs": ""}
    assert ('gpuio_engine_mount_info{engine="nfs",path="/models/a.onnx",mountpoint='
            '"/var/lib/kubelet/pods/0b7e/volumes/kubernetes.io~nfs/models",fstype="nfs4",'
            'source="10.0.4.20:/exports/models"} 1') in text
    assert 'gpuio_engine_physical_device_info{engine="hostpath",path="/models/b.pt",physical_device="sdb"} 1' in text


SLOTS = len(spool_format.WATERFALL_SLOTS)


@pytest.mark.parametrize(("kind", "key", "payload"), [
    # strings past the record
    (spool_format.KIND_MOUNT, "e\x001:2", spool_format.MOUNT_STRUCT.pack(4000, 0, 0, 0) + b"/x"),
    (spool_format.KIND_MOUNT, "e\x00one:2", spool_format.pack_mount("/", "ext4", "/dev/vda", "")),  # not MAJ:MIN
    (spool_format.KIND_MOUNT, "e", spool_format.pack_mount("/", "ext4", "/dev/vda", "")),  # no device in the key
    (spool_format.KIND_WATERFALL, "e", b"\0" * 8 * 3),  # short
    (spool_format.KIND_WATERFALL, "e", struct.pack(f"<{SLOTS}d", *([float("nan")] * SLOTS))),  # NaN
    (spool_format.KIND_WATERFALL, "e", struct.pack(f"<{SLOTS}d", *([-1.0] * SLOTS))),  # negative
])
def test_hostile_waterfall_and_mount_records_stop_the_parse_there(kind: int, key: str, payload: bytes) -> None:
    """A writer is untrusted: a record that makes no sense ends the parse (kept: what came before)."""
    file = spool_format.SpoolFile(None)
    with file.lock:
        file.add_record(spool_format.KIND_ERROR, "good\x00reason", 8, struct.pack("<d", 1.0))
        file.add_record(kind, key, len(payload), payload)
    parsed = parse.parse(bytes(file._map))
    assert parsed.bad_record and parsed.errors == {("good", "reason"): 1.0}
    assert not parsed.waterfalls and not parsed.mounts


def test_load_timer_with_the_callers_own_read(model_file: str, spool: str) -> None:
    """LoadTimer around code the caller owns: its read (on this thread) is what the bytes count."""
    size = os.path.getsize(model_file)
    evict(model_file)
    with gpuio.LoadTimer("timed", model_file) as timer:
        with timer.reading(size), open(model_file, "rb") as handle:
            data = handle.read()
        with timer.deserializing():
            bytes(data)
        with timer.phase("context"):
            pass
    w = timer.waterfall
    assert w is not None and w.load_class == "cold" and w.device_bytes >= 0.9 * size
    assert set(w.phases) == {"read", "deserialize", "context"}
    with pytest.raises(ValueError, match="unknown phase"), gpuio.LoadTimer("timed", model_file) as timer, \
            timer.phase("nap"):
        pass


class HungFilesystem:
    """A real FUSE mount whose daemon never answers: any lookup under it blocks, as under an NFS server
    that went away.  ``release()`` aborts the connection (the blocked calls fail with ENOTCONN)."""

    def __init__(self) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        self.mountpoint = tempfile.mkdtemp(prefix="gpuio-hung-")
        self._libc = libc
        try:
            self._fd: int | None = os.open("/dev/fuse", os.O_RDWR)
        except OSError as exc:
            os.rmdir(self.mountpoint)
            pytest.skip(f"no /dev/fuse here: {exc.strerror}")
        options = f"fd={self._fd},rootmode=40000,user_id=0,group_id=0".encode()
        if libc.mount(b"hung", self.mountpoint.encode(), b"fuse", 0, options) != 0:
            self.release()
            pytest.skip(f"cannot mount FUSE here: {os.strerror(ctypes.get_errno())}")

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
            self._libc.umount2(self.mountpoint.encode(), 2)  # MNT_DETACH
            os.rmdir(self.mountpoint)


def test_a_layer_the_writer_names_on_a_hung_mount_does_not_hang_the_scrape(spool: str) -> None:
    """The writer's MOUNT record names its overlay layer directory, a host path the exporter stats in the
    scrape.  A hostile (or merely wrong) writer names a path under a mount that does not answer (a dead
    NFS server, an automount, FUSE): the scrape must not wait on it.  Only a layer on a local block
    device's file system is looked at."""
    hung = HungFilesystem()
    writer = SpoolFile(spool)
    try:
        dev = (0, 4242)  # a st_dev no mount of this machine has: the exporter's own view finds no device
        with writer.lock:
            offset = writer.add_record(spool_format.KIND_ENGINE, "trapped", spool_format.ENGINE_LAYOUT.size * 8)
            info = spool_format.pack_info(0, dev, 7, 4096, 1, 1.0, "/opt/model/trapped.engine", "", "tensorrt")
            writer.add_record(spool_format.KIND_INFO, "trapped", len(info), info)
            mount = spool_format.pack_mount("/", "overlay", "overlay",
                                            os.path.join(hung.mountpoint, "snapshots", "7", "fs"))
            writer.add_record(spool_format.KIND_MOUNT, f"trapped\0{dev[0]}:{dev[1]}", len(mount), mount)
        assert offset is not None
        collector = engines_collector(spool)
        scraped: list[object] = []
        scrape = threading.Thread(target=lambda: scraped.append(collector.collect()), daemon=True)
        scrape.start()
        scrape.join(20)  # not a timing: the old code waited until the mount was aborted below
        hanging = scrape.is_alive()
    finally:
        hung.release()
        writer.close()
    assert not hanging, "the scrape waited on a path the spool writer chose"
    assert scraped


def test_a_writers_waterfall_cannot_break_the_scrape_of_every_engine(model_file: str, spool: str) -> None:
    """The predicted cold start divides by the cold-read throughput the writers report.  Values a writer
    may legally record (finite, >= 0) made it 0.0 (5e-324 bytes in 1e10 s): a ZeroDivisionError in the
    scrape took every engine's series with it.  Such a writer's engine gets no prediction, the rest
    is served."""
    gpuio.load(model_file, bytes, name="victim")
    hostile = SpoolFile(spool)
    try:
        values = [0.0] * len(spool_format.WATERFALL_SLOTS)
        for name, value in (("cold_device_bytes", 5e-324), ("cold_read_seconds", 1e10), ("residency_method", 1.0),
                            ("file_bytes", 4096.0), ("cached_end_bytes", 0.0)):
            values[spool_format.WATERFALL[name]] = value
        with hostile.lock:
            hostile.add_record(spool_format.KIND_ENGINE, "hostile", spool_format.ENGINE_LAYOUT.size * 8)
            hostile.add_record(spool_format.KIND_WATERFALL, "hostile", len(values) * 8,
                               struct.pack(f"<{len(values)}d", *values))
        collector = engines_collector(spool)
        text = render(collector.collect())
    finally:
        hostile.close()
    assert 'gpuio_engine_load_phase_seconds_total{engine="victim"' in text
    assert 'gpuio_engine_predicted_cold_start_seconds{engine="hostile"' not in text
