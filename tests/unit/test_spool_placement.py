"""A library writer NVML lists on several GPUs (issue 41): each engine placed by the Triton config.pbtxt beside
its file, else on every GPU the writer holds (exporter.engines.spool.WriterGpus, SpoolReader's merge).

Writers are real SpoolFile objects in this process, reading real engine files in a real model repository;
the reader sees this process through the real /proc (its start time, its lock on the file).  NVML is the
one thing faked: which GPUs this process is listed on (a GpuProcesses table filled as the nvml collector
fills it), since no GPU is here.
"""

from __future__ import annotations

import os
import threading
import time

from exporter.context import GpuProcesses
from exporter.engines import placement
from exporter.engines import spool as spool_source
from exporter.host import procstat
from gpuio import spool as spool_format
from gpuio.metrics import EngineMetrics

UUIDS = ("GPU-00000000-aaaa", "GPU-11111111-bbbb", "GPU-22222222-cccc", "GPU-33333333-dddd")
ME = (os.getpid(), procstat.start_ticks())


def listed_on(gpus: tuple[str, ...], memory: int = 1 << 30) -> GpuProcesses:
    table = GpuProcesses()
    table.update_sweep((((ME), uuid, memory) for uuid in gpus), UUIDS)
    return table


def reader_for(directory: str, table: GpuProcesses) -> tuple[spool_source.SpoolReader, spool_source.WriterGpus]:
    """What the engines collector builds (exporter/collectors/engines.py)."""
    gpus = spool_source.WriterGpus(table.get, "/proc", gpus_of_process=table.gpus_of, ordered=table.ordered)
    return spool_source.SpoolReader(directory, gpu_of=gpus, place_of=gpus.placed), gpus


def repository(root, config: bytes | None) -> str:
    version = root / "models" / "resnet" / "1"
    version.mkdir(parents=True)
    (version / "model.plan").write_bytes(b"\0" * 4096)
    if config is not None:
        (root / "models" / "resnet" / "config.pbtxt").write_bytes(config)
    return str(version / "model.plan")


def serving(spool_dir: str, engine_file: str, gpu_uuid: str | None = None) -> tuple[spool_format.SpoolFile,
                                                                                    EngineMetrics]:
    file = spool_format.SpoolFile(spool_dir, 64 * 1024)
    metrics = EngineMetrics("resnet", file)
    metrics.record_load(0.5, 4096, 0.1, path=engine_file, gpu_uuid=gpu_uuid)
    metrics.inference_seconds.observe(0.01)
    return file, metrics


def gpus_of_infos(totals) -> list[str]:
    return sorted(info.gpu_uuid for info in totals.infos["resnet"])


def test_a_config_places_a_writer_on_four_gpus_on_its_gpu(tmp_path, monkeypatch) -> None:
    """CUDA_VISIBLE_DEVICES=2,3,0,1 and ``gpus: [1]``: the engine is on CUDA ordinal 1, which is NVML's GPU 3.
    Its info, per-GPU series and loads in progress go there (one GPU: nothing is split)."""
    monkeypatch.setattr(placement, "read_cuda_environ", lambda procfs, pid: placement.CudaEnviron("2,3,0,1"))
    spool_dir = tmp_path / "spool"
    spool_dir.mkdir()
    engine = repository(tmp_path, b'name: "resnet"\ninstance_group [ { kind: KIND_GPU, count: 2, gpus: [ 1 ] } ]\n')
    file, metrics = serving(str(spool_dir), engine)
    reader, _ = reader_for(str(spool_dir), listed_on(UUIDS))
    with metrics.loading(engine):
        totals = reader.read()
        assert gpus_of_infos(totals) == [UUIDS[3]]
        assert set(totals.per_gpu) == {("resnet", UUIDS[3])}
        assert [key[:2] for key in totals.loads] == [("resnet", UUIDS[3])]
    file.close()


def test_without_a_config_the_engine_is_on_every_gpu_the_writer_holds(tmp_path) -> None:
    """One info per GPU (an alert joining on the engine's GPU finds each of them); the per-GPU series and
    loads stay on "": which GPU served a request the writer did not say, and a share on each is invented."""
    spool_dir = tmp_path / "spool"
    spool_dir.mkdir()
    engine = repository(tmp_path, None)
    file, metrics = serving(str(spool_dir), engine)
    reader, _ = reader_for(str(spool_dir), listed_on(UUIDS[:2]))
    with metrics.loading(engine):
        totals = reader.read()
        assert gpus_of_infos(totals) == list(UUIDS[:2])
        assert set(totals.per_gpu) == {("resnet", "")}
        assert [key[:2] for key in totals.loads] == [("resnet", "")]
    file.close()


def test_a_config_putting_the_model_on_every_gpu_names_each(tmp_path) -> None:
    spool_dir = tmp_path / "spool"
    spool_dir.mkdir()
    engine = repository(tmp_path, b"instance_group [ { kind: KIND_GPU } ]")
    file, _ = serving(str(spool_dir), engine)
    reader, _ = reader_for(str(spool_dir), listed_on(UUIDS))
    assert gpus_of_infos(reader.read()) == list(UUIDS)
    file.close()


def test_what_the_writer_recorded_and_a_single_gpu_are_as_before(tmp_path) -> None:
    spool_dir = tmp_path / "spool"
    spool_dir.mkdir()
    engine = repository(tmp_path, b"instance_group { gpus: 0 }")
    file, _ = serving(str(spool_dir), engine, gpu_uuid="GPU-recorded")
    reader, gpus = reader_for(str(spool_dir), listed_on(UUIDS))
    gpus.config = None  # type: ignore[assignment]  # never asked: the writer said where its engine is
    totals = reader.read()
    assert gpus_of_infos(totals) == ["GPU-recorded"] and set(totals.per_gpu) == {("resnet", "GPU-recorded")}
    file.close()
    other = tmp_path / "other"
    other.mkdir()
    file, _ = serving(str(other), engine)
    reader, _ = reader_for(str(other), listed_on(UUIDS[2:3]))
    totals = reader.read()
    assert gpus_of_infos(totals) == [UUIDS[2]] and set(totals.per_gpu) == {("resnet", UUIDS[2])}
    file.close()


def test_a_writer_nvml_does_not_list_is_on_no_gpu(tmp_path) -> None:
    spool_dir = tmp_path / "spool"
    spool_dir.mkdir()
    file, _ = serving(str(spool_dir), repository(tmp_path, None))
    reader, _ = reader_for(str(spool_dir), GpuProcesses())
    totals = reader.read()
    assert gpus_of_infos(totals) == [""] and set(totals.per_gpu) == {("resnet", "")}
    file.close()


def test_a_placement_is_kept_and_the_merge_reused(tmp_path) -> None:
    spool_dir = tmp_path / "spool"
    spool_dir.mkdir()
    engine = repository(tmp_path, b"instance_group { gpus: 0 }")
    file, _ = serving(str(spool_dir), engine)
    reader, gpus = reader_for(str(spool_dir), listed_on(UUIDS))
    reads: list[str] = []
    real = gpus.config
    gpus.config = lambda pid, path: reads.append(path) or real(pid, path)  # type: ignore[assignment,func-returns-value]
    first = reader.read()
    second = reader.read()
    assert gpus_of_infos(first) == [UUIDS[0]] and reads == [engine]  # read once, kept PLACED_SECONDS
    assert second.infos is first.infos  # nothing changed: the same merge
    file.close()


def test_the_writer_moving_gpus_is_followed(tmp_path) -> None:
    """The placement is keyed by the GPUs the writer holds: NVML listing it elsewhere places it anew."""
    spool_dir = tmp_path / "spool"
    spool_dir.mkdir()
    file, _ = serving(str(spool_dir), repository(tmp_path, None))
    table = listed_on(UUIDS[:2])
    reader, _ = reader_for(str(spool_dir), table)
    assert gpus_of_infos(reader.read()) == list(UUIDS[:2])
    table.update_sweep((((ME), uuid, 1 << 30) for uuid in UUIDS[2:]), UUIDS)
    assert gpus_of_infos(reader.read()) == list(UUIDS[2:])
    file.close()


def test_a_config_read_that_hangs_is_abandoned(tmp_path) -> None:
    """A model repository on a dead mount: the read is waited for PLACEMENT_READ_SECONDS, then the engine
    is placed on every GPU the writer holds, and the hung read is not asked again for a while."""
    spool_dir = tmp_path / "spool"
    spool_dir.mkdir()
    file, _ = serving(str(spool_dir), repository(tmp_path, b"instance_group { gpus: 0 }"))
    reader, gpus = reader_for(str(spool_dir), listed_on(UUIDS[:2]))
    release = threading.Event()
    gpus.config = lambda pid, path: release.wait(30) and None  # type: ignore[assignment]
    started = time.monotonic()
    try:
        assert gpus_of_infos(reader.read()) == list(UUIDS[:2])
        assert time.monotonic() - started < spool_source.PLACEMENT_READ_SECONDS + 1.0
        assert gpus.reads.unresponsive() == 1
    finally:
        release.set()
        file.close()
