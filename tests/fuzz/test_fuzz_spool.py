"""Fuzz the spool reader (exporter/spool_reader.py) and the engines collector on corrupt files.

The seed is a real spool file: a subprocess loads an "engine" through the instrumentation library,
runs inferences, records an error and layer timings, and exits (so the file is a dead writer's).
Generated mutations of it - bytes flipped, header and record fields overwritten with edge values,
truncation, appended garbage - go through:

* ``parse``: raises only BadFile; what it returns has full-length, finite ENGINE records;
* a SpoolReader and the engines collector over a directory of mutated files next to the pristine one:
  never raise, count what they refused, keep the pristine file's totals exactly, and render valid
  Prometheus text and OpenMetrics with no repeated series.
"""

from __future__ import annotations

import math
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import textwrap

from hypothesis import given
from hypothesis import strategies as st
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics

from exporter import spool_reader
from exporter.collect import Context
from exporter.collectors.engines import EnginesCollector
from exporter.exposition import render
from gpuio import spool
from tests.conftest import REPO, parse_samples

WRITER = textwrap.dedent("""
    import sys
    sys.path.insert(0, {repo!r})
    import gpuio
    gpuio.configure({spool!r})
    loaded = gpuio.load({engine!r}, lambda data: len(data), name='det"ector\\n')
    for batch in (1, 4, 8):
        with loaded.metrics.infer(batch_size=batch):
            pass
    loaded.metrics.error("timeout")
    for _ in range(6):  # the first 5 profiles are buffered before the top-K layers are chosen
        loaded.metrics.add_layer_times({{"conv1": 0.001, "fc": 0.002}})
""")


def spool_seed(writer: str = WRITER) -> bytes:
    """The spool file a real instrumented process leaves: ``writer`` (formatted with repo, spool and
    engine) run as a process of its own against a 4 KiB engine file."""
    work = tempfile.mkdtemp(prefix="gpuio-fuzz-seed-")
    try:
        engine = os.path.join(work, "model.engine")
        with open(engine, "wb") as handle:
            handle.write(b"\1" * 4096)
        directory = os.path.join(work, "spool")
        os.mkdir(directory)
        subprocess.run([sys.executable, "-c", writer.format(repo=str(REPO), spool=directory, engine=engine)],
                       check=True, cwd=work)
        (name,) = os.listdir(directory)
        with open(os.path.join(directory, name), "rb") as handle:
            return handle.read()
    finally:
        shutil.rmtree(work, ignore_errors=True)


SEED = spool_seed()
USED = struct.unpack_from("<Q", SEED, spool.USED_OFFSET)[0]
PRISTINE = spool_reader.parse(SEED)
EDGE_U64 = st.sampled_from([0, 1, 7, 8, 255, 256, USED - 8, USED, USED + 8, len(SEED), 2**31, 2**32 - 1, 2**63,
                            2**64 - 1])
EDGE_DOUBLE = st.sampled_from([math.nan, math.inf, -math.inf, -1.0, 0.0, 1e308, 5e-324]) | st.floats()
MUTATION = st.one_of(
    st.tuples(st.just("flip"), st.integers(0, USED - 1), st.integers(1, 255)),
    st.tuples(st.just("u32"), st.integers(0, USED - 4), st.integers(0, 2**32 - 1)),
    st.tuples(st.just("u64"), st.integers(0, USED - 8).map(lambda at: at - at % 8), EDGE_U64),
    st.tuples(st.just("double"), st.integers(spool.HEADER_SIZE, USED - 8).map(lambda at: at - at % 8), EDGE_DOUBLE),
    st.tuples(st.just("truncate"), st.integers(0, len(SEED))),
    st.tuples(st.just("append"), st.binary(max_size=64)),
)


def mutate(data: bytes, mutations: list[tuple]) -> bytes:
    buffer = bytearray(data)
    for operation, *arguments in mutations:
        if operation == "truncate":
            del buffer[arguments[0]:]
        elif operation == "append":
            buffer += arguments[0]
        elif arguments[0] + 8 > len(buffer):
            continue  # past a truncation
        elif operation == "flip":
            buffer[arguments[0]] ^= arguments[1]
        elif operation == "u32":
            struct.pack_into("<I", buffer, arguments[0], arguments[1])
        elif operation == "u64":
            struct.pack_into("<Q", buffer, arguments[0], arguments[1])
        else:
            struct.pack_into("<d", buffer, arguments[0], arguments[1])
    return bytes(buffer)


@given(st.lists(MUTATION, min_size=1, max_size=5))
def test_parse_raises_only_bad_file(mutations: list[tuple]) -> None:
    try:
        parsed = spool_reader.parse(mutate(SEED, mutations))
    except spool_reader.BadFile as exc:
        assert exc.reason in ("empty", "truncated", "garbage", "version")
        return
    for values in parsed.engines.values():
        assert len(values) == spool.ENGINE_LAYOUT.size and all(map(math.isfinite, values))


ROOT = tempfile.mkdtemp(prefix="gpuio-fuzz-spool-")
PRISTINE_NAME = "gpuio-1-1-0000000000000001.spool"


@given(st.lists(st.lists(MUTATION, min_size=1, max_size=4), min_size=1, max_size=3))
def test_reader_and_collector_on_a_directory_of_corrupt_files(files: list[list[tuple]]) -> None:
    directory = os.path.join(ROOT, "spool")
    shutil.rmtree(directory, ignore_errors=True)
    os.mkdir(directory)
    with open(os.path.join(directory, PRISTINE_NAME), "wb") as handle:
        handle.write(SEED)
    for index, mutations in enumerate(files, start=2):
        with open(os.path.join(directory, f"gpuio-{index}-1-{index:016x}.spool"), "wb") as handle:
            handle.write(mutate(SEED, mutations))
    # Only the pristine file, read alone, is the reference: mutated files may parse and add to it.
    collector = EnginesCollector(Context(procfs=ROOT, sysfs=ROOT), {"spool-dir": directory}, read_only=True)
    families = collector.collect()
    samples = [(sample.name, tuple(sorted(sample.labels.items())))
               for family in parse_openmetrics(render(families, openmetrics=True)) for sample in family.samples]
    assert len(samples) == len(set(samples)), "a series repeated"
    text_samples = parse_samples(render(families))
    assert all(not math.isnan(value) for value in text_samples.values())
    # Mutated files may parse and add to the pristine file's engine, never take from it: counters
    # (the monotonic slots) are at least the pristine file's, however the others were corrupted.
    totals = collector.reader.read()
    for engine, values in PRISTINE.engines.items():
        merged = totals.engines[engine]
        prefix = spool.ENGINE_LAYOUT.monotonic_prefix
        assert all(total >= mine for total, mine in zip(merged[:prefix], values[:prefix], strict=True))


def test_the_seed_is_a_real_file_with_every_record_kind() -> None:
    """The fuzzing starts from something the library really wrote (guards against an empty seed)."""
    assert set(PRISTINE.engines) == {'det"ector\n'}
    assert PRISTINE.errors and PRISTINE.layers and PRISTINE.infos and not PRISTINE.bad_record
    load_count = spool.ENGINE_LAYOUT.histograms["inference_seconds"]
    assert sum(PRISTINE.engines['det"ector\n'][load_count[0]:load_count[1]]) == 3
