"""Inference pods with no hostPath: the exporter finds their spool in their emptyDir through a tree laid
out as the kubelet lays out /var/lib/kubelet/pods, written by the real instrumentation library.

The library runs in this process (a pod's process would run it the same way); its Downward API
environment is set as a pod spec would set it.
"""

from __future__ import annotations

import os

import pytest

import gpuio
from exporter.collect import Absent
from exporter.engines.service import MAX_GPUS_PER_ENGINE
from exporter.exposition import render
from exporter.pods import kubelet
from gpuio import spool as spool_format
from tests.conftest import engines_collector

UID_A = "6f1c2d3e-4a5b-4c6d-8e7f-90a1b2c3d4e5"
UID_B = "0d9e8f7a-6b5c-4d3e-9f2a-1b0c9d8e7f6a"
GPU = "GPU-a4f34abc-7715-3560-dcea-7238b9611a45"


def pod_spool(pods: str, uid: str, volume: str = "gpuio-spool") -> str:
    """<pods>/<uid>/volumes/kubernetes.io~empty-dir/<volume>, as the kubelet makes an emptyDir."""
    path = os.path.join(pods, uid, "volumes", kubelet.EMPTY_DIR, volume)
    os.makedirs(path)
    os.makedirs(os.path.join(pods, uid, "containers", "server"))  # what else a pod directory holds
    os.makedirs(os.path.join(pods, uid, "volumes", "kubernetes.io~projected", "kube-api-access-x7k2p"))
    return path


@pytest.fixture
def pod_env(monkeypatch):
    """The Downward API environment of the example Deployment (deploy/kubernetes/examples)."""
    monkeypatch.setenv("POD_NAMESPACE", "serving")
    monkeypatch.setenv("POD_NAME", "detector-7d9f-x2x9q")
    monkeypatch.setenv("CONTAINER_NAME", "server")
    monkeypatch.setenv("POD_UID", "11111111-2222-3333-4444-555555555555")  # a claim: the path's UID wins
    yield
    gpuio.close()
    gpuio.configure(None)


def write_engine(spool: str, engine: str, model: str) -> None:
    """What an inference process does: load its model through gpuio (INFO, LOAD, ENGINE records)."""
    gpuio.close()
    gpuio.configure(spool)
    loaded = gpuio.load(model, lambda data: bytes(data), name=engine, gpu_uuid=GPU)
    loaded.metrics.inference_seconds.observe(0.004)


def read(path: str) -> bytes:
    with open(path, "rb") as handle:
        return handle.read()


def scrape(collector) -> str:
    return render(collector.collect())


def test_exporter_finds_a_pods_emptydir_spool(tmp_path, pod_env) -> None:
    pods = str(tmp_path / "var" / "lib" / "kubelet" / "pods")
    spool = pod_spool(pods, UID_A)
    model = tmp_path / "detector.onnx"
    model.write_bytes(b"x" * 4096)
    write_engine(spool, "detector", str(model))
    collector = engines_collector(str(tmp_path / "no-hostpath-spool"), kubelet_pods_dir=pods)
    found = collector.service.pod_spools.sample_now().value
    assert found.directories == {spool: UID_A}
    text = scrape(collector)
    assert f'gpuio_engine_inference_seconds_count{{engine="detector",gpu_uuid="{GPU}"}} 1' in text
    assert (f'gpuio_engine_pod_info{{engine="detector",gpu_uuid="{GPU}",namespace="serving",pod="detector-7d9f-x2x9q",'
            f'container="server",pod_uid="{UID_A}"}} 1') in text
    assert "gpuio_engine_pod_spool_directories 1" in text


def test_old_exporter_behaviour_without_discovery_sees_nothing(tmp_path, pod_env) -> None:
    """Before: only --collector.engines.spool-dir was read, so a pod's emptyDir spool was invisible."""
    pods = str(tmp_path / "pods")
    write_engine(pod_spool(pods, UID_A), "detector", __file__)
    collector = engines_collector(str(tmp_path / "no-hostpath-spool"), kubelet_pods_dir=pods)
    with pytest.raises(Absent):  # no discovery scan yet: the same as the old exporter
        collector.collect()


def test_symlinks_are_refused(tmp_path, pod_env) -> None:
    """A pod controls its volume's content: a spool file that is a symlink (to another pod's file) is not
    read; a volume path that is a symlink is not followed."""
    pods = str(tmp_path / "pods")
    victim = pod_spool(pods, UID_A)
    write_engine(victim, "victim-engine", __file__)
    (victim_file,) = [name for name in os.listdir(victim) if name.endswith(spool_format.SUFFIX)]
    attacker = pod_spool(pods, UID_B)
    os.symlink(os.path.join(victim, victim_file), os.path.join(attacker, "gpuio-1-1-0000000000000001.spool"))
    other = str(tmp_path / "elsewhere" / "gpuio-spool")
    os.makedirs(other)
    uid_c = "3f2a9c1e8b7d6a5f4e3d2c1b0a998877"
    os.makedirs(os.path.join(pods, uid_c, "volumes", kubelet.EMPTY_DIR))
    os.symlink(other, os.path.join(pods, uid_c, "volumes", kubelet.EMPTY_DIR, "gpuio-spool"))
    collector = engines_collector(str(tmp_path / "none"), kubelet_pods_dir=pods)
    assert collector.service.pod_spools.sample_now().value.directories == {victim: UID_A, attacker: UID_B}
    text = scrape(collector)
    assert text.count("gpuio_engine_pod_info{") == 1 and f'pod_uid="{UID_A}"' in text
    assert f'pod_uid="{UID_B}"' not in text
    assert 'gpuio_engine_spool_errors_total{reason="io"} 1' in text  # the symlink, counted


def test_a_deleted_pod_folds_and_its_files_are_never_deleted(tmp_path, pod_env) -> None:
    pods = str(tmp_path / "pods")
    spool = pod_spool(pods, UID_A)
    write_engine(spool, "detector", __file__)
    collector = engines_collector(str(tmp_path / "none"), kubelet_pods_dir=pods)
    collector.service.pod_spools.sample_now()
    assert "gpuio_engine_inference_seconds_count{" in scrape(collector)
    gpuio.close()  # the process exits: its lock goes, the exporter folds its file ...
    text = scrape(collector)
    assert f'gpuio_engine_inference_seconds_count{{engine="detector",gpu_uuid="{GPU}"}} 1' in text
    assert len(os.listdir(spool)) == 1  # ... and leaves it in the pod's volume (mounted read-only)
    assert "not_deleted" not in text
    for name in os.listdir(spool):
        os.unlink(os.path.join(spool, name))
    os.removedirs(spool)  # the pod is deleted, its volume with it
    collector.service.pod_spools.sample_now()
    text = scrape(collector)
    assert f'gpuio_engine_inference_seconds_count{{engine="detector",gpu_uuid="{GPU}"}} 1' in text  # no reset


def test_pods_scanned_are_capped(tmp_path, pod_env) -> None:
    pods = str(tmp_path / "pods")
    pod_spool(pods, UID_A)
    pod_spool(pods, UID_B)
    for junk in ("not-a-uid", "..", "6f1c2d3e-4a5b-4c6d-8e7f-90a1b2c3d4eZ"):
        os.makedirs(os.path.join(pods, junk, "volumes", kubelet.EMPTY_DIR, "gpuio-spool"), exist_ok=True)
    collector = engines_collector(str(tmp_path / "none"), kubelet_pods_dir=pods, max_pod_spools=1)
    found = collector.service.pod_spools.sample_now().value
    assert len(found.directories) == 1 and found.left_out == 1
    assert "gpuio_engine_pod_spool_pods_skipped 1" in scrape(collector)


def test_off_the_cluster_nothing_changes(tmp_path) -> None:
    collector = engines_collector(str(tmp_path / "none"), kubelet_pods_dir=str(tmp_path / "no-kubelet"))
    found = collector.service.pod_spools.sample_now().value
    assert not found.exists and found.directories == {}
    with pytest.raises(Absent) as absent:
        collector.collect()
    assert "spool directory" in absent.value.reason


def test_a_hostpath_writer_records_its_pod_from_the_downward_api(spool_dir, pod_env, tmp_path) -> None:
    """The writer on a hostPath spool: no path says its pod, so what it recorded is served (its claim)."""
    write_engine(spool_dir, "ranker", __file__)
    text = scrape(engines_collector(spool_dir, kubelet_pods_dir=str(tmp_path / "none")))
    assert (f'gpuio_engine_pod_info{{engine="ranker",gpu_uuid="{GPU}",namespace="serving",pod="detector-7d9f-x2x9q",'
            'container="server",pod_uid="11111111-2222-3333-4444-555555555555"} 1') in text


def test_a_pod_record_that_lies_about_its_lengths_is_a_bad_record(tmp_path, monkeypatch) -> None:
    """A writer is untrusted: POD strings that overrun their record stop the parse there (counted once),
    what came before stands, nothing raises; bytes that are not UTF-8 are kept, not fatal (and shown \\xNN
    where they leave the exporter: hosttext)."""
    from exporter.engines import parse

    for name in spool_format.POD_ENVIRONMENT:
        monkeypatch.delenv(name, raising=False)
    file = spool_format.SpoolFile(str(tmp_path))
    assert file.path is not None
    payload = spool_format.POD_STRUCT.pack(3, 60000, 0, 0) + b"abc"
    file.add_record(spool_format.KIND_POD, "pod", len(payload), payload)
    parsed = parse.parse(read(file.path))
    assert parsed.bad_record and parsed.pod is None
    file.close()
    other = spool_format.SpoolFile(str(tmp_path))
    junk = spool_format.POD_STRUCT.pack(2, 2, 0, 0) + b"\xff\xfe\xc3("
    other.add_record(spool_format.KIND_POD, "pod", len(junk), junk)
    assert other.path is not None
    parsed = parse.parse(read(other.path))
    assert not parsed.bad_record and parsed.pod is not None and parsed.pod.namespace == os.fsdecode(b"\xff\xfe")
    other.close()


def test_no_pod_record_without_a_pod_name_or_uid(tmp_path, monkeypatch) -> None:
    """CONTAINER_NAME alone is common outside Kubernetes (this very machine sets it): no POD record."""
    from exporter.engines import parse

    for name in spool_format.POD_ENVIRONMENT:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("CONTAINER_NAME", "some-sandbox")
    file = spool_format.SpoolFile(str(tmp_path))
    assert file.path is not None
    assert parse.parse(read(file.path)).pod is None
    file.close()


def test_an_engine_on_more_gpus_than_the_cap_is_counted_not_a_crash(tmp_path) -> None:
    """An engine reported on more GPUs than MAX_GPUS_PER_ENGINE (writers name GPUs: untrusted) has the
    rest counted as kind="engine_gpu"; the counter's kind had no slot, so the collector raised KeyError."""
    from gpuio.metrics import EngineMetrics

    files = []
    for index in range(MAX_GPUS_PER_ENGINE + 1):
        file = spool_format.SpoolFile(str(tmp_path))
        metrics = EngineMetrics("wide", file)
        metrics._append_info(spool_format.pack_info(0, (0, 0), 0, 0, 0, 1.0, "/models/wide.engine",
                                                    f"GPU-{index:08d}-aaaa-bbbb-cccc-dddddddddddd", "generic"))
        metrics.inference_seconds.observe(0.001)
        files.append(file)
    text = scrape(engines_collector(str(tmp_path), kubelet_pods_dir=str(tmp_path / "none")))
    assert 'gpuio_engine_dropped_series_total{kind="engine_gpu"} 1' in text
    for file in files:
        file.close()


def test_a_pod_filling_its_volume_with_files_cannot_crowd_out_the_others(tmp_path, monkeypatch) -> None:
    """Each pod directory gives at most MAX_POD_DIRECTORY_ENTRIES entries a read (the rest of that pod's
    files at the next reads, in turn), so a pod listed first cannot take the whole listing from the others."""
    from exporter.engines import spool_listing
    from gpuio.metrics import EngineMetrics

    monkeypatch.setattr(spool_listing, "MAX_POD_DIRECTORY_ENTRIES", 5)
    pods = str(tmp_path / "pods")
    crowded, quiet = pod_spool(pods, UID_B), pod_spool(pods, UID_A)  # UID_B's directory is listed first
    files = []
    for _ in range(12):
        file = spool_format.SpoolFile(crowded)
        EngineMetrics("crowd", file).inference_seconds.observe(0.001)
        files.append(file)
    victim = spool_format.SpoolFile(quiet)
    EngineMetrics("victim", victim).inference_seconds.observe(0.001)
    collector = engines_collector(str(tmp_path / "none"), kubelet_pods_dir=pods)
    collector.service.pod_spools.sample_now()
    text = scrape(collector)
    assert 'gpuio_engine_inference_seconds_count{engine="victim",gpu_uuid=""} 1' in text
    assert 'gpuio_engine_inference_seconds_count{engine="crowd",gpu_uuid=""} 5' in text
    assert "gpuio_engine_spool_unfinished_listings 1" in text
    text = scrape(collector)
    assert 'gpuio_engine_inference_seconds_count{engine="crowd",gpu_uuid=""} 10' in text
    text = scrape(collector)  # the last 2 entries: the crowded pod's listing is through
    assert 'gpuio_engine_inference_seconds_count{engine="crowd",gpu_uuid=""} 12' in text
    assert "gpuio_engine_spool_unfinished_listings 0" in text
    assert 'gpuio_engine_inference_seconds_count{engine="victim",gpu_uuid=""} 1' in text
    for file in [*files, victim]:
        file.close()


def test_a_pod_left_out_by_the_scan_cap_for_a_while_is_not_counted_twice(tmp_path, pod_env) -> None:
    """Pods past --collector.engines.max-pod-spools are not looked at (by UID order).  A pod whose live
    writer drops out of the scan because a pod sorting before it came was read as vanished (folded) and,
    listed again once that pod went, counted a second time on top."""
    pods = str(tmp_path / "pods")
    spool = pod_spool(pods, UID_A)
    write_engine(spool, "detector", __file__)
    collector = engines_collector(str(tmp_path / "none"), kubelet_pods_dir=pods, max_pod_spools=1)
    line = f'gpuio_engine_inference_seconds_count{{engine="detector",gpu_uuid="{GPU}"}} 1'
    collector.service.pod_spools.sample_now()
    assert line in scrape(collector)
    pod_spool(pods, UID_B)  # sorts before UID_A: now the one pod looked at
    assert collector.service.pod_spools.sample_now().value.directories == {
        os.path.join(pods, UID_B, "volumes", kubelet.EMPTY_DIR, "gpuio-spool"): UID_B}
    assert line in scrape(collector)
    for root, directories, _ in os.walk(os.path.join(pods, UID_B), topdown=False):
        for directory in directories:
            os.rmdir(os.path.join(root, directory))
    os.rmdir(os.path.join(pods, UID_B))  # that pod is gone: UID_A is looked at again
    collector.service.pod_spools.sample_now()
    assert line in scrape(collector)
    assert "vanished" not in scrape(collector)


def test_pod_names_longer_than_kubernetes_allows_are_refused(tmp_path) -> None:
    """A POD record's strings become label values of gpuio_engine_pod_info, one series per pod and engine.
    The library cuts them to 253 bytes (what Kubernetes allows a pod name, the longest of them); a
    hostile writer's record of 60 KiB names made every series of its engines 60 KiB long (64 pods x
    200 engines of them in one scrape).  Such a record is a bad record: counted, nothing after it kept."""
    from gpuio.metrics import EngineMetrics

    spool = str(tmp_path / "spool")
    os.mkdir(spool)
    file = spool_format.SpoolFile(spool)
    try:
        names = [b"n" * 63, b"p" * 60_000, b"c" * 63, UID_A.encode()]
        payload = spool_format.POD_STRUCT.pack(*map(len, names)) + b"".join(names)
        with file.lock:
            file.add_record(spool_format.KIND_POD, "pod", len(payload), payload)
        EngineMetrics("bloated", file).inference_seconds.observe(0.001)
        text = scrape(engines_collector(spool))
    finally:
        file.close()
    assert max(map(len, text.splitlines())) < 4096
    assert 'gpuio_engine_spool_errors_total{reason="record"} 1' in text


def test_gpuio_engines_lists_the_engines_of_pods_emptydir_spools(tmp_path, pod_env) -> None:
    """`gpuio engines` reads what the exporter reads: the node's spool directory and the pods' volumes."""
    from exporter.engine_join import engine_rows

    pods = str(tmp_path / "pods")
    spool = pod_spool(pods, UID_A)
    model = tmp_path / "detector.onnx"
    model.write_bytes(b"x" * 4096)
    write_engine(spool, "detector", str(model))
    rows = engine_rows(str(tmp_path / "no-hostpath-spool"), [], path_include=[str(tmp_path)], pods_dir=pods)
    assert [(row["engine"], row["pods"]) for row in rows] == [("detector", ["serving/detector-7d9f-x2x9q"])]
