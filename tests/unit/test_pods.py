"""Pod attribution: cgroup paths of real node layouts, and the kubelet's pod-resources API.

The pod-resources client runs against a real gRPC server generated with grpcio-tools from the
kubelet's v1 proto (tests/fixtures/podresources/api.proto) on a unix socket, as the kubelet serves it;
the answers are encoded by the real protobuf runtime and decoded by the exporter's own bounded
decoder.  No kubelet can run here: the server is the kubelet's contract, not the kubelet.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import random
import sys
import time
import tracemalloc
from concurrent import futures

import pytest

from exporter.pods import cgroup, podresources, wire
from tests.conftest import REPO

FIXTURES = os.path.join(REPO, "tests", "fixtures", "cgroup")
PROTO_DIR = os.path.join(REPO, "tests", "fixtures", "podresources")

# fixture -> (pod UID, container ID prefix, runtime); None: a host process
EXPECTED = {
    "v2-systemd-containerd-burstable": ("6f1c2d3e-4a5b-4c6d-8e7f-90a1b2c3d4e5", "3b8e5f0c", "containerd"),
    "v2-systemd-crio-guaranteed": ("0d9e8f7a-6b5c-4d3e-9f2a-1b0c9d8e7f6a", "9f8e7d6c", "cri-o"),
    "v2-systemd-private-cgroupns": ("5a4b3c2d-1e0f-4a9b-8c7d-6e5f4a3b2c1d", "0a1b2c3d", "containerd"),
    "v2-kind-nested": ("1e2d3c4b-5a69-4788-9a0b-c1d2e3f4a5b6", "5e6f7081", "containerd"),
    "v1-systemd-docker": ("2b3c4d5e-6f70-4182-93a4-b5c6d7e8f901", "4f797c53", "docker"),
    "v1-cgroupfs-containerd": ("74c13223-5a00-11e9-b385-42010a80018d", "34dc0b5e", ""),
    "v2-cgroupfs-guaranteed": ("8c7b6a59-4837-4261-9f0e-d1c2b3a49586", "b1c2d3e4", ""),
    "v2-static-pod": ("3f2a9c1e8b7d6a5f4e3d2c1b0a998877", "c0ffee0c", "containerd"),
    "v2-crio-conmon": ("6f1c2d3e-4a5b-4c6d-8e7f-90a1b2c3d4e5", "", ""),
    "v2-host-session": None,
    "v2-host-service": None,
}


def test_every_fixture_has_an_expectation() -> None:
    names = {name[: -len(".cgroup")] for name in os.listdir(FIXTURES) if name.endswith(".cgroup")}
    assert names == set(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_pod_and_container_of_real_node_layouts(name: str, tmp_path) -> None:
    with open(os.path.join(FIXTURES, f"{name}.cgroup")) as handle:
        text = handle.read()
    # Through a procfs tree, as the collector reads it (--path.procfs).
    (tmp_path / "4242").mkdir()
    (tmp_path / "4242" / "cgroup").write_text(text)
    ref = cgroup.of_pid(4242, str(tmp_path))
    expected = EXPECTED[name]
    if expected is None:
        assert ref is None
        return
    uid, container, runtime = expected
    assert ref is not None
    assert ref.pod_uid == uid
    assert ref.container_id.startswith(container) and len(ref.container_id) in (0, 64)
    assert bool(ref.container_id) == bool(container)
    assert ref.runtime == runtime


def test_this_process_is_in_no_pod_here() -> None:
    """The real /proc of this machine: a process outside Kubernetes has no pod, and nothing raises."""
    assert cgroup.of_pid(os.getpid()) is None
    assert cgroup.of_pid(2**22 + 12345) is None  # no such process


def test_junk_never_raises_and_reads_are_bounded(tmp_path) -> None:
    rng = random.Random(17)
    for _ in range(300):
        junk = bytes(rng.randrange(256) for _ in range(rng.randrange(400)))
        cgroup.parse(junk.decode("utf-8", "replace"))
    # A pod segment buried past the bounded read is not found (and the read stays small).
    (tmp_path / "7").mkdir()
    with open(tmp_path / "7" / "cgroup", "w") as handle:
        handle.write("1:x:/" + "a" * (cgroup.MAX_BYTES + 10) + "\n")
        handle.write("0::/kubepods/pod74c13223-5a00-11e9-b385-42010a80018d/" + "b" * 64 + "\n")
    assert cgroup.of_pid(7, str(tmp_path)) is None
    # A symlink in place of the file is not followed.
    (tmp_path / "8").mkdir()
    os.symlink(os.path.join(FIXTURES, "v2-static-pod.cgroup"), tmp_path / "8" / "cgroup")
    assert cgroup.of_pid(8, str(tmp_path)) is None


# --- the pod-resources API ---------------------------------------------------------------------------

GPU0 = "GPU-a4f34abc-7715-3560-dcea-7238b9611a45"
GPU1 = "GPU-0b1c2d3e-4f50-6172-8394-a5b6c7d8e9f0"
MIG = "MIG-5d6e7f80-9a1b-5c2d-8e3f-4a5b6c7d8e9f"


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    """api_pb2 and api_pb2_grpc generated from the kubelet's proto, in process."""
    protoc = pytest.importorskip("grpc_tools.protoc", reason="pip install grpcio-tools (dev extras)")
    out = tmp_path_factory.mktemp("podresources_generated")
    assert protoc.main(["protoc", f"-I{PROTO_DIR}", f"--python_out={out}", f"--grpc_python_out={out}",
                        os.path.join(PROTO_DIR, "api.proto")]) == 0
    sys.path.insert(0, str(out))
    try:
        pb2 = importlib.import_module("api_pb2")
        pb2_grpc = importlib.import_module("api_pb2_grpc")
    finally:
        sys.path.remove(str(out))
    yield pb2, pb2_grpc
    for name in ("api_pb2", "api_pb2_grpc"):
        sys.modules.pop(name, None)


def node_answer(pb2):
    """A GPU node as the kubelet would describe it: a whole GPU, two time-slicing replicas of another in
    two pods, a MIG device, a DRA claim, and pods and devices that are no GPUs."""
    def pod(name, namespace, *containers):
        return pb2.PodResources(name=name, namespace=namespace, containers=list(containers))

    def devices(resource, *ids):
        return pb2.ContainerDevices(resource_name=resource, device_ids=list(ids),
                                    topology=pb2.TopologyInfo(nodes=[pb2.NUMANode(ID=0)]))

    dra = pb2.DynamicResource(claim_name="single-gpu", claim_namespace="gpu-test3", claim_resources=[
        pb2.ClaimResource(driver_name="gpu.nvidia.com", pool_name="node-a", device_name="gpu-1",
                          cdi_devices=[pb2.CDIDevice(name=f"k8s.gpu.nvidia.com/device={GPU1}")])])
    return pb2.ListPodResourcesResponse(pod_resources=[
        pod("detector-7d9f", "serving",
            pb2.ContainerResources(name="server", devices=[devices("nvidia.com/gpu", GPU0)], cpu_ids=[2, 3]),
            pb2.ContainerResources(name="sidecar")),
        pod("ranker-a", "serving", pb2.ContainerResources(name="main", devices=[devices("nvidia.com/gpu",
                                                                                          f"{GPU1}::0")])),
        pod("ranker-b", "serving", pb2.ContainerResources(name="main", devices=[devices("nvidia.com/gpu",
                                                                                          f"{GPU1}::1")])),
        pod("notebook", "research", pb2.ContainerResources(name="lab", devices=[devices("nvidia.com/mig-1g.10gb",
                                                                                          MIG)])),
        pod("pod1", "gpu-test3", pb2.ContainerResources(name="ctr", dynamic_resources=[dra])),
        pod("coredns-5d78c9869d-abcde", "kube-system", pb2.ContainerResources(name="coredns")),
        pod("sriov", "net", pb2.ContainerResources(name="c", devices=[devices("intel.com/sriov", "0000:3b:02.1")])),
    ])


class Kubelet:
    """A real gRPC server of the generated PodResourcesLister on a unix socket."""

    def __init__(self, generated, socket_path: str) -> None:
        import grpc

        pb2, pb2_grpc = generated
        self.answer = node_answer(pb2)
        self.fail_with = None  # a grpc.StatusCode to abort with
        self.delay = 0.0
        self.calls = 0
        kubelet = self

        class Servicer(pb2_grpc.PodResourcesListerServicer):
            def List(self, request, context):  # noqa: N802  (the generated name)
                kubelet.calls += 1
                if kubelet.delay:
                    time.sleep(kubelet.delay)
                if kubelet.fail_with is not None:
                    context.abort(kubelet.fail_with, "kubelet says no")
                return kubelet.answer

        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        pb2_grpc.add_PodResourcesListerServicer_to_server(Servicer(), self.server)
        self.server.add_insecure_port(f"unix://{socket_path}")
        self.server.start()

    def stop(self) -> None:
        self.server.stop(grace=None)


@pytest.fixture
def kubelet(generated, tmp_path):
    pytest.importorskip("grpc")
    directory = tmp_path / "pod-resources"
    directory.mkdir()
    server = Kubelet(generated, str(directory / "kubelet.sock"))
    yield server, str(directory / "kubelet.sock")
    server.stop()


def test_decoder_reads_what_the_protobuf_runtime_writes(generated) -> None:
    pb2, _ = generated
    decoded = wire.decode_list_response(node_answer(pb2).SerializeToString())
    assert [(p.namespace, p.name) for p in decoded.pods][:2] == [("serving", "detector-7d9f"), ("serving", "ranker-a")]
    assert decoded.pods[0].containers[0].devices == [("nvidia.com/gpu", GPU0)]
    assert decoded.pods[4].containers[0].claims[0].device == "gpu-1"
    assert decoded.pods[4].containers[0].claims[0].cdi_devices == (f"k8s.gpu.nvidia.com/device={GPU1}",)


def test_decoder_refuses_junk_with_its_own_error_only(generated) -> None:
    pb2, _ = generated
    good = node_answer(pb2).SerializeToString()
    rng = random.Random(3)
    for _ in range(2000):
        data = bytearray(good[: rng.randrange(len(good) + 1)])
        for _ in range(rng.randrange(4)):
            if data:
                data[rng.randrange(len(data))] = rng.randrange(256)
        with contextlib.suppress(wire.WireError):
            wire.decode_list_response(bytes(data))
    with pytest.raises(wire.WireError):
        wire.decode_list_response(b"\x0a\xff\xff\xff\xff\x0f")  # a length far past the end
    with pytest.raises(wire.WireError):
        wire.decode_list_response(b"\x0b")  # a group


def test_decoder_caps_what_it_keeps(generated) -> None:
    pb2, _ = generated
    many = pb2.ListPodResourcesResponse(pod_resources=[pb2.PodResources(name=f"p{i}", namespace="n")
                                                       for i in range(wire.MAX_PODS + 5)])
    decoded = wire.decode_list_response(many.SerializeToString())
    assert len(decoded.pods) == wire.MAX_PODS and decoded.truncated == 5


def test_a_hostile_answer_cannot_make_the_decoder_keep_millions_of_devices(generated) -> None:
    """The per-pod, per-container and per-ID caps multiply to 16M; an answer of short device IDs (2 bytes
    each on the wire) decoded to a tuple per ID, ~30x its size in memory.  A whole answer keeps at most
    what the poller can use."""
    pb2, _ = generated
    containers = [pb2.ContainerResources(name="c", devices=[pb2.ContainerDevices(resource_name="nvidia.com/gpu",
                                                                                   device_ids=[""] * 256)])
                  for _ in range(8)]
    answer = pb2.ListPodResourcesResponse(pod_resources=[pb2.PodResources(name=f"p{i}", namespace="n",
                                                                          containers=containers)
                                                         for i in range(64)])
    decoded = wire.decode_list_response(answer.SerializeToString())
    kept = sum(len(c.devices) + len(c.claims) for p in decoded.pods for c in p.containers)
    assert kept <= podresources.MAX_OWNERS
    assert kept + decoded.truncated == 64 * 8 * 256  # what was left out is counted, not lost silently


def test_an_answer_of_millions_of_fields_is_refused_not_walked(kubelet) -> None:
    """The caps bound what is kept, not what is walked: a 16 MiB answer of 2-byte fields took ~9 s of CPU
    at every poll, on a thread sharing the interpreter with the scrapes.  An answer of more than
    MAX_FIELDS fields is refused, as gRPC refuses one past its size limit: counted, the last good answer
    kept, the poll backed off."""
    server, socket_path = kubelet
    poller = podresources.PodResourcesPoller(socket_path, interval=10, timeout=5)
    assert poller.poll().answer is not None
    pb2 = sys.modules["api_pb2"]
    containers = [pb2.ContainerResources(name="c", devices=[pb2.ContainerDevices(resource_name="r",
                                                                                   device_ids=[""] * 10)])
                  for _ in range(30)]
    server.answer = pb2.ListPodResourcesResponse(pod_resources=[
        pb2.PodResources(name=f"p{i}", namespace="n", containers=containers) for i in range(1024)])
    state = poller.poll()
    assert state.failures == {"resource_exhausted": 1}
    assert state.answer is not None and state.answer.pods == 7  # the last good answer stands


def test_a_malformed_answer_is_counted_as_malformed(tmp_path) -> None:
    """A kubelet (or whatever listens on its socket) answering bytes that are no message: the failure
    reads "malformed".  Decoded inside gRPC's deserializer, it read "internal", like a kubelet bug."""
    grpc = pytest.importorskip("grpc")
    socket_path = str(tmp_path / "kubelet.sock")
    handler = grpc.method_handlers_generic_handler("v1.PodResourcesLister", {
        "List": grpc.unary_unary_rpc_method_handler(lambda request, context: b"\x0b")})  # a group: refused
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    server.add_generic_rpc_handlers((handler,))
    server.add_insecure_port(f"unix://{socket_path}")
    server.start()
    try:
        state = podresources.PodResourcesPoller(socket_path, interval=10, timeout=5).poll()
    finally:
        server.stop(grace=None)
    assert state.failures == {"malformed": 1}


def test_a_cdi_device_repeating_its_name_keeps_one(generated) -> None:
    """A CDIDevice has one name; the wire allows a field to repeat (the last one wins in protobuf).  One
    CDIDevice of 100,000 names must not become a list of 100,000 strings before the cap applies."""
    pb2, _ = generated
    cdi = b"".join(b"\x0a\x02ab" for _ in range(100_000))  # CDIDevice{name="ab"} x 100,000 in one message
    claim = b"\x0a" + varint(len(cdi)) + cdi + pb2.ClaimResource(driver_name="gpu.nvidia.com").SerializeToString()
    dynamic = b"\x22" + varint(len(claim)) + claim
    container = pb2.ContainerResources(name="c").SerializeToString() + b"\x2a" + varint(len(dynamic)) + dynamic
    pod = pb2.PodResources(name="p", namespace="n").SerializeToString() + b"\x1a" + varint(len(container)) + container
    data = b"\x0a" + varint(len(pod)) + pod
    tracemalloc.start()
    try:
        decoded = wire.decode_list_response(data)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert decoded.pods[0].containers[0].claims[0].cdi_devices[:1] == ("ab",)
    assert peak < 4 * len(data)  # a list of 100,000 strings alone is ~6 MB, the answer 0.4 MB


def varint(value: int) -> bytes:
    """A protobuf base-128 varint, as the kubelet's encoder writes it."""
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def test_gpu_owners_from_a_real_grpc_server(kubelet) -> None:
    server, socket_path = kubelet
    poller = podresources.PodResourcesPoller(socket_path, interval=10, timeout=2)
    state = poller.poll()
    assert state.error is None and state.absent is None and state.answer is not None
    assert state.answer.pods == 7
    got = {(o.namespace, o.pod, o.container, o.resource, o.device, o.gpu_uuid, o.mig_uuid) for o in state.answer.owners}
    assert got == {
        ("serving", "detector-7d9f", "server", "nvidia.com/gpu", GPU0, GPU0, ""),
        ("serving", "ranker-a", "main", "nvidia.com/gpu", f"{GPU1}::0", GPU1, ""),  # time-slicing replicas
        ("serving", "ranker-b", "main", "nvidia.com/gpu", f"{GPU1}::1", GPU1, ""),
        ("research", "notebook", "lab", "nvidia.com/mig-1g.10gb", MIG, "", MIG),
        ("gpu-test3", "pod1", "ctr", "gpu.nvidia.com", "node-a/gpu-1", GPU1, ""),  # DRA, UUID from the CDI name
    }
    poller.stop()


def test_failures_keep_the_last_answer_and_back_off(kubelet) -> None:
    import grpc

    server, socket_path = kubelet
    poller = podresources.PodResourcesPoller(socket_path, interval=1, timeout=0.5)
    good = poller.poll().answer
    server.fail_with = grpc.StatusCode.UNAVAILABLE
    state = poller.poll()
    assert state.answer is good and state.error is not None and state.failures == {"unavailable": 1}
    assert poller._backoff == 1
    poller.poll()
    assert poller._backoff == 2  # doubles, up to MAX_BACKOFF
    server.fail_with, server.delay = None, 1.5  # a hung kubelet: the call times out, the poller goes on
    started = time.monotonic()
    state = poller.poll()
    assert time.monotonic() - started < 1.4
    assert state.failures == {"unavailable": 2, "deadline_exceeded": 1} and state.answer is good
    server.delay = 0
    time.sleep(1.2)  # let the hung call finish on the server
    state = poller.poll()
    assert state.error is None and state.answer is not good and poller._backoff == 0
    poller.stop()


def test_no_socket_is_an_absent_source_and_grpc_is_not_loaded(tmp_path) -> None:
    poller = podresources.PodResourcesPoller(str(tmp_path / "kubelet.sock"), interval=1, timeout=1)
    state = poller.poll()
    assert state.absent is not None and "no kubelet pod-resources socket" in state.absent
    assert state.error is None and state.failures == {} and state.answer is None
    (tmp_path / "kubelet.sock").write_text("")
    assert "not a socket" in (poller.poll().absent or "")


def test_the_poller_thread_polls_in_the_background(kubelet) -> None:
    server, socket_path = kubelet
    poller = podresources.PodResourcesPoller(socket_path, interval=0.05, timeout=1)
    poller.start()
    deadline = time.monotonic() + 10
    while server.calls < 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    poller.stop()
    assert server.calls >= 3 and poller.state.answer is not None
