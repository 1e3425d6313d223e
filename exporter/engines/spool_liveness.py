"""Which spool writers are alive, and reaping the files of those that are not.

A writer holds an flock on its file for as long as it runs: a lock this reader can take means the
writer has exited (writer_gone).  The kernel's lock table says which process holds a file's lock, so
which writer a file's header may truthfully name (WriterLiveness).  A dead writer's file, once folded,
has its name removed by the Reaper, through a directory of the reader's own (ReapingDirectory) where
nothing can swap the file between the check and the unlink (see the module docstring of
:mod:`exporter.engines.spool`).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import os
import random
import secrets
import time
import typing
from collections.abc import Callable, Iterator

from gpuio.spool import PREFIX, SUFFIX

from .parse import Parsed
from .spool_files import FileId, FileState


def _libc_flock() -> Callable[[int, int], int] | None:
    """libc's flock, called directly: a refused probe then costs a return value, where fcntl.flock
    raises an OSError (about half of what a scrape of unchanged files spends per file)."""
    try:
        flock = ctypes.CDLL(None, use_errno=True).flock
    except (OSError, AttributeError):
        return None
    flock.argtypes, flock.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return typing.cast("Callable[[int, int], int]", flock)


FLOCK = _libc_flock()
PROBE = fcntl.LOCK_EX | fcntl.LOCK_NB


def writer_gone(fd: int) -> bool:
    """Probe the writer's lock: granted means no process holds it, so the writer has exited (and, until
    ``fd`` is closed, this reader holds it: no process can take it meanwhile)."""
    if FLOCK is not None:
        if FLOCK(fd, PROBE) == 0:
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


class WriterLiveness:
    """Which processes the kernel's lock table (<procfs>/locks) shows holding a file's lock: which writer
    a file's header may truthfully name.  The table is read at most once per read()."""

    def __init__(self, procfs: str) -> None:
        self.procfs = procfs
        # inode -> lock holders, read at most once per read() (None: unreadable this time)
        self._lock_table: dict[int, frozenset[int]] | None = None
        self._lock_table_read = False

    def start_read(self) -> None:
        """A new read(): the lock table is read again at the first file that asks."""
        self._lock_table_read = False

    def lockers(self, inode: int) -> frozenset[int] | None:
        """The pids holding a lock on a file with this inode, from the kernel's lock table (read at most
        once per read(), up to 4 MiB: ~80,000 locks); None when the table could not be read, which says
        nothing about the writer (asked again at the file's next full read, not taken for "nobody")."""
        if not self._lock_table_read:
            self._lock_table_read = True
            self._lock_table = read_lock_table(os.path.join(self.procfs, "locks"))
        return None if self._lock_table is None else self._lock_table.get(inode, frozenset())


def writer_of(state: FileState, parsed: Parsed) -> tuple[int, int]:
    """(pid, start ticks) of the file's writer as its header says, where the kernel shows that pid
    holding the file's lock; else (pid, 0), which names no process.  The header is the writer's word:
    a file claiming another live process would lend it that process's GPU and per-process series."""
    if state.lockers is not None and parsed.pid in state.lockers:
        return parsed.pid, parsed.start_ticks
    return parsed.pid, 0


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
        Reaper.remove_name for the outcomes)."""
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
                if writer_gone(fd):
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


class Reaper:
    """Removes the names of dead writers' files from the node's spool directory (never a pod's: its
    volume is the pod's): a folded file's name, and the temporary file of a writer that died before
    renaming it.  A tool (gpuio engines) reads without removing (``remove_dead`` False): the exporter
    must still fold what it finds.  The descriptor on the spool directory and the reaping directory
    live from the first removal of a read to its end (close)."""

    def __init__(self, directory: str, remove_dead: bool) -> None:
        self.directory = directory
        self.remove_dead = remove_dead
        self._directory_fd: int | None = None  # the node's spool directory, open while a read() removes files
        self._reaping: ReapingDirectory | None = None  # made at the first removal of a read, gone at its end
        self._no_reaping = False  # this read could not make one: names are checked, then unlinked

    def remove_name(self, name: str, file_id: FileId) -> str:
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

    def close(self) -> None:
        """The end of a read's removals: the reaping directory removed, the spool directory's descriptor closed."""
        if self._reaping is not None:
            self._reaping.close()
            self._reaping = None
        self._no_reaping = False
        if self._directory_fd is not None:
            os.close(self._directory_fd)
            self._directory_fd = None

    def sweep_temporary(self, name: str) -> None:
        """A writer that died between creating its file and renaming it leaves a dot-file: remove it."""
        with _opened(os.path.join(self.directory, name)) as fd:
            if fd is None or not self.remove_dead:
                return
            st = os.fstat(fd)
            if time.time() - st.st_mtime > 60 and writer_gone(fd):
                self.remove_name(name, (st.st_dev, st.st_ino))


@contextlib.contextmanager
def _opened(path: str) -> Iterator[int | None]:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        yield None
        return
    try:
        yield fd
    finally:
        os.close(fd)
