"""Folding: a file's values added into totals, and what a live file's fall says (a writer's reset).

A live file's values are added as they are (:func:`add_counts`); when a record's counters are lower than
at the last read, or the record is gone, that is the writer's reset of that record: the values it had are
folded once, like a process that exited (:func:`fallen`), and its new values count from there.
"""

from __future__ import annotations

import operator
import time
import typing
from collections.abc import Mapping, Set

from gpuio.spool import ENGINE_LAYOUT

from .model import PER_GPU_LAYOUT, WATERFALL_LAST_FROM, Totals, add_into, merge_waterfall, observations, per_gpu_values
from .parse import Parsed


def add_counts(totals: Totals, parsed: Parsed, writer: tuple[int, int]) -> None:
    """A live file's engines (and who reports them), error counts, layer times and waterfalls, added up."""
    for engine, values in parsed.engines.items():
        total = totals.engines.get(engine)
        totals.engines[engine] = list(values) if total is None else list(map(operator.add, total, values))
        totals.processes[engine] = totals.processes.get(engine, 0) + 1
        totals.writers.setdefault(engine, []).append(writer)
    for key, count in parsed.errors.items():
        totals.errors[key] = totals.errors.get(key, 0.0) + count
    for key, pair in parsed.layers.items():
        old = totals.layers.get(key)
        totals.layers[key] = list(pair) if old is None else [old[0] + pair[0], old[1] + pair[1]]
    for engine, values in parsed.waterfalls.items():
        merge_waterfall(totals.waterfalls, engine, values)


def not_carried_forward(previous: Parsed | None, current: Parsed) -> Parsed | None:
    """What of a file's last content (``previous``) its content now (``current``) does not carry forward,
    to be folded before ``current`` replaces it: all of it when another writer (instance) is in the
    inode now (the last one's file was freed and its inode reused); else what fallen says, once the
    waterfalls copied mid-update are settled.  None: nothing (or no last content)."""
    if previous is None:
        return None
    if previous.instance != current.instance:
        return previous
    settle_waterfalls(previous, current)
    return fallen(previous, current)


def fallen(previous: Parsed, current: Parsed) -> Parsed | None:
    """The records of ``previous`` (a file's last content) that ``current`` (the same writer's content
    now) does not carry forward, as a Parsed to fold: each one gone, or with a counter lower than before
    (a histogram bucket or sum, a counter, an error count, a layer's time or samples, a waterfall
    counter), and the header's drop count if it fell.  None when nothing fell.  Gauges may fall: they
    are not looked at, and a Parsed that is folded has its gauges zeroed anyway."""
    engines = _fallen_records(previous.engines, current.engines, ENGINE_LAYOUT.monotonic_prefix)
    errors = {key: before for key, before in previous.errors.items()
              if key not in current.errors or current.errors[key] < before}
    layers = _fallen_records(previous.layers, current.layers, 2)
    waterfalls = _fallen_records(previous.waterfalls, current.waterfalls, WATERFALL_LAST_FROM)
    dropped = previous.dropped if current.dropped < previous.dropped else 0
    if not (engines or errors or layers or waterfalls or dropped):
        return None
    # The file's INFO records go with it: the GPU its per-GPU counts fold under (and its last load).
    return Parsed(previous.pid, previous.start_ticks, previous.instance, dropped, engines=engines, errors=errors,
                  layers=layers, infos=previous.infos, waterfalls=waterfalls)


_K = typing.TypeVar("_K")


def _fallen_records(previous: dict[_K, list[float]], current: dict[_K, list[float]],
                    monotonic: int) -> dict[_K, list[float]]:
    """The records of ``previous`` that ``current`` lacks, or in which one of the first ``monotonic``
    slots is lower (compared at C speed: a scrape of a thousand changed files checks every counter)."""
    lower = operator.lt
    return {key: before for key, before in previous.items()
            if (now := current.get(key)) is None or any(map(lower, now[:monotonic], before[:monotonic]))}


def settle_waterfalls(previous: Parsed, current: Parsed) -> None:
    """A WATERFALL record copied while its writer was updating it (its two sequence numbers differ)
    stands for nothing: the last good copy stays until a whole one is read."""
    for engine, values in current.waterfalls.items():
        before = previous.waterfalls.get(engine)
        if values[0] != values[-1] and before is not None:
            values[:] = before


class Folded:
    """The totals of exited writers, and of live writers' resets (:func:`fallen`), kept while the exporter
    runs: per engine (an ENGINE record's doubles, gauges zeroed: a dead process has nothing in flight),
    per engine and GPU (the GPU it had while it lived), and the loads its exit abandoned.  Bounded by
    ``max_engines`` (:meth:`bound`)."""

    def __init__(self, max_engines: int) -> None:
        self.max_engines = max_engines
        self.totals = Totals()
        self.touched: dict[str, float] = {}  # engine -> when it was last folded (monotonic)
        self.per_gpu: dict[tuple[str, str], list[float]] = {}  # PER_GPU_LAYOUT vectors
        self.abandoned: dict[tuple[str, str], float] = {}
        self.forgotten_engines = 0  # engines forgotten past the cap (a counter)
        self._pruned_at = 0

    def fold(self, parsed: Parsed, gpu_seen: Mapping[tuple[int, str], str]) -> None:
        """Add a file's values in for good; ``gpu_seen``: (writer instance, engine) -> the GPU NVML listed
        the writer on at the last read."""
        folded = self.totals
        now = time.monotonic()
        for engine, values in parsed.engines.items():
            total = folded.engines.get(engine)
            kept = list(values)
            for index in ENGINE_LAYOUT.gauges.values():
                kept[index] = 0.0  # a dead process has nothing in flight and no pool
            folded.engines[engine] = kept if total is None else list(map(operator.add, total, kept))
            self.touched[engine] = now
        for key, count in parsed.errors.items():
            folded.errors[key] = folded.errors.get(key, 0.0) + count
        for key, pair in parsed.layers.items():
            old = folded.layers.get(key, [0.0, 0.0])
            folded.layers[key] = [old[0] + pair[0], old[1] + pair[1]]
        for engine, info in parsed.infos.items():
            if info.load_time > 0:  # 0: loading, never finished a load
                folded.last_load[engine] = max(folded.last_load.get(engine, 0.0), info.load_time)
        for engine, values in parsed.waterfalls.items():
            merge_waterfall(folded.waterfalls, engine, values)
        folded.dropped_by_writers += parsed.dropped
        self._fold_per_gpu(parsed, gpu_seen)

    def _fold_per_gpu(self, parsed: Parsed, gpu_seen: Mapping[tuple[int, str], str]) -> None:
        """An exited writer's per-GPU counts stay under the GPU it had while alive (gauges zeroed), and
        its loads still in progress count as abandoned there.  Bounded: past max_engines * 4 keys, new GPUs
        of an engine fold into its "" series, and engines forgotten by the engine cap are forgotten here
        too."""
        for engine, values in parsed.engines.items():
            kept = list(per_gpu_values(values))
            for index in PER_GPU_LAYOUT.gauges.values():
                kept[index] = 0.0
            add_into(self.per_gpu, (engine, self._gpu(parsed, engine, "", gpu_seen)), kept)
        for (engine, uuid, _), (in_progress, _, _) in parsed.loads.items():
            if in_progress >= 1:  # whole loads only: the slot is a count the writer moves by one
                key = (engine, self._gpu(parsed, engine, uuid, gpu_seen))
                self.abandoned[key] = self.abandoned.get(key, 0.0) + float(int(in_progress))
        if self._pruned_at != self.forgotten_engines:
            self._pruned_at = self.forgotten_engines
            for table in (self.per_gpu, self.abandoned):
                for key in [key for key in table if key[0] not in self.totals.engines]:
                    del table[key]

    def _gpu(self, parsed: Parsed, engine: str, recorded: str, gpu_seen: Mapping[tuple[int, str], str]) -> str:
        """The GPU an exited writer's ``engine`` folds under: the one it recorded (for a load, on the load
        itself), else the one its INFO or NVML gave while it lived; "" once the folded keys are at their cap."""
        info = parsed.infos.get(engine)
        uuid = recorded or (info.gpu_uuid if info else "") or gpu_seen.get((parsed.instance, engine), "")
        known = (engine, uuid) in self.per_gpu or (engine, uuid) in self.abandoned
        return uuid if known or len(self.per_gpu) < self.max_engines * 4 else ""

    def bound(self, protected: Set[str], live: Set[str]) -> bool:
        """Folded totals are kept while the exporter runs, up to a cap, so endless distinct names cannot
        grow memory forever.  Past it an engine is forgotten whole (counted), never in part, and never
        one whose counters someone sees: not a ``protected`` (exported) engine, not one a ``live`` file
        still reports (its counters would drop to the live part: a reset).  Junk goes first: engines
        with no observation at all, then those with the fewest, then those folded longest ago.  True
        when something was forgotten."""
        excess = len(self.totals.engines) - self.max_engines
        if excess <= 0:
            return False
        candidates = [engine for engine in self.touched if engine not in protected and engine not in live]
        candidates.sort(key=lambda engine: (observations(self.totals.engines.get(engine)), self.touched[engine]))
        for engine in candidates[:excess]:
            self.touched.pop(engine)
            self.totals.engines.pop(engine, None)
            self.totals.last_load.pop(engine, None)
            self.totals.waterfalls.pop(engine, None)
            for table in (self.totals.errors, self.totals.layers):
                for key in [k for k in table if k[0] == engine]:
                    del table[key]
            self.forgotten_engines += 1
        return bool(candidates[:excess])

    def copy(self) -> Totals:
        """A Totals to merge live files into: a copy of the folded totals."""
        folded = self.totals
        return Totals(
            engines={engine: list(values) for engine, values in folded.engines.items()},
            errors=dict(folded.errors),
            layers={key: list(pair) for key, pair in folded.layers.items()},
            last_load=dict(folded.last_load),
            waterfalls={engine: list(values) for engine, values in folded.waterfalls.items()},
            dropped_by_writers=folded.dropped_by_writers,
            abandoned=dict(self.abandoned),
        )
