"""``gpuio engines``: the engine view for the engineer on the node.

It lists the engines on this node (from the spool and ``--path`` globs): file size, page-cache residency,
the block device and disks under the file, the GPU, live processes, loads and when the last one happened,
mean read throughput and inference latency.  It reads the spool without changing it: files of exited
processes are left for the exporter to fold.  ``--url`` prints the same table from a remote exporter's
JSON API.  (``gpuio warm``: exporter/tools/warm_cli.py.)
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ..engine_join import ENGINES_API, ROW_FIELDS, engine_rows, finite, json_text
from .terminal import mib, printable

if TYPE_CHECKING:
    from .remote import ClientOptions



def _age(timestamp: float | None) -> str:
    return f"{_elapsed(timestamp)} ago" if timestamp else "-"


def _elapsed(since: float) -> str:
    """The time from ``since`` (a Unix time) to now: "12s", "1.5m", "2.0h", "3.1d"."""
    seconds = max(0.0, time.time() - since)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f}{unit}"
    return f"{seconds:.0f}s"


def _waterfall(row: dict[str, Any]) -> str:
    short = {"open": "open", "read": "read", "deserialize": "deser", "context": "ctx", "warmup": "warm",
             "first_inference": "first"}
    phases = row.get("last_load_phases") or {}
    return " ".join(f"{short[name]} {seconds * 1000:.0f}ms" for name, seconds in phases.items()) or "-"


def _loading(row: dict[str, Any]) -> str:
    """Loads in progress and how long the oldest has taken so far: "1 for 12s"."""
    count = row.get("loads_in_progress") or 0
    if not count:
        return "-"
    since = row.get("load_in_progress_since")
    return f"{count:.0f} for {_elapsed(since)}" if since else f"{count:.0f}"


# The table's columns: (heading, the cell of a row, shown without --wide).  What on-call reads first is
# compact (~120 columns for typical names); --wide adds the load's detail and the inference figures.
COLUMNS: tuple[tuple[str, Callable[[dict[str, Any]], str], bool], ...] = (
    ("ENGINE", lambda row: row["engine"], True),
    ("PROCS", lambda row: str(row["processes"]), True),
    ("SIZE MiB", lambda row: mib(row["size_bytes"]) if row["size_bytes"] is not None else "-", True),
    ("CACHED", lambda row: f"{row['cached_ratio'] * 100:.0f}%" if row["cached_ratio"] is not None
     else (row["residency_unavailable"] or "-"), True),
    ("DEVICE", lambda row: row["device"] or "-", False),
    ("DISKS", lambda row: ",".join(row["disks"]) or "-", True),
    ("GPU", lambda row: " ".join(_short_gpu(gpu) for gpu in row["gpus"]) or "-", True),
    ("MOUNT", lambda row: row.get("mountpoint") or "-", False),
    ("LOADS", lambda row: f"{row.get('loads') or 0:.0f}", True),
    ("LOADING", _loading, False),
    ("LAST LOAD", lambda row: _age(row["last_load_timestamp"]), True),
    ("READ MiB/s", lambda row: f"{row['read_mib_per_second']:.0f}" if row.get("read_mib_per_second") else "-", True),
    ("LAST LOAD WATERFALL", _waterfall, False),
    ("CLASS", lambda row: row.get("last_load_class") or "-", True),
    ("FROM DISK MiB", lambda row: mib(row["last_load_device_bytes"]) if row.get("last_load_class") else "-", False),
    ("COLD START s", lambda row: "-" if row.get("predicted_cold_start_seconds") is None
     else f"{row['predicted_cold_start_seconds']:.2f}", True),
    ("INFERENCES", lambda row: f"{row.get('inferences') or 0:.0f}", False),
    ("MEAN ms", lambda row: f"{row['mean_latency_seconds'] * 1000:.2f}" if row.get("mean_latency_seconds") else "-",
     False),
    ("PATH", lambda row: row["path"] or "-", True),
)


def _short_gpu(gpu: str) -> str:
    """A GPU cell's UUID cut to its first 8 hex digits ("cuda:0 GPU-5a1e0c2b"): enough to tell a node's GPUs
    apart; --json has it whole."""
    return " ".join(part[:12] if part.startswith(("GPU-", "MIG-")) else part for part in gpu.split(" "))


def _table(rows: list[dict[str, Any]], wide: bool = False) -> str:
    columns = [column for column in COLUMNS if wide or column[2]]
    lines = [tuple(heading for heading, _, _ in columns)]
    lines += [tuple(cell(row) for _, cell, _ in columns) for row in rows]
    # Names and paths come from spool writers: printed escaped, so none can drive the admin's terminal.
    shown = [[printable(cell) for cell in line] for line in lines]
    widths = [max(len(line[i]) for line in shown) for i in range(len(columns))]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip()
                     for line in shown) + "\n"


# The exporter's JSON API of the join (exporter/web/api.py), and the most of its answer read: above the
# exporter's own bound on it, so that a whole answer always fits.
MAX_API_ANSWER_BYTES = 16 << 20
# The most rows read, and the objects and arrays they may hold (counted before the answer is parsed): a few
# KiB of gzip can pack a million rows into the byte bound above, each made a dict of every field here.  The
# exporter serves at most 8 MiB of rows (exporter/web/api.py), each of every field: ~12,800 rows of nulls, 3,200
# at its default caps (200 engines, 16 files each).  A row is an object with 4 more (pods, disks, gpus, its
# last load's phases); the answer adds itself and its list.
MAX_API_ROWS = 25_000
CONTAINERS_PER_ROW = 5
MAX_API_CONTAINERS = MAX_API_ROWS * CONTAINERS_PER_ROW + 2
# Flags that say where on this node to look: they mean nothing with --url.
LOCAL_FLAGS = (("--spool-dir", "spool_dir"), ("--path", "path"), ("--path.procfs", "procfs"),
               ("--path.sysfs", "sysfs"), ("--path.rootfs", "rootfs"), ("--path-include", "path_include"),
               ("--kubelet-pods-dir", "kubelet_pods_dir"))


def _engines_parser() -> argparse.ArgumentParser:
    from gpuio.spool import DEFAULT_DIR

    from ..pods import kubelet
    from .remote import URL_HELP, add_client_options

    parser = argparse.ArgumentParser(
        prog="gpuio engines", description="The engines on this node, or on the node of the exporter --url names.",
        epilog=f"Without --url: the engines processes report here through the library (the spool directory, and "
               f"pods' spool volumes under --kubelet-pods-dir) and the --path files.  Engines the exporter finds by "
               f"discovery (servers without the library, holding model files open on a GPU NVML lists) are the "
               f"running exporter's: --url http://localhost:9817 reads them.  No spool directory at the default "
               f"{DEFAULT_DIR} is no error (no process on this node has used the library): the rest is shown, or a "
               f"line 'no engines:' saying what was looked at, exit 0.  A --spool-dir (or variable) that does not "
               f"exist is an error, exit 2: a typo would otherwise read as no engines.")
    parser.add_argument("--spool-dir", default=None,
                        help=f"spool directory (env GPUIO_COLLECTOR_ENGINES_SPOOL_DIR, else GPUIO_SPOOL_DIR as the "
                             f"library reads it; default {DEFAULT_DIR})")
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
    parser.add_argument("--wide", action="store_true",
                        help="every column: the device and mount, loads in progress, the last load's waterfall and "
                             "disk bytes, inferences")
    parser.add_argument("--url", metavar="URL",
                        help=f"read the engines of the node a running exporter serves, from its /api/v1/engines, "
                             f"instead of this node's: {URL_HELP}")
    add_client_options(parser)
    return parser


def engines_main(argv: Sequence[str]) -> int:
    from .remote import client_options

    parser = _engines_parser()
    args = parser.parse_args(list(argv))
    options = client_options(parser, args)
    if args.url:
        local = [flag for flag, dest in LOCAL_FLAGS if getattr(args, dest) != parser.get_default(dest)]
        if local:
            parser.error(f"{', '.join(local)}: where to look on this node; not with --url, which reads the exporter's")
        return _print_remote(args, options)
    return _print_local(args)


def spool_directory(given: str | None, environ: Mapping[str, str]) -> tuple[str, str | None]:
    """The spool directory to read, and what named it (a flag or a variable; None for the default)."""
    from gpuio.spool import DEFAULT_DIR

    if given is not None:
        return given, "--spool-dir"
    for variable in ("GPUIO_COLLECTOR_ENGINES_SPOOL_DIR", "GPUIO_SPOOL_DIR"):
        if environ.get(variable):
            return environ[variable], variable
    return DEFAULT_DIR, None


def _print_local(args: argparse.Namespace) -> int:
    spool_dir, named_by = spool_directory(args.spool_dir, os.environ)
    globs = [part.strip() for value in args.path for part in value.split(",") if part.strip()]
    if not globs and env_globs():
        globs = env_globs()
    if named_by is not None and not os.path.isdir(spool_dir):
        # Named on purpose: a typo would otherwise read as "no engines".  The default missing is no error:
        # no process on this node has used the library, and discovery and --path may still find engines.
        print(f"gpuio engines: error: spool directory {printable(spool_dir)} does not exist (named by {named_by}); "
              "no instrumented process can report there", file=sys.stderr)
        return 2
    include = [part.strip() for part in args.path_include.split(",") if part.strip()]
    rows = engine_rows(spool_dir, globs, args.procfs, args.sysfs, args.rootfs, include or None,
                       args.kubelet_pods_dir)
    _print_rows(rows, args, _nothing_found(spool_dir, globs))
    return 0


def _nothing_found(spool_dir: str, globs: Sequence[str]) -> str:
    """What ``gpuio engines`` looked at and found empty, and where to point it instead: one line."""
    spool = (f"nothing in the spool directory {printable(spool_dir)}" if os.path.isdir(spool_dir) else
             f"no spool directory at {printable(spool_dir)}, so no process here reports through the library "
             "(--spool-dir or GPUIO_SPOOL_DIR names another)")
    files = "no file matches --path" if globs else "no --path files"
    # Discovery counts processes NVML lists on a GPU, which only the exporter's nvml collector reads.
    return f"{spool}; {files}; engines found by discovery are a running exporter's: --url http://localhost:9817"


def _print_remote(args: argparse.Namespace, options: ClientOptions) -> int:
    from .remote import RemoteError

    try:
        rows, answer, url = remote_rows(args.url, options)
        try:
            _print_rows(rows, args, f"the exporter at {printable(url)} reports none")
        except (TypeError, ValueError, AttributeError):  # a field of a type the table cannot print
            raise RemoteError(f"{url}: not an answer of gpuio's engines API") from None
    except RemoteError as exc:
        print(f"gpuio engines: error: {printable(exc)}", file=sys.stderr)
        return 1
    left_out = [f"{answer[key]} {what}" for key, what in (
        ("engines_left_out", "engines over the exporter's --collector.engines.max-engines"),
        ("rows_left_out", "files over the answer's bounds")) if isinstance(answer.get(key), int) and answer[key]]
    if left_out:
        print(f"gpuio engines: not listed: {'; '.join(left_out)} (docs/engines.md, The JSON API)", file=sys.stderr)
    return 0


def _print_rows(rows: list[dict[str, Any]], args: argparse.Namespace, why_none: str) -> None:
    if args.json:
        print(json_text(rows))
    elif not rows:
        print(f"no engines: {why_none}")
    else:  # a figure that is no finite number shows as "-" (no figure), as --json's null says
        sys.stdout.write(_table(finite(rows), args.wide))


def remote_rows(url: str, options: ClientOptions) -> tuple[list[dict[str, Any]], dict[str, Any], str]:
    """The rows of the exporter at ``url``'s /api/v1/engines, every field present; its whole answer; and the
    API's URL.  RemoteError (one line) when it cannot be read or is no such answer."""
    from .remote import Exporter, RemoteError

    exporter = Exporter(url, options)
    api = exporter.endpoint(ENGINES_API)
    answer = exporter.get_json(api, MAX_API_ANSWER_BYTES, MAX_API_CONTAINERS)
    rows = answer.get("engines") if isinstance(answer, dict) else None
    if isinstance(rows, list) and len(rows) > MAX_API_ROWS:
        raise RemoteError(f"{api}: the answer holds over {MAX_API_ROWS} rows (an exporter serves at most ~12,800); "
                          "is this a gpuio exporter?")
    if not isinstance(rows, list) or not all(isinstance(row, dict) and "engine" in row for row in rows):
        raise RemoteError(f"{api}: not an answer of gpuio's engines API")
    return [{**dict.fromkeys(ROW_FIELDS), **row} for row in rows], answer, api


def env_globs() -> list[str]:
    value = os.environ.get("GPUIO_COLLECTOR_ENGINES_PATH", "")
    return [part.strip() for part in value.split(",") if part.strip()]
