"""Pods: which namespace/pod/container holds each GPU, from the kubelet's pod-resources API.

``gpuio_gpu_pod_info{uuid, mig_uuid, resource, device, namespace, pod, container}`` is 1 for each GPU
(or MIG device, or time-slicing replica) a container holds: one series per allocation, so GPU series
join it on ``uuid`` (``* on(uuid) group_left(namespace, pod, container) gpuio_gpu_pod_info``) instead
of every GPU series carrying pod labels (dcgm-exporter's way: each of its ~100 families multiplied
by the pods sharing a GPU).  Bounded by MAX_OWNERS allocations.

The API is called on the poller's own thread (:mod:`exporter.pods.podresources`), never in a scrape;
the scrape renders the last answer.  No socket: the source is absent (not a Kubernetes node, or the
socket not mounted), one log line, nothing else.  A failing kubelet: the last answer is served as
stale, failures are counted by reason.  The answer also feeds the nvml collector's per-process
series (:mod:`exporter.pods.attribution`).
"""

from __future__ import annotations

import time
from typing import Any

from ..collect import Absent, Collector, Failing, StaleData, register
from ..context import Context
from ..exposition import COUNTER, GAUGE, INFO, Desc, Family, label_string
from ..options import Option, parse_seconds
from ..pods import podresources

DURATION = "a duration above zero such as 500ms, 2s, 5m"

GPU_POD = Desc("gpuio_gpu_pod_info", INFO,
               "A GPU, MIG device or time-slicing replica held by a container, as the kubelet's pod-resources "
               "API says (device plugins and DRA); join GPU series on uuid.",
               labels=("uuid", "mig_uuid", "resource", "device", "namespace", "pod", "container"))
PODS = Desc("gpuio_kubelet_pod_resources_pods", GAUGE, "Pods in the kubelet's last pod-resources answer.")
LEFT_OUT = Desc("gpuio_kubelet_pod_resources_dropped_devices", GAUGE,
                "Pods, containers and devices of the last pod-resources answer left out by the exporter's caps.")
LAST_SUCCESS = Desc("gpuio_kubelet_pod_resources_last_success_timestamp_seconds", GAUGE,
                    "When the kubelet last answered pod-resources List.", unit="seconds")
FAILURES = Desc("gpuio_kubelet_pod_resources_failures_total", COUNTER,
                "Failed pod-resources List calls by reason (a gRPC status such as unavailable or "
                "deadline_exceeded; permission; malformed; resource_exhausted: an answer past 16 MiB or 200,000 "
                "fields).", labels=("reason",))


@register
class PodsCollector(Collector):
    name = "pods"
    options = (
        Option("pod-resources-socket", podresources.DEFAULT_SOCKET, str, "a path to a unix socket",
               "The kubelet's pod-resources socket (absent: no pod attribution, no failure)."),
        Option("pod-resources-interval", "10s", parse_seconds, DURATION,
               "How often the kubelet is asked which pod holds each GPU (in the background)."),
        Option("pod-resources-timeout", "2s", parse_seconds, DURATION, "Time limit of one pod-resources call."),
    )

    def __init__(self, context: Context, options: dict[str, Any],
                 poller: podresources.PodResourcesPoller | None = None) -> None:
        super().__init__(context, options)
        self.poller = poller or podresources.PodResourcesPoller(
            self.settings["pod-resources-socket"],
            self.settings["pod-resources-interval"], self.settings["pod-resources-timeout"])
        self.poller.on_answer = self._share

    def start(self) -> None:
        self.poller.start()

    def stop(self) -> None:
        self.poller.stop()

    def _share(self, answer: podresources.Answer) -> None:
        self.context.pods.update_owners(answer.owners)

    def _labels(self, o: podresources.DeviceOwner) -> str:
        """A MIG device's series names its GPU too (NVML's parent UUID), so GPU series join it on uuid."""
        return label_string({"uuid": o.gpu_uuid or self.context.pods.parent_of(o.mig_uuid), "mig_uuid": o.mig_uuid,
                             "resource": o.resource, "device": o.device, "namespace": o.namespace, "pod": o.pod,
                             "container": o.container})

    def collect(self) -> list[Family]:
        state = self.poller.state
        families = [FAILURES.family([FAILURES.sample(label_string({"reason": reason}), count)
                                     for reason, count in sorted(state.failures.items())])]
        answer = state.answer
        if answer is not None:
            families += [
                GPU_POD.family([GPU_POD.sample(self._labels(o), 1) for o in answer.owners]),
                PODS.family([PODS.sample("", answer.pods)]),
                LEFT_OUT.family([LEFT_OUT.sample("", answer.left_out)]),
                LAST_SUCCESS.family([LAST_SUCCESS.sample("", answer.taken_at)]),
            ]
        absent = state.absent
        if absent is None and state.polls == 0 and state.answer is None and state.error is None:
            absent = self.poller.why_absent()  # not polled yet (a one-shot `gpuio scrape`): a stat, no call
        if absent is not None:
            raise Absent(absent, families)
        if state.error is not None:
            if answer is None:  # the failure reasons are served from the first failure on
                raise Failing(f"pod-resources: {state.error}", families)
            age = time.time() - answer.taken_at
            raise StaleData(f"pod-resources: {state.error} (serving the answer of {age:.0f}s ago)", families)
        return families
