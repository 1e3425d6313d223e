"""Which GPUs a discovered model is on, for a process on several GPUs (one Triton server on every GPU).

Real loader processes (plain Python) read Triton-layout model repositories with real config.pbtxt files
and real environments; NVML's process list (which GPUs each process holds, its used memory on each) is a
table here, as the nvml collector would fill it on a GPU machine (tests/gpu/multi_gpu_check.py does it
on two H200s).
"""

from __future__ import annotations

import pytest

from exporter.engines.discovery import Discovery
from exporter.host import procstat
from tests.e2e.loaders import model

pytestmark = pytest.mark.e2e

@pytest.fixture(autouse=True)
def _no_gpus_given_by_the_environment(monkeypatch) -> None:
    """The loaders inherit this process's environment: a GPU host's own CUDA_VISIBLE_DEVICES or
    NVIDIA_VISIBLE_DEVICES (real GPUs' UUIDs) would hide the table's GPUs from them."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("NVIDIA_VISIBLE_DEVICES", raising=False)


GPUS = tuple(f"GPU-{index}0000000-0000-0000-0000-00000000000{index}" for index in range(4))
GIB = 1 << 30


class Nvml:
    """NVML's process list as the engines collector gets it: the GPUs of each process, its memory on each."""

    def __init__(self) -> None:
        self.gpus: dict[int, tuple[str, ...]] = {}
        self.memory: dict[int, dict[str, int]] = {}

    def discovery(self, root: str) -> Discovery:
        found = Discovery([root], join_within=0.0, gpu_processes=self.processes, gpus_of=self.gpus_of,
                          memory_of=lambda pid, start: dict(self.memory.get(pid, {})), ordered_gpus=lambda: GPUS)
        found.sample()
        return found

    def processes(self) -> list[tuple[int, int]]:
        return [(pid, procstat.start_ticks(pid)) for pid in self.gpus]

    def gpus_of(self, pid: int, start: int) -> tuple[str, ...]:
        return self.gpus.get(pid, ())


def triton_model(root, name: str, config: str | None, size: int = 1 << 20) -> str:
    path = model(root, f"repo/{name}/1/model.plan", size)
    if config is not None:
        (root / "repo" / name / "config.pbtxt").write_text(config)
    return path


def load(loader, path: str, size: int = 1 << 20) -> None:
    loader.do("open", path)
    loader.do("read", path, size // 2)


def placed(totals, engine: str) -> set[str]:
    return {info.gpu_uuid for info in totals.infos[engine]}


def loading_on(totals, engine: str) -> set[str]:
    return {key[1] for key, (count, _, _) in totals.loads.items() if key[0] == engine and count}


def test_one_server_on_four_gpus_places_each_model_where_its_config_says(tmp_path, loaders) -> None:
    """Two models with instance groups on GPUs 0,1 and 2,3, one without any (Triton's default: every GPU):
    each model's info and its load in progress are on its GPUs, and only there."""
    detector = triton_model(tmp_path, "detector", 'name: "detector"\ninstance_group [ { count: 2 kind: KIND_GPU '
                                                  'gpus: [ 0, 1 ] } ]\n')
    ranker = triton_model(tmp_path, "ranker", 'instance_group { kind: KIND_GPU gpus: 2 gpus: 3 }')
    embedder = triton_model(tmp_path, "embedder", 'name: "embedder"\nmax_batch_size: 8\n')
    nvml = Nvml()
    found = nvml.discovery(str(tmp_path))
    server = loaders()
    nvml.gpus[server.pid] = GPUS
    for path in (detector, ranker, embedder):
        load(server, path)
    totals = found.sample().totals
    assert placed(totals, "detector") == loading_on(totals, "detector") == set(GPUS[:2])
    assert placed(totals, "ranker") == loading_on(totals, "ranker") == set(GPUS[2:])
    assert placed(totals, "embedder") == loading_on(totals, "embedder") == set(GPUS)


def test_config_ordinals_are_the_processs_own_cuda_devices(tmp_path, loaders) -> None:
    """A server started with CUDA_VISIBLE_DEVICES=3,1: its CUDA device 0 is the node's GPU 3."""
    path = triton_model(tmp_path, "detector", "instance_group [ { kind: KIND_GPU, gpus: [0] } ]")
    nvml = Nvml()
    found = nvml.discovery(str(tmp_path))
    server = loaders(env={"CUDA_VISIBLE_DEVICES": "3,1"})
    nvml.gpus[server.pid] = (GPUS[1], GPUS[3])
    load(server, path)
    assert placed(found.sample().totals, "detector") == {GPUS[3]}


def test_in_a_pod_given_two_gpus_the_ordinals_are_among_them(tmp_path, loaders) -> None:
    """A pod the device plugin gave the node's GPUs 1 and 3 (NVIDIA_VISIBLE_DEVICES): its CUDA device 1 is
    the node's GPU 3, not the node's GPU 1."""
    path = triton_model(tmp_path, "detector", "instance_group [ { kind: KIND_GPU, gpus: [1] } ]")
    nvml = Nvml()
    found = nvml.discovery(str(tmp_path))
    server = loaders(env={"NVIDIA_VISIBLE_DEVICES": f"{GPUS[3]},{GPUS[1]}"})
    nvml.gpus[server.pid] = (GPUS[1], GPUS[3])
    load(server, path)
    assert placed(found.sample().totals, "detector") == {GPUS[3]}


def test_without_a_config_the_gpu_its_memory_grew_on_places_the_model(tmp_path, loaders) -> None:
    """No config.pbtxt: the model goes where the process's used memory grew while it read the file; until
    that shows (NVML's list is read every 10 s), on every GPU the process holds."""
    path = triton_model(tmp_path, "resnet", None)
    nvml = Nvml()
    found = nvml.discovery(str(tmp_path))
    server = loaders()
    nvml.gpus[server.pid] = GPUS[:2]
    nvml.memory[server.pid] = {GPUS[0]: GIB, GPUS[1]: GIB}
    load(server, path)
    totals = found.sample().totals
    assert placed(totals, "resnet") == loading_on(totals, "resnet") == set(GPUS[:2])
    nvml.memory[server.pid] = {GPUS[0]: GIB + (40 << 20), GPUS[1]: 3 * GIB}  # the weights went to GPU 1
    totals = found.sample().totals
    assert placed(totals, "resnet") == loading_on(totals, "resnet") == {GPUS[1]}


def test_a_config_on_the_cpu_places_nothing_and_a_malformed_one_falls_back(tmp_path, loaders) -> None:
    on_cpu = triton_model(tmp_path, "tokenizer", "instance_group [ { kind: KIND_CPU } ]")
    broken = triton_model(tmp_path, "broken", "instance_group [ { kind: KIND_GPU gpus: [ 0, ")
    nvml = Nvml()
    found = nvml.discovery(str(tmp_path))
    server = loaders()
    nvml.gpus[server.pid] = GPUS[:2]
    load(server, on_cpu)
    load(server, broken)
    totals = found.sample().totals
    assert placed(totals, "tokenizer") == {""}
    assert placed(totals, "broken") == set(GPUS[:2])


def test_a_server_killed_while_loading_abandons_the_load_on_each_gpu_of_the_model(tmp_path, loaders) -> None:
    """A crash loop of one server on four GPUs: each kill abandons the model's load on both of its GPUs."""
    path = triton_model(tmp_path, "detector", "instance_group [ { kind: KIND_GPU gpus: [ 1, 2 ] } ]")
    nvml = Nvml()
    found = nvml.discovery(str(tmp_path))
    for attempt in range(1, 3):
        server = loaders()
        nvml.gpus[server.pid] = GPUS
        load(server, path)
        assert loading_on(found.sample().totals, "detector") == set(GPUS[1:3])
        server.kill()
        totals = found.sample().totals
        assert totals.abandoned == {("detector", GPUS[1]): attempt, ("detector", GPUS[2]): attempt}


def test_a_symlinked_or_huge_config_is_not_read(tmp_path, loaders) -> None:
    """A tenant's config.pbtxt pointing elsewhere (a symlink) or a FIFO never holds the pass or places by it."""
    import os
    path = triton_model(tmp_path, "sneaky", None)
    os.symlink("/etc/hostname", tmp_path / "repo" / "sneaky" / "config.pbtxt")
    fifo_path = triton_model(tmp_path, "fifo", None)
    os.mkfifo(tmp_path / "repo" / "fifo" / "config.pbtxt")
    nvml = Nvml()
    found = nvml.discovery(str(tmp_path))
    server = loaders()
    nvml.gpus[server.pid] = GPUS[:2]
    load(server, path)
    load(server, fifo_path)
    totals = found.sample().totals
    assert placed(totals, "sneaky") == placed(totals, "fifo") == set(GPUS[:2])


def test_the_exporter_serves_a_two_gpu_servers_models_each_on_its_gpu(tmp_path, loaders) -> None:
    """The whole path in a real exporter, its NVML the fake listing one real process on two GPUs: each model
    is served on its GPU (info, load in progress), none on gpu_uuid ""."""
    from tests.conftest import ExporterProcess
    from tests.e2e.test_discovery import wait_for

    uuids = GPUS[:2]
    first = triton_model(tmp_path, "alpha", "instance_group [ { kind: KIND_GPU gpus: [ 0 ] } ]", 4 << 20)
    second = triton_model(tmp_path, "beta", "instance_group [ { kind: KIND_GPU gpus: [ 1 ] } ]", 4 << 20)
    listed = tmp_path / "gpu-processes"
    exporter = ExporterProcess(["--collector.disable-defaults", "--collector.engines", "--collector.nvml",
                                f"--collector.engines.spool-dir={tmp_path / 'spool'}",
                                f"--collector.engines.path-include={tmp_path}", "--collector.nvml.slow-interval=1s",
                                "--collector.engines.discover-interval=200ms"],
                               env={"GPUIO_FAKE_GPUS": ",".join(uuids), "GPUIO_FAKE_GPU_PROCESSES": str(listed)},
                               module="tests.e2e.fake_gpu_exporter").start()
    try:
        server = loaders()
        listed.write_text("".join(f"{server.pid} {uuid}\n" for uuid in uuids))
        wait_for(exporter, lambda s: s.get(("gpuio_gpu_processes", frozenset({("gpu", "1"), ("uuid", uuids[1])}))) == 1)
        for path in (first, second):
            load(server, path, 4 << 20)

        def loading(samples, engine: str, uuid: str):
            return samples.get(("gpuio_engine_loads_in_progress", frozenset({("engine", engine), ("gpu_uuid", uuid)})))

        samples = wait_for(exporter, lambda s: loading(s, "alpha", uuids[0]) == 1 and loading(s, "beta", uuids[1]) == 1)
        infos = sorted((dict(labels)["engine"], dict(labels)["gpu_uuid"]) for name, labels in samples
                       if name == "gpuio_engine_info")
        assert infos == [("alpha", uuids[0]), ("beta", uuids[1])]
        assert loading(samples, "alpha", uuids[1]) is None and loading(samples, "beta", uuids[0]) is None
    finally:
        exporter.stop()
