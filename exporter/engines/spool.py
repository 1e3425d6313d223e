"""The spool, the source of processes that use the library: read every writer's file, fold the exited
ones, merge the rest into the engine model (:mod:`exporter.engines.model`).

The file format and the writer live in the instrumentation library (:mod:`gpuio.spool`),
which inference processes import; this module is what only the exporter (and ``gpuio engines``)
runs: parsing a file no one trusts, the bounded directory read, folding the totals of exited
processes, and merging everything per engine, per engine and GPU, and per load in progress.

Every writer is untrusted; what this module guarantees whatever they write:

* **A file is its inode, not its name.**  A live file is known by ``(st_dev, st_ino)`` and its
  writer by the header's instance id (another instance in the same inode is another file: the
  inode was freed and reused).  A file under two names (a hard link) is read and counted once; a
  renamed file keeps its totals under its new name; a live file no name shows any more stays live
  while the descriptor kept on it shows the inode still linked somewhere, and is read through it.
  A folded file is remembered by inode and instance while it may still have names, so no other
  name of it is folded again.
* **The exporter deletes only what it folded.**  A dead file's name is removed only while it means
  the inode folded from the descriptor on which this reader holds the writer's lock: the name is
  first moved (one atomic rename) into a directory of the reader's own that no writer can write
  (ReapingDirectory), checked there and unlinked; a file that is not the folded one (a live file a
  writer renamed or swapped onto the name) is moved back, never over another name, and read as what
  it is.  Only where that directory cannot be made is a name checked (fstatat) then unlinked
  (unlinkat), which leaves a writer swapping files in a loop the microseconds in between.
* **Published counters never fall.**  Published = folded totals of exited writers + every live
  file's values.  A live file's values are taken as they are; when a record's counters are lower
  than at the last read, or the record is gone (``used`` cut, a value lowered, NaN or an infinity,
  which end the parse, a key renamed in place), that is the writer's reset of that record: the
  values it had are folded once, like a process that exited, and its new values count from there
  (``spool_errors_total{reason="reset"}``).  A fall is read a second time before it is believed, so
  a read that raced a store cannot fake one.  No NaN, infinity, negative or past-2**53 value is ever
  parsed, so none is published or added.
* **One writer's flood costs only its own series.**  Each file has its own budgets (FileLimits):
  bytes parsed per read, entries kept, distinct engines, distinct devices named by INFO, MOUNT and
  LOAD records, and per engine the error reasons, layers, loads and mounts the library itself would
  write.  Past them, that file's further records are left out (``spool_errors_total
  {reason="over_budget"}``, once per file; ``Totals.records_left_out``) and every other file is
  read in full.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import errno
import fcntl
import functools
import hashlib
import os
import random
import resource
import secrets
import stat
import struct
import threading
import time
import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from gpuio.spool import DEFAULT_FILE_BYTES, GENERATION_OFFSET, HEADER_SIZE, MAGIC, PREFIX, SUFFIX, USED_OFFSET

from .. import procstat
from ..abandonable import Abandonable, Unresponsive
from . import placement
from .fold import Folded, add_counts, not_carried_forward
from .model import MAX_MOUNTS_PER_ENGINE, EngineInfo, InfoIdentity, PodIdentity, Totals, merge_load, per_gpu_values
from .parse import FILE_LIMITS, BadFile, Parsed, instance_of, parse

_T = typing.TypeVar("_T")

# How long a writer's engine stays placed (placement.place) before its config and GPUs are looked at again,
# and how many placements are kept; a config read or an environ read waits this long at most (a model
# repository on a dead network mount, a writer stuck in a page fault), and a writer whose read did not come
# back is not asked again for PLACED_SECONDS.
PLACED_SECONDS = 60.0
MAX_PLACED = 4096
PLACEMENT_READ_SECONDS = 0.2
PLACEMENT_MAX_STUCK = 4


class WriterGpus:
    """The GPUs NVML lists a spool writer on, for a writer that recorded none, and where each of its
    engines is among them.

    ``gpu_of_process`` is what the nvml collector last saw ((pid, start ticks) -> GPU UUID, the start
    time read from this exporter's procfs at its sweep).  A pid counts only when this exporter's procfs
    shows that very process now as well (same start time): a writer in another pid namespace (a pod
    without hostPID) has a pid that means another process here, or none, and NVML reports host pids.

    ``placed`` (issue 41): a writer NVML lists on several GPUs (one server holding every GPU) has each
    engine placed as discovery places a model (exporter.engines.placement): by the Triton config.pbtxt
    beside the engine's file, read in the writer's root, its CUDA ordinals mapped through the writer's
    CUDA_VISIBLE_DEVICES; else on every GPU the writer holds.  Not by memory growth: the library's loads
    are not watched from outside.  Both reads run where the wait can be abandoned; a placement is kept
    PLACED_SECONDS.  Without ``gpus_of_process`` (a tool, a test) a writer is on its one GPU or none.
    """

    def __init__(self, gpu_of_process: Callable[[int, int], str | None], procfs: str = "/proc",
                 gpus_of_process: Callable[[int, int], tuple[str, ...]] | None = None,
                 ordered: Callable[[], tuple[str, ...]] | None = None) -> None:
        self.gpu_of_process = gpu_of_process
        self.procfs = procfs
        self.gpus_of_process = gpus_of_process
        self.ordered = ordered or (lambda: ())
        self.config = placement.ConfigReader(procfs)
        self.reads = Abandonable(PLACEMENT_READ_SECONDS, PLACED_SECONDS, PLACEMENT_MAX_STUCK, "spool-placement",
                                 persistent=True)
        self._same_process: dict[tuple[int, int], bool] = {}  # (pid, start ticks) -> our /proc shows it
        # (pid, start ticks, engine path, GPUs held) -> (GPUs placed on, until when: monotonic)
        self._placed: dict[tuple[int, int, str, tuple[str, ...]], tuple[tuple[str, ...], float]] = {}
        self._visible: dict[tuple[int, int], placement.CudaEnviron] = {}  # a writer's start environment

    def __call__(self, pid: int, start_ticks: int) -> str | None:
        uuid = self.gpu_of_process(pid, start_ticks)
        if uuid is None:
            return None
        return uuid if self.same_process(pid, start_ticks) else None

    def same_process(self, pid: int, start_ticks: int) -> bool:
        """Whether this exporter's procfs shows the writer itself under ``pid`` (same start time)."""
        if start_ticks <= 0:
            return False
        key = (pid, start_ticks)
        same = self._same_process.get(key)
        if same is None:
            if len(self._same_process) > 4096:
                self._same_process.clear()
            same = self._same_process[key] = procstat.start_ticks(pid, self.procfs) == start_ticks
        return same

    def placed(self, pid: int, start_ticks: int, path: str) -> tuple[str, ...]:
        """The GPUs the writer's engine file ``path`` (as the writer names it; "" unknown) is on, in NVML
        index order: () for a writer NVML does not list (or not this very process)."""
        if self.gpus_of_process is None:
            one = self(pid, start_ticks)
            return (one,) if one else ()
        if not self.same_process(pid, start_ticks):
            return ()
        held = self.gpus_of_process(pid, start_ticks)
        if len(held) <= 1 or not path:
            return held
        key = (pid, start_ticks, path, held)
        now = time.monotonic()
        known = self._placed.get(key)
        if known is not None and known[1] > now:
            return known[0]
        config = self._call(("config", pid), functools.partial(self.config, pid, path))
        visible = self._visible_gpus(pid, start_ticks) if config is not None and config.ordinals else None
        gpus = placement.place(config, visible, held)[0]
        if len(self._placed) >= MAX_PLACED:
            self._placed = {k: v for k, v in self._placed.items() if v[1] > now}
            if len(self._placed) >= MAX_PLACED:
                self._placed.clear()
        self._placed[key] = (gpus, now + PLACED_SECONDS)
        return gpus

    def _visible_gpus(self, pid: int, start_ticks: int) -> tuple[str, ...] | None:
        """The UUIDs of the writer's CUDA ordinals; None when they cannot be told (module placement)."""
        ordered = self.ordered()
        if not ordered:
            return None
        key = (pid, start_ticks)
        if key not in self._visible:  # the environment a process started with never changes
            if len(self._visible) > MAX_PLACED:
                self._visible.clear()
            found = self._call(("environ", pid), functools.partial(placement.read_cuda_environ, self.procfs, pid))
            if found is None:
                return None  # unreadable, or no answer in time: asked again at the next placement
            self._visible[key] = found
        environ = self._visible[key]
        return environ.visible(ordered)

    def _call(self, key: tuple[str, int], work: Callable[[], _T]) -> _T | None:
        try:
            return self.reads.call(key, work)
        except (Unresponsive, OSError):
            return None


FileId = tuple[int, int]  # (st_dev, st_ino): which file, whatever names it has


@dataclass
class FileState:
    """What the reader remembers of one live writer's file: one inode, under any number of names."""

    # Which file: its inode, its writer (the header's instance id at the first parse: another instance
    # in the same inode is another file), its owner (the writer, whose view of engine files the exporter
    # checks), the directory it was found in and the pod whose volume that is ("" for the node's spool
    # directory: the file's path says it, the writer cannot choose it).
    file_id: FileId
    instance: int = 0
    uid: int = -1
    directory: str = ""
    pod_uid: str = ""
    # The names (keys) it was found under -> the inode the directory listing gave for each when it was
    # opened (while the listing gives the same, the name still means this file; compared with the
    # listing's, which on overlayfs is not always st_ino).  Empty: no name shows it any more, but the
    # descriptor kept on it shows it still linked (renamed out of the listing): read through that.
    names: dict[str, int] = field(default_factory=dict)
    # What it said at its last full read.  ``digest``: of the bytes ``parsed`` came from (unchanged
    # bytes are not parsed again); ``used``: how many (the reader's memory budget counts them).
    parsed: Parsed | None = None
    digest: bytes = b""
    used: int = 0
    needs_gpu: bool = False  # ``parsed`` has series without a GPU: the merge asks ``gpu_of`` for this writer
    bad_reported: bool = False  # damaged since it was understood: counted once
    over_budget_reported: bool = False  # records left out by its FileLimits: counted once
    # Whether it changed since, cheaply (see SpoolReader._unchanged): a descriptor kept open between
    # reads (up to a cap), the header ``parsed`` came with (the same header again means nothing
    # changed) and when to read the whole file even so (monotonic seconds).
    fd: int | None = None
    header: bytes = b""
    recheck_at: float = 0.0
    visited: int = 0  # the read() that last looked at it: a file under two names is read once a read
    # The pids the kernel's lock table shows holding its lock: which process the header may truthfully
    # name as its writer (None: not known yet, looked up at the next full read).
    lockers: frozenset[int] | None = None


@dataclass(frozen=True)
class FoldedFile:
    """A file whose totals are folded and whose inode may still have names (hard links, a name this
    reader may not delete): found under any of them, it is not counted again."""

    instance: int
    directory: str


# What one reader may spend.  A spool writer is untrusted input: it chooses how big its file claims to
# be, how much of it is "used", how many files it makes and how often it changes them.
# Directory entries looked at per read (spool files or not): a directory of millions of names is walked
# a slice per read, each read going on where the last one stopped (see DirectoryScan), so that a read
# costs the same bounded time however many names a writer makes, and every name gets its turn.
MAX_SCANNED_ENTRIES = 65_536  # of the node's spool directory
# Of the pods' own spool volumes, together, shared evenly among them and at most MAX_POD_DIRECTORY_ENTRIES
# each: a pod that fills its volume with files cannot take the listing from the other pods (a real pod
# has a few processes, one file each).
POD_SCANNED_ENTRIES = 65_536
MAX_POD_DIRECTORY_ENTRIES = 1024
MIN_POD_DIRECTORY_ENTRIES = 64
# Bad files remembered (name and inode: ~150 bytes each), so that each is counted once and not opened
# again; a listing walked a slice per read reaches every name, so without a cap junk names would be.
MAX_BAD_REMEMBERED = 65_536
# Folded files remembered by inode while they may still have names (FoldedFile: ~200 bytes each): a
# dead file's hard links, a dead file this reader may not delete, a live file that vanished while no
# descriptor was kept on it.  Past the cap the oldest is forgotten: a name of it found after that
# would be folded again.
MAX_FOLDED_REMEMBERED = 65_536
# Leftover temporary files (a writer that died before renaming its file) opened per read to see whether
# they may be removed: each costs an open and a lock probe, and a writer can make any number of them.
MAX_SWEPT_TEMPORARY = 32
SCRAPE_READ_BYTES = 16 << 20  # bytes read from spool files per read()
SCRAPE_PARSE_BYTES = 4 << 20  # bytes of changed content parsed per read() (~35 ms per MiB here)
RETAINED_BYTES = 8 << 20  # bytes of live files whose parsed content the reader keeps (~4x in Python objects)
# A real process's file holds a few engines: a few KiB.  Files above this may take only half of
# RETAINED_BYTES, so a few big files cannot keep the small ones out.
SMALL_FILE_BYTES = 64 << 10
# Live files whose descriptors stay open between reads; the others are opened on every read, as a new
# file is.  Only from what the open-file limit leaves above FD_ROOM (the server's connections, up to
# 512, and everything else the exporter opens), and half of that: a low limit keeps none.
MAX_KEPT_FILES = 4096
FD_ROOM = 1024
# A file whose header says nothing changed is still read whole this often (give or take a quarter, so
# that files first seen together do not all come due on one scrape): a writer's word is trusted for
# its own series only, and never for longer than this.
RECHECK_SECONDS = 60.0
_GENERATION = struct.Struct("<d")


def _libc_flock() -> Callable[[int, int], int] | None:
    """libc's flock, called directly: a refused probe then costs a return value, where fcntl.flock
    raises an OSError (about half of what a scrape of unchanged files spends per file)."""
    try:
        flock = ctypes.CDLL(None, use_errno=True).flock
    except (OSError, AttributeError):
        return None
    flock.argtypes, flock.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return typing.cast("Callable[[int, int], int]", flock)


_FLOCK = _libc_flock()
_PROBE = fcntl.LOCK_EX | fcntl.LOCK_NB


def _writer_gone(fd: int) -> bool:
    """Probe the writer's lock: granted means no process holds it, so the writer has exited (and, until
    ``fd`` is closed, this reader holds it: no process can take it meanwhile)."""
    if _FLOCK is not None:
        if _FLOCK(fd, _PROBE) == 0:
            return True
        error = ctypes.get_errno()
        if error in (errno.EWOULDBLOCK, errno.EAGAIN):
            return False
        raise OSError(error, os.strerror(error))
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return False
        raise
    return True


def _libc_renameat2() -> Callable[[int, bytes, int, bytes, int], int] | None:
    """libc's renameat2 (glibc 2.28 and later), for RENAME_NOREPLACE; None where there is none."""
    try:
        function = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return None
    function.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint)
    function.restype = ctypes.c_int
    return typing.cast("Callable[[int, bytes, int, bytes, int], int]", function)


_RENAMEAT2 = _libc_renameat2()
_RENAME_NOREPLACE = 1


class ReapingDirectory:
    """A directory of the reader's own inside the node's spool directory, where the name of a folded file
    is moved before it is removed.

    Checking what a name means and then unlinking it leaves a window between the two calls, and a
    writer who may rename in the spool directory can keep swapping a live file with the dead one
    (renameat2's RENAME_EXCHANGE in a loop wins that window about one time in three): the live file
    would be unlinked.  A rename is atomic, so whatever the name means at that instant arrives here,
    mode 0700 and this reader's own (no writer can put, rename or remove anything in it), and is
    checked where nothing can change it: unlinked if it is the folded file, else moved back, never
    over another name.  Made at the first removal of a read (``.gpuio-reaping-<euid>``; a name taken
    by someone else gets a random one), removed at its end."""

    def __init__(self, spool_fd: int, name: str, fd: int) -> None:
        self.spool_fd = spool_fd  # the node's spool directory
        self.name = name
        self.fd = fd
        self._moved = 0

    @classmethod
    def make(cls, spool_fd: int) -> ReapingDirectory | None:
        """The reaping directory in the spool directory open on ``spool_fd``; None where none can be made."""
        own = f".{PREFIX}reaping-{os.geteuid()}"
        for name in (own, f"{own}-{random.getrandbits(64):016x}"):
            try:
                os.mkdir(name, 0o700, dir_fd=spool_fd)
            except FileExistsError:
                pass  # left by a reader that crashed (used if it is ours), or someone else's name
            except OSError:
                return None
            try:
                fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=spool_fd)
            except OSError:
                continue
            st = os.fstat(fd)
            if st.st_uid == os.geteuid() and not st.st_mode & 0o077:
                reaping = cls(spool_fd, name, fd)
                reaping._empty_leftovers()
                return reaping
            os.close(fd)  # someone else's: never used
        return None

    def remove(self, name: str, file_id: FileId) -> str:
        """Remove ``name`` from the spool directory if it means the folded file ``file_id`` (see
        SpoolReader._remove_name for the outcomes)."""
        self._moved += 1
        held = f"{file_id[1]}-{self._moved}"
        try:
            os.rename(name, held, src_dir_fd=self.spool_fd, dst_dir_fd=self.fd)
        except FileNotFoundError:
            return "gone"
        except OSError:
            return "refused"
        try:
            arrived = os.stat(held, dir_fd=self.fd, follow_symlinks=False)
            if (arrived.st_dev, arrived.st_ino) != file_id:
                self._put_back(held, name)
                return "replaced"
        except OSError:
            return "replaced"  # still here: the next reaping directory made puts it back (_empty_leftovers)
        try:
            os.unlink(held, dir_fd=self.fd)
        except OSError:
            with contextlib.suppress(OSError):
                self._put_back(held, name)
            return "refused"
        return "removed"

    def _put_back(self, held: str, name: str) -> None:
        """Move ``held`` back into the spool directory: under ``name`` unless something took it meanwhile
        (RENAME_NOREPLACE), else under a fresh name no one can have taken.  Files are known by inode: the
        name a live file goes back under changes nothing of what it counts."""
        if _RENAMEAT2 is not None and _RENAMEAT2(self.fd, held.encode(), self.spool_fd, name.encode(),
                                                  _RENAME_NOREPLACE) == 0:
            return
        os.rename(held, f"{PREFIX}restored-{secrets.token_hex(16)}{SUFFIX}", src_dir_fd=self.fd,
                  dst_dir_fd=self.spool_fd)

    def _empty_leftovers(self) -> None:
        """What a reader that crashed mid-removal left here: a dead file is removed, a live one put back."""
        for held in os.listdir(self.fd):
            try:
                fd = os.open(held, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=self.fd)
            except OSError:
                continue
            try:
                if _writer_gone(fd):
                    os.unlink(held, dir_fd=self.fd)
                else:
                    self._put_back(held, f"{PREFIX}restored-{held}{SUFFIX}")
            except OSError:
                pass
            finally:
                os.close(fd)

    def close(self) -> None:
        """Remove the directory (empty now) and close it."""
        with contextlib.suppress(OSError):
            os.rmdir(self.name, dir_fd=self.spool_fd)
        os.close(self.fd)


def _kept_files_cap() -> int:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return MAX_KEPT_FILES if soft == resource.RLIM_INFINITY else max(0, min(MAX_KEPT_FILES, (soft - FD_ROOM) // 2))


class DirectoryScan:
    """One directory's listing, walked a slice per read(): at most ``budget`` entries, the next read going
    on where this one stopped (the directory stream stays open in between), so that a directory of
    millions of names costs each read the same bounded time and every name gets its turn.

    A *pass* is one walk through the whole directory, in one read or over several.  Only a finished pass
    proves that a file is gone (readdir(3) returns every entry that stays in place exactly once per
    pass); until then the files the reader remembers (live, folded, bad) that this read's slice did not
    show stand as they were.  ``seen`` keeps which of those earlier slices of the pass showed."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._stream: typing.Any = None  # os.scandir's iterator, while a pass is under way
        self.finished = False  # the last slice ended the pass
        self.seen: dict[str, int] = {}  # remembered names shown by earlier slices of this pass -> inode
        self.slice_names: list[str] = []  # the spool names of the last slice (the reader fills it in)

    def next_slice(self, budget: int) -> Iterator[os.DirEntry[str]]:
        """The next ``budget`` entries at most (OSError as os.scandir raises it; the pass then starts over)."""
        self.finished = False
        if self._stream is None:
            self._stream = os.scandir(self.path)
            self.seen = {}
        taken = 0
        try:
            for entry in self._stream:
                yield entry
                taken += 1
                if taken >= budget:
                    return
        except OSError:
            self.close()
            raise
        self.close()
        self.finished = True

    def close(self) -> None:
        if self._stream is not None:
            self._stream.close()
            self._stream = None


@dataclass
class ReadBudget:
    """What is left of one read()'s work: bytes read, bytes parsed."""

    read: int
    parse: int


class SpoolReader:
    """Merges a spool directory; keeps the folded totals of exited processes for as long as it runs.

    ``read()`` costs one directory listing plus, per live file, a flock probe and a pread of its
    header on a descriptor kept open: a writer moves the header's generation up after every change,
    so the same header means the same content (and the last merge stands when no file changed).  A
    changed file, a new one, one whose writer does not count generations and, once a minute, every
    file are read whole (open + pread + flock probe); bytes that did not change are not parsed
    again.  A dead file costs that once: it is folded, then deleted (or tombstoned) and never opened
    again.  Files are known by inode (FileState), names only lead to them (see the module docstring).

    Bounded whatever the writers do: one read() looks at ``scan_entries`` directory entries at most (a
    bigger directory is walked over several reads, DirectoryScan); a file is read up to
    ``max_file_bytes`` at most (a bigger one is refused, ``oversized``); one read() reads at most
    SCRAPE_READ_BYTES and parses at most SCRAPE_PARSE_BYTES (files past that keep their last values
    and are read at a later call, live files first, in turn); one file's records are parsed and kept
    within ``file_limits`` (FileLimits); the parsed content kept for live files comes from at most
    RETAINED_BYTES of them; a bad file is counted once for as long as it stays (remembered by name
    and inode).
    """

    def __init__(self, directory: str, max_folded_engines: int = 4096, remove_dead: bool = True,
                 gpu_of: Callable[[int, int], str | None] | None = None,
                 max_file_bytes: int = DEFAULT_FILE_BYTES, procfs: str = "/proc",
                 place_of: Callable[[int, int, str], tuple[str, ...]] | None = None) -> None:
        self.directory = directory
        # Where the kernel's lock table is (<procfs>/locks): it says which process holds a file's lock, so
        # which writer a file's header may truthfully name (see _writer).
        self.procfs = procfs
        # inode -> lock holders, read at most once per read() (None: unreadable this time)
        self._lock_table: dict[int, frozenset[int]] | None = None
        self._lock_table_read = False
        # The GPU of a live writer (pid, start ticks) that did not record one: the exporter asks NVML.
        self.gpu_of = gpu_of
        # Where such a writer's engine file (by the path it names) is among its GPUs (WriterGpus.placed):
        # a writer NVML lists on several GPUs.  Without it, on the one GPU ``gpu_of`` gives, or none.
        self.place_of = place_of
        # (file, engine) -> the GPUs its series without a GPU are placed on, at the last read
        self._placed: dict[tuple[FileId, str], tuple[str, ...]] = {}
        # A tool (gpuio engines) reads without removing: the exporter must still fold what it finds.
        self.remove_dead = remove_dead
        self.max_file_bytes = max_file_bytes
        self.scrape_read_bytes = SCRAPE_READ_BYTES
        self.scrape_parse_bytes = SCRAPE_PARSE_BYTES
        self.retained_bytes = RETAINED_BYTES
        self.recheck_seconds = RECHECK_SECONDS
        self.file_limits = FILE_LIMITS
        # Engines whose folded totals are never forgotten (the exporter's exported engines).
        self.protected: set[str] = set()
        self.errors: dict[str, int] = {}
        self.folded_processes = 0
        self.deferred_files = 0  # at the last read()
        self._live: dict[FileId, FileState] = {}
        self._names: dict[str, FileId] = {}  # name (key) -> the live file it was found to mean
        self._unnamed: set[FileId] = set()  # live files that lost their last name (see _forget_names_gone)
        self._reads = 0  # read() calls so far: FileState.visited
        # Names of folded files left in place (a tool's read, a pod's volume, a refused unlink) -> the
        # listing's inode for the name: skipped unopened while the name lists that inode.
        self._tombstones: dict[str, int] = {}
        self._folded_files: dict[FileId, FoldedFile] = {}  # oldest first, MAX_FOLDED_REMEMBERED at most
        self._directory_fd: int | None = None  # the node's spool directory, open while a read() removes files
        self._reaping: ReapingDirectory | None = None  # made at the first removal of a read, gone at its end
        self._no_reaping = False  # this read could not make one: names are checked, then unlinked
        # name -> inode of files counted as bad; pruned to the names still listed, never cleared
        # wholesale (that re-counted every bad file), so it is as big as the bad files present.
        self._bad: dict[str, int] = {}
        self._listed: dict[str, int] = {}  # name -> inode, from the last listing (readdir's d_ino: no stat)
        self._scans: dict[str, DirectoryScan] = {}  # directory -> its listing, a slice per read
        self.scan_entries = MAX_SCANNED_ENTRIES
        self._resume_at = ""  # the first file the last read() had no budget for: the next one starts there
        self._waiting: set[str] = set()  # the files the last read() had no budget for: the next one reads them first
        self._budget = ReadBudget(0, 0)
        self._deferred_now = 0
        self.unfinished_listings = 0  # at the last read(): directories whose pass goes on at the next
        self._sweeps_left = 0
        self._left_out_directories: set[str] = set()  # pod directories that exist but the scan left out
        self._retained = {False: 0, True: 0}
        self.folded = Folded(max_folded_engines)  # exited writers' totals, and live writers' resets
        self._gpu_seen: dict[tuple[int, str], str] = {}  # (writer instance, engine) -> GPU at the last read
        self._lock = threading.Lock()  # a scrape and a tool may read at the same time
        self._kept_cap = _kept_files_cap()
        self._kept = 0  # descriptors held open by live FileStates
        self._now = 0.0  # time.monotonic() at the start of this read
        # Moves whenever what _merge() reads changes (a live file parsed anew, added, folded, forgotten):
        # the same version and the same GPU answers give the same merge, which is then reused.
        self._version = 0
        self._merged: tuple[tuple[object, ...], Totals] | None = None
        # Spool directories found in pods' volumes (exporter.pods.kubelet): directory -> pod UID.  Their
        # files are keyed by absolute path (the main directory's by name), read with the same budgets,
        # and never deleted (the volume is the pod's, mounted read-only): folded, then tombstoned.
        self.pod_directories: dict[str, str] = {}

    def live_file_ids(self) -> frozenset[FileId]:
        """(st_dev, st_ino) of the live spool files read: their processes report through the library."""
        return frozenset(self._live)

    def set_pod_directories(self, directories: dict[str, str]) -> None:
        """Replace the discovered directories (directory -> pod UID); files of one no longer listed
        are folded at the next read, as files that vanished, once the directory is gone (while it
        exists, the scan only left it out: see _list)."""
        if directories != self.pod_directories:
            self._version += 1  # the files read change: the last merge may not be reused
        self.pod_directories = dict(directories)

    def close(self) -> None:
        """Close the descriptors kept open (the reader stays usable: it opens them again)."""
        with self._lock:
            for state in self._live.values():
                self._close_kept(state)
            for scan in self._scans.values():
                scan.close()
            self._scans.clear()
            self._close_directory()

    def __del__(self) -> None:
        for state in getattr(self, "_live", {}).values():
            if state.fd is not None:
                with contextlib.suppress(OSError):
                    os.close(state.fd)
                state.fd = None
        for scan in getattr(self, "_scans", {}).values():
            scan.close()

    # --- the directory -------------------------------------------------------------------------

    def read(self) -> Totals:
        """Everything merged now.  The Totals may be the one an earlier read returned (nothing changed
        since): callers read it and never modify it."""
        with self._lock:
            self._now = time.monotonic()
            self._reads += 1
            names = self._list()
            if names is None:
                self._place_writers()
                return self._with_owners(self._merge())
            self._start_budgets()
            try:
                self._visit_all(names)
                self._forget_names_gone(names)
                self._visit_unnamed()
            finally:
                self._close_directory()
            self._note_seen()
            self._bound_folded()  # once per read, not per fold: a thousand folds would sort a thousand times
            return self._merged_totals()

    def _start_budgets(self) -> None:
        """This read's budgets: bytes read, bytes parsed, and the memory the parsed content of live files
        already takes (small and big files apart)."""
        self._budget = ReadBudget(self.scrape_read_bytes, self.scrape_parse_bytes)
        self._lock_table_read = False
        self._retained = {False: 0, True: 0}
        for state in self._live.values():
            self._retained[state.used > SMALL_FILE_BYTES] += state.used
        self._deferred_now = 0

    def _visit_all(self, names: set[str]) -> None:
        """Every file listed, in turn, while the budgets last: an unchanged live file settled here (a
        lock probe and a header read), everything else visited in full; a live file is looked at once,
        under whichever of its names comes first.  The loop a thousand idle writers cost: names bound once."""
        live, named, listed, bad, tombstones = self._live, self._names, self._listed, self._bad, self._tombstones
        budget, unchanged, now, first_deferred, deferred = self._budget, self._unchanged, self._reads, "", 0
        waiting: set[str] = set()
        for name in self._visit_order(names):
            shown = listed.get(name)
            if tombstones.get(name, -1) == shown or bad.get(name, -1) == shown:
                continue  # folded already, or known bad, and not replaced: not even opened
            known = live.get(named[name]) if name in named else None
            if known is not None and known.names.get(name) == shown:  # the name still means this file
                if known.visited == now:
                    continue  # looked at already this read, under another name
                if budget.read > 0 and budget.parse > 0 and known.fd is not None and unchanged(known, known.fd):
                    continue
            if budget.read <= 0 or budget.parse <= 0:
                deferred += 1
                first_deferred = first_deferred or name
                waiting.add(name)
                continue
            deferred_before = self._deferred_now
            self._visit(name)
            if self._deferred_now > deferred_before:  # too big for what was left: its turn comes first next time
                first_deferred = first_deferred or name
                waiting.add(name)
        self._resume_at = first_deferred
        self._waiting = waiting
        self.deferred_files = deferred + self._deferred_now

    def _visit_unnamed(self) -> None:
        """Live files no name shows any more whose kept descriptor shows them still linked (renamed out of
        the listing, or into a part of it not reached yet): read through that descriptor, as any live file."""
        for state in [self._live[file_id] for file_id in self._unnamed if file_id in self._live]:
            fd = state.fd
            if (fd is None or state.visited == self._reads or self._budget.read <= 0 or self._budget.parse <= 0
                    or self._unchanged(state, fd)):
                continue
            self._take_kept(state)
            self._visit_descriptor(None, fd)

    def _forget_names_gone(self, names: set[str]) -> None:
        """After the visits: a name this read's listing no longer shows stops meaning its file.  A live file
        left with no name is gone (folded as vanished), unless the descriptor kept on it shows its inode
        still linked somewhere: renamed, it stays live (read through that descriptor) and keeps its totals."""
        for name in self._names.keys() - names:
            self._unname(name)
        for file_id in list(self._unnamed):
            state = self._live.get(file_id)
            if state is None or state.names:
                self._unnamed.discard(file_id)  # folded since, or found under another name
            elif not self._still_linked(state):
                self._vanished(state)

    def _merged_totals(self) -> Totals:
        """The merge, reused while no file changed and NVML places the writers that recorded no GPU
        where it did (the only input of the merge that is not in the files)."""
        key = (self._version, self._place_writers())
        if self._merged is None or self._merged[0] != key:
            self._merged = (key, self._with_owners(self._merge()))
        return dataclasses.replace(self._merged[1], deferred_files=self.deferred_files,
                                   unfinished_listings=self.unfinished_listings)

    def _visit_order(self, names: set[str]) -> list[str]:
        """The files the last read() had no budget for first, live or not (so that live files changing at
        every read cannot keep a new writer waiting for ever), then the other live files (their values
        go stale when skipped), then the rest; each group in name order, starting at the first file the
        last read() had no budget left for, so all get their turn."""
        def turn(group: list[str]) -> list[str]:
            group.sort()
            after = [name for name in group if name >= self._resume_at]
            return after + group[: len(group) - len(after)]
        waiting, named = self._waiting, self._names
        return (turn([n for n in names if n in waiting]) + turn([n for n in names if n in named and n not in waiting])
                + turn([n for n in names if n not in named and n not in waiting]))

    def _with_owners(self, totals: Totals) -> Totals:
        """Which writers (file owners) report each engine path: the exporter opens an engine file only
        where one of them could have read it."""
        for state in self._live.values():
            if state.parsed is not None:
                for engine, info in state.parsed.infos.items():
                    totals.info_uids.setdefault((engine, info.path), set()).add(state.uid)
        totals.deferred_files = self.deferred_files
        totals.unfinished_listings = self.unfinished_listings
        return totals

    def _list(self) -> set[str] | None:
        """The spool files of this read: the main directory's (by name) and the pod directories' (by
        absolute path), each directory's next slice (see DirectoryScan) plus its live files; None when
        the main directory is missing or unreadable and no pod directory is known."""
        self.unfinished_listings = 0
        self._sweeps_left = MAX_SWEPT_TEMPORARY
        names: set[str] = set()
        listed: dict[str, int] = {}
        found = self._list_one(self.directory, "", names, listed, self.scan_entries)
        if not found and not self.pod_directories and not any(map(os.path.isabs, self._names)):
            return None  # nothing to list; a pod directory gone last has its files vanish below
        if not found:  # the main directory's files keep their last values, as they did alone
            self._carry(self.directory, names, listed)
        share = max(MIN_POD_DIRECTORY_ENTRIES, POD_SCANNED_ENTRIES // max(1, len(self.pod_directories)))
        for directory in sorted(self.pod_directories):
            if self._list_one(directory, directory, names, listed, min(MAX_POD_DIRECTORY_ENTRIES, share)) is None:
                self._carry(directory, names, listed)  # unreadable now: not proof that the pod is gone
        # A pod directory the scan no longer hands over (past --collector.engines.max-pod-spools) that
        # still exists: its pod is not gone.  Its live files are read on and its tombstones kept, so that
        # it is neither folded now nor counted a second time when the scan takes it back.
        known = {os.path.dirname(key) for key in (*self._names, *self._tombstones) if os.path.isabs(key)}
        self._left_out_directories = {directory for directory in known - self.pod_directories.keys()
                                      if _real_directory(directory)}
        for directory in sorted(self._left_out_directories):
            self._carry(directory, names, listed)
        self._forget_unread_directories()
        self._listed = listed
        return names

    def _list_one(self, directory: str, prefix: str, names: set[str], listed: dict[str, int],
                  budget: int) -> bool | None:
        """Add the spool files of one directory's next slice of at most ``budget`` entries to ``names``
        (keyed by ``prefix``/name), and its live files the slice did not show while its pass goes on;
        False when it does not exist (any file of it listed before has vanished), None when it could
        not be read."""
        scan = self._scans.get(directory)
        if scan is None:
            scan = self._scans[directory] = DirectoryScan(directory)
        taken: list[str] = []
        scan.slice_names = taken
        try:
            for entry in scan.next_slice(budget):
                name = entry.name
                if name.endswith(SUFFIX) and not name.startswith("."):
                    key = os.path.join(prefix, name) if prefix else name
                    taken.append(key)
                    names.add(key)
                    listed[key] = entry.inode()
                elif (not prefix and self._sweeps_left > 0 and name.startswith(f".{PREFIX}")
                      and name.endswith(".tmp")):  # a pod's volume is the pod's: never swept
                    self._sweeps_left -= 1
                    self._sweep_temporary(name)
        except FileNotFoundError:
            del self._scans[directory]
            return False
        except OSError:
            del self._scans[directory]
            self._count("io")
            return None
        if scan.finished:
            self._end_of_pass(scan, names, listed)
        else:
            self.unfinished_listings += 1
            self._carry(directory, names, listed)  # not reached yet this pass: as last seen
        return True

    def _end_of_pass(self, scan: DirectoryScan, names: set[str], listed: dict[str, int]) -> None:
        """A directory walked through: a file it remembers that the pass showed is still there; one it
        did not show is gone (a live file's name is forgotten after the visits: read() folds a file left
        with no name; a tombstone or a bad file is forgotten: a file put under that name later is a new file)."""
        directory = scan.path
        for key, ino in scan.seen.items():  # shown by an earlier slice of the pass
            if key in self._names:
                names.add(key)
                listed[key] = ino
        if self._tombstones:
            self._tombstones = {key: ino for key, ino in self._tombstones.items()
                                if listed.get(key, scan.seen.get(key)) == ino or self._directory_of(key) != directory}
        if self._bad:
            self._bad = {key: ino for key, ino in self._bad.items()
                         if listed.get(key, scan.seen.get(key)) == ino or self._directory_of(key) != directory}
        scan.seen = {}

    def _note_seen(self) -> None:
        """After the visits of a read: which files the reader remembers (live, folded, bad) the slices of
        passes still under way showed, for the end of their pass."""
        for scan in self._scans.values():
            if not scan.finished:
                for key in scan.slice_names:
                    if key in self._names or key in self._tombstones or key in self._bad:
                        scan.seen[key] = self._listed.get(key, 0)
                scan.slice_names = []

    def _forget_unread_directories(self) -> None:
        """Directories no longer read (a pod gone, or its directory gone while left out by the scan):
        their listings are closed, their tombstones, bad files and folded files forgotten.  The node's
        directory is always read, and a left-out pod directory is carried."""
        kept = {self.directory, *self.pod_directories, *self._left_out_directories}
        for directory in [directory for directory in self._scans if directory not in kept]:
            self._scans.pop(directory).close()
        if any(self._directory_of(key) not in kept for key in self._tombstones):
            self._tombstones = {key: ino for key, ino in self._tombstones.items() if self._directory_of(key) in kept}
        if any(self._directory_of(key) not in kept for key in self._bad):
            self._bad = {key: ino for key, ino in self._bad.items() if self._directory_of(key) in kept}
        if any(folded.directory not in kept for folded in self._folded_files.values()):
            self._folded_files = {file_id: folded for file_id, folded in self._folded_files.items()
                                  if folded.directory in kept}

    def _carry(self, directory: str, names: set[str], listed: dict[str, int]) -> None:
        """Keep the live files of a directory that could not be listed, or whose listing has not reached
        them yet, as last seen."""
        for key in self._names:
            if key not in names and self._directory_of(key) == directory:
                names.add(key)
                listed[key] = self._listed.get(key, 0)

    def _directory_of(self, key: str) -> str:
        return os.path.dirname(key) if os.path.isabs(key) else self.directory

    def _sweep_temporary(self, name: str) -> None:
        """A writer that died between creating its file and renaming it leaves a dot-file: remove it."""
        with self._opened(os.path.join(self.directory, name)) as fd:
            if fd is None or not self.remove_dead:
                return
            st = os.fstat(fd)
            if time.time() - st.st_mtime > 60 and _writer_gone(fd):
                self._remove_name(name, (st.st_dev, st.st_ino))

    @contextlib.contextmanager
    def _opened(self, path: str) -> Iterator[int | None]:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError:
            yield None
            return
        try:
            yield fd
        finally:
            os.close(fd)

    def _visit(self, name: str) -> None:
        """Open ``name`` and read the file it means now (the descriptor kept on its file while the listing
        shows the name with the same inode as when it was opened)."""
        known = self._live.get(self._names[name]) if name in self._names else None
        fd = None
        if known is not None and known.names.get(name) == self._listed.get(name):
            fd = self._take_kept(known)
        if fd is None:
            try:
                fd = os.open(os.path.join(self.directory, name),
                             os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
            except FileNotFoundError:
                return  # gone since the listing: the end of the read forgets the name
            except OSError:
                self._count_bad(name, "io")
                return
        self._visit_descriptor(name, fd)

    def _visit_descriptor(self, name: str | None, fd: int) -> None:
        """Read the file open on ``fd`` (``name``: where it was found; None: through a kept descriptor),
        then keep ``fd`` open for its live state, or close it (which also drops a lock the probe took)."""
        live = None
        try:
            live = self._visit_open(name, fd)
        finally:
            if live is not None and live.fd is None and self._kept < self._kept_cap:
                self._keep(live, fd)  # the state of this very file (_visit_open found it from this fd)
            else:
                os.close(fd)

    # --- descriptors kept open; files that did not change ---------------------------------------------

    def _take_kept(self, state: FileState) -> int | None:
        fd, state.fd = state.fd, None
        if fd is not None:
            self._kept -= 1
        return fd

    def _keep(self, state: FileState, fd: int) -> None:
        state.fd = fd
        self._kept += 1

    def _close_kept(self, state: FileState) -> None:
        fd = self._take_kept(state)
        if fd is not None:
            os.close(fd)

    def _unchanged(self, state: FileState, fd: int) -> bool:
        """Whether a live file is as it was at its last full read: writer alive, the same header (used
        bytes, drops, a counted generation), not yet due for a full read (the caller checked that its
        name still lists the same inode).  The scrape of a thousand unchanged files is a thousand of
        these: two syscalls, little else."""
        if not state.header or self._now >= state.recheck_at:
            return False
        if _FLOCK is None or _FLOCK(fd, _PROBE) == 0:
            return False  # gone, or no cheap probe: the full read decides (a lock we got is ours until fd closes)
        try:
            header = os.pread(fd, HEADER_SIZE, 0)
        except OSError:
            return False
        self._budget.read -= HEADER_SIZE
        if header != state.header:
            return False
        state.visited = self._reads
        return True

    def _remember_header(self, state: FileState, data: bytes) -> None:
        """The header of the content ``state.parsed`` stands for (read in the same pread, before it).
        A writer that does not count generations (0) leaves none: its file is read whole every time."""
        counted = len(data) >= HEADER_SIZE and _GENERATION.unpack_from(data, GENERATION_OFFSET)[0] != 0
        state.header = data[:HEADER_SIZE] if counted else b""
        state.recheck_at = self._now + self.recheck_seconds * random.uniform(0.75, 1.25)

    # --- names and inodes ----------------------------------------------------------------------------

    def _make_live(self, name: str | None, state: FileState) -> FileState:
        """``state`` is a live file, found under ``name`` (None: through its kept descriptor)."""
        if name is not None:
            if self._names.get(name) != state.file_id:
                self._unname(name)
                self._names[name] = state.file_id
            state.names[name] = self._listed.get(name, 0)
            self._unnamed.discard(state.file_id)
        if self._live.get(state.file_id) is not state:
            self._live[state.file_id] = state
            self._version += 1
        return state

    def _unname(self, name: str) -> None:
        """``name`` no longer means the live file it meant (its other names still do)."""
        file_id = self._names.pop(name, None)
        state = self._live.get(file_id) if file_id is not None else None
        if state is not None:
            state.names.pop(name, None)
            if not state.names:
                self._unnamed.add(state.file_id)

    def _retire(self, state: FileState) -> None:
        """``state`` is no longer a live file: out of the live files, its names forgotten, its kept
        descriptor closed."""
        if self._live.get(state.file_id) is state:
            del self._live[state.file_id]
        for name in state.names:
            if self._names.get(name) == state.file_id:
                del self._names[name]
        state.names = {}
        self._unnamed.discard(state.file_id)
        self._close_kept(state)
        self._version += 1

    @staticmethod
    def _still_linked(state: FileState) -> bool:
        """Whether the descriptor kept on a live file shows its inode still has a name somewhere."""
        if state.fd is None:
            return False
        try:
            return os.fstat(state.fd).st_nlink > 0
        except OSError:
            return False

    def _already_folded(self, file_id: FileId, fd: int) -> FoldedFile | None:
        """The folded file that the one open on ``fd`` is (same inode, same writer instance): another name
        of it (a hard link, a rename), which must not count again; None: a file not folded before."""
        folded = self._folded_files.get(file_id)
        if folded is None:
            return None
        try:
            header = os.pread(fd, HEADER_SIZE, 0)
        except OSError:
            return folded  # unreadable: not counted, rather than perhaps counted twice
        self._budget.read -= HEADER_SIZE
        if instance_of(header) == folded.instance:
            return folded
        del self._folded_files[file_id]  # the inode was freed and is another file's now
        return None

    def _remember_folded(self, file_id: FileId, folded: FoldedFile) -> None:
        self._folded_files.pop(file_id, None)  # the newest last: the oldest is forgotten first
        self._folded_files[file_id] = folded
        if len(self._folded_files) > MAX_FOLDED_REMEMBERED:
            del self._folded_files[next(iter(self._folded_files))]

    # --- reading one file ----------------------------------------------------------------------------

    def _visit_open(self, name: str | None, fd: int) -> FileState | None:
        """Read a file whole: parse what changed, fold it if its writer is gone, else keep it live.
        Returns its live state (None: not a live file)."""
        st = os.fstat(fd)
        file_id = (st.st_dev, st.st_ino)
        if name is not None and self._names.get(name, file_id) != file_id:
            self._unname(name)  # replaced under this name: the file it meant keeps its other names
        if not stat.S_ISREG(st.st_mode):
            self._count_bad(name, "garbage")
            return None
        state = self._live.get(file_id)
        if state is not None and state.visited == self._reads:
            return self._make_live(name, state)  # read already this time, under another name
        try:
            gone = _writer_gone(fd)
        except OSError:
            gone = False
        folded = self._already_folded(file_id, fd) if state is None else None
        if folded is not None:
            # Never counted again.  Removed (or tombstoned) once its writer is gone; while some process
            # holds its lock (a renamed live file folded as vanished), left alone and looked at again.
            if gone:
                self._dispose(name, fd, file_id, folded)
            return None
        # Sparse or not, a file is never read past what a writer makes.
        data = "oversized" if st.st_size > self.max_file_bytes else self._read_bounded(
            fd, state.used if state else 0, None if gone or state is not None else self._fits_new)
        if data is None:
            return None  # a new file for which there is no room now: it waits (counted in deferred_files)
        if isinstance(data, str):
            if state is None or state.parsed is None:
                self._count_bad(name, data)
                return None
            self._count_damaged(state, data)
            return self._keep_last_good(name, fd, state, gone)
        if state is None:
            directory = self._directory_of(name) if name is not None else self.directory
            state = FileState(file_id, uid=st.st_uid, directory=directory,
                              pod_uid=self.pod_directories.get(directory, ""))
        return self._visit_content(name, fd, state, data, gone)

    def _visit_content(self, name: str | None, fd: int, state: FileState, data: bytes, gone: bool) -> FileState | None:
        """_visit_open, once the file's bytes are read: take them into ``state`` if they fit this read,
        then fold the file (its writer is gone) or keep it live."""
        state.visited = self._reads
        digest = hashlib.blake2b(data, digest_size=16).digest()
        if not self._affordable(state, data, digest, gone):
            # Keeps its last values (if any); parsed again when there is room.
            return self._make_live(name, state) if state.parsed is not None else None
        taken = self._take_content(state, fd, data, digest, name)
        if taken is None:
            # Never understood: not ours to fold or delete (a foreign version's file, garbage); it stays,
            # counted once.  Understood before: see _keep_last_good.
            return self._keep_last_good(name, fd, state, gone)
        self._remember_header(state, taken)
        if gone:
            self._fold_dead(name, fd, state)
            return None
        if state.lockers is None:
            state.lockers = self._lockers(state.file_id[1])
            if state.lockers is not None:
                self._version += 1  # the writer the merge names may change, with the same bytes
        return self._make_live(name, state)

    def _keep_last_good(self, name: str | None, fd: int, state: FileState, gone: bool) -> FileState | None:
        """A file understood before and not now (truncated or scribbled on by someone, unreadable): its
        last good content stands, and is what is folded once the writer is gone."""
        if state.parsed is None:
            return None
        if gone:
            self._fold_dead(name, fd, state)
            return None
        return self._make_live(name, state)

    def _take_content(self, state: FileState, fd: int, data: bytes, digest: bytes, name: str | None) -> bytes | None:
        """Make ``data`` the content ``state`` stands for: parsed if it changed, and what of the last
        content it does not carry forward folded (see _take).  A fall is read once more before it is
        believed: a read racing a store, on a copy routine that does not move 8 bytes at once, could see
        a torn double, and no honest writer's value ever goes down.  Returns the bytes taken (None: they
        could not be parsed, and nothing changed)."""
        if digest == state.digest and state.parsed is not None:
            return data
        parsed = self._parse(state, data, name)
        if parsed is None:
            return None
        fallen = not_carried_forward(state.parsed, parsed)
        if fallen is not None:
            again = self._read_bounded(fd, len(data))
            if isinstance(again, bytes):
                self._budget.parse -= min(len(again), self.file_limits.parse_bytes)
                reparsed = self._parse(state, again, name)
                if reparsed is not None:
                    parsed, data = reparsed, again
                    digest = hashlib.blake2b(data, digest_size=16).digest()
                    fallen = not_carried_forward(state.parsed, parsed)
        self._take(state, parsed, data, digest, fallen)
        return data

    def _take(self, state: FileState, parsed: Parsed, data: bytes, digest: bytes, fallen: Parsed | None) -> None:
        """``parsed`` is what ``state`` says from now on.  What the last content had and this one does not
        carry forward (``fallen``) is folded first, so that what is published (folded + live) never falls."""
        if fallen is not None:
            if fallen is state.parsed:  # another writer in the inode: the last one's file went
                self._count("vanished")
                self.folded_processes += 1
                state.lockers = None  # ask the lock table again
            else:  # the writer reset these records: what they had counts once, their new values from now
                self._count("reset")
            self._fold_parsed(fallen)
        if parsed.left_out and not state.over_budget_reported:
            state.over_budget_reported = True
            self._count("over_budget")
        state.parsed, state.instance, state.digest, state.used = parsed, parsed.instance, digest, len(data)
        state.needs_gpu = (any(not info.gpu_uuid for info in parsed.infos.values())
                           or any(engine not in parsed.infos for engine in parsed.engines)
                           or any(not uuid for _, uuid, _ in parsed.loads))
        self._version += 1

    def _parse(self, state: FileState, data: bytes, name: str | None) -> Parsed | None:
        """``data`` parsed within the file's limits; None (counted) where it is not a spool file."""
        try:
            parsed = parse(data, self.file_limits)
        except BadFile as exc:
            if state.parsed is None:
                self._count_bad(name, exc.reason)
            else:  # was fine, now is not (truncated by someone): keep the last good
                self._count_damaged(state, exc.reason)
            return None
        if parsed.bad_record and not state.bad_reported:
            state.bad_reported = True
            self._count("record")
        return parsed

    def _lockers(self, inode: int) -> frozenset[int] | None:
        """The pids holding a lock on a file with this inode, from the kernel's lock table (read at most
        once per read(), up to 4 MiB: ~80,000 locks); None when the table could not be read, which says
        nothing about the writer (asked again at the file's next full read, not taken for "nobody")."""
        if not self._lock_table_read:
            self._lock_table_read = True
            self._lock_table = read_lock_table(os.path.join(self.procfs, "locks"))
        return None if self._lock_table is None else self._lock_table.get(inode, frozenset())

    def _writer(self, state: FileState, parsed: Parsed) -> tuple[int, int]:
        """(pid, start ticks) of the file's writer as its header says, where the kernel shows that pid
        holding the file's lock; else (pid, 0), which names no process.  The header is the writer's word:
        a file claiming another live process would lend it that process's GPU and per-process series."""
        if state.lockers is not None and parsed.pid in state.lockers:
            return parsed.pid, parsed.start_ticks
        return parsed.pid, 0

    def _affordable(self, state: FileState, data: bytes, digest: bytes, gone: bool) -> bool:
        """Whether parsing ``data`` (if changed) fits this read's parse budget and the memory kept for
        live files (not for a dead writer's file: it is folded and let go at once); charges the parse
        budget with what the file's own limit lets it cost.  A file that does not fit waits
        (``deferred_files``)."""
        if state.parsed is not None and digest == state.digest:
            return True
        cost = min(len(data), self.file_limits.parse_bytes)
        if cost > self._budget.parse or (not gone and not self._room_to_keep(state, len(data))):
            self._deferred_now += 1
            return False
        self._budget.parse -= cost
        if state.parsed is not None:  # its last content is let go: counted once, not twice, till the next read()
            self._retained[state.used > SMALL_FILE_BYTES] -= state.used
        self._retained[len(data) > SMALL_FILE_BYTES] += len(data)
        return True

    def _fits_new(self, used: int) -> bool:
        """Whether a new live file of ``used`` bytes could be kept now (see _read_bounded)."""
        if self._room_to_keep(None, used):
            return True
        self._deferred_now += 1
        return False

    def _room_to_keep(self, state: FileState | None, size: int) -> bool:
        """Whether the parsed content of ``size`` bytes of a live file fits the memory kept for live files
        (files over SMALL_FILE_BYTES take at most half of it), ``state``'s own content aside."""
        big = size > SMALL_FILE_BYTES
        own = state.used if state is not None and (state.used > SMALL_FILE_BYTES) == big else 0
        allowance = self.retained_bytes // 2 if big else self.retained_bytes - self._retained[True]
        return self._retained[big] - own + size <= allowance

    def _read_bounded(self, fd: int, hint: int, fits: Callable[[int], bool] | None = None) -> bytes | str | None:
        """The file up to its ``used`` offset, or the spool-errors reason why not; None where ``fits(used)``
        says it could not be kept now anyway (then only the first page is read: a new file that must
        wait costs a scrape 4 KiB, not its whole size out of the read budget, which would starve the
        small files listed after a few big ones).

        One pread of the last size seen (at least a page); a second only when the file grew.  ``used``
        past ``max_file_bytes`` is refused before anything past the header is read.
        """
        try:
            data = os.pread(fd, max(hint, 4096), 0)
            if len(data) >= USED_OFFSET + 8 and data[:8] == MAGIC:  # else parse() says what it is
                used, size = (struct.unpack_from("<Q", data, offset)[0] for offset in (USED_OFFSET, 16))
                if used > self.max_file_bytes or size > self.max_file_bytes:
                    return "oversized"
                if fits is not None and not fits(used):
                    self._budget.read -= max(len(data), 4096)
                    return None
                if len(data) < used:
                    data += os.pread(fd, used - len(data), len(data))
                if HEADER_SIZE <= used <= len(data):
                    data = data[:used]
        except OSError:
            return "io"
        self._budget.read -= max(len(data), 4096)
        return data

    # --- folding -----------------------------------------------------------------------------

    def _fold_dead(self, name: str | None, fd: int, state: FileState) -> None:
        """The writer is gone: fold its final totals, then remove the file's name (or tombstone it)."""
        self._retire(state)
        if state.parsed is not None:
            self._fold_parsed(state.parsed)
        self.folded_processes += 1
        self._dispose(name, fd, state.file_id, FoldedFile(state.instance, state.directory))

    def _dispose(self, name: str | None, fd: int, file_id: FileId, folded: FoldedFile) -> None:
        """A folded file found under ``name`` (open on ``fd``, its lock held by this reader): the name is
        removed where this reader removes (the node's directory, not a tool's read), else tombstoned;
        the inode is remembered as folded while it still has names, so that none of them counts again."""
        outcome = "kept"
        if name is not None and self.remove_dead and not os.path.isabs(name):
            outcome = self._remove_name(name, file_id)
            if outcome == "refused":
                # The directory does not let the exporter delete (a sticky 1777 directory owned by someone
                # else): the file stays, and an exporter restart folds it again.  Said once per name.
                self._count("not_deleted")
        if name is not None and outcome in ("kept", "refused"):
            self._tombstones[name] = self._listed.get(name, 0)
        try:
            linked = os.fstat(fd).st_nlink > 0
        except OSError:
            linked = True
        if linked:
            self._remember_folded(file_id, folded)
        else:
            self._folded_files.pop(file_id, None)

    def _remove_name(self, name: str, file_id: FileId) -> str:
        """Remove ``name`` from the node's spool directory if it means the folded file ``file_id``, open on a
        descriptor whose lock this reader holds (so no live process holds it).  "removed"; "replaced":
        the name meant another file (renamed there), which stays in the directory, read as what it is;
        "gone": no such name; "refused": the directory does not let this reader remove it.

        Through the reaping directory (ReapingDirectory), where nothing can swap the file once it is
        there.  Only where that directory cannot be made: fstatat, then unlinkat, both relative to a
        descriptor on the spool directory, which leaves the few microseconds between the two calls to
        a writer renaming a live file onto the name."""
        directory_fd = self._open_directory()
        if directory_fd is None:
            return "refused"
        if self._reaping is None and not self._no_reaping:
            self._reaping = ReapingDirectory.make(directory_fd)
            self._no_reaping = self._reaping is None
        if self._reaping is not None:
            return self._reaping.remove(name, file_id)
        try:
            now = os.stat(name, dir_fd=directory_fd, follow_symlinks=False)
            if (now.st_dev, now.st_ino) != file_id:
                return "replaced"
            os.unlink(name, dir_fd=directory_fd)
        except FileNotFoundError:
            return "gone"
        except OSError:
            return "refused"
        return "removed"

    def _open_directory(self) -> int | None:
        """A descriptor on the node's spool directory, opened at the first removal of a read."""
        if self._directory_fd is None:
            try:
                self._directory_fd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            except OSError:
                return None
        return self._directory_fd

    def _close_directory(self) -> None:
        """The end of a read's removals: the reaping directory removed, the spool directory's descriptor closed."""
        if self._reaping is not None:
            self._reaping.close()
            self._reaping = None
        self._no_reaping = False
        if self._directory_fd is not None:
            os.close(self._directory_fd)
            self._directory_fd = None

    def _vanished(self, state: FileState) -> None:
        """A live file no name shows any more, and no descriptor shows still linked (another reader
        removed it, a wiped emptyDir): fold what was last seen, so no counter goes backwards.  Without a
        kept descriptor it may only have been renamed: remembered, so that found again it does not count
        twice (its later increments are not shown: someone took its name away)."""
        had_descriptor = state.fd is not None
        self._retire(state)
        self._count("vanished")
        if state.parsed is not None:
            self._fold_parsed(state.parsed)
        self.folded_processes += 1
        if not had_descriptor:
            self._remember_folded(state.file_id, FoldedFile(state.instance, state.directory))

    def _fold_parsed(self, parsed: Parsed) -> None:
        self.folded.fold(parsed, self._gpu_seen)

    def _bound_folded(self) -> None:
        """See :meth:`Folded.bound`: engines no live file reports and none shown may be forgotten."""
        live = {engine for state in self._live.values() if state.parsed for engine in state.parsed.engines}
        if self.folded.bound(self.protected, live):
            self._version += 1

    @property
    def forgotten_engines(self) -> int:
        return self.folded.forgotten_engines

    # --- errors ------------------------------------------------------------------------------

    def _count(self, reason: str) -> None:
        self.errors[reason] = self.errors.get(reason, 0) + 1

    def _count_damaged(self, state: FileState, reason: str) -> None:
        """A file understood before and not now: counted once, whatever happens to it after."""
        if not state.bad_reported:
            state.bad_reported = True
            self._count("truncated" if reason in ("empty", "truncated") else reason)

    def _count_bad(self, name: str | None, reason: str) -> None:
        """Count a bad file once for as long as it stays under that name and inode (read() skips it
        unopened from then on; a file put in its place is a new file).  Up to MAX_BAD_REMEMBERED of them:
        past that, a bad file is opened and counted again whenever the listing shows it (its errors
        counter runs on: visible, where remembering every one would let junk names grow memory)."""
        if name is None:
            self._count(reason)
            return
        shown = self._listed.get(name, 0)  # the listing's inode, which read() compares the next listings with
        if self._bad.get(name) == shown:
            return
        if name in self._bad or len(self._bad) < MAX_BAD_REMEMBERED:
            self._bad[name] = shown
        self._count(reason)

    # --- merging -----------------------------------------------------------------------------

    def _place_writers(self) -> tuple[object, ...]:
        """Places the engines of live writers that recorded no GPU for them (``_placed``; see _placed_on);
        returns what it found, as a key of the merge."""
        placed: dict[tuple[FileId, str], tuple[str, ...]] = {}
        if self.gpu_of is not None or self.place_of is not None:
            for state in self._live.values():
                parsed = state.parsed
                if not state.needs_gpu or parsed is None:
                    continue
                writer = self._writer(state, parsed)
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

    def _merge(self) -> Totals:
        """The folded totals of exited writers plus every live file, per engine, per engine and GPU and per
        load in progress."""
        totals = self.folded.copy()
        infos: dict[InfoIdentity, EngineInfo] = {}
        mounts_of: dict[str, set[tuple[int, int]]] = {}  # engine -> the st_devs whose mount is kept
        for state in self._live.values():
            parsed = state.parsed
            if parsed is None:
                continue
            writer = self._writer(state, parsed)
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
        self._merge_per_gpu_and_loads(totals)
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

    def _merge_per_gpu_and_loads(self, totals: Totals) -> None:
        """Per (engine, GPU): the live writers' per-GPU slots plus the folded ones; and the loads in
        progress of live writers (a dead writer's loads are over, whatever its file says)."""
        # Grouped first, summed once per (engine, GPU) at C speed: a scrape of 1,000 writers pays one
        # tuple per writer and engine here, not one list addition.
        groups: dict[tuple[str, str], list[typing.Sequence[float]]] = {
            key: [values] for key, values in self.folded.per_gpu.items()}
        seen: dict[tuple[int, str], str] = {}  # only GPUs NVML gave: a recorded one is in the file itself
        for state in self._live.values():
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
        self._gpu_seen = seen
        totals.per_gpu = {key: list(group[0]) if len(group) == 1 else list(map(sum, zip(*group, strict=True)))
                          for key, group in groups.items()}



MAX_LOCK_TABLE_BYTES = 4 << 20


def read_lock_table(path: str) -> dict[int, frozenset[int]] | None:
    """inode -> pids holding a lock on it, from /proc/locks (proc(5)): ``1: FLOCK ADVISORY WRITE 4242
    fe:00:2281097 0 EOF``; a blocked waiter's line (``->``) holds nothing.  Matched by inode alone: the
    device field is the file system's own, which overlayfs may report differently from fstat, and a
    pid and an inode both matching by chance is not a claim anyone can arrange.  None: unreadable."""
    chunks: list[bytes] = []
    try:
        with open(path, "rb", buffering=0) as handle:  # in pieces: read(4 MiB) would allocate 4 MiB at once
            while sum(map(len, chunks)) < MAX_LOCK_TABLE_BYTES and (chunk := handle.read(64 << 10)):
                chunks.append(chunk)
    except OSError:
        return None
    text = b"".join(chunks)
    table: dict[int, set[int]] = {}
    for line in text.split(b"\n"):
        parts = line.split()
        if len(parts) < 6 or parts[1] != b"FLOCK":  # a blocked waiter ("->") holds nothing
            continue
        pid, _, inode = parts[4], parts[5].rpartition(b":")[1], parts[5].rpartition(b":")[2]
        if pid.isdigit() and inode.isdigit():
            table.setdefault(int(inode), set()).add(int(pid))
    return {inode: frozenset(pids) for inode, pids in table.items()}


def _real_directory(path: str) -> bool:
    """Whether ``path`` is a directory and not a symlink to one."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def pod_of(state: FileState, parsed: Parsed) -> PodIdentity | None:
    """The pod of a live file: the writer's record, with the UID of the pod volume it was found in
    (the kubelet's, which a writer cannot choose) in place of the one it recorded."""
    pod = parsed.pod
    if state.pod_uid:
        return dataclasses.replace(pod or PodIdentity(), pod_uid=state.pod_uid)
    return pod if pod is not None and any(dataclasses.astuple(pod)) else None

