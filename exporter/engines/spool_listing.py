"""Listing the spool directories under budgets: which files a read looks at, and which it skips and why.

The node's spool directory is listed by name, the pods' spool volumes (exporter.pods.kubelet) by
absolute path.  A directory of millions of names is walked a slice per read (DirectoryScan); what the
reader remembers of names no longer worth opening (tombstones of folded files, bad files) is kept
here, with the listing that proves when they are gone.
"""

from __future__ import annotations

import os
import stat
import typing
from collections.abc import Callable, Iterator

from gpuio.spool import PREFIX, SUFFIX

from .spool_files import FileId, FoldedFiles, count_error

# Directory entries looked at per read: of the node's spool directory, the reader's ``scan_entries``
# (exporter.engines.spool.MAX_SCANNED_ENTRIES).  Of the pods' own spool volumes, together, shared evenly
# among them and at most MAX_POD_DIRECTORY_ENTRIES each: a pod that fills its volume with files cannot
# take the listing from the other pods (a real pod has a few processes, one file each).
POD_SCANNED_ENTRIES = 65_536
MAX_POD_DIRECTORY_ENTRIES = 1024
MIN_POD_DIRECTORY_ENTRIES = 64
# Bad files remembered (name and inode: ~150 bytes each), so that each is counted once and not opened
# again; a listing walked a slice per read reaches every name, so without a cap junk names would be.
MAX_BAD_REMEMBERED = 65_536
# Leftover temporary files (a writer that died before renaming its file) opened per read to see whether
# they may be removed: each costs an open and a lock probe, and a writer can make any number of them.
MAX_SWEPT_TEMPORARY = 32


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
        self.slice_names: list[str] = []  # the spool names of the last slice (the listing fills it in)

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


class SpoolListing:
    """The spool files of each read: the node's directory and the pods' (``pod_directories``: directory
    -> pod UID), each walked a slice per read, plus the live files a slice did not show (as last seen).
    Remembers the names not worth opening while the listing shows them with the same inode: folded files
    left in place (``tombstones``) and bad files (``bad``, counted once).

    ``live_names`` is the reader's map of the names of live files (LiveFiles.names), only read here;
    ``errors`` the reader's spool error counts; ``sweep`` removes a dead writer's leftover temporary file."""

    def __init__(self, directory: str, scan_entries: int, live_names: dict[str, FileId], folded_files: FoldedFiles,
                 errors: dict[str, int], sweep: Callable[[str], None]) -> None:
        self.directory = directory
        self.live_names = live_names
        self.folded_files = folded_files
        self.errors = errors
        self.sweep = sweep
        # Spool directories found in pods' volumes (exporter.pods.kubelet): directory -> pod UID.  Their
        # files are keyed by absolute path (the main directory's by name), read with the same budgets,
        # and never deleted (the volume is the pod's, mounted read-only): folded, then tombstoned.
        self.pod_directories: dict[str, str] = {}
        self.scan_entries = scan_entries  # entries of the node's directory looked at per read
        self.unfinished_listings = 0  # at the last read(): directories whose pass goes on at the next
        # Names of folded files left in place (a tool's read, a pod's volume, a refused unlink) -> the
        # listing's inode for the name: skipped unopened while the name lists that inode.
        self.tombstones: dict[str, int] = {}
        # name -> inode of files counted as bad; pruned to the names still listed, never cleared
        # wholesale (that re-counted every bad file), so it is as big as the bad files present.
        self.bad: dict[str, int] = {}
        self.listed: dict[str, int] = {}  # name -> inode, from the last listing (readdir's d_ino: no stat)
        self._scans: dict[str, DirectoryScan] = {}  # directory -> its listing, a slice per read
        self._sweeps_left = 0
        self._left_out_directories: set[str] = set()  # pod directories that exist but the scan left out

    def spool_files(self) -> set[str] | None:
        """The spool files of this read: the main directory's (by name) and the pod directories' (by
        absolute path), each directory's next slice (see DirectoryScan) plus its live files; None when
        the main directory is missing or unreadable and no pod directory is known."""
        self.unfinished_listings = 0
        self._sweeps_left = MAX_SWEPT_TEMPORARY
        names: set[str] = set()
        listed: dict[str, int] = {}
        found = self._list_one(self.directory, "", names, listed, self.scan_entries)
        if not found and not self.pod_directories and not any(map(os.path.isabs, self.live_names)):
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
        known = {os.path.dirname(key) for key in (*self.live_names, *self.tombstones) if os.path.isabs(key)}
        self._left_out_directories = {directory for directory in known - self.pod_directories.keys()
                                      if _real_directory(directory)}
        for directory in sorted(self._left_out_directories):
            self._carry(directory, names, listed)
        self._forget_unread_directories()
        self.listed = listed
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
                    self.sweep(name)
        except FileNotFoundError:
            del self._scans[directory]
            return False
        except OSError:
            del self._scans[directory]
            count_error(self.errors, "io")
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
            if key in self.live_names:
                names.add(key)
                listed[key] = ino
        if self.tombstones:
            self.tombstones = {key: ino for key, ino in self.tombstones.items()
                               if listed.get(key, scan.seen.get(key)) == ino or self.directory_of(key) != directory}
        if self.bad:
            self.bad = {key: ino for key, ino in self.bad.items()
                        if listed.get(key, scan.seen.get(key)) == ino or self.directory_of(key) != directory}
        scan.seen = {}

    def note_seen(self) -> None:
        """After the visits of a read: which files the reader remembers (live, folded, bad) the slices of
        passes still under way showed, for the end of their pass."""
        for scan in self._scans.values():
            if not scan.finished:
                for key in scan.slice_names:
                    if key in self.live_names or key in self.tombstones or key in self.bad:
                        scan.seen[key] = self.listed.get(key, 0)
                scan.slice_names = []

    def _forget_unread_directories(self) -> None:
        """Directories no longer read (a pod gone, or its directory gone while left out by the scan):
        their listings are closed, their tombstones, bad files and folded files forgotten.  The node's
        directory is always read, and a left-out pod directory is carried."""
        kept = {self.directory, *self.pod_directories, *self._left_out_directories}
        for directory in [directory for directory in self._scans if directory not in kept]:
            self._scans.pop(directory).close()
        if any(self.directory_of(key) not in kept for key in self.tombstones):
            self.tombstones = {key: ino for key, ino in self.tombstones.items() if self.directory_of(key) in kept}
        if any(self.directory_of(key) not in kept for key in self.bad):
            self.bad = {key: ino for key, ino in self.bad.items() if self.directory_of(key) in kept}
        self.folded_files.keep_directories(kept)

    def _carry(self, directory: str, names: set[str], listed: dict[str, int]) -> None:
        """Keep the live files of a directory that could not be listed, or whose listing has not reached
        them yet, as last seen."""
        for key in self.live_names:
            if key not in names and self.directory_of(key) == directory:
                names.add(key)
                listed[key] = self.listed.get(key, 0)

    def directory_of(self, key: str) -> str:
        return os.path.dirname(key) if os.path.isabs(key) else self.directory

    def tombstone(self, name: str) -> None:
        """A folded file left in place under ``name``: skipped unopened while the listing shows the same inode."""
        self.tombstones[name] = self.listed.get(name, 0)

    def count_bad(self, name: str | None, reason: str) -> None:
        """Count a bad file once for as long as it stays under that name and inode (read() skips it
        unopened from then on; a file put in its place is a new file).  Up to MAX_BAD_REMEMBERED of them:
        past that, a bad file is opened and counted again whenever the listing shows it (its errors
        counter runs on: visible, where remembering every one would let junk names grow memory)."""
        if name is None:
            count_error(self.errors, reason)
            return
        shown = self.listed.get(name, 0)  # the listing's inode, which read() compares the next listings with
        if self.bad.get(name) == shown:
            return
        if name in self.bad or len(self.bad) < MAX_BAD_REMEMBERED:
            self.bad[name] = shown
        count_error(self.errors, reason)

    def close(self) -> None:
        """Close the directory streams of passes under way (the next read starts them over)."""
        for scan in self._scans.values():
            scan.close()
        self._scans.clear()

    def __del__(self) -> None:
        for scan in getattr(self, "_scans", {}).values():
            scan.close()


def _real_directory(path: str) -> bool:
    """Whether ``path`` is a directory and not a symlink to one."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False
