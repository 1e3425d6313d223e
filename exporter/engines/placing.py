"""Which GPUs each model file of a process discovery follows is placed on: the state and the reads behind it.

exporter.engines.placement decides where a model is from what was read (config.pbtxt, CUDA_VISIBLE_DEVICES,
memory growth); :class:`Placer` does the reading for discovery, pass after pass, within its bounds: a file's
config is read once (CONFIG_READS_PER_PROCESS a pass, where the wait can be abandoned), a process's environ
once, and a multi-GPU process's memory looked at from a load's start until GROWTH_WAIT after its end.  What it
finds is kept on discovery's own records (the process's ``visible``, each held file's ``config``, ``grown``).
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable

from ..host.abandonable import Abandonable, Unresponsive
from . import placement
from .descriptors import abandonable_config_reads
from .followed import HeldFile, Process

# How long after a load's end its process's GPU memory may still show where it went: NVML's process list
# (and its used memory) is read every slow interval of the nvml collector (10 s), three of them.
GROWTH_WAIT = 30.0
# config.pbtxt files read for one process in one pass, at most (each may take up to CONFIG_READ_SECONDS); the
# rest wait for the next pass, and none is read once the pass is past its deadline
CONFIG_READS_PER_PROCESS = 2


class Placer:
    """Places the model files of discovery's processes on their GPUs (module note).

    ``proc`` is discovery's own abandonable reader of /proc/<pid> (a process stuck in the kernel is
    refused once, whichever read found it stuck); ``drop`` counts what the bounds left out."""

    def __init__(self, procfs: str, proc: Abandonable, drop: Callable[[str], None],
                 gpu_of: Callable[[int, int], str | None] | None = None,
                 gpus_of: Callable[[int, int], tuple[str, ...]] | None = None,
                 memory_of: Callable[[int, int], dict[str, int]] | None = None,
                 ordered_gpus: Callable[[], tuple[str, ...]] | None = None) -> None:
        self.procfs = procfs
        self.gpu_of = gpu_of or (lambda pid, start: None)  # (pid, start ticks) -> GPU uuid (NVML's list)
        # NVML's list again: every GPU of a process (NVML order), its used memory on each, every GPU's UUID in
        # NVML order; for a process on several GPUs, where each of its models is (the placement module)
        self.gpus_of = gpus_of
        self.memory_of = memory_of or (lambda pid, start: {})
        self.ordered_gpus = ordered_gpus or (lambda: ())
        self._configs = placement.ConfigReader(procfs)
        self._config_reads = abandonable_config_reads()
        self._proc = proc
        self._drop = drop

    def gpus(self, pid: int, start: int) -> tuple[str, ...]:
        """Every GPU NVML lists the process on, in NVML index order."""
        if self.gpus_of is not None:
            return self.gpus_of(pid, start)
        gpu = self.gpu_of(pid, start)
        return (gpu,) if gpu else ()

    def load_began(self, process: Process, held: HeldFile) -> None:
        """Where its memory grows tells where the model goes: the process's memory now, looked at again
        until the growth shows (or GROWTH_WAIT after the load, see load_ended)."""
        if len(process.gpus) > 1 and not held.grown:
            held.memory_at_start, held.grow_until = self.memory_of(process.pid, process.start), float("inf")

    @staticmethod
    def load_ended(held: HeldFile) -> None:
        """NVML shows a process's memory late: its growth is looked for until GROWTH_WAIT after the load."""
        held.grow_until = time.monotonic() + GROWTH_WAIT

    def place(self, process: Process, deadline: float) -> None:
        """Each file's GPUs: the process's one GPU; for a process on several, where the placement module puts
        the model (its config.pbtxt, the GPUs its memory grew on while it loaded, else all of them).  A file
        whose config is not read yet (CONFIG_READS_PER_PROCESS a pass, none past the pass's ``deadline``, or
        its mount did not answer) keeps the GPUs it was placed on; a new one is on all of them meanwhile."""
        if len(process.gpus) <= 1:
            for held in process.files.values():
                held.gpus = process.gpus
            return
        now = time.monotonic()
        memory: dict[str, int] | None = None
        reads = CONFIG_READS_PER_PROCESS
        for held in process.files.values():
            if not held.open and held.loading_since is None and held.gpus:
                continue  # closed and done: where it was
            if not held.config_read:
                if reads <= 0 or time.monotonic() >= deadline or not self._read_config(process, held):
                    held.gpus = held.gpus or process.gpus
                    continue
                reads -= 1
            if held.memory_at_start is not None and not held.grown:
                memory = self.memory_of(process.pid, process.start) if memory is None else memory
                held.grown = placement.grew_on(held.memory_at_start, memory)
                if held.grown or now > held.grow_until:
                    held.memory_at_start = None
            visible = self._visible(process) if held.config is not None and held.config.ordinals else None
            held.gpus, _ = placement.place(held.config, visible, process.gpus, held.grown)

    def _read_config(self, process: Process, held: HeldFile) -> bool:
        """The config.pbtxt beside the file, in the process's root, where the wait can be abandoned (after
        CONFIG_READ_SECONDS: a cold read from a local disk in a storm takes a fraction of that; a dead NFS export
        or FUSE daemon never answers); False when it did not answer (read again at a later pass).  A read that
        does not answer refuses the reads of its process's mount namespace for a while, not those of others (a
        tenant can mount a FUSE file system on its own config's name)."""
        try:
            namespace = os.readlink(f"{self.procfs}/{process.pid}/ns/mnt")
        except OSError:
            namespace = f"pid {process.pid}"
        try:
            held.config = self._config_reads.call(namespace, functools.partial(self._configs, process.pid,
                                                                               held.file.path))
        except Unresponsive:
            self._drop("unresponsive_mount")
            return False
        held.config_read = True
        return True

    def _visible(self, process: Process) -> tuple[str, ...] | None:
        """The GPUs the process's CUDA ordinals are, from its CUDA_VISIBLE_DEVICES (read once, where the wait
        can be abandoned: reading environ takes the process's memory lock); None when it cannot be read."""
        if not process.environ_read:
            try:
                environ = self._proc.call(process.pid, functools.partial(placement.read_cuda_environ, self.procfs,
                                                                         process.pid))
            except Unresponsive:
                self._drop("unresponsive_process")
                return None
            process.environ_read = True
            if environ is not None:
                process.visible = environ.visible(self.ordered_gpus())
        return process.visible
