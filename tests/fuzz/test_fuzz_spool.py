"""Fuzz the spool reader (exporter/engines/) and the engines collector on corrupt files.

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

from exporter.collectors.engines import EnginesCollector
from exporter.context import Context
from exporter.engines import model, parse
from exporter.engines import spool as spool_source
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
PRISTINE = parse.parse(SEED)
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
        parsed = parse.parse(mutate(SEED, mutations))
    except parse.BadFile as exc:
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
    totals = collector.service.reader.read()
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


# --- one file's budgets; counters that never fall (issue 27) ------------------------------------------

RICH_WRITER = textwrap.dedent("""
    import sys
    sys.path.insert(0, {repo!r})
    import gpuio
    from gpuio import spool as spool_format
    gpuio.configure({spool!r})
    for number in range(4):  # four engines, each on files of devices of its own, with loads and errors
        engine = gpuio.engine(f"engine{{number}}")
        for copy in range(3):
            dev = (8, 16 * number + copy)
            engine._append_info(spool_format.pack_info(0, dev, 100 + copy, 4096, 0, 1.0 + copy,
                                                       f"/m/{{number}}-{{copy}}", f"GPU-{{copy}}", "tensorrt"))
            engine.record_mount(dev, f"/m{{copy}}", "ext4", f"/dev/sd{{copy}}", "")
            with engine.loading(None, gpu_uuid=f"GPU-{{copy}}"):
                pass
        for reason in ("timeout", "oom", "shape"):
            engine.error(reason)
        engine.inference_seconds.observe(0.01)
    loaded = gpuio.load({engine!r}, lambda data: len(data), name="engine0")
    for _ in range(6):
        loaded.metrics.add_layer_times({{"conv1": 0.001, "fc": 0.002}})
""")
RICH_SEED = spool_seed(RICH_WRITER)
RICH_USED = struct.unpack_from("<Q", RICH_SEED, spool.USED_OFFSET)[0]
RICH_FILE = RICH_SEED[:RICH_USED]  # what a live writer's file holds up to its used offset


def mutations_within(data: bytes) -> st.SearchStrategy[tuple]:
    """MUTATION's kinds of change, anywhere in ``data`` (a spool file up to its used offset)."""
    used = len(data)
    edge = st.sampled_from([0, 1, 7, 8, 255, 256, used - 8, used, used + 8, 2**31, 2**32 - 1, 2**63, 2**64 - 1])
    aligned = st.integers(0, used - 8).map(lambda at: at - at % 8)
    return st.one_of(
        st.tuples(st.just("flip"), st.integers(0, used - 1), st.integers(1, 255)),
        st.tuples(st.just("u64"), aligned, edge),
        st.tuples(st.just("double"), aligned.filter(lambda at: at >= spool.HEADER_SIZE), EDGE_DOUBLE),
        st.tuples(st.just("truncate"), st.integers(spool.HEADER_SIZE, used)),
        st.tuples(st.just("append"), st.binary(max_size=64)),
    )


RICH_MUTATION = mutations_within(RICH_FILE)
SMALL = st.integers(0, 4)
LIMITS = st.builds(parse.FileLimits, parse_bytes=st.integers(0, RICH_USED), entries=st.integers(0, 40),
                   engines=SMALL, devices=SMALL, errors_per_engine=SMALL, layers_per_engine=SMALL,
                   loads_per_engine=SMALL, mounts_per_engine=SMALL)


def engines_named(parsed: parse.Parsed) -> set[str]:
    return ({*parsed.engines, *parsed.infos, *parsed.waterfalls} | {engine for engine, _ in parsed.errors}
            | {engine for engine, _ in parsed.layers} | {engine for engine, _, _ in parsed.loads}
            | {engine for engine, _ in parsed.mounts})


def test_the_rich_seed_fits_the_default_limits_whole() -> None:
    parsed = parse.parse(RICH_SEED)
    assert parsed.left_out == 0 and not parsed.bad_record
    assert len(engines_named(parsed)) == 4 and len(parsed.infos) == 4
    assert len(parsed.mounts) >= 12 and len(parsed.loads) >= 12 and len(parsed.errors) == 12 and parsed.layers


@given(LIMITS, st.lists(RICH_MUTATION, max_size=3))
def test_parse_keeps_one_file_within_its_limits(limits: parse.FileLimits, mutations: list[tuple]) -> None:
    """Whatever the file and the limits: no more engines, devices, entries, and per engine no more error
    reasons, layers, loads or mounts than the limits allow; and what is left out is counted."""
    data = mutate(RICH_FILE, mutations)
    try:
        parsed = parse.parse(data, limits)
        whole = parse.parse(data)
    except parse.BadFile:
        return
    assert len(engines_named(parsed)) <= limits.engines
    devices = ({info.dev for info in parsed.infos.values()} | {dev for _, dev in parsed.mounts}
               | {dev for _, _, dev in parsed.loads})
    assert len(devices) <= limits.devices
    tables = (parsed.engines, parsed.errors, parsed.layers, parsed.infos, parsed.loads, parsed.waterfalls,
              parsed.mounts)
    assert sum(map(len, tables)) <= limits.entries
    for table, cap in ((parsed.errors, limits.errors_per_engine), (parsed.layers, limits.layers_per_engine),
                       (parsed.loads, limits.loads_per_engine), (parsed.mounts, limits.mounts_per_engine)):
        per_engine: dict[str, int] = {}
        for key in table:
            per_engine[key[0]] = per_engine.get(key[0], 0) + 1
        assert max(per_engine.values(), default=0) <= cap
    # A record kept within the limits is the record itself; whatever is missing was counted as left out.
    assert all(whole.engines[engine] == values for engine, values in parsed.engines.items())
    kept = sum(map(len, tables))
    whole_kept = sum(map(len, (whole.engines, whole.errors, whole.layers, whole.infos, whole.loads,
                               whole.waterfalls, whole.mounts)))
    assert kept == whole_kept or parsed.left_out > 0 or parsed.bad_record


def published_counters(totals: model.Totals) -> dict[tuple[str, object], list[float]]:
    """Every counter the reader publishes: engines' histograms and counters, error counts, layer times
    and samples, waterfall counters, the writers' drops."""
    counters: dict[tuple[str, object], list[float]] = {("dropped", None): [float(totals.dropped_by_writers)]}
    prefix = spool.ENGINE_LAYOUT.monotonic_prefix
    counters.update({("engine", engine): values[:prefix] for engine, values in totals.engines.items()})
    counters.update({("error", key): [count] for key, count in totals.errors.items()})
    counters.update({("layer", key): list(pair) for key, pair in totals.layers.items()})
    counters.update({("waterfall", engine): values[: model.WATERFALL_LAST_FROM]
                     for engine, values in totals.waterfalls.items()})
    return counters


@given(st.lists(st.lists(RICH_MUTATION, max_size=3), min_size=1, max_size=4))
def test_published_counters_never_fall_whatever_a_live_file_becomes(versions: list[list[tuple]]) -> None:
    """A live writer (its flock held) rewrites its own file into mutation after mutation of a real one,
    beside an exited writer's file (folded): no counter published after a read is lower than after the
    read before, none is NaN or infinite."""
    directory = os.path.join(ROOT, "live")
    shutil.rmtree(directory, ignore_errors=True)
    os.mkdir(directory)
    with open(os.path.join(directory, PRISTINE_NAME), "wb") as handle:
        handle.write(SEED)  # no writer holds it: folded at the first read
    live = spool.SpoolFile(directory)
    assert live.path is not None
    fd = os.open(live.path, os.O_WRONLY)
    try:
        os.pwrite(fd, RICH_FILE, 0)
        reader = spool_source.SpoolReader(directory)
        reader.recheck_seconds = 0.0  # every file read whole at every read, whatever its header says
        last = published_counters(reader.read())
        assert last[("engine", "engine0")] and reader.read().live_files == 1
        for mutations in versions:
            version = mutate(RICH_FILE, mutations)
            os.pwrite(fd, version, 0)
            os.ftruncate(fd, len(version))  # the file is this version, nothing after it
            now = published_counters(reader.read())
            for key, before in last.items():
                assert key in now, f"{key} is no longer published"
                assert all(map(math.isfinite, now[key]))
                assert all(value >= old for value, old in zip(now[key], before, strict=True)), (key, before, now[key])
            last = now
    finally:
        os.close(fd)
        live.close()
