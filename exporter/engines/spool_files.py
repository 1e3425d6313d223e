"""What the spool reader remembers of files, known by inode: the live files and the names that lead to
them (LiveFiles), and the folded files whose inodes may still have names (FoldedFiles).

See the module docstring of :mod:`exporter.engines.spool`: a file is its inode, not its name.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from gpuio.spool import HEADER_SIZE

from .parse import Parsed, instance_of

# Folded files remembered by inode while they may still have names (FoldedFile: ~200 bytes each): a
# dead file's hard links, a dead file this reader may not delete, a live file that vanished while no
# descriptor was kept on it.  Past the cap the oldest is forgotten: a name of it found after that
# would be folded again.
MAX_FOLDED_REMEMBERED = 65_536

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


def count_error(errors: dict[str, int], reason: str) -> None:
    """One more spool error for ``reason`` (``spool_errors_total{reason}``)."""
    errors[reason] = errors.get(reason, 0) + 1


class LiveFiles:
    """The live files (by inode) and the names that lead to them: a file under two names is one file, a
    renamed one keeps its totals, and one that lost its last name stays live while the descriptor kept on
    it shows it still linked (``unnamed``)."""

    def __init__(self) -> None:
        self.live: dict[FileId, FileState] = {}
        self.names: dict[str, FileId] = {}  # name (key) -> the live file it was found to mean
        self.unnamed: set[FileId] = set()  # live files that lost their last name (see SpoolReader._forget_names_gone)

    def make_live(self, name: str | None, state: FileState, listed: dict[str, int]) -> bool:
        """``state`` is a live file, found under ``name`` (None: through its kept descriptor; ``listed``:
        the listing's inode of each name).  Whether it was not a live file before."""
        if name is not None:
            if self.names.get(name) != state.file_id:
                self.unname(name)
                self.names[name] = state.file_id
            state.names[name] = listed.get(name, 0)
            self.unnamed.discard(state.file_id)
        if self.live.get(state.file_id) is not state:
            self.live[state.file_id] = state
            return True
        return False

    def unname(self, name: str) -> None:
        """``name`` no longer means the live file it meant (its other names still do)."""
        file_id = self.names.pop(name, None)
        state = self.live.get(file_id) if file_id is not None else None
        if state is not None:
            state.names.pop(name, None)
            if not state.names:
                self.unnamed.add(state.file_id)

    def retire(self, state: FileState) -> None:
        """``state`` is no longer a live file: out of the live files, its names forgotten (its kept
        descriptor is the reader's to close)."""
        if self.live.get(state.file_id) is state:
            del self.live[state.file_id]
        for name in state.names:
            if self.names.get(name) == state.file_id:
                del self.names[name]
        state.names = {}
        self.unnamed.discard(state.file_id)

    @staticmethod
    def still_linked(state: FileState) -> bool:
        """Whether the descriptor kept on a live file shows its inode still has a name somewhere."""
        if state.fd is None:
            return False
        try:
            return os.fstat(state.fd).st_nlink > 0
        except OSError:
            return False


class FoldedFiles:
    """Folded files remembered by inode while they may still have names, oldest first,
    MAX_FOLDED_REMEMBERED at most: found again under any name, they are not counted again."""

    def __init__(self) -> None:
        self.files: dict[FileId, FoldedFile] = {}

    def find(self, file_id: FileId, fd: int) -> tuple[FoldedFile | None, int]:
        """The folded file that the one open on ``fd`` is (same inode, same writer instance): another name
        of it (a hard link, a rename), which must not count again; None: a file not folded before.  With
        the bytes read to tell (the caller's read budget pays them)."""
        folded = self.files.get(file_id)
        if folded is None:
            return None, 0
        try:
            header = os.pread(fd, HEADER_SIZE, 0)
        except OSError:
            return folded, 0  # unreadable: not counted, rather than perhaps counted twice
        if instance_of(header) == folded.instance:
            return folded, HEADER_SIZE
        del self.files[file_id]  # the inode was freed and is another file's now
        return None, HEADER_SIZE

    def remember(self, file_id: FileId, folded: FoldedFile) -> None:
        self.files.pop(file_id, None)  # the newest last: the oldest is forgotten first
        self.files[file_id] = folded
        if len(self.files) > MAX_FOLDED_REMEMBERED:
            del self.files[next(iter(self.files))]

    def forget(self, file_id: FileId) -> None:
        self.files.pop(file_id, None)

    def keep_directories(self, kept: set[str]) -> None:
        """Forget the folded files of directories no longer read."""
        if any(folded.directory not in kept for folded in self.files.values()):
            self.files = {file_id: folded for file_id, folded in self.files.items() if folded.directory in kept}
