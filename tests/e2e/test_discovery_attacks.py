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

from exporter import procstat
from exporter.engines import discovery
from exporter.engines.discovery import Discovery
from gpuio import spool as spool_format
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
        found = Discovery([shared_models], require_gpu=False)
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
        found = Discovery([str(tmp_path)])
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
    found = Discovery([str(tmp_path)], require_gpu=False)
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
    found = Discovery([str(tmp_path)], require_gpu=False)
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


def test_a_checkpoint_of_100_shards_is_counted_whole(tmp_path, loaders) -> None:
    """A process reading a 100-shard checkpoint one shard after another: every shard's load counts (a
    closed shard whose load is over makes room for the next), 100 loads of the checkpoint, all its bytes."""
    shard_bytes = 1 << 20
    found = Discovery([str(tmp_path)], require_gpu=False)
    found.sample()
    reader = loaders()
    for index in range(1, 101):
        shard = model(tmp_path, f"ckpt/model-{index:05d}-of-00100.safetensors", shard_bytes)
        reader.do("open", shard)
        found.sample()
        reader.do("read", shard, shard_bytes)
        reader.do("close", shard)
    totals = found.sample().totals
    assert _loads(totals, "ckpt") == 100
    assert totals.engines["ckpt"][LOAD_BYTES] == 100 * shard_bytes


def test_a_process_on_a_pid_nvml_listed_for_another_is_no_inference_process(tmp_path, loaders) -> None:
    """NVML's sweep listed pid P with its start time; by the pass, P is a process that started later (the
    pid was reused): a copy tool there is no inference process, its reads no load."""
    path = model(tmp_path, "repo/resnet50/1/model.plan")
    copier = loaders()
    found = Discovery([str(tmp_path)], gpu_processes=lambda: [(copier.pid, _start(copier.pid) - 1)])
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
    found = Discovery([str(tmp_path)])
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
        found = Discovery([str(tmp_path)], require_gpu=False)
        for _ in range(3):
            figures = found.sample().figures
        assert dict(figures.dropped).get("descriptors") == 1
    finally:
        _stop([hoarder])
