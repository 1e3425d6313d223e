"""Placement and mapped loads against hostile tenants and odd loaders: real processes, real FUSE mounts
(tests/fuse_stub.py), real page cache; NVML's process list is a table (as in test_discovery_placement.py)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from exporter.engines.discovery import Discovery
from tests.conftest import evict
from tests.e2e.loaders import model
from tests.e2e.test_discovery_placement import GPUS, Nvml, load, placed, triton_model
from tests.fuse_stub import FuseStub, unavailable

pytestmark = pytest.mark.e2e

LOAD_BYTES_AND_CLASS = ("load_read_bytes",)


@contextlib.contextmanager
def bound_over(source: str, target: Path):
    """``source`` bind-mounted over ``target`` (a tenant in its own user namespace can do as much)."""
    subprocess.run(["mount", "--bind", source, str(target)], check=True)
    try:
        yield
    finally:
        subprocess.run(["umount", "-l", str(target)], check=False)


class SlowStub(FuseStub):
    """A FUSE daemon that answers every request, each after ``delay`` seconds (an overloaded one)."""

    delay = 0.15

    def _answer(self, *request):  # noqa: ANN002, ANN202 (the stub's own signature)
        time.sleep(self.delay)
        return super()._answer(*request)


def _fuse_or_skip() -> None:
    reason = unavailable()
    if reason:
        pytest.skip(reason)


def test_a_tenants_hung_config_does_not_misplace_another_tenants_model(tmp_path, loaders, fuse_stub) -> None:
    """Tenant A mounts a FUSE file that never answers over its own config.pbtxt; tenant B (a pod: a mount
    namespace of its own) has its model on the same disk with a config putting it on its CUDA device 1:
    B's model is placed on GPU 1, pass after pass, while A's reads stay refused."""
    a_model = triton_model(tmp_path, "amodel", "instance_group { gpus: 0 }")
    b_model = triton_model(tmp_path, "bmodel", "instance_group [ { kind: KIND_GPU gpus: [ 1 ] } ]")
    stub = fuse_stub(files={"config.pbtxt": 100})
    with bound_over(stub.path("config.pbtxt"), tmp_path / "repo" / "amodel" / "config.pbtxt"):
        stub.freeze()
        nvml = Nvml()
        found = nvml.discovery(str(tmp_path))
        tenant_a = loaders()
        tenant_b = loaders(wrapper=("unshare", "--mount", "--propagation", "private"))
        nvml.gpus[tenant_a.pid] = nvml.gpus[tenant_b.pid] = GPUS
        load(tenant_a, a_model)
        found.sample()
        load(tenant_b, b_model)
        for _ in range(3):
            started = time.monotonic()
            totals = found.sample().totals
            assert time.monotonic() - started < 3.0
            assert placed(totals, "bmodel") == {GPUS[1]}
            assert placed(totals, "amodel") == set(GPUS)  # its config never answered: every GPU it holds


def test_slow_configs_do_not_hold_a_pass(tmp_path, loaders) -> None:
    """A process on two GPUs holding 12 models whose config.pbtxt are files of a FUSE daemon answering each
    request in 0.15 s: a pass reads a config or two (never past its deadline), not all twelve; over the
    passes every model is placed by its config."""
    _fuse_or_skip()
    directory = tempfile.mkdtemp(prefix="gpuio-fuse-stub-")
    stub = SlowStub(directory, {"config.pbtxt": 0})
    paths = []
    with contextlib.ExitStack() as mounts:
        mounts.callback(os.rmdir, directory)
        mounts.callback(stub.close)
        for index in range(12):
            paths.append(triton_model(tmp_path, f"m{index}", None))
            config = tmp_path / "repo" / f"m{index}" / "config.pbtxt"
            config.write_text("")
            mounts.enter_context(bound_over(stub.path("config.pbtxt"), config))
        nvml = Nvml()
        found = nvml.discovery(str(tmp_path))
        server = loaders()
        nvml.gpus[server.pid] = GPUS[:2]
        for path in paths:
            load(server, path)
        longest = 0.0
        for _ in range(12):
            started = time.monotonic()
            totals = found.sample().totals
            longest = max(longest, time.monotonic() - started)
        assert longest < 2.5, longest  # one read of ~5 requests x 0.15 s, past the 0.5 s deadline at most once
        # an empty config: no instance_group, every GPU -- placed by it (the reads all came back)
        assert all(held.config_read for held in found._tracked[server.pid].files.values())
        assert all(placed(totals, f"m{index}") == set(GPUS[:2]) for index in range(12))


def test_a_split_checkpoint_mapped_whole_is_loading_until_its_last_shard(tmp_path, loaders) -> None:
    """llama.cpp maps a split GGUF's 4 shards at once and faults them in one after another: the device reads
    are shared among the shards, so the load is in progress until the last shard is read, not after two."""
    shards = [model(tmp_path, f"llm/model-0000{index}-of-00004.gguf", 32 << 20) for index in range(1, 5)]
    for shard in shards:
        evict(shard)
    found = Discovery([str(tmp_path)], require_gpu=False, join_within=0.0)
    found.sample()
    loader = loaders()
    for shard in shards:
        loader.do("map", shard)
    found.sample()
    for shard in shards[:3]:
        loader.do("fault", shard, 32 << 20)
        totals = found.sample().totals
        assert [key[0] for key in totals.loads] == ["llm"], shard
    loader.do("fault", shards[3], 32 << 20)
    found.sample()
    totals = found.sample().totals
    assert totals.loads == {}
    assert totals.engines["llm"][_bytes_slot()] <= 4 * (32 << 20)


def test_a_warm_mapped_model_beside_input_reads_is_no_long_load(tmp_path, loaders) -> None:
    """A server maps its model from the page cache (no device read) and then reads its inputs from the disk:
    the inputs' reads (returned by read()) do not move the model's load, which ends after ``idle``."""
    path = model(tmp_path, "repo/served/1/model.safetensors", 64 << 20)
    inputs = model(tmp_path, "inputs.bin", 16 << 20)
    found = Discovery([str(tmp_path)], require_gpu=False, join_within=0.0, idle=0.6)
    found.sample()
    loader = loaders()
    loader.do("map", path)
    loader.do("fault", path, 64 << 20)  # all in the page cache: it was just written
    found.sample()
    evict(inputs)
    loader.do("open", inputs)
    deadline = time.monotonic() + 3.0
    while time.monotonic() < deadline:
        loader.do("read", inputs, 1 << 20)
        totals = found.sample().totals
        time.sleep(0.1)
    assert totals.loads == {}
    assert totals.engines["served"][_bytes_slot()] < 16 << 20


def test_python_mmap_keeping_its_descriptor_is_followed_as_mapped(tmp_path, loaders) -> None:
    """numpy.memmap's way (Python's mmap keeps a duplicate of the descriptor, at position 0 for ever): the load
    moves with the faults' device reads, as for a loader that closed its descriptor."""
    size = 64 << 20
    path = model(tmp_path, "repo/np/1/model.safetensors", size)
    evict(path)
    found = Discovery([str(tmp_path)], require_gpu=False, join_within=0.0)
    found.sample()
    loader = loaders()
    loader.do("pymap", path)
    found.sample()
    loader.do("fault", path, 16 << 20)
    ((count, read, _),) = found.sample().totals.loads.values()
    assert count == 1 and read >= 16 << 20
    loader.do("fault", path, size)
    totals = found.sample().totals
    assert totals.loads == {}
    assert totals.engines["np"][_bytes_slot()] >= size // 2


def _bytes_slot() -> int:
    from gpuio import spool as spool_format
    return spool_format.ENGINE_LAYOUT.counters["load_read_bytes"]
