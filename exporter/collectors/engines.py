"""Engines: what inference processes report through the spool, and what the exporter sees of engine files.

This collector renders the engine service's snapshots (:mod:`exporter.engines.service`, which owns the
sources below and reads them); what follows is what the series mean and how they are bounded.

Two sources (docs/engines.md):

* the spool directory (``--collector.engines.spool-dir``): per-engine load, inference, pool and layer
  series merged over every live process, plus the folded totals of processes that exited
  (:class:`exporter.engines.spool.SpoolReader`); read on the scrape path (file reads only);
* engine files, named by the processes (their load path) and by ``--collector.engines.path`` globs:
  size, mtime, the block device under them (st_dev -> /sys/dev/block, mountinfo for overlayfs and
  btrfs) and their page-cache residency.  Residency scans of big files run in a background
  :class:`PeriodicSampler`, never on the scrape path; the scrape renders the last scan.

``gpuio_engine_info{engine, path, device, cuda_device, gpu_uuid, runtime}`` joins an engine to its
disk and its GPU (as the process recorded it, else as NVML lists the process:
:class:`exporter.engines.spool.WriterGpus`);
``gpuio_engine_physical_device_info`` names the whole disks under the device, the same way
``gpuio_disk_physical_device_info`` does, so rules can go engine -> disk -> diskstats.

Bounded: at most ``max-engines`` engines, 64 layers, 32 error reasons and 16 info series per engine,
``max-files`` files from globs; what does not fit is counted in
``gpuio_engine_dropped_series_total{kind}`` each time something shown is left out.

Which engines are shown when there are more than the cap (:func:`exporter.engines.selection.fair_share`):
the slots are shared among the *tenants* that report engines -- each pod (by the kubelet's pod UID where
its spool is in the pod's own volume), else each live writer process (see
:meth:`exporter.engines.selection.EngineSelection._tenants`) -- in rounds:
every tenant gets its best engine not shown yet, then its next best, and so on.  One process with 3,000
busy engines beside one with a single engine gets 199 of 200 slots, never all.  A tenant's own engines
are ranked so that junk cannot push out real ones: engines whose counters moved recently first, then
those with live writers, then any with observations, then those shown before (no flapping among
equals).  Engines no live process reports (folded totals of exited ones) get the slots left over.

Devices, bounded per scrape whatever the writers name (each names any st_dev it likes): the st_dev ->
block device look-ups (:class:`exporter.host.blockdev.DeviceNumbers`) share one mount table (the host's,
``Context.host_mounts``, which the mount of each engine file and the mountstats collector read too) and
one sysfs index, at most MAX_DEVICE_LOOKUPS a scrape, in the order the engines were chosen (each tenant's first
engines first: a flood waits behind them, its info series show ``device=""`` until their turn), and
only the answers of what is shown are kept: one writer cannot flush another's.

Engine files named by writers are opened only through :func:`exporter.host.pagecache.open_claimed`: inside
``--collector.engines.path-include`` (and the ``--collector.engines.path`` directories), the very
inode the writer reported, a regular file one of the writers could read, no symlink, under
``--path.rootfs``.  A path a writer names in its MOUNT record (an overlay layer directory, a /dev
source) is never followed by name: it is walked under ``--path.rootfs`` by
:func:`exporter.host.mounts.open_without_waiting` (no symlink, no component on a network, FUSE or automount
file system, judged before it is asked anything), in a background sampler of its own (``layers``,
at most MAX_LAYER_WALKS walks and LAYER_PASS_SECONDS a pass); the scrape uses its last answers.
"""

from __future__ import annotations

import os
import time
from typing import Any

from gpuio import spool as spool_format

from ..collect import Absent, Collector, Pending, StaleData, register
from ..context import Context
from ..engines import discovery, model
from ..engines.files import MAX_INFOS, FileDevices, ScanResult, cached_figure
from ..engines.service import MAX_PODS_PER_ENGINE, EngineService, EngineSnapshot, NoSource
from ..exposition import COUNTER, GAUGE, HISTOGRAM, INFO, SUMMARY, Desc, Family, histogram_samples, label_string
from ..options import Option, parse_bool, parse_count, parse_seconds
from ..pods import kubelet
from ..sampler import Snapshot

MAX_LAYERS = 64
MAX_ERRORS = 32
DEFAULT_PATH_INCLUDE = "/models,/mnt,/data,/srv,/opt,/var/lib"
DURATION_ACCEPTED = "a duration above zero such as 500ms, 2s, 5m"


def _parse_globs(value: str) -> tuple[str, ...]:
    patterns = tuple(part.strip() for part in value.split(",") if part.strip())
    for pattern in patterns:
        if not os.path.isabs(pattern):
            raise ValueError(f"{pattern!r} is not an absolute path")
    return patterns


def _parse_directories(value: str) -> tuple[str, ...]:
    directories = tuple(part.strip().rstrip("/") or "/" for part in value.split(",") if part.strip())
    for directory in directories:
        if not os.path.isabs(directory) or any(part in (".", "..") for part in directory.split("/")):
            raise ValueError(f"{directory!r} is not an absolute path without . or ..")
    return directories




def _parse_directory_name(value: str) -> str:
    if not value or not os.path.isabs(value):
        raise ValueError("not an absolute path")
    return value  # may not exist yet: processes and the exporter start in any order


ENGINE = ("engine",)
ENGINE_GPU = ("engine", "gpu_uuid")  # what waits on one GPU is told apart from a spare replica's
ENGINE_FILE = ("engine", "path")


def _declared(slot: str, kind: str = "", doc: str = "") -> Desc:
    """The family of an ENGINE-record series, as the library declares it (gpuio.spool.ENGINE_SERIES)."""
    series = spool_format.SERIES[slot]
    return Desc(series.name, kind or series.type, series.help, labels=series.labels, unit=series.unit, doc=doc)


# The histograms whose buckets some rule, board or `gpuio top` takes a quantile of
# (tests/unit/test_dashboards.py holds the boards and rules to this list).  The others are served by
# default as their _count and _sum only: the boards read their means, and their buckets would be 1,600
# of a node's ~4,000 series with 20 engines (docs/performance.md, "Series per node").
DEFAULT_BUCKETED = tuple(spool_format.SERIES[slot].name for slot in ("inference_seconds", "inference_gpu_seconds",
                                                             "pool_wait_seconds"))
HISTOGRAM_NAMES = tuple(series.name for series in spool_format.ENGINE_SERIES if series.type == HISTOGRAM)
_WITHOUT_BUCKETS = (" Served by default as a summary of _count and _sum (no quantiles); with buckets, as a "
                    "histogram, when named in --collector.engines.histogram-buckets.")


def served_histograms(bucketed: tuple[str, ...]) -> dict[str, Desc]:
    """slot -> the Desc each engine histogram is served with: a histogram where its buckets are wanted,
    else a summary of the same name (its _count and _sum)."""
    return {series.slot: _declared(series.slot) if series.name in bucketed
            else _declared(series.slot, SUMMARY, series.help + _WITHOUT_BUCKETS)
            for series in spool_format.ENGINE_SERIES if series.type == HISTOGRAM}


HISTOGRAM_DESCS = served_histograms(DEFAULT_BUCKETED)  # as served by default: what the reference lists


def _parse_histogram_names(value: str) -> tuple[str, ...]:
    names = tuple(part.strip() for part in value.split(",") if part.strip())
    if names == ("all",):
        return HISTOGRAM_NAMES
    unknown = sorted(set(names) - set(HISTOGRAM_NAMES))
    if unknown:
        raise ValueError(f"not an engine histogram: {', '.join(unknown)} (one of {', '.join(HISTOGRAM_NAMES)})")
    return names
LOAD_BYTES = _declared("load_read_bytes")
ERRORS = Desc("gpuio_engine_errors_total", COUNTER,
              "Failed loads and inferences by reason (enqueue_failed, timeout, pool_timeout, out_of_memory, "
              "load_read_failed, load_deserialize_failed, an exception name, other).", labels=(*ENGINE, "reason"))
LAYER_SECONDS = Desc("gpuio_engine_layer_seconds_total", COUNTER,
                     "Time spent in each layer during profiled inferences (top layers; the rest is '(other)').",
                     labels=(*ENGINE, "layer"), unit="seconds")
PROFILED = _declared("layer_profiled_inferences")
IN_FLIGHT = _declared("in_flight")
POOL_CONTEXTS = _declared("pool_contexts")
POOL_IDLE = _declared("pool_idle")
LOADS = Desc("gpuio_engine_loads_in_progress", GAUGE,
             "Loads (read and deserialize) of the engine started and not finished by live processes, per GPU.",
             labels=ENGINE_GPU)
LOAD_PROGRESS_BYTES = Desc("gpuio_engine_load_in_progress_read_bytes", GAUGE,
                           "Bytes read so far by the engine's loads in progress, per GPU.", labels=ENGINE_GPU,
                           unit="bytes")
LOAD_OLDEST = Desc("gpuio_engine_load_oldest_in_progress_seconds", GAUGE,
                   "Age of the engine's oldest load in progress on the GPU; 0 when none is in progress.",
                   labels=ENGINE_GPU, unit="seconds")
LOADS_ABANDONED = Desc("gpuio_engine_loads_abandoned_total", COUNTER,
                       "Loads of the engine on the GPU that never finished because their process exited while "
                       "loading (killed by a startup or liveness probe, out of memory, a crash): a crash-looping "
                       "cold start counts one per attempt.", labels=ENGINE_GPU)
DISK_LOADS = Desc("gpuio_disk_engine_loads_in_progress", GAUGE,
                  "Engine loads in progress from files on the disk (a whole disk under the files' device stack; 0 "
                  "for every disk holding an engine file).", labels=("device",))
DISK_LOAD_OLDEST = Desc("gpuio_disk_engine_load_oldest_in_progress_seconds", GAUGE,
                        "Age of the oldest engine load in progress from files on the disk; 0 when none is.",
                        labels=("device",), unit="seconds")
MOUNT_LOADS = Desc("gpuio_mount_engine_loads_in_progress", GAUGE,
                   "Engine loads in progress from files under the mount point (local or network; 0 for every mount "
                   "point holding an engine file).", labels=("mountpoint",))
MOUNT_LOAD_OLDEST = Desc("gpuio_mount_engine_load_oldest_in_progress_seconds", GAUGE,
                         "Age of the oldest engine load in progress from files under the mount point; 0 when none is.",
                         labels=("mountpoint",), unit="seconds")
ENGINE_MOUNT = Desc("gpuio_engine_mount_info", INFO,
                    "The mount holding an engine file as the host sees it (filesystem type and source; network and "
                    "FUSE mounts too): joins engines with gpuio_mount_info and gpuio_mountstats_*.",
                    labels=(*ENGINE, "path", "mountpoint", "fstype", "source"))
PROCESSES = Desc("gpuio_engine_processes", GAUGE,
                 "Live processes serving the engine, by source: spool (reporting through the library) or proc "
                 "(found holding its file without the library: engine discovery).", labels=(*ENGINE, "source"),
                 values={"source": ("spool", "proc")})
LAST_LOAD = Desc("gpuio_engine_last_load_timestamp_seconds", GAUGE,
                 "When the engine was last loaded.", labels=ENGINE, unit="seconds")
ENGINE_INFO = Desc("gpuio_engine_info", INFO,
                   "An engine file as loaded, or being loaded, by a live process: its block device and its GPU (for "
                   "joins).", labels=(*ENGINE, "path", "device", "cuda_device", "gpu_uuid", "runtime"))
PROCESS_INFO = Desc("gpuio_engine_process_info", INFO,
                    "A live process reporting the engine, by its pid here (only when this exporter sees that very "
                    "process): joins the engine to gpuio_gpu_process_* on pid.", labels=("engine", "pid"))
PHYSICAL_INFO = Desc("gpuio_engine_physical_device_info", INFO,
                     "The whole disks at the bottom of an engine file's device stack.",
                     labels=(*ENGINE, "path", "physical_device"))
FILE_SIZE = Desc("gpuio_engine_file_size_bytes", GAUGE, "Size of an engine file.", labels=ENGINE_FILE, unit="bytes")
FILE_MTIME = Desc("gpuio_engine_file_modified_timestamp_seconds", GAUGE,
                  "Last modification time of an engine file.", labels=ENGINE_FILE, unit="seconds")
FILE_CACHED = Desc("gpuio_engine_file_cached_bytes", GAUGE,
                   "Bytes of an engine file in the page cache at the last residency scan (or, where the exporter "
                   "may not measure it, at the end of the loading process's latest load: see "
                   "gpuio_engine_file_cached_measured_timestamp_seconds).", labels=ENGINE_FILE, unit="bytes")
FILE_RATIO = Desc("gpuio_engine_file_cached_ratio", GAUGE,
                  "Fraction (0-1) of an engine file in the page cache at the last residency scan (or as the loading "
                  "process measured it: see gpuio_engine_file_cached_measured_timestamp_seconds).", labels=ENGINE_FILE,
                  unit="ratio")
RESIDENCY_UNAVAILABLE = Desc("gpuio_engine_file_residency_unavailable", GAUGE,
                             "Engine files whose residency could not be measured truthfully at the last scan, by "
                             "reason (permission: the kernel refuses or fakes it without write access).",
                             labels=("reason",),
                             values={"reason": ("permission", "not_visible", "io", "not_regular", "unsupported",
                                                "outside_paths", "unverified", "symlink", "writer_permission",
                                                "unresponsive_mount")})
SCAN_DURATION = Desc("gpuio_engine_residency_scan_duration_seconds", GAUGE,
                     "How long the last background scan of engine files took.", unit="seconds")
SCAN_TIME = Desc("gpuio_engine_residency_scan_timestamp_seconds", GAUGE,
                 "When the last background scan of engine files finished.", unit="seconds")
SPOOL_PROCESSES = Desc("gpuio_engine_spool_processes", GAUGE, "Live processes with a spool file.")
SPOOL_FOLDED = Desc("gpuio_engine_spool_folded_processes_total", COUNTER,
                    "Spool files of exited processes whose totals were folded in.")
SPOOL_ERRORS = Desc("gpuio_engine_spool_errors_total", COUNTER,
                    "Spool files skipped or damaged, by reason (empty, truncated, version, garbage, record, io, "
                    "vanished, oversized, not_deleted, over_budget: records past one file's limits, counted once "
                    "per file), and reset: a live file's record whose counters fell or that went (its values "
                    "folded once, counted at each fall).", labels=("reason",),
                    values={"reason": ("empty", "truncated", "version", "garbage", "record", "io", "vanished",
                                       "oversized", "not_deleted", "over_budget", "reset")})
SPOOL_DEFERRED = Desc("gpuio_engine_spool_deferred_files", GAUGE,
                      "Spool files not read at this scrape because its read budget was spent (read at a later "
                      "scrape; live files keep their last values).")
SPOOL_UNFINISHED = Desc("gpuio_engine_spool_unfinished_listings", GAUGE,
                        "Spool directories (the node's, pods' volumes) holding more entries than one scrape looks "
                        "at: their listing goes on at the next scrapes, in turn, so a new file there may wait a "
                        "few scrapes to be read.")
WRITER_DROPS = Desc("gpuio_engine_spool_writer_dropped_series_total", COUNTER,
                    "Series processes could not record because their spool file was full.")
# The waterfall of loads (gpuio.waterfall in the library; WATERFALL records of the spool).
LOADS_BY_CLASS = Desc("gpuio_engine_loads_total", COUNTER,
                      "Finished loads by class: cold (at least 80 % of the file fetched from the device, or not "
                      "cached when the load started), warm (at most 10 %), partial (between).",
                      labels=("engine", "class"))
PHASE_SECONDS = Desc("gpuio_engine_load_phase_seconds_total", COUNTER,
                     "Seconds spent in each phase of loads: open, read, deserialize, context (execution-context "
                     "creation), warmup, first_inference.", labels=("engine", "phase"), unit="seconds")
SOURCE_BYTES = Desc("gpuio_engine_load_source_read_bytes_total", COUNTER,
                    "Bytes loads read, by where they came from: device (the loading thread's read_bytes) or "
                    "page_cache (the rest of what its reads returned).", labels=("engine", "source"), unit="bytes")
MAJOR_FAULTS = Desc("gpuio_engine_load_major_faults_total", COUNTER,
                    "Major page faults taken by the loading thread during loads (loaders that mmap the file).",
                    labels=("engine",))
LAST_PHASE = Desc("gpuio_engine_last_load_phase_seconds", GAUGE,
                  "The engine's latest load, phase by phase (its waterfall).", labels=("engine", "phase"),
                  unit="seconds")
LAST_DURATION = Desc("gpuio_engine_last_load_duration_seconds", GAUGE,
                     "Wall time of the engine's latest load, from opening the file to the model deserialized.",
                     labels=("engine",), unit="seconds")
LAST_BYTES = Desc("gpuio_engine_last_load_read_bytes", GAUGE,
                  "Bytes the engine's latest load read, by source (device, page_cache).", labels=("engine", "source"),
                  unit="bytes")
LAST_CLASS = Desc("gpuio_engine_last_load_class_info", INFO,
                  "The class (cold, warm, partial) of the engine's latest load.", labels=("engine", "class"))
LAST_START_CACHED = Desc("gpuio_engine_last_load_start_cached_ratio", GAUGE,
                         "Fraction (0-1) of the engine file in the page cache when its latest load started, as the "
                         "loading process measured it (cachestat on its own descriptor, else sampled).",
                         labels=("engine",), unit="ratio")
PREDICTED = Desc("gpuio_engine_predicted_cold_start_seconds", GAUGE,
                 "Predicted load time of the engine now: its file's bytes not in the page cache over the read "
                 "throughput of its past cold loads (else of cold loads from the same device), plus its mean "
                 "deserialize time (exact: the deserialize seconds of its loads over their count).  Absent until "
                 "a cold load from that device was seen.",
                 labels=("engine",), unit="seconds")
CACHED_SOURCE = Desc("gpuio_engine_file_cached_measured_timestamp_seconds", GAUGE,
                     "When gpuio_engine_file_cached_bytes of the file was measured, and by whom (source: scan, the "
                     "exporter's background scan; loader, the loading process at the end of its latest load).",
                     labels=("engine", "path", "source"), unit="seconds")
ENGINE_POD = Desc("gpuio_engine_pod_info", INFO,
                  "The pods whose live processes report the engine on the GPU: namespace, pod and container as "
                  "the process recorded them (Downward API), pod_uid the kubelet's where its spool is in the "
                  "pod's volume (join on engine and gpu_uuid).",
                  labels=("engine", "gpu_uuid", "namespace", "pod", "container", "pod_uid"))
POD_SPOOLS = Desc("gpuio_engine_pod_spool_directories", GAUGE,
                  "Spool directories found in pods' emptyDir volumes through the kubelet's pods directory at "
                  "the last scan.")
POD_SPOOLS_SKIPPED = Desc("gpuio_engine_pod_spool_pods_skipped", GAUGE,
                          "Pods not looked at by the last scan of the kubelet's pods directory (past "
                          "--collector.engines.max-pod-spools).")
POD_SPOOLS_FAILED = Desc("gpuio_engine_pod_spool_scan_failed", GAUGE,
                         "1 when the last scan could not read the kubelet's pods directory (the exporter needs "
                         "to traverse its root:root 0750 directories: group root), 0 when it could.")
DISCOVERY_PROCESSES = Desc("gpuio_engine_discovery_processes", GAUGE,
                           "Processes engine discovery follows: holding model files open without the library, "
                           "or having loaded one while it watched.")
DISCOVERY_REFUSED = Desc("gpuio_engine_discovery_refused_processes_total", COUNTER,
                         "Processes whose descriptors discovery was not allowed to read (another user's, without "
                         "root or CAP_SYS_PTRACE): engines they load are not seen.")
DISCOVERY_DURATION = Desc("gpuio_engine_discovery_pass_duration_seconds", GAUGE,
                          "How long discovery's last pass over the processes took.", unit="seconds")
DISCOVERY_TIME = Desc("gpuio_engine_discovery_timestamp_seconds", GAUGE,
                      "When discovery's last pass finished (what the scrape serves is that old).", unit="seconds")
DISCOVERY_BEHIND = Desc("gpuio_engine_discovery_unfinished_rotation", GAUGE,
                        "1 while discovery's passes have not yet looked at every process once this round (its "
                        "per-pass budget is spent): a new loader is seen first, an old one in turn.")
DISCOVERY_DROPPED = Desc("gpuio_engine_discovery_dropped_total", COUNTER,
                         "What engine discovery's bounds left out, by kind: process (not followed: the table full, "
                         "or its owner's share of it), file (past a process's files followed at once), engine and "
                         "load (loads of engines past the history's bounds), unresponsive_mount (a file whose "
                         "network or FUSE mount did not answer a stat in time), unresponsive_process (a process "
                         "whose /proc/<pid>/stat did not answer: stuck in execve on such a mount), descriptors "
                         "(a process with more than 4,096 descriptors: those past the 4,096th are not looked "
                         "at), mappings (a GPU process whose maps are longer than 2 MiB: the files mapped past "
                         "that are not seen), pass_deadline (a pass that ran out of time before every process of "
                         "its priority list).", labels=("kind",),
                         values={"kind": ("process", "file", "engine", "load", "unresponsive_mount",
                                          "unresponsive_process", "descriptors", "mappings", "pass_deadline")})
DISCOVERY_UNRESPONSIVE = Desc("gpuio_engine_discovery_unresponsive_mounts", GAUGE,
                              "Network or FUSE mounts whose stat did not answer discovery in time: their files are "
                              "not looked at for a minute (a dead NFS server or FUSE daemon).")
DROPPED = Desc("gpuio_engine_dropped_series_total", COUNTER,
               "Engines, layers, error reasons, info series and files left out by the exporter's caps, by kind "
               "(counted each time one is left out that was not left out at the scrape before).", labels=("kind",),
               values={"kind": ("engine", "layer", "error", "info", "file", "folded_engine", "engine_gpu")},
               doc="Engines, engine x GPU pairs, layers, error reasons, info series and files left out by the "
                   "exporter's caps, by kind (counted each time one is left out that was not left out at the scrape "
                   "before).")


# The collector's flags (--collector.engines.*), declared beside its families.
OPTIONS = (
    Option("spool-dir", spool_format.DEFAULT_DIR, _parse_directory_name, "an absolute directory path",
           "Directory where inference processes write their spool files (GPUIO_SPOOL_DIR in them)."),
    Option("path", "", _parse_globs, "comma-separated absolute glob patterns, e.g. /models/*.engine",
           "Engine files to watch (size, residency, device) even when no process reports them."),
    Option("max-engines", "200", parse_count(1), "a whole number above zero", "At most this many engines."),
    Option("max-files", "1000", parse_count(1), "a whole number above zero",
           "At most this many files from --collector.engines.path."),
    Option("residency-interval", "30s", parse_seconds, DURATION_ACCEPTED,
           "How often the background scan measures engine files' page-cache residency and devices."),
    Option("path-include", DEFAULT_PATH_INCLUDE, _parse_directories,
           "comma-separated absolute directories, e.g. /models,/mnt/cache",
           "Directories where engine files named by spool writers may be opened (size, residency); "
           "the --collector.engines.path directories are added."),
    Option("max-file-bytes", str(spool_format.DEFAULT_FILE_BYTES), parse_count(spool_format.HEADER_SIZE + 4096),
           "a whole number of bytes, at least 4352",
           "Spool files bigger than this are refused unread (the library makes 1 MiB files)."),
    Option("kubelet-pods-dir", kubelet.DEFAULT_PODS_DIR, _parse_directory_name, "an absolute directory path",
           "The kubelet's pods directory, where spool directories in pods' emptyDir volumes are found "
           "(absent off Kubernetes: nothing is looked for)."),
    Option("pod-spool-volume", kubelet.DEFAULT_VOLUME, kubelet.parse_volume_name,
           "a volume name (lower-case letters, digits and '-')",
           "Name of the emptyDir volume in which inference pods keep their spool (docs/engines.md)."),
    Option("max-pod-spools", str(kubelet.DEFAULT_MAX_PODS), parse_count(1), "a whole number above zero",
           "At most this many pods are looked at for a spool volume."),
    Option("pod-spool-interval", "15s", parse_seconds, DURATION_ACCEPTED,
           "How often the kubelet's pods directory is scanned for spool volumes (in the background)."),
    Option("histogram-buckets", ",".join(DEFAULT_BUCKETED), _parse_histogram_names,
           "comma-separated engine histogram names, or all",
           "Engine histograms served with their buckets; the others are served as their _count and _sum "
           "only (a summary without quantiles), which is what the boards read of them."),
    Option("discover", "true", parse_bool, "true or false",
           "Find engines served without the library: processes holding model files open for reading "
           "under the path-include directories, from /proc (needs root, or CAP_SYS_PTRACE and "
           "CAP_DAC_READ_SEARCH, to see other users' processes)."),
    Option("discover-patterns", ",".join(discovery.MODEL_PATTERNS), discovery.parse_patterns,
           "comma-separated file-name patterns, e.g. *.plan,*.onnx",
           "Names of the model files discovery looks for."),
    Option("discover-interval", "1s", parse_seconds, DURATION_ACCEPTED,
           "How often discovery looks at the processes (in the background)."),
    Option("work-interval", "1s", parse_seconds, DURATION_ACCEPTED,
           "How often what engines do on each GPU (in flight, loading, waiting, a saturated disk under their "
           "files) is measured for the nvml collector's GPU-time ledger (in the background: one read of the "
           "spool, /proc/diskstats and /proc/pressure/io)."),
)


@register
class EnginesCollector(Collector):
    name = "engines"
    options = OPTIONS

    def __init__(self, context: Context, options: dict[str, Any], read_only: bool = False) -> None:
        super().__init__(context, options)
        self.histogram_descs = served_histograms(self.settings["histogram-buckets"])
        self.service = EngineService(context, self.settings, read_only)
        self._labels: dict[str, str] = {}  # of the engines shown now
        self._rendered: dict[str, tuple[list[float], list[list[str]]]] = {}

    def start(self) -> None:
        self.service.start()

    def stop(self) -> None:
        self.service.stop()

    # --- the scrape: the service's snapshot, rendered ------------------------------------------

    def collect(self) -> list[Family]:
        try:
            snapshot = self.service.snapshot()
        except NoSource as absent:
            raise Absent(str(absent)) from None
        totals, engines = snapshot.totals, snapshot.engines
        self._labels = {name: self._labels.get(name) or label_string({"engine": name}) for name in snapshot.chosen}
        families = self._engine_families(totals, engines)
        families += _per_gpu_families(totals, snapshot.pairs, self.histogram_descs)
        families += self._info_families(totals, engines, snapshot.files)
        families += self._load_families(totals, snapshot.files, snapshot.pairs)
        families += _file_families(totals, snapshot.scan)
        families += self._waterfall_families(totals, engines)
        families += self._pod_families(totals, snapshot)
        self.service.commit_left_out()
        families += self._spool_families(totals)
        families += _discovery_families(snapshot.discovered)
        if snapshot.stuck:
            raise StaleData(snapshot.stuck, families)
        if snapshot.pending:
            raise Pending("the first scan of engine files (size, residency, device) is still running", families)
        return families

    def _drop(self, kind: str, key: Any) -> None:
        self.service.left_out[kind].add(key)

    @staticmethod
    def _sourced(engine: str, source: str) -> str:
        return label_string({"engine": engine, "source": source})

    def _label(self, engine: str) -> str:
        """``engine="..."``, kept for the engines shown (see collect), made afresh for any other."""
        return self._labels.get(engine) or label_string({"engine": engine})

    def _engine_families(self, totals: model.Totals, engines: list[str]) -> list[Family]:
        layout = spool_format.ENGINE_LAYOUT
        histogram_names = [name for name in self.histogram_descs if name not in model.PER_GPU_HISTOGRAMS]
        columns: list[list[str]] = [[] for _ in histogram_names]
        load_bytes, profiled, processes, last_load = [], [], [], []
        rendered: dict[str, tuple[list[float], list[list[str]]]] = {}
        for engine in engines:
            values = totals.engines[engine]
            labels = self._label(engine)
            cached = self._rendered.get(engine)
            if cached is not None and cached[0] == values:
                lines = cached[1]
            else:
                lines = []
                for name in histogram_names:
                    first, total, bounds = layout.histograms[name]
                    lines.append(histogram_samples(self.histogram_descs[name], labels, bounds, values[first:total],
                                                   values[total]))
            rendered[engine] = (values, lines)
            for column, block in zip(columns, lines, strict=True):
                column.extend(block)
            load_bytes.append(LOAD_BYTES.sample(labels, values[layout.counters["load_read_bytes"]]))
            profiled.append(PROFILED.sample(labels, values[layout.counters["layer_profiled_inferences"]]))
            processes.append(PROCESSES.sample(self._sourced(engine, "spool"), totals.processes.get(engine, 0)))
            if engine in totals.discovered_processes:
                processes.append(PROCESSES.sample(self._sourced(engine, "proc"), totals.discovered_processes[engine]))
            if engine in totals.last_load:
                last_load.append(LAST_LOAD.sample(labels, totals.last_load[engine]))
        self._rendered = rendered
        families = [Family(self.histogram_descs[name], column) for name, column in zip(histogram_names, columns,
                                                                                   strict=True)]
        families += [Family(LOAD_BYTES, load_bytes), Family(PROCESSES, processes), Family(LAST_LOAD, last_load),
                     Family(PROFILED, profiled)]
        families.append(self._labelled(ERRORS, totals.errors, engines, "reason", MAX_ERRORS, "error"))
        families.append(self._labelled(LAYER_SECONDS, {k: v[0] for k, v in totals.layers.items()}, engines,
                                       "layer", MAX_LAYERS, "layer"))
        return families

    def _labelled(self, desc: Desc, table: dict[tuple[str, str], float], engines: list[str], label: str,
                  cap: int, kind: str) -> Family:
        wanted = set(engines)
        per_engine: dict[str, int] = {}
        samples = []
        for (engine, value_label), value in sorted(table.items()):
            if engine not in wanted:
                continue
            if per_engine.get(engine, 0) >= cap:
                self._drop(kind, (engine, value_label))
                continue
            per_engine[engine] = per_engine.get(engine, 0) + 1
            samples.append(desc.sample(label_string({"engine": engine, label: value_label}), value))
        return Family(desc, samples)

    # --- per engine and GPU; loads in progress -------------------------------------------------------

    def _load_families(self, totals: model.Totals, files: FileDevices, pairs: list[tuple[str, str]]) -> list[Family]:
        """Loads in progress per engine and GPU, per physical disk and per mount point; and each engine
        file's mount.  Every engine GPU, disk and mount point of an engine file is served, at 0 when
        nothing loads there, so that ``max by`` and joins find it."""
        per_pair: dict[tuple[str, str], list[float]] = {pair: [0.0, 0.0, 0.0] for pair in pairs}  # count, age, bytes
        per_disk: dict[str, list[float]] = {}  # count, age
        per_mount: dict[str, list[float]] = {}
        mount_info: dict[str, None] = {}
        mount_table = self.context.host_mounts.table()  # one table for every file of this scrape
        for engine, path, dev in self.service.files.shown_files(files):
            for disk in files.disks(dev):
                per_disk.setdefault(disk, [0.0, 0.0])
            mount = mount_table.of_file(dev, path)
            if mount is not None:
                per_mount.setdefault(mount.mountpoint, [0.0, 0.0])
                mount_info[ENGINE_MOUNT.sample(label_string({"engine": engine, "path": path, "mountpoint":
                                                             mount.mountpoint, "fstype": mount.fstype,
                                                             "source": mount.source}), 1)] = None
        now = time.time()
        for (engine, uuid, dev), (count, read_bytes, oldest) in totals.loads.items():
            if (engine, uuid) not in per_pair or count <= 0:
                continue
            age = max(0.0, now - oldest) if oldest > 0 else 0.0
            _add_load(per_pair[(engine, uuid)], count, age, read_bytes)
            # Only a file the engine's info names (written when the load started): a writer cannot make
            # the exporter resolve devices it invents, and the mount look-up gets the file's path.
            load_path = next((item.path for item in totals.infos.get(engine, []) if item.dev == dev), None)
            if load_path is None or dev == (0, 0):
                continue
            for disk in files.disks(dev):
                _add_load(per_disk.setdefault(disk, [0.0, 0.0]), count, age)
            mount = mount_table.of_file(dev, load_path)
            if mount is not None:
                _add_load(per_mount.setdefault(mount.mountpoint, [0.0, 0.0]), count, age)
        families = [Family(desc, [desc.sample(label_string({"engine": engine, "gpu_uuid": uuid}), values[index])
                                  for (engine, uuid), values in per_pair.items()])
                    for desc, index in ((LOADS, 0), (LOAD_PROGRESS_BYTES, 2), (LOAD_OLDEST, 1))]
        # Every pair at 0 until a load of it is abandoned: rate() and increase() see the first one.
        families.append(Family(LOADS_ABANDONED, [
            LOADS_ABANDONED.sample(label_string({"engine": engine, "gpu_uuid": uuid}),
                                   totals.abandoned.get((engine, uuid), 0.0)) for engine, uuid in per_pair]))
        for desc, index, table, label in ((DISK_LOADS, 0, per_disk, "device"),
                                          (DISK_LOAD_OLDEST, 1, per_disk, "device"),
                                          (MOUNT_LOADS, 0, per_mount, "mountpoint"),
                                          (MOUNT_LOAD_OLDEST, 1, per_mount, "mountpoint")):
            families.append(Family(desc, [desc.sample(label_string({label: key}), values[index])
                                          for key, values in sorted(table.items())]))
        families.append(Family(ENGINE_MOUNT, list(mount_info)))
        return families

    def _pod_families(self, totals: model.Totals, snapshot: EngineSnapshot) -> list[Family]:
        """Which pods report each served (engine, GPU), at most MAX_PODS_PER_ENGINE per engine; and what
        the last scan of the kubelet's pods directory found."""
        lines: list[str] = []
        per_engine: dict[str, int] = {}
        for engine, uuid in snapshot.pairs:
            for pod in sorted(totals.pods.get((engine, uuid), ()), key=lambda p: (p.namespace, p.pod, p.container,
                                                                                   p.pod_uid)):
                if per_engine.get(engine, 0) >= MAX_PODS_PER_ENGINE:
                    self._drop("pod", (engine, uuid, pod))
                    continue
                per_engine[engine] = per_engine.get(engine, 0) + 1
                lines.append(ENGINE_POD.sample(label_string({
                    "engine": engine, "gpu_uuid": uuid, "namespace": pod.namespace, "pod": pod.pod,
                    "container": pod.container, "pod_uid": pod.pod_uid}), 1))
        families = [Family(ENGINE_POD, lines)]
        scan = snapshot.pod_spools
        if scan is not None and scan.exists:  # off Kubernetes: not a word
            families += [Family(POD_SPOOLS, [POD_SPOOLS.sample("", len(scan.directories))]),
                         Family(POD_SPOOLS_SKIPPED, [POD_SPOOLS_SKIPPED.sample("", scan.left_out)]),
                         Family(POD_SPOOLS_FAILED, [POD_SPOOLS_FAILED.sample("", 1 if scan.error else 0)])]
        return families

    # --- engine -> file -> disk, GPU -------------------------------------------------------------

    def _info_families(self, totals: model.Totals, engines: list[str], files: FileDevices) -> list[Family]:
        info, physical = [], []
        seen: set[str] = set()
        for engine in engines:
            for item in files.infos.get(engine, []):
                device, disks = files.of(engine, item.dev)
                labels = {"engine": engine, "path": item.path, "device": device,
                          "cuda_device": "" if item.cuda_device < 0 else str(item.cuda_device),
                          "gpu_uuid": item.gpu_uuid, "runtime": item.runtime}
                text = label_string(labels)
                if text in seen:
                    continue
                seen.add(text)
                info.append(ENGINE_INFO.sample(text, 1))
                for disk in disks:
                    line = PHYSICAL_INFO.sample(label_string({"engine": engine, "path": item.path,
                                                              "physical_device": disk}), 1)
                    if line not in physical:
                        physical.append(line)
        # Files only the globs name: the same join, with no GPU (no process has them loaded).
        for view in self.service.files.from_globs():
            if view.dev is None:
                continue
            answer = files.numbers.get(view.dev)
            device, disks = (answer.device, answer.disks) if answer is not None else ("", ())
            info.append(ENGINE_INFO.sample(label_string({"engine": view.engine, "path": view.path, "device": device,
                                                         "cuda_device": "", "gpu_uuid": "", "runtime": ""}), 1))
            physical.extend(PHYSICAL_INFO.sample(label_string({"engine": view.engine, "path": view.path,
                                                               "physical_device": disk}), 1) for disk in disks)
        return [Family(ENGINE_INFO, info), Family(PHYSICAL_INFO, physical),
                Family(PROCESS_INFO, self._process_info(totals, engines))]

    def _process_info(self, totals: model.Totals, engines: list[str]) -> list[str]:
        """Each engine's live writers by pid, at most MAX_INFOS per engine; a pid this exporter's procfs
        shows as another process (a writer in another pid namespace) is left out, never mislabelled."""
        lines = []
        for engine in engines:
            pids = sorted({pid for pid, start in totals.writers.get(engine, ())
                           if self.service.writer_gpus.same_process(pid, start)})
            lines += [PROCESS_INFO.sample(label_string({"engine": engine, "pid": str(pid)}), 1)
                      for pid in pids[:MAX_INFOS]]
        return lines

    # --- the waterfall of loads -----------------------------------------------------------------

    def _waterfall_families(self, totals: model.Totals, engines: list[str]) -> list[Family]:
        slot = spool_format.WATERFALL
        lines: dict[Desc, list[str]] = {desc: [] for desc in (LOADS_BY_CLASS, PHASE_SECONDS, SOURCE_BYTES, MAJOR_FAULTS,
                                                              LAST_PHASE, LAST_DURATION, LAST_BYTES, LAST_CLASS,
                                                              LAST_START_CACHED, PREDICTED)}
        for engine in engines:
            values = totals.waterfalls.get(engine)
            if values is None:
                continue
            labels = self._label(engine)
            for name in spool_format.LOAD_CLASSES:
                lines[LOADS_BY_CLASS].append(LOADS_BY_CLASS.sample(
                    label_string({"engine": engine, "class": name}), values[slot[f"loads_{name}"]]))
            for name in spool_format.PHASES:
                phase = label_string({"engine": engine, "phase": name})
                lines[PHASE_SECONDS].append(PHASE_SECONDS.sample(phase, values[slot[f"phase_{name}"]]))
                if values[slot["last_start"]] > 0:
                    lines[LAST_PHASE].append(LAST_PHASE.sample(phase, values[slot[f"last_{name}"]]))
            for source, total, last in (("device", "device_bytes", "last_device_bytes"),
                                        ("page_cache", "cache_bytes", "last_cache_bytes")):
                source_labels = label_string({"engine": engine, "source": source})
                lines[SOURCE_BYTES].append(SOURCE_BYTES.sample(source_labels, values[slot[total]]))
                if values[slot["last_start"]] > 0:
                    lines[LAST_BYTES].append(LAST_BYTES.sample(source_labels, values[slot[last]]))
            lines[MAJOR_FAULTS].append(MAJOR_FAULTS.sample(labels, values[slot["major_faults"]]))
            if values[slot["last_start"]] > 0:
                lines[LAST_DURATION].append(LAST_DURATION.sample(labels, values[slot["last_wall"]]))
                klass = int(values[slot["last_class"]])
                if 1 <= klass <= len(spool_format.LOAD_CLASSES):
                    lines[LAST_CLASS].append(LAST_CLASS.sample(
                        label_string({"engine": engine, "class": spool_format.LOAD_CLASSES[klass - 1]}), 1))
                if values[slot["residency_method"]] > 0 and values[slot["file_bytes"]] > 0:
                    lines[LAST_START_CACHED].append(LAST_START_CACHED.sample(
                        labels, min(1.0, values[slot["cached_start_bytes"]] / values[slot["file_bytes"]])))
            predicted = self.service.predicted_cold_start(totals, engine)
            if predicted is not None:
                lines[PREDICTED].append(PREDICTED.sample(labels, predicted))
        return [Family(desc, samples) for desc, samples in lines.items()]

    def _spool_families(self, totals: model.Totals) -> list[Family]:
        reader = self.service.reader
        errors = [SPOOL_ERRORS.sample(label_string({"reason": reason}), count)
                  for reason, count in sorted(reader.errors.items())]
        counts = self.service.left_out_counts()
        dropped = [DROPPED.sample(label_string({"kind": kind}), count) for kind, count in sorted(counts.items())]
        return [
            Family(SPOOL_PROCESSES, [SPOOL_PROCESSES.sample("", totals.live_files)]),
            Family(SPOOL_FOLDED, [SPOOL_FOLDED.sample("", reader.folded_processes)]),
            Family(SPOOL_ERRORS, errors),
            Family(SPOOL_DEFERRED, [SPOOL_DEFERRED.sample("", totals.deferred_files)]),
            Family(SPOOL_UNFINISHED, [SPOOL_UNFINISHED.sample("", totals.unfinished_listings)]),
            Family(WRITER_DROPS, [WRITER_DROPS.sample("", totals.dropped_by_writers)]),
            Family(DROPPED, dropped),
        ]


def _per_gpu_families(totals: model.Totals, pairs: list[tuple[str, str]],
                      histogram_descs: dict[str, Desc]) -> list[Family]:
    """Work waiting, judged per engine *and* GPU: a spare replica on another GPU has its own series."""
    layout = model.PER_GPU_LAYOUT
    histograms: dict[str, list[str]] = {name: [] for name in model.PER_GPU_HISTOGRAMS}
    gauges: dict[Desc, list[str]] = {IN_FLIGHT: [], POOL_CONTEXTS: [], POOL_IDLE: []}
    slots = {IN_FLIGHT: layout.gauges["in_flight"], POOL_CONTEXTS: layout.gauges["pool_contexts"],
             POOL_IDLE: layout.gauges["pool_idle"]}
    for engine, uuid in pairs:
        values = totals.per_gpu.get((engine, uuid))
        if values is None:  # only a load in progress so far
            continue
        labels = label_string({"engine": engine, "gpu_uuid": uuid})
        for name, lines in histograms.items():
            first, total, bounds = layout.histograms[name]
            lines.extend(histogram_samples(histogram_descs[name], labels, bounds, values[first:total],
                                           values[total]))
        for desc, lines in gauges.items():
            lines.append(desc.sample(labels, max(0.0, values[slots[desc]])))
    return ([Family(histogram_descs[name], lines) for name, lines in histograms.items()]
            + [Family(desc, lines) for desc, lines in gauges.items()])


def _file_families(totals: model.Totals, result: ScanResult | None) -> list[Family]:
    """Each engine file's size, mtime and residency as the last background scan found them."""
    if result is None:
        return []
    size, mtime, cached, ratio, measured = [], [], [], [], []
    unavailable: dict[str, int] = {}
    for view in result.files.values():
        labels = label_string({"engine": view.engine, "path": view.path})
        if view.size is not None:
            size.append(FILE_SIZE.sample(labels, view.size))
        if view.mtime is not None:
            mtime.append(FILE_MTIME.sample(labels, view.mtime))
        figure = cached_figure(totals, view, result.finished)
        if figure is not None:
            file_bytes, cached_bytes, source, when = figure
            cached.append(FILE_CACHED.sample(labels, cached_bytes))
            ratio.append(FILE_RATIO.sample(labels, 1.0 if file_bytes == 0 else cached_bytes / file_bytes))
            measured.append(CACHED_SOURCE.sample(label_string({"engine": view.engine, "path": view.path,
                                                               "source": source}), when))
        if view.unavailable is not None:
            unavailable[view.unavailable] = unavailable.get(view.unavailable, 0) + 1
    return [
        Family(FILE_SIZE, size), Family(FILE_MTIME, mtime), Family(FILE_CACHED, cached), Family(FILE_RATIO, ratio),
        Family(CACHED_SOURCE, measured),
        Family(RESIDENCY_UNAVAILABLE, [RESIDENCY_UNAVAILABLE.sample(label_string({"reason": reason}), count)
                                       for reason, count in sorted(unavailable.items())]),
        Family(SCAN_DURATION, [SCAN_DURATION.sample("", result.duration)]),
        Family(SCAN_TIME, [SCAN_TIME.sample("", result.finished)]),
    ]


def _discovery_families(snapshot: Snapshot[discovery.Discovered] | None) -> list[Family]:
    """What discovery's last pass found and left out (nothing before its first)."""
    if snapshot is None or snapshot.value is None or snapshot.taken_at is None:
        return []
    figures = snapshot.value.figures
    return [Family(DISCOVERY_PROCESSES, [DISCOVERY_PROCESSES.sample("", figures.processes)]),
            Family(DISCOVERY_REFUSED, [DISCOVERY_REFUSED.sample("", figures.not_permitted)]),
            Family(DISCOVERY_DURATION, [DISCOVERY_DURATION.sample("", figures.duration)]),
            Family(DISCOVERY_TIME, [DISCOVERY_TIME.sample("", snapshot.taken_at)]),
            Family(DISCOVERY_BEHIND, [DISCOVERY_BEHIND.sample("", 1 if figures.unfinished else 0)]),
            Family(DISCOVERY_DROPPED, [DISCOVERY_DROPPED.sample(label_string({"kind": kind}), count)
                                       for kind, count in figures.dropped]),
            Family(DISCOVERY_UNRESPONSIVE, [DISCOVERY_UNRESPONSIVE.sample("", figures.unresponsive_mounts)])]


def _add_load(totals: list[float], count: float, age: float, read_bytes: float | None = None) -> None:
    """Add loads to ``[count, oldest age(, bytes)]``."""
    totals[0] += count
    totals[1] = max(totals[1], age)
    if read_bytes is not None:
        totals[2] += read_bytes
