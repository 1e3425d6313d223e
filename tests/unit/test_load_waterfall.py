"""The waterfall of a load: phases, device vs page-cache bytes, class, residency at the start, the
writer's mount; the spool record, its reader, and the exporter's families and prediction.

Real files on this machine's disk (/var/tmp is ext4 on a virtio disk), evicted with posix_fadvise."""

from __future__ import annotations

import os
import tempfile

import pytest

import gpuio
from exporter import spool_reader as rd
from gpuio import spool as fmt
from gpuio import waterfall as wf
from tests.conftest import engines_collector

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures", "mounts", "writer")


def _evict(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


@pytest.fixture
def model_file() -> str:
    directory = tempfile.mkdtemp(dir="/var/tmp")
    path = os.path.join(directory, "waterfall.bin")
    with open(path, "wb") as handle:
        handle.write(os.urandom(8 << 20))
    return path


@pytest.fixture
def spool(tmp_path: object) -> str:
    directory = tempfile.mkdtemp()
    gpuio.configure(spool_dir=directory)
    yield directory
    gpuio.close()


def test_classify_thresholds() -> None:
    assert wf.classify(100, 100, None) == "cold"
    assert wf.classify(100, 80, None) == "cold"
    assert wf.classify(100, 50, None) == "partial"
    assert wf.classify(100, 10, None) == "warm"
    assert wf.classify(100, 0, 0) == "cold"  # NFS: no device bytes, but nothing was cached
    assert wf.classify(100, 0, 100) == "warm"


def test_cold_then_warm_load_device_bytes_and_phases(model_file: str, spool: str) -> None:
    size = os.path.getsize(model_file)
    _evict(model_file)
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
    _evict(model_file)
    gpuio.load(model_file, bytes, name="served")
    gpuio.load(model_file, bytes, name="served")
    _evict(model_file)
    collector = engines_collector(spool, path_include=(os.path.dirname(model_file),))
    collector.collect()
    collector.engine_files_now()
    text = "".join(line for family in collector.collect() for line in family.samples)
    assert 'gpuio_engine_loads_total{engine="served",class="cold"} 1' in text
    assert 'gpuio_engine_loads_total{engine="served",class="warm"} 1' in text
    assert 'gpuio_engine_last_load_class_info{engine="served",class="warm"} 1' in text
    assert 'gpuio_engine_load_phase_seconds_total{engine="served",phase="read"}' in text
    assert 'gpuio_engine_load_source_read_bytes_total{engine="served",source="device"}' in text
    assert 'gpuio_engine_predicted_cold_start_seconds{engine="served"}' in text
    assert 'source="scan"' in text  # root: the exporter measured it itself


def test_torn_copy_keeps_the_last_good_load(model_file: str, spool: str) -> None:
    gpuio.load(model_file, bytes, name="torn")
    reader = rd.SpoolReader(spool)
    good = reader.read().waterfalls["torn"]
    metrics = gpuio.engine("torn")
    index = metrics._waterfall_index
    assert index is not None
    values = metrics._file.values
    values[index] += 1  # a writer between its first and last store
    values[index + fmt.WATERFALL["last_start"]] = 12345.0
    torn = reader.read().waterfalls["torn"]
    assert torn[fmt.WATERFALL["last_start"]] == good[fmt.WATERFALL["last_start"]]


def test_reader_without_the_new_kinds_skips_them(model_file: str, spool: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """An exporter older than the library: the new records are skipped, what came before still counts."""
    gpuio.load(model_file, bytes, name="old")
    monkeypatch.setattr(rd, "KINDS", (fmt.KIND_ENGINE, fmt.KIND_ERROR, fmt.KIND_LAYER, fmt.KIND_INFO, fmt.KIND_LOAD))
    path = gpuio.describe()["spool"]
    with open(path, "rb") as handle:
        parsed = rd.parse(handle.read())
    assert parsed.unknown_records >= 1 and not parsed.bad_record and "old" in parsed.engines


@pytest.mark.parametrize(("fixture", "dev", "path", "expected"), [
    ("containerd-overlay.mountinfo", (0, 347), "/opt/model/resnet.engine",
     wf.OwnMount("/", "overlay", "overlay",
                 "/var/lib/containerd/io.containerd.snapshotter.v1.overlayfs/snapshots/5344/fs")),
    ("csi-block-pvc.mountinfo", (259, 6), "/models/llm.plan", wf.OwnMount("/models", "ext4", "/dev/nvme2n1", "")),
    ("nfs.mountinfo", (0, 88), "/models/a.onnx", wf.OwnMount("/models", "nfs4", "10.0.4.20:/exports/models", "")),
    ("hostpath.mountinfo", (8, 17), "/models/b.pt", wf.OwnMount("/models", "xfs", "/dev/sdb1", "")),
])
def test_writer_mount_of_real_mountinfo_lines(fixture: str, dev: tuple[int, int], path: str,
                                              expected: wf.OwnMount) -> None:
    assert wf.mount_of(dev, path, os.path.join(FIXTURES, fixture)) == expected


def test_overlay_layer_resolves_to_the_disk_under_it(spool: str) -> None:
    """A file in a container image: the exporter cannot see it, the writer's overlay layer directory (a
    host path) leads to the block device (here a real directory on this machine's disk)."""
    layer = tempfile.mkdtemp(dir="/var/tmp")
    st = os.stat(layer)
    expected = rd.WriterMount("/", "overlay", "overlay", layer)
    collector = engines_collector(spool)
    device, _ = collector.device_from_writer(expected)
    assert device and os.path.exists(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}")
    assert os.path.basename(os.readlink(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}")) == device
    assert collector.device_from_writer(rd.WriterMount("/", "overlay", "overlay", "/var/../etc")) == ("", [])
    assert collector.device_from_writer(rd.WriterMount("/models", "nfs4", "10.0.4.20:/x", "")) == ("", [])


def test_writer_records_its_mount_in_the_spool(model_file: str, spool: str) -> None:
    gpuio.load(model_file, bytes, name="mounted")
    totals = rd.SpoolReader(spool).read()
    st = os.stat(model_file)
    mount = totals.mounts[("mounted", (os.major(st.st_dev), os.minor(st.st_dev)))]
    assert mount.fstype == "ext4" and mount.mountpoint == "/"
