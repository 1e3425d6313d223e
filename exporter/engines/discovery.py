"""Engines served without the library: processes found holding engine and model files open, from /proc.

Most engines in production are loaded by processes that will never import gpuio (Triton Inference
Server, TensorRT-LLM, an LLM server).  The kernel still tells who reads what: /proc/<pid>/fd names each
open file, /proc/<pid>/fdinfo/<fd> its read position and open flags, stat() through the fd link its
file (st_dev, inode, size, whatever the process's mount namespace), /proc/<pid>/io the process's bytes
from the device, /proc/<pid>/cgroup its pod.  :class:`Discovery` looks, in passes on a background
thread, for processes holding a file open for reading whose name matches the model patterns
(MODEL_PATTERNS) under the include directories, *as the process names it* (a container's
``/models/...``), and turns what it sees into the same :class:`exporter.engines.model.Totals` the
spool gives: engine info (file, device, GPU, pod), loads in progress, finished loads (duration, device
and page-cache bytes, class), loads abandoned by processes that died while loading.  Files under 1 MiB
(MIN_MODEL_BYTES) and Python's own (site-packages, dist-packages) are no models.

A load, seen from outside
-------------------------
* It starts when a process opens a model file for reading while the exporter watches (the file is new
  in a process already looked at, or the process itself started after discovery did), or when the read
  position of a file already open moves.  A file found open and still at exporter start-up is not a
  load: a server keeps its files open long after loading them.
* It is in progress while the position moves, and at most ``idle`` seconds without a movement (three
  times that while the process waits on IO, state D: one read held up by a storm).
* It finishes when the file is closed, or at its last movement when it stood ``idle`` seconds: the load
  duration runs from the start to then.  Its bytes are the forward movement of the position, at most what
  the process's reads returned meanwhile (rchar: a seek moves the position without reading) and at most
  the file's size; the share from the device is the process's read_bytes over the same time
  (process-wide: a process reading two models at once splits its device bytes by position), the rest came
  from the page cache.
* It is abandoned when the process is gone before the position reached the end of the file (a pod
  killed by its startup probe while loading: a crash-looping cold start is one per attempt).

A load is all of an engine's files: a checkpoint of 100 shards read one after another (or several at once)
is one load, from the first shard's start to the last one's end, with all their bytes; a shard that starts
within JOIN_SECONDS of the previous one's end continues the load (a pass may fall between two shards), so
the load in progress never ends and starts again between shards.  A process holding many model files is
followed for MAX_FILES_PER_PROCESS at once: a closed file whose load is over makes room for the next.

Loaders that read with ``pread`` do not move the position: their load is seen from the open to the close,
with no bytes.  Loaders that map the file and close its descriptor (safetensors' Rust loader, llama.cpp)
are seen in the maps of processes on a GPU (exporter.engines.mappings): a file mapped anew begins a load,
which moves while the process's device reads grow (process-wide: at most the file's size) and ends when they
stood still ``idle`` seconds, reached the file's size, or the file was unmapped.  A mapping found already
there is no load, as a file found open and still is not.  Each engine's
history of loads (its counters) is kept while a process holds its files and for FORGET_AFTER after;
when MAX_ENGINES histories are kept and none can be forgotten, a new engine's loads are counted as
dropped, never made room for by forgetting another's (a counter never falls), and one owner's
processes make at most MAX_ENGINES_PER_OWNER of them.

Engine names (:func:`engine_identity`): Triton's model repository ``<repo>/<model>/<version>/model.plan``
is engine ``<model>`` version ``<version>``; a generic file name (``model.*``, ``rank0.engine``,
``pytorch_model.bin``, shards ``...-00001-of-00004.safetensors``) takes its directory's name; any other
its file name without the suffix (as the library names an engine by default).

Which GPUs: those NVML lists the process on; a process on several (one Triton server on every GPU) has each
model file placed by exporter.engines.placement (its config.pbtxt, read once a file and process where the
wait can be abandoned, with the process's CUDA_VISIBLE_DEVICES read once from its environ; else the GPUs the
process's NVML memory grew on while it loaded the file, looked for until GROWTH_WAIT after the load; else
all of them), and its engine's info, loads in progress and abandoned loads are on each of those GPUs.  What
is read for that, and when, is exporter.engines.placing's (:class:`~exporter.engines.placing.Placer`); how a
file's load begins and ends, and each engine's history, :class:`LoadBook`'s.

Only inference processes: a process counts once NVML lists it with a GPU context (``gpu_processes``: pid
and start time, so a process that took the pid of one NVML listed is not it), and what it loaded before
that counts from then on; a copy, a checksum or a backup reading model files is
no load.  Never counted twice: a process holding a spool file the engines collector reads (the library's)
is left to the spool (``library_files``).

Bounded, fair, and never on the scrape path (the engines collector serves the last pass).  Each pass looks
first at the processes with GPU contexts, then those new since the last listing, then those followed for
holding model files (every pass, PRIORITY_FD_ENTRIES descriptors in all), then at the rest in turn
(FD_ENTRIES_PER_PASS), all within PASS_SECONDS.  The priority budget is shared fairly among the processes'
owners (uids), and a process's share among its descriptors is taken where its last look stopped, so that no
tenant's processes -- however many, holding however many descriptors -- keep another's from being looked
at: a new loader is seen at the next pass, and a process that was running before opens a model in a round.
The model files a followed process holds are looked at again directly, every pass, whatever its share.
At most MAX_TRACKED_PROCESSES processes are followed, at most a quarter of them per owner while not on a GPU;
a process NVML lists on a GPU takes the place of one that is not.  Nothing read from /proc in the pass itself
takes a process's memory lock (no cmdline): a GPU process's maps (read again only when its device reads grew,
else every MAPS_EVERY) are read where the wait can be abandoned, and no file on a network or FUSE mount is
stat'ed in the pass (exporter.engines.descriptors); a process's stat and io are read where the wait can be abandoned
(a process stuck in execve, closing a file of a hung FUSE daemon, makes them wait: it is skipped, counted as
``unresponsive_process``), so neither a process stuck in the kernel nor a server that does not answer can
hold a pass; a slow pass only ages what the scrape serves, and a pass that stops finishing all the same is
the engines collector's state ``stale``.

What it needs: permission to read other processes' fd directories: root on a host install; in a
container, the host's pid namespace with CAP_SYS_PTRACE and CAP_DAC_READ_SEARCH (docs/engines.md).
Processes it may not look at are counted (``not_permitted``), never guessed at.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
import logging
import os
import re
import stat
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from gpuio import spool as spool_format
from gpuio.waterfall import classify

from ..host import procstat
from ..host.abandonable import Unresponsive, proc_reads
from ..pods import cgroup as pod_cgroup
from . import mappings, model
from .descriptors import MountJudge, abandonable_stats, read_fdinfo
from .followed import EngineLoad, FileKey, HeldFile, OpenFile, Process
from .placing import Placer

log = logging.getLogger("gpuio.discovery")

# The file names of model formats servers load: TensorRT (Triton's model.plan, TensorRT-LLM's rank0.engine),
# ONNX, safetensors, TorchScript (Triton's model.pt), GGUF.  Not *.bin nor *.pth by default: data files and
# Python's own path files take those names too (add them where pytorch_model.bin is what you serve).
MODEL_PATTERNS = ("*.engine", "*.plan", "*.trt", "*.onnx", "*.safetensors", "*.pt", "*.gguf")
MIN_MODEL_BYTES = 1 << 20  # smaller files are no model whose load a disk could hold up (configs, stubs)
PACKAGE_DIRECTORIES = ("/site-packages/", "/dist-packages/")  # Python's own files, not models
IDLE_SECONDS = 10.0  # a load whose position has not moved this long (the process not waiting on IO) is over
PASS_SECONDS = 0.5  # the most one pass spends; the rest waits for the next pass
# Descriptors looked at per pass (a readlink each, ~3.5 us with the rest of a look on a 2-core VM):
# those of the processes followed, with GPU contexts or new (every pass), and those of the others in turn.
PRIORITY_FD_ENTRIES = 16_384
FD_ENTRIES_PER_PASS = 2048  # of the others: ~7 ms a pass, a node of 100k descriptors gone round in ~50 s
MAX_FDS_PER_PROCESS = 4096  # a process's descriptors looked at per pass (a server with 100k sockets)
MAX_LISTED = 1 << 17  # /proc entries looked at per listing (pid_max is 4M at most; a node runs ~10^3)
MIN_FD_SHARE = 64  # descriptors a process of the priority list is looked at per pass, at the least
MAX_TRACKED_PROCESSES = 1024  # processes holding or having loaded model files, kept between passes
MAX_TRACKED_OFF_GPU_PER_OWNER = MAX_TRACKED_PROCESSES // 4  # of one uid's processes without a GPU context
MAX_FILES_PER_PROCESS = 64  # model files one process is followed for at once (open, and loaded since)
MAX_PENDING_PER_PROCESS = 1024  # loads a process ended before NVML listed it (a checkpoint's shards), kept
MAX_ENGINES = 4096  # engines with a history of discovered loads
MAX_ENGINES_PER_OWNER = MAX_ENGINES // 4  # of them, made by one uid's processes
FORGET_AFTER = 3600.0  # a history nobody holds a file of is forgotten after this long without a load
IO_BYTES = 1024
# A file of an engine that starts loading within this of the end of the engine's last file continues that
# load: a checkpoint's shards, opened one after another, are one load (a pass may fall between two shards).
JOIN_SECONDS = 3.0
# A GPU process's maps are read again when its device reads grew since the last look, else after this long.
MAPS_EVERY = 30.0
MAPPED_SLACK = 1 << 20  # a mapped file read to within this of its size is read whole
SPOOL_SUFFIX = spool_format.SUFFIX
_SPOOL_NAME = re.compile(re.escape(spool_format.PREFIX) + r"\d{1,10}-(?P<start>\d{1,20})-[0-9a-f]{16}"
                         + re.escape(spool_format.SUFFIX))
_SHARD = re.compile(r"-\d+-of-\d+$")
_GENERIC = re.compile(r"^(model|pytorch_model|tf_model|weights|engine|rank\d+|consolidated(\.\d+)?)$")
_ACCESS_MODE = 0o3  # O_ACCMODE: fdinfo's flags are octal
_WRITE_ONLY = 0o1


HeldNow = dict[FileKey, "OpenFile"]  # the model files a process holds open now


def engine_identity(path: str) -> tuple[str, str]:
    """(engine, version) a model file's path names (module note); version "" outside Triton's layout."""
    directory, base = os.path.split(path)
    stem = base.split(".", 1)[0] if base.startswith(("model.", "rank")) else os.path.splitext(base)[0]
    parent = os.path.basename(directory)
    if parent.isascii() and parent.isdigit() and stem == "model":
        model = os.path.basename(os.path.dirname(directory))
        if model:
            return model, parent
    if (_GENERIC.match(stem) or _SHARD.search(stem)) and parent:
        return parent, ""
    return stem or base, ""


def pattern_matcher(patterns: Iterable[str]) -> Callable[[str], bool]:
    """A test of a file name against shell patterns (``*.plan``), compiled once."""
    joined = "|".join(fnmatch.translate(pattern) for pattern in patterns)
    compiled = re.compile(joined) if joined else None
    return (lambda name: compiled.match(name) is not None) if compiled else (lambda name: False)


def parse_patterns(value: str) -> tuple[str, ...]:
    patterns = tuple(part.strip() for part in value.split(",") if part.strip())
    if not patterns:
        raise ValueError("no pattern")
    for pattern in patterns:
        if "/" in pattern:
            raise ValueError(f"{pattern!r} names a directory: patterns match file names")
    return patterns


@dataclass
class EngineHistory:
    """What discovered loads of one engine added up to (counters only grow)."""

    owner: int  # the uid of the process whose load made it (one owner makes at most MAX_ENGINES_PER_OWNER)
    engine_values: list[float]  # an ENGINE record's doubles: load_read_seconds, load_read_bytes
    waterfall: list[float]  # a WATERFALL record's doubles
    abandoned: dict[str, float] = field(default_factory=dict)  # GPU uuid -> loads abandoned
    touched: float = 0.0  # monotonic: the last load that ended here (the least recent are forgotten first)


@dataclass(frozen=True)
class PassFigures:
    """What the last pass did, for the engines collector's self-series."""

    processes: int = 0  # processes holding or having loaded model files
    looked_at: int = 0  # processes whose descriptors this pass listed
    not_permitted: int = 0  # processes this pass was refused (cumulative: a counter)
    unfinished: bool = False  # the pass ran out of its budget before the rotation came round
    duration: float = 0.0
    dropped: tuple[tuple[str, int], ...] = ()  # (kind, count): what the bounds left out (cumulative)
    unresponsive_mounts: int = 0  # mounts whose stat did not answer in time, not asked for now


@dataclass(frozen=True)
class Discovered:
    """One pass's answer: the totals to merge with the spool's, and the figures."""

    totals: model.Totals
    figures: PassFigures


def _wall_from_monotonic(moment: float) -> float:
    return time.time() - (time.monotonic() - moment)


class Discovery:
    """Finds processes holding model files and follows their loads; ``sample()`` is one pass."""

    def __init__(self, include: Iterable[str], patterns: Iterable[str] = MODEL_PATTERNS, procfs: str = "/proc",
                 sysfs: str | None = None, gpu_of: Callable[[int, int], str | None] | None = None,
                 gpu_processes: Callable[[], Iterable[tuple[int, int]]] | None = None, idle: float = IDLE_SECONDS,
                 gpus_of: Callable[[int, int], tuple[str, ...]] | None = None,
                 memory_of: Callable[[int, int], dict[str, int]] | None = None,
                 ordered_gpus: Callable[[], tuple[str, ...]] | None = None,
                 fd_entries_per_pass: int = FD_ENTRIES_PER_PASS, require_gpu: bool = True,
                 priority_fd_entries: int = PRIORITY_FD_ENTRIES, join_within: float = JOIN_SECONDS) -> None:
        self.procfs = procfs
        self.sysfs = sysfs  # where the cgroup hierarchy is seen: a pod's cgroup believed only if root owns it
        self.include = tuple(directory.rstrip("/") + "/" for directory in include)
        self._include_bytes = tuple(os.fsencode(directory) for directory in self.include)
        self.matches = pattern_matcher(patterns)
        self.gpu_processes = gpu_processes or (lambda: ())  # (pid, start ticks) with a GPU context (NVML's list)
        self.fd_entries_per_pass = fd_entries_per_pass
        self.priority_fd_entries = priority_fd_entries
        # Only processes with a GPU context load engines: a copy, a checksum or a backup reading model
        # files is no load (and must not make a storm page "hurt serving").
        self.require_gpu = require_gpu
        self._on_gpus: frozenset[tuple[int, int]] = frozenset()  # this pass's NVML list
        self.library_files: frozenset[tuple[int, int]] = frozenset()  # (st_dev, st_ino) of spool files read
        self._tracked: dict[int, Process] = {}  # pid -> process (the start ticks tell a reused pid)
        self._listed: set[int] = set()  # pids of the last listing
        self._rotation: list[int] = []  # pids not looked at yet in this round
        self._started_ticks = self._now_ticks()
        self._not_permitted = 0
        self._refused: set[tuple[int, int]] = set()  # processes that refused us (counted once each)
        self._left_out: set[tuple[int, int]] = set()  # processes not followed for the bounds (counted once each)
        self._cursors: dict[int, int] = {}  # pid -> where the next look at a process not followed starts
        self._past_fd_cap: set[int] = set()  # pids with descriptors past MAX_FDS_PER_PROCESS (counted once each)
        self._past_maps_cap: set[int] = set()  # pids whose maps were longer than mappings.MAPS_BYTES (the same)
        self._maps_reads: dict[int, tuple[int, float, int]] = {}  # pid -> (start ticks, when, read_bytes): last read
        self._dropped: dict[str, int] = {}  # kind -> what the bounds left out (a counter)
        self._mounts = MountJudge(procfs)
        self._remote = abandonable_stats()
        self._proc = proc_reads("discovery-proc")
        self._placer = Placer(procfs, self._proc, self._drop, gpu_of, gpus_of, memory_of, ordered_gpus)
        self._book = LoadBook(self._placer, self._drop, idle, join_within)
        self._lock = threading.Lock()

    # --- one pass ----------------------------------------------------------------------------------

    def sample(self) -> Discovered:
        with self._lock:
            started = time.monotonic()
            deadline = started + PASS_SECONDS
            listed = self._list()
            new = {pid for pid in listed if pid not in self._listed} if self._listed else set()
            if not self._rotation:
                self._rotation = sorted(listed)
            self._on_gpus = frozenset(self.gpu_processes())
            self._mounts.new_pass()
            first = self._priority(listed, new)
            looked = self._look_fairly(first, new, deadline)
            budget = _Budget(self.fd_entries_per_pass, deadline)
            chosen = set(first)
            while self._rotation and budget.left():
                pid = self._rotation.pop()
                if pid in listed and pid not in chosen:
                    looked += self._look_at(pid, budget, new_process=False)
            self._listed = listed
            self._end_pass(listed)
            figures = PassFigures(len(self._tracked), looked, self._not_permitted, bool(self._rotation),
                                  time.monotonic() - started, tuple(sorted(self._dropped.items())),
                                  self._remote.unresponsive())
            return Discovered(self._book.totals(self._tracked.values()), figures)

    def _priority(self, listed: set[int], new: set[int]) -> list[int]:
        """The processes looked at every pass, in order: those NVML lists on a GPU (inference servers), the
        new ones (a server just started), those followed for holding model files."""
        on_gpus = sorted(pid for pid, _ in self._on_gpus if pid in listed)
        return list(dict.fromkeys([*on_gpus, *sorted(new), *self._tracked]))

    def _look_fairly(self, pids: list[int], new: set[int], deadline: float) -> int:
        """Look at ``pids`` with the priority budget shared equally among their owners, and each owner's
        share equally among its processes (at least MIN_FD_SHARE each): one tenant's many processes or
        many descriptors cannot use up the pass."""
        owner_of = {pid: owner for pid in pids if (owner := self._owner(pid)) is not None}
        owned: dict[int, int] = {}  # uid -> how many of its processes are in the list
        for owner in owner_of.values():
            owned[owner] = owned.get(owner, 0) + 1
        per_owner = self.priority_fd_entries // max(1, len(owned))
        looked = 0
        for pid, owner in owner_of.items():
            if time.monotonic() >= deadline:
                self._drop("pass_deadline")
                break
            share = max(MIN_FD_SHARE, per_owner // owned[owner])
            looked += self._look_at(pid, _Budget(share, deadline), new_process=pid in new)
        return looked

    def _owner(self, pid: int) -> int | None:
        known = self._tracked.get(pid)
        if known is not None:
            return known.uid
        try:
            return os.stat(f"{self.procfs}/{pid}").st_uid
        except OSError:
            return None

    def _list(self) -> set[int]:
        pids: set[int] = set()
        try:
            with os.scandir(self.procfs) as entries:
                for count, entry in enumerate(entries):
                    if count >= MAX_LISTED:
                        break
                    name = entry.name
                    if name.isascii() and name.isdigit():
                        pids.add(int(name))
        except OSError as error:
            log.warning("cannot list processes", extra={"path": self.procfs, "err": str(error)})
        return pids

    def _now_ticks(self) -> int:
        """Clock ticks since boot now (the unit of a process's start time in /proc/<pid>/stat)."""
        try:
            with open(os.path.join(self.procfs, "uptime"), "rb") as handle:
                uptime = float(handle.read(64).split()[0])
        except (OSError, ValueError, IndexError):
            return 0
        return int(uptime * os.sysconf("SC_CLK_TCK"))

    def _drop(self, kind: str, count: int = 1) -> None:
        self._dropped[kind] = self._dropped.get(kind, 0) + count

    # --- one process ------------------------------------------------------------------------------

    def _look_at(self, pid: int, budget: _Budget, new_process: bool) -> int:
        """List one process's descriptors and follow its model files; 1 if it was looked at."""
        try:
            facts = self._proc.call(pid, functools.partial(self._facts, pid))
        except Unresponsive:
            self._drop("unresponsive_process")
            return 0
        if facts is None:
            return 0
        start, waiting, uid, chars, device_bytes = facts
        known = self._tracked.get(pid)
        if known is not None and known.start != start:
            self._process_gone(known)  # the pid was reused
            known = None
        held = self._held_files(pid, start, budget, known)
        if isinstance(held, _Library):  # the spool reports it: what was followed of it goes
            if known is not None:
                del self._tracked[pid]
            return 1
        if held is None:
            return 1
        on_gpu = (pid, start) in self._on_gpus or not self.require_gpu
        if on_gpu:
            self._add_mapped(pid, start, held, known, device_bytes)
        if known is None:
            if not held:
                return 1
            if not self._make_room(uid, on_gpu):
                self._leave_out(pid, start)
                return 1
            known = Process(pid, start, uid, pod_cgroup.of_pid(pid, self.procfs, sysfs=self.sysfs))
            fresh = new_process or start >= self._started_ticks
            self._tracked[pid] = known
        else:
            fresh = True  # files new in a process already followed were opened since the last pass
        known.waiting = waiting
        chars_before, device_before = known.chars, known.device_bytes
        known.chars, known.device_bytes = chars, device_bytes
        known.gpus = self._placer.gpus(pid, start)
        if not known.on_gpu and on_gpu:
            known.on_gpu = True
            for settle in known.pending:  # its loads that ended before NVML listed it
                settle()
            known.pending.clear()
        returned, grew = max(0, known.chars - chars_before), max(0, device_bytes - device_before)
        # a mapped file moves by the device reads its faults caused: those that no read() returned (the
        # process's other reads -- its inputs, another model's file -- count in rchar; faults do not)
        self._follow(known, held, fresh, returned, max(0, grew - returned))
        self._placer.place(known, budget.deadline)
        self._book.close_loads(known, time.monotonic())
        return 1

    def _facts(self, pid: int) -> tuple[int, bool, int, int, int] | None:
        """(start ticks, waiting on IO, uid, rchar, read_bytes) of a process; None when it is gone.  Read where
        the wait can be abandoned (self._proc): /proc/<pid>/stat and io wait for a process stuck in execve
        (closing a file on a FUSE mount whose daemon hangs), while its fd/, fdinfo/ and cgroup answer."""
        try:
            fields = procstat.stat_fields(pid, self.procfs)
            start = int(fields[procstat.START_TIME])
            waiting = fields[procstat.STATE] == b"D"
            uid = os.stat(f"{self.procfs}/{pid}").st_uid
        except (OSError, ValueError, IndexError):
            return None
        chars, device_bytes = self._io(pid)
        return start, waiting, uid, chars, device_bytes

    def _make_room(self, uid: int, on_gpu: bool) -> bool:
        """Whether a new process may be followed: within the table, and within its owner's quarter while it
        is not on a GPU; a process on a GPU takes the place of the least recent one that is not."""
        if not on_gpu:
            owned = sum(1 for process in self._tracked.values() if process.uid == uid and not process.on_gpu)
            if owned >= MAX_TRACKED_OFF_GPU_PER_OWNER:
                return False
        if len(self._tracked) < MAX_TRACKED_PROCESSES:
            return True
        # The oldest followed first: a process off the GPU loads nothing that counts yet (its loads wait for
        # NVML to list it), so even one that keeps "loading" (seeking its file) gives way to a GPU process.
        off_gpu = next((process for process in self._tracked.values() if not process.on_gpu), None)
        if not on_gpu or off_gpu is None:
            return False
        del self._tracked[off_gpu.pid]
        self._leave_out(off_gpu.pid, off_gpu.start)
        return True

    def _leave_out(self, pid: int, start: int) -> None:
        """A process not followed: counted once (it is looked at again, and left out again, pass after pass)."""
        if (pid, start) not in self._left_out and len(self._left_out) < MAX_LISTED:
            self._left_out.add((pid, start))
            self._drop("process")

    def _held_files(self, pid: int, start: int, budget: _Budget, known: Process | None) -> HeldNow | _Library | None:
        """The model files the process holds open for reading now; None if it may not be looked at, _LIBRARY
        if it holds a spool file the engines collector reads (the library reports it).

        The files it was known to hold are looked at again by their descriptors; then ``budget`` of its
        descriptors, from where the last look's budget ran out (``fd_cursor``), round and round."""
        found: HeldNow = {}
        again = {held.file.fd: held.file for held in known.files.values() if held.open} if known is not None else {}
        for name, before in again.items():
            if self._add_file(found, pid, name, start, before) is _LIBRARY:
                return _LIBRARY
        try:
            names = self._fd_names(pid, known, budget)
        except PermissionError:
            if (pid, start) not in self._refused and len(self._refused) < MAX_TRACKED_PROCESSES:
                self._refused.add((pid, start))
                self._not_permitted += 1
            return None
        except OSError:
            return None
        for name in names:
            if name not in again and self._add_file(found, pid, name, start) is _LIBRARY:
                return _LIBRARY
        return found

    def _fd_names(self, pid: int, known: Process | None, budget: _Budget) -> list[str]:
        """The descriptors to look at: ``budget`` of them from the process's cursor on (wrapping round)."""
        with os.scandir(f"{self.procfs}/{pid}/fd") as entries:
            names = [entry.name for _, entry in zip(range(MAX_FDS_PER_PROCESS + 1), entries, strict=False)]
        if len(names) > MAX_FDS_PER_PROCESS:  # the rest are never looked at: said, once a process
            del names[MAX_FDS_PER_PROCESS:]
            if pid not in self._past_fd_cap and len(self._past_fd_cap) < MAX_LISTED:
                self._past_fd_cap.add(pid)
                self._drop("descriptors")
        cursor = known.fd_cursor if known is not None else self._cursors.get(pid, 0)
        cursor = cursor if cursor < len(names) else 0
        chosen = []
        for offset in range(len(names)):
            if not budget.spend():
                break
            chosen.append(names[(cursor + offset) % len(names)])
        after = (cursor + len(chosen)) % max(1, len(names))
        if known is not None:
            known.fd_cursor = after
        elif after and len(self._cursors) < MAX_LISTED:  # a process not followed is taken up where it was left
            self._cursors[pid] = after
        else:
            self._cursors.pop(pid, None)
        return chosen

    def _add_mapped(self, pid: int, start: int, held: HeldNow, known: Process | None, device_bytes: int) -> None:
        """The model files a GPU process maps, added to ``held`` (a loader that maps a checkpoint and closes
        its descriptor: the mappings module).  Its maps are read again only when its device reads grew since
        the last read or MAPS_EVERY passed (followed or not: a training job on a GPU holds no model file);
        else the files it mapped at the last read still count."""
        now = time.monotonic()
        last = self._maps_reads.get(pid)
        due = last is None or last[0] != start or last[2] != device_bytes or now - last[1] >= MAPS_EVERY
        read = None
        if due:
            if len(self._maps_reads) < MAX_LISTED:
                self._maps_reads[pid] = (start, now, device_bytes)
            try:
                read = self._proc.call(pid, functools.partial(mappings.read_maps, self.procfs, pid))
            except Unresponsive:
                self._drop("unresponsive_process")
        if read is None:
            for key, file in (known.files.items() if known is not None else ()):
                if file.open and file.file.mapped and len(held) < MAX_FILES_PER_PROCESS:
                    held[key] = _as_mapped(held[key]) if key in held else file.file
            return
        text, more = read
        if more and pid not in self._past_maps_cap and len(self._past_maps_cap) < MAX_LISTED:
            self._past_maps_cap.add(pid)
            self._drop("mappings")
        by_path = {file.path: key for key, file in held.items()}
        for key, found in mappings.mapped_files(text, self._is_model_path, self._include_bytes).items():
            known_key = key if key in held else by_path.get(found.path)
            if known_key is not None:
                # mapped and held open (Python's mmap, numpy.memmap keep a duplicate of the descriptor, whose
                # position never moves): followed as mapped
                held[known_key] = _as_mapped(held[known_key])
                continue
            if found.extent < MIN_MODEL_BYTES or len(held) >= MAX_FILES_PER_PROCESS:
                continue
            held[key] = OpenFile(found.path, found.dev, found.ino, found.extent, 0, 0, mapped=True)

    def _is_model_path(self, target: str) -> bool:
        """A path (as the process names it) under the include directories with a model's file name."""
        return (target.startswith(self.include) and not target.endswith(" (deleted)")
                and self.matches(os.path.basename(target)) and not any(part in target for part in PACKAGE_DIRECTORIES))

    def _add_file(self, found: HeldNow, pid: int, name: str, start: int,
                  before: OpenFile | None = None) -> _Library | None:
        opened = self._model_file(pid, name, start, before)
        if isinstance(opened, _Library):
            return opened
        if isinstance(opened, OpenFile) and len(found) < MAX_FILES_PER_PROCESS:
            found[(opened.dev, opened.ino)] = opened
        return None

    def _model_file(self, pid: int, name: str, start: int, before: OpenFile | None = None
                    ) -> OpenFile | _Library | None:
        """The model file at descriptor ``name``, if it is one; ``before``: what the last look found there."""
        fd_dir = f"{self.procfs}/{pid}/fd"
        try:
            target = os.readlink(f"{fd_dir}/{name}")  # the kernel's name of the file: asks its mount nothing
        except OSError:
            return None
        if target.endswith(SPOOL_SUFFIX):
            return self._spool_file(pid, name, target, start)
        if not self._is_model_path(target):
            return None
        info = read_fdinfo(f"{self.procfs}/{pid}/fdinfo/{name}")
        if info is None or info.flags & _ACCESS_MODE == _WRITE_ONLY:
            return None
        if before is not None and before.path == target and info.inode in (None, before.ino) \
                and not self._mounts.answers_locally(info.mount_id, pid):
            # The same file as at the last look (name and inode): its mount is not asked again.  A mount that
            # stopped answering since does not make a file that is still held look closed.
            return dataclasses.replace(before, position=info.position)
        st = self._stat_held(pid, name, info.mount_id)
        if st is None or not stat.S_ISREG(st.st_mode) or st.st_size < MIN_MODEL_BYTES:
            return None
        return OpenFile(target, (os.major(st.st_dev), os.minor(st.st_dev)), st.st_ino, st.st_size, st.st_mtime_ns,
                        info.position, name)

    def _stat_held(self, pid: int, name: str, mount_id: int | None) -> os.stat_result | None:
        """The file's stat through the descriptor's link (the file itself, in any mount namespace): in the
        pass where its mount answers locally, else where the wait can be abandoned (descriptors module)."""
        link = f"{self.procfs}/{pid}/fd/{name}"
        try:
            if self._mounts.answers_locally(mount_id, pid):
                return os.stat(link)
            return self._remote.call(mount_id, lambda: os.stat(link))
        except Unresponsive:
            self._drop("unresponsive_mount")
        except OSError:
            pass
        return None

    def _spool_file(self, pid: int, name: str, target: str, start: int) -> _Library | None:
        """_LIBRARY for the process's own spool file (named with its start time, which no pid namespace
        changes) or one the engines collector reads; None for any other file."""
        own = _SPOOL_NAME.fullmatch(os.path.basename(target))
        if own is not None and int(own["start"]) == start:
            return _LIBRARY
        if not self.library_files:
            return None
        info = read_fdinfo(f"{self.procfs}/{pid}/fdinfo/{name}")
        st = self._stat_held(pid, name, info.mount_id if info is not None else None)
        return _LIBRARY if st is not None and (st.st_dev, st.st_ino) in self.library_files else None

    def _io(self, pid: int) -> tuple[int, int]:
        """The process's rchar and read_bytes (/proc/<pid>/io): bytes its reads returned, and bytes it caused
        to be fetched from storage."""
        read = procstat.read_bounded(f"{self.procfs}/{pid}/io", IO_BYTES)
        found: dict[str, int] = {}
        for line in read[0].split("\n", 8) if read is not None else ():
            key, _, value = line.partition(":")
            if key in ("rchar", "read_bytes"):
                found[key] = procstat.whole_number(value.strip()) or 0
        return found.get("rchar", 0), found.get("read_bytes", 0)

    # --- loads ------------------------------------------------------------------------------------

    def _follow(self, process: Process, held: HeldNow, fresh: bool, returned: int, grew: int) -> None:
        """Follow the files ``held`` now; ``returned`` is what the process's reads returned since its last
        look (rchar), which bounds how far the positions can have moved by reading (a seek moves them for
        free); ``grew`` what its faults read from the device since (a mapped file's load moves by that alone)."""
        now = time.monotonic()
        # the device reads of the faults, shared among the mapped files loading (a split checkpoint mapped
        # whole and faulted in shard after shard: each is credited its share, not all of it)
        mapped_loading = sum(1 for key, opened in held.items() if opened.mapped and key in process.files
                             and process.files[key].loading_since is not None)
        share = grew // max(1, mapped_loading)
        for key, opened in held.items():
            known = process.files.get(key)
            if known is None:
                known = self._start_following(process, key, opened)
                if known is not None and fresh:
                    self._book.begin(process, known, now, already_read=opened.position)
                continue
            if opened.mapped:
                self._follow_mapped(process, known, opened, share, now)
                continue
            moved = opened.position != known.file.position or not known.open
            if moved and known.loading_since is None:
                self._book.begin_moving(process, known, now)
            known.looked_again = True
            if known.loading_since is not None and opened.position > known.file.position:
                forward = min(opened.position - known.file.position, returned)
                returned -= forward
                known.read_forward = min(known.file.size, known.read_forward + forward)
            if moved:
                known.load_moved_at = now
            known.file, known.open, known.chars_at_look = opened, True, process.chars
        for key, known in process.files.items():
            if key not in held and known.open:
                known.open = False
                if known.loading_since is not None:
                    self._book.finish(process, known, now)
            elif known.open and known.loading_since is not None and self._book.stood_still(process, known, now):
                self._book.finish(process, known, known.load_moved_at)
            elif known.open and known.loading_since is not None and _mapped_read_whole(known):
                self._book.finish(process, known, now)  # the device gave as much as the whole file: read

    def _follow_mapped(self, process: Process, known: HeldFile, opened: OpenFile, grew: int, now: float) -> None:
        """A mapped file: its load begins when it is mapped anew (never for a mapping found already there, as a
        file found open and still is no load) and moves while the process reads from the device (its faults
        reading the file in; process-wide, so at most the file's size)."""
        if not known.open:  # unmapped, then mapped again
            self._book.begin(process, known, now, already_read=0)
        elif known.loading_since is not None and grew:
            known.read_forward = min(known.file.size, known.read_forward + grew)
            known.load_moved_at = now
        known.looked_again = True
        known.file, known.open = opened, True

    def _start_following(self, process: Process, key: FileKey, opened: OpenFile) -> HeldFile | None:
        """A file new in the process, followed from now: room is made by forgetting a closed file whose
        load is over (a checkpoint's shards read one after another); else it is counted as dropped."""
        if len(process.files) >= MAX_FILES_PER_PROCESS:
            done = next((file_key for file_key, held in process.files.items()
                         if not held.open and held.loading_since is None), None)
            if done is None:
                self._drop("file")
                return None
            del process.files[done]
        engine, _ = engine_identity(opened.path)  # Triton's version directory is not served (yet)
        held = process.files[key] = HeldFile(engine, opened, time.time(), process.device_bytes, process.chars,
                                             chars_at_look=process.chars)
        return held

    def _process_gone(self, process: Process) -> None:
        """The process exited (or its pid was taken by another): its loads end, and it is followed no more."""
        self._book.process_gone(process)
        self._tracked.pop(process.pid, None)

    def _end_pass(self, listed: set[int]) -> None:
        for pid, process in list(self._tracked.items()):
            if pid not in listed:
                self._process_gone(process)
            elif not any(held.open for held in process.files.values()) and not process.files:
                del self._tracked[pid]
        self._refused = {key for key in self._refused if key[0] in listed}
        self._left_out = {key for key in self._left_out if key[0] in listed}
        self._cursors = {pid: cursor for pid, cursor in self._cursors.items() if pid in listed}
        self._past_fd_cap &= listed
        self._past_maps_cap &= listed
        self._maps_reads = {pid: last for pid, last in self._maps_reads.items() if pid in listed}
        self._book.note_held(self._tracked.values())


class LoadBook:
    """The loads of the processes discovery follows, from a file's first movement to its engine's load recorded
    (module note: a load, seen from outside), and each engine's history of them: what the answer's totals are
    made of.  Discovery looks and follows the files; this book says when a load begins, moves on and ends."""

    def __init__(self, placer: Placer, drop: Callable[[str], None], idle: float, join_within: float) -> None:
        self.idle = idle
        self.join_within = join_within
        self._placer = placer  # told each load's start and end: it looks where the model's memory went meanwhile
        self._drop = drop
        self._histories: dict[str, EngineHistory] = {}
        self._held_engines: set[str] = set()  # engines some followed process holds a file of (never forgotten)

    def note_held(self, processes: Iterable[Process]) -> None:
        """The engines the processes followed hold a file of now: their histories are never forgotten."""
        self._held_engines = {held.engine for process in processes for held in process.files.values()}

    def stood_still(self, process: Process, held: HeldFile, now: float) -> bool:
        """The load's position has not moved for ``idle`` seconds, or for three times that while the
        process waits on IO (a read held up by a storm; a reader at fixed offsets waits for ever)."""
        still = now - held.load_moved_at
        return still >= (3 * self.idle if process.waiting else self.idle)

    def begin(self, process: Process, held: HeldFile, now: float, already_read: int,
              since: tuple[float, int, int] | None = None) -> None:
        """A file's load begins: now, or ``since`` (wall clock, read_bytes and rchar when it was found), and
        with it its engine's load, unless one is in progress (or ended within JOIN_SECONDS): the next file
        of the same load."""
        held.loading_since, held.device_at_start, held.chars_at_start = since or (
            time.time(), process.device_bytes, process.chars)
        held.loaded_at = held.loading_since
        held.load_moved_at = now
        held.read_forward = held.read_before = max(0, min(already_read, held.file.size))
        self._placer.load_began(process, held)
        load = process.loads.get(held.engine)
        if load is None:
            process.loads[held.engine] = EngineLoad(held.loading_since, held.device_at_start, held.file.dev)
        else:
            load.ended = None
            load.started = min(load.started, held.loading_since)

    def begin_moving(self, process: Process, held: HeldFile, now: float) -> None:
        """A load of a file already open whose position moved.  Moving at the first look after the file
        was found (the exporter started, or the rotation reached the process, mid-read): the load was
        under way when found, so it counts from then with what was read before.  Later: a new read of a
        file held still, from now."""
        if held.looked_again or not held.open:
            self.begin(process, held, now, already_read=0)
            return
        self.begin(process, held, now, already_read=held.file.position,
                   since=(held.sighted, held.device_at_sight, held.chars_at_sight))

    def finish(self, process: Process, held: HeldFile, ended: float) -> None:
        """A file's load ended (closed, or still for ``idle`` seconds): its bytes go to its engine's load,
        which ends with the last of its files (recorded by close_loads)."""
        if held.loading_since is None:
            return
        held.loading_since = None
        self._placer.load_ended(held)
        load = process.loads.get(held.engine)
        if load is None:
            return
        load.done_bytes += self._bytes_read(process, held)
        load.done_sizes[(held.file.dev, held.file.ino)] = held.file.size
        if not any(other.loading_since is not None for other in process.files.values() if other.engine == held.engine):
            load.ended = ended if load.ended is None else max(load.ended, ended)
            load.device_at_end = process.device_bytes

    def close_loads(self, process: Process, now: float, join: float | None = None) -> None:
        """Record the engine loads whose files all finished ``join`` (JOIN_SECONDS) ago: their duration from
        the first file's start to the last one's end, their bytes, and the device's share of them."""
        join = self.join_within if join is None else join
        for engine, load in list(process.loads.items()):
            if load.ended is None or now - load.ended < join:
                continue
            del process.loads[engine]
            started, size = load.started, sum(load.done_sizes.values())
            seconds = max(0.0, _wall_from_monotonic(load.ended) - started)
            read = min(load.done_bytes, size)
            device = min(read, max(0, load.device_at_end - load.device_at_start)) if read else 0
            self._settle(process, functools.partial(self._record_load, process.uid, engine, started, seconds, read,
                                                    device, size))

    def _settle(self, process: Process, settle: Callable[[], None]) -> None:
        if process.on_gpu:
            settle()
        elif len(process.pending) < MAX_PENDING_PER_PROCESS:
            process.pending.append(settle)
        else:
            self._drop("load")

    def _record_load(self, owner: int, engine: str, started: float, seconds: float, read: int, device: int,
                     size: int) -> None:
        history = self._history(engine, owner)
        if history is None:
            return
        values = history.engine_values
        first, total, bounds = spool_format.ENGINE_LAYOUT.histograms["load_read_seconds"]
        values[first + _bucket(bounds, seconds)] += 1.0
        values[total] += seconds
        values[spool_format.ENGINE_LAYOUT.counters["load_read_bytes"]] += read
        self._add_waterfall(history.waterfall, size, started, seconds, read, device)
        history.touched = time.monotonic()

    @staticmethod
    def _bytes_read(process: Process, held: HeldFile) -> int:
        """The file's bytes: the forward movement of the position seen (each step at most what the reads
        returned), and the reads after the last look that saw the file open (before its close), at most
        what the file had left; at most the file's size.  A mapped file's: the device reads seen."""
        if held.file.mapped:
            return held.read_forward
        unseen = max(0, process.chars - held.chars_at_look)
        tail = min(unseen, max(0, held.file.size - held.file.position))
        return min(held.file.size, held.read_forward + tail)

    def _abandon(self, process: Process, engine: str) -> None:
        """The process died while loading the engine: an abandoned load, where it was on a GPU (a tool that
        dies while reading a model file abandoned nothing)."""
        if not process.on_gpu:
            return
        history = self._history(engine, process.uid)
        if history is None:
            return
        for gpu in _engine_gpus(process, engine):
            history.abandoned[gpu] = history.abandoned.get(gpu, 0.0) + 1.0
        history.touched = time.monotonic()

    def _history(self, engine: str, owner: int) -> EngineHistory | None:
        """The engine's history, made if there is room (module note); None, counted, if there is none."""
        history = self._histories.get(engine)
        if history is not None:
            return history
        if sum(1 for kept in self._histories.values() if kept.owner == owner) >= MAX_ENGINES_PER_OWNER:
            self._drop("engine")
            return None
        if len(self._histories) >= MAX_ENGINES and not self._forget_a_history():
            self._drop("engine")
            return None
        history = self._histories[engine] = EngineHistory(owner, [0.0] * spool_format.ENGINE_LAYOUT.size,
                                                          [0.0] * len(spool_format.WATERFALL_SLOTS))
        return history

    def _forget_a_history(self) -> bool:
        """Forget the least recent history that nobody holds a file of and that had no load for FORGET_AFTER:
        its series go (Prometheus marks them stale), they never fall."""
        cutoff = time.monotonic() - FORGET_AFTER
        idle = [(history.touched, engine) for engine, history in self._histories.items()
                if history.touched < cutoff and engine not in self._held_engines]
        if not idle:
            return False
        del self._histories[min(idle)[1]]
        return True

    @staticmethod
    def _add_waterfall(values: list[float], size: int, started: float, seconds: float, read: int,
                       device: int) -> None:
        slot = spool_format.WATERFALL
        load_class = classify(size, device, None) if read else "warm"
        values[slot["seq"]] += 1.0
        values[slot[f"loads_{load_class}"]] += 1.0
        values[slot["phase_read"]] += seconds
        values[slot["device_bytes"]] += device
        values[slot["cache_bytes"]] += read - device
        if load_class == "cold":
            values[slot["cold_device_bytes"]] += device
            values[slot["cold_read_seconds"]] += seconds
        values[slot["last_start"]] = started
        values[slot["last_wall"]] = seconds
        for phase in spool_format.PHASES:
            values[slot[f"last_{phase}"]] = seconds if phase == "read" else 0.0
        values[slot["last_bytes"]] = read
        values[slot["last_device_bytes"]] = device
        values[slot["last_cache_bytes"]] = read - device
        values[slot["last_class"]] = spool_format.LOAD_CLASSES.index(load_class) + 1
        values[slot["file_bytes"]] = size
        values[slot["seq_end"]] = values[slot["seq"]]

    def process_gone(self, process: Process) -> None:
        """Its engine loads end: those whose files were all read to the end (or had finished) are recorded,
        the others abandoned, once an engine."""
        abandoned: set[str] = set()
        for held in process.files.values():
            if held.loading_since is None:
                continue
            if held.file.position >= held.file.size > 0 or _mapped_read_whole(held):
                self.finish(process, held, held.load_moved_at)  # read to the end, then exited
            else:
                held.loading_since = None
                abandoned.add(held.engine)
        for engine in abandoned:
            process.loads.pop(engine, None)
            self._abandon(process, engine)
        self.close_loads(process, time.monotonic(), join=0.0)

    # --- the answer: the histories, and the processes followed now ---------------------------------

    def totals(self, processes: Iterable[Process]) -> model.Totals:
        totals = model.Totals()
        for engine, history in self._histories.items():
            totals.engines[engine] = list(history.engine_values)
            totals.waterfalls[engine] = list(history.waterfall)
            for uuid, count in history.abandoned.items():
                totals.abandoned[(engine, uuid)] = count
        for process in processes:
            if process.on_gpu:
                self._add_process(totals, process)
        return totals

    @staticmethod
    def _add_process(totals: model.Totals, process: Process) -> None:
        engines: set[str] = set()
        for held in process.files.values():
            engine = held.engine
            engines.add(engine)
            totals.engines.setdefault(engine, [0.0] * spool_format.ENGINE_LAYOUT.size)
            file = held.file
            infos = totals.infos.setdefault(engine, [])
            for gpu in held.gpus or ("",):  # a model on several GPUs: one info on each
                info = model.EngineInfo(file.path, -1, gpu, "", file.dev, file.ino, file.size, file.mtime_ns,
                                        held.loaded_at)
                if info not in infos:
                    infos.append(info)
            totals.info_uids.setdefault((engine, held.file.path), set()).add(process.uid)
            if held.loaded_at:
                totals.last_load[engine] = max(totals.last_load.get(engine, 0.0), held.loaded_at)
            if process.pod is not None:
                for gpu in held.gpus or ("",):
                    totals.pods.setdefault((engine, gpu), set()).add(model.PodIdentity(pod_uid=process.pod.pod_uid))
        for engine, load in process.loads.items():  # in progress, or ended less than JOIN_SECONDS ago
            read = load.done_bytes + sum(held.read_forward for held in process.files.values()
                                         if held.engine == engine and held.loading_since is not None)
            for gpu in _engine_gpus(process, engine):  # a load onto several GPUs keeps each of them waiting
                entry = totals.loads.setdefault((engine, gpu, load.dev), [0.0, 0.0, 0.0])
                entry[0] += 1.0
                entry[1] += read
                entry[2] = load.started if entry[2] <= 0 else min(entry[2], load.started)
        for engine in engines:
            totals.processes[engine] = totals.processes.get(engine, 0) + 1
            totals.writers.setdefault(engine, []).append((process.pid, process.start))


def _mapped_read_whole(held: HeldFile) -> bool:
    """A mapped file whose faults read (about) all of it from the device: within MAPPED_SLACK of its size (the
    device reads credited to it are those no read() returned, a bound that may fall short by a few bytes)."""
    return held.file.mapped and held.read_forward >= held.file.size - MAPPED_SLACK


def _as_mapped(opened: OpenFile) -> OpenFile:
    """A file held by a descriptor that is also mapped: mapped while its position has not moved (a reader
    that maps and reads the same file is followed by its reads)."""
    return dataclasses.replace(opened, mapped=True) if opened.position == 0 and not opened.mapped else opened


def _engine_gpus(process: Process, engine: str) -> tuple[str, ...]:
    """The GPUs the process's files of ``engine`` are placed on (("",): none known)."""
    gpus = {gpu: None for held in process.files.values() if held.engine == engine for gpu in held.gpus}
    return tuple(gpus) or ("",)


class _Library:
    """What a look at a process found when it holds the library's spool file: the spool reports it."""


_LIBRARY = _Library()


class _Budget:
    def __init__(self, entries: int, deadline: float) -> None:
        self.entries = entries
        self.deadline = deadline

    def spend(self) -> bool:
        self.entries -= 1
        return self.entries >= 0 and (self.entries % 256 != 0 or time.monotonic() < self.deadline)

    def left(self) -> bool:
        return self.entries > 0 and time.monotonic() < self.deadline


def _bucket(bounds: tuple[float, ...], value: float) -> int:
    for index, bound in enumerate(bounds):
        if value <= bound:
            return index
    return len(bounds)
