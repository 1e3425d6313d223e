"""GPU processes and GPUs named by pod: the nvml collector (on the fake NVML, CI has no GPU) joined with
the pods collector polling a real gRPC server generated from the kubelet's proto, and process cgroups
laid out as on a node (tests/fixtures/cgroup)."""

from __future__ import annotations

import logging
import os
import time

from exporter.collect import Scraper
from exporter.collectors.pods import PodsCollector
from exporter.context import Context
from exporter.exposition import render
from exporter.host.nvml_device import ProcessInfo
from tests.conftest import parse_samples
from tests.unit.test_nvml_collector import make, now_us, value
from tests.unit.test_nvml_fake import FakeNvml, h100s
from tests.unit.test_pods import FIXTURES, generated, kubelet  # noqa: F401  (fixtures)

UID_A = "6f1c2d3e-4a5b-4c6d-8e7f-90a1b2c3d4e5"  # v2-systemd-containerd-burstable
UID_B = "0d9e8f7a-6b5c-4d3e-9f2a-1b0c9d8e7f6a"  # v2-systemd-crio-guaranteed
UID_C = "5a4b3c2d-1e0f-4a9b-8c7d-6e5f4a3b2c1d"  # v2-systemd-private-cgroupns


def procfs_with(tmp_path, cgroups: dict[int, str]) -> str:
    root = tmp_path / "proc"
    for pid, fixture in cgroups.items():
        (root / str(pid)).mkdir(parents=True)
        with open(os.path.join(FIXTURES, f"{fixture}.cgroup")) as handle:
            (root / str(pid) / "cgroup").write_text(handle.read())
    return str(root)


def answer(pb2, gpu0: str, gpu1: str):
    def container(name, *ids):
        return pb2.ContainerResources(name=name, devices=[pb2.ContainerDevices(resource_name="nvidia.com/gpu",
                                                                               device_ids=list(ids))])
    return pb2.ListPodResourcesResponse(pod_resources=[
        pb2.PodResources(name="detector", namespace="serving", containers=[container("server", gpu0),
                                                                            container("logger")]),
        pb2.PodResources(name="ranker-a", namespace="serving", containers=[container("main", f"{gpu1}::0")]),
        pb2.PodResources(name="ranker-b", namespace="serving", containers=[container("main", f"{gpu1}::1")]),
    ])


def test_gpu_processes_get_their_pod(tmp_path, generated, kubelet) -> None:  # noqa: F811
    pb2, _ = generated
    server, socket_path = kubelet
    fake = FakeNvml(h100s(2))
    gpu0, gpu1 = (gpu.uuid for gpu in fake.gpus)
    server.answer = answer(pb2, gpu0, gpu1)
    fake.gpus[0].processes = [ProcessInfo(101, 1 << 30), ProcessInfo(104, 1 << 20)]
    fake.gpus[1].processes = [ProcessInfo(102, 2 << 30), ProcessInfo(103, 3 << 30)]
    for gpu in fake.gpus:
        gpu.process_names = {101: "triton", 102: "ranker", 103: "ranker", 104: "Xorg"}
    procfs = procfs_with(tmp_path, {101: "v2-systemd-containerd-burstable", 102: "v2-systemd-crio-guaranteed",
                                    103: "v2-systemd-private-cgroupns", 104: "v2-host-session"})
    context = Context(procfs=procfs)
    pods = PodsCollector(context, {"pod-resources-socket": socket_path, "pod-resources-interval": 60.0,
                                   "pod-resources-timeout": 2.0})
    pods.poller.poll()
    context.pods.update_writer_pods([(UID_B, "serving", "ranker-b")])  # what the engines collector passes on
    nvml = make(fake)
    nvml.context = context
    nvml.sampler.sample_now()
    samples = parse_samples(render([*nvml.collect(), *pods.collect()]))
    memory = "gpuio_gpu_process_memory_used_bytes"
    # One holder of GPU 0: its pod and the container holding the GPU.
    assert value(samples, memory, pid="101", namespace="serving", pod="detector", container="server") == 1 << 30
    # GPU 1 time-sliced by two pods: the one whose writer named its UID, the container of that pod.
    assert value(samples, memory, pid="102", namespace="serving", pod="ranker-b", container="main") == 2 << 30
    # The other pod on GPU 1 cannot be told apart: no labels, rather than a guess.
    labels_103 = [ls for (n, ls), _ in samples.items() if n == memory and ("pid", "103") in ls]
    assert labels_103 and not {key for key, _ in labels_103[0]} & {"namespace", "pod", "container"}
    # A host process: exactly the series of before.
    assert {key for (n, ls), _ in samples.items() if n == memory and ("pid", "104") in ls
            for key, _ in ls} == {"gpu", "uuid", "pid", "process_name"}
    # The GPUs themselves: one info series per allocation, joinable on uuid.
    assert value(samples, "gpuio_gpu_pod_info", uuid=gpu0, namespace="serving", pod="detector",
                 container="server") == 1
    assert value(samples, "gpuio_gpu_pod_info", uuid=gpu1, device=f"{gpu1}::1", pod="ranker-b") == 1
    assert value(samples, "gpuio_kubelet_pod_resources_pods") == 3


def test_off_the_cluster_the_pods_collector_is_absent_and_logs_once(tmp_path, caplog) -> None:
    caplog.set_level(logging.INFO, logger="gpuio")
    collector = PodsCollector(Context(), {"pod-resources-socket": str(tmp_path / "kubelet.sock"),
                                          "pod-resources-interval": 60.0, "pod-resources-timeout": 1.0})
    collector.poller.poll()
    scraper = Scraper([collector], 2.0, "")
    for _ in range(3):
        samples = parse_samples(render(scraper.scrape_sync()))
        collector.poller.poll()
    assert value(samples, "gpuio_scrape_collector_success", collector="pods") == 1
    assert value(samples, "gpuio_scrape_collector_state", collector="pods", state="absent") == 1
    assert not any(name.startswith("gpuio_gpu_pod") or name.startswith("gpuio_kubelet") for name, _ in samples)
    assert [r.getMessage() for r in caplog.records if "absent" in r.getMessage()] == ["source absent"]


def test_a_failing_kubelet_is_visible_and_serves_its_last_answer(tmp_path, generated, kubelet) -> None:  # noqa: F811
    import grpc

    server, socket_path = kubelet
    collector = PodsCollector(Context(), {"pod-resources-socket": socket_path, "pod-resources-interval": 60.0,
                                          "pod-resources-timeout": 1.0})
    scraper = Scraper([collector], 2.0, "")
    collector.poller.poll()
    server.fail_with = grpc.StatusCode.UNAVAILABLE
    collector.poller.poll()
    samples = parse_samples(render(scraper.scrape_sync()))
    assert value(samples, "gpuio_scrape_collector_state", collector="pods", state="stale") == 1
    assert value(samples, "gpuio_kubelet_pod_resources_failures_total", reason="unavailable") == 1
    assert any(name == "gpuio_gpu_pod_info" for name, _ in samples)  # the last answer, still served


def test_a_kubelet_failing_from_the_start_says_why_at_once(tmp_path, generated, kubelet) -> None:  # noqa: F811
    """No good answer yet: the collector is failing, and its failures by reason are served from the first
    (they were served only once a first answer had come)."""
    import grpc

    server, socket_path = kubelet
    collector = PodsCollector(Context(), {"pod-resources-socket": socket_path, "pod-resources-interval": 60.0,
                                          "pod-resources-timeout": 1.0})
    server.fail_with = grpc.StatusCode.PERMISSION_DENIED
    collector.poller.poll()
    samples = parse_samples(render(Scraper([collector], 2.0, "").scrape_sync()))
    assert value(samples, "gpuio_scrape_collector_state", collector="pods", state="failing") == 1
    assert value(samples, "gpuio_kubelet_pod_resources_failures_total", reason="permission_denied") == 1
    assert not any(name == "gpuio_gpu_pod_info" for name, _ in samples)


def test_a_mig_device_is_named_after_its_gpu(tmp_path, generated, kubelet) -> None:  # noqa: F811
    """The device plugin hands out MIG UUIDs; NVML lists MIG processes on the parent GPU: the nvml
    collector tells which GPU each MIG device is part of, so both the process and the info series join."""
    from tests.unit.test_nvml_fake import FakeGpu, FakeMig

    pb2, _ = generated
    server, socket_path = kubelet
    mig = "MIG-5d6e7f80-9a1b-5c2d-8e3f-4a5b6c7d8e9f"
    gpu = FakeGpu("GPU-00000007-aaaa-bbbb-cccc-dddddddddddd", mig_mode=(1, 1), mig=[FakeMig(mig, 1, 0)])
    gpu.processes, gpu.process_names = [ProcessInfo(101, 1 << 30)], {101: "triton"}
    server.answer = pb2.ListPodResourcesResponse(pod_resources=[pb2.PodResources(
        name="notebook", namespace="research", containers=[pb2.ContainerResources(
            name="lab", devices=[pb2.ContainerDevices(resource_name="nvidia.com/mig-1g.10gb", device_ids=[mig])])])])
    context = Context(procfs=procfs_with(tmp_path, {101: "v2-systemd-containerd-burstable"}))
    pods = PodsCollector(context, {"pod-resources-socket": socket_path, "pod-resources-interval": 60.0,
                                   "pod-resources-timeout": 2.0})
    pods.poller.poll()
    nvml = make(FakeNvml([gpu]))
    nvml.context = context
    nvml.sampler.sample_now()  # learns the MIG device's parent
    nvml.sampler.sample_now()
    samples = parse_samples(render([*nvml.collect(), *pods.collect()]))
    assert value(samples, "gpuio_gpu_process_memory_used_bytes", pid="101", namespace="research", pod="notebook",
                 container="lab") == 1 << 30
    assert value(samples, "gpuio_gpu_pod_info", uuid=gpu.uuid, mig_uuid=mig, pod="notebook") == 1


def test_before_the_first_poll_a_missing_socket_is_already_absent(tmp_path) -> None:
    """`gpuio scrape` runs the collectors once without starting their threads: no socket is absent there too."""
    collector = PodsCollector(Context(), {"pod-resources-socket": str(tmp_path / "kubelet.sock")})
    samples = parse_samples(render(Scraper([collector], 2.0, "").scrape_sync()))
    assert value(samples, "gpuio_scrape_collector_state", collector="pods", state="absent") == 1


def test_a_writer_cannot_name_its_processes_after_another_pod(tmp_path, generated, kubelet) -> None:  # noqa: F811
    """A spool writer's namespace/pod are its claim (any environment can be set).  Pod A's writer claiming
    to be payments/billing-api must not put that name on pod A's GPU processes where the kubelet says
    who holds the GPU; and two pods (two UIDs) claiming one name cannot both be it."""
    pb2, _ = generated
    server, socket_path = kubelet
    fake = FakeNvml(h100s(2))
    gpu0, gpu1 = (gpu.uuid for gpu in fake.gpus)
    server.answer = answer(pb2, gpu0, gpu1)
    fake.gpus[0].processes = [ProcessInfo(101, 1 << 30)]
    fake.gpus[1].processes = [ProcessInfo(102, 2 << 30), ProcessInfo(103, 3 << 30)]
    procfs = procfs_with(tmp_path, {101: "v2-systemd-containerd-burstable", 102: "v2-systemd-crio-guaranteed",
                                    103: "v2-systemd-private-cgroupns"})
    context = Context(procfs=procfs)
    pods = PodsCollector(context, {"pod-resources-socket": socket_path, "pod-resources-interval": 60.0,
                                   "pod-resources-timeout": 2.0})
    pods.poller.poll()
    context.pods.update_writer_pods([
        (UID_A, "payments", "billing-api"),  # pod A on GPU 0, which the kubelet gave to serving/detector
        (UID_B, "serving", "ranker-b"),  # the real ranker-b on GPU 1
        (UID_C, "serving", "ranker-b"),  # pod C, the other pod on GPU 1, claiming to be ranker-b too
    ])
    nvml = make(fake)
    nvml.context = context
    nvml.sampler.sample_now()
    samples = parse_samples(render([*nvml.collect(), *pods.collect()]))
    memory = "gpuio_gpu_process_memory_used_bytes"
    named = {dict(ls)["pid"]: (dict(ls).get("namespace"), dict(ls).get("pod"))
             for (n, ls), _ in samples.items() if n == memory}
    assert ("payments", "billing-api") not in named.values()
    assert named["101"] == ("serving", "detector")  # the kubelet's one holder of GPU 0
    # ranker-b has one UID: of two pods claiming it, neither is believed, and neither sharer is guessed.
    assert named["102"] == named["103"] == (None, None)


def write_stat(procfs: str, pid: int, name: str, start_ticks: int) -> None:
    """/proc/<pid>/stat as the kernel writes it: field 22 is the start time, in clock ticks since boot."""
    fields = ["S", "1", str(pid), str(pid), *["0"] * 15, str(start_ticks), *["0"] * 30]
    with open(os.path.join(procfs, str(pid), "stat"), "w") as handle:
        handle.write(f"{pid} ({name}) {' '.join(fields)}\n")


def test_a_reused_pid_is_a_new_process_with_its_own_name_pod_and_busy_time(tmp_path, generated, kubelet) -> None:  # noqa: F811
    """A process exits and the kernel hands its pid to the next one between two sweeps: NVML lists the
    same pid on and on.  The new process gets its own name and pod (none here: a host process), not the
    old one's, and its busy seconds start from zero: the exporter tells them apart by start time."""
    pb2, _ = generated
    server, socket_path = kubelet
    fake = FakeNvml(h100s(1))
    gpu0 = fake.gpus[0].uuid
    server.answer = pb2.ListPodResourcesResponse(pod_resources=[pb2.PodResources(
        name="detector", namespace="serving", containers=[pb2.ContainerResources(
            name="server", devices=[pb2.ContainerDevices(resource_name="nvidia.com/gpu", device_ids=[gpu0])])])])
    fake.gpus[0].processes = [ProcessInfo(101, 1 << 30)]
    fake.gpus[0].process_names = {101: "triton"}
    procfs = procfs_with(tmp_path, {101: "v2-systemd-containerd-burstable"})
    write_stat(procfs, 101, "triton", 5_000)
    context = Context(procfs=procfs)
    pods = PodsCollector(context, {"pod-resources-socket": socket_path, "pod-resources-interval": 60.0,
                                   "pod-resources-timeout": 2.0})
    pods.poller.poll()
    nvml = make(fake)
    nvml.context = context
    nvml.sampler.sample_now()  # the baseline of the busy seconds
    time.sleep(0.1)
    fake.gpus[0].add_process_samples(now_us(), 1, {101: (100, 50)})
    nvml.sampler.sample_now()
    memory, busy = "gpuio_gpu_process_memory_used_bytes", "gpuio_gpu_process_sm_busy_seconds_total"
    samples = parse_samples(render(nvml.collect()))
    assert value(samples, memory, pid="101", process_name="triton", pod="detector") == 1 << 30
    assert value(samples, busy, pid="101", process_name="triton") > 0
    # pid 101 exits; the next process the kernel starts gets pid 101 again: a host process, another name.
    with open(os.path.join(FIXTURES, "v2-host-session.cgroup")) as handle:
        (tmp_path / "proc" / "101" / "cgroup").write_text(handle.read())
    write_stat(procfs, 101, "Xorg", 9_000)
    fake.gpus[0].process_names = {101: "Xorg"}
    fake.gpus[0].processes = [ProcessInfo(101, 1 << 20)]
    nvml.sampler.sample_now()
    samples = parse_samples(render(nvml.collect()))
    series = [dict(ls) for (n, ls), _ in samples.items() if n == memory]
    assert series == [{"gpu": "0", "uuid": gpu0, "pid": "101", "process_name": "Xorg"}]
    nvml.sampler.sample_now()  # nothing ran since: the new process has been busy for no time at all
    assert value(parse_samples(render(nvml.collect())), busy, pid="101", process_name="Xorg") == 0
