"""``gpuio engines`` and ``gpuio warm``: the engine view for the engineer on the node.

``gpuio engines`` lists the engines on this node (from the spool and ``--path`` globs): file size,
page-cache residency, the block device and disks under the file, the GPU, live processes, loads and
when the last one happened, mean read throughput and inference latency.  It reads the spool without
changing it: files of exited processes are left for the exporter to fold.

``gpuio warm PATH...`` reads engine files into the page cache ahead of a rollout (what teams do today
by copying engines to tmpfs) and prints the throughput achieved and the residency before and after.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from .pagecache import Unavailable, open_regular, residency
from .terminal import printable

WARM_CHUNK = 8 << 20
# Reads of the spool one ``gpuio engines`` may take to walk directories that one read does not list in
# full (65,536 entries a read: 1,000 reads are 65 million names).
MAX_LISTING_READS = 1000


def _mib(value: float) -> str:
    return f"{value / 2**20:.1f}"


def _age(timestamp: float | None) -> str:
    if not timestamp:
        return "-"
    seconds = max(0.0, time.time() - timestamp)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f}{unit} ago"
    return f"{seconds:.0f}s ago"


def json_text(value: Any) -> str:
    """``value`` as JSON that every parser reads: a number that is not finite (a writer's absurd figures,
    say 2**53 bytes read in 5e-324 s) becomes null, "no figure", where Python's json would print
    ``Infinity`` or ``NaN``, which are not JSON."""
    return json.dumps(_finite(value), indent=2, allow_nan=False)


def _finite(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(item) for item in value]
    return value


def engine_rows(spool_dir: str, globs: Sequence[str], procfs: str = "/proc", sysfs: str = "/sys",
                rootfs: str = "/", path_include: Sequence[str] | None = None,
                pods_dir: str | None = None) -> list[dict[str, Any]]:
    """One row per engine file (or per engine with no file known): what ``gpuio engines`` prints.

    The spools in pods' emptyDir volumes under ``pods_dir`` (the kubelet's pods directory) are read
    too, as the exporter reads them: found by one scan, now."""
    from .collect import Context
    from .collectors.engines import EnginesCollector
    from .spool_reader import counter, histogram_count_and_sum

    options = {"spool-dir": spool_dir, "path": tuple(globs), "max-engines": 10_000, "max-files": 10_000,
               "residency-interval": 3600.0, "path-include": tuple(path_include) if path_include else None,
               "kubelet-pods-dir": pods_dir}
    collector = EnginesCollector(Context(procfs, sysfs, rootfs), options, read_only=True)
    collector.find_pod_spools_now()  # the pods' spools (none off a Kubernetes node)
    collector.collect()  # learns the files processes report
    files = collector.engine_files_now()
    totals = collector.spool_totals()
    for _ in range(MAX_LISTING_READS):  # asked once: the whole of a directory too big for one read
        if not totals.unfinished_listings:
            break
        totals = collector.spool_totals()
    rows = []
    engines = sorted(set(totals.engines) | {engine for engine, _ in files})
    for engine in engines:
        values = totals.engines.get(engine)
        infos = totals.infos.get(engine, [])
        paths = sorted({path for name, path in files if name == engine} | {info.path for info in infos}) or [""]
        for path in paths:
            view = files.get((engine, path))
            info = next((i for i in infos if i.path == path), None)
            dev = info.dev if info is not None else view.dev if view is not None else None
            device, disks = collector.device_of(dev) if dev else ("", [])
            row: dict[str, Any] = {
                "engine": engine, "path": path, "processes": totals.processes.get(engine, 0),
                "pods": sorted({f"{pod.namespace}/{pod.pod}" for (name, _), pods in totals.pods.items()
                                if name == engine for pod in pods if pod.pod}),
                "size_bytes": view.size if view else (info.size if info else None),
                "cached_ratio": (view.cached_bytes / view.size if view.size else 1.0)
                if view is not None and view.cached_bytes is not None and view.size is not None else None,
                "residency_unavailable": view.unavailable if view else None,
                "device": device, "disks": disks,
                "gpus": sorted({f"cuda:{i.cuda_device} {i.gpu_uuid}".strip() for i in infos
                                if i.path == path and (i.cuda_device >= 0 or i.gpu_uuid)}),
                "last_load_timestamp": totals.last_load.get(engine),
            }
            row.update(_last_load(totals.waterfalls.get(engine)))
            row["predicted_cold_start_seconds"] = collector.predicted_cold_start(totals, engine)
            if values is not None:
                loads, read_seconds = histogram_count_and_sum(values, "load_read_seconds")
                inferences, inference_seconds = histogram_count_and_sum(values, "inference_seconds")
                row.update({
                    "loads": loads,
                    "read_mib_per_second": counter(values, "load_read_bytes") / 2**20 / read_seconds
                    if read_seconds > 0 else None,
                    "inferences": inferences,
                    "mean_latency_seconds": inference_seconds / inferences if inferences else None,
                })
            rows.append(row)
    return rows


def _last_load(values: list[float] | None) -> dict[str, Any]:
    """The waterfall of the engine's latest load, as a row's fields (empty before any)."""
    from gpuio import spool as fmt

    slot = fmt.WATERFALL
    if values is None or values[slot["last_start"]] <= 0:
        return {}
    klass = int(values[slot["last_class"]])
    read = values[slot["last_read"]]
    return {
        "last_load_class": fmt.LOAD_CLASSES[klass - 1] if 1 <= klass <= len(fmt.LOAD_CLASSES) else None,
        "last_load_seconds": values[slot["last_wall"]],
        "last_load_phases": {name: values[slot[f"last_{name}"]] for name in fmt.PHASES if values[slot[f"last_{name}"]]},
        "last_load_device_bytes": values[slot["last_device_bytes"]],
        "last_load_cache_bytes": values[slot["last_cache_bytes"]],
        "last_load_read_bytes_per_second": values[slot["last_bytes"]] / read if read > 0 else None,
    }


def _waterfall(row: dict[str, Any]) -> str:
    short = {"open": "open", "read": "read", "deserialize": "deser", "context": "ctx", "warmup": "warm",
             "first_inference": "first"}
    phases = row.get("last_load_phases") or {}
    return " ".join(f"{short[name]} {seconds * 1000:.0f}ms" for name, seconds in phases.items()) or "-"


def _table(rows: list[dict[str, Any]]) -> str:
    header = ("ENGINE", "PROCS", "SIZE MiB", "CACHED", "DEVICE", "DISKS", "GPU", "LOADS", "LAST LOAD", "READ MiB/s",
              "LAST LOAD WATERFALL", "CLASS", "FROM DISK MiB", "COLD START s", "INFERENCES", "MEAN ms", "PATH")
    lines = [header]
    for row in rows:
        cached = row["cached_ratio"]
        lines.append((
            row["engine"], str(row["processes"]),
            _mib(row["size_bytes"]) if row["size_bytes"] is not None else "-",
            f"{cached * 100:.0f}%" if cached is not None else (row["residency_unavailable"] or "-"),
            row["device"] or "-", ",".join(row["disks"]) or "-", " ".join(row["gpus"]) or "-",
            f"{row.get('loads', 0):.0f}", _age(row["last_load_timestamp"]),
            f"{row['read_mib_per_second']:.0f}" if row.get("read_mib_per_second") else "-",
            _waterfall(row), row.get("last_load_class") or "-",
            _mib(row["last_load_device_bytes"]) if row.get("last_load_class") else "-",
            "-" if row.get("predicted_cold_start_seconds") is None else f"{row['predicted_cold_start_seconds']:.2f}",
            f"{row.get('inferences', 0):.0f}",
            f"{row['mean_latency_seconds'] * 1000:.2f}" if row.get("mean_latency_seconds") else "-",
            row["path"] or "-",
        ))
    # Names and paths come from spool writers: printed escaped, so none can drive the admin's terminal.
    shown = [[printable(cell) for cell in line] for line in lines]
    widths = [max(len(line[i]) for line in shown) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip()
                     for line in shown) + "\n"


def engines_main(argv: Sequence[str]) -> int:
    from gpuio.spool import DEFAULT_DIR

    from .pods import kubelet

    parser = argparse.ArgumentParser(prog="gpuio engines", description="The engines on this node.")
    parser.add_argument("--spool-dir", default=os.environ.get("GPUIO_COLLECTOR_ENGINES_SPOOL_DIR", DEFAULT_DIR),
                        help="spool directory (env GPUIO_COLLECTOR_ENGINES_SPOOL_DIR; default %(default)s)")
    parser.add_argument("--path", action="append", default=[],
                        help="glob of engine files to include (repeatable, or comma-separated)")
    parser.add_argument("--path.procfs", dest="procfs", default="/proc")
    parser.add_argument("--path.sysfs", dest="sysfs", default="/sys")
    parser.add_argument("--path.rootfs", dest="rootfs", default="/")
    parser.add_argument("--path-include", default=os.environ.get("GPUIO_COLLECTOR_ENGINES_PATH_INCLUDE", ""),
                        help="directories where engine files named by processes may be opened (comma-separated; "
                             "env GPUIO_COLLECTOR_ENGINES_PATH_INCLUDE; default: the exporter's)")
    parser.add_argument("--kubelet-pods-dir",
                        default=os.environ.get("GPUIO_COLLECTOR_ENGINES_KUBELET_PODS_DIR", kubelet.DEFAULT_PODS_DIR),
                        help="the kubelet's pods directory, where inference pods' emptyDir spools are found "
                             "(env GPUIO_COLLECTOR_ENGINES_KUBELET_PODS_DIR; default %(default)s)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(list(argv))
    globs = [part.strip() for value in args.path for part in value.split(",") if part.strip()]
    if not globs and env_globs():
        globs = env_globs()
    if not globs and not os.path.isdir(args.spool_dir) and not os.path.isdir(args.kubelet_pods_dir):
        # a typo would otherwise read as "no engines"
        print(f"gpuio engines: error: spool directory {printable(args.spool_dir)} does not exist "
              "(--spool-dir, GPUIO_COLLECTOR_ENGINES_SPOOL_DIR); no instrumented process can report there",
              file=sys.stderr)
        return 2
    include = [part.strip() for part in args.path_include.split(",") if part.strip()]
    rows = engine_rows(args.spool_dir, globs, args.procfs, args.sysfs, args.rootfs, include or None,
                       args.kubelet_pods_dir)
    if args.json:
        print(json_text(rows))
    elif not rows:
        print(f"no engines: nothing in {printable(args.spool_dir)} and no --path files")
    else:
        sys.stdout.write(_table(rows))
    return 0


def env_globs() -> list[str]:
    value = os.environ.get("GPUIO_COLLECTOR_ENGINES_PATH", "")
    return [part.strip() for part in value.split(",") if part.strip()]


def _open_regular(path: str) -> int:
    """A read-only descriptor of ``path`` if it is a regular file (a symlink to one is fine), else OSError.
    A glob's matches are names anyone who may write there chose: a FIFO would block open() for ever, a
    device node's driver would see an open (a watchdog arms) and be read without end or evicted."""
    try:
        fd, _ = open_regular(path)
    except Unavailable as exc:
        raise OSError("not a regular file" if exc.reason == "not_regular" else str(exc)) from None
    return fd


def evict_file(path: str) -> dict[str, Any]:
    """Drop ``path``'s clean pages from the page cache (posix_fadvise DONTNEED), to reproduce a cold
    start on purpose; dirty pages are written first (fdatasync), or the kernel would keep them."""
    result: dict[str, Any] = {"path": path, "evicted": True}
    try:
        result["cached_before"] = residency(path).ratio
    except Unavailable as exc:
        result["cached_before"] = None
        result["residency_unavailable"] = exc.reason
    fd = _open_regular(path)
    try:
        with contextlib.suppress(OSError):  # a file this user may not write: its dirty pages stay
            os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        result["bytes"] = os.fstat(fd).st_size
    finally:
        os.close(fd)
    try:
        result["cached_after"] = residency(path).ratio
    except Unavailable:
        result["cached_after"] = None
    return result


def warm_file(path: str, chunk: int = WARM_CHUNK, progress: Callable[[int], None] | None = None) -> dict[str, Any]:
    """Read ``path`` once, sequentially, into the page cache; what it took and what it achieved.
    ``progress`` is told each chunk's bytes as they are read."""
    result: dict[str, Any] = {"path": path}
    try:
        result["cached_before"] = residency(path).ratio
    except Unavailable as exc:
        result["cached_before"] = None
        result["residency_unavailable"] = exc.reason
    buffer = bytearray(chunk)
    view = memoryview(buffer)
    total = 0
    start = time.perf_counter()
    with open(_open_regular(path), "rb", buffering=0) as handle:
        os.posix_fadvise(handle.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
        while True:
            count = handle.readinto(view)
            if not count:
                break
            total += count
            if progress is not None:
                progress(count)
    seconds = time.perf_counter() - start
    result.update({"bytes": total, "seconds": seconds, "mib_per_second": total / 2**20 / seconds if seconds else None})
    try:
        result["cached_after"] = residency(path).ratio
    except Unavailable:
        result["cached_after"] = None
    return result


def _jobs(value: str) -> int:
    """--jobs: a whole number of at least 1 (0 or less read nothing, and silently became 1)."""
    if not (value.isascii() and value.isdigit()) or int(value) < 1:
        raise argparse.ArgumentTypeError(f"{value!r} is not a whole number of at least 1")
    return int(value)


def warm_main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="gpuio warm",
                                     description="Read engine files into the page cache and print the throughput.")
    parser.add_argument("paths", nargs="+", metavar="PATH", help="files or globs")
    parser.add_argument("--jobs", type=_jobs, default=1, help="files read at once (default 1: one after another)")
    parser.add_argument("--evict", action="store_true",
                        help="drop the files from the page cache instead (posix_fadvise DONTNEED): the next load "
                             "of each is a cold start, on purpose")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(list(argv))
    paths: list[str] = []
    for pattern in args.paths:
        matches = sorted(glob.glob(pattern)) if glob.has_magic(pattern) else [pattern]
        paths.extend(path for path in matches if path not in paths)
    if not paths:
        print("gpuio warm: error: no files match", file=sys.stderr)
        return 2
    failed = 0
    results: list[dict[str, Any]] = []
    start = time.perf_counter()

    bar = _progress_bar(paths, enabled=not args.json and not args.evict and sys.stderr.isatty())

    def one(path: str) -> dict[str, Any]:
        try:
            if args.evict:
                return evict_file(path)
            return warm_file(path, progress=bar.advance if bar is not None else None)
        except OSError as exc:
            return {"path": path, "error": exc.strerror or str(exc)}

    with ThreadPoolExecutor(max_workers=args.jobs) as pool, (bar or contextlib.nullcontext()):
        for result in pool.map(one, paths):
            results.append(result)
            failed += "error" in result
            if not args.json:
                line = _evict_line(result) if args.evict else _warm_line(result)
                if bar is not None:  # above the bar, which stays at the bottom
                    bar.console.print(line, markup=False, highlight=False)
                else:
                    print(line, flush=True)
    elapsed = time.perf_counter() - start
    total = sum(result.get("bytes", 0) for result in results)
    if args.evict and not args.json:
        print(f"evicted: {_mib(total)} MiB, {len(paths) - failed} of {len(paths)} files")
        return 1 if failed else 0
    if args.json:
        print(json_text({"files": results, "bytes": total, "seconds": elapsed}))
    else:
        print(f"total: {_mib(total)} MiB in {elapsed:.2f} s ({total / 2**20 / elapsed if elapsed else 0:.0f} MiB/s), "
              f"{len(paths) - failed} of {len(paths)} files")
    return 1 if failed else 0


class _Bar:
    """A rich progress bar on stderr over the bytes of every file (only on a terminal)."""

    def __init__(self, total: int) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn, TransferSpeedColumn

        self.console = Console(stderr=True)
        self._progress = Progress("reading", BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                                  TimeRemainingColumn(), console=self.console, transient=True)
        self._task = self._progress.add_task("warm", total=total)

    def advance(self, nbytes: int) -> None:
        self._progress.advance(self._task, nbytes)

    def __enter__(self) -> _Bar:
        self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._progress.stop()


def _progress_bar(paths: list[str], enabled: bool) -> _Bar | None:
    if not enabled:
        return None
    total = 0
    for path in paths:
        with contextlib.suppress(OSError):
            total += os.stat(path).st_size
    return _Bar(total)


def _evict_line(result: dict[str, Any]) -> str:
    path = printable(result["path"])
    if "error" in result:
        return f"{path}: error: {printable(result['error'])}"

    def ratio(value: float | None) -> str:
        return "?" if value is None else f"{value * 100:.0f}%"

    return f"{path}: evicted, cached {ratio(result['cached_before'])} -> {ratio(result['cached_after'])}"


def _warm_line(result: dict[str, Any]) -> str:
    path = printable(result["path"])  # a glob's matches are names anyone with write access chose
    if "error" in result:
        return f"{path}: error: {printable(result['error'])}"

    def ratio(value: float | None) -> str:
        return "?" if value is None else f"{value * 100:.0f}%"

    speed = result["mib_per_second"]
    return (f"{path}: {_mib(result['bytes'])} MiB in {result['seconds']:.2f} s "
            f"({speed:.0f} MiB/s), cached {ratio(result['cached_before'])} -> {ratio(result['cached_after'])}"
            if speed else f"{path}: empty")
