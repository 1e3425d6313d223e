"""The GPU-time ledger: every second of every GPU and MIG device accounted to one state, and the same per pod.

At each sweep of the nvml collector (every ``--collector.nvml.interval``, 1 s) the time since the sweep
before goes to the state the device is in now, judged in this order:

* ``starved``: an engine's work waits on the device (a pool with every execution context busy, or a
  mean pool wait of at least ENGINE_POOL_WAIT_SECONDS) while the device has lost its activity (NVML busy
  under GPU_BUSY_LOW, or GPM's SM activity under GPU_SM_ACTIVE_LOW) and a disk under that engine's files
  is saturated: exporter.thresholds' judgement, the one ``gpuio top`` and the starvation rules make;
* ``serving``: an engine has requests in flight on it;
* ``loading``: a load to it is in progress, nothing in flight;
* ``allocated_idle``: a pod holds it (the kubelet's pod resources) or NVML lists a compute process on
  it, and no engine has work there;
* ``idle``: nobody holds it.

So the states of one device add up to the wall time since the exporter first saw it, to the sweep.
What engines do comes from the engine service (``Context.gpu_work``, measured every
``--collector.engines.work-interval``): without the engines collector, or with a measurement older than
WORK_MAX_AGE, no engine has work and the states are ``allocated_idle`` and ``idle`` only.  A MIG device
has no busy reading of its own here, so it is never judged ``starved``; a GPU in MIG mode is
accounted as its MIG devices (its own series stop), so that no second is counted twice.

Per pod (namespace, pod) and device, the seconds its engines or its holding account for: ``serving``,
``loading`` or ``starved`` for the named pods whose engines have that work there (each pod its own
state: two pods time-slicing a GPU are told apart), ``allocated_idle`` for the pods holding the device
(the kubelet gave it to them, or a process of theirs has a context on it) with no work there.  At most
MAX_PODS_PER_DEVICE pods a device a sweep (by name); the seconds of the rest go to
``gpuio_pod_gpu_time_left_out_seconds_total``.  Pods not seen for POD_RETENTION_SECONDS are
forgotten (their series end; Prometheus' ``increase()`` keeps what they counted).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from .. import thresholds as th
from ..context import Context, DeviceWork
from ..exposition import COUNTER, Desc, Family, label_string

SERVING, LOADING, STARVED, ALLOCATED_IDLE, IDLE = "serving", "loading", "starved", "allocated_idle", "idle"
STATES = (SERVING, LOADING, STARVED, ALLOCATED_IDLE, IDLE)
POD_STATES = (SERVING, LOADING, STARVED, ALLOCATED_IDLE)
MAX_PODS_PER_DEVICE = 16
MAX_DEVICES = 1024  # GPUs and MIG devices remembered (MIG devices are made anew with new UUIDs)
POD_RETENTION_SECONDS = 600.0
WORK_MAX_AGE = 5.0  # seconds: an older measurement of engine work is no evidence of work now

GPU_TIME = Desc("gpuio_gpu_time_seconds_total", COUNTER,
                "Seconds of the GPU or MIG device in each state since the exporter first saw it: serving (an "
                "engine has requests in flight on it), loading (a load to it in progress, nothing in flight), "
                "starved (work waiting while the device has lost its activity and a disk under the engine's "
                "files is saturated), allocated_idle (a pod or a process holds it, no engine work), idle "
                "(nobody holds it). The states add up to the wall time.", labels=("uuid", "state"),
                unit="seconds", values={"state": STATES})
POD_GPU_TIME = Desc("gpuio_pod_gpu_time_seconds_total", COUNTER,
                    "Seconds a pod's engines served, loaded or starved on the GPU or MIG device, or the pod held "
                    "it with no engine work (allocated_idle); at most 16 pods a device.",
                    labels=("namespace", "pod", "uuid", "state"), unit="seconds", values={"state": POD_STATES})
POD_LEFT_OUT = Desc("gpuio_pod_gpu_time_left_out_seconds_total", COUNTER,
                    "Pod-seconds on the device not in gpuio_pod_gpu_time_seconds_total: pods past the 16 a device "
                    "that are accounted.", labels=("uuid",), unit="seconds")
DESCS = (GPU_TIME, POD_GPU_TIME, POD_LEFT_OUT)


@dataclass(frozen=True)
class DeviceReading:
    """What one sweep read of a device: its busy and SM-active counters (seconds; None where not read),
    whether NVML lists a compute process on it, and the named pods of those processes (their cgroup's pod,
    named as exporter.pods.attribution names it)."""

    uuid: str
    busy_seconds: float | None
    sm_active_seconds: float | None
    has_processes: bool
    process_pods: frozenset[tuple[str, str]] = frozenset()


def judge(work: DeviceWork | None, busy: float | None, sm_active: float | None, held: bool,
          limits: th.Thresholds = th.DEFAULT) -> str:
    """The state of a device (module note) from its engine work, its activity over the last sweep
    (shares of the time, None where unknown) and whether a pod or process holds it."""
    if work is not None and work.in_flight > 0:
        if work.waiting and work.disk_saturated and limits.gpu_idle(busy, sm_active):
            return STARVED
        return SERVING
    if work is not None and work.loading > 0:
        return LOADING
    return ALLOCATED_IDLE if held else IDLE


class GpuLedger:
    """Integrates the states of each device, sweep by sweep (module note)."""

    def __init__(self, context: Callable[[], Context], limits: th.Thresholds = th.DEFAULT) -> None:
        self._context = context  # read at each sweep: whoever built the collector may hand it another one
        self._limits = limits
        self._seconds: dict[str, dict[str, float]] = {}  # uuid -> state -> seconds
        self._last: dict[str, tuple[float, float | None, float | None]] = {}  # uuid -> (when, busy, SM active)
        self._pods: dict[tuple[str, str, str], dict[str, float]] = {}  # (namespace, pod, uuid) -> state -> s
        self._pod_seen: dict[tuple[str, str, str], float] = {}
        self._left_out: dict[str, float] = {}
        self.states: dict[str, str] = {}  # uuid -> the state at the last sweep

    def advance(self, readings: Iterable[DeviceReading], now: float) -> None:
        """Account the time since each device's last sweep to its state now; ``now`` is monotonic."""
        context = self._context()
        work_fresh = self._work_is_fresh(context, now)
        for reading in readings:
            last = self._last.get(reading.uuid)
            self._last[reading.uuid] = (now, reading.busy_seconds, reading.sm_active_seconds)
            if last is None:  # first seen: the baseline, counted from here
                self._seconds.setdefault(reading.uuid, dict.fromkeys(STATES, 0.0))
                continue
            seconds = now - last[0]
            if seconds <= 0:
                continue
            work = context.gpu_work.get(reading.uuid) if work_fresh else None
            holders = context.pods.holders(reading.uuid) | reading.process_pods
            state = judge(work, _share(last[1], reading.busy_seconds, seconds),
                          _share(last[2], reading.sm_active_seconds, seconds),
                          reading.has_processes or bool(holders), self._limits)
            self.states[reading.uuid] = state
            self._seconds[reading.uuid][state] += seconds
            self._account_pods(reading.uuid, state, work, holders, seconds, now)
        self._forget(now)

    @staticmethod
    def _work_is_fresh(context: Context, now: float) -> bool:
        measured = context.gpu_work.measured_at()
        return measured is not None and now - measured <= WORK_MAX_AGE

    def _account_pods(self, uuid: str, state: str, work: DeviceWork | None, holders: frozenset[tuple[str, str]],
                      seconds: float, now: float) -> None:
        doing = dict.fromkeys(sorted(holders), ALLOCATED_IDLE)
        for named, what in (work.pods.items() if work is not None else ()):
            doing[named] = STARVED if state == STARVED and what == SERVING else what
        for index, ((namespace, pod), what) in enumerate(sorted(doing.items())):
            if index >= MAX_PODS_PER_DEVICE:
                self._left_out[uuid] = self._left_out.get(uuid, 0.0) + seconds
                continue
            key = (namespace, pod, uuid)
            self._pods.setdefault(key, dict.fromkeys(POD_STATES, 0.0))[what] += seconds
            self._pod_seen[key] = now

    def _forget(self, now: float) -> None:
        """Pods not seen for POD_RETENTION_SECONDS; devices past MAX_DEVICES, the longest unseen first."""
        for key in [key for key, seen in self._pod_seen.items() if now - seen > POD_RETENTION_SECONDS]:
            del self._pod_seen[key], self._pods[key]
        if len(self._last) > MAX_DEVICES:
            for uuid, _ in sorted(self._last.items(), key=lambda item: item[1][0])[:len(self._last) - MAX_DEVICES]:
                for table in (self._last, self._seconds, self._left_out, self.states):
                    table.pop(uuid, None)

    def families(self) -> list[Family]:
        device = [GPU_TIME.sample(label_string({"uuid": uuid, "state": state}), value)
                  for uuid, states in sorted(self._seconds.items()) for state, value in states.items()]
        pods = [POD_GPU_TIME.sample(label_string({"namespace": namespace, "pod": pod, "uuid": uuid, "state": state}),
                                    value)
                for (namespace, pod, uuid), states in sorted(self._pods.items()) for state, value in states.items()]
        left_out = [POD_LEFT_OUT.sample(label_string({"uuid": uuid}), self._left_out.get(uuid, 0.0))
                    for uuid in sorted(self._seconds)]
        return [Family(GPU_TIME, device), Family(POD_GPU_TIME, pods), Family(POD_LEFT_OUT, left_out)]


def _share(before: float | None, after: float | None, seconds: float) -> float | None:
    """The share of ``seconds`` a counter of seconds grew by; None where either reading is missing."""
    if before is None or after is None:
        return None
    return min(1.0, max(0.0, (after - before) / seconds))
