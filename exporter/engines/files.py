"""Engine files: what the exporter sees of them, and the block devices under them.

The engines collector renders; this module keeps the facts it renders from (module note of
:mod:`exporter.collectors.engines`, "Devices" and "Engine files named by writers"):

* the background scan (sampler ``scanner``) stats every engine file the last scrape showed and every file
  ``--collector.engines.path`` matches, and measures its page-cache residency, never on the scrape path;
* the st_dev -> block device look-ups of the scrape, bounded (MAX_DEVICE_LOOKUPS a scrape, in the order
  the engines were chosen);
* the walks of writers' MOUNT records (overlay layer directories, /dev sources) in a background sampler
  of their own (``layers``), whose last answers the scrape uses.
"""

from __future__ import annotations

import functools
import glob
import logging
import os
import stat
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from gpuio import spool as spool_format
from gpuio.load import engine_name

from ..context import Context
from ..host import mounts
from ..host.abandonable import Abandonable, Unresponsive
from ..host.blockdev import DeviceAnswer, DeviceNumbers, device_by_number, device_named
from ..host.pagecache import Claim, Unavailable, open_regular, residency_fd, residency_of_claim
from ..sampler import PeriodicSampler
from . import model
from .selection import LeftOut

log = logging.getLogger("gpuio.collector.engines")  # the collector's logger: its log lines are unchanged

MAX_INFOS = 16  # info series (path, GPU, runtime) per engine: a few GPUs and copies on a node

DEVICE_CACHE_SECONDS = 60.0  # st_dev and writer mount answers are looked up again this often
# st_dev -> block device look-ups per scrape (a readlink under /sys/dev/block each): a node's engines sit
# on a few devices, a hundred PVCs at most; only a writer naming new numbers all the time needs more.
MAX_DEVICE_LOOKUPS = 256
# Writers' MOUNT records (overlay layer directories, /dev sources) are walked in the background: a pass
# every LAYER_INTERVAL seconds when there is something to look up, at most MAX_LAYER_WALKS walks and
# LAYER_PASS_SECONDS a pass (the rest wait for the next pass, in the order the scrape asked).
LAYER_INTERVAL = 1.0
MAX_LAYER_WALKS = 64
LAYER_PASS_SECONDS = 2.0
# A file's view (stat, residency) in the background scan is abandoned after this long (its mount then skipped
# for a minute): cachestat answers in microseconds, mincore maps and walks a file of 100 GiB in about a second.
SCAN_FILE_SECONDS = 5.0
SCAN_QUIET_SECONDS = 60.0
SCAN_MAX_STUCK = 4


def _files_of(pattern: str) -> list[str]:
    """The regular files a glob pattern matches, sorted."""
    return [path for path in sorted(glob.glob(pattern)) if os.path.isfile(path)]


def glob_directory(pattern: str) -> str:
    """The directory above a glob's first wildcard: /models/*/x.engine -> /models."""
    fixed = []
    for part in pattern.split("/"):
        if glob.has_magic(part):
            break
        fixed.append(part)
    else:
        fixed = fixed[:-1]  # no wildcard: the file's directory
    return "/".join(fixed) or "/"


@dataclass(frozen=True)
class Target:
    engine: str
    path: str
    dev: tuple[int, int] | None  # the st_dev the process saw; None for files from globs
    ino: int | None
    uids: frozenset[int] = frozenset()  # the writers (spool file owners) that reported it


@dataclass(frozen=True)
class FileView:
    engine: str
    path: str
    from_glob: bool  # named only by --collector.engines.path (no process reports it)
    dev: tuple[int, int] | None
    size: int | None
    mtime: float | None
    cached_bytes: int | None
    unavailable: str | None  # why there is no residency


@dataclass(frozen=True)
class ScanResult:
    files: dict[tuple[str, str], FileView]
    duration: float
    finished: float


LayerKey = tuple[str, str, str]  # a writer mount as far as its device goes: fstype, source, layer directory


def _layer_key(mount: model.WriterMount) -> LayerKey:
    return mount.fstype, mount.source, mount.layer


@dataclass(frozen=True)
class FileDevices:
    """What one scrape knows of where the shown engines' files are: their info records (at most
    MAX_INFOS an engine, the engines in the order they were chosen), the block device of each st_dev
    looked up (None: not looked up yet, this scrape's budget was spent), and the devices the
    background found under writers' own mount records (the last answers)."""

    infos: dict[str, list[model.EngineInfo]]
    numbers: dict[tuple[int, int], DeviceAnswer | None]
    writer_mounts: dict[model.MountKey, model.WriterMount]
    layers: dict[LayerKey, DeviceAnswer]

    def of(self, engine: str, dev: tuple[int, int]) -> tuple[str, tuple[str, ...]]:
        """(device, whole disks) of an engine file on ``dev``: by its st_dev, else by its writer's mount."""
        answer = self.numbers.get(dev)
        if answer is None:
            return "", ()
        if not answer.device:
            mount = self.writer_mounts.get((engine, dev))
            answer = self.layers.get(_layer_key(mount)) if mount is not None else None
        return (answer.device, answer.disks) if answer is not None else ("", ())

    def disks(self, dev: tuple[int, int]) -> tuple[str, ...]:
        """The whole disks under ``dev`` (by st_dev alone), () when not known."""
        answer = self.numbers.get(dev)
        return answer.disks if answer is not None else ()


def cached_figure(totals: model.Totals, view: FileView, scanned: float) -> tuple[int, int, str, float] | None:
    """(file bytes, cached bytes, source, when measured) of an engine file: the exporter's scan where
    it could measure, else what the loading process measured at the end of the engine's latest load
    of that very file (an exporter without CAP_FOWNER cannot measure a file it may not write)."""
    if view.cached_bytes is not None and view.size is not None:
        return view.size, view.cached_bytes, "scan", scanned
    values = totals.waterfalls.get(view.engine)
    slot = spool_format.WATERFALL
    if values is None or values[slot["residency_method"]] <= 0 or values[slot["file_bytes"]] <= 0:
        return None
    infos = totals.infos.get(view.engine, [])
    latest = max(infos, key=lambda item: item.load_time, default=None)
    if latest is None or latest.path != view.path:
        return None
    file_bytes = int(values[slot["file_bytes"]])
    cached = min(file_bytes, int(values[slot["cached_end_bytes"]]))
    return file_bytes, cached, "loader", values[slot["residency_time"]]


class EngineFiles:
    """The engine files' facts and device look-ups: the background scan of the files (``scanner``), the
    scrape's st_dev look-ups and the background walks of writers' mount records (``layers``).

    ``background`` says whether the samplers run on their threads (the collector's start()); where they
    do not (``gpuio engines``, tests), a pass a scrape needs runs on the scrape's thread."""

    def __init__(self, context: Context, globs: tuple[str, ...], max_files: int, path_include: tuple[str, ...],
                 residency_interval: float, infos_left_out: LeftOut, background: Callable[[], bool]) -> None:
        self.context = context
        self.globs = globs
        self.max_files = max_files
        self.path_include = path_include
        self._background = background
        self._infos_left_out = infos_left_out  # the collector's count of info records past MAX_INFOS
        self.scanner: PeriodicSampler[ScanResult] = PeriodicSampler(
            "engine-files", residency_interval, self.scan_files, log)
        self._scan_calls = Abandonable(SCAN_FILE_SECONDS, SCAN_QUIET_SECONDS, SCAN_MAX_STUCK, "engine-file")
        # The files the last scrape showed (the next scan measures them) and the writers' mount records it
        # wanted a device for: handed from the scrape to the samplers' threads under one lock.
        self._targets: dict[tuple[str, str], Target] = {}
        self._targets_lock = threading.Lock()
        self.left_out = LeftOut()  # files past max-files: the background scan's own (another thread)
        self._devices = DeviceNumbers(context.sysfs, context.host_mounts.table, context.rootfs,
                                      ttl=DEVICE_CACHE_SECONDS, budget=MAX_DEVICE_LOOKUPS)
        # The exporter's own mount table, by mount id: what a walk of a writer-named path is judged by.
        self._own_mounts = mounts.MountTableWatch(own=True)
        # Writers' mount records the last scrape wanted a device for (in the order it asked), and the
        # background sampler that walks them (the scrape reads its last answers).
        self._layer_wants: dict[LayerKey, model.WriterMount] = {}
        self.layers: PeriodicSampler[dict[LayerKey, DeviceAnswer]] = PeriodicSampler(
            "engine-layers", LAYER_INTERVAL, self.resolve_layers, log)

    def last_scan(self) -> ScanResult | None:
        """The background scan's last result (None before the first)."""
        return self.scanner.snapshot().value

    def watch(self, targets: dict[tuple[str, str], Target]) -> None:
        """The files of the engines shown now: what the next background scan measures."""
        with self._targets_lock:
            self._targets = targets

    def from_globs(self) -> list[FileView]:
        """The last scan's files that only the globs name (no process reports them)."""
        scan = self.last_scan()
        return [view for view in (scan.files.values() if scan is not None else ()) if view.from_glob]

    def shown_files(self, shown: FileDevices) -> list[tuple[str, str, tuple[int, int]]]:
        """(engine, path, st_dev) of every engine file shown: those live processes load or loaded (the
        info records shown, at most MAX_INFOS an engine), and those only the globs name (from the last
        background scan)."""
        files = [(engine, item.path, item.dev) for engine, items in sorted(shown.infos.items()) for item in items
                 if item.dev != (0, 0)]
        files += [(view.engine, view.path, view.dev) for view in self.from_globs() if view.dev is not None]
        return files

    # --- devices: st_dev on the scrape (bounded), writers' mount records in the background ------------

    def file_devices(self, totals: model.Totals, chosen: list[str], pairs: list[tuple[str, str]]) -> FileDevices:
        """Where the shown engines' files are (see FileDevices), with the scrape's look-ups in the order
        the engines were chosen: each tenant's first engines' files are looked up first."""
        infos = {engine: self._shown_infos(totals, engine) for engine in chosen}
        wanted = [item.dev for items in infos.values() for item in items]
        shown_pairs = set(pairs)
        wanted += [dev for engine, uuid, dev in totals.loads if (engine, uuid) in shown_pairs]
        wanted += [view.dev for view in self.from_globs() if view.dev is not None]
        self._devices.start_round()
        numbers = {dev: self._devices.lookup(dev) for dev in dict.fromkeys(wanted) if dev != (0, 0)}
        self._devices.end_round()
        return FileDevices(infos, numbers, totals.mounts, self._layer_answers(totals, infos, numbers))

    def _shown_infos(self, totals: model.Totals, engine: str) -> list[model.EngineInfo]:
        """At most MAX_INFOS of an engine's info records: those whose file the last scan found as the
        writer reported it first, then the latest loads.  Many writers naming many paths for one
        engine cannot multiply its series."""
        items = totals.infos.get(engine, [])
        if len(items) <= MAX_INFOS:
            return items
        scan = self.last_scan()
        files = scan.files if scan is not None else {}

        def verified(item: model.EngineInfo) -> bool:
            view = files.get((engine, item.path))
            return view is not None and view.size is not None

        ranked = sorted(items, key=lambda item: (not verified(item), -item.load_time, item.path))
        for item in ranked[MAX_INFOS:]:
            self._infos_left_out.add((engine, item.path, item.gpu_uuid, item.runtime))
        return ranked[:MAX_INFOS]

    def _layer_answers(self, totals: model.Totals, infos: dict[str, list[model.EngineInfo]],
                       numbers: dict[tuple[int, int], DeviceAnswer | None]) -> dict[LayerKey, DeviceAnswer]:
        """The background's last answers for the writers' mount records of shown files whose st_dev has
        no block device; those records are handed to it (in this scrape's order) for its next pass.
        Where the samplers do not run (``gpuio engines``, tests), the pass runs here, on this thread."""
        wants: dict[LayerKey, model.WriterMount] = {}
        for engine, items in infos.items():
            for item in items:
                answer = numbers.get(item.dev)
                mount = totals.mounts.get((engine, item.dev))
                if answer is not None and not answer.device and mount is not None:
                    wants.setdefault(_layer_key(mount), mount)
        with self._targets_lock:
            self._layer_wants = wants
        if not self._background():
            self.layers.sample_now()
        return self.layers.snapshot().value or {}

    def resolve_layers(self) -> dict[LayerKey, DeviceAnswer]:
        """One pass of the background sampler ``layers``: the device under each writer mount record the
        last scrape wanted, new ones first (in the scrape's order), then those looked up more than
        DEVICE_CACHE_SECONDS ago; at most MAX_LAYER_WALKS walks and LAYER_PASS_SECONDS.  Records no
        longer wanted are forgotten: the answers are those of what is shown."""
        with self._targets_lock:
            wants = self._layer_wants
        before = self.layers.snapshot().value or {}
        now = time.monotonic()
        answers = {key: before[key] for key in wants if key in before}
        due = [key for key in wants if key not in answers]
        due += sorted((key for key, answer in answers.items() if now - answer.at >= DEVICE_CACHE_SECONDS),
                      key=lambda key: answers[key].at)
        if not due:
            return answers
        table = self._own_mounts.table().by_id()  # once a pass: the exporter's own mounts, by id
        deadline = now + LAYER_PASS_SECONDS
        for key in due[:MAX_LAYER_WALKS]:
            if time.monotonic() >= deadline:
                break
            device, disks = self.device_from_writer(wants[key], table)
            answers[key] = DeviceAnswer(device, tuple(disks), time.monotonic())
        return answers

    def device_from_writer(self, mount: model.WriterMount | None,
                           table: dict[int, mounts.MountPoint] | None = None) -> tuple[str, list[str]]:
        """The block device under a file as its writer's own mountinfo names it, where the exporter's
        view has none (a file inside a container image: overlayfs, whose layer directory is a path of the
        host's filesystem; a PVC's /dev source).  Looked up now, on this thread (the scrape leaves it to
        the ``layers`` sampler).

        The writer's word is never followed by name: the layer directory (or /dev node) is walked under
        --path.rootfs by :func:`mounts.open_without_waiting` -- no symlink, no component on a network,
        FUSE or automount file system, each judged by its mount before it is asked anything -- and only
        the st_dev of the directory it reaches (the st_rdev of the node) is used; a /dev source the walk
        refuses is looked for in sysfs by its name.  ``table``: the exporter's own mounts by id, asked of
        its mount table here when not given."""
        if mount is None:
            return "", []
        table = self._own_mounts.table().by_id() if table is None else table
        paths, devices = self._devices.tables()
        if mount.fstype == "overlay":
            st = self._walked(mount.layer, table)
            if st is None or not stat.S_ISDIR(st.st_mode):
                return "", []
            device = paths.of_dev(os.major(st.st_dev), os.minor(st.st_dev)).device
        elif mount.source.startswith("/dev/") and not {".", ".."} & set(mount.source.split("/")):
            st = self._walked(mount.source, table)
            if st is not None and stat.S_ISBLK(st.st_mode):
                device = device_by_number(self.context.sysfs, os.major(st.st_rdev), os.minor(st.st_rdev)) or ""
            else:
                device = device_named(self.context.sysfs, mount.source) or ""
        else:
            return "", []
        return device, devices.physical(device) if device else []

    def _walked(self, path: str, table: dict[int, mounts.MountPoint]) -> os.stat_result | None:
        """The fstat of a writer-named path walked under --path.rootfs (see device_from_writer); None
        where the walk refused it."""
        try:
            fd, st = mounts.open_without_waiting(self.context.rootfs, path, table)
        except mounts.Refused as refused:
            log.debug("writer mount path not looked at", extra={"path": path, "reason": refused.reason})
            return None
        os.close(fd)
        return st

    def device_of(self, dev: tuple[int, int], look_up: bool = True) -> tuple[str, list[str]]:
        """The block device behind st_dev MAJ:MIN and the whole disks under it: looked up now (for
        ``gpuio engines``), or with ``look_up`` False what the scrapes learned within their budget (see
        file_devices; for the API, whose rows name numbers spool writers chose): ("", []) if nothing."""
        answer = self._devices.resolve(dev) if look_up and dev != (0, 0) else self._devices.known(dev)
        return (answer.device, list(answer.disks)) if answer is not None else ("", [])

    # --- files: background scan ----------------------------------------------------------------

    def scan_files(self) -> ScanResult:
        """Stat and measure residency of every target file (runs on the sampler's thread)."""
        start = time.perf_counter()
        with self._targets_lock:
            targets = dict(self._targets)
        for path in self._glob():
            key = (engine_name(path), path)
            if not any(target.path == path for target in targets.values()):
                targets[key] = Target(key[0], path, None, None)
        files = {key: self._view_abandonable(target) for key, target in targets.items()}
        self.left_out.commit()
        return ScanResult(files, time.perf_counter() - start, time.time())

    def _glob(self) -> list[str]:
        """The files --collector.engines.path's patterns match now; a pattern whose directory does not answer
        (a dead mount) matches nothing this scan, and is not asked again for a minute (_view_abandonable)."""
        found: list[str] = []
        for pattern in self.globs:
            try:
                matched = self._scan_calls.call(glob_directory(pattern), functools.partial(_files_of, pattern))
            except Unresponsive:
                continue
            for path in matched:
                if len(found) >= self.max_files:
                    self.left_out.add(path)
                else:
                    found.append(path)
        return found

    def _view_abandonable(self, target: Target) -> FileView:
        """_view where its wait can be abandoned: any file (a writer's word, a glob's match) may sit on a
        network or FUSE mount that stopped answering, and a stat, an open or a residency call there waits for
        as long as it does.  A file whose view takes longer than SCAN_FILE_SECONDS is "unresponsive_mount",
        and so are the files of its device for a minute (exporter.host.abandonable)."""
        try:
            return self._scan_calls.call(target.dev or target.path, lambda: self._view(target))
        except Unresponsive:
            return FileView(target.engine, target.path, target.dev is None, target.dev, None, None, None,
                            "unresponsive_mount")

    def _view(self, target: Target) -> FileView:
        """Stat and residency of one file.  A file a writer named is opened only as
        :func:`pagecache.open_claimed` allows (another file by that name, say in another mount
        namespace, is "not_visible"); a glob's file is the operator's choice, but a symlink or a
        non-regular file there is not opened either."""
        from_glob = target.dev is None
        try:
            if from_glob:
                fd, st = open_regular(target.path, follow=False)
                try:
                    measured = residency_fd(fd, st, target.path, "auto")
                finally:
                    os.close(fd)
            else:
                claim = Claim(target.path, target.dev or (0, 0), target.ino or 0, target.uids)
                st, measured = residency_of_claim(self.context.rootfs, claim, self.path_include)
        except Unavailable as exc:
            found = exc.st
            if found is None:
                return FileView(target.engine, target.path, from_glob, None, None, None, None, exc.reason)
            dev = (os.major(found.st_dev), os.minor(found.st_dev))
            return FileView(target.engine, target.path, from_glob, dev, found.st_size, found.st_mtime, None,
                            exc.reason)
        dev = (os.major(st.st_dev), os.minor(st.st_dev))
        return FileView(target.engine, target.path, from_glob, dev, measured.size, st.st_mtime,
                        measured.cached_bytes, None)

    def bytes_not_cached(self, totals: model.Totals, engine: str) -> int | None:
        """Bytes of the engine's file not in the page cache now (the most over its files' views), else as
        the loader measured at the end of its latest load; None where neither knows."""
        scan = self.scanner.snapshot()
        views = [view for (name, _), view in (scan.value.files.items() if scan.value is not None else ())
                 if name == engine]
        figures = [figure for view in views
                   if (figure := cached_figure(totals, view, scan.value.finished if scan.value else 0.0))]
        if figures:
            return max(file_bytes - cached for file_bytes, cached, _, _ in figures)
        values = totals.waterfalls.get(engine)  # no file view at all: the loader's own figure
        slot = spool_format.WATERFALL
        if values is not None and values[slot["residency_method"]] > 0 and values[slot["file_bytes"]] > 0:
            return int(max(0.0, values[slot["file_bytes"]] - values[slot["cached_end_bytes"]]))
        return None
