"""Parsing one spool file no one trusts: its header, its records, each file's own budgets.

Bounded whatever the writer put there (FileLimits): bytes parsed, entries, distinct engines and devices,
and per engine what the library itself would write; no NaN, infinity, negative or past-2**53 value is
ever parsed.  The reading of files and directories is :mod:`exporter.engines.spool`'s.
"""

from __future__ import annotations

import math
import struct
import typing
from dataclasses import dataclass, field

from gpuio.spool import (
    DEFAULT_FILE_BYTES,
    ENGINE_LAYOUT,
    HEADER,
    HEADER_SIZE,
    INFO_STRUCT,
    KIND_ENGINE,
    KIND_ERROR,
    KIND_INFO,
    KIND_LAYER,
    KIND_LOAD,
    KIND_MOUNT,
    KIND_POD,
    KIND_WATERFALL,
    KINDS,
    LOAD_SLOTS,
    MAGIC,
    MAX_KEY_BYTES,
    MAX_PATH_BYTES,
    MAX_POD_NAME_BYTES,
    MAX_RECORD_BYTES,
    MAX_SHORT_BYTES,
    MOUNT_STRUCT,
    POD_STRUCT,
    RECORD_HEAD,
    VERSION,
    WATERFALL_COUNTERS,
    WATERFALL_SLOTS,
    pad8,
)

from ..host import hosttext, procstat
from .model import EngineInfo, LoadKey, MountKey, PodIdentity, WriterMount, bucket_values

MAX_VALUE = 2.0**53


@dataclass
class Parsed:
    """The content of one spool file."""

    pid: int
    start_ticks: int
    instance: int
    dropped: int
    engines: dict[str, list[float]] = field(default_factory=dict)
    errors: dict[tuple[str, str], float] = field(default_factory=dict)
    layers: dict[tuple[str, str], list[float]] = field(default_factory=dict)
    infos: dict[str, EngineInfo] = field(default_factory=dict)
    loads: dict[LoadKey, list[float]] = field(default_factory=dict)  # LOAD records, LOAD_SLOTS each
    waterfalls: dict[str, list[float]] = field(default_factory=dict)  # WATERFALL records by engine
    mounts: dict[MountKey, WriterMount] = field(default_factory=dict)
    pod: PodIdentity | None = None  # the POD record, where the writer made one
    unknown_records: int = 0  # well-framed records of kinds this reader does not know (a newer library)
    bad_record: bool = False
    # Records the file's budgets left out (FileLimits); past the parse budget, the rest of the file counts as one.
    left_out: int = 0


@dataclass(frozen=True)
class FileLimits:
    """What one spool file may make the reader parse per read and keep.  A real process stays far
    below every one of these (a few engines, one file system or two); a writer past them loses its
    own further records (``Parsed.left_out``), never a neighbour's."""

    # Bytes of records parsed per read, each record counted as at least MIN_RECORD_COST (what walking
    # a record costs, however small): the library's whole file, and a quarter of a read's parse budget.
    parse_bytes: int = DEFAULT_FILE_BYTES
    entries: int = 4096  # engines, error reasons, layers, infos, loads, waterfalls and mounts kept
    engines: int = 256  # distinct engine names, whatever the kinds of records that name them
    # Distinct st_devs named by INFO, MOUNT and LOAD records: each one the exporter may look up (its
    # disk, its mount), so 12,000 INFO records naming 12,000 devices cost what 64 do.
    devices: int = 64
    # Per engine: loads and mounts, what the library itself writes at most; error reasons and layers,
    # twice what the collector serves per engine (the library writes 17 and its top-K + 1), so that
    # the collector's own caps, and what they count as dropped, still choose among a file's series.
    errors_per_engine: int = 64
    layers_per_engine: int = 128
    loads_per_engine: int = 16
    mounts_per_engine: int = 16


FILE_LIMITS = FileLimits()
MIN_RECORD_COST = 64


class FileBudget:
    """What one file may still add while it is parsed (see FileLimits).  Decided in file order, so an
    append-only writer's records keep their place read after read: a record kept once is kept again."""

    def __init__(self, limits: FileLimits, parsed: Parsed) -> None:
        self.limits = limits
        self.parsed = parsed
        self.bytes_left = limits.parse_bytes  # parse() charges each record, at least MIN_RECORD_COST
        self.entries = 0
        self.engines: set[str] = set()
        self.devices: set[tuple[int, int]] = set()
        self.per_engine: dict[tuple[int, str], int] = {}  # (kind, engine) -> entries kept

    def admit(self, table: typing.Mapping[typing.Any, object], key: object, kind: int, engine: str,
              device: tuple[int, int] | None = None, per_engine: int | None = None) -> bool:
        """Whether a record may set ``table[key]``: one already kept may change (the last record of a key
        wins), a new one only within the file's limits; ``per_engine``: the cap of this kind per engine.
        False counts the record as left out."""
        limits = self.limits
        if device is not None and device not in self.devices and len(self.devices) >= limits.devices:
            return self._leave_out()
        if key not in table:
            if (self.entries >= limits.entries
                    or (engine not in self.engines and len(self.engines) >= limits.engines)
                    or (per_engine is not None and self.per_engine.get((kind, engine), 0) >= per_engine)):
                return self._leave_out()
            self.entries += 1
            self.engines.add(engine)
            if per_engine is not None:
                self.per_engine[(kind, engine)] = self.per_engine.get((kind, engine), 0) + 1
        if device is not None:
            self.devices.add(device)
        return True

    def _leave_out(self) -> bool:
        self.parsed.left_out += 1
        return False


class BadFile(ValueError):
    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


def parse_header(data: bytes) -> tuple[int, int, int, int, int]:
    """``(used, pid, start_ticks, instance, dropped)``, or BadFile with a spool-errors reason."""
    if not data:
        raise BadFile("empty", "zero-byte file")
    if len(data) < HEADER.size:
        raise BadFile("truncated", f"{len(data)} bytes, shorter than the header")
    magic, version, header_size, size, used, pid, _, ticks, _, instance, dropped, _ = HEADER.unpack_from(data)
    if magic != MAGIC:
        raise BadFile("garbage", "not a gpuio spool file (bad magic)")
    if version != VERSION:
        raise BadFile("version", f"spool format version {version}, this exporter reads {VERSION}")
    if header_size != HEADER_SIZE or not HEADER_SIZE <= used <= size or size % 8:
        raise BadFile("garbage", f"inconsistent header (header {header_size}, used {used}, size {size})")
    if used > len(data):
        raise BadFile("truncated", f"header says {used} bytes are in use, the file has {len(data)}")
    return used, pid, ticks, instance, dropped


def instance_of(header: bytes) -> int | None:
    """The writer's instance id in a spool header, None where ``header`` is not one."""
    if len(header) < HEADER.size or header[:8] != MAGIC:
        return None
    return typing.cast("int", HEADER.unpack_from(header)[9])


def parse(data: bytes, limits: FileLimits = FILE_LIMITS) -> Parsed:
    """Parse a whole spool file (``data`` at least up to its ``used`` offset).

    Records are checked one by one; at the first one that makes no sense parsing stops, keeps what
    came before and sets ``bad_record`` (a file is never trusted past garbage).  Well-formed records
    past the file's ``limits`` are left out and counted (``left_out``).
    """
    used, pid, ticks, instance, dropped = parse_header(data)
    parsed = Parsed(pid, ticks, instance, dropped)
    budget = FileBudget(limits, parsed)
    view = memoryview(data)
    offset = HEADER_SIZE
    while offset < used:
        if offset + RECORD_HEAD.size > used:
            parsed.bad_record = True
            break
        size, kind, key_len = RECORD_HEAD.unpack_from(data, offset)
        payload = offset + RECORD_HEAD.size + pad8(key_len)
        if (size % 8 or size < RECORD_HEAD.size or size > MAX_RECORD_BYTES or offset + size > used
                or kind == 0 or key_len > MAX_KEY_BYTES or payload > offset + size):
            parsed.bad_record = True
            break
        budget.bytes_left -= size if size > MIN_RECORD_COST else MIN_RECORD_COST  # inline: once per record
        if budget.bytes_left < 0:
            parsed.left_out += 1  # the rest of the file, unread
            break
        if kind not in KINDS:
            # A kind of a newer library, well framed: skipped, so that a library upgraded before the
            # exporter costs only what the exporter cannot show yet, not the records after it.
            parsed.unknown_records += 1
            offset += size
            continue
        try:
            key = hosttext.decode(view[offset + RECORD_HEAD.size : offset + RECORD_HEAD.size + key_len])
            _parse_record(budget, kind, key, view[payload : offset + size])
        except (ValueError, struct.error):
            parsed.bad_record = True
            break
        offset += size
    return parsed


# The longest strings the library writes: namespace, pod, container, UID; mount point, fstype, source, layer.
POD_LIMITS = (MAX_POD_NAME_BYTES, MAX_POD_NAME_BYTES, MAX_POD_NAME_BYTES, MAX_SHORT_BYTES)
MOUNT_LIMITS = (MAX_PATH_BYTES, MAX_SHORT_BYTES, MAX_PATH_BYTES, MAX_PATH_BYTES)


def _parse_mount(budget: FileBudget, key: str, payload: memoryview) -> None:
    engine, _, dev = key.partition("\0")
    major, colon, minor = dev.partition(":")
    if not engine or not colon or not (major + minor).isascii() or not major.isdigit() or not minor.isdigit():
        raise ValueError("bad MOUNT key")
    lengths = MOUNT_STRUCT.unpack_from(payload)
    if MOUNT_STRUCT.size + sum(lengths) > len(payload):
        raise ValueError("MOUNT strings overrun the record")
    if any(length > limit for length, limit in zip(lengths, MOUNT_LIMITS, strict=True)):
        raise ValueError("MOUNT string longer than the library writes")
    mounts, device = budget.parsed.mounts, (int(major), int(minor))
    if not budget.admit(mounts, (engine, device), KIND_MOUNT, engine, device, budget.limits.mounts_per_engine):
        return
    text, start, parts = bytes(payload), MOUNT_STRUCT.size, []
    for length in lengths:
        parts.append(hosttext.decode(text[start : start + length]))
        start += length
    mounts[(engine, device)] = WriterMount(*parts)


def _parse_pod(parsed: Parsed, payload: memoryview) -> None:
    lengths = POD_STRUCT.unpack_from(payload)
    if POD_STRUCT.size + sum(lengths) > len(payload):
        raise ValueError("POD strings overrun the record")
    # Label values of every series of the writer's engines: never longer than the library writes them
    # (what Kubernetes allows), or one record of 64 KiB names makes each of those series 64 KiB.
    if any(length > limit for length, limit in zip(lengths, POD_LIMITS, strict=True)):
        raise ValueError("POD string longer than Kubernetes allows")
    text, offset = bytes(payload[POD_STRUCT.size :]), 0
    values = []
    for length in lengths:
        values.append(hosttext.decode(text[offset : offset + length]))
        offset += length
    parsed.pod = PodIdentity(*values)


def _parse_info(budget: FileBudget, key: str, payload: memoryview) -> None:
    cuda, major, minor, ino, size, mtime_ns, load_time, n_path, n_uuid, n_runtime = INFO_STRUCT.unpack_from(payload)
    start = INFO_STRUCT.size
    if start + n_path + n_uuid + n_runtime > len(payload):
        raise ValueError("INFO strings overrun the record")
    infos = budget.parsed.infos
    if not budget.admit(infos, key, KIND_INFO, key, (major, minor)):
        return  # decided before the strings are decoded: a flood of INFO records costs little
    text = bytes(payload[start : start + n_path + n_uuid + n_runtime])
    path, uuid, runtime = (hosttext.decode(part) for part in
                           (text[:n_path], text[n_path : n_path + n_uuid], text[n_path + n_uuid :]))
    infos[key] = EngineInfo(path, cuda, uuid, runtime, (major, minor), ino, size, mtime_ns, load_time)


def _parse_record(budget: FileBudget, kind: int, key: str, payload: memoryview) -> None:
    if kind == KIND_MOUNT:
        _parse_mount(budget, key, payload)
    elif kind == KIND_POD:
        _parse_pod(budget.parsed, payload)
    elif kind == KIND_INFO:
        _parse_info(budget, key, payload)
    else:
        _parse_values(budget, kind, key, typing.cast("list[float]", payload.cast("d").tolist()))  # not list[int]


def _parse_values(budget: FileBudget, kind: int, key: str, values: list[float]) -> None:
    """A record of doubles: ENGINE, LOAD, WATERFALL, ERROR or LAYER."""
    # What the library never writes, and what would break the exposition or the merged totals: NaN or
    # infinity, a negative value (a counter that went down reads as a reset), one past 2**53 (where
    # doubles stop counting by ones; a sum of such values over many files could overflow).
    if values and (not math.isfinite(sum(values)) or min(values) < 0 or max(values) > MAX_VALUE):
        raise ValueError("value out of range in a record")
    parsed, limits = budget.parsed, budget.limits
    if kind == KIND_ENGINE:
        if len(values) < ENGINE_LAYOUT.size or not key:
            raise ValueError("short ENGINE record")
        if not all(map(float.is_integer, bucket_values(values))):
            raise ValueError("a histogram bucket that is not a whole count")
        if budget.admit(parsed.engines, key, kind, key):
            parsed.engines[key] = values[: ENGINE_LAYOUT.size]
        return
    if kind == KIND_LOAD:
        _parse_load(budget, key, values)
        return
    if kind == KIND_WATERFALL:
        if len(values) < len(WATERFALL_SLOTS) or not key:
            raise ValueError("short WATERFALL record")
        values = values[: len(WATERFALL_SLOTS)]
        if values[0] != values[-1]:  # copied mid-update: no last load from this copy (see settle_waterfalls)
            values[len(WATERFALL_COUNTERS) : -1] = [0.0] * (len(values) - 1 - len(WATERFALL_COUNTERS))
        if budget.admit(parsed.waterfalls, key, kind, key):
            parsed.waterfalls[key] = values
        return
    engine, _, label = key.partition("\0")
    if not engine or not label:
        raise ValueError("record key without engine and label")
    if kind == KIND_ERROR and values:
        if budget.admit(parsed.errors, (engine, label), kind, engine, per_engine=limits.errors_per_engine):
            parsed.errors[(engine, label)] = values[0]
    elif kind == KIND_LAYER and len(values) >= 2:
        if budget.admit(parsed.layers, (engine, label), kind, engine, per_engine=limits.layers_per_engine):
            parsed.layers[(engine, label)] = values[:2]
    else:
        raise ValueError("short record")


def _parse_load(budget: FileBudget, key: str, values: list[float]) -> None:
    engine, uuid, dev = key.split("\0") if key.count("\0") == 2 else ("", "", "")
    major, colon, minor = dev.partition(":")
    numbers = (procstat.whole_number(major), procstat.whole_number(minor))
    if not engine or not colon or numbers[0] is None or numbers[1] is None or len(values) < len(LOAD_SLOTS):
        raise ValueError("bad LOAD record")
    device = (numbers[0], numbers[1])
    loads = budget.parsed.loads
    if budget.admit(loads, (engine, uuid, device), KIND_LOAD, engine, device, budget.limits.loads_per_engine):
        loads[(engine, uuid, device)] = values[: len(LOAD_SLOTS)]
