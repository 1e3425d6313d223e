"""A real FUSE file system, served from this process, that can die like a hung FUSE daemon or a dead NFS server.

No libfuse: the daemon speaks the kernel's FUSE protocol (include/uapi/linux/fuse.h) on /dev/fuse itself.  It
serves a flat, read-only root directory of regular files whose content is a function of the offset
(:func:`content`), and it gives the kernel no cache time at all (entry and attribute timeouts of 0 s), so every
path look-up and every stat() of a file on the mount becomes a request to the daemon.  That is what makes a
frozen daemon block its callers, as a real one does:

    with FuseStub(mountpoint, files={"model.plan": 4 << 20}) as stub:
        ...                  # the mount answers
        stub.freeze()        # from now on no request is answered: stat()/open()/read() there blocks
        ...                  # touch it from subprocesses only: a blocked thread here would hang this process
    # close(): the connection is aborted (blocked callers fail with ECONNABORTED or ENOTCONN) and detached

What still answers while frozen, because the kernel serves it without asking the daemon: readlink() of
/proc/<pid>/fd/<n>, /proc/<pid>/fdinfo/<n> and /proc/<pid>/mountinfo.

Needs root (mount(2)) and /dev/fuse; :func:`unavailable` says why not where they are missing.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import ctypes.util
import errno
import os
import select
import stat
import struct
import tempfile
import threading
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import pytest

# --- The protocol (include/uapi/linux/fuse.h): the kernel's structs in native byte order ("="), no implicit
# padding (the header pads every struct to 64 bits by hand). ---

FUSE_KERNEL_VERSION = 7
# 7.31: the newest minor whose structs below are complete (fuse_attr ends with padding, fuse_in_header's last
# u32 is padding, no request extensions).  Newer kernels speak it: both sides use the smaller minor.
FUSE_KERNEL_MINOR_VERSION = 31
FUSE_ROOT_ID = 1

# Opcodes (enum fuse_opcode).
FUSE_LOOKUP = 1
FUSE_FORGET = 2  # no reply
FUSE_GETATTR = 3
FUSE_SETATTR = 4
FUSE_READLINK = 5
FUSE_OPEN = 14
FUSE_READ = 15
FUSE_WRITE = 16
FUSE_STATFS = 17
FUSE_RELEASE = 18
FUSE_FSYNC = 20
FUSE_SETXATTR = 21
FUSE_GETXATTR = 22
FUSE_LISTXATTR = 23
FUSE_REMOVEXATTR = 24
FUSE_FLUSH = 25
FUSE_INIT = 26
FUSE_OPENDIR = 27
FUSE_READDIR = 28
FUSE_RELEASEDIR = 29
FUSE_FSYNCDIR = 30
FUSE_ACCESS = 34
FUSE_CREATE = 35
FUSE_INTERRUPT = 36  # no reply (answering the interrupted request is enough)
FUSE_DESTROY = 38
FUSE_IOCTL = 39
FUSE_POLL = 40
FUSE_BATCH_FORGET = 42  # no reply
FUSE_READDIRPLUS = 44
FUSE_RENAME2 = 45
FUSE_LSEEK = 46

# "LOOKUP", ... by opcode, for FuseStub.requests: every FUSE_<name> constant above but the three that are no opcodes.
OPCODE_NAMES = {value: name[len("FUSE_"):] for name, value in globals().items()
                if name.startswith("FUSE_") and isinstance(value, int) and name not in (
                    "FUSE_KERNEL_VERSION", "FUSE_KERNEL_MINOR_VERSION", "FUSE_ROOT_ID")}
NO_REPLY = frozenset({FUSE_FORGET, FUSE_BATCH_FORGET, FUSE_INTERRUPT})

# struct fuse_in_header {u32 len; u32 opcode; u64 unique; u64 nodeid; u32 uid; u32 gid; u32 pid; u32 padding}
# (newer kernels split padding into u16 total_extlen, u16 padding: always 0 below 7.36's extensions).
FUSE_IN_HEADER = struct.Struct("=IIQQIIII")
# struct fuse_out_header {u32 len; s32 error (a negative errno); u64 unique}
FUSE_OUT_HEADER = struct.Struct("=IiQ")
# struct fuse_init_in {u32 major; u32 minor; u32 max_readahead; u32 flags; ...}: only the first four are read
# (older kernels send no more).
FUSE_INIT_IN = struct.Struct("=IIII")
# struct fuse_init_out {u32 major; u32 minor; u32 max_readahead; u32 flags; u16 max_background;
#   u16 congestion_threshold; u32 max_write; u32 time_gran; u16 max_pages; u16 map_alignment; u32 flags2;
#   u32 unused[7]}: 64 bytes.
FUSE_INIT_OUT = struct.Struct("=IIIIHHIIHHI28x")
# struct fuse_attr {u64 ino; u64 size; u64 blocks; u64 atime; u64 mtime; u64 ctime; u32 atimensec;
#   u32 mtimensec; u32 ctimensec; u32 mode; u32 nlink; u32 uid; u32 gid; u32 rdev; u32 blksize; u32 padding}
FUSE_ATTR = struct.Struct("=QQQQQQIIIIIIIIII")
# struct fuse_entry_out {u64 nodeid; u64 generation; u64 entry_valid; u64 attr_valid; u32 entry_valid_nsec;
#   u32 attr_valid_nsec; struct fuse_attr attr}
FUSE_ENTRY_OUT = struct.Struct("=QQQQII")  # followed by FUSE_ATTR
# struct fuse_attr_out {u64 attr_valid; u32 attr_valid_nsec; u32 dummy; struct fuse_attr attr}
FUSE_ATTR_OUT = struct.Struct("=QII")  # followed by FUSE_ATTR
# struct fuse_open_in {u32 flags; u32 unused}
FUSE_OPEN_IN = struct.Struct("=II")
# struct fuse_open_out {u64 fh; u32 open_flags; u32 padding}
FUSE_OPEN_OUT = struct.Struct("=QII")
# struct fuse_read_in {u64 fh; u64 offset; u32 size; u32 read_flags; u64 lock_owner; u32 flags; u32 padding}
FUSE_READ_IN = struct.Struct("=QQIIQII")
# struct fuse_kstatfs {u64 blocks; u64 bfree; u64 bavail; u64 files; u64 ffree; u32 bsize; u32 namelen;
#   u32 frsize; u32 padding; u32 spare[6]}: the whole of struct fuse_statfs_out.
FUSE_KSTATFS = struct.Struct("=QQQQQIIII24x")
# struct fuse_dirent {u64 ino; u64 off; u32 namelen; u32 type; char name[]}, padded to 8 bytes.
FUSE_DIRENT = struct.Struct("=QQII")

# The sizes the kernel checks a reply against (a wrong one fails the request with EINVAL).
assert (FUSE_IN_HEADER.size, FUSE_OUT_HEADER.size, FUSE_INIT_OUT.size) == (40, 16, 64)
assert (FUSE_ATTR.size, FUSE_ENTRY_OUT.size + FUSE_ATTR.size, FUSE_ATTR_OUT.size + FUSE_ATTR.size) == (88, 128, 104)
assert (FUSE_OPEN_OUT.size, FUSE_READ_IN.size, FUSE_KSTATFS.size, FUSE_DIRENT.size) == (16, 40, 80, 24)

# Read buffer: the kernel refuses (EINVAL) a read() smaller than a whole request, header + fuse_write_in +
# max_write; a 1 MiB buffer plus room for the headers holds any request of any max_write we could negotiate.
READ_BUFFER = (1 << 20) + 4096
MAX_WRITE = 128 << 10
MAX_READAHEAD = 128 << 10
BLOCK = 4096

DT_DIR = 4
DT_REG = 8


def content(offset: int, length: int) -> bytes:
    """The bytes of every stub file at ``offset``: 8-byte little-endian words, each holding its own index
    (word *k* covers offsets 8k..8k+7), so a read at a wrong offset can't return the right bytes."""
    if length <= 0:
        return b""
    first, last = offset // 8, (offset + length + 7) // 8
    words = struct.pack(f"<{last - first}Q", *range(first, last))
    start = offset - first * 8
    return words[start:start + length]


# --- mount(2) and umount2(2) through libc ---

MS_NOSUID = 2
MS_NODEV = 4
MNT_DETACH = 2

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]


def _mount(source: str, target: str, fstype: str, flags: int, data: str) -> None:
    if _libc.mount(source.encode(), target.encode(), fstype.encode(), flags, data.encode()) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount -t {fstype} {source} {target}: {os.strerror(err)}")


def _umount_lazy(target: str) -> None:
    """Detach the mount now; the kernel frees it once nothing uses it.  Never waits for the daemon."""
    if _libc.umount2(target.encode(), MNT_DETACH) != 0:
        err = ctypes.get_errno()
        if err not in (errno.EINVAL, errno.ENOENT):  # not (or no longer) a mount point there
            raise OSError(err, f"umount2({target}, MNT_DETACH): {os.strerror(err)}")


def unavailable() -> str | None:
    """Why a FuseStub can't be mounted here, or None where it can."""
    if os.geteuid() != 0:
        return "mounting a FUSE file system needs root"
    if not os.path.exists("/dev/fuse"):
        return "no /dev/fuse"
    try:
        with open("/proc/filesystems") as filesystems:
            if not any(line.split()[-1:] == ["fuse"] for line in filesystems):
                return "the kernel has no fuse file system"
    except OSError as exc:
        return f"/proc/filesystems: {exc}"
    return None


@dataclass(frozen=True)
class MountEntry:
    """One line of /proc/<pid>/mountinfo (proc(5))."""

    mount_id: int
    major: int
    minor: int
    mountpoint: str
    fstype: str
    source: str


def _unescape(field: bytes) -> str:
    # mountinfo writes space, tab, newline and backslash as octal escapes (\040 ...), any other byte as it is:
    # not always UTF-8 (a path may hold any byte but NUL), hence bytes in, surrogate escapes out.
    return field.decode("unicode_escape").encode("latin-1").decode(errors="surrogateescape")


def mountinfo(pid: int | str = "self") -> list[MountEntry]:
    """The mount table of a process.  Reading it never asks any file system's daemon."""
    entries = []
    with open(f"/proc/{pid}/mountinfo", "rb") as table:
        for line in table:
            fields = line.split()
            sep = fields.index(b"-")
            major, minor = fields[2].split(b":")
            entries.append(MountEntry(int(fields[0]), int(major), int(minor), _unescape(fields[4]),
                                      _unescape(fields[sep + 1]), _unescape(fields[sep + 2])))
    return entries


class FuseStub:
    """A FUSE mount at ``mountpoint`` serving ``files`` (name -> size) from a daemon thread of this process.

    ``freeze()`` makes the daemon stop answering; ``close()`` (or leaving the ``with``) aborts the connection,
    which fails every blocked caller, and detaches the mount.  ``requests`` counts the requests the daemon
    received, by opcode name ("LOOKUP", "GETATTR", ...), which lets a test prove that something never touched
    the mount.
    """

    def __init__(self, mountpoint: str | os.PathLike[str], files: Mapping[str, int] | None = None,
                 subtype: str = "gpuio-stub") -> None:
        self.mountpoint = os.path.abspath(os.fspath(mountpoint))
        self.files = dict(files if files is not None else {"model.plan": 4 << 20})
        for name in self.files:
            if not name or "/" in name or name in (".", ".."):
                raise ValueError(f"not a file name: {name!r}")
        self.subtype = subtype
        self.fstype = f"fuse.{subtype}" if subtype else "fuse"
        # Node ids: the root is FUSE_ROOT_ID (1), files follow in name order.
        self._names = sorted(self.files)
        self._nodes = {name: FUSE_ROOT_ID + 1 + i for i, name in enumerate(self._names)}
        self._by_node = {node: name for name, node in self._nodes.items()}
        self.requests: collections.Counter[str] = collections.Counter()
        self.protocol: tuple[int, int] | None = None  # (major, minor) once INIT is answered
        self.kernel_protocol: tuple[int, int] | None = None  # what the kernel offered in its INIT
        self.mount_entry: MountEntry | None = None
        self._frozen = False
        self._swallow = False
        self._closing = False
        self._lock = threading.Lock()
        self._initialized = threading.Event()
        self._thread: threading.Thread | None = None
        self._open()

    # --- life cycle ---

    def _open(self) -> None:
        # O_NONBLOCK: the daemon thread reads only after poll() said a request is there, and a read that finds
        # none (another reader, an interrupted request) returns EAGAIN instead of blocking.  A thread blocked in
        # read() would keep the file alive past close(), and with it the connection and every stuck caller.
        # O_CLOEXEC (Python's default): no child process gets a copy, which would keep the connection alive too.
        self._fd = os.open("/dev/fuse", os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
        # The daemon thread sleeps in poll() on /dev/fuse and this pipe; a byte here makes it look at its state.
        self._wake_r, self._wake_w = os.pipe()
        try:
            _mount("gpuio-stub", self.mountpoint, self.fstype, MS_NOSUID | MS_NODEV,
                   f"fd={self._fd},rootmode={stat.S_IFDIR:o},user_id=0,group_id=0,allow_other")
        except BaseException:
            for fd in (self._fd, self._wake_r, self._wake_w):
                os.close(fd)
            raise
        self._resources = _Resources(self._fd, self._wake_r, self._wake_w, self.mountpoint)
        # Also at interpreter exit, should a test never close it: no dead mount left behind.
        self._finalizer = weakref.finalize(self, self._resources.release)
        try:
            self.mount_entry = next((entry for entry in reversed(mountinfo())
                                     if entry.mountpoint == self.mountpoint and entry.fstype == self.fstype), None)
            # The kernel sent INIT at mount; only now can /dev/fuse be read (before mount it says EPERM).
            self._thread = threading.Thread(target=self._serve, name=f"fuse-stub {self.mountpoint}", daemon=True)
            self._thread.start()
            if not self._initialized.wait(10):
                raise TimeoutError(f"the kernel sent no FUSE INIT for {self.mountpoint}")
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> FuseStub:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def freeze(self, swallow: bool = False) -> None:
        """From now on answer nothing: every request to the mount blocks its caller until close().

        Either way a blocked caller sleeps in request_wait_answer (state S).  ``swallow=False`` (like a dead NFS
        server on a hard mount): the daemon stops reading /dev/fuse, requests stay queued in the kernel, and
        SIGKILL still ends a blocked caller (the kernel drops a request it never handed out), so
        ``subprocess.run(..., timeout=...)`` works.  ``swallow=True`` (a hung FUSE daemon): the daemon keeps
        taking requests off the queue and drops them; a signal then only turns the wait uninterruptible (state D),
        even SIGKILL, until close() -- never wait() without a timeout for such a process before close(), which is
        what subprocess.run() does after its timeout.
        """
        with self._lock:
            self._frozen, self._swallow = True, swallow
        self._wake()

    @property
    def frozen(self) -> bool:
        return self._frozen

    @property
    def connection(self) -> str | None:
        """/sys/fs/fuse/connections/<n> of this mount, where fusectl is mounted there."""
        if self.mount_entry is None:
            return None
        path = f"/sys/fs/fuse/connections/{os.makedev(self.mount_entry.major, self.mount_entry.minor)}"
        return path if os.path.isdir(path) else None

    def abort_connection(self) -> None:
        """Abort the connection now, as `echo 1 > /sys/fs/fuse/connections/<n>/abort` does: every waiting and
        every later request fails (ECONNABORTED, ENOTCONN), but the mount stays, dead, until close()."""
        connection = self.connection
        if connection is not None:
            with open(os.path.join(connection, "abort"), "w") as abort:
                abort.write("1")
        else:  # no fusectl: the release of the last /dev/fuse file aborts it just the same
            self._stop_thread()
            self._resources.abort()

    def close(self) -> None:
        """Abort the connection (blocked callers return with an error), detach the mount, end the thread."""
        self._stop_thread()
        self._finalizer()  # closes /dev/fuse, which aborts the connection, then umount2(MNT_DETACH)

    def _stop_thread(self) -> None:
        self._closing = True
        self._wake()
        if self._thread is not None and self._thread is not threading.current_thread():
            # The thread never blocks but in poll(), which the wake-up pipe ends.
            self._thread.join(10)

    def _wake(self) -> None:
        # Only while the pipe is ours (its number could be another file's once closed).  OSError: the pipe is full,
        # so the thread will look anyway.
        if self._resources.wake:
            with contextlib.suppress(OSError):
                os.write(self._resources.wake[1], b"x")

    # --- paths ---

    def path(self, name: str) -> str:
        return os.path.join(self.mountpoint, name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    # --- the daemon ---

    def _serve(self) -> None:
        buffer = bytearray(READ_BUFFER)
        view = memoryview(buffer)
        try:
            while not (self._closing or self._resources.closing):
                poller = select.poll()
                poller.register(self._wake_r, select.POLLIN)
                with self._lock:
                    reading = not self._frozen or self._swallow
                if reading:
                    poller.register(self._fd, select.POLLIN)
                ready = dict(poller.poll())
                if self._closing or self._resources.closing:
                    return
                if self._wake_r in ready:
                    os.read(self._wake_r, 4096)
                if self._fd not in ready:
                    continue
                if ready[self._fd] & (select.POLLERR | select.POLLHUP | select.POLLNVAL):
                    return  # the connection was aborted
                try:
                    length = os.readv(self._fd, [buffer])
                except (BlockingIOError, InterruptedError):
                    continue  # nothing there after all
                except FileNotFoundError:
                    continue  # ENOENT: the request went away (interrupted) while being read
                self._handle(view[:length])
        except OSError:
            return  # ENODEV, ECONNABORTED: the connection is gone; EBADF: released (at exit) under our feet
    def _handle(self, message: memoryview) -> None:
        _, opcode, unique, nodeid, _, _, _, _ = FUSE_IN_HEADER.unpack_from(message)
        body = message[FUSE_IN_HEADER.size:]
        with self._lock:
            self.requests[OPCODE_NAMES.get(opcode, str(opcode))] += 1
            frozen = self._frozen
        if frozen or opcode in NO_REPLY:
            return  # frozen (swallowing): taken off the queue, never answered
        try:
            error, payload = self._answer(opcode, nodeid, body)
        except Exception:  # a bug here must not kill the daemon and hang every caller
            error, payload = errno.EIO, b""
        self._reply(unique, error, payload)

    def _reply(self, unique: int, error: int, payload: bytes = b"") -> None:
        if error:
            payload = b""
        # OSError: ENOENT where the caller was interrupted and the kernel forgot the request, ENODEV once aborted.
        with contextlib.suppress(OSError):
            os.write(self._fd, FUSE_OUT_HEADER.pack(FUSE_OUT_HEADER.size + len(payload), -error, unique) + payload)

    def _answer(self, opcode: int, nodeid: int, body: memoryview) -> tuple[int, bytes]:
        """``(errno, reply payload)`` of one request."""
        if opcode == FUSE_INIT:
            return self._init(body)
        if opcode == FUSE_LOOKUP:
            name = bytes(body).split(b"\0", 1)[0].decode(errors="surrogateescape")
            if nodeid != FUSE_ROOT_ID or name not in self._nodes:
                return errno.ENOENT, b""
            node = self._nodes[name]
            # entry_valid = attr_valid = 0: the kernel trusts neither the name nor the attributes for any time
            # and asks again on the next look-up or stat().
            return 0, FUSE_ENTRY_OUT.pack(node, 0, 0, 0, 0, 0) + self._attr(node)
        if opcode == FUSE_GETATTR:
            if nodeid != FUSE_ROOT_ID and nodeid not in self._by_node:
                return errno.ENOENT, b""
            return 0, FUSE_ATTR_OUT.pack(0, 0, 0) + self._attr(nodeid)
        if opcode == FUSE_OPEN:
            flags, _ = FUSE_OPEN_IN.unpack_from(body)
            if nodeid not in self._by_node:
                return errno.EISDIR if nodeid == FUSE_ROOT_ID else errno.ENOENT, b""
            if flags & os.O_ACCMODE != os.O_RDONLY or flags & os.O_TRUNC:
                return errno.EROFS, b""
            return 0, FUSE_OPEN_OUT.pack(nodeid, 0, 0)
        if opcode == FUSE_OPENDIR:
            if nodeid != FUSE_ROOT_ID:
                return errno.ENOTDIR, b""
            return 0, FUSE_OPEN_OUT.pack(0, 0, 0)
        if opcode == FUSE_READ:
            _, offset, size, _, _, _, _ = FUSE_READ_IN.unpack_from(body)
            if nodeid not in self._by_node:
                return errno.EBADF, b""
            end = min(offset + size, self.files[self._by_node[nodeid]])
            return 0, content(offset, end - offset)  # short (or empty) at the end of the file: EOF
        if opcode == FUSE_READDIR:
            _, offset, size, _, _, _, _ = FUSE_READ_IN.unpack_from(body)
            return 0, self._readdir(offset, size)
        if opcode in (FUSE_RELEASE, FUSE_RELEASEDIR, FUSE_FLUSH, FUSE_ACCESS, FUSE_DESTROY):
            return 0, b""
        if opcode == FUSE_STATFS:
            blocks = sum((size + BLOCK - 1) // BLOCK for size in self.files.values())
            return 0, FUSE_KSTATFS.pack(blocks, 0, 0, len(self.files) + 1, 0, BLOCK, 255, BLOCK, 0)
        if opcode == FUSE_GETXATTR:
            return errno.ENODATA, b""
        if opcode in (FUSE_WRITE, FUSE_SETATTR, FUSE_CREATE, FUSE_SETXATTR, FUSE_REMOVEXATTR):
            return errno.EROFS, b""
        # LISTXATTR, READDIRPLUS (never negotiated), FSYNC, locks ...: ENOSYS, after which the kernel stops asking
        # for most of them.
        return errno.ENOSYS, b""

    def _init(self, body: memoryview) -> tuple[int, bytes]:
        major, minor, max_readahead, _flags = FUSE_INIT_IN.unpack_from(body)
        if major != FUSE_KERNEL_VERSION:
            # A kernel of a newer major would take our major and send INIT again; none exists.  Refuse.
            return errno.EPROTO, b""
        self.kernel_protocol = (major, minor)
        minor = min(minor, FUSE_KERNEL_MINOR_VERSION)
        self.protocol = (major, minor)
        self._initialized.set()
        # flags 0: none of the optional features (no async reads, no readdirplus, no writeback cache, no
        # max_pages), so the kernel asks the plainest questions.  max_background and congestion_threshold 0: the
        # kernel's defaults.  time_gran 1 ns.
        return 0, FUSE_INIT_OUT.pack(FUSE_KERNEL_VERSION, minor, min(max_readahead, MAX_READAHEAD), 0, 0, 0,
                                     MAX_WRITE, 1, 0, 0, 0)

    def _attr(self, node: int) -> bytes:
        if node == FUSE_ROOT_ID:
            mode, size, nlink = stat.S_IFDIR | 0o555, BLOCK, 2
        else:
            mode, size, nlink = stat.S_IFREG | 0o444, self.files[self._by_node[node]], 1
        blocks = (size + 511) // 512  # st_blocks counts 512-byte units
        return FUSE_ATTR.pack(node, size, blocks, 0, 0, 0, 0, 0, 0, mode, nlink, 0, 0, 0, BLOCK, 0)

    def _readdir(self, offset: int, size: int) -> bytes:
        # Each entry's off is the offset of the one after it: the kernel passes it back to continue a listing.
        entries = [(FUSE_ROOT_ID, ".", DT_DIR), (FUSE_ROOT_ID, "..", DT_DIR)]
        entries += [(self._nodes[name], name, DT_REG) for name in self._names]
        out = bytearray()
        for index in range(offset, len(entries)):
            node, name, kind = entries[index]
            encoded = name.encode(errors="surrogateescape")
            record = FUSE_DIRENT.pack(node, index + 1, len(encoded), kind) + encoded
            record += b"\0" * (-len(record) % 8)
            if len(out) + len(record) > size:
                break
            out += record
        return bytes(out)


class _Resources:
    """What a FuseStub must give back, each exactly once (a descriptor closed twice could be another's by then);
    kept apart from the stub so that weakref.finalize can release them without keeping the stub alive."""

    def __init__(self, fd: int, wake_r: int, wake_w: int, mountpoint: str) -> None:
        self.fd, self.wake, self.mountpoint = fd, [wake_r, wake_w], mountpoint
        self.closing = False  # tells the daemon thread to stop, where nobody called close() (at exit)

    def abort(self) -> None:
        # Closing the last /dev/fuse file aborts the connection: every request waiting for an answer ends with
        # ECONNABORTED and every later one fails with ENOTCONN, so nothing blocks on this mount any more.
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)

    def release(self) -> None:
        self.closing = True
        if self.wake:
            with contextlib.suppress(OSError):
                os.write(self.wake[1], b"x")
        self.abort()
        wake, self.wake = self.wake, []
        for fd in wake:
            os.close(fd)
        # Lazy: a mount still in use (an open file) can't be unmounted now; detached, it goes once unused.
        _umount_lazy(self.mountpoint)


@pytest.fixture
def fuse_stub() -> Iterator[Callable[..., FuseStub]]:
    """A factory of mounted FuseStubs, ``fuse_stub(files={...})``, each under a fresh directory and each closed
    (connection aborted, mount detached) when the test ends, pass or fail.  Skips where FUSE can't be mounted."""
    reason = unavailable()
    if reason:
        pytest.skip(reason)
    stubs: list[FuseStub] = []

    def make(files: Mapping[str, int] | None = None, subtype: str = "gpuio-stub") -> FuseStub:
        # Not under pytest's basetemp: pytest walks that tree at the end of the session, and must never find a
        # live mount there, should one outlive its test.
        directory = tempfile.mkdtemp(prefix="gpuio-fuse-stub-")
        try:
            stub = FuseStub(directory, files, subtype)
        except BaseException:
            os.rmdir(directory)
            raise
        stubs.append(stub)
        return stub

    try:
        yield make
    finally:
        for stub in stubs:
            stub.close()
            with contextlib.suppress(OSError):  # still busy, which would be a bug of the stub: leave it be
                os.rmdir(stub.mountpoint)
