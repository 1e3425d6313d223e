"""What engines do on each GPU now: the engine service's input to the GPU-time ledger.

From one read of the sources (the spool's per-GPU gauges and histograms, loads in progress from the
spool and discovery): per GPU or MIG device UUID, the requests in flight, the loads in progress,
whether work queues (a pool with every execution context busy, or a mean pool wait over the time since
the last measurement of at least ENGINE_POOL_WAIT_SECONDS: exporter.thresholds.Thresholds.engine_starved's
"waiting"), whether a disk under the files of an engine with work there is saturated, and which pods'
engines have work there.  The nvml collector's ledger (exporter.collectors.nvml_ledger) joins it with
each GPU's activity.

GPU UUIDs come from spool writers (untrusted): a made-up one costs an entry here and is never read,
since the ledger asks only for the devices NVML lists.
"""

from __future__ import annotations

from collections.abc import Callable

from .. import thresholds as th
from ..context import DeviceWork
from ..host.diskstats import SaturatedDisks
from . import model

SERVING = "serving"
LOADING = "loading"
IN_FLIGHT = model.PER_GPU_LAYOUT.gauges["in_flight"]
CONTEXTS = model.PER_GPU_LAYOUT.gauges["pool_contexts"]
POOL_WAIT_FIRST, POOL_WAIT_SUM, _ = model.PER_GPU_LAYOUT.histograms["pool_wait_seconds"]


class WorkMeter:
    """Measures DeviceWork per GPU from the engine totals (module note).  ``disks_of(dev)``: the whole
    disks under an engine file's st_dev, as the service already knows them (no look-up here)."""

    def __init__(self, saturated: SaturatedDisks, disks_of: Callable[[tuple[int, int]], list[str]],
                 limits: th.Thresholds = th.DEFAULT) -> None:
        self._saturated = saturated
        self._disks_of = disks_of
        self._limits = limits
        self._pool_waits: dict[tuple[str, str], tuple[float, float]] = {}  # (engine, GPU) -> (count, sum)

    def measure(self, totals: model.Totals, now: float) -> dict[str, DeviceWork]:
        in_flight: dict[str, float] = {}
        loading: dict[str, float] = {}
        waiting: set[str] = set()
        busy_engines: dict[str, set[str]] = {}  # GPU -> engines with work on it
        pods: dict[str, dict[tuple[str, str], str]] = {}
        waits: dict[tuple[str, str], tuple[float, float]] = {}
        for (engine, uuid), values in totals.per_gpu.items():
            flying = max(0.0, values[IN_FLIGHT])
            waits[(engine, uuid)] = pool_wait = (sum(values[POOL_WAIT_FIRST:POOL_WAIT_SUM]), values[POOL_WAIT_SUM])
            if self._queues(flying, values[CONTEXTS], self._pool_waits.get((engine, uuid)), pool_wait):
                waiting.add(uuid)
            if flying > 0:
                in_flight[uuid] = in_flight.get(uuid, 0.0) + flying
                busy_engines.setdefault(uuid, set()).add(engine)
                self._name_pods(pods, totals, engine, uuid, SERVING)
        self._pool_waits = waits
        for (engine, uuid, _), (count, _, _) in totals.loads.items():
            if count > 0:
                loading[uuid] = loading.get(uuid, 0.0) + count
                busy_engines.setdefault(uuid, set()).add(engine)
                self._name_pods(pods, totals, engine, uuid, LOADING)
        disks = {uuid: self._engine_disks(totals, engines) for uuid, engines in busy_engines.items()}
        saturated = self._saturated.judge(set().union(*disks.values()) if disks else set(), now)
        return {uuid: DeviceWork(in_flight=in_flight.get(uuid, 0.0), loading=loading.get(uuid, 0.0),
                                 waiting=uuid in waiting, disk_saturated=bool(disks.get(uuid, set()) & saturated),
                                 pods=pods.get(uuid, {}))
                for uuid in set(in_flight) | set(loading) | waiting}

    def _queues(self, in_flight: float, contexts: float, before: tuple[float, float] | None,
                now: tuple[float, float]) -> bool:
        """Work waits for the device (Thresholds.work_waiting) with the mean pool wait since the last
        measurement (none before a second measurement, or without acquires since)."""
        mean_wait = (now[1] - before[1]) / (now[0] - before[0]) if before is not None and now[0] > before[0] else None
        return self._limits.work_waiting(in_flight, mean_wait, contexts)

    def _engine_disks(self, totals: model.Totals, engines: set[str]) -> set[str]:
        return {disk for engine in engines for info in totals.infos.get(engine, [])
                if info.dev != (0, 0) for disk in self._disks_of(info.dev)}

    @staticmethod
    def _name_pods(pods: dict[str, dict[tuple[str, str], str]], totals: model.Totals, engine: str, uuid: str,
                   doing: str) -> None:
        """The named pods of the engine on the GPU do ``doing`` there (serving wins over loading)."""
        for pod in totals.pods.get((engine, uuid), ()):
            if pod.pod:
                table = pods.setdefault(uuid, {})
                if table.get((pod.namespace, pod.pod)) != SERVING:
                    table[(pod.namespace, pod.pod)] = doing
