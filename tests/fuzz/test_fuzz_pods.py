"""Fuzz the pod sources: the kubelet pod-resources decoder, the /proc/<pid>/cgroup parser, and the spool
records that name pods and mounts (POD, MOUNT, WATERFALL).

Oracles:

* ``wire.decode_list_response`` raises only WireError, on any bytes; what it keeps is within every cap
  (pods, containers, device IDs per container and in all, string bytes, CDI names), and a well-formed
  answer built here field by field decodes to exactly its pods, containers and devices.
* ``cgroup.parse`` never raises; what it returns is a pod UID in the API's form and a 64-hex container
  ID or none (where a pod segment is believed: tests/fuzz/test_fuzz_pod_trust.py).
* The spool parser, on a real file written by the library with a POD record (Downward API environment),
  a MOUNT and a WATERFALL record, mutated: raises only BadFile; a parsed POD's strings and a WATERFALL's
  values are what the reader may export (finite, whole vector); the engines collector over a pod's
  volume of such files renders each series once, with no NaN.
"""

from __future__ import annotations

import math
import os
import re
import shutil
import tempfile
import textwrap

from hypothesis import example, given, settings
from hypothesis import strategies as st
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics

from exporter.collectors.engines import EnginesCollector
from exporter.context import Context
from exporter.engines import model, parse
from exporter.engines import spool as spool_source
from exporter.exposition import render
from exporter.pods import cgroup, kubelet, wire
from gpuio import spool
from tests.conftest import parse_samples
from tests.fuzz.test_fuzz_spool import MUTATION, mutate, spool_seed
from tests.unit.test_pods import varint

# --- the pod-resources decoder ------------------------------------------------------------------------


def field(number: int, payload: bytes) -> bytes:
    """A length-delimited field (strings and sub-messages)."""
    return varint(number << 3 | wire.LENGTH) + varint(len(payload)) + payload


NAME = st.text(max_size=20)
DEVICE_ID = st.sampled_from(["GPU-a4f34abc-7715-3560-dcea-7238b9611a45", "MIG-5d6e7f80-9a1b-5c2d-8e3f-4a5b6c7d8e9f",
                             "GPU-a4f34abc-7715-3560-dcea-7238b9611a45::3", "0000:3b:02.1", ""]) | NAME
CONTAINER = st.tuples(NAME, st.lists(st.tuples(NAME, st.lists(DEVICE_ID, max_size=4)), max_size=3))
POD = st.tuples(NAME, NAME, st.lists(CONTAINER, max_size=3))


def encode(pods: list[tuple[str, str, list]]) -> bytes:
    """A ListPodResourcesResponse, as the kubelet's protobuf runtime lays it out (field order kept)."""
    out = b""
    for name, namespace, containers in pods:
        body = field(1, name.encode()) + field(2, namespace.encode())
        for container_name, groups in containers:
            inner = field(1, container_name.encode())
            for resource, ids in groups:
                inner += field(2, field(1, resource.encode()) + b"".join(field(2, i.encode()) for i in ids))
            body += field(3, inner)
        out += field(1, body)
    return out


# Raw wire pieces: tags of every wire type (groups included), varints of every length up to 11 bytes,
# lengths past the end, and good sub-messages.
PIECE = st.one_of(
    st.binary(max_size=12),
    st.integers(0, 2**70).map(varint),
    st.tuples(st.integers(1, 6), st.integers(0, 7)).map(lambda tag: varint(tag[0] << 3 | tag[1])),
    st.tuples(st.integers(1, 6), st.integers(0, 2**33)).map(lambda f: varint(f[0] << 3 | 2) + varint(f[1])),
    st.lists(POD, max_size=2).map(encode),
)


def check_caps(decoded: wire.Decoded) -> None:
    assert len(decoded.pods) <= wire.MAX_PODS
    kept = 0
    for pod in decoded.pods:
        assert len(pod.containers) <= wire.MAX_CONTAINERS
        assert len(pod.name.encode()) <= 3 * wire.MAX_STRING_BYTES  # U+FFFD for each bad byte at most
        for container in pod.containers:
            assert len(container.devices) + len(container.claims) <= wire.MAX_DEVICES
            kept += len(container.devices) + len(container.claims)
            for claim in container.claims:
                assert len(claim.cdi_devices) <= wire.MAX_CDI_DEVICES
    assert kept <= wire.MAX_TOTAL_DEVICES


@given(st.lists(PIECE, max_size=8).map(b"".join))
@example(b"\x0a\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01")  # an 11-byte varint length
@example(b"\x00")  # field number 0
@example(b"\x0b\x0c")  # a group
def test_decoder_raises_only_wire_error_and_keeps_within_its_caps(data: bytes) -> None:
    try:
        decoded = wire.decode_list_response(data)
    except wire.WireError:
        return
    check_caps(decoded)


@given(st.lists(POD, max_size=6))
def test_decoder_reads_a_well_formed_answer_exactly(pods: list[tuple[str, str, list]]) -> None:
    decoded = wire.decode_list_response(encode(pods))
    assert decoded.truncated == 0
    assert [(p.name, p.namespace) for p in decoded.pods] == [(name, namespace) for name, namespace, _ in pods]
    for pod, (_, _, containers) in zip(decoded.pods, pods, strict=True):
        assert [c.name for c in pod.containers] == [name for name, _ in containers]
        for container, (_, groups) in zip(pod.containers, containers, strict=True):
            assert container.devices == [(resource, i) for resource, ids in groups for i in ids]


# --- /proc/<pid>/cgroup ---------------------------------------------------------------------------

HEX = "0123456789abcdef"
UUID = st.tuples(*(st.text(HEX, min_size=n, max_size=n) for n in (8, 4, 4, 4, 12))).map("-".join)
STATIC_UID = st.text(HEX, min_size=32, max_size=32)
CONTAINER_ID = st.text(HEX, min_size=64, max_size=64)
SEGMENT = st.text(st.characters(blacklist_characters="/\n\x00"), max_size=30)
API_UID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}|[0-9a-f]{32}")


@given(st.text(max_size=400) | st.lists(st.tuples(st.integers(0, 13), SEGMENT, st.lists(SEGMENT, max_size=6)))
       .map(lambda lines: "\n".join(f"{n}:{c}:/{'/'.join(p)}" for n, c, p in lines)))
@example("0::/kubepods/podZZZ/" + "a" * 64)
@example("0::" + "/pod" * 5000)
def test_cgroup_parse_never_raises_and_returns_only_well_formed_ids(text: str) -> None:
    ref = cgroup.parse(text)
    if ref is not None:
        assert API_UID.fullmatch(ref.pod_uid)
        assert ref.container_id == "" or re.fullmatch("[0-9a-f]{64}", ref.container_id)
        assert ref.runtime in ("", *cgroup.RUNTIMES.values())


# --- spool records naming pods and mounts ----------------------------------------------------------

WRITER = textwrap.dedent("""
    import os, sys
    sys.path.insert(0, {repo!r})
    os.environ.update(POD_NAMESPACE="serv\\\\ing", POD_NAME='det"ector-7d9f', CONTAINER_NAME="server\\n",
                      POD_UID="11111111-2222-3333-4444-555555555555")
    import gpuio
    gpuio.configure({spool!r})
    loaded = gpuio.load({engine!r}, lambda data: len(data), name="detector")
    with loaded.metrics.infer(batch_size=1):
        pass
""")


SEED = spool_seed(WRITER)
PRISTINE = parse.parse(SEED)
UID = "6f1c2d3e-4a5b-4c6d-8e7f-90a1b2c3d4e5"


def test_the_seed_holds_pod_mount_and_waterfall_records() -> None:
    assert PRISTINE.pod == model.PodIdentity("serv\\ing", 'det"ector-7d9f', "server\n",
                                                    "11111111-2222-3333-4444-555555555555")
    assert PRISTINE.mounts and PRISTINE.waterfalls and not PRISTINE.bad_record


@given(st.lists(MUTATION, min_size=1, max_size=5))
def test_parse_of_pod_mount_and_waterfall_records_raises_only_bad_file(mutations: list[tuple]) -> None:
    try:
        parsed = parse.parse(mutate(SEED, mutations))
    except parse.BadFile:
        return
    for values in parsed.waterfalls.values():
        assert len(values) == len(spool.WATERFALL_SLOTS) and all(map(math.isfinite, values))
        assert min(values) >= 0
    if parsed.pod is not None:
        assert all(isinstance(text, str) for text in (parsed.pod.namespace, parsed.pod.pod, parsed.pod.pod_uid))
    for (engine, dev), _ in parsed.mounts.items():
        assert engine and all(isinstance(number, int) and number >= 0 for number in dev)


ROOT = tempfile.mkdtemp(prefix="gpuio-fuzz-pods-")


@settings(max_examples=max(60, settings.default.max_examples // 5))  # a whole scrape per example
@given(st.lists(st.lists(MUTATION, min_size=1, max_size=4), min_size=1, max_size=3))
def test_collector_over_a_pods_volume_of_corrupt_files(files: list[list[tuple]]) -> None:
    pods = os.path.join(ROOT, "pods")
    shutil.rmtree(pods, ignore_errors=True)
    volume = os.path.join(pods, UID, "volumes", kubelet.EMPTY_DIR, kubelet.DEFAULT_VOLUME)
    os.makedirs(volume)
    with open(os.path.join(volume, "gpuio-1-1-0000000000000001.spool"), "wb") as handle:
        handle.write(SEED)
    for index, mutations in enumerate(files, start=2):
        with open(os.path.join(volume, f"gpuio-{index}-1-{index:016x}.spool"), "wb") as handle:
            handle.write(mutate(SEED, mutations))
    collector = EnginesCollector(Context(procfs=ROOT, sysfs=ROOT),
                                 {"spool-dir": os.path.join(ROOT, "none"), "kubelet-pods-dir": pods}, read_only=True)
    collector.service.pod_spools.sample_now()
    families = collector.collect()
    samples = [(sample.name, tuple(sorted(sample.labels.items())))
               for family in parse_openmetrics(render(families, openmetrics=True)) for sample in family.samples]
    assert len(samples) == len(set(samples)), "a series repeated"
    text_samples = parse_samples(render(families))
    assert all(not math.isnan(value) for value in text_samples.values())
    # The pristine file's pod is named with the kubelet's UID (the volume's), never the one it recorded.
    uids = {dict(labels).get("pod_uid") for (name, labels) in samples if name == "gpuio_engine_pod_info"}
    assert uids <= {UID}


# --- the kernel's lock table (which pid holds a spool file's lock) --------------------------------

LOCK_LINE = st.tuples(st.integers(1, 10**6), st.integers(0, 2**22), st.integers(0, 255), st.integers(0, 255),
                      st.integers(0, 2**63)).map(
    lambda f: (f"{f[0]}: FLOCK  ADVISORY  WRITE {f[1]} {f[2]:02x}:{f[3]:02x}:{f[4]} 0 EOF", f[1], f[4]))


@given(st.lists(LOCK_LINE, max_size=6), st.lists(st.binary(max_size=60), max_size=6))
@example([], [b"1: -> FLOCK  ADVISORY  WRITE 77 fe:00:12 0 EOF", b"2: POSIX  ADVISORY  WRITE 78 fe:00:13 0 EOF"])
def test_lock_table_finds_each_flock_holder_and_nothing_else(good: list, junk: list[bytes]) -> None:
    path = os.path.join(ROOT, "locks")
    lines = [line.encode() for line, _, _ in good] + [j.replace(b"FLOCK", b"flock") for j in junk]
    with open(path, "wb") as handle:
        handle.write(b"\n".join(lines))
    table = spool_source.read_lock_table(path)
    for _, pid, inode in good:
        assert pid in table[inode]
    assert sum(map(len, table.values())) <= len({(pid, inode) for _, pid, inode in good})
