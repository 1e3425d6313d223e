"""The kubelet's pod-resources API (v1 ``PodResourcesLister.List``): which pod and container holds each GPU.

The kubelet serves it on a unix socket (``/var/lib/kubelet/pod-resources/kubelet.sock``, GA since
Kubernetes 1.28; dynamic resources since 1.27, on by default since 1.34).  ``List`` answers, for
every pod on the node, each container's devices as the device plugins named them (NVIDIA's plugin:
GPU UUIDs ``GPU-…``, MIG device UUIDs ``MIG-…``, and with time-slicing ``GPU-…::<replica>``) and, with
DRA, each claim's devices (driver, pool, device name, CDI device names).

Polled on a thread of its own every ``interval``, never in a scrape (a hung kubelet costs the
poller, not the scrape), with a per-call ``timeout``.  A failed poll keeps the last good answer,
is counted by reason and is retried after a back-off that doubles up to MAX_BACKOFF.  No socket is
no failure: the source is absent (a node without a kubelet, or the socket not mounted).

Transport is grpcio's generic client (``channel.unary_unary`` with our own (de)serialisers): the
answer is decoded by :mod:`exporter.pods.wire`, so no protobuf runtime is needed.  grpcio is imported
only when a socket exists, so off the cluster it is never loaded.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import stat
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..logsetup import fields
from . import wire

log = logging.getLogger("gpuio.pods")

DEFAULT_SOCKET = "/var/lib/kubelet/pod-resources/kubelet.sock"
METHOD = "/v1.PodResourcesLister/List"
MAX_BACKOFF = 300.0
MAX_OWNERS = 4096  # (device, container) pairs kept: 8 GPUs x 7 MIG slices x time-slicing replicas fits

_GPU_UUID = re.compile(r"GPU-[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}")
_MIG_UUID = re.compile(r"MIG-[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}"
                       r"|MIG-GPU-[0-9a-fA-F-]{36}/\d+/\d+")


@dataclass(frozen=True)
class DeviceOwner:
    """One GPU (or MIG device, or time-slicing replica of one) held by one container."""

    namespace: str
    pod: str
    container: str
    resource: str  # the device plugin's resource name ("nvidia.com/gpu") or the DRA driver ("gpu.nvidia.com")
    device: str  # the ID as the kubelet gave it ("GPU-…::2"), or "<pool>/<device>" for DRA
    gpu_uuid: str  # "" where the ID names no GPU UUID (an index strategy, a DRA device name)
    mig_uuid: str


def gpu_ids(text: str) -> tuple[str, str]:
    """``(GPU UUID, MIG UUID)`` named in a device ID or CDI name, each "" when absent.  A MIG UUID of the
    old form ``MIG-GPU-<uuid>/<gi>/<ci>`` also names its GPU."""
    mig = _MIG_UUID.search(text)
    if mig is not None:
        parent = _GPU_UUID.search(mig[0])
        return (parent[0] if parent else ""), mig[0]
    gpu = _GPU_UUID.search(text)
    return (gpu[0] if gpu else ""), ""


def _is_gpu(resource: str, gpu_uuid: str, mig_uuid: str) -> bool:
    return bool(gpu_uuid or mig_uuid) or resource.startswith("nvidia.com/") or resource.endswith("nvidia.com")


def owners(decoded: wire.Decoded) -> tuple[list[DeviceOwner], int]:
    """Every GPU device of every container, and how many the cap left out."""
    found: list[DeviceOwner] = []
    left_out = 0
    for pod in decoded.pods:
        for container in pod.containers:
            candidates = [(resource, device_id, *gpu_ids(device_id)) for resource, device_id in container.devices]
            for claim in container.claims:
                gpu_uuid, mig_uuid = gpu_ids(" ".join((claim.device, *claim.cdi_devices)))
                candidates.append((claim.driver, f"{claim.pool}/{claim.device}", gpu_uuid, mig_uuid))
            for resource, device, gpu_uuid, mig_uuid in candidates:
                if not _is_gpu(resource, gpu_uuid, mig_uuid):
                    continue
                if len(found) >= MAX_OWNERS:
                    left_out += 1
                    continue
                found.append(DeviceOwner(pod.namespace, pod.name, container.name, resource, device, gpu_uuid,
                                         mig_uuid))
    return found, left_out


class PodResourcesClient:
    """One gRPC channel to the kubelet's socket, kept between calls (gRPC reconnects by itself)."""

    def __init__(self, socket_path: str, timeout: float) -> None:
        self.socket_path = socket_path
        self.timeout = timeout
        self._channel: Any = None
        self._call: Any = None

    def list(self) -> wire.Decoded:
        if self._call is None:
            import grpc  # only where a socket exists: off the cluster grpcio is never loaded

            self._channel = grpc.insecure_channel(
                f"unix://{os.path.abspath(self.socket_path)}",
                options=[("grpc.max_receive_message_length", wire.MAX_RESPONSE_BYTES),
                         ("grpc.enable_retries", 0)])
            # The answer comes back as bytes and is decoded here: an exception inside a gRPC deserializer
            # comes out as StatusCode.INTERNAL, and a malformed or oversized answer would read as that.
            self._call = self._channel.unary_unary(METHOD, request_serializer=lambda _request: b"",
                                                   response_deserializer=None)
        answer: bytes = self._call(None, timeout=self.timeout)
        return wire.decode_list_response(answer)

    def close(self) -> None:
        if self._channel is not None:
            self._channel.close()
        self._channel = self._call = None


def failure_reason(exc: BaseException) -> str:
    """A bounded label for a failed poll: the gRPC status code in lower case, or the errno's kind."""
    code = getattr(exc, "code", None)
    if callable(code):
        try:
            name = getattr(code(), "name", "")
        except Exception:
            name = ""
        if isinstance(name, str) and name.isidentifier():
            return name.lower()
    if isinstance(exc, PermissionError):
        return "permission"
    if isinstance(exc, wire.TooLarge):
        return "resource_exhausted"  # what gRPC says of an answer past its own size limit
    if isinstance(exc, wire.WireError):
        return "malformed"
    return "error"


@dataclass(frozen=True)
class Answer:
    owners: tuple[DeviceOwner, ...]
    pods: int
    left_out: int
    taken_at: float


@dataclass
class PollerState:
    """What the scrape reads of the poller, replaced whole by the poller thread."""

    answer: Answer | None = None
    absent: str | None = None  # why there is no socket here; None when there is one
    error: str | None = None  # the last poll's failure, None when it succeeded
    failures: dict[str, int] = field(default_factory=dict)
    polls: int = 0


class PodResourcesPoller:
    """Calls ``List`` every ``interval`` on a daemon thread; keeps the last good answer."""

    def __init__(self, socket_path: str, interval: float, timeout: float,
                 client_factory: Callable[[str, float], PodResourcesClient] = PodResourcesClient) -> None:
        self.socket_path = socket_path
        self.interval = interval
        self._client_factory = client_factory
        self._timeout = timeout
        self._client: PodResourcesClient | None = None
        self._state = PollerState()
        self._failures: dict[str, int] = {}
        self._backoff = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.on_answer: Callable[[Answer], None] | None = None  # told each new answer (on the poller's thread)

    @property
    def state(self) -> PollerState:
        return self._state

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="gpuio-pod-resources", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._client is not None:
            self._client.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.poll()
            self._stop.wait(self.interval + self._backoff)

    def poll(self) -> PollerState:
        """One call of List (on the calling thread: the poller's, or a test's)."""
        previous = self._state
        absent = self.why_absent()
        if absent is not None:
            self._backoff = 0.0
            self._state = PollerState(None, absent, None, dict(self._failures), previous.polls)
            return self._state
        try:
            if not os.access(self.socket_path, os.W_OK):  # connect(2) needs write permission on the socket
                raise PermissionError(errno.EACCES, "no write permission on the socket (or its directory)")
            if self._client is None:
                self._client = self._client_factory(self.socket_path, self._timeout)
            decoded = self._client.list()
            found, left_out = owners(decoded)
        except Exception as exc:  # any failure of the kubelet or its answer is this source's failure only
            reason = failure_reason(exc)
            self._failures[reason] = self._failures.get(reason, 0) + 1
            self._backoff = min(MAX_BACKOFF, max(self.interval, self._backoff * 2))
            error = f"{reason}: {type(exc).__name__}: {str(exc)[:200]}"
            if error != previous.error:
                log.warning("pod-resources poll failed", extra=fields(socket=self.socket_path, err=error))
            self._state = PollerState(previous.answer, None, error, dict(self._failures), previous.polls + 1)
            return self._state
        self._backoff = 0.0
        answer = Answer(tuple(found), len(decoded.pods), left_out + decoded.truncated, time.time())
        self._state = PollerState(answer, None, None, dict(self._failures), previous.polls + 1)
        if self.on_answer is not None:
            self.on_answer(answer)
        return self._state

    def why_absent(self) -> str | None:
        """Why there is no kubelet socket to call (None when there is one).  A socket we may not reach
        (a root-only directory) is a failure, not an absence: the operator mounted it for a reason."""
        try:
            st = os.stat(self.socket_path)
        except FileNotFoundError:
            return f"no kubelet pod-resources socket at {self.socket_path}"
        except OSError as exc:
            if exc.errno == errno.EACCES:
                return None  # the poll fails with "permission" and says so
            return f"kubelet pod-resources socket {self.socket_path} unusable: {exc.strerror}"
        if not stat.S_ISSOCK(st.st_mode):
            return f"{self.socket_path} is not a socket"
        return None
