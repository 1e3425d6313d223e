"""Discovery against a hostile tenant: real processes that try to blind it or make it count what did not happen.

Each attacker here is a real process on this machine, and discovery reads the real /proc; only NVML's
process list (which processes hold a GPU context) is a table, as in tests/e2e/test_discovery.py.  Each test
is one attack of the hostile-tenant review: blinding by many descriptors, by many processes, by seeking,
by many engine names, by many shards, and by a pid NVML listed for another process.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator

import pytest

from exporter.engines import discovery
from exporter.engines.discovery import Discovery
from exporter.host import procstat
from gpuio import spool as spool_format
from tests.conftest import evict
from tests.e2e.loaders import model

pytestmark = pytest.mark.e2e

NOBODY = 65534
LOAD_COUNT = spool_format.ENGINE_LAYOUT.histograms["load_read_seconds"]
LOAD_BYTES = spool_format.ENGINE_LAYOUT.counters["load_read_bytes"]

# Holds a model and `extra` more descriptors (of /dev/null), as `uid`; says "ok" once it does, then waits.
HOARDER = textwrap.dedent("""
    import os, resource, sys
    path, extra, uid = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    resource.setrlimit(resource.RLIMIT_NOFILE, (extra + 64, extra + 64))
    if uid != os.getuid():
        os.setgid(uid)
        os.setuid(uid)
    handle = open(path, "rb")
    held = [os.open("/dev/null", os.O_RDONLY) for _ in range(extra)]
    print("ok", flush=True)
    sys.stdin.read()
""")

def _start(pid: int) -> int:
    return procstat.start_ticks(pid)


def _loads(totals, engine: str) -> float:
    first, total, _ = LOAD_COUNT
    return sum(totals.engines.get(engine, [0.0] * spool_format.ENGINE_LAYOUT.size)[first:total])


@pytest.fixture
def shared_models() -> Iterator[str]:
    """A model directory any user may read (pytest's own is root's alone)."""
    directory = tempfile.mkdtemp(prefix="gpuio-discovery-")
    os.chmod(directory, 0o755)
    yield directory
    subprocess.run(["rm", "-rf", directory], check=False)


def _hoard(path: str, extra: int, uid: int) -> subprocess.Popen:
    hoarder = subprocess.Popen([sys.executable, "-c", HOARDER, path, str(extra), str(uid)],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert hoarder.stdout is not None and hoarder.stdout.readline().strip() == "ok"
    return hoarder


def _stop(processes: list[subprocess.Popen]) -> None:
    for process in processes:
        process.kill()
    for process in processes:
        process.wait()


@pytest.mark.root
def test_another_users_processes_full_of_descriptors_do_not_hide_a_new_server(shared_models, loaders) -> None:
    """Four processes of uid 65534, each holding a model and 4,100 descriptors (together the whole
    priority budget of a pass, looked at first as processes followed): the new inference server must
    still be found at the next pass."""
    if os.geteuid() != 0:
        pytest.skip("needs root: processes of another user")
    bait = model_file(shared_models, "bait/model.plan")
    hoarders = [_hoard(bait, 4100, NOBODY) for _ in range(4)]
    try:
        found = Discovery([shared_models], require_gpu=False, join_within=0.0)
        for _ in range(100):  # the rotation reaches the hoarders, which are followed from then on
            if found.sample().figures.processes >= 4:
                break
        assert found.sample().figures.processes == 4
        server = loaders()
        served = model_file(shared_models, "served/model.plan")
        server.do("open", served)
        server.do("read", served, 4096)
        found.gpu_processes = lambda: [(server.pid, _start(server.pid))]
        totals = found.sample().totals
        assert "served" in totals.infos, sorted(totals.infos)
    finally:
        _stop(hoarders)


def test_a_thousand_idle_readers_do_not_fill_the_table_against_a_gpu_process(tmp_path, loaders) -> None:
    """1,030 processes holding a model open on their standard input (`sleep 900 < model`) are not on a
    GPU: they take at most their owner's quarter of the table, and a server on a GPU is followed."""
    bait = model(tmp_path, "bait/model.plan")
    sleepers = [subprocess.Popen(["sleep", "900"], stdin=open(bait, "rb")) for _ in range(1030)]  # noqa: SIM115
    try:
        found = Discovery([str(tmp_path)], join_within=0.0)
        for _ in range(50):
            found.sample()
        assert found.sample().figures.processes <= discovery.MAX_TRACKED_OFF_GPU_PER_OWNER
        server = loaders()
        served = model(tmp_path, "served/model.plan")
        found.gpu_processes = lambda: [(server.pid, _start(server.pid))]
        server.do("open", served)
        server.do("read", served, 4096)
        figures_and_totals = found.sample()
        assert "served" in figures_and_totals.totals.infos
        assert dict(figures_and_totals.figures.dropped).get("process", 0) > 0  # the sleepers left out, counted
    finally:
        _stop(sleepers)


def test_seeking_back_and_forth_counts_no_bytes_that_were_not_read(tmp_path, loaders) -> None:
    """A model read 1 MiB with 1 TiB seeks back and forth between passes: the load's bytes, in progress and
    finished, are at most what was read (at most the file), not the distance the position travelled."""
    path = model(tmp_path, "repo/seeker/1/model.plan", 2 << 20)
    seeker = loaders()
    found = Discovery([str(tmp_path)], require_gpu=False, join_within=0.0)
    found.sample()
    seeker.do("open", path)
    seeker.do("read", path, 1 << 20)
    found.sample()
    for _ in range(3):
        seeker.do("seek", path, 1 << 40)
        loads = found.sample().totals.loads
        assert all(read <= 2 << 20 for _, read, _ in loads.values()), loads
        seeker.do("seek", path, 0)
        found.sample()
    seeker.do("close", path)
    totals = found.sample().totals
    assert _loads(totals, "seeker") == 1
    assert totals.engines["seeker"][LOAD_BYTES] <= 2 << 20


def test_many_engine_names_never_make_a_counter_fall(tmp_path, loaders, monkeypatch) -> None:
    """Engines past the table's bound: an engine's history of loads is not forgotten to make room (its
    finished-load counter would fall from 1 to 0); the newcomers' loads are counted as dropped."""
    monkeypatch.setattr(discovery, "MAX_ENGINES", 32)
    monkeypatch.setattr(discovery, "MAX_ENGINES_PER_OWNER", 32)
    found = Discovery([str(tmp_path)], require_gpu=False, join_within=0.0)
    found.sample()
    legit = loaders()
    path = model(tmp_path, "repo/legit/1/model.plan")
    legit.do("open", path)
    found.sample()
    legit.do("read", path, 1 << 20)
    legit.do("close", path)
    assert _loads(found.sample().totals, "legit") == 1
    legit.kill()
    flood = loaders()
    for index in range(40):
        junk = model(tmp_path, f"junk/j{index}.plan")
        flood.do("open", junk)
        found.sample()
        flood.do("read", junk, 1 << 20)
        flood.do("close", junk)
        found.sample()
    figures_and_totals = found.sample()
    assert _loads(figures_and_totals.totals, "legit") == 1
    assert dict(figures_and_totals.figures.dropped).get("engine", 0) >= 8


def test_a_checkpoint_of_100_shards_is_one_load_of_all_its_bytes(tmp_path, loaders) -> None:
    """A process reading a 100-shard checkpoint one shard after another, a pass falling between every two
    shards: one load of the checkpoint in progress from the first shard to the last (never ending and
    starting again between shards), then one finished load of all its bytes."""
    shard_bytes = 1 << 20
    found = Discovery([str(tmp_path)], require_gpu=False, join_within=2.0)
    found.sample()
    reader = loaders()
    for index in range(1, 101):
        shard = model(tmp_path, f"ckpt/model-{index:05d}-of-00100.safetensors", shard_bytes)
        reader.do("open", shard)
        found.sample()
        reader.do("read", shard, shard_bytes)
        reader.do("close", shard)
        totals = found.sample().totals
        ((count, read, _),) = [value for key, value in totals.loads.items() if key[0] == "ckpt"]
        assert (count, read) == (1, index * shard_bytes), index
        assert _loads(totals, "ckpt") == 0, index
    time.sleep(2.0)
    totals = found.sample().totals
    assert totals.loads == {}
    assert _loads(totals, "ckpt") == 1
    assert totals.engines["ckpt"][LOAD_BYTES] == 100 * shard_bytes
    assert totals.waterfalls["ckpt"][spool_format.WATERFALL["file_bytes"]] == 100 * shard_bytes


def test_two_models_loading_at_once_are_two_loads(tmp_path, loaders) -> None:
    """The join is per engine: a process reading two models' files at once makes two loads, each its own."""
    found = Discovery([str(tmp_path)], require_gpu=False, join_within=0.0)
    found.sample()
    reader = loaders()
    first, second = model(tmp_path, "repo/a/1/model.plan"), model(tmp_path, "repo/b/1/model.plan", 2 << 20)
    for path in (first, second):
        reader.do("open", path)
    found.sample()
    reader.do("read", first, 1 << 20)
    reader.do("read", second, 2 << 20)
    reader.do("close", first)
    reader.do("close", second)
    totals = found.sample().totals
    assert (_loads(totals, "a"), _loads(totals, "b")) == (1, 1)
    assert (totals.engines["a"][LOAD_BYTES], totals.engines["b"][LOAD_BYTES]) == (1 << 20, 2 << 20)


def test_a_loader_that_maps_the_file_and_closes_it_is_seen_loading(tmp_path, loaders) -> None:
    """safetensors' and llama.cpp's way: map the whole file, close its descriptor, fault the tensors in.  No
    descriptor holds the file; the maps do, and the process's device reads move the load: in progress while
    they grow, finished once they reached the file's size, its bytes what came from the device."""
    size = 64 << 20  # past the disk's read-ahead, which a fault may read whole (8 MiB here)
    path = model(tmp_path, "repo/llama/1/model.gguf", size)
    evict(path)
    found = Discovery([str(tmp_path)], require_gpu=False, join_within=0.0)
    found.sample()
    loader = loaders()
    loader.do("map", path)
    totals = found.sample().totals
    (info,) = totals.infos["llama"]
    assert (info.path, info.size) == (path, size)
    ((key, (count, read, _)),) = totals.loads.items()
    assert key[0] == "llama" and count == 1
    loader.do("fault", path, 4 << 20)
    ((count, read, _),) = found.sample().totals.loads.values()
    assert count == 1 and 4 << 20 <= read < size
    loader.do("fault", path, size)
    totals = found.sample().totals
    assert totals.loads == {}
    assert _loads(totals, "llama") == 1
    assert size // 2 <= totals.engines["llama"][LOAD_BYTES] <= size


def test_a_mapping_found_at_start_is_no_load_and_other_reads_do_not_make_one(tmp_path, loaders) -> None:
    """A server that mapped its model before discovery looked (a restart of the exporter) and then reads
    other files from the disk: it holds the engine (info), it loads nothing."""
    path = model(tmp_path, "repo/served/1/model.safetensors", 4 << 20)
    data = model(tmp_path, "inputs.bin", 8 << 20)
    loader = loaders()
    loader.do("map", path)
    loader.do("fault", path, 4 << 20)
    found = Discovery([str(tmp_path)], require_gpu=False, join_within=0.0)
    found.sample()
    evict(data)
    loader.do("open", data)
    loader.do("read", data, 8 << 20)
    totals = found.sample().totals
    assert [info.path for info in totals.infos["served"]] == [path]
    assert totals.loads == {} and _loads(totals, "served") == 0


def test_a_process_on_a_pid_nvml_listed_for_another_is_no_inference_process(tmp_path, loaders) -> None:
    """NVML's sweep listed pid P with its start time; by the pass, P is a process that started later (the
    pid was reused): a copy tool there is no inference process, its reads no load."""
    path = model(tmp_path, "repo/resnet50/1/model.plan")
    copier = loaders()
    found = Discovery([str(tmp_path)], gpu_processes=lambda: [(copier.pid, _start(copier.pid) - 1)], join_within=0.0)
    found.sample()
    copier.do("open", path)
    found.sample()
    copier.do("read", path, 1 << 20)
    copier.do("close", path)
    time.sleep(0.05)
    totals = found.sample().totals
    assert totals.engines == {} and totals.infos == {}


def model_file(directory: str, relative: str, size: int = 1 << 20) -> str:
    """A model under a directory every user may read."""
    path = os.path.join(directory, relative)
    os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
    os.chmod(os.path.dirname(path), 0o755)
    with open(path, "wb") as handle:
        handle.write(os.urandom(size))
    os.chmod(path, 0o644)
    return path


def test_processes_that_keep_loading_off_the_gpu_give_way_to_a_gpu_process(tmp_path, loaders, monkeypatch) -> None:
    """A full table of processes off the GPU that keep "loading" (moving their position by seeks and reads):
    none of their loads counts yet, so a server on a GPU still takes the place of one of them."""
    monkeypatch.setattr(discovery, "MAX_TRACKED_PROCESSES", 4)
    monkeypatch.setattr(discovery, "MAX_TRACKED_OFF_GPU_PER_OWNER", 4)
    found = Discovery([str(tmp_path)], join_within=0.0)
    found.sample()
    busy = [loaders() for _ in range(4)]
    for index, loader in enumerate(busy):
        path = model(tmp_path, f"busy/b{index}.plan", 2 << 20)
        loader.do("open", path)
    for round_ in range(3):
        for index, loader in enumerate(busy):
            loader.do("read", str(tmp_path / f"busy/b{index}.plan"), 4096)
            loader.do("seek", str(tmp_path / f"busy/b{index}.plan"), 4096 * (round_ % 2))
        found.sample()
    assert found.sample().figures.processes == 4
    server = loaders()
    served = model(tmp_path, "served/model.plan")
    found.gpu_processes = lambda: [(server.pid, _start(server.pid))]
    server.do("open", served)
    server.do("read", served, 4096)
    assert "served" in found.sample().totals.infos


def test_descriptors_past_the_cap_are_said_not_looked_at(tmp_path) -> None:
    """A process with more descriptors than discovery lists (4,096): those past them are never looked at, and
    that is counted once for the process, not hidden."""
    path = model(tmp_path, "late/model.plan")
    hoarder = _hoard(path, discovery.MAX_FDS_PER_PROCESS + 100, os.getuid())
    try:
        found = Discovery([str(tmp_path)], require_gpu=False, join_within=0.0)
        for _ in range(3):
            figures = found.sample().figures
        assert dict(figures.dropped).get("descriptors") == 1
    finally:
        _stop([hoarder])
