"""The model files a process maps: /proc/<pid>/maps, for loaders that never keep a descriptor open.

safetensors' Rust loader and llama.cpp map a checkpoint (``mmap``), close its descriptor and copy the
tensors out of the mapping: the read goes through page faults, and no descriptor position moves.  The
kernel still lists each mapping with the file's device, inode and path (as the process names it), and the
process's read_bytes grows while the faults read the file from the disk.

Reading another process's maps takes its memory-map lock (shared), which a process stuck in a page fault on
a dead network or FUSE mount may hold for ever behind a writer: the caller reads it where the wait can be
abandoned.  The text is bounded (MAPS_BYTES: a CUDA process maps a few thousand regions, ~300 KB); a table
longer than that is read in part, and said so.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..host import hosttext, procstat

MAPS_BYTES = 2 << 20  # what one read of a process's maps takes at most


@dataclass(frozen=True)
class Mapped:
    """One file a process maps, over all its mappings."""

    path: str  # as the process names it
    dev: tuple[int, int]  # (major, minor) of the file's device
    ino: int
    extent: int  # the furthest byte of the file mapped (offset + length): its size, where mapped whole


def read_maps(procfs: str, pid: int, limit: int = MAPS_BYTES) -> tuple[bytes, bool] | None:
    """The process's maps (at most ``limit`` bytes) and whether there was more; None when it is gone or may
    not be read."""
    return procstat.read_bounded_bytes(f"{procfs}/{pid}/maps", limit)


def mapped_files(text: bytes, wanted: Callable[[str], bool],
                 within: tuple[bytes, ...] = (b"/",)) -> dict[tuple[tuple[int, int], int], Mapped]:
    """The files of ``text`` (a maps table) whose path ``wanted`` takes, by (device, inode); only the lines
    holding one of ``within`` (the directories looked under: most of a CUDA process's thousands of mappings
    are anonymous or its libraries, skipped without being parsed) are parsed.  A line cut by the bound, a
    deleted file or a line of another shape is left out."""
    found: dict[tuple[tuple[int, int], int], Mapped] = {}
    for line in _lines_holding(text, within):
        parsed = _parse_line(line)
        if parsed is None or not wanted(parsed.path):
            continue
        key = (parsed.dev, parsed.ino)
        known = found.get(key)
        if known is None or parsed.extent > known.extent:
            found[key] = parsed
    return found


def _lines_holding(text: bytes, within: tuple[bytes, ...]) -> list[bytes]:
    """The lines of ``text`` holding one of ``within``, found by searching for them (not by splitting every
    line: a process's maps run to thousands of lines, a handful of them model files)."""
    lines: dict[int, bytes] = {}
    for directory in within:
        at = text.find(directory) if directory else -1
        while at >= 0:
            begin = text.rfind(b"\n", 0, at) + 1
            end = text.find(b"\n", at)
            end = len(text) if end < 0 else end
            lines[begin] = text[begin:end]
            at = text.find(directory, end)
    return [lines[begin] for begin in sorted(lines)]


def _parse_line(line: bytes) -> Mapped | None:
    """``start-end perms offset major:minor inode path`` (hex but the inode), or None."""
    fields = line.split(maxsplit=5)
    if len(fields) < 6 or not fields[5].startswith(b"/") or fields[5].endswith(b" (deleted)"):
        return None
    span, _, offset, device, inode, path = fields
    low, _, high = span.partition(b"-")
    major, _, minor = device.partition(b":")
    try:
        start, end, at = int(low, 16), int(high, 16), int(offset, 16)
        dev, ino = (int(major, 16), int(minor, 16)), int(inode)
    except ValueError:
        return None
    if ino <= 0 or end <= start:
        return None
    return Mapped(hosttext.decode(path), dev, ino, at + end - start)
