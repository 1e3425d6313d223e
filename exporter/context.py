"""What collectors and the engine service share, and who writes and who reads each fact.

:class:`Context` is handed to every collector (exporter.assemble builds one per exporter): the roots
every path goes through (node_exporter's --path.*), and the facts one source learns that another
needs.  Each fact has one writer and names its readers here; nothing else is shared between collectors.

============================  ==========================================  ==========================================
fact                          written by                                  read by
============================  ==========================================  ==========================================
``gpu_processes``             the nvml collector, each sweep              the engine service (which GPU a writer or a
                              (GpuProcesses.update_sweep)                 discovered process is on; placement)
``pods.update_owners``        the pods collector (kubelet pod resources)  the nvml collector and the engine service
                                                                          (``of_process``: a GPU process's pod)
``pods.update_writer_pods``   the engine service (spool writers' pods)    the nvml collector (``of_process``), the
                                                                          cgroup_io collector (``writer_pod_uids``)
``pods.set_discovered_pods``  the engine service (discovery's pods)       the cgroup_io collector (``writer_pod_uids``)
``pods.set_mig_parents``      the nvml collector                          the pods collector (``parent_of``: a MIG
                                                                          device's GPU)
``gpu_work``                  the engine service, every work interval     the nvml collector (the GPU-time ledger:
                              (GpuWork.update)                            serving, loading, starved)
``host_mounts``               nobody: the table is read again only when   the mountstats collector, the engine
                              /proc's mounts change                       service (the mount under each engine file)
============================  ==========================================  ==========================================

A reader sees the writer's last complete update (each is replaced whole): the engine service reads
the GPU processes of the nvml collector's last sweep, one scrape behind at most.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from .host.mounts import MountTableWatch
from .pods.attribution import PodAttribution


@dataclass(frozen=True)
class _GpuSweep:
    """One sweep's process tables (GpuProcesses): built whole, then published in one assignment."""

    by_process: Mapping[tuple[int, int], str] = field(default_factory=dict)  # on one GPU only
    processes: frozenset[tuple[int, int]] = frozenset()
    gpus: Mapping[tuple[int, int], tuple[str, ...]] = field(default_factory=dict)  # every GPU, NVML order
    memory: Mapping[tuple[int, int], Mapping[str, int]] = field(default_factory=dict)  # GPU -> used bytes
    ordered: tuple[str, ...] = ()


class GpuProcesses:
    """Which GPUs each compute process is on, as the nvml collector last read it: (pid, start time) -> GPU UUIDs.

    The engines collector uses it for an inference process that did not say which GPU it uses (the
    library learns the UUID only through torch, or pycuda with NVML).  Keyed by the start time too
    (clock ticks since boot, from /proc/<pid>/stat at the sweep): a process that got the pid of one
    that exited since the sweep is another key, and does not inherit that GPU.  A process whose start
    time this exporter's procfs does not show (another pid namespace) is not listed.  Replaced whole
    on each update, so readers on other threads see one sweep or the next, never half of one.

    ``get`` is the one GPU of a process NVML lists on one GPU only; ``gpus_of`` every GPU of it and
    ``memory_of`` its used memory on each (issue 41: placing a model of a process on several GPUs,
    exporter.engines.placement); ``ordered`` every GPU in NVML index order (what CUDA ordinals map onto).
    """

    def __init__(self) -> None:
        self._sweep = _GpuSweep()

    def update(self, by_process: Mapping[tuple[int, int], str] | Iterable[tuple[tuple[int, int], str]]) -> None:
        """From (process, GPU) pairs: a process NVML lists on several GPUs is on none of them for ``get``
        (which of its GPUs an engine is for cannot be told from the process list)."""
        pairs = by_process.items() if isinstance(by_process, Mapping) else by_process
        self.update_sweep(((key, uuid, None) for key, uuid in pairs))

    def update_sweep(self, listed: Iterable[tuple[tuple[int, int], str, int | None]],
                     ordered: Iterable[str] = ()) -> None:
        """From one sweep: (process, GPU, its used memory on that GPU or None where NVML cannot say) for
        every process NVML lists on each GPU, and every GPU's UUID in NVML index order (empty: unknown).
        A process's GPUs are kept in ``ordered``'s order where it names them, else in the order listed."""
        order = tuple(ordered)
        rank = {uuid: index for index, uuid in enumerate(order)}
        gpus: dict[tuple[int, int], list[str]] = {}
        memory: dict[tuple[int, int], dict[str, int]] = {}
        for key, uuid, used in listed:
            if key[1] <= 0:
                continue
            held = gpus.setdefault(key, [])
            if uuid not in held:
                held.append(uuid)
            if used is not None:
                memory.setdefault(key, {})[uuid] = used
        for held in gpus.values():
            held.sort(key=lambda uuid: rank.get(uuid, len(rank)))  # stable: unranked keep their order
        self._sweep = _GpuSweep(
            by_process={key: held[0] for key, held in gpus.items() if len(held) == 1 and held[0]},
            processes=frozenset(gpus), gpus={key: tuple(held) for key, held in gpus.items()},
            memory={key: {uuid: memory[key][uuid] for uuid in gpus[key] if uuid in memory[key]} for key in memory},
            ordered=order)

    def get(self, pid: int, start_ticks: int) -> str | None:
        """The GPU of a process NVML lists on one GPU; None for one on several, or not listed."""
        return self._sweep.by_process.get((pid, start_ticks))

    def processes(self) -> frozenset[tuple[int, int]]:
        """Every process (pid, start time) with a GPU context at the last sweep (on one GPU or several)."""
        return self._sweep.processes

    def gpus_of(self, pid: int, start_ticks: int) -> tuple[str, ...]:
        """Every GPU NVML lists the process on, in NVML index order; () for one not listed."""
        return self._sweep.gpus.get((pid, start_ticks), ())

    def memory_of(self, pid: int, start_ticks: int) -> dict[str, int]:
        """The process's used GPU memory in bytes per GPU (NVML's usedGpuMemory), for the GPUs where NVML
        says it (not under MIG without privileges, for one): a copy, the caller's to keep."""
        return dict(self._sweep.memory.get((pid, start_ticks), {}))

    def ordered(self) -> tuple[str, ...]:
        """Every GPU's UUID in NVML index order, as CUDA ordinals map onto them (exporter.engines.placement);
        () when the nvml collector could not tell (a GPU NVML refused, MIG mode)."""
        return self._sweep.ordered


@dataclass(frozen=True)
class DeviceWork:
    """What engines do on one GPU or MIG device now, as the engine service last measured it."""

    in_flight: float = 0.0  # requests in flight, every engine on the device together
    loading: float = 0.0  # loads to the device in progress
    waiting: bool = False  # work queues for the device: a pool with every context busy, or a pool wait
    disk_saturated: bool = False  # a disk under the files of an engine with work on the device is saturated
    # (namespace, pod) -> "serving" or "loading": the named pods whose engines have work on the device
    pods: Mapping[tuple[str, str], str] = field(default_factory=dict)


class GpuWork:
    """Engine work per GPU or MIG device UUID (DeviceWork), replaced whole by each measurement: a reader
    sees one measurement or the next.  ``age`` says how old it is (a monotonic clock's seconds); empty,
    and as old as the exporter, while the engines collector is off or has not measured yet."""

    def __init__(self) -> None:
        self._devices: Mapping[str, DeviceWork] = {}
        self._at: float | None = None

    def update(self, devices: Mapping[str, DeviceWork], at: float) -> None:
        self._devices, self._at = dict(devices), at

    def get(self, uuid: str) -> DeviceWork | None:
        return self._devices.get(uuid)

    def measured_at(self) -> float | None:
        """When the last measurement was taken (monotonic); None before the first."""
        return self._at


@dataclass(frozen=True)
class Context:
    """Where collectors find the host: every path goes through these roots (node_exporter's --path.*),
    and what one collector tells another (the GPU of each compute process)."""

    procfs: str = "/proc"
    sysfs: str = "/sys"
    rootfs: str = "/"
    gpu_processes: GpuProcesses = field(default_factory=GpuProcesses, compare=False)
    # Who holds each GPU (the pods collector) and which pod each spool writer is in (engines): the nvml
    # collector names GPU processes' pods from it.
    pods: PodAttribution = field(default_factory=PodAttribution, compare=False)
    # What engines do on each GPU now (the engine service, every --collector.engines.work-interval): the
    # nvml collector's GPU-time ledger tells serving, loading and starved GPUs from it.
    gpu_work: GpuWork = field(default_factory=GpuWork, compare=False)
    # The host's mount table under ``procfs``, one reader for every collector that needs it (mountstats,
    # engines): read once, again only when the mounts change, and the same table for all of them.
    host_mounts: MountTableWatch = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "host_mounts", MountTableWatch(self.procfs))  # frozen: set once, here
