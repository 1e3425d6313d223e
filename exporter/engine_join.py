"""The engine join: each engine's spool figures with its files (size, residency, device), the disks and
mount under them, its GPUs and pods -- the rows ``gpuio engines`` prints and ``GET /api/v1/engines`` serves.

One home for both, below them: the CLI (exporter/tools/engines_cli.py) and the API (exporter/web/api.py) render
these rows, and neither imports the other.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from .host.hosttext import visible

if TYPE_CHECKING:
    from .engines.files import FileView
    from .engines.model import Totals
    from .engines.service import EngineService

# The exporter's JSON API of these rows (remote.ENGINES_API_PATH, which the client joins to a node's URL).
ENGINES_API = "/api/v1/engines"
# Reads of the spool one ``gpuio engines`` may take to walk directories that one read does not list in
# full (65,536 entries a read: 1,000 reads are 65 million names).
MAX_LISTING_READS = 1000


def json_text(value: Any) -> str:
    """``value`` as JSON that every parser reads: a number that is not finite (a writer's absurd figures,
    say 2**53 bytes read in 5e-324 s) becomes null, "no figure", where Python's json would print
    ``Infinity`` or ``NaN``, which are not JSON."""
    return json.dumps(finite(value), indent=2, allow_nan=False)


def finite(value: Any) -> Any:
    """``value`` fit for JSON: a figure that is no finite number becomes null (JSON has no Infinity), and a
    host string valid UTF-8 (hosttext.visible)."""
    if isinstance(value, str):
        return visible(value)
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {finite(key): finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(item) for item in value]
    return value


def engine_rows(spool_dir: str, globs: Sequence[str], procfs: str = "/proc", sysfs: str = "/sys",
                rootfs: str = "/", path_include: Sequence[str] | None = None,
                pods_dir: str | None = None) -> list[dict[str, Any]]:
    """One row per engine file (or per engine with no file known): what ``gpuio engines`` prints.

    The spools in pods' emptyDir volumes under ``pods_dir`` (the kubelet's pods directory) are read
    too, as the exporter reads them: found by one scan, now."""
    from .collectors.engines import OPTIONS
    from .context import Context
    from .engines.service import EngineService
    from .options import with_defaults

    settings = with_defaults(OPTIONS, {
        "spool-dir": spool_dir, "path": tuple(globs), "max-engines": 10_000, "max-files": 10_000,
        "residency-interval": 3600.0, "path-include": tuple(path_include) if path_include else None,
        "kubelet-pods-dir": pods_dir})
    service = EngineService(Context(procfs, sysfs, rootfs), settings, read_only=True)
    service.find_pod_spools_now()  # the pods' spools (none off a Kubernetes node)
    service.snapshot()  # learns the files processes report
    files = service.files_now()
    totals = service.totals_now()
    for _ in range(MAX_LISTING_READS):  # asked once: the whole of a directory too big for one read
        if not totals.unfinished_listings:
            break
        totals = service.totals_now()
    join = EngineJoin(service, totals, files)
    return join.rows(join.engines())


# Every field of a row, in the order --json prints them; None where nothing is known.  The exporter's
# JSON API (exporter/web/api.py) serves the same rows, so a remote table is this table.
ROW_FIELDS = (
    "engine", "path", "processes", "pods", "size_bytes", "cached_ratio", "residency_unavailable", "device",
    "disks", "mountpoint", "fstype", "gpus", "loads", "read_mib_per_second", "inferences", "mean_latency_seconds",
    "loads_in_progress", "load_in_progress_read_bytes", "load_in_progress_since", "last_load_timestamp",
    "last_load_class", "last_load_seconds", "last_load_phases", "last_load_device_bytes", "last_load_cache_bytes",
    "last_load_read_bytes_per_second", "predicted_cold_start_seconds",
)


class EngineJoin:
    """The join behind ``gpuio engines`` and the exporter's /api/v1/engines: each engine's spool figures
    with its files (size, residency, device), the disks and mount under them, its GPUs and pods.

    ``service`` is an engine service (a read-only one of ``gpuio engines``, or the exporter's own engines
    collector's, held by its caller alone); ``files`` its last scan of engine files.  ``look_up``: devices are looked
    up now (a one-shot tool), else taken from what the exporter's scrapes learned within their budget (the
    API: st_dev numbers are what spool writers report, so a request must not make a look-up per row).
    Mounts come from the host's table the service reads (``Context.host_mounts``), as /metrics' do."""

    def __init__(self, service: EngineService, totals: Totals,
                 files: Mapping[tuple[str, str], FileView], look_up: bool = True) -> None:
        self.service = service
        self.look_up = look_up
        self.totals = totals
        self.files = files
        self.mount_table = service.context.host_mounts.table()  # one table for every row

    def engines(self) -> list[str]:
        """Every engine known: reported through the spool or discovery, or only a file."""
        return sorted(set(self.totals.engines) | {engine for engine, _ in self.files})

    def paths(self, engine: str) -> list[str]:
        """The engine's files, by name ("" alone when none is known)."""
        infos = self.totals.infos.get(engine, [])
        return sorted({path for name, path in self.files if name == engine} | {info.path for info in infos}) or [""]

    def rows(self, engines: Iterable[str]) -> list[dict[str, Any]]:
        return [self.row(engine, path) for engine in engines for path in self.paths(engine)]

    def row(self, engine: str, path: str) -> dict[str, Any]:
        row = dict.fromkeys(ROW_FIELDS)
        row.update(self._engine_figures(engine))
        row.update(self._file_figures(engine, path))
        row.update(_last_load(self.totals.waterfalls.get(engine)))
        row["predicted_cold_start_seconds"] = self.service.predicted_cold_start(self.totals, engine)
        return row

    def _engine_figures(self, engine: str) -> dict[str, Any]:
        """What the engine's writers report, the same in each of its rows."""
        from .engines.model import counter, histogram_count_and_sum

        totals = self.totals
        figures: dict[str, Any] = {
            "engine": engine,
            "processes": totals.live_processes(engine),
            "pods": sorted({f"{pod.namespace}/{pod.pod}" for (name, _), pods in totals.pods.items()
                            if name == engine for pod in pods if pod.pod}),
            "last_load_timestamp": totals.last_load.get(engine),
            **self._loads_in_progress(engine),
        }
        values = totals.engines.get(engine)
        if values is not None:
            loads, read_seconds = histogram_count_and_sum(values, "load_read_seconds")
            inferences, inference_seconds = histogram_count_and_sum(values, "inference_seconds")
            figures.update({
                "loads": loads,
                "read_mib_per_second": counter(values, "load_read_bytes") / 2**20 / read_seconds
                if read_seconds > 0 else None,
                "inferences": inferences,
                "mean_latency_seconds": inference_seconds / inferences if inferences else None,
            })
        return figures

    def _loads_in_progress(self, engine: str) -> dict[str, Any]:
        """The engine's loads started and not finished by live processes, on every GPU, and when the
        oldest began (None when none is in progress)."""
        count = read_bytes = 0.0
        since: float | None = None
        for (name, _, _), (in_progress, progress_bytes, oldest) in self.totals.loads.items():
            if name != engine or in_progress <= 0:
                continue
            count += in_progress
            read_bytes += progress_bytes
            if oldest > 0 and (since is None or oldest < since):
                since = oldest
        return {"loads_in_progress": count, "load_in_progress_read_bytes": read_bytes,
                "load_in_progress_since": since}

    def _file_figures(self, engine: str, path: str) -> dict[str, Any]:
        """The file's size and residency (the last scan), the device, disks and mount under it, and the
        GPUs the engine was loaded on from it."""
        view = self.files.get((engine, path))
        infos = self.totals.infos.get(engine, [])
        info = next((i for i in infos if i.path == path), None)
        dev = info.dev if info is not None else view.dev if view is not None else None
        device, disks = self.service.device_of(dev, self.look_up) if dev else ("", [])
        mount = self.mount_table.of_file(dev, path) if dev and dev != (0, 0) and path else None
        return {
            "path": path,
            "size_bytes": view.size if view else (info.size if info else None),
            "cached_ratio": (view.cached_bytes / view.size if view.size else 1.0)
            if view is not None and view.cached_bytes is not None and view.size is not None else None,
            "residency_unavailable": view.unavailable if view else None,
            "device": device, "disks": disks,
            "mountpoint": mount.mountpoint if mount else None, "fstype": mount.fstype if mount else None,
            "gpus": sorted({gpu_cell(i.cuda_device, i.gpu_uuid) for i in infos
                            if i.path == path and (i.cuda_device >= 0 or i.gpu_uuid)}),
        }


def _last_load(values: list[float] | None) -> dict[str, Any]:
    """The waterfall of the engine's latest load, as a row's fields (empty before any)."""
    from gpuio import spool as spool_format

    slot = spool_format.WATERFALL
    if values is None or values[slot["last_start"]] <= 0:
        return {}
    klass = int(values[slot["last_class"]])
    classes = spool_format.LOAD_CLASSES
    read = values[slot["last_read"]]
    return {
        "last_load_class": classes[klass - 1] if 1 <= klass <= len(classes) else None,
        "last_load_seconds": values[slot["last_wall"]],
        "last_load_phases": {name: values[slot[f"last_{name}"]] for name in spool_format.PHASES
                             if values[slot[f"last_{name}"]]},
        "last_load_device_bytes": values[slot["last_device_bytes"]],
        "last_load_cache_bytes": values[slot["last_cache_bytes"]],
        "last_load_read_bytes_per_second": values[slot["last_bytes"]] / read if read > 0 else None,
    }


def gpu_cell(cuda_device: int, uuid: str) -> str:
    """"cuda:0 GPU-5a1e...", either part where known (-1: the process did not say)."""
    return " ".join(part for part in (f"cuda:{cuda_device}" if cuda_device >= 0 else "", uuid) if part)
