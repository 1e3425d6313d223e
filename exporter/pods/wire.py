"""A bounded decoder of the protocol-buffers wire format, for the kubelet's pod-resources answer.

Why not the protobuf runtime: it is a large dependency (and a second one with grpcio's) for five
small messages, and its parser trusts sizes and depths that this exporter wants to bound itself.
The wire format (protobuf.dev/programming-guides/encoding) is a sequence of (tag, value) pairs, the
tag a varint ``field_number << 3 | wire_type``; this reader knows varints (0), 64-bit (1),
length-delimited (2) and 32-bit (5) values, skips fields it does not know (as any protobuf reader
must: newer kubelets add fields) and refuses groups (3, 4: proto2 only) and anything truncated.

The messages, with the field numbers of k8s.io/kubelet/pkg/apis/podresources/v1/api.proto::

    ListPodResourcesResponse { repeated PodResources pod_resources = 1; }
    PodResources             { string name = 1; string namespace = 2; repeated ContainerResources containers = 3; }
    ContainerResources       { string name = 1; repeated ContainerDevices devices = 2;
                               repeated DynamicResource dynamic_resources = 5; }
    ContainerDevices         { string resource_name = 1; repeated string device_ids = 2; }
    DynamicResource          { string claim_name = 2; string claim_namespace = 3;
                               repeated ClaimResource claim_resources = 4; }
    ClaimResource            { repeated CDIDevice cdi_devices = 1; string driver_name = 2; string pool_name = 3;
                               string device_name = 4; }
    CDIDevice                { string name = 1; }

Bounded: the whole answer is capped by the gRPC channel (MAX_RESPONSE_BYTES), and the decoder keeps at
most MAX_PODS pods, MAX_CONTAINERS containers a pod, MAX_DEVICES device IDs a container,
MAX_TOTAL_DEVICES device IDs and claims in all and MAX_STRING_BYTES of any string; what is past a cap
is counted in ``Decoded.truncated``, not kept.  An answer of more than MAX_FIELDS fields is refused
(TooLarge), as gRPC refuses one past MAX_RESPONSE_BYTES.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field

MAX_RESPONSE_BYTES = 16 << 20  # ~110 pods on a node; a few KiB each at most
MAX_PODS = 1024
MAX_CONTAINERS = 64
MAX_DEVICES = 256
# Device IDs and claims kept from a whole answer: the per-pod and per-container caps multiply to 16M,
# and a 16 MiB answer of 2-byte IDs would decode to ~8M tuples (~0.5 GiB).  The poller keeps at most
# this many GPU devices anyway (podresources.MAX_OWNERS).
MAX_TOTAL_DEVICES = 4096
MAX_CDI_DEVICES = 16
# Fields walked in one answer (each ~1 us of CPU): a real node's answer has a few thousand.  The caps
# above bound what is kept, not what is walked: a 16 MiB answer of 2-byte fields took 9 s of CPU every
# poll, on a thread that shares the interpreter with the scrapes.  Past it the answer is refused.
MAX_FIELDS = 200_000
MAX_STRING_BYTES = 512
VARINT, FIXED64, LENGTH, FIXED32 = 0, 1, 2, 5


class WireError(ValueError):
    """Bytes that are not a well-formed message."""


class TooLarge(WireError):
    """An answer of more fields than MAX_FIELDS."""


def _varint(data: memoryview, offset: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if offset >= len(data):
            raise WireError("truncated varint")
        byte = data[offset]
        offset += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, offset
        shift += 7
        if shift >= 64:
            raise WireError("varint longer than 10 bytes")


def fields(data: bytes | memoryview) -> Iterator[tuple[int, int, int | memoryview]]:
    """``(field number, wire type, value)`` of each field of one message: an int for varints and fixed
    values, a memoryview of the bytes for length-delimited ones (strings, bytes, sub-messages)."""
    view = memoryview(data)
    offset = 0
    while offset < len(view):
        tag, offset = _varint(view, offset)
        number, wire_type = tag >> 3, tag & 7
        if number == 0:
            raise WireError("field number 0")
        if wire_type == VARINT:
            value, offset = _varint(view, offset)
            yield number, wire_type, value
        elif wire_type in (FIXED64, FIXED32):
            width = 8 if wire_type == FIXED64 else 4
            if offset + width > len(view):
                raise WireError("truncated fixed-width value")
            yield number, wire_type, int.from_bytes(view[offset : offset + width], "little")
            offset += width
        elif wire_type == LENGTH:
            length, offset = _varint(view, offset)
            if offset + length > len(view):
                raise WireError("length past the end of the message")
            yield number, wire_type, view[offset : offset + length]
            offset += length
        else:
            raise WireError(f"wire type {wire_type} (groups are not used by this API)")


def _text(value: int | memoryview) -> str:
    if not isinstance(value, memoryview):
        raise WireError("a string field with a numeric wire type")
    return bytes(value[:MAX_STRING_BYTES]).decode("utf-8", "replace")


def _message(value: int | memoryview) -> memoryview:
    if not isinstance(value, memoryview):
        raise WireError("a message field with a numeric wire type")
    return value


@dataclass(frozen=True)
class ClaimDevice:
    """A device a DRA driver allocated for a claim."""

    driver: str
    pool: str
    device: str
    cdi_devices: tuple[str, ...]


@dataclass
class Container:
    name: str = ""
    # (resource name, device ID) of device-plugin devices: ("nvidia.com/gpu", "GPU-…" / "MIG-…" / "GPU-…::2")
    devices: list[tuple[str, str]] = field(default_factory=list)
    claims: list[ClaimDevice] = field(default_factory=list)


@dataclass
class Pod:
    name: str = ""
    namespace: str = ""
    containers: list[Container] = field(default_factory=list)


@dataclass
class Decoded:
    pods: list[Pod] = field(default_factory=list)
    truncated: int = 0  # pods, containers, devices left out by the caps
    devices: int = 0  # device IDs and claims kept, all containers together (MAX_TOTAL_DEVICES)
    fields_left: int = MAX_FIELDS

    def fields(self, data: bytes | memoryview) -> Iterator[tuple[int, int, int | memoryview]]:
        """:func:`fields`, each one counted against the answer's MAX_FIELDS."""
        for item in fields(data):
            self.fields_left -= 1
            if self.fields_left < 0:
                raise TooLarge(f"an answer of more than {MAX_FIELDS} fields")
            yield item

    def room(self, container: Container) -> bool:
        """Whether one more device or claim may be kept in ``container``; counts it if so."""
        if self.devices >= MAX_TOTAL_DEVICES or len(container.devices) + len(container.claims) >= MAX_DEVICES:
            self.truncated += 1
            return False
        self.devices += 1
        return True


def decode_list_response(data: bytes | memoryview) -> Decoded:
    """A ``ListPodResourcesResponse``; WireError when the bytes are not one."""
    decoded = Decoded()
    for number, _, value in decoded.fields(data):
        if number != 1:
            continue
        if len(decoded.pods) >= MAX_PODS:
            decoded.truncated += 1
            continue
        decoded.pods.append(_pod(_message(value), decoded))
    return decoded


def _pod(data: memoryview, decoded: Decoded) -> Pod:
    pod = Pod()
    for number, _, value in decoded.fields(data):
        if number == 1:
            pod.name = _text(value)
        elif number == 2:
            pod.namespace = _text(value)
        elif number == 3:
            if len(pod.containers) >= MAX_CONTAINERS:
                decoded.truncated += 1
                continue
            pod.containers.append(_container(_message(value), decoded))
    return pod


def _container(data: memoryview, decoded: Decoded) -> Container:
    container = Container()
    for number, _, value in decoded.fields(data):
        if number == 1:
            container.name = _text(value)
        elif number == 2:
            _devices(_message(value), container, decoded)
        elif number == 5:
            for claim in _dynamic(_message(value), decoded):
                if decoded.room(container):
                    container.claims.append(claim)
    return container


def _devices(data: memoryview, container: Container, decoded: Decoded) -> None:
    """A ContainerDevices: its IDs go into ``container`` while there is room (the resource name may come
    after the IDs on the wire, so IDs are gathered first, at most as many as there is room for)."""
    resource, ids = "", list[memoryview]()
    for number, _, value in decoded.fields(data):
        if number == 1:
            resource = _text(value)
        elif number == 2 and decoded.room(container):
            ids.append(_message(value))
    container.devices.extend((resource, _text(device_id)) for device_id in ids)


def _dynamic(data: memoryview, decoded: Decoded) -> list[ClaimDevice]:
    claims: list[ClaimDevice] = []
    for number, _, value in decoded.fields(data):
        if number == 4 and len(claims) < MAX_DEVICES:
            claims.append(_claim_resource(_message(value), decoded))
    return claims


def _claim_resource(data: memoryview, decoded: Decoded) -> ClaimDevice:
    driver = pool = device = ""
    cdi: list[str] = []
    for number, _, value in decoded.fields(data):
        if number == 1 and len(cdi) < MAX_CDI_DEVICES:
            # A CDIDevice has one name; a hostile one repeating it thousands of times keeps one.
            cdi.extend(_text(v) for n, _, v in itertools.islice(decoded.fields(_message(value)), 64) if n == 1)
        elif number == 2:
            driver = _text(value)
        elif number == 3:
            pool = _text(value)
        elif number == 4:
            device = _text(value)
    return ClaimDevice(driver, pool, device, tuple(cdi[:MAX_CDI_DEVICES]))
