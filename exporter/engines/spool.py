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
import dataclasses
import functools
import hashlib
import os
import random
import resource
import stat
import struct
import threading
import time
import typing
from collections.abc import Callable

from gpuio.spool import DEFAULT_FILE_BYTES, GENERATION_OFFSET, HEADER_SIZE

from ..host import procstat
from ..host.abandonable import Abandonable, Unresponsive
from . import placement
from .fold import Folded, not_carried_forward
from .model import Totals
from .parse import FILE_LIMITS, BadFile, Parsed, parse
from .spool_budget import RETAINED_BYTES, SCRAPE_PARSE_BYTES, SCRAPE_READ_BYTES, ReadBudget
from .spool_files import FileId, FileState, FoldedFile, FoldedFiles, LiveFiles, count_error
from .spool_listing import MAX_SWEPT_TEMPORARY as MAX_SWEPT_TEMPORARY  # moved there; tests name it here
from .spool_listing import SpoolListing
from .spool_liveness import FLOCK, PROBE, Reaper, WriterLiveness, writer_gone
from .spool_liveness import read_lock_table as read_lock_table  # moved there; tests name it here
from .spool_merge import SpoolMerge

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


# Directory entries looked at per read (spool files or not): a directory of millions of names is walked
# a slice per read, each read going on where the last one stopped (see DirectoryScan), so that a read
# costs the same bounded time however many names a writer makes, and every name gets its turn.
MAX_SCANNED_ENTRIES = 65_536  # of the node's spool directory; the pods' volumes: see spool_listing
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


def _kept_files_cap() -> int:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return MAX_KEPT_FILES if soft == resource.RLIM_INFINITY else max(0, min(MAX_KEPT_FILES, (soft - FD_ROOM) // 2))


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

    What it owns, one part per concern: the listing (SpoolListing: which names a read looks at, which
    it skips and why), the live files by inode (LiveFiles) and the folded ones (FoldedFiles), the read's
    budgets (ReadBudget), the writers' liveness and the reaping of dead files (WriterLiveness, Reaper),
    and the merge (SpoolMerge).  Reading each file and folding the dead ones is this class's own work.
    """

    def __init__(self, directory: str, max_folded_engines: int = 4096, remove_dead: bool = True,
                 gpu_of: Callable[[int, int], str | None] | None = None,
                 max_file_bytes: int = DEFAULT_FILE_BYTES, procfs: str = "/proc",
                 place_of: Callable[[int, int, str], tuple[str, ...]] | None = None) -> None:
        self.directory = directory
        # Where the kernel's lock table is (<procfs>/locks): it says which process holds a file's lock, so
        # which writer a file's header may truthfully name (see writer_of).
        self.liveness = WriterLiveness(procfs)
        # A tool (gpuio engines) reads without removing (remove_dead False): the exporter must still fold
        # what it finds.
        self.reaper = Reaper(directory, remove_dead)
        self.merge = SpoolMerge(gpu_of, place_of)
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
        self.files = LiveFiles()
        self.folded_files = FoldedFiles()  # oldest first, MAX_FOLDED_REMEMBERED at most
        self.listing = SpoolListing(directory, MAX_SCANNED_ENTRIES, self.files.names, self.folded_files, self.errors,
                                    self.reaper.sweep_temporary)
        self._reads = 0  # read() calls so far: FileState.visited
        self.budget = ReadBudget()
        self.folded = Folded(max_folded_engines)  # exited writers' totals, and live writers' resets
        self._lock = threading.Lock()  # a scrape and a tool may read at the same time
        self._kept_cap = _kept_files_cap()
        self._kept = 0  # descriptors held open by live FileStates
        self._now = 0.0  # time.monotonic() at the start of this read
        # Moves whenever what the merge reads changes (a live file parsed anew, added, folded, forgotten):
        # the same version and the same GPU answers give the same merge, which is then reused.
        self._version = 0
        self._merged: tuple[tuple[object, ...], Totals] | None = None

    @property
    def pod_directories(self) -> dict[str, str]:
        """Spool directories found in pods' volumes: directory -> pod UID (see SpoolListing)."""
        return self.listing.pod_directories

    @property
    def scan_entries(self) -> int:
        """Entries of the node's spool directory looked at per read (see DirectoryScan)."""
        return self.listing.scan_entries

    @scan_entries.setter
    def scan_entries(self, entries: int) -> None:
        self.listing.scan_entries = entries

    def live_file_ids(self) -> frozenset[FileId]:
        """(st_dev, st_ino) of the live spool files read: their processes report through the library."""
        return frozenset(self.files.live)

    def set_pod_directories(self, directories: dict[str, str]) -> None:
        """Replace the discovered directories (directory -> pod UID); files of one no longer listed
        are folded at the next read, as files that vanished, once the directory is gone (while it
        exists, the scan only left it out: see SpoolListing.spool_files)."""
        if directories != self.listing.pod_directories:
            self._version += 1  # the files read change: the last merge may not be reused
        self.listing.pod_directories = dict(directories)

    def close(self) -> None:
        """Close the descriptors kept open (the reader stays usable: it opens them again)."""
        with self._lock:
            for state in self.files.live.values():
                self._close_kept(state)
            self.listing.close()
            self.reaper.close()

    def __del__(self) -> None:
        files = getattr(self, "files", None)
        for state in files.live.values() if files is not None else ():
            if state.fd is not None:
                with contextlib.suppress(OSError):
                    os.close(state.fd)
                state.fd = None

    # --- the directory -------------------------------------------------------------------------

    def read(self) -> Totals:
        """Everything merged now.  The Totals may be the one an earlier read returned (nothing changed
        since): callers read it and never modify it."""
        with self._lock:
            self._now = time.monotonic()
            self._reads += 1
            names = self.listing.spool_files()
            if names is None:
                self.merge.place_writers(self.files.live.values())
                return self._merge()
            self.liveness.start_read()
            self.budget.start(self.scrape_read_bytes, self.scrape_parse_bytes, self.retained_bytes,
                              self.files.live.values())
            try:
                self._visit_all(names)
                self._forget_names_gone(names)
                self._visit_unnamed()
            finally:
                self.reaper.close()
            self.listing.note_seen()
            self._bound_folded()  # once per read, not per fold: a thousand folds would sort a thousand times
            return self._merged_totals()

    def _visit_all(self, names: set[str]) -> None:
        """Every file listed, in turn, while the budgets last: an unchanged live file settled here (a
        lock probe and a header read), everything else visited in full; a live file is looked at once,
        under whichever of its names comes first.  The loop a thousand idle writers cost: names bound once."""
        live, named, listing = self.files.live, self.files.names, self.listing
        listed, bad, tombstones = listing.listed, listing.bad, listing.tombstones
        budget, unchanged, now, first_deferred, deferred = self.budget, self._unchanged, self._reads, "", 0
        waiting: set[str] = set()
        for name in budget.visit_order(names, named):
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
            deferred_before = budget.deferred_now
            self._visit(name)
            if budget.deferred_now > deferred_before:  # too big for what was left: its turn comes first next time
                first_deferred = first_deferred or name
                waiting.add(name)
        budget.resume_at = first_deferred
        budget.waiting = waiting
        self.deferred_files = deferred + budget.deferred_now

    def _visit_unnamed(self) -> None:
        """Live files no name shows any more whose kept descriptor shows them still linked (renamed out of
        the listing, or into a part of it not reached yet): read through that descriptor, as any live file."""
        live = self.files.live
        for state in [live[file_id] for file_id in self.files.unnamed if file_id in live]:
            fd = state.fd
            if (fd is None or state.visited == self._reads or self.budget.read <= 0 or self.budget.parse <= 0
                    or self._unchanged(state, fd)):
                continue
            self._take_kept(state)
            self._visit_descriptor(None, fd)

    def _forget_names_gone(self, names: set[str]) -> None:
        """After the visits: a name this read's listing no longer shows stops meaning its file.  A live file
        left with no name is gone (folded as vanished), unless the descriptor kept on it shows its inode
        still linked somewhere: renamed, it stays live (read through that descriptor) and keeps its totals."""
        files = self.files
        for name in files.names.keys() - names:
            files.unname(name)
        for file_id in list(files.unnamed):
            state = files.live.get(file_id)
            if state is None or state.names:
                files.unnamed.discard(file_id)  # folded since, or found under another name
            elif not files.still_linked(state):
                self._vanished(state)

    def _merged_totals(self) -> Totals:
        """The merge, reused while no file changed and NVML places the writers that recorded no GPU
        where it did (the only input of the merge that is not in the files)."""
        key = (self._version, self.merge.place_writers(self.files.live.values()))
        if self._merged is None or self._merged[0] != key:
            self._merged = (key, self._merge())
        return dataclasses.replace(self._merged[1], deferred_files=self.deferred_files,
                                   unfinished_listings=self.listing.unfinished_listings)

    def _merge(self) -> Totals:
        return self.merge.totals(self.folded, self.files.live.values(), self.deferred_files,
                                 self.listing.unfinished_listings)

    def _visit(self, name: str) -> None:
        """Open ``name`` and read the file it means now (the descriptor kept on its file while the listing
        shows the name with the same inode as when it was opened)."""
        named = self.files.names
        known = self.files.live.get(named[name]) if name in named else None
        fd = None
        if known is not None and known.names.get(name) == self.listing.listed.get(name):
            fd = self._take_kept(known)
        if fd is None:
            try:
                fd = os.open(os.path.join(self.directory, name),
                             os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
            except FileNotFoundError:
                return  # gone since the listing: the end of the read forgets the name
            except OSError:
                self.listing.count_bad(name, "io")
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
        if FLOCK is None or FLOCK(fd, PROBE) == 0:
            return False  # gone, or no cheap probe: the full read decides (a lock we got is ours until fd closes)
        try:
            header = os.pread(fd, HEADER_SIZE, 0)
        except OSError:
            return False
        self.budget.read -= HEADER_SIZE
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
        if self.files.make_live(name, state, self.listing.listed):
            self._version += 1
        return state

    def _retire(self, state: FileState) -> None:
        """``state`` is no longer a live file: out of the live files, its names forgotten, its kept
        descriptor closed."""
        self.files.retire(state)
        self._close_kept(state)
        self._version += 1

    # --- reading one file ----------------------------------------------------------------------------

    def _visit_open(self, name: str | None, fd: int) -> FileState | None:
        """Read a file whole: parse what changed, fold it if its writer is gone, else keep it live.
        Returns its live state (None: not a live file)."""
        st = os.fstat(fd)
        file_id = (st.st_dev, st.st_ino)
        if name is not None and self.files.names.get(name, file_id) != file_id:
            self.files.unname(name)  # replaced under this name: the file it meant keeps its other names
        if not stat.S_ISREG(st.st_mode):
            self.listing.count_bad(name, "garbage")
            return None
        state = self.files.live.get(file_id)
        if state is not None and state.visited == self._reads:
            return self._make_live(name, state)  # read already this time, under another name
        try:
            gone = writer_gone(fd)
        except OSError:
            gone = False
        folded, header_read = self.folded_files.find(file_id, fd) if state is None else (None, 0)
        self.budget.read -= header_read
        if folded is not None:
            # Never counted again.  Removed (or tombstoned) once its writer is gone; while some process
            # holds its lock (a renamed live file folded as vanished), left alone and looked at again.
            if gone:
                self._dispose(name, fd, file_id, folded)
            return None
        # Sparse or not, a file is never read past what a writer makes.
        data = "oversized" if st.st_size > self.max_file_bytes else self.budget.read_file(
            fd, state.used if state else 0, self.max_file_bytes,
            None if gone or state is not None else self.budget.fits_new)
        if data is None:
            return None  # a new file for which there is no room now: it waits (counted in deferred_files)
        if isinstance(data, str):
            if state is None or state.parsed is None:
                self.listing.count_bad(name, data)
                return None
            self._count_damaged(state, data)
            return self._keep_last_good(name, fd, state, gone)
        if state is None:
            directory = self.listing.directory_of(name) if name is not None else self.directory
            state = FileState(file_id, uid=st.st_uid, directory=directory,
                              pod_uid=self.listing.pod_directories.get(directory, ""))
        return self._visit_content(name, fd, state, data, gone)

    def _visit_content(self, name: str | None, fd: int, state: FileState, data: bytes, gone: bool) -> FileState | None:
        """_visit_open, once the file's bytes are read: take them into ``state`` if they fit this read,
        then fold the file (its writer is gone) or keep it live."""
        state.visited = self._reads
        digest = hashlib.blake2b(data, digest_size=16).digest()
        if not self.budget.affordable(state, data, digest, gone, self.file_limits.parse_bytes):
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
            state.lockers = self.liveness.lockers(state.file_id[1])
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
            again = self.budget.read_file(fd, len(data), self.max_file_bytes)
            if isinstance(again, bytes):
                self.budget.parse -= min(len(again), self.file_limits.parse_bytes)
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
                self.listing.count_bad(name, exc.reason)
            else:  # was fine, now is not (truncated by someone): keep the last good
                self._count_damaged(state, exc.reason)
            return None
        if parsed.bad_record and not state.bad_reported:
            state.bad_reported = True
            self._count("record")
        return parsed

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
        if name is not None and self.reaper.remove_dead and not os.path.isabs(name):
            outcome = self.reaper.remove_name(name, file_id)
            if outcome == "refused":
                # The directory does not let the exporter delete (a sticky 1777 directory owned by someone
                # else): the file stays, and an exporter restart folds it again.  Said once per name.
                self._count("not_deleted")
        if name is not None and outcome in ("kept", "refused"):
            self.listing.tombstone(name)
        try:
            linked = os.fstat(fd).st_nlink > 0
        except OSError:
            linked = True
        if linked:
            self.folded_files.remember(file_id, folded)
        else:
            self.folded_files.forget(file_id)

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
            self.folded_files.remember(state.file_id, FoldedFile(state.instance, state.directory))

    def _fold_parsed(self, parsed: Parsed) -> None:
        self.folded.fold(parsed, self.merge.gpu_seen)

    def _bound_folded(self) -> None:
        """See :meth:`Folded.bound`: engines no live file reports and none shown may be forgotten."""
        live = {engine for state in self.files.live.values() if state.parsed for engine in state.parsed.engines}
        if self.folded.bound(self.protected, live):
            self._version += 1

    @property
    def forgotten_engines(self) -> int:
        return self.folded.forgotten_engines

    # --- errors ------------------------------------------------------------------------------

    def _count(self, reason: str) -> None:
        count_error(self.errors, reason)

    def _count_damaged(self, state: FileState, reason: str) -> None:
        """A file understood before and not now: counted once, whatever happens to it after."""
        if not state.bad_reported:
            state.bad_reported = True
            self._count("truncated" if reason in ("empty", "truncated") else reason)
