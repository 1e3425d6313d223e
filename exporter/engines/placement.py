"""Which GPUs a model is on, for a process NVML lists on several GPUs (issue 41).

NVML says which GPUs a process holds a context on, not which of them a model file it reads is for: one
Triton Inference Server holds every GPU of the node and loads each model where its configuration says.
Without more, such a process's engines had no GPU and no alert could name one.  A model is placed, in
this order (:func:`place`):

1. **config** -- Triton's model configuration beside the file (``<repo>/<model>/config.pbtxt`` for the
   model file ``<repo>/<model>/<version>/model.plan``): its ``instance_group`` entries say on which of the
   process's CUDA devices the model's instances run (``gpus: [0, 1]``); a group without ``gpus``, or no
   ``instance_group`` at all, means every GPU the process sees; ``KIND_CPU`` no GPU; ``KIND_MODEL`` the
   backend decides (unknown).  Triton's docs: model_config.proto, ``ModelInstanceGroup``.
2. **memory** -- the GPUs the process's used memory (NVML's per-process ``usedGpuMemory``) grew on while
   the file was read (:func:`grew_on`).
3. **process** -- every GPU NVML lists the process on.

CUDA device ordinals are the process's own: ``gpus: [0]`` is the first GPU its ``CUDA_VISIBLE_DEVICES``
leaves visible (:func:`visible_gpus`), read from ``/proc/<pid>/environ`` (:func:`read_cuda_environ`).
Assumed: CUDA enumerates the GPUs in NVML's index order, which is PCI bus order.  That is CUDA's order
under ``CUDA_DEVICE_ORDER=PCI_BUS_ID``, and under its default ``FASTEST_FIRST`` too on a node of one GPU
model (ties are broken by PCI bus id); a node mixing GPU models may order them otherwise.  The environment
is the one the process started with: a process that sets ``CUDA_VISIBLE_DEVICES`` itself before CUDA
starts is not seen doing so (placing on the GPUs NVML lists it on catches most such mistakes, see
:func:`place`).

Everything read here is untrusted (a tenant writes config.pbtxt and chooses its environment): the
parser is bounded in bytes, tokens, nesting and entries, and anything it does not understand gives
None ("unknown": the next way of placing is used), never an exception out of this module.

Two reads here may wait for ever, so callers run them where the wait can be abandoned
(:class:`exporter.host.abandonable.Abandonable`): :class:`ConfigReader` opens a file on whatever mount the
model repository is on (a dead NFS export, a hung FUSE daemon), and :func:`read_cuda_environ` reads
``/proc/<pid>/environ``, which takes the process's memory lock (held for as long as the process is stuck
in a page fault on such a mount).  Both are plain calls; neither starts a thread.
"""

from __future__ import annotations

import os
import re
import stat
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ..host import procstat

MAX_CONFIG_BYTES = 64 << 10  # a config.pbtxt bigger than this is not read (a real one is a few KiB)
MAX_TOKENS = 32_768  # of one config (a 64 KiB file of one-character tokens and blanks at most)
MAX_DEPTH = 32  # nested messages and lists (Triton's deepest config is ~6)
MAX_GROUPS = 256  # instance_group entries
MAX_GPU_ENTRIES = 1024  # gpus entries, all groups together
MAX_ORDINAL = 1 << 16  # a CUDA ordinal above this is no GPU of any node
MAX_PATH_COMPONENTS = 64
MAX_CACHED_CONFIGS = 1024
MAX_ENVIRON_BYTES = 256 << 10  # of /proc/<pid>/environ (ARG_MAX-sized environments exist, but rarely)
MIN_GROWTH_BYTES = 16 << 20  # memory growth smaller than this places nothing (allocator noise)
GROWTH_SHARE = 0.5  # a GPU whose growth is at least this share of the largest is one the model went to

KINDS = ("KIND_AUTO", "KIND_GPU", "KIND_CPU", "KIND_MODEL")  # model_config.proto's Kind, by number
CONFIG_NAME = "config.pbtxt"
CONFIG = "config"
MEMORY = "memory"
PROCESS = "process"


# --- config.pbtxt ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class InstanceGroup:
    """One ``instance_group`` entry: its kind (a KINDS name), count (0: not given) and CUDA ordinals."""

    kind: str = "KIND_AUTO"
    count: int = 0
    gpus: tuple[int, ...] = ()


@dataclass(frozen=True)
class ConfigGpus:
    """Where a config puts a model's instances: on ``every`` GPU the process sees, and/or on the CUDA
    ordinals ``ordinals`` (sorted, distinct).  Neither: on the CPU only (no GPU)."""

    every: bool = False
    ordinals: tuple[int, ...] = ()


class _Malformed(Exception):
    """Internal: the text is not one this parser understands."""


@dataclass
class _Message:
    fields: list[tuple[str, _Value]]


@dataclass
class _List:
    items: list[_Value]


_Value = bytes | _Message | _List

# Protobuf text format: blanks and # comments, punctuation, quoted strings (escapes skipped, no raw
# newline), and words (identifiers, numbers with their sign, enum names).  Anything else is malformed.
_TOKEN = re.compile(rb"""
    (?P<skip>[ \t\r\n\f\v]+|\#[^\n]*)
  | (?P<punct>[{}<>\[\]:,;])
  | (?P<string>"(?:[^"\\\n]|\\[^\n])*"|'(?:[^'\\\n]|\\[^\n])*')
  | (?P<word>[A-Za-z0-9_.+\-]+)
""", re.VERBOSE)
_IDENTIFIER = re.compile(rb"[A-Za-z_][A-Za-z0-9_]*\Z")
_INTEGER = re.compile(rb"(-?)(0[xX][0-9a-fA-F]{1,8}|0[0-7]{0,11}|[1-9][0-9]{0,9})\Z")
_CLOSER = {b"{": b"}", b"<": b">"}
_PUNCTUATION = frozenset(bytes([byte]) for byte in b"{}<>[]:,;")


def _tokens(data: bytes) -> list[bytes]:
    tokens: list[bytes] = []
    position, end = 0, len(data)
    while position < end:
        match = _TOKEN.match(data, position)
        if match is None:
            raise _Malformed(f"unexpected byte at {position}")
        position = match.end()
        if match.lastgroup != "skip":
            if len(tokens) >= MAX_TOKENS:
                raise _Malformed("too many tokens")
            tokens.append(match.group())
    return tokens


class _Parser:
    """Protobuf text format into a small tree: a message is its fields (name, value) in order, a value a
    scalar token, a message or a list.  Lenient where protobuf is (``:`` before a message, ``,`` or ``;``
    after a field, ``{}`` or ``<>``), strict elsewhere; extensions (``[x.y]``) are malformed here."""

    def __init__(self, tokens: list[bytes]) -> None:
        self.tokens = tokens
        self.at = 0

    def peek(self) -> bytes:
        return self.tokens[self.at] if self.at < len(self.tokens) else b""

    def take(self) -> bytes:
        token = self.peek()
        if not token:
            raise _Malformed("unexpected end")
        self.at += 1
        return token

    def message(self, depth: int, closer: bytes) -> _Message:
        if depth > MAX_DEPTH:
            raise _Malformed("nested too deep")
        fields: list[tuple[str, _Value]] = []
        while self.peek() != closer:
            name = self.take()
            if not _IDENTIFIER.match(name):
                raise _Malformed("not a field name")
            if self.peek() == b":":
                self.at += 1
            fields.append((name.decode("ascii"), self.value(depth)))
            if self.peek() in (b",", b";"):
                self.at += 1
        if closer:
            self.at += 1
        return _Message(fields)

    def value(self, depth: int) -> _Value:
        token = self.take()
        if token in _CLOSER:
            return self.message(depth + 1, _CLOSER[token])
        if token == b"[":
            return self.items(depth + 1)
        if token[:1] in (b'"', b"'"):
            while self.peek()[:1] in (b'"', b"'"):  # adjacent strings are one
                self.at += 1
            return token
        if token in _PUNCTUATION:
            raise _Malformed("no value")
        return token

    def items(self, depth: int) -> _List:
        if depth > MAX_DEPTH:
            raise _Malformed("nested too deep")
        items: list[_Value] = []
        while self.peek() != b"]":
            if items:
                if self.take() != b",":
                    raise _Malformed("no comma between list items")
                if self.peek() == b"]":
                    break
            items.append(self.value(depth))
        self.at += 1
        return _List(items)


def _integer(token: _Value) -> int:
    match = _INTEGER.match(token) if isinstance(token, bytes) else None
    if match is None:
        raise _Malformed("not an integer")
    sign, digits = match.groups()
    base = 16 if digits[:2].lower() == b"0x" else 8 if len(digits) > 1 and digits[:1] == b"0" else 10
    value = int(digits, base)
    return -value if sign else value


def _kind(token: _Value) -> str:
    if isinstance(token, bytes):
        if token.decode("ascii", "replace") in KINDS:
            return token.decode("ascii")
        number = _integer(token)
        if 0 <= number < len(KINDS):
            return KINDS[number]
    raise _Malformed("not a kind")


def _ordinals(value: _Value) -> list[int]:
    values = value.items if isinstance(value, _List) else [value]
    ordinals = [_integer(item) for item in values]
    if any(not 0 <= ordinal < MAX_ORDINAL for ordinal in ordinals):
        raise _Malformed("not a GPU ordinal")
    return ordinals


def _group(value: _Value) -> InstanceGroup:
    if not isinstance(value, _Message):
        raise _Malformed("instance_group is no message")
    kind: str | None = None
    count: int | None = None
    gpus: list[int] = []
    for name, field_value in value.fields:
        if name == "kind":
            if kind is not None:
                raise _Malformed("kind given twice")  # protobuf refuses a singular field given twice
            kind = _kind(field_value)
        elif name == "count":
            if count is not None:
                raise _Malformed("count given twice")
            count = _integer(field_value)
        elif name == "gpus":
            gpus += _ordinals(field_value)
            if len(gpus) > MAX_GPU_ENTRIES:
                raise _Malformed("too many gpus")
    return InstanceGroup(kind or "KIND_AUTO", count or 0, tuple(gpus))


def instance_groups(data: bytes) -> tuple[InstanceGroup, ...] | None:
    """The ``instance_group`` entries of a config.pbtxt's bytes, in order; None when the text is malformed
    or past the bounds (module note).  Other fields, however nested, are parsed and ignored."""
    if len(data) > MAX_CONFIG_BYTES:
        return None
    try:
        top = _Parser(_tokens(data)).message(0, b"")
        groups: list[InstanceGroup] = []
        for name, value in top.fields:
            if name == "instance_group":
                groups += [_group(item) for item in (value.items if isinstance(value, _List) else [value])]
                if len(groups) > MAX_GROUPS:
                    return None
                if sum(len(group.gpus) for group in groups) > MAX_GPU_ENTRIES:
                    return None
    except (_Malformed, UnicodeDecodeError, ValueError):
        return None
    return tuple(groups)


def config_gpus(groups: Sequence[InstanceGroup] | None) -> ConfigGpus | None:
    """Where the groups put the model (ConfigGpus); None when they do not say: malformed, or a
    ``KIND_MODEL`` group (the backend places it).  No group at all is Triton's default: an instance on
    every GPU.  ``KIND_AUTO`` counts as ``KIND_GPU``: it falls back to the CPU only where the GPUs are not
    there, and a process NVML lists on GPUs has them."""
    if groups is None:
        return None
    if not groups:
        return ConfigGpus(every=True)
    every, ordinals = False, set[int]()
    for group in groups:
        if group.kind == "KIND_MODEL":
            return None
        if group.kind == "KIND_CPU":
            continue
        if group.gpus:
            ordinals.update(group.gpus)
        else:
            every = True
    return ConfigGpus(every, tuple(sorted(ordinals)))


def parse_config(data: bytes) -> ConfigGpus | None:
    """A config.pbtxt's bytes to where it puts the model (:func:`config_gpus` of :func:`instance_groups`)."""
    return config_gpus(instance_groups(data))


def config_candidates(path: str) -> tuple[str, ...]:
    """The config.pbtxt files that may describe the model file ``path`` (absolute, as the process names
    it), nearest layout first: Triton's ``<model>/<version>/...`` (a version directory is all digits; the
    model may be a directory itself, as an ONNX model with external data is), then the file's directory."""
    directory = os.path.dirname(path)
    candidates: list[str] = []
    ancestor = directory
    for _ in range(3):
        parent, name = os.path.split(ancestor)
        if name.isascii() and name.isdigit():
            candidates.append(os.path.join(parent, CONFIG_NAME))
            break
        if parent == ancestor:
            break
        ancestor = parent
    beside = os.path.join(directory, CONFIG_NAME)
    if beside not in candidates:
        candidates.append(beside)
    return tuple(candidates)


class _NotThere(Exception):  # noqa: N818  (an outcome: no such file, look at the next candidate)
    pass


def open_in_root(procfs: str, pid: int, path: str) -> int:
    """A descriptor of ``path`` in the process's root (``<procfs>/<pid>/root``), opened for reading
    (O_RDONLY|O_NOFOLLOW|O_NONBLOCK|O_CLOEXEC), walking the path one directory at a time and following no
    symlink on the way.  Why not ``open(f"{procfs}/{pid}/root{path}")``: past that magic link, an absolute
    symlink a tenant planted in its directories would resolve against the *exporter's* root, and the
    exporter would read a file of the host (or of another pod) for this tenant's model.  A model path
    the kernel gave (a descriptor's link) names no symlink anyway.  OSError where it cannot be opened."""
    parts = path.split("/")
    if parts[0] or len(parts) > MAX_PATH_COMPONENTS or any(part in ("", ".", "..") for part in parts[1:]):
        raise OSError(f"not a plain absolute path: {path!r}")
    directory = os.open(f"{procfs}/{pid}/root", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for part in parts[1:-1]:
            inner = os.open(part, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=directory)
            os.close(directory)
            directory = inner
        return os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=directory)
    finally:
        os.close(directory)


class ConfigReader:
    """Reads the config.pbtxt of a model file a process names, in that process's root, and says where it
    puts the model (ConfigGpus), or None: no config, unreadable, not a regular file, too big, malformed.

    Parsed configs are cached by file (st_dev, st_ino, size, mtime_ns), MAX_CACHED_CONFIGS of them, so a
    config read again costs its opens and an fstat.  A plain call that may wait for ever on the mount the
    file is on: run it where the wait can be abandoned (module note).  Safe to call from several threads."""

    def __init__(self, procfs: str = "/proc", max_cached: int = MAX_CACHED_CONFIGS) -> None:
        self.procfs = procfs
        self.max_cached = max_cached
        self._cache: dict[tuple[int, int, int, int], ConfigGpus | None] = {}
        self._lock = threading.Lock()

    def __call__(self, pid: int, path: str) -> ConfigGpus | None:
        for candidate in config_candidates(path):
            try:
                return self._read(pid, candidate)
            except _NotThere:
                continue
        return None

    def _read(self, pid: int, path: str) -> ConfigGpus | None:
        try:
            fd = open_in_root(self.procfs, pid, path)
        except FileNotFoundError as exc:
            raise _NotThere(path) from exc
        except OSError:  # a symlink on the way (ELOOP, ENOTDIR), no permission, the process gone
            return None
        try:
            status = os.fstat(fd)
            if not stat.S_ISREG(status.st_mode) or status.st_size > MAX_CONFIG_BYTES:
                return None
            key = (status.st_dev, status.st_ino, status.st_size, status.st_mtime_ns)
            with self._lock:
                if key in self._cache:
                    return self._cache[key]
            data = procstat.read_at_most(fd, MAX_CONFIG_BYTES)  # one byte more: too big shows
        except OSError:
            return None
        finally:
            os.close(fd)
        found = parse_config(data)
        with self._lock:
            while len(self._cache) >= self.max_cached:
                del self._cache[next(iter(self._cache))]  # the oldest first
            self._cache[key] = found
        return found


# --- CUDA_VISIBLE_DEVICES ----------------------------------------------------------------------------


@dataclass(frozen=True)
class CudaEnviron:
    """The CUDA variables a process started with (None: not set)."""

    visible_devices: str | None = None
    device_order: str | None = None
    # NVIDIA_VISIBLE_DEVICES: the GPUs the NVIDIA container runtime gave the process's container (the
    # Kubernetes device plugin sets it to the pod's GPUs); inside, CUDA sees those alone
    container_devices: str | None = None

    def visible(self, ordered: Sequence[str], mig_parents: Mapping[str, str] | None = None) -> tuple[str, ...]:
        """The GPUs the process's CUDA ordinals 0, 1, ... are: its CUDA_VISIBLE_DEVICES (visible_gpus) among
        its container's GPUs (container_gpus)."""
        return visible_gpus(self.visible_devices, container_gpus(self.container_devices, ordered), mig_parents)


def container_gpus(value: str | None, ordered: Sequence[str]) -> tuple[str, ...]:
    """The GPUs a container given NVIDIA_VISIBLE_DEVICES=``value`` sees, in NVML index order (its device files
    are those GPUs', and CUDA enumerates what it sees in PCI order); every GPU where the value does not
    restrict them or cannot be read: unset, "", "all", "void" and "none" (GPUs given another way: CDI, the
    device plugin's mounts), MIG entries, or an entry that names no GPU of ``ordered``."""
    if value is None or value.strip().lower() in ("", "all", "void", "none"):
        return tuple(ordered)
    chosen: set[str] = set()
    for entry in value.split(",", len(ordered) + 1):
        uuid = _visible_entry(entry.strip(), ordered, {})
        if uuid is None:
            return tuple(ordered)
        chosen.add(uuid)
    return tuple(uuid for uuid in ordered if uuid in chosen)


def parse_environ(data: bytes, complete: bool = True) -> CudaEnviron | None:
    """The CUDA variables of an environ file's bytes (NUL-separated NAME=value); the first of a name given
    twice counts (as getenv's).  None when ``data`` is not ``complete`` (cut at the bound) and a variable
    was not found in it: it may be in the part not read."""
    found: dict[bytes, str] = {}
    for entry in data.split(b"\0"):
        name, equals, value = entry.partition(b"=")
        if equals and name in _ENVIRON_NAMES and name not in found:
            found[name] = value.decode("utf-8", "replace")
    if not complete and b"CUDA_VISIBLE_DEVICES" not in found:
        return None
    return CudaEnviron(found.get(b"CUDA_VISIBLE_DEVICES"), found.get(b"CUDA_DEVICE_ORDER"),
                       found.get(b"NVIDIA_VISIBLE_DEVICES"))


_ENVIRON_NAMES = (b"CUDA_VISIBLE_DEVICES", b"CUDA_DEVICE_ORDER", b"NVIDIA_VISIBLE_DEVICES")


def read_cuda_environ(procfs: str, pid: int) -> CudaEnviron | None:
    """The CUDA variables of ``/proc/<pid>/environ`` (at most MAX_ENVIRON_BYTES read); None where it cannot
    be read (another user's process without CAP_SYS_PTRACE, a kernel thread, the process gone) or is cut
    before the variable.  The read takes the process's memory lock: run it where the wait can be abandoned."""
    read = procstat.read_bounded_bytes(f"{procfs}/{pid}/environ", MAX_ENVIRON_BYTES)
    if read is None:
        return None
    data, more = read
    if more:
        return parse_environ(data[: data.rfind(b"\0") + 1], complete=False)  # whole entries only
    return parse_environ(data)


def visible_gpus(value: str | None, ordered: Sequence[str],
                 mig_parents: Mapping[str, str] | None = None) -> tuple[str, ...]:
    """The GPU UUIDs a process's CUDA ordinals 0, 1, ... are, from its CUDA_VISIBLE_DEVICES ``value`` and
    every GPU's UUID in NVML index order (``ordered``).  CUDA's documented rules: unset, every GPU in order;
    a comma-separated sequence of indices, UUIDs (``GPU-8932f937-...``) or unique UUID prefixes
    (``GPU-8932f937``), or MIG devices (``MIG-...``: placed on their parent GPU, when ``mig_parents`` names
    it); the devices are enumerated in the order of the sequence, and an invalid entry hides it and every
    entry after it (``0,2,-1,1`` is 0 and 2).  Assumed where the docs are silent: blanks around an entry
    are ignored, an entry naming a GPU already listed is invalid, and "" (or any invalid first entry)
    hides every GPU."""
    if value is None:
        return tuple(ordered)
    out: list[str] = []
    for entry in value.split(",", len(ordered) + 1):
        uuid = _visible_entry(entry.strip(), ordered, mig_parents or {})
        if uuid is None or uuid in out:
            break
        out.append(uuid)
    return tuple(out)


def _visible_entry(entry: str, ordered: Sequence[str], mig_parents: Mapping[str, str]) -> str | None:
    if entry.isascii() and entry.isdigit():
        index = int(entry) if len(entry) < 6 else len(ordered)
        return ordered[index] if index < len(ordered) else None
    lowered = entry.lower()
    if lowered.startswith("mig-"):
        parents = {mig.lower(): gpu for mig, gpu in mig_parents.items()}
        return parents.get(lowered)
    if lowered.startswith("gpu-") and len(lowered) > 4:
        matches = [uuid for uuid in ordered if uuid.lower().startswith(lowered)]
        return matches[0] if len(matches) == 1 else None
    return None


# --- memory growth -----------------------------------------------------------------------------------


def grew_on(before: Mapping[str, int], after: Mapping[str, int], min_bytes: int = MIN_GROWTH_BYTES,
            share: float = GROWTH_SHARE) -> tuple[str, ...]:
    """The GPUs a process's used memory grew on between two readings (UUID -> bytes), in ``after``'s order:
    those whose growth is at least ``share`` of the largest, when the largest is at least ``min_bytes``;
    nothing otherwise.  Why that rule: a model loaded on one GPU grows that GPU by about its weights, and
    one loaded on several grows each by about as much, while what else the process does meanwhile (a
    request's activations, an allocator's pool) moves the others less.  A GPU missing from ``before`` grew
    from 0 (the process's first context there)."""
    growth = {uuid: used - before.get(uuid, 0) for uuid, used in after.items()}
    largest = max(growth.values(), default=0)
    if largest < max(min_bytes, 1):
        return ()
    return tuple(uuid for uuid, grown in growth.items() if grown >= largest * share)


# --- all together ------------------------------------------------------------------------------------


def place(config: ConfigGpus | None, visible: Sequence[str] | None, held: Sequence[str],
          grown: Sequence[str] | None = None) -> tuple[tuple[str, ...], str]:
    """The GPUs a model is on (UUIDs, in ``held``'s order) and how that was found (CONFIG, MEMORY or
    PROCESS), from: where its config puts it (None: no usable config), the UUIDs of the process's CUDA
    ordinals (:func:`visible_gpus`; None: unknown, so ordinals cannot be placed), the GPUs NVML lists the
    process on (in NVML's index order) and the GPUs its memory grew on while it read the model (None or
    empty: nothing decisive).

    A config's GPUs the process holds no context on are left out: an instance there is not loaded (yet),
    or the config changed since, or the ordinals were mapped wrong (a process that set CUDA_VISIBLE_DEVICES
    itself); when none is left the config is not believed and the next way decides.  A config that puts
    the model on the CPU only places it on no GPU."""
    if config is not None:
        if config.every:
            return tuple(held), CONFIG
        if not config.ordinals:
            return (), CONFIG
        if visible is not None:
            named = {visible[ordinal] for ordinal in config.ordinals if ordinal < len(visible)}
            kept = tuple(uuid for uuid in held if uuid in named)
            if kept:
                return kept, CONFIG
    if grown:
        went = set(grown)
        kept = tuple(uuid for uuid in held if uuid in went)
        if kept:
            return kept, MEMORY
    return tuple(held), PROCESS
