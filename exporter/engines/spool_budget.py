"""What one read of the spool may spend, and which files wait for the next one.

A spool writer is untrusted input: it chooses how big its file claims to be, how much of it is
"used", how many files it makes and how often it changes them.  One read() reads at most
SCRAPE_READ_BYTES and parses at most SCRAPE_PARSE_BYTES; the parsed content kept for live files comes
from at most RETAINED_BYTES of them.  Files past that keep their last values and are read at a later
call, live files first, in turn (ReadBudget.visit_order).
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable, Container, Iterable

from gpuio.spool import HEADER_SIZE, MAGIC, USED_OFFSET

from .spool_files import FileState

SCRAPE_READ_BYTES = 16 << 20  # bytes read from spool files per read()
SCRAPE_PARSE_BYTES = 4 << 20  # bytes of changed content parsed per read() (~35 ms per MiB here)
RETAINED_BYTES = 8 << 20  # bytes of live files whose parsed content the reader keeps (~4x in Python objects)
# A real process's file holds a few engines: a few KiB.  Files above this may take only half of
# RETAINED_BYTES, so a few big files cannot keep the small ones out.
SMALL_FILE_BYTES = 64 << 10


class ReadBudget:
    """What is left of one read()'s work (bytes read, bytes parsed, memory for the parsed content of live
    files), and the files it had no budget for, which the next read() looks at first."""

    def __init__(self) -> None:
        self.read = 0
        self.parse = 0
        self.retained_bytes = RETAINED_BYTES
        self.retained = {False: 0, True: 0}  # parsed content kept for live files, small and big apart
        self.deferred_now = 0  # files this read() had no room for once opened
        self.resume_at = ""  # the first file the last read() had no budget for: the next one starts there
        self.waiting: set[str] = set()  # the files the last read() had no budget for: the next one reads them first

    def start(self, read: int, parse: int, retained_bytes: int, live: Iterable[FileState]) -> None:
        """This read's budgets: bytes read, bytes parsed, and the memory the parsed content of live files
        already takes (small and big files apart)."""
        self.read, self.parse, self.retained_bytes = read, parse, retained_bytes
        self.retained = {False: 0, True: 0}
        for state in live:
            self.retained[state.used > SMALL_FILE_BYTES] += state.used
        self.deferred_now = 0

    def visit_order(self, names: set[str], named: Container[str]) -> list[str]:
        """The files the last read() had no budget for first, live or not (so that live files changing at
        every read cannot keep a new writer waiting for ever), then the other live files (``named``: their
        values go stale when skipped), then the rest; each group in name order, starting at the first file
        the last read() had no budget left for, so all get their turn."""
        def turn(group: list[str]) -> list[str]:
            group.sort()
            after = [name for name in group if name >= self.resume_at]
            return after + group[: len(group) - len(after)]
        waiting = self.waiting
        return (turn([n for n in names if n in waiting]) + turn([n for n in names if n in named and n not in waiting])
                + turn([n for n in names if n not in named and n not in waiting]))

    def affordable(self, state: FileState, data: bytes, digest: bytes, gone: bool, parse_limit: int) -> bool:
        """Whether parsing ``data`` (if changed) fits this read's parse budget and the memory kept for
        live files (not for a dead writer's file: it is folded and let go at once); charges the parse
        budget with what the file's own limit (``parse_limit``) lets it cost.  A file that does not fit
        waits (``deferred_files``)."""
        if state.parsed is not None and digest == state.digest:
            return True
        cost = min(len(data), parse_limit)
        if cost > self.parse or (not gone and not self._room_to_keep(state, len(data))):
            self.deferred_now += 1
            return False
        self.parse -= cost
        if state.parsed is not None:  # its last content is let go: counted once, not twice, till the next read()
            self.retained[state.used > SMALL_FILE_BYTES] -= state.used
        self.retained[len(data) > SMALL_FILE_BYTES] += len(data)
        return True

    def fits_new(self, used: int) -> bool:
        """Whether a new live file of ``used`` bytes could be kept now (see read_file)."""
        if self._room_to_keep(None, used):
            return True
        self.deferred_now += 1
        return False

    def _room_to_keep(self, state: FileState | None, size: int) -> bool:
        """Whether the parsed content of ``size`` bytes of a live file fits the memory kept for live files
        (files over SMALL_FILE_BYTES take at most half of it), ``state``'s own content aside."""
        big = size > SMALL_FILE_BYTES
        own = state.used if state is not None and (state.used > SMALL_FILE_BYTES) == big else 0
        allowance = self.retained_bytes // 2 if big else self.retained_bytes - self.retained[True]
        return self.retained[big] - own + size <= allowance

    def read_file(self, fd: int, hint: int, max_file_bytes: int,
                  fits: Callable[[int], bool] | None = None) -> bytes | str | None:
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
                if used > max_file_bytes or size > max_file_bytes:
                    return "oversized"
                if fits is not None and not fits(used):
                    self.read -= max(len(data), 4096)
                    return None
                if len(data) < used:
                    data += os.pread(fd, used - len(data), len(data))
                if HEADER_SIZE <= used <= len(data):
                    data = data[:used]
        except OSError:
            return "io"
        self.read -= max(len(data), 4096)
        return data
