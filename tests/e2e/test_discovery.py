"""Discovery of engines from /proc: real processes, without the library, opening and reading model files.

Each loader here is a real child process (plain Python, no gpuio) driven step by step through a pipe, and
the discovery reads the real /proc of this machine: its descriptors, read positions, open flags and
read_bytes.  Nothing is faked; the GPU of a process is whatever ``gpu_of`` says (NVML's process list in
the exporter), here a table.
"""

from __future__ import annotations

import os
import time

import pytest

from exporter.engines.discovery import Discovery
from gpuio import spool as spool_format
from tests.conftest import ExporterProcess, parse_samples
from tests.e2e.loaders import model

pytestmark = pytest.mark.e2e

def finder(tmp_path, **options) -> Discovery:
    options.setdefault("join_within", 0.0)  # a load ends at its file's close (the join of shards: its own test)
    options.setdefault("require_gpu", False)  # these loaders have no GPU context: the loads are what is tested
    found = Discovery([str(tmp_path)], **options)
    found.sample()  # the first listing: what runs already is not new
    return found


def test_a_triton_layout_load_is_followed_from_open_to_close(tmp_path, loaders) -> None:
    path = model(tmp_path, "repo/resnet50/1/model.plan", 1 << 20)
    found = finder(tmp_path, gpu_of=lambda pid, start: "GPU-aa" if pid == loader.pid else None)
    loader = loaders()
    loader.do("open", path)
    loader.do("read", path, 256 << 10)
    totals = found.sample().totals
    ((key, (count, read, oldest)),) = totals.loads.items()
    st = os.stat(path)
    assert key == ("resnet50", "GPU-aa", (os.major(st.st_dev), os.minor(st.st_dev)))
    assert count == 1 and read == 256 << 10 and time.time() - 5 < oldest <= time.time()
    (info,) = totals.infos["resnet50"]
    assert (info.path, info.gpu_uuid, info.ino, info.size) == (path, "GPU-aa", st.st_ino, 1 << 20)
    assert totals.writers["resnet50"] == [(loader.pid, _start(loader.pid))] and totals.processes["resnet50"] == 1

    loader.do("read", path, 512 << 10)
    assert found.sample().totals.loads[key][1] == 768 << 10
    time.sleep(0.3)
    loader.do("read", path, 1 << 20)
    loader.do("close", path)
    totals = found.sample().totals
    assert totals.loads == {}
    values = totals.engines["resnet50"]
    first, total, _ = spool_format.ENGINE_LAYOUT.histograms["load_read_seconds"]
    assert sum(values[first:total]) == 1 and values[total] >= 0.3
    assert values[spool_format.ENGINE_LAYOUT.counters["load_read_bytes"]] == 1 << 20
    waterfall = totals.waterfalls["resnet50"]
    slot = spool_format.WATERFALL
    assert waterfall[slot["device_bytes"]] + waterfall[slot["cache_bytes"]] == 1 << 20
    assert waterfall[slot["last_read"]] == waterfall[slot["last_wall"]] >= 0.3
    # the process lives on with the engine loaded: it still serves it (info kept, no load in progress)
    assert [item.path for item in totals.infos["resnet50"]] == [path]


def test_a_process_killed_while_loading_abandons_its_load(tmp_path, loaders) -> None:
    path = model(tmp_path, "repo/bert/3/model.onnx")
    found = finder(tmp_path)
    loader = loaders()
    loader.do("open", path)
    loader.do("read", path, 4096)
    assert found.sample().totals.loads
    loader.kill()
    totals = found.sample().totals
    assert totals.loads == {} and totals.abandoned == {("bert", ""): 1.0}
    assert "bert" not in totals.infos  # no live process holds it


def test_a_file_found_open_and_still_is_no_load_until_it_moves(tmp_path, loaders) -> None:
    path = model(tmp_path, "served/ranker.plan")
    loader = loaders()
    loader.do("open", path)
    loader.do("read", path, 4096)
    found = finder(tmp_path)  # the exporter starts now: the file was opened before
    totals = found.sample().totals
    assert totals.loads == {} and [item.path for item in totals.infos["ranker"]] == [path]
    loader.do("read", path, 8192)
    totals = found.sample().totals
    assert [count for count, _, _ in totals.loads.values()] == [1.0]


def test_a_read_found_under_way_counts_from_when_it_was_found(tmp_path, loaders) -> None:
    """The exporter (re)starts while a process reads: the position moving at the next look makes it a
    load that was under way when found, with the bytes read before; a file that stood still at that look
    and moves later is a new read, from then."""
    path = model(tmp_path, "repo/resnet50/1/model.plan", 1 << 20)
    loader = loaders()
    loader.do("open", path)
    loader.do("read", path, 256 << 10)
    found = finder(tmp_path)  # found mid-read, in the first listing
    sighted = time.time()
    loader.do("read", path, 256 << 10)
    ((count, read, oldest),) = found.sample().totals.loads.values()
    assert count == 1 and read == 512 << 10 and oldest <= sighted
    loader.do("read", path, 1 << 20)
    loader.do("close", path)
    values = found.sample().totals.engines["resnet50"]
    assert values[spool_format.ENGINE_LAYOUT.counters["load_read_bytes"]] == 1 << 20

    held = model(tmp_path, "repo/bert/1/model.plan", 1 << 20)
    loader.do("open", held)
    loader.do("read", held, 4096)
    later = finder(tmp_path)
    later.sample()  # still at the next look
    loader.do("read", held, 8192)
    ((count, read, _),) = later.sample().totals.loads.values()
    assert count == 1 and read == 8192


def test_a_reader_at_fixed_offsets_is_no_load_for_ever(tmp_path, loaders) -> None:
    """pread() leaves the position where it is: a load seen from its open ends ``idle`` seconds later,
    even while the process keeps reading (at most three times that while it waits on IO)."""
    path = model(tmp_path, "models/pread.engine")
    found = finder(tmp_path, idle=0.3)
    loader = loaders()
    loader.do("open", path)
    assert found.sample().totals.loads
    time.sleep(0.4)
    assert found.sample().totals.loads == {}


def test_a_load_that_stands_still_ends_at_its_last_movement(tmp_path, loaders) -> None:
    path = model(tmp_path, "models/idle.engine")
    found = finder(tmp_path, idle=0.4)
    loader = loaders()
    loader.do("open", path)
    loader.do("read", path, 1 << 19)
    assert found.sample().totals.loads
    time.sleep(0.6)
    totals = found.sample().totals
    assert totals.loads == {}
    first, total, _ = spool_format.ENGINE_LAYOUT.histograms["load_read_seconds"]
    assert sum(totals.engines["idle"][first:total]) == 1 and totals.engines["idle"][total] < 0.4


def test_what_is_not_a_model_read_is_left_alone(tmp_path, loaders) -> None:
    written = str(tmp_path / "models" / "download.safetensors")
    os.makedirs(os.path.dirname(written))
    unmatched = model(tmp_path, "models/config.pbtxt")
    outside = model(tmp_path.parent, f"{tmp_path.name}-elsewhere/outside.plan")
    tiny = model(tmp_path, "models/stub.plan", 4096)  # under MIN_MODEL_BYTES: no load a disk holds up
    package = model(tmp_path, "venv/lib/python3.12/site-packages/torch/model.pt")  # Python's own files
    data = model(tmp_path, "data/storm.bin")  # *.bin is data as often as weights: not by default
    found = finder(tmp_path)
    loader = loaders()
    loader.do("write", written)  # a download: written, not loaded
    for path in (unmatched, outside, tiny, package, data):
        loader.do("open", path)
    totals = found.sample().totals
    assert totals.infos == {} and totals.loads == {} and totals.engines == {}


def test_a_process_using_the_library_is_left_to_the_spool(tmp_path, loaders) -> None:
    path = model(tmp_path, "repo/ranker/1/model.plan")
    spool = tmp_path / "spool" / f"gpuio-1-2-0000000000000003{spool_format.SUFFIX}"
    spool.parent.mkdir()
    spool.write_bytes(b"\0" * 64)
    found = finder(tmp_path)
    st = os.stat(spool)
    found.library_files = frozenset({(st.st_dev, st.st_ino)})
    loader = loaders()
    loader.do("open", str(spool))
    loader.do("open", path)
    loader.do("read", path, 4096)
    totals = found.sample().totals
    assert totals.infos == {} and totals.loads == {}
    found.library_files = frozenset()  # a spool file nobody reads: the process is discovered
    assert found.sample().totals.infos


def test_a_process_holding_its_own_spool_file_is_the_librarys_before_any_scrape(tmp_path, loaders) -> None:
    """The library names its file after its process's start time: recognised at once, whichever
    directory, before the engines collector has read it."""
    path = model(tmp_path, "repo/ranker/1/model.plan")
    found = finder(tmp_path)
    loader = loaders()
    own = tmp_path / f"gpuio-7-{_start(loader.pid)}-00000000000000ab{spool_format.SUFFIX}"
    own.write_bytes(b"\0" * 64)
    loader.do("open", str(own))
    loader.do("open", path)
    assert found.sample().totals.infos == {}


def test_a_process_without_a_gpu_context_loads_no_engine_until_it_has_one(tmp_path, loaders) -> None:
    """A copy, a checksum or a backup reading model files is no engine load: only processes NVML lists
    with a GPU context count, and what one loaded before it was listed counts from then on."""
    path = model(tmp_path, "repo/resnet50/1/model.plan")
    on_gpus: list[tuple[int, int]] = []
    found = finder(tmp_path, require_gpu=True, gpu_processes=lambda: on_gpus)
    copier = loaders()
    copier.do("open", path)
    copier.do("read", path, 1 << 20)
    copier.do("close", path)
    totals = found.sample().totals
    assert totals.infos == {} and totals.loads == {} and totals.engines == {}
    copier.kill()
    assert found.sample().totals.abandoned == {}  # a tool killed while reading abandoned nothing

    server = loaders()
    server.do("open", path)
    server.do("read", path, 4096)
    assert found.sample().totals.engines == {}  # loading, not on a GPU yet
    server.do("close", path)
    assert found.sample().totals.engines == {}  # its load ended before NVML listed it
    on_gpus.append((server.pid, _start(server.pid)))  # NVML lists it now: its load counts
    totals = found.sample().totals
    first, total, _ = spool_format.ENGINE_LAYOUT.histograms["load_read_seconds"]
    assert sum(totals.engines["resnet50"][first:total]) == 1


def test_a_pass_is_bounded_and_the_rotation_reaches_everyone(tmp_path, loaders) -> None:
    """A budget far below the node's descriptors: processes holding model files are found in turn, and
    once found they are followed every pass."""
    paths = [model(tmp_path, f"models/m{index}.plan") for index in range(3)]
    started = [loaders() for _ in paths]
    for loader, path in zip(started, paths, strict=True):
        loader.do("open", path)
    found = Discovery([str(tmp_path)], fd_entries_per_pass=64, require_gpu=False)
    passes = 0
    while len(found.sample().totals.infos) < 3:
        passes += 1
        assert passes < 2000, "the rotation never came round"
    figures = found.sample().figures
    assert figures.processes == 3 and figures.looked_at >= 3


def test_gpu_processes_are_followed_first(tmp_path, loaders) -> None:
    path = model(tmp_path, "models/first.plan")
    loader = loaders()
    loader.do("open", path)
    found = Discovery([str(tmp_path)], fd_entries_per_pass=8, gpu_processes=lambda: [(loader.pid, _start(loader.pid))],
                      gpu_of=lambda pid, start: "GPU-bb")
    totals = found.sample().totals
    assert [item.gpu_uuid for item in totals.infos["first"]] == ["GPU-bb"]


@pytest.mark.root
def test_processes_it_may_not_look_at_are_counted_not_guessed(tmp_path, loaders) -> None:
    """An exporter without the right to read other users' descriptors (here: a fork of this test turned
    nobody, the modules already loaded) counts the processes that refused it and reports none of them."""
    if os.geteuid() != 0:
        pytest.skip("needs root: a process of another user")
    path = model(tmp_path, "models/root-owned.plan")
    os.chmod(tmp_path, 0o755)
    loader = loaders()
    loader.do("open", path)
    reading, writing = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - the child reports through the pipe
        try:
            os.setgid(65534)
            os.setuid(65534)
            figures_and_totals = Discovery([str(tmp_path)]).sample()
            os.write(writing, f"{figures_and_totals.figures.not_permitted} {len(figures_and_totals.totals.infos)}"
                     .encode())
        finally:
            os._exit(0)
    os.close(writing)
    answer = os.read(reading, 100).decode().split()
    os.close(reading)
    os.waitpid(child, 0)
    refused, infos = int(answer[0]), int(answer[1])
    assert refused >= 1 and infos == 0


def _start(pid: int) -> int:
    from exporter.host import procstat
    return procstat.start_ticks(pid)


def test_the_exporter_serves_a_discovered_load_joined_to_its_gpu_and_disk(tmp_path, loaders) -> None:
    """The whole path in a real exporter (its NVML the fake, listing the loader on its GPU): a process
    without the library reading a Triton-layout model is served through the engine families the rules
    join -- info with path, device and GPU, the load in progress per engine and GPU, the process by
    source -- and its finished load through the load histogram and waterfall."""
    path = model(tmp_path, "repo/resnet50/1/model.plan", 4 << 20)
    uuid = "GPU-d15c0000-0000-0000-0000-000000000001"
    listed = tmp_path / "gpu-processes"
    exporter = ExporterProcess(["--collector.disable-defaults", "--collector.engines", "--collector.nvml",
                                f"--collector.engines.spool-dir={tmp_path / 'spool'}",
                                f"--collector.engines.path-include={tmp_path}", "--collector.nvml.slow-interval=1s",
                                "--collector.engines.discover-interval=200ms"],
                               env={"GPUIO_FAKE_GPUS": uuid, "GPUIO_FAKE_GPU_PROCESSES": str(listed)},
                               module="tests.e2e.fake_gpu_exporter").start()
    try:
        loader = loaders()
        listed.write_text(f"{loader.pid} {uuid}\n")
        loader.do("open", path)
        loader.do("read", path, 1 << 20)
        engine_gpu = frozenset({("engine", "resnet50"), ("gpu_uuid", uuid)})
        samples = wait_for(exporter, lambda s: s.get(("gpuio_engine_loads_in_progress", engine_gpu)) == 1)
        assert samples[("gpuio_engine_processes", frozenset({("engine", "resnet50"), ("source", "proc")}))] == 1
        (info,) = [dict(labels) for name, labels in samples if name == "gpuio_engine_info"]
        assert (info["path"], info["gpu_uuid"]) == (path, uuid)
        assert samples[("gpuio_engine_load_in_progress_read_bytes", engine_gpu)] >= 1 << 20
        assert ("gpuio_engine_process_info", frozenset({("engine", "resnet50"), ("pid", str(loader.pid))})) in samples
        loader.do("read", path, 4 << 20)
        loader.do("close", path)
        engine = frozenset({("engine", "resnet50")})
        samples = wait_for(exporter, lambda s: s.get(("gpuio_engine_load_read_seconds_count", engine)) == 1)
        assert samples[("gpuio_engine_loads_in_progress", engine_gpu)] == 0
        assert samples[("gpuio_engine_load_read_bytes_total", engine)] == 4 << 20
        assert samples[("gpuio_engine_last_load_read_bytes", engine | {("source", "device")})] \
            + samples[("gpuio_engine_last_load_read_bytes", engine | {("source", "page_cache")})] == 4 << 20
        assert samples[("gpuio_engine_discovery_processes", frozenset())] == 1
    finally:
        exporter.stop()


def wait_for(exporter: ExporterProcess, condition, timeout: float = 15.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        samples = parse_samples(exporter.scrape())
        if condition(samples):
            return samples
        assert time.monotonic() < deadline, sorted(
            (name, sorted(labels), value) for (name, labels), value in samples.items() if "engine" in name)
        time.sleep(0.2)

