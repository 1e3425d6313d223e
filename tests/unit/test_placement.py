"""Placing a model on its GPUs (exporter.engines.placement, issue 41): Triton's config.pbtxt, the process's
CUDA_VISIBLE_DEVICES, memory growth, and how they combine.  Real files in a real /proc (this process's own
root and environ); the config texts follow Triton's docs (model_config.proto, ModelInstanceGroup)."""

from __future__ import annotations

import os

import pytest

from exporter.engines import placement
from exporter.engines.placement import ConfigGpus, ConfigReader, InstanceGroup

UUIDS = ("GPU-0aaa1111-0000", "GPU-1bbb2222-0000", "GPU-2ccc3333-0000", "GPU-3ddd4444-0000")
MIB = 1 << 20

RESNET = b"""
# a real-looking Triton config
name: "resnet"
platform: "tensorrt_plan"
max_batch_size: 8
input [ { name: "input", data_type: TYPE_FP32, dims: [ 3, 224, 224 ] } ]
output [ { name: "out" data_type: TYPE_FP32 dims: [ 1000 ] label_filename: "labels.txt" } ]
instance_group [
  {
    count: 2
    kind: KIND_GPU
    gpus: [ 0, 1 ]
    rate_limiter { resources [ { name: "R1" count: 4 }, { name: "R2" global: true count: 2 } ] priority: 2 }
    secondary_devices [ { kind: KIND_NVDLA device_id: 0 } ]
    host_policy: "policy_0"
    profile: [ "0", "1" ]
    passive: false
  }
]
dynamic_batching { preferred_batch_size: [ 4, 8 ] max_queue_delay_microseconds: 100 }
parameters { key: "note" value: { string_value: "a \\"quoted\\" } and a # not-a-comment" } }
"""


# --- the parser ---------------------------------------------------------------------------------------


def test_a_triton_config_gives_its_instance_groups_and_skips_the_rest() -> None:
    assert placement.instance_groups(RESNET) == (InstanceGroup("KIND_GPU", 2, (0, 1)),)
    assert placement.parse_config(RESNET) == ConfigGpus(False, (0, 1))


@pytest.mark.parametrize("text, groups", [
    (b"", ()),  # no instance_group: Triton's default
    (b'name: "m"', ()),
    (b"instance_group [ ]", ()),
    (b"instance_group { kind: KIND_GPU gpus: 0 gpus: 2 }", (InstanceGroup("KIND_GPU", 0, (0, 2)),)),
    (b"instance_group: { kind: KIND_GPU, gpus: [3], gpus: 1 };", (InstanceGroup("KIND_GPU", 0, (3, 1)),)),
    (b"instance_group < kind: 2 count: 0x3 >", (InstanceGroup("KIND_CPU", 3, ()),)),
    (b"instance_group [{count: 1}, {kind: KIND_MODEL}]", (InstanceGroup("KIND_AUTO", 1, ()),
                                                          InstanceGroup("KIND_MODEL", 0, ()))),
    (b"instance_group { gpus: [] }\ninstance_group { kind: KIND_CPU count: 010 }",
     (InstanceGroup(), InstanceGroup("KIND_CPU", 8, ()))),
    (b"instance_group [ { kind: KIND_GPU gpus: [ 1, ] } ]  # trailing comma, comment",
     (InstanceGroup("KIND_GPU", 0, (1,)),)),
    (b"x { instance_group { gpus: 5 } } instance_group { gpus: 0 }",  # only the top level's
     (InstanceGroup("KIND_AUTO", 0, (0,)),)),
    (b"name: 'it''s' \"a\" 'b\\'c' instance_group { gpus: 4 }", (InstanceGroup("KIND_AUTO", 0, (4,)),)),
])
def test_instance_group_syntaxes(text: bytes, groups: tuple[InstanceGroup, ...]) -> None:
    assert placement.instance_groups(text) == groups


@pytest.mark.parametrize("text", [
    b"instance_group { kind: KIND_GPU kind: KIND_CPU }",  # a singular field twice: protobuf refuses it
    b"instance_group { count: 1 count: 2 }",
    b"instance_group { kind: KIND_NPU }",
    b"instance_group { kind: 7 }",
    b"instance_group { gpus: -1 }",
    b"instance_group { gpus: [0 1] }",
    b"instance_group { gpus: 1.5 }",
    b'instance_group { gpus: "0" }',
    b"instance_group [ 1, 2 ]",
    b"instance_group: 3",
    b"instance_group { gpus: [0] ",  # unclosed
    b"instance_group { gpus: [0] >",  # mismatched
    b"}",
    b"name: \"unterminated",
    b"name: \"line\nbreak\"",
    b"[ext.field]: 1",
    b"name: @",
    b"name:",
    b"instance_group { gpus: 99999999999 }",
    b"a {" * (placement.MAX_DEPTH + 2) + b"}" * (placement.MAX_DEPTH + 2),
    b"a: [" * (placement.MAX_DEPTH + 2) + b"]" * (placement.MAX_DEPTH + 2),
    b"a: 1 " * (placement.MAX_TOKENS // 2 + 1),
    b"instance_group { gpus: 0 }" * (placement.MAX_GROUPS + 1),
    b"instance_group { gpus: [" + b"0," * placement.MAX_GPU_ENTRIES + b"0] }",
    b"#" * (placement.MAX_CONFIG_BYTES + 1),
    b"name: \"\xff\xfe\" instance_group { kind: \xc3\xa9 }",
])
def test_malformed_or_oversized_configs_say_nothing(text: bytes) -> None:
    assert placement.instance_groups(text) is None
    assert placement.parse_config(text) is None


def test_nesting_within_the_bound_is_fine() -> None:
    deep = b"a {" * (placement.MAX_DEPTH - 1) + b"}" * (placement.MAX_DEPTH - 1)
    assert placement.instance_groups(deep + b" instance_group { gpus: 1 }") == (InstanceGroup("KIND_AUTO", 0, (1,)),)


@pytest.mark.parametrize("groups, expected", [
    ((), ConfigGpus(every=True)),
    ((InstanceGroup("KIND_GPU", 1, ()),), ConfigGpus(every=True)),
    ((InstanceGroup("KIND_AUTO", 1, ()),), ConfigGpus(every=True)),
    ((InstanceGroup("KIND_CPU", 4, ()),), ConfigGpus()),  # on the CPU only: no GPU
    ((InstanceGroup("KIND_GPU", 2, (2, 0)), InstanceGroup("KIND_GPU", 1, (0, 1))), ConfigGpus(False, (0, 1, 2))),
    ((InstanceGroup("KIND_GPU", 1, (3,)), InstanceGroup("KIND_CPU", 1, ())), ConfigGpus(False, (3,))),
    ((InstanceGroup("KIND_GPU", 1, (3,)), InstanceGroup("KIND_GPU", 1, ())), ConfigGpus(True, (3,))),
    ((InstanceGroup("KIND_GPU", 1, (0,)), InstanceGroup("KIND_MODEL", 1, ())), None),  # the backend decides
    (None, None),
])
def test_what_the_groups_say(groups: tuple[InstanceGroup, ...] | None, expected: ConfigGpus | None) -> None:
    assert placement.config_gpus(groups) == expected


# --- where the config is, and reading it safely ---------------------------------------------------------


def test_config_candidates_follow_tritons_layout_then_the_files_directory() -> None:
    assert placement.config_candidates("/models/resnet/1/model.plan") == (
        "/models/resnet/config.pbtxt", "/models/resnet/1/config.pbtxt")
    assert placement.config_candidates("/models/bert/3/model.onnx/model.onnx")[0] == "/models/bert/config.pbtxt"
    assert placement.config_candidates("/srv/engines/llama.engine") == ("/srv/engines/config.pbtxt",)
    assert placement.config_candidates("/model.plan") == ("/config.pbtxt",)


def write_repository(root, config: bytes | None) -> str:
    """A Triton model repository under ``root``: the model file's path (as this process names it)."""
    version = root / "repo" / "resnet" / "1"
    version.mkdir(parents=True)
    (version / "model.plan").write_bytes(b"\0" * 16)
    if config is not None:
        (root / "repo" / "resnet" / "config.pbtxt").write_bytes(config)
    return str(version / "model.plan")


def test_the_reader_finds_the_config_in_the_processes_root_and_caches_it(tmp_path, monkeypatch) -> None:
    model = write_repository(tmp_path, RESNET)
    reader = ConfigReader("/proc")
    assert reader(os.getpid(), model) == ConfigGpus(False, (0, 1))
    parsed: list[bytes] = []
    monkeypatch.setattr(placement, "parse_config", lambda data: parsed.append(data) or ConfigGpus(True))
    assert reader(os.getpid(), model) == ConfigGpus(False, (0, 1))  # the same file: not parsed again
    assert parsed == []
    config = tmp_path / "repo" / "resnet" / "config.pbtxt"
    config.write_bytes(b"instance_group { kind: KIND_CPU }")  # changed: its size (and mtime) says so
    assert reader(os.getpid(), model) == ConfigGpus(True) and len(parsed) == 1


def test_the_cache_is_bounded(tmp_path) -> None:
    reader = ConfigReader("/proc", max_cached=2)
    for index in range(5):
        (tmp_path / f"m{index}").mkdir()
        (tmp_path / f"m{index}" / "config.pbtxt").write_bytes(b"instance_group { gpus: %d }" % index)
        assert reader(os.getpid(), str(tmp_path / f"m{index}" / "x.plan")) == ConfigGpus(False, (index,))
    assert len(reader._cache) == 2


def test_a_config_beside_the_file_counts_when_the_model_directory_has_none(tmp_path) -> None:
    model = write_repository(tmp_path, None)
    assert ConfigReader()(os.getpid(), model) is None
    (tmp_path / "repo" / "resnet" / "1" / "config.pbtxt").write_bytes(b"instance_group { gpus: 2 }")
    assert ConfigReader()(os.getpid(), model) == ConfigGpus(False, (2,))


def test_no_symlink_is_followed_anywhere_on_the_way(tmp_path) -> None:
    """An absolute symlink past <procfs>/<pid>/root resolves against the exporter's root: a tenant could
    point the exporter at a host file.  Neither the config nor a directory above it may be one."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "config.pbtxt").write_bytes(b"instance_group { gpus: 3 }")
    (tmp_path / "linked").mkdir()
    (tmp_path / "linked" / "config.pbtxt").symlink_to(elsewhere / "config.pbtxt")
    assert ConfigReader()(os.getpid(), str(tmp_path / "linked" / "m.plan")) is None
    (tmp_path / "dir").symlink_to(elsewhere)
    assert ConfigReader()(os.getpid(), str(tmp_path / "dir" / "m.plan")) is None
    assert ConfigReader()(os.getpid(), str(elsewhere / "m.plan")) == ConfigGpus(False, (3,))


@pytest.mark.parametrize("path", ["relative/m.plan", "/a/../etc/m.plan", "/a//m.plan", "/a/./m.plan"])
def test_only_plain_absolute_paths_are_walked(path: str) -> None:
    with pytest.raises(OSError):
        placement.open_in_root("/proc", os.getpid(), path)
    assert ConfigReader()(os.getpid(), path) is None


def test_what_is_no_regular_file_or_too_big_is_not_read(tmp_path) -> None:
    (tmp_path / "fifo").mkdir()
    os.mkfifo(tmp_path / "fifo" / "config.pbtxt")  # O_NONBLOCK: the open does not wait for a writer
    assert ConfigReader()(os.getpid(), str(tmp_path / "fifo" / "m.plan")) is None
    (tmp_path / "dir" / "config.pbtxt").mkdir(parents=True)
    assert ConfigReader()(os.getpid(), str(tmp_path / "dir" / "m.plan")) is None
    (tmp_path / "big").mkdir()
    (tmp_path / "big" / "config.pbtxt").write_bytes(b" " * (placement.MAX_CONFIG_BYTES + 1))
    assert ConfigReader()(os.getpid(), str(tmp_path / "big" / "m.plan")) is None


def test_a_process_that_is_gone_has_no_config(tmp_path) -> None:
    model = write_repository(tmp_path, RESNET)
    assert ConfigReader(str(tmp_path / "no-proc"))(1, model) is None


# --- CUDA_VISIBLE_DEVICES -------------------------------------------------------------------------------


@pytest.mark.parametrize("value, expected", [
    (None, UUIDS),  # unset: every GPU, in order
    ("0,2", (UUIDS[0], UUIDS[2])),
    ("2,1", (UUIDS[2], UUIDS[1])),  # CUDA's docs: 2 enumerated before 1, 0 hidden
    ("0,2,-1,1", (UUIDS[0], UUIDS[2])),  # CUDA's docs: an invalid entry hides it and all after it
    ("3,7,1", (UUIDS[3],)),  # no GPU 7 here
    ("", ()),
    ("-1", ()),
    ("none", ()),
    (" 1 , 0 ", (UUIDS[1], UUIDS[0])),
    ("1,1,2", (UUIDS[1],)),  # a GPU named twice: invalid from there
    ("GPU-2ccc3333-0000,GPU-0aaa", (UUIDS[2], UUIDS[0])),  # UUIDs and unique prefixes
    ("gpu-1BBB", (UUIDS[1],)),
    ("GPU-,0", ()),
    ("GPU-ffff,0", ()),  # no such GPU
    ("0,GPU-", (UUIDS[0],)),
    ("MIG-aaaa,0", (UUIDS[2], UUIDS[0])),  # a MIG device, on its parent GPU
    ("MIG-zzzz,0", ()),  # unknown MIG device
    ("99999999999999999999", ()),
])
def test_visible_gpus_follow_cudas_documented_rules(value: str | None, expected: tuple[str, ...]) -> None:
    assert placement.visible_gpus(value, UUIDS, {"MIG-aaaa": UUIDS[2]}) == expected


def test_an_ambiguous_uuid_prefix_is_invalid() -> None:
    assert placement.visible_gpus("GPU-,1", ("GPU-ab", "GPU-ac")) == ()
    assert placement.visible_gpus("GPU-a", ("GPU-ab", "GPU-ac")) == ()
    assert placement.visible_gpus("GPU-ac", ("GPU-ab", "GPU-ac")) == ("GPU-ac",)


def test_a_long_value_is_looked_at_only_as_far_as_there_are_gpus() -> None:
    assert placement.visible_gpus("0," * 1_000_000, UUIDS[:2]) == (UUIDS[0],)


def test_parse_environ_takes_the_first_of_a_name_and_says_when_it_cannot_know() -> None:
    data = b"PATH=/bin\0CUDA_VISIBLE_DEVICES=2,3\0CUDA_DEVICE_ORDER=PCI_BUS_ID\0CUDA_VISIBLE_DEVICES=0\0"
    assert placement.parse_environ(data) == placement.CudaEnviron("2,3", "PCI_BUS_ID")
    assert placement.parse_environ(b"PATH=/bin\0X_CUDA_VISIBLE_DEVICES=1\0") == placement.CudaEnviron()
    assert placement.parse_environ(b"CUDA_VISIBLE_DEVICES\0") == placement.CudaEnviron()  # no "=": no variable
    assert placement.parse_environ(b"CUDA_VISIBLE_DEVICES=\xff\0") == placement.CudaEnviron("\ufffd")
    assert placement.parse_environ(b"PATH=/bin\0", complete=False) is None  # may be in the part not read
    assert placement.parse_environ(b"CUDA_VISIBLE_DEVICES=1\0", complete=False) == placement.CudaEnviron("1")


def test_read_cuda_environ_reads_a_real_process(tmp_path) -> None:
    found = placement.read_cuda_environ("/proc", os.getpid())
    assert found is not None  # this process's own environ (what it started with)
    (tmp_path / "1").mkdir()
    (tmp_path / "1" / "environ").write_bytes(b"A=1\0CUDA_VISIBLE_DEVICES=1,0\0")
    assert placement.read_cuda_environ(str(tmp_path), 1) == placement.CudaEnviron("1,0")
    (tmp_path / "2").mkdir()
    (tmp_path / "2" / "environ").write_bytes(b"A=" + b"x" * placement.MAX_ENVIRON_BYTES + b"\0CUDA_VISIBLE_DEVICES=1\0")
    assert placement.read_cuda_environ(str(tmp_path), 2) is None  # cut before the variable: unknown
    (tmp_path / "3").mkdir()
    (tmp_path / "3" / "environ").write_bytes(b"CUDA_VISIBLE_DEVICES=3\0A=" + b"x" * placement.MAX_ENVIRON_BYTES)
    assert placement.read_cuda_environ(str(tmp_path), 3) == placement.CudaEnviron("3")
    assert placement.read_cuda_environ(str(tmp_path), 4) is None  # gone


# --- memory growth --------------------------------------------------------------------------------------


@pytest.mark.parametrize("before, after, expected", [
    ({UUIDS[0]: 500 * MIB, UUIDS[1]: 500 * MIB}, {UUIDS[0]: 500 * MIB, UUIDS[1]: 1500 * MIB}, (UUIDS[1],)),
    ({UUIDS[0]: 0, UUIDS[1]: 0}, {UUIDS[0]: 900 * MIB, UUIDS[1]: 1000 * MIB}, (UUIDS[0], UUIDS[1])),
    ({UUIDS[0]: 0, UUIDS[1]: 0}, {UUIDS[0]: 400 * MIB, UUIDS[1]: 1000 * MIB}, (UUIDS[1],)),
    ({UUIDS[0]: 0}, {UUIDS[0]: 8 * MIB, UUIDS[1]: 4 * MIB}, ()),  # too little to say
    ({UUIDS[0]: 900 * MIB}, {UUIDS[0]: 100 * MIB}, ()),  # shrank
    ({}, {}, ()),
    ({UUIDS[0]: 100 * MIB}, {UUIDS[1]: 300 * MIB}, (UUIDS[1],)),  # a new context
])
def test_grew_on(before: dict[str, int], after: dict[str, int], expected: tuple[str, ...]) -> None:
    assert placement.grew_on(before, after) == expected


# --- all together ---------------------------------------------------------------------------------------


HELD = UUIDS  # a Triton holding every GPU, in NVML order


@pytest.mark.parametrize("config, visible, held, grown, expected", [
    # the config's ordinals, through CUDA_VISIBLE_DEVICES, in NVML order
    (ConfigGpus(False, (1, 0)), UUIDS, HELD, None, ((UUIDS[0], UUIDS[1]), "config")),
    (ConfigGpus(False, (0,)), (UUIDS[2], UUIDS[3]), HELD, None, ((UUIDS[2],), "config")),
    (ConfigGpus(True), UUIDS, HELD, (UUIDS[1],), (HELD, "config")),
    (ConfigGpus(True), None, HELD[:2], None, (HELD[:2], "config")),
    (ConfigGpus(), UUIDS, HELD, (UUIDS[1],), ((), "config")),  # KIND_CPU
    # config GPUs the process holds no context on are left out; none left: the next way decides
    (ConfigGpus(False, (0, 3)), UUIDS, HELD[:2], None, ((UUIDS[0],), "config")),
    (ConfigGpus(False, (3,)), UUIDS, HELD[:2], (UUIDS[1],), ((UUIDS[1],), "memory")),
    (ConfigGpus(False, (9,)), UUIDS, HELD, None, (HELD, "process")),  # no such ordinal
    (ConfigGpus(False, (0,)), None, HELD, None, (HELD, "process")),  # ordinals cannot be mapped
    (None, UUIDS, HELD, (UUIDS[3], UUIDS[1]), ((UUIDS[1], UUIDS[3]), "memory")),
    (None, UUIDS, HELD[:2], (UUIDS[3],), (HELD[:2], "process")),  # grew where NVML does not list it
    (None, UUIDS, HELD, (), (HELD, "process")),
    (None, None, (), None, ((), "process")),
])
def test_place(config: ConfigGpus | None, visible: tuple[str, ...] | None, held: tuple[str, ...],
               grown: tuple[str, ...] | None, expected: tuple[tuple[str, ...], str]) -> None:
    assert placement.place(config, visible, held, grown) == expected


def test_one_triton_on_four_gpus_end_to_end(tmp_path) -> None:
    """The issue's case: a config on GPUs 0 and 1 of a process started with CUDA_VISIBLE_DEVICES=2,3,0,1."""
    model = write_repository(tmp_path, RESNET)
    (tmp_path / "proc" / "1").mkdir(parents=True)
    (tmp_path / "proc" / "1" / "root").symlink_to("/")
    (tmp_path / "proc" / "1" / "environ").write_bytes(b"CUDA_VISIBLE_DEVICES=2,3,0,1\0")
    config = ConfigReader(str(tmp_path / "proc"))(1, model)
    environ = placement.read_cuda_environ(str(tmp_path / "proc"), 1)
    assert environ is not None
    visible = placement.visible_gpus(environ.visible_devices, UUIDS)
    assert placement.place(config, visible, HELD) == ((UUIDS[2], UUIDS[3]), "config")


@pytest.mark.parametrize(("container", "cuda", "expected"), [
    (None, None, UUIDS),
    ("all", "1", (UUIDS[1],)),
    ("void", None, UUIDS),
    (f"{UUIDS[3]},{UUIDS[1]}", None, (UUIDS[1], UUIDS[3])),  # the container's GPUs, in PCI (NVML) order
    (f"{UUIDS[3]},{UUIDS[1]}", "1", (UUIDS[3],)),  # its CUDA_VISIBLE_DEVICES counts among them
    ("2,3", "0", (UUIDS[2],)),
    ("0:1,1", "0", (UUIDS[0],)),  # a MIG entry: which GPUs is not read here, every GPU then
    ("GPU-nope", "1", (UUIDS[1],)),
])
def test_a_pods_cuda_ordinals_are_among_the_gpus_its_container_was_given(
        container: str | None, cuda: str | None, expected: tuple[str, ...]) -> None:
    """The Kubernetes device plugin gives a pod GPUs 1 and 3 (NVIDIA_VISIBLE_DEVICES): in the pod, CUDA device
    0 is the node's GPU 1 and device 1 its GPU 3, whatever the node's other GPUs."""
    assert placement.CudaEnviron(cuda, None, container).visible(UUIDS) == expected


def test_parse_environ_reads_the_containers_gpus_too() -> None:
    data = b"NVIDIA_VISIBLE_DEVICES=GPU-1,GPU-3\0CUDA_VISIBLE_DEVICES=1\0"
    assert placement.parse_environ(data) == placement.CudaEnviron("1", None, "GPU-1,GPU-3")
