"""Engines on a real GPU: a PyTorch model file loaded through the generic loader path, served through
the pool on the GPU, and the engines collector (in-process, no web server) showing it all.

No TensorRT engine can run on the GPU machines here (docs/engines.md), so a TorchScript model stands
in for an engine: a file on disk, read (timed, the disk's part) and deserialized onto the GPU (timed)
by ``gpuio.load``; an EnginePool of 2 contexts (each a CUDA stream and its CUDA-event timer),
warmed before serving; 4 threads sending 50 requests each, so requests wait for a context.  Then
the engines collector reads the spool and must show: load histograms and bytes, inference latency
and GPU-time histograms, pool size, waits, warm-up and first-inference histograms, and in
gpuio_engine_info the GPU's UUID as NVML names it (checked against nvidia-smi where present).

Runs under pytest (marker ``gpu``) or as a plain script that prints what it found:

    python tests/gpu/test_engines_gpu.py          # needs torch with CUDA; no fastapi, no pytest needed
"""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)
LIBRARY = os.path.join(REPO, "exporter", "instrument")  # gpuio, the instrumentation library, from this checkout
sys.path.insert(0, LIBRARY)
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, (LIBRARY, os.environ.get("PYTHONPATH"))))

try:
    import pytest
except ImportError:  # the GPU machine may have no pytest: the script runs without it
    pytest = None  # type: ignore[assignment]

MODEL_WIDTH = 4096  # one 4096 x 4096 float32 layer: a 64 MiB model file, enough for the read to show
BATCH = 32
THREADS = 4
REQUESTS = 50


def nvidia_smi_uuids() -> list[str]:
    if shutil.which("nvidia-smi") is None:
        return []
    output = subprocess.run(["nvidia-smi", "--query-gpu=uuid", "--format=csv,noheader"], capture_output=True,
                            text=True, check=False).stdout
    return [line.strip() for line in output.splitlines() if line.strip()]


def samples_of(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    from prometheus_client.parser import text_string_to_metric_families

    found = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return found


def run(work: str) -> dict[str, Any]:
    import torch

    import gpuio
    from exporter.context import Context
    from exporter.exposition import render
    from gpuio.gpu import TorchEventTimer

    assert torch.cuda.is_available(), "no CUDA device"
    device = torch.device("cuda:0")
    spool = os.path.join(work, "spool")
    os.makedirs(spool, exist_ok=True)
    gpuio.configure(spool)

    # The "engine": a TorchScript model in a file, evicted from the page cache so the load reads the disk.
    model = torch.nn.Sequential(torch.nn.Linear(MODEL_WIDTH, MODEL_WIDTH), torch.nn.ReLU(),
                                torch.nn.Linear(MODEL_WIDTH, 16))
    path = os.path.join(work, "mlp.pt")
    torch.jit.save(torch.jit.script(model.eval()), path)
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)

    loaded = gpuio.load(path, lambda data: torch.jit.load(io.BytesIO(data), map_location=device), device=device)
    metrics = loaded.metrics

    class Replica:
        def __init__(self) -> None:
            self.model = loaded.model
            self.stream = torch.cuda.Stream(device)
            self.timer = TorchEventTimer(self.stream)

    def infer(replica: Replica, batch: torch.Tensor) -> torch.Tensor:
        with torch.no_grad(), torch.cuda.stream(replica.stream):
            return replica.model(batch)

    def warm(replica: Replica) -> None:
        infer(replica, torch.randn(BATCH, MODEL_WIDTH, device=device))
        replica.stream.synchronize()

    pool = gpuio.EnginePool(metrics, Replica, size=2, warmup=warm, warmup_iterations=3)
    inputs = torch.randn(BATCH, MODEL_WIDTH, device=device)
    torch.cuda.synchronize()

    def client() -> None:
        for _ in range(REQUESTS):
            with pool.acquire() as replica, metrics.infer(batch_size=BATCH, gpu_timer=replica.timer) as call:
                infer(replica, inputs)
                call.enqueued()
                replica.stream.synchronize()

    threads = [threading.Thread(target=client) for _ in range(THREADS)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    serving = time.perf_counter() - started

    from exporter.collectors import engines

    # the model lies in a temporary directory: the exporter opens writer-named files only inside these
    collector = engines.EnginesCollector(Context(), {"spool-dir": spool, "path-include": (work,)})
    collector.collect()
    collector.service.files.scanner.sample_now()
    text = render(collector.collect())
    found = samples_of(text)
    engine = frozenset({("engine", "mlp")})
    info = [dict(labels) for name, labels in found if name == "gpuio_engine_info"]
    requests = THREADS * REQUESTS
    result = {
        "gpu": torch.cuda.get_device_name(device),
        "model_bytes": os.path.getsize(path),
        "load_read_seconds": loaded.read_seconds,
        "load_deserialize_seconds": loaded.deserialize_seconds,
        "serving_seconds": serving,
        "info": info,
        "nvidia_smi_uuids": nvidia_smi_uuids(),
        "text": text,
        "samples": found,
    }
    assert found[("gpuio_engine_load_read_bytes_total", engine)] == os.path.getsize(path)
    assert found[("gpuio_engine_load_read_seconds_count", engine)] == 1
    assert found[("gpuio_engine_load_deserialize_seconds_count", engine)] == 1
    # Work-waiting families are per engine and GPU: this process recorded its GPU's UUID.
    per_gpu = frozenset({("engine", "mlp"), ("gpu_uuid", info[0]["gpu_uuid"] if info else "")})
    assert found[("gpuio_engine_inference_seconds_count", per_gpu)] == requests
    assert found[("gpuio_engine_inference_gpu_seconds_count", engine)] == requests
    assert 0 < found[("gpuio_engine_inference_gpu_seconds_sum", engine)] <= found[
        ("gpuio_engine_inference_seconds_sum", per_gpu)]
    assert found[("gpuio_engine_inference_batch_size_sum", engine)] == requests * BATCH
    assert found[("gpuio_engine_pool_contexts", per_gpu)] == 2
    assert found[("gpuio_engine_pool_idle_contexts", per_gpu)] == 2
    assert found[("gpuio_engine_pool_wait_seconds_count", per_gpu)] == requests
    assert found[("gpuio_engine_pool_wait_seconds_sum", per_gpu)] > 0  # 4 clients, 2 contexts
    assert found[("gpuio_engine_warmup_seconds_count", engine)] == 2
    assert found[("gpuio_engine_first_inference_seconds_count", engine)] == 2
    assert found[("gpuio_engine_file_cached_ratio", frozenset({("engine", "mlp"), ("path", path)}))] == 1.0
    assert len(info) == 1 and info[0]["cuda_device"] == "0" and info[0]["path"] == path
    assert info[0]["gpu_uuid"].startswith("GPU-"), info[0]
    if result["nvidia_smi_uuids"]:
        assert info[0]["gpu_uuid"] in result["nvidia_smi_uuids"]
    pool.close()
    return result


def report(result: dict[str, Any]) -> None:
    found = result["samples"]

    def mean(name: str) -> float:
        """Over every series of the engine: some families are per engine, the work-waiting ones per engine and GPU."""
        def total(suffix: str) -> float:
            return sum(value for (sample, labels), value in found.items()
                       if sample == f"{name}_{suffix}" and ("engine", "mlp") in labels)
        return total("sum") / max(1.0, total("count"))

    print(f"GPU: {result['gpu']}   engine info: {result['info']}")
    print(f"nvidia-smi UUIDs: {result['nvidia_smi_uuids']}")
    print(f"load: {result['model_bytes'] / 2**20:.0f} MiB read in {result['load_read_seconds'] * 1000:.1f} ms "
          f"(page cache dropped first), deserialized onto the GPU in "
          f"{result['load_deserialize_seconds'] * 1000:.1f} ms")
    print(f"serving: {THREADS} threads x {REQUESTS} requests in {result['serving_seconds']:.2f} s; mean latency "
          f"{mean('gpuio_engine_inference_seconds') * 1000:.2f} ms, GPU time "
          f"{mean('gpuio_engine_inference_gpu_seconds') * 1000:.2f} ms, pool wait "
          f"{mean('gpuio_engine_pool_wait_seconds') * 1000:.2f} ms")
    print(f"warm-up per context {mean('gpuio_engine_warmup_seconds') * 1000:.1f} ms; first inference "
          f"{mean('gpuio_engine_first_inference_seconds') * 1000:.2f} ms vs steady "
          f"{mean('gpuio_engine_inference_seconds') * 1000:.2f} ms")
    print("\n--- engines collector output (buckets left out) ---")
    sys.stdout.write("".join(line + "\n" for line in result["text"].splitlines() if "_bucket{" not in line))


if pytest is not None:
    pytestmark = pytest.mark.gpu

    def test_engine_on_the_gpu_through_loader_pool_and_collector(tmp_path) -> None:
        torch = pytest.importorskip("torch")
        if not torch.cuda.is_available():
            pytest.skip("no CUDA device here")
        report(run(str(tmp_path)))


if __name__ == "__main__":
    work_dir = tempfile.mkdtemp(prefix="gpuio-gpu-")
    try:
        report(run(work_dir))
        print("\nOK")
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)
