"""The engine service: one object owns every source of engine facts and hands out snapshots of them.

The sources (docs/engines.md): the spool (the library's processes, :class:`.spool.SpoolReader`), the
pods' spools in their emptyDir volumes (found by a background scan of the kubelet's pods directory),
discovery (processes serving engines without the library, :class:`.discovery.Discovery`, in background
passes), the engine files (size, residency, device look-ups: :class:`.files.EngineFiles`, a background
scan) and tenant selection (which engines are shown under the cap: :class:`.selection.EngineSelection`).

:meth:`EngineService.snapshot` reads them once and joins them: the spool and discovery's totals as one,
the engines chosen, their GPUs, the devices under their files.  Three places render it and none of
them reads a source itself: the engines collector (exporter.collectors.engines: the series), ``gpuio
engines`` and ``GET /api/v1/engines`` (exporter.engine_join: the rows).

Every ``--collector.engines.work-interval`` (1 s) a background sampler measures what engines do on each
GPU (:mod:`.work`: in flight, loading, waiting, a saturated disk under their files) into
``Context.gpu_work``, which the nvml collector's GPU-time ledger reads.

The spool reader is read by one caller at a time (the service's lock: a scrape's snapshot, the API's
read and the work measurement take turns); the other background samplers hand their results over
through :class:`PeriodicSampler`.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gpuio import spool as spool_format

from ..context import Context
from ..host.diskstats import SaturatedDisks
from ..logsetup import LogOnce
from ..pods import kubelet
from ..sampler import PeriodicSampler, Snapshot
from . import discovery, model, spool
from .files import EngineFiles, FileDevices, FileView, ScanResult, Target, glob_directory
from .selection import EngineSelection, LeftOut
from .work import WorkMeter

log = logging.getLogger("gpuio.collector.engines")

# The GPUs and pods of one engine that are shown (in /metrics and the JSON API); the rest are counted
# (gpuio_engine_dropped_series_total{kind="engine_gpu"} and {kind="pod"}).
MAX_GPUS_PER_ENGINE = 16
MAX_PODS_PER_ENGINE = 64
# Discovery is stuck (the collector turns stale) when no pass has ended for this many intervals, and
# at least this long: a pass over 100k descriptors takes seconds, never minutes.
DISCOVERY_STUCK_INTERVALS = 10
DISCOVERY_STUCK_SECONDS = 60.0
# What a cap left out, by kind: each counted in gpuio_engine_dropped_series_total{kind}.
LEFT_OUT_KINDS = ("engine", "error", "info", "layer", "engine_gpu", "pod")


@dataclass(frozen=True)
class EngineSnapshot:
    """The engine facts at one moment, joined: what a scrape, ``gpuio engines`` and the API render."""

    totals: model.Totals  # the spool's and discovery's, as one
    chosen: list[str]  # the engines shown, in the order chosen: each tenant's first engines first
    pairs: list[tuple[str, str]]  # (engine, GPU UUID) of the engines shown, MAX_GPUS_PER_ENGINE each at most
    files: FileDevices  # the devices and disks under the shown engines' files
    scan: ScanResult | None  # the background scan's last answer (sizes, residency); None before the first
    pod_spools: kubelet.Discovery | None  # the last scan of the kubelet's pods directory
    discovered: Snapshot[discovery.Discovered] | None  # discovery's last pass; None with discovery off
    stuck: str | None  # why discovery's passes stopped finishing, or None
    pending: bool  # the first scan of engine files has not ended yet

    @property
    def engines(self) -> list[str]:
        """The engines shown, by name."""
        return sorted(self.chosen)


class NoSource(Exception):  # noqa: N818  (an outcome: the collector says absent)
    """Nothing can report engines here: no spool directory, no kubelet pods' spools, no globs, no
    discovery."""


class EngineService:
    """Owns the engine sources and joins them into snapshots (module note).  ``settings`` are the engines
    collector's options, parsed (exporter.collectors.engines.OPTIONS); ``read_only`` (``gpuio engines``)
    leaves exited writers' spool files in place, for the exporter to fold."""

    def __init__(self, context: Context, settings: Mapping[str, Any], read_only: bool = False) -> None:
        self.context = context
        self.settings = settings
        self.spool_dir: str = settings["spool-dir"]
        self.max_engines: int = settings["max-engines"]
        gpus = context.gpu_processes
        self.writer_gpus = spool.WriterGpus(gpus.get, context.procfs, gpus_of_process=gpus.gpus_of,
                                            ordered=gpus.ordered)
        self.reader = spool.SpoolReader(self.spool_dir, max_folded_engines=self.max_engines * 4,
                                        remove_dead=not read_only, gpu_of=self.writer_gpus,
                                        max_file_bytes=settings["max-file-bytes"], procfs=context.procfs,
                                        place_of=self.writer_gpus.placed)
        self._reading = threading.Lock()  # one read of the spool at a time (module note)
        self._started = False  # start() called: the samplers run on their threads
        self._started_at = 0.0  # wall clock: when start() was called
        globs: tuple[str, ...] = settings["path"]
        path_include = tuple(settings["path-include"]) + tuple(glob_directory(g) for g in globs)
        self.left_out: dict[str, LeftOut] = {kind: LeftOut() for kind in LEFT_OUT_KINDS}
        self.files = EngineFiles(context, globs, settings["max-files"], path_include,
                                 settings["residency-interval"], self.left_out["info"],
                                 background=lambda: self._started)
        self.selection = EngineSelection(self.max_engines, self.left_out["engine"])
        self._bad = LogOnce(log)
        self.pods_dir: str = settings["kubelet-pods-dir"]
        self.pod_spools: PeriodicSampler[kubelet.Discovery] = PeriodicSampler(
            "pod-spools", settings["pod-spool-interval"], self.find_pod_spools, log)
        self.discovery = self._discovery(path_include) if settings["discover"] else None
        self.discoveries: PeriodicSampler[discovery.Discovered] | None = None
        if self.discovery is not None:
            self.discoveries = PeriodicSampler("engine-discovery", settings["discover-interval"],
                                               self.discovery.sample, log)
        self._work_meter = WorkMeter(SaturatedDisks(context.procfs, context.sysfs),
                                     lambda dev: self.files.device_of(dev, look_up=False)[1])
        self.work: PeriodicSampler[int] = PeriodicSampler("engine-work", settings["work-interval"],
                                                          self.measure_work, log)

    def _discovery(self, path_include: tuple[str, ...]) -> discovery.Discovery:
        """Discovery of the processes that serve engines without the library, told by the nvml collector
        (Context.gpu_processes) which processes hold which GPU."""
        gpus = self.context.gpu_processes
        return discovery.Discovery(path_include, self.settings["discover-patterns"], self.context.procfs,
                                   self.context.sysfs, gpu_of=gpus.get, gpu_processes=gpus.processes,
                                   gpus_of=gpus.gpus_of, memory_of=gpus.memory_of, ordered_gpus=gpus.ordered)

    # --- the background samplers ---------------------------------------------------------------

    def _samplers(self) -> list[PeriodicSampler[Any]]:
        return [self.files.scanner, self.pod_spools, self.files.layers, self.work,
                *([self.discoveries] if self.discoveries else [])]

    def start(self) -> None:
        self._started = True
        self._started_at = time.time()
        for sampler in self._samplers():
            sampler.start()

    def stop(self) -> None:
        for sampler in self._samplers():
            sampler.stop()

    def find_pod_spools(self) -> kubelet.Discovery:
        """Scan the kubelet's pods directory and hand what it holds to the spool reader (background)."""
        found = kubelet.find_spools(self.pods_dir, self.settings["pod-spool-volume"],
                                    self.settings["max-pod-spools"])
        if found.error:
            self._bad.warning("cannot read the kubelet's pods directory: inference pods' emptyDir spools are "
                              "not found (docs/deploy.md, Pods)", found.error, path=self.pods_dir)
        if found.directories != self.reader.pod_directories:
            log.info("pod spool directories", extra={"found": len(found.directories), "pods": found.pods})
        self.reader.set_pod_directories(found.directories)
        return found

    # --- on demand, on the caller's thread (gpuio engines) -----------------------------------------

    def find_pod_spools_now(self) -> kubelet.Discovery | None:
        """Scan the kubelet's pods directory on this thread (the snapshots after it read what it found)."""
        return self.pod_spools.sample_now().value

    def totals_now(self) -> model.Totals:
        """The spool merged now with the engines discovery's last pass found (no selection, no files)."""
        return self._read_totals(True)

    def measure_work(self) -> int:
        """What engines do on each GPU now, into Context.gpu_work (background, every work interval);
        returns how many devices have work."""
        now = time.monotonic()
        devices = self._work_meter.measure(self._read_totals(self._has_spool()), now)
        self.context.gpu_work.update(devices, now)
        return len(devices)

    def files_now(self) -> dict[tuple[str, str], FileView]:
        """Every engine file known now, (engine, path) -> its size, residency and device: a scan run on
        this thread, not the background one's last."""
        scan = self.files.scanner.sample_now().value
        return dict(scan.files) if scan is not None else {}

    # --- the snapshot ---------------------------------------------------------------------------

    def snapshot(self) -> EngineSnapshot:
        """Every source read once and joined (module note); raises NoSource where nothing can report."""
        has_spool = self._has_spool()
        if not has_spool and not self.files.globs and self.discoveries is None:
            raise NoSource(f"spool directory {self.spool_dir} does not exist; instrumented processes cannot "
                           "report (and neither --collector.engines.path nor discovery is on)")
        totals = self._read_totals(has_spool)
        if totals.pods:  # the pods of writers, for the nvml collector's process series
            self.context.pods.update_writer_pods((pod.pod_uid, pod.namespace, pod.pod)
                                                 for found in totals.pods.values() for pod in found)
        chosen = self.selection.select(totals)
        self.reader.protected = self.selection.shown  # their folded totals are never forgotten
        pairs = self._engine_gpus(totals, sorted(chosen))
        files = self.files.file_devices(totals, chosen, pairs)
        self.files.watch(_scan_targets(totals, sorted(chosen), files))
        discovered = self.discoveries.snapshot() if self.discoveries else None
        return EngineSnapshot(totals=totals, chosen=chosen, pairs=pairs, files=files, scan=self.files.last_scan(),
                              pod_spools=self.pod_spools.snapshot().value, discovered=discovered,
                              stuck=self._discovery_stuck(), pending=self.files.scanner.first_pending())

    def _has_spool(self) -> bool:
        """The spool directory exists, or this is a kubelet's node: the pods' volumes are a source even
        while no pod has a spool volume."""
        pods = self.pod_spools.snapshot().value
        return os.path.isdir(self.spool_dir) or (pods is not None and pods.exists)

    def _read_totals(self, has_spool: bool) -> model.Totals:
        """The spool (where there is one) and discovery's last pass, merged: one reader at a time."""
        with self._reading:
            return self._with_discovered(self.reader.read() if has_spool else model.Totals())

    def _with_discovered(self, totals: model.Totals) -> model.Totals:
        """The spool's totals and the last discovery pass's, as one (exporter.engines.discovery).  Discovery
        is told which spool files the reader reads: their processes report through the library, never twice."""
        if self.discovery is None or self.discoveries is None:
            return totals
        self.discovery.library_files = self.reader.live_file_ids()
        if not self._started:
            self.discoveries.sample_now()
        found = self.discoveries.snapshot().value
        if found is None:
            return totals
        self.context.pods.set_discovered_pods(pod.pod_uid for found_pods in found.totals.pods.values()
                                              for pod in found_pods)
        named = {key: {self._named(pod, key[1]) for pod in found_pods} for key, found_pods in found.totals.pods.items()}
        return model.combined(totals, dataclasses.replace(found.totals, pods=named))

    def _named(self, pod: model.PodIdentity, gpu_uuid: str) -> model.PodIdentity:
        """A discovered process's pod (its UID, from its cgroup) with the names the kubelet gives it."""
        names = self.context.pods.of_process(pod.pod_uid, gpu_uuid) if gpu_uuid else None
        return model.PodIdentity(*names, pod_uid=pod.pod_uid) if names else pod

    def _engine_gpus(self, totals: model.Totals, engines: list[str]) -> list[tuple[str, str]]:
        """The (engine, GPU) pairs to serve: every GPU a process of the engine recorded, is loading on or
        loaded it for, at most MAX_GPUS_PER_ENGINE per engine (GPU uuids come from writers: untrusted)."""
        wanted = set(engines)
        by_engine: dict[str, set[str]] = {}
        loading = [(engine, uuid) for engine, uuid, _ in totals.loads]
        loaded = [(engine, item.gpu_uuid) for engine, items in totals.infos.items() for item in items if item.gpu_uuid]
        for engine, uuid in [*totals.per_gpu, *loading, *totals.abandoned, *loaded]:
            if engine in wanted:
                by_engine.setdefault(engine, set()).add(uuid)
        pairs: list[tuple[str, str]] = []
        for engine in engines:
            uuids = sorted(by_engine.get(engine, ()))
            for uuid in uuids[MAX_GPUS_PER_ENGINE:]:
                self.left_out["engine_gpu"].add((engine, uuid))
            pairs.extend((engine, uuid) for uuid in uuids[:MAX_GPUS_PER_ENGINE])
        return pairs

    def _discovery_stuck(self) -> str | None:
        """Why discovery's passes have stopped finishing, or None: a pass has not ended for
        DISCOVERY_STUCK_INTERVALS intervals (DISCOVERY_STUCK_SECONDS at least).  Passes never wait on a file
        system (exporter.engines.descriptors), so this is a bug or a kernel that does not answer /proc: the
        collector is ``stale`` (and GpuioCollectorFailing fires) while the spool's engines are still served."""
        if self.discoveries is None or not self._started:
            return None
        snapshot = self.discoveries.snapshot()
        since = snapshot.taken_at if snapshot.taken_at is not None else self._started_at
        age = time.time() - since
        interval = self.settings["discover-interval"]
        if age <= max(DISCOVERY_STUCK_SECONDS, DISCOVERY_STUCK_INTERVALS * interval):
            return None
        return (f"engine discovery's last pass ended {age:.0f} s ago (one is due every {interval:g} s): "
                "processes loading engines without the library are not followed")

    # --- what renderers ask of the sources --------------------------------------------------------

    def commit_left_out(self) -> None:
        """The end of a rendering: what the caps left out this time is counted (LeftOut.commit)."""
        for left_out in self.left_out.values():
            left_out.commit()

    def left_out_counts(self) -> dict[str, int]:
        """kind -> how many times something shown was left out by a cap, since the start."""
        counts = {kind: left_out.total for kind, left_out in self.left_out.items() if left_out.total}
        if self.files.left_out.total:
            counts["file"] = self.files.left_out.total
        if self.reader.forgotten_engines:  # folded engines of exited processes forgotten past the reader's cap
            counts["folded_engine"] = self.reader.forgotten_engines
        return counts

    def device_of(self, dev: tuple[int, int], look_up: bool = True) -> tuple[str, list[str]]:
        return self.files.device_of(dev, look_up)

    def predicted_cold_start(self, totals: model.Totals, engine: str) -> float | None:
        """Bytes of the engine's file not cached now / cold-read throughput + mean deserialize seconds
        (docs/engines.md, "Predicted cold start"); None where a part is unknown."""
        missing = self.files.bytes_not_cached(totals, engine)
        throughput = cold_throughput(totals, engine)
        values = totals.engines.get(engine)
        if missing is None or throughput is None or values is None:
            return None
        deserialize = mean_observation(values, "load_deserialize_seconds")
        predicted = missing / throughput + (deserialize or 0.0)
        return predicted if math.isfinite(predicted) else None


def _scan_targets(totals: model.Totals, engines: list[str], files: FileDevices) -> dict[tuple[str, str], Target]:
    """The files of the shown engines the background scan measures: the inode each writer reported, and
    which writers may read it (exporter.host.pagecache.open_claimed)."""
    return {(engine, item.path): Target(engine, item.path, item.dev, item.ino,
                                        frozenset(totals.info_uids.get((engine, item.path), ())))
            for engine in engines for item in files.infos.get(engine, [])}


def mean_observation(values: list[float], name: str) -> float | None:
    """The exact mean of an ENGINE vector's histogram ``name`` (its sum over its count); None with no
    observation.  Why not a quantile: the load buckets are coarse (1 s, then 2.5 s), and a median
    interpolated inside them was off by 0.7 s for loads that all deserialized in about 1 s."""
    first, sum_index, _ = spool_format.ENGINE_LAYOUT.histograms[name]
    count = sum(values[first:sum_index])
    return values[sum_index] / count if count > 0 else None


def cold_throughput(totals: model.Totals, engine: str) -> float | None:
    """Bytes per second of the engine's cold loads; else of every engine's cold loads from the same
    st_dev (its file's filesystem)."""
    slot = spool_format.WATERFALL

    def rate(names: list[str]) -> float | None:
        known = [totals.waterfalls[name] for name in names if name in totals.waterfalls]
        moved = sum(values[slot["cold_device_bytes"]] for values in known)
        seconds = sum(values[slot["cold_read_seconds"]] for values in known)
        # Writers' figures: 5e-324 bytes in 1e10 s is legal and rounds to 0 bytes/s, a divisor.
        throughput = moved / seconds if moved > 0 and seconds > 0 else 0.0
        return throughput if 0.0 < throughput < math.inf else None

    own = rate([engine])
    if own is not None:
        return own
    devices = {info.dev for info in totals.infos.get(engine, []) if info.dev != (0, 0)}
    if not devices:
        return None
    return rate([name for name, infos in totals.infos.items() if any(info.dev in devices for info in infos)])
