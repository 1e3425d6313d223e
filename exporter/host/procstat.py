"""/proc/<pid>/stat, read once for the whole exporter: its own process metrics, smartctl's process
table and the start time that identifies a spool writer; the bounded reading of a number any kernel
file writes (``whole_number``) and of a file (``read_at_most``, ``read_bounded``, ``read_regular_file``).

The command name (field 2) is in parentheses and may itself hold spaces and parentheses, so the
fields are split after its last ")".  (gpuio, the instrumentation library, has its own few lines
for its own start time: it imports nothing of the exporter.)
"""

from __future__ import annotations

import errno
import os
import stat

# Indexes into stat_fields(), i.e. field number (proc(5), from 1) minus 3.
STATE, PPID, SESSION = 0, 1, 3
UTIME, STIME, THREADS, START_TIME, VSIZE, RSS = 11, 12, 17, 19, 20, 21


# The most digits of a number a kernel file writes (a u64 has 20): a longer one is a bad line, never an int()
# that takes time or raises past Python's 4,300-digit limit and fails a whole collector.
MAX_DIGITS = 20


def whole_number(text: str) -> int | None:
    """A non-negative ASCII integer of at most MAX_DIGITS digits, or None (isdigit() alone accepts '²' and
    other Unicode digits that int() refuses)."""
    return int(text) if len(text) <= MAX_DIGITS and text.isascii() and text.isdigit() else None


def read_at_most(fd: int, limit: int) -> bytes:
    """Up to ``limit + 1`` bytes from ``fd``: whether there were more than ``limit`` shows, and a file that
    never ends (/dev/zero, a sysfs file gone mad) costs no more."""
    chunks: list[bytes] = []
    size = 0
    while size <= limit:
        chunk = os.read(fd, limit + 1 - size)
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)


def read_bounded(path: str, limit: int) -> tuple[str, bool] | None:
    """At most ``limit`` bytes of a kernel file as text, and whether there was more; None when it cannot be
    read (gone with its process or cgroup, no such file here, unreadable).  A symlink is not followed."""
    read = read_bounded_bytes(path, limit)
    return None if read is None else (read[0].decode("ascii", "replace"), read[1])


def read_bounded_bytes(path: str, limit: int) -> tuple[bytes, bool] | None:
    """:func:`read_bounded` as the bytes the kernel gave (a process's maps or environ name files in bytes)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        data = read_at_most(fd, limit)
    except OSError:
        return None  # ENODEV and the like: the cgroup or process went after the open
    finally:
        os.close(fd)
    return data[:limit], len(data) > limit


def stat_fields(pid: int | str = "self", procfs: str = "/proc") -> list[bytes]:
    """The fields of /proc/<pid>/stat after the command name: the state first.  OSError if the
    process is gone or unreadable; ValueError if the file is not of that shape."""
    with open(f"{procfs}/{pid}/stat", "rb") as handle:
        text = handle.read()
    return text[text.rindex(b")") + 2 :].split()


def start_ticks(pid: int | str = "self", procfs: str = "/proc") -> int:
    """When the process started, in clock ticks since boot; 0 if unknown."""
    try:
        return int(stat_fields(pid, procfs)[START_TIME])
    except (OSError, ValueError, IndexError):
        return 0


def read_regular_file(path: str, limit: int) -> bytes:
    """A regular file's first ``limit`` bytes; OSError for anything else.

    Opened non-blocking: open() of a FIFO with no writer would otherwise wait forever (and a device
    node may block or never end).  What is not a regular file is refused before a byte is read.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = ("a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode)
                    else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "a socket")
            raise OSError(errno.EINVAL, f"not a regular file but {kind}")
        return read_at_most(fd, limit)
    finally:
        os.close(fd)
