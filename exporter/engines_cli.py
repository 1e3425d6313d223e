"""``gpuio engines`` and ``gpuio warm``: the engine view for the engineer on the node.

``gpuio engines`` lists the engines on this node (from the spool and ``--path`` globs): file size,
page-cache residency, the block device and disks under the file, the GPU, live processes, loads and
when the last one happened, mean read throughput and inference latency.  It reads the spool without
changing it: files of exited processes are left for the exporter to fold.

``gpuio warm PATH...`` reads engine files into the page cache ahead of a rollout (what teams do today
by copying engines to tmpfs) and prints the throughput achieved and the residency before and after.
It is often run as root over directories others write to: it opens only regular files on a disk,
inside the paths it was given, as the user who ran sudo, each bounded in time (WARM_RULES below).
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import math
import os
import pwd
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from .engine_join import ENGINES_API, ROW_FIELDS, engine_rows, finite, json_text
from .pagecache import NamedPaths, Unavailable, lexical, open_named, residency_fd
from .terminal import printable

if TYPE_CHECKING:
    from .remote import ClientOptions

WARM_CHUNK = 8 << 20


def _mib(value: float) -> str:
    return f"{value / 2**20:.1f}"


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
    ("SIZE MiB", lambda row: _mib(row["size_bytes"]) if row["size_bytes"] is not None else "-", True),
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
    ("FROM DISK MiB", lambda row: _mib(row["last_load_device_bytes"]) if row.get("last_load_class") else "-", False),
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


# The exporter's JSON API of the join (exporter/api.py), and the most of its answer read: above the
# exporter's own bound on it, so that a whole answer always fits.
MAX_API_ANSWER_BYTES = 16 << 20
# The most rows read, and the objects and arrays they may hold (counted before the answer is parsed): a few
# KiB of gzip can pack a million rows into the byte bound above, each made a dict of every field here.  The
# exporter serves at most 8 MiB of rows (exporter/api.py), each of every field: ~12,800 rows of nulls, 3,200
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

    from .pods import kubelet
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


# --------------------------------------------------------------------------------------------------
# gpuio warm: often run as root over directories others may write to (a glob's matches are names
# anyone with write access there chose), so what it opens is bounded — see WARM_RULES.
# --------------------------------------------------------------------------------------------------

STALL_SECONDS = 15.0  # default --stall-timeout: an 8 MiB read from a slow network mount takes ~1 s
MAX_ABANDONED = 8  # reads left stuck in the kernel before the files left are not tried

WARM_RULES = f"""\
what is read, and what is refused (a refusal is a line "PATH: error: why",
and the exit status is then 1):

  * Regular files on a disk only.  A FIFO, device, socket or directory is
    refused without being opened; so is a file on /proc, /sys or another
    kernel filesystem, told by the filesystem of the opened descriptor, not
    by its name (a bind mount of /proc/self/pagemap is refused too).
  * Only the paths named.  Each PATH, and each path a glob matches, is a
    named path.  It is walked from the directory typed before any wildcard
    (taken as given), one part at a time, following no symbolic link: a
    link there is followed only where it leads, by name, to a named path or
    below one, and refused otherwise.  So /models/x.engine -> /root/secret
    is never opened by `gpuio warm '/models/*.engine'`, while b.engine ->
    a.engine is read when a.engine is named too: to warm through a link,
    name its target as well.
  * As root on another user's behalf (sudo, which sets SUDO_UID and
    SUDO_GID; or a set-user-ID start, whose real user is not root), gpuio
    warm first becomes that user (user id, group id and groups, for good)
    before it looks at any path.  It then lists, reads and evicts only what
    that user may, and reports residency as that user would see it.
    --as-root keeps root's rights (every other rule still holds).
  * A file whose open or read makes no progress for --stall-timeout
    seconds (default {STALL_SECONDS:g}; a dead network mount or disk) is abandoned
    with a message and the next file goes on; a glob whose listing stalls,
    likewise.  The read stays blocked in the kernel on a thread of its own
    (nothing can cancel it from user space): if it ever returns, that
    thread closes the file and ends; at exit the kernel ends it.  After
    {MAX_ABANDONED} abandoned reads, the files left are not tried.
"""


class Stalled(Exception):
    """Work run by :func:`within_stall_bound` made no progress for the bound; it was left behind."""


def within_stall_bound(work: Callable[[Callable[[], None], threading.Event], Any], stall: float) -> Any:
    """``work(beat, abandoned)`` on a daemon thread of its own: its value, or :class:`Stalled` once it
    has not called ``beat()`` for ``stall`` seconds.

    A read that blocks in the kernel (a dead NFS server, a failing disk) cannot be interrupted from
    Python, and O_NONBLOCK means nothing for regular files: the only bound is to stop waiting.  The
    thread is then left blocked; ``abandoned`` tells ``work`` to stop as soon as it runs again, and as a
    daemon thread it does not hold up the exit (the kernel ends it then).
    """
    finished, abandoned = threading.Event(), threading.Event()
    last_beat = [time.monotonic()]
    outcome: dict[str, Any] = {}

    def beat() -> None:
        last_beat[0] = time.monotonic()

    def run() -> None:
        try:
            outcome["value"] = work(beat, abandoned)
        except BaseException as exc:  # handed to the waiting thread, which raises it
            outcome["error"] = exc
        finally:
            finished.set()

    threading.Thread(target=run, name="gpuio-warm-file", daemon=True).start()
    while not finished.wait(max(0.0, last_beat[0] + stall - time.monotonic())):
        if time.monotonic() - last_beat[0] >= stall:
            abandoned.set()
            raise Stalled
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def _residency(fd: int, into: dict[str, Any], key: str) -> None:
    """``into[key]``: the cached fraction of the open file ``fd``, or None with the reason alongside."""
    try:
        into[key] = residency_fd(fd, os.fstat(fd), f"/proc/self/fd/{fd}", "auto").ratio
    except Unavailable as exc:
        into[key] = None
        into.setdefault("residency_unavailable", exc.reason)


def evict_file(path: str, named: NamedPaths, beat: Callable[[], None] = lambda: None,
               abandoned: threading.Event | None = None) -> dict[str, Any]:
    """Drop ``path``'s clean pages from the page cache (posix_fadvise DONTNEED), to reproduce a cold
    start on purpose; dirty pages are written first (fdatasync), or the kernel would keep them.
    ``path`` is opened by :func:`open_named`: only inside ``named``; ``beat`` is called after each
    step; nothing is dropped once ``abandoned`` is set (the wait for fdatasync was given up)."""
    result: dict[str, Any] = {"path": path, "evicted": True}
    fd, st = open_named(path, named)
    try:
        beat()
        _residency(fd, result, "cached_before")
        with contextlib.suppress(OSError):  # a file this user may not write: its dirty pages stay
            os.fdatasync(fd)
        beat()
        if abandoned is not None and abandoned.is_set():
            return result
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        result["bytes"] = st.st_size
        _residency(fd, result, "cached_after")
    finally:
        os.close(fd)
    return result


def warm_file(path: str, named: NamedPaths, progress: Callable[[int], None] = lambda _: None,
              expect: Callable[[int], None] = lambda _: None, abandoned: threading.Event | None = None,
              chunk: int = WARM_CHUNK) -> dict[str, Any]:
    """Read ``path`` once, sequentially, into the page cache; what it took and what it achieved.

    ``path`` is opened by :func:`open_named` (only inside ``named``); ``expect`` is told its size once
    open, ``progress`` each chunk's bytes as they are read (0 for a step without bytes); reading stops
    early once ``abandoned`` is set."""
    result: dict[str, Any] = {"path": path}
    fd, st = open_named(path, named)
    try:
        _residency(fd, result, "cached_before")
        expect(st.st_size)
        progress(0)
        buffer = bytearray(chunk)
        view = memoryview(buffer)
        total = 0
        start = time.perf_counter()
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        with open(fd, "rb", buffering=0, closefd=False) as handle:
            while not (abandoned is not None and abandoned.is_set()):
                count = handle.readinto(view)
                if not count:
                    break
                total += count
                progress(count)
        seconds = time.perf_counter() - start
        result.update({"bytes": total, "seconds": seconds,
                       "mib_per_second": total / 2**20 / seconds if seconds else None})
        _residency(fd, result, "cached_after")
    finally:
        os.close(fd)
    return result


def invoking_user() -> tuple[int, int, list[int], str] | None:
    """(uid, gid, groups, who) of the user this root process acts for: sudo's SUDO_UID (and SUDO_GID),
    else the real user of a set-user-ID start; None when not root or when root acts for itself.
    ValueError when sudo's variables are there but say no user."""
    if os.geteuid() != 0:
        return None
    if os.getuid() != 0:  # set-user-ID root: the real ids and groups are the caller's
        return os.getuid(), os.getgid(), os.getgroups(), f"uid {os.getuid()}, the real user"
    sudo_uid = os.environ.get("SUDO_UID")
    if sudo_uid is None:
        return None
    uid = _user_id(sudo_uid, "SUDO_UID")
    if uid == 0:
        return None
    try:
        account: pwd.struct_passwd | None = pwd.getpwuid(uid)
    except KeyError:
        account = None
    sudo_gid = os.environ.get("SUDO_GID")
    if sudo_gid is not None:
        gid = _user_id(sudo_gid, "SUDO_GID")
    elif account is not None:
        gid = account.pw_gid
    else:
        raise ValueError(f"SUDO_UID={uid} has no SUDO_GID and no account to take a group from")
    groups = os.getgrouplist(account.pw_name, gid) if account is not None else [gid]
    return uid, gid, groups, f"uid {uid}, who ran sudo"


def _user_id(text: str, name: str) -> int:
    if not (text.isascii() and text.isdigit()) or int(text) >= 2**32 - 1:
        raise ValueError(f"{name}={printable(text)} is not a user or group id")
    return int(text)


def become(uid: int, gid: int, groups: list[int]) -> None:
    """This whole process becomes ``uid``, for good: groups first, then group, then user (after setresuid
    it could change neither).  Python's calls reach every thread (glibc applies them to all)."""
    os.setgroups(groups)
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)
    if os.getresuid() != (uid, uid, uid) or os.getresgid() != (gid, gid, gid):
        raise OSError(f"still uid {os.getresuid()}, gid {os.getresgid()}")


def _act_as_invoking_user() -> str | None:
    """Become the user root runs for (see WARM_RULES); None when done or not needed, else why not."""
    try:
        user = invoking_user()
    except ValueError as exc:
        return f"{exc}: unset it, or pass --as-root to read as root"
    if user is None:
        return None
    uid, gid, groups, who = user
    try:
        become(uid, gid, groups)
    except OSError as exc:
        return f"cannot become {who} ({exc}): run gpuio warm as that user, or pass --as-root to read as root"
    print(f"gpuio warm: reading as {who} (--as-root reads as root)", file=sys.stderr)
    return None


def _jobs(value: str) -> int:
    """--jobs: a whole number of at least 1 (0 or less read nothing, and silently became 1)."""
    if not (value.isascii() and value.isdigit()) or int(value) < 1:
        raise argparse.ArgumentTypeError(f"{value!r} is not a whole number of at least 1")
    return int(value)


def _seconds(value: str) -> float:
    """--stall-timeout: a positive, finite number of seconds."""
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds > 0):
        raise argparse.ArgumentTypeError(f"{value!r} is not a positive number of seconds")
    return seconds


def _anchor(pattern: str) -> str:
    """The directory a path or glob names before its first wildcard: what the user typed, taken as given."""
    parts = lexical(pattern).split("/")[:-1]  # the last part is the file (or what its wildcards match)
    typed = []
    for part in parts:
        if glob.has_magic(part):
            break
        typed.append(part)
    return "/".join(typed) or "/"


def _expand(patterns: Sequence[str], stall: float) -> tuple[list[str], NamedPaths, list[dict[str, Any]]]:
    """The paths to read, in order (each once); the named paths they are; a failure for each glob whose
    listing stalled (a directory on a dead mount)."""
    paths: list[str] = []
    named = NamedPaths()
    failures = []
    for pattern in patterns:
        if glob.has_magic(pattern):
            try:
                matches = within_stall_bound(_lister(pattern), stall)
            except Stalled:
                failures.append({"path": pattern, "error": f"listing made no progress in {stall:g} s "
                                                          "(a dead network mount or disk?): abandoned"})
                continue
        else:
            matches = [pattern]
        anchor = _anchor(pattern)
        for path in matches:
            named.add(path, anchor)
            if path not in paths:
                paths.append(path)
    return paths, named, failures


def _lister(pattern: str) -> Callable[[Callable[[], None], threading.Event], list[str]]:
    def matches(beat: Callable[[], None], abandoned: threading.Event) -> list[str]:
        return sorted(glob.glob(pattern))
    return matches


def warm_main(argv: Sequence[str]) -> int:
    """``gpuio warm``.  Run as root for another user (sudo), this process becomes that user, for good:
    a command's entry point, not a function to call inside a longer-lived root process."""
    parser = argparse.ArgumentParser(
        prog="gpuio warm", description="Read engine files into the page cache and print the throughput.",
        epilog=WARM_RULES, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("paths", nargs="+", metavar="PATH", help="files or globs")
    parser.add_argument("--jobs", type=_jobs, default=1, help="files read at once (default 1: one after another)")
    parser.add_argument("--evict", action="store_true",
                        help="drop the files from the page cache instead (posix_fadvise DONTNEED): the next load "
                             "of each is a cold start, on purpose")
    parser.add_argument("--stall-timeout", type=_seconds, default=STALL_SECONDS, metavar="SECONDS",
                        help="abandon a file whose open or read makes no progress for this long "
                             "(default %(default)g)")
    parser.add_argument("--as-root", action="store_true",
                        help="run by root for another user (sudo), read as root rather than as that user")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(list(argv))
    if not args.as_root:
        problem = _act_as_invoking_user()  # before any path is looked at: globs list as that user too
        if problem is not None:
            print(f"gpuio warm: error: {problem}", file=sys.stderr)
            return 2
    paths, named, results = _expand(args.paths, args.stall_timeout)
    if not paths and not results:
        print("gpuio warm: error: no files match", file=sys.stderr)
        return 2
    start = time.perf_counter()
    bar = _Bar() if not args.json and not args.evict and sys.stderr.isatty() else None
    stuck = _Count()  # reads abandoned, left blocked in the kernel
    for failure in results:
        _print_result(failure, args, bar)

    def one(path: str) -> dict[str, Any]:
        if stuck.value >= MAX_ABANDONED:
            return {"path": path, "error": f"not tried: {stuck.value} reads are stuck (a dead mount?)"}
        try:
            return within_stall_bound(lambda beat, stop: _warm_or_evict(path, named, args.evict, beat, stop, bar),
                                      args.stall_timeout)
        except Stalled:
            stuck.add()
            return {"path": path, "error": f"no progress in {args.stall_timeout:g} s (a dead network mount or "
                                           "disk?): abandoned, its read left blocked in the kernel"}
        except Unavailable as exc:  # its message starts with the path, which the line shows already
            return {"path": path, "error": str(exc).removeprefix(f"{path}: ")}
        except OSError as exc:
            return {"path": path, "error": exc.strerror or str(exc)}

    with ThreadPoolExecutor(max_workers=args.jobs) as pool, (bar or contextlib.nullcontext()):
        for result in pool.map(one, paths):
            results.append(result)
            _print_result(result, args, bar)
    elapsed = time.perf_counter() - start
    failed = sum("error" in result for result in results)
    total = sum(result.get("bytes", 0) for result in results)
    files = len(results)  # every path, and every glob that could not be listed
    if args.json:
        print(json_text({"files": results, "bytes": total, "seconds": elapsed}))
    elif args.evict:
        print(f"evicted: {_mib(total)} MiB, {files - failed} of {files} files")
    else:
        print(f"total: {_mib(total)} MiB in {elapsed:.2f} s ({total / 2**20 / elapsed if elapsed else 0:.0f} MiB/s), "
              f"{files - failed} of {files} files")
    return 1 if failed else 0


class _Count:
    """A number the pool's threads add to (--jobs)."""

    def __init__(self) -> None:
        self.value = 0
        self._lock = threading.Lock()

    def add(self) -> None:
        with self._lock:
            self.value += 1


def _warm_or_evict(path: str, named: NamedPaths, evict: bool, beat: Callable[[], None], abandoned: threading.Event,
                   bar: _Bar | None) -> dict[str, Any]:
    """One file's work on its own thread: each step beats, so that only a stall ends the wait for it."""
    if evict:
        return evict_file(path, named, beat, abandoned)

    def progress(nbytes: int) -> None:
        if not abandoned.is_set():
            beat()
            if bar is not None and nbytes:
                bar.advance(nbytes)

    return warm_file(path, named, progress, bar.expect if bar is not None else lambda _: None, abandoned)


def _print_result(result: dict[str, Any], args: argparse.Namespace, bar: _Bar | None) -> None:
    if args.json:
        return
    line = _evict_line(result) if args.evict else _warm_line(result)
    if bar is not None:  # above the bar, which stays at the bottom
        bar.console.print(line, markup=False, highlight=False)
    else:
        print(line, flush=True)


class _Bar:
    """A rich progress bar on stderr over the bytes of every file (only on a terminal).  Its total grows
    as each file is opened: sizing the files up front would look them up outside the bounds above."""

    def __init__(self) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn, TransferSpeedColumn

        self.console = Console(stderr=True)
        self._progress = Progress("reading", BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                                  TimeRemainingColumn(), console=self.console, transient=True)
        self._task = self._progress.add_task("warm", total=0)
        self._lock = threading.Lock()  # --jobs: several files' threads size it at once
        self._total = 0

    def expect(self, nbytes: int) -> None:
        with self._lock:
            self._total += nbytes
            self._progress.update(self._task, total=self._total)

    def advance(self, nbytes: int) -> None:
        self._progress.advance(self._task, nbytes)

    def __enter__(self) -> _Bar:
        self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._progress.stop()


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
