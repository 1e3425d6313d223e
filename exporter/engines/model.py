"""The engine model: what every source of engine facts adds up to, and how two sources join.

:class:`Totals` is one model of every engine on the node, whichever source reports it: the spool of
processes that use the library (:mod:`exporter.engines.spool`) and the processes discovery finds without
it (:mod:`exporter.engines.discovery`); :func:`combined` joins them.  The engines collector renders it.
The vectors are the library's record layouts (:mod:`gpuio.spool`): an ENGINE record's doubles per engine,
the per-GPU part of them (PER_GPU_LAYOUT) per engine and GPU, a WATERFALL record's per engine.
"""

from __future__ import annotations

import dataclasses
import operator
import typing
from dataclasses import dataclass, field

from gpuio.spool import ENGINE_LAYOUT, ENGINE_SERIES, GAUGES, WATERFALL, WATERFALL_COUNTERS, Layout

# What the reader keeps per engine *and GPU* (the rest is per engine): the series that say whether work
# waits on one GPU.  A compact vector of these ENGINE slots, in this order; PER_GPU_LAYOUT indexes it.
PER_GPU_HISTOGRAMS = tuple(series.slot for series in ENGINE_SERIES if series.per_gpu and series.type == "histogram")


def _per_gpu_layout() -> tuple[tuple[int, ...], Layout]:
    slots: list[int] = []
    histograms: dict[str, tuple[int, int, tuple[float, ...]]] = {}
    for name in PER_GPU_HISTOGRAMS:
        first, sum_index, bounds = ENGINE_LAYOUT.histograms[name]
        histograms[name] = (len(slots), len(slots) + sum_index - first, bounds)
        slots.extend(range(first, sum_index + 1))
    monotonic = len(slots)
    gauges = {name: monotonic + offset for offset, name in enumerate(GAUGES)}
    slots.extend(ENGINE_LAYOUT.gauges[name] for name in GAUGES)
    return tuple(slots), Layout(histograms, {}, gauges, len(slots), monotonic)


PER_GPU_SLOTS, PER_GPU_LAYOUT = _per_gpu_layout()
per_gpu_values = operator.itemgetter(*PER_GPU_SLOTS)
# The histogram bucket slots of an ENGINE record: whole counts (OpenMetrics refuses anything else).
BUCKET_SLOTS = tuple(index for first, sum_index, _ in ENGINE_LAYOUT.histograms.values()
                     for index in range(first, sum_index))
bucket_values = operator.itemgetter(*BUCKET_SLOTS)  # at C speed: a scrape of 1,000 changed files checks 141,000


def histogram_count_and_sum(values: typing.Sequence[float], name: str) -> tuple[float, float]:
    """An ENGINE vector's histogram ``name``: how many observations, and their sum."""
    first, sum_index, _ = ENGINE_LAYOUT.histograms[name]
    return sum(values[first:sum_index]), values[sum_index]


def counter(values: typing.Sequence[float], name: str) -> float:
    """An ENGINE vector's counter ``name``."""
    return values[ENGINE_LAYOUT.counters[name]]


@dataclass(frozen=True)
class EngineInfo:
    path: str
    cuda_device: int
    gpu_uuid: str
    runtime: str
    dev: tuple[int, int]
    ino: int
    size: int
    mtime_ns: int
    load_time: float


LoadKey = tuple[str, str, tuple[int, int]]  # engine, GPU uuid ("" unknown), st_dev of the file
# What makes two INFO records one engine file: engine, path, CUDA device, GPU uuid, runtime, st_dev, inode.
InfoIdentity = tuple[str, str, int, str, str, tuple[int, int], int]
MountKey = tuple[str, tuple[int, int]]  # engine, st_dev of its file


@dataclass(frozen=True)
class WriterMount:
    """A writer's own mountinfo line for its engine file's st_dev (its word: untrusted)."""

    mountpoint: str
    fstype: str
    source: str
    layer: str  # overlayfs: a layer directory, a path of the host's filesystem


MAX_MOUNTS_PER_ENGINE = 4


@dataclass(frozen=True)
class PodIdentity:
    """The pod a spool writer runs in.  ``pod_uid`` is the kubelet's where the exporter found the file in
    that pod's volume (the path says it); otherwise, like the names, what the writer recorded (its
    Downward API environment and cgroup): a claim, shown as such."""

    namespace: str = ""
    pod: str = ""
    container: str = ""
    pod_uid: str = ""


@dataclass
class Totals:
    """Everything merged: live files plus the folded totals of exited processes."""

    engines: dict[str, list[float]] = field(default_factory=dict)
    errors: dict[tuple[str, str], float] = field(default_factory=dict)
    layers: dict[tuple[str, str], list[float]] = field(default_factory=dict)
    # live processes only; one entry per distinct (path, GPU, runtime, file identity), the latest load
    infos: dict[str, list[EngineInfo]] = field(default_factory=dict)
    processes: dict[str, int] = field(default_factory=dict)  # engine -> live processes reporting it
    writers: dict[str, list[tuple[int, int]]] = field(default_factory=dict)  # engine -> (pid, start ticks) live
    # (engine, GPU uuid) -> PER_GPU_LAYOUT vector: live processes merged per GPU, plus folded totals
    per_gpu: dict[tuple[str, str], list[float]] = field(default_factory=dict)
    # loads in progress of live processes: (engine, GPU uuid, st_dev) -> LOAD_SLOTS (counts and bytes
    # summed, the oldest start time the smallest)
    loads: dict[LoadKey, list[float]] = field(default_factory=dict)
    last_load: dict[str, float] = field(default_factory=dict)
    # engine -> WATERFALL vector: counters summed over live and exited writers, the last-load slots of
    # the latest load among them
    waterfalls: dict[str, list[float]] = field(default_factory=dict)
    mounts: dict[MountKey, WriterMount] = field(default_factory=dict)  # live writers', per engine capped
    live_files: int = 0
    dropped_by_writers: int = 0
    # (engine, path) -> owners (uids) of the live files whose INFO names that path: the exporter opens an
    # engine file only where one of them could have read it (collectors/engines.py)
    info_uids: dict[tuple[str, str], set[int]] = field(default_factory=dict)
    deferred_files: int = 0  # files left for a later scrape: this one's read budget was spent
    unfinished_listings: int = 0  # directories whose listing goes on at the next scrapes (DirectoryScan)
    records_left_out: int = 0  # records of live files their FileLimits leave out now (Parsed.left_out)
    # (engine, GPU uuid) -> the pods of the live writers reporting it (PodIdentity of each file)
    pods: dict[tuple[str, str], set[PodIdentity]] = field(default_factory=dict)
    # (engine, GPU uuid) -> loads that were in progress when their writer exited (folded only): a process
    # killed while loading (a startup probe, OOM) never finishes its load, and a crash-looping cold start
    # is one such load per attempt.  The evidence that survives the processes (docs/engines.md).
    abandoned: dict[tuple[str, str], float] = field(default_factory=dict)
    # engine -> live processes found holding its file without the library (exporter.engines.discovery)
    discovered_processes: dict[str, int] = field(default_factory=dict)

    def live_processes(self, engine: str) -> int:
        """The engine's live processes, whichever source reports them (the spool or discovery)."""
        return self.processes.get(engine, 0) + self.discovered_processes.get(engine, 0)


def combined(spool: Totals, discovered: Totals) -> Totals:
    """The spool's totals with the engines discovery found (exporter.engines.discovery) added in: one model of
    every engine, whichever source reports it.  Neither argument changes (the reader reuses its merge
    between reads): the tables are copied shallow, and only the entries discovery adds to are new objects;
    discovered processes are counted apart (``discovered_processes``)."""
    if not (discovered.engines or discovered.infos or discovered.abandoned):
        return spool
    out = dataclasses.replace(
        spool, engines=dict(spool.engines), infos=dict(spool.infos), writers=dict(spool.writers),
        loads=_copied(spool.loads, discovered.loads), last_load=dict(spool.last_load),
        waterfalls=_copied(spool.waterfalls, discovered.waterfalls), info_uids=dict(spool.info_uids),
        pods=dict(spool.pods), abandoned=dict(spool.abandoned), discovered_processes=dict(discovered.processes))
    for engine, values in discovered.engines.items():
        total = out.engines.get(engine)
        out.engines[engine] = list(values) if total is None else list(map(operator.add, total, values))
    for engine, items in discovered.infos.items():
        out.infos[engine] = [*out.infos.get(engine, ()), *items]
    for engine, found in discovered.writers.items():
        out.writers[engine] = [*out.writers.get(engine, ()), *found]
    for load, values in discovered.loads.items():
        merge_load(out.loads, load, values)
    for engine, moment in discovered.last_load.items():
        out.last_load[engine] = max(out.last_load.get(engine, 0.0), moment)
    for engine, values in discovered.waterfalls.items():
        merge_waterfall(out.waterfalls, engine, values)
    for file, uids in discovered.info_uids.items():
        out.info_uids[file] = out.info_uids.get(file, set()) | uids
    for pair, pods in discovered.pods.items():
        out.pods[pair] = out.pods.get(pair, set()) | pods
    for pair, count in discovered.abandoned.items():
        out.abandoned[pair] = out.abandoned.get(pair, 0.0) + count
    return out


_V = typing.TypeVar("_V")


def _copied(table: dict[_V, list[float]], changing: typing.Iterable[_V]) -> dict[_V, list[float]]:
    """A shallow copy of ``table`` whose entries at the keys of ``changing`` are lists of their own (the
    merge adds into them in place)."""
    out = dict(table)
    for key in changing:
        if key in out:
            out[key] = list(out[key])
    return out


def add_into(table: dict[tuple[str, str], list[float]], key: tuple[str, str], values: typing.Sequence[float]) -> None:
    total = table.get(key)
    table[key] = list(values) if total is None else list(map(operator.add, total, values))


def merge_load(table: dict[LoadKey, list[float]], key: LoadKey, values: list[float]) -> None:
    """Loads of several writers: counts and bytes add up, the oldest start is the earliest (a slot
    read while its writer was between stores may say loads with no start yet: 0, ignored)."""
    in_progress, read_bytes, oldest = values
    merged = table.get(key)
    if merged is None:
        table[key] = [in_progress, read_bytes, oldest if in_progress > 0 else 0.0]
        return
    merged[0] += in_progress
    merged[1] += read_bytes
    if in_progress > 0 and oldest > 0 and (merged[2] <= 0 or oldest < merged[2]):
        merged[2] = oldest


WATERFALL_LAST_FROM = len(WATERFALL_COUNTERS)  # the last-load slots start here (seq_end is the last slot)


def merge_waterfall(table: dict[str, list[float]], engine: str, values: list[float]) -> None:
    """Counters add up; the last-load slots are those of the latest load (its start time)."""
    merged = table.get(engine)
    if merged is None:
        table[engine] = list(values)
        return
    start = WATERFALL["last_start"]
    newer = values[start] > merged[start]
    for index in range(WATERFALL_LAST_FROM):
        merged[index] += values[index]
    if newer:
        merged[WATERFALL_LAST_FROM:] = values[WATERFALL_LAST_FROM:]


def observations(values: list[float] | None) -> float:
    """How much an engine's totals say: histogram observations plus bytes loaded (0: nothing)."""
    if values is None:
        return 0.0
    return sum(values[index] for index in BUCKET_SLOTS) + values[ENGINE_LAYOUT.counters["load_read_bytes"]]
