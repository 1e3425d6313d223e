"""The merge of the spool: the folded totals of exited writers plus every live file, per engine, per
engine and GPU and per load in progress, with the engines of writers that recorded no GPU placed where
NVML says their writer is (see WriterGpus in :mod:`exporter.engines.spool`).
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Callable, Collection

from .fold import Folded, add_counts
from .model import MAX_MOUNTS_PER_ENGINE, EngineInfo, InfoIdentity, PodIdentity, Totals, merge_load, per_gpu_values
from .parse import Parsed
from .spool_files import FileId, FileState
from .spool_liveness import writer_of


class SpoolMerge:
    """Adds up the folded totals and the live files (``totals``); places the engines of live writers that
    recorded no GPU for them (``place_writers``) first.

    ``gpu_of``: the GPU of a live writer (pid, start ticks) that did not record one: the exporter asks
    NVML.  ``place_of``: where such a writer's engine file (by the path it names) is among its GPUs
    (WriterGpus.placed): a writer NVML lists on several GPUs.  Without it, on the one GPU ``gpu_of``
    gives, or none."""

    def __init__(self, gpu_of: Callable[[int, int], str | None] | None,
                 place_of: Callable[[int, int, str], tuple[str, ...]] | None) -> None:
        self.gpu_of = gpu_of
        self.place_of = place_of
        # (file, engine) -> the GPUs its series without a GPU are placed on, at the last read
        self._placed: dict[tuple[FileId, str], tuple[str, ...]] = {}
        self.gpu_seen: dict[tuple[int, str], str] = {}  # (writer instance, engine) -> GPU at the last read

    def place_writers(self, live: Collection[FileState]) -> tuple[object, ...]:
        """Places the engines of live writers that recorded no GPU for them (``_placed``; see _placed_on);
        returns what it found, as a key of the merge."""
        placed: dict[tuple[FileId, str], tuple[str, ...]] = {}
        if self.gpu_of is not None or self.place_of is not None:
            for state in live:
                parsed = state.parsed
                if not state.needs_gpu or parsed is None:
                    continue
                writer = writer_of(state, parsed)
                unplaced = {engine for engine, _, _ in parsed.loads} | parsed.engines.keys() | parsed.infos.keys()
                for engine in unplaced:
                    info = parsed.infos.get(engine)
                    if info is None or not info.gpu_uuid:
                        placed[(state.file_id, engine)] = self._place(writer, info.path if info else "")
        self._placed = placed
        return tuple(placed.items())

    def _place(self, writer: tuple[int, int], path: str) -> tuple[str, ...]:
        if self.place_of is not None:
            return self.place_of(writer[0], writer[1], path)
        found = self.gpu_of(*writer) if self.gpu_of is not None else None
        return (found,) if found else ()

    def _placed_on(self, state: FileState, engine: str) -> tuple[str, ...]:
        """The GPUs a live writer's ``engine`` is on where the writer did not say: an engine info names
        each of them (the engine is there); its per-GPU series and loads in progress go to the GPU only
        when there is one, else stay on "" (which GPU served a request or reads a file, the writer did not
        say, and a share of it on each would be invented)."""
        return self._placed.get((state.file_id, engine), ())

    def totals(self, folded: Folded, live: Collection[FileState], deferred_files: int,
               unfinished_listings: int) -> Totals:
        """The folded totals of exited writers plus every live file, per engine, per engine and GPU and per
        load in progress (and how much of the spool the last read left for later)."""
        totals = folded.copy()
        infos: dict[InfoIdentity, EngineInfo] = {}
        mounts_of: dict[str, set[tuple[int, int]]] = {}  # engine -> the st_devs whose mount is kept
        for state in live:
            parsed = state.parsed
            if parsed is None:
                continue
            writer = writer_of(state, parsed)
            totals.live_files += 1
            totals.records_left_out += parsed.left_out
            totals.dropped_by_writers += parsed.dropped
            add_counts(totals, parsed, writer)
            for (engine, dev), mount in parsed.mounts.items():
                kept = mounts_of.setdefault(engine, set())
                if (engine, dev) in totals.mounts or len(kept) < MAX_MOUNTS_PER_ENGINE:
                    kept.add(dev)
                    totals.mounts[(engine, dev)] = mount
            self._add_infos_and_pods(totals, infos, pod_of(state, parsed), state, parsed)
        for identity, info in infos.items():
            totals.infos.setdefault(identity[0], []).append(info)
        self._merge_per_gpu_and_loads(totals, folded, live)
        return self._with_owners(totals, live, deferred_files, unfinished_listings)

    @staticmethod
    def _with_owners(totals: Totals, live: Collection[FileState], deferred_files: int,
                     unfinished_listings: int) -> Totals:
        """Which writers (file owners) report each engine path: the exporter opens an engine file only
        where one of them could have read it."""
        for state in live:
            if state.parsed is not None:
                for engine, info in state.parsed.infos.items():
                    totals.info_uids.setdefault((engine, info.path), set()).add(state.uid)
        totals.deferred_files = deferred_files
        totals.unfinished_listings = unfinished_listings
        return totals

    def _add_infos_and_pods(self, totals: Totals, infos: dict[InfoIdentity, EngineInfo], pod: PodIdentity | None,
                            state: FileState, parsed: Parsed) -> None:
        """A live file's engine files (one INFO per distinct file and GPU, the latest load; one per GPU it
        is placed on where the writer named none), the last load of each engine, and the pod of each
        (engine, GPU) it reports."""
        if pod is not None:
            for engine in parsed.engines.keys() - parsed.infos.keys():
                totals.pods.setdefault((engine, ""), set()).add(pod)
        for engine, info in parsed.infos.items():
            placed = [info] if info.gpu_uuid else [dataclasses.replace(info, gpu_uuid=uuid)
                                                   for uuid in self._placed_on(state, engine)] or [info]
            for info in placed:
                self._add_info(totals, infos, pod, engine, info)

    @staticmethod
    def _add_info(totals: Totals, infos: dict[InfoIdentity, EngineInfo], pod: PodIdentity | None, engine: str,
                  info: EngineInfo) -> None:
        if pod is not None:
            totals.pods.setdefault((engine, info.gpu_uuid), set()).add(pod)
        identity = (engine, info.path, info.cuda_device, info.gpu_uuid, info.runtime, info.dev, info.ino)
        seen = infos.get(identity)
        if seen is None or seen.load_time < info.load_time:
            infos[identity] = info
        if info.load_time > 0:  # 0: loading, never finished a load
            totals.last_load[engine] = max(totals.last_load.get(engine, 0.0), info.load_time)

    # --- per engine and GPU; loads in progress ----------------------------------------------------

    def _one_gpu(self, state: FileState, engine: str, recorded: str = "") -> str:
        """The GPU a live writer's per-GPU series and loads of ``engine`` go to: what it recorded, else the
        one GPU it is placed on, else "" (see _placed_on)."""
        if recorded:
            return recorded
        placed = self._placed_on(state, engine)
        return placed[0] if len(placed) == 1 else ""

    def _merge_per_gpu_and_loads(self, totals: Totals, folded: Folded, live: Collection[FileState]) -> None:
        """Per (engine, GPU): the live writers' per-GPU slots plus the folded ones; and the loads in
        progress of live writers (a dead writer's loads are over, whatever its file says)."""
        # Grouped first, summed once per (engine, GPU) at C speed: a scrape of 1,000 writers pays one
        # tuple per writer and engine here, not one list addition.
        groups: dict[tuple[str, str], list[typing.Sequence[float]]] = {
            key: [values] for key, values in folded.per_gpu.items()}
        seen: dict[tuple[int, str], str] = {}  # only GPUs NVML gave: a recorded one is in the file itself
        for state in live:
            parsed = state.parsed
            if parsed is None:
                continue
            infos = parsed.infos
            for engine, values in parsed.engines.items():
                info = infos.get(engine)
                uuid = info.gpu_uuid if info is not None else ""
                if not uuid and (self.gpu_of is not None or self.place_of is not None):
                    uuid = seen[(parsed.instance, engine)] = self._one_gpu(state, engine)
                group = groups.get((engine, uuid))
                if group is None:
                    groups[(engine, uuid)] = [per_gpu_values(values)]
                else:
                    group.append(per_gpu_values(values))
            if parsed.loads:
                for (engine, uuid, dev), values in parsed.loads.items():
                    merge_load(totals.loads, (engine, self._one_gpu(state, engine, uuid), dev), values)
        self.gpu_seen = seen
        totals.per_gpu = {key: list(group[0]) if len(group) == 1 else list(map(sum, zip(*group, strict=True)))
                          for key, group in groups.items()}


def pod_of(state: FileState, parsed: Parsed) -> PodIdentity | None:
    """The pod of a live file: the writer's record, with the UID of the pod volume it was found in
    (the kubelet's, which a writer cannot choose) in place of the one it recorded."""
    pod = parsed.pod
    if state.pod_uid:
        return dataclasses.replace(pod or PodIdentity(), pod_uid=state.pod_uid)
    return pod if pod is not None and any(dataclasses.astuple(pod)) else None
