"""What discovery follows of a process, pass by pass: the model files it holds (open or mapped), each file's
load, and its loads of an engine (a checkpoint's shards are one).  Data only: discovery.py changes them,
placing.py reads them, and neither imports the other for them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from ..pods import cgroup as pod_cgroup
from . import placement

FileKey = tuple[tuple[int, int], int]  # (st_dev as major, minor; inode): which file


@dataclass(frozen=True)
class OpenFile:
    """A model file as one look at a process's descriptors found it."""

    path: str  # as the process names it
    dev: tuple[int, int]
    ino: int
    size: int
    mtime_ns: int
    position: int
    fd: str = ""  # the descriptor's number, as /proc names it: the next look starts there
    mapped: bool = False  # found in the process's maps, not its descriptors: no position to follow


@dataclass
class HeldFile:
    """One model file one process holds (or held) open, followed pass by pass."""

    engine: str
    file: OpenFile  # as the latest look found it
    sighted: float  # wall clock: when discovery first saw the process hold it
    device_at_sight: int  # the process's read_bytes then
    chars_at_sight: int  # and its rchar
    chars_at_look: int = 0  # the process's rchar at the latest look that saw the file open
    looked_again: bool = False  # seen at a later pass too
    open: bool = True
    loading_since: float | None = None  # wall clock: the load in progress began then
    load_moved_at: float = 0.0  # monotonic: the load's last movement
    read_forward: int = 0  # bytes the position moved forward during the load (at most what reads returned)
    device_at_start: int = 0  # the process's read_bytes when the load began
    chars_at_start: int = 0  # the process's rchar when the load began
    read_before: int = 0  # the position when the load was first seen (read before the look)
    loaded_at: float = 0.0  # wall clock: the latest load's start (for the info's load time)
    gpus: tuple[str, ...] = ()  # the GPUs it is placed on (placement module); () while the process has none
    config: placement.ConfigGpus | None = None  # where the config.pbtxt beside it puts it (None: no config)
    config_read: bool = False
    memory_at_start: dict[str, int] | None = None  # the process's GPU memory when its load began (several GPUs)
    grown: tuple[str, ...] = ()  # the GPUs that memory grew on while it loaded
    grow_until: float = float("inf")  # monotonic: when to stop looking for that growth


@dataclass
class EngineLoad:
    """One load of an engine by one process: every file of it read (a checkpoint's shards, one after another
    or at once), from the first file's start to the last one's end."""

    started: float  # wall clock: the first file's load began
    device_at_start: int  # the process's read_bytes then
    dev: tuple[int, int]  # the device of the file it began with: where the load waits
    done_bytes: int = 0  # what its files that finished read
    done_sizes: dict[FileKey, int] = field(default_factory=dict)  # each file read: its size
    ended: float | None = None  # monotonic: its files all finished; recorded JOIN_SECONDS later unless one begins
    device_at_end: int = 0  # the process's read_bytes when its last file finished


@dataclass
class Process:
    """A process holding, or having loaded, model files."""

    pid: int
    start: int  # clock ticks since boot: with the pid, which process
    uid: int
    pod: pod_cgroup.PodRef | None
    files: dict[FileKey, HeldFile] = field(default_factory=dict)
    device_bytes: int = 0  # /proc/<pid>/io read_bytes at the last look
    chars: int = 0  # /proc/<pid>/io rchar (every byte its reads returned) at the last look
    waiting: bool = False  # state D (uninterruptible: waiting on IO) at the last look
    gpus: tuple[str, ...] = ()  # every GPU NVML lists it on, in NVML index order
    visible: tuple[str, ...] | None = None  # the GPUs its CUDA ordinals are (its CUDA_VISIBLE_DEVICES), once read
    environ_read: bool = False
    on_gpu: bool = False  # NVML listed it with a GPU context (once is enough: an inference process)
    pending: list[Callable[[], None]] = field(default_factory=list)  # ends of loads before it was on a GPU
    fd_cursor: int = 0  # where in its descriptor listing the next look starts (its share ran out there)
    loads: dict[str, EngineLoad] = field(default_factory=dict)  # engine -> its load in progress
