"""The GPU-time ledger end to end: the real exporter process (NVML the fake of tests/e2e/fake_gpu_exporter.py,
there being no GPU here), the instrumentation library serving and loading engines in this process, and the
kubelet's pod-resources API served by a gRPC server generated from the kubelet's proto
(tests/unit/test_pods.py): every GPU's seconds go to the state it is in, and each pod's to its own.

The kubelet's node (tests/unit/test_pods.py node_answer): GPU0 is held by pod serving/detector-7d9f, which
runs nothing; GPU1 is time-sliced between serving/ranker-a and serving/ranker-b, and ranker-a's engine has a
request in flight on it.  Two GPUs no pod holds: one an engine loads to, one nobody uses.
"""

from __future__ import annotations

import os
import time

import pytest

import gpuio
from tests.conftest import ExporterProcess, parse_samples
from tests.unit.test_pods import GPU0, GPU1, generated, kubelet  # noqa: F401  (fixtures)

pytestmark = pytest.mark.e2e

LOADED_GPU = "GPU-e2e00000-0000-0000-0000-00000000000a"
UNUSED_GPU = "GPU-e2e00000-0000-0000-0000-00000000000b"
WINDOW_S = 4.0
TOLERANCE_S = 1.0  # a sweep (250 ms) and a work measurement (250 ms) at each end, on a loaded 2-core machine


def ledger(text: str) -> tuple[dict[tuple[str, str], float], dict[tuple[str, str, str], float]]:
    """(uuid, state) -> seconds, and (pod, uuid, state) -> seconds, from one scrape."""
    samples = parse_samples(text)
    devices = {(dict(labels)["uuid"], dict(labels)["state"]): value for (name, labels), value in samples.items()
               if name == "gpuio_gpu_time_seconds_total"}
    pods = {(dict(labels)["pod"], dict(labels)["uuid"], dict(labels)["state"]): value
            for (name, labels), value in samples.items() if name == "gpuio_pod_gpu_time_seconds_total"}
    return devices, pods


def test_each_gpu_and_each_pod_gets_the_seconds_of_the_state_it_is_in(tmp_path, monkeypatch,
                                                                          kubelet) -> None:  # noqa: F811
    _, socket_path = kubelet
    spool = str(tmp_path / "spool")
    os.mkdir(spool)
    model = tmp_path / "ranker.plan"
    model.write_bytes(b"x" * 65536)
    monkeypatch.setenv("POD_NAMESPACE", "serving")
    monkeypatch.setenv("POD_NAME", "ranker-a")
    gpuio.close()
    gpuio.configure(spool)
    exporter = ExporterProcess(["--collector.disable-defaults", "--collector.nvml", "--collector.nvml.interval=250ms",
                                "--collector.nvml.slow-interval=250ms", "--collector.engines",
                                f"--collector.engines.spool-dir={spool}", "--collector.engines.discover=false",
                                "--collector.engines.work-interval=250ms", "--collector.pods",
                                f"--collector.pods.pod-resources-socket={socket_path}",
                                "--collector.pods.pod-resources-interval=200ms"],
                               env={"GPUIO_FAKE_GPUS": ",".join((GPU0, GPU1, LOADED_GPU, UNUSED_GPU))},
                               module="tests.e2e.fake_gpu_exporter")
    serving = gpuio.engine("ranker")
    serving.set_info(str(model), gpu_uuid=GPU1)
    loading = gpuio.engine("detector")
    try:
        with serving.infer(), loading.loading(str(model), gpu_uuid=LOADED_GPU):
            exporter.start()
            deadline = time.monotonic() + 20
            # Settled: the kubelet's answer read, the work measured, each GPU's state counted a while.
            while ledger(exporter.scrape())[0].get((GPU0, "allocated_idle"), 0.0) < 1.0:
                assert time.monotonic() < deadline, exporter.scrape()[-3000:]
                time.sleep(0.2)
            first_at, (devices_before, pods_before) = time.monotonic(), ledger(exporter.scrape())
            time.sleep(WINDOW_S)
            second_at, (devices_after, pods_after) = time.monotonic(), ledger(exporter.scrape())
    finally:
        exporter.stop()
        gpuio.close()
        gpuio.configure(None)
    elapsed = second_at - first_at
    grown = {key: value - devices_before.get(key, 0.0) for key, value in devices_after.items()}
    print(f"over {elapsed:.2f} s: " + ", ".join(f"{uuid[-4:]} {state} {seconds:.2f}"
                                              for (uuid, state), seconds in sorted(grown.items()) if seconds))
    expected = {GPU0: "allocated_idle", GPU1: "serving", LOADED_GPU: "loading", UNUSED_GPU: "idle"}
    for uuid, state in expected.items():
        assert grown[(uuid, state)] == pytest.approx(elapsed, abs=TOLERANCE_S), (uuid, state, grown)
        others = {other: seconds for (device, other), seconds in grown.items() if device == uuid and other != state}
        assert sum(others.values()) <= TOLERANCE_S / 2, (uuid, others)
    pods = {key: value - pods_before.get(key, 0.0) for key, value in pods_after.items()}
    assert pods[("detector-7d9f", GPU0, "allocated_idle")] == pytest.approx(elapsed, abs=TOLERANCE_S)
    assert pods[("ranker-a", GPU1, "serving")] == pytest.approx(elapsed, abs=TOLERANCE_S)
    assert pods[("ranker-b", GPU1, "allocated_idle")] == pytest.approx(elapsed, abs=TOLERANCE_S)
    assert not any(seconds > 0 for (pod, _, state), seconds in pods.items() if (pod, state) == ("ranker-b", "serving"))
